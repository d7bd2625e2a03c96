"""Adversarial review (round 4) of how the local tier's features combine: rollbacks, durability,
promotion, items and local retention. One process, 8 CPU devices (one test: a real 2-process job,
tests/tiers_interplay_job.py). Each test fails on the code it was written against and passes once the
finding its docstring names is fixed."""

import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
import storage_helpers as sh
from dispatch_io import policies
from test_manager_multiprocess import _finish
from test_multiprocess import child_env, free_port


def _state(mesh, value):
    return {"w": jax.device_put(np.full((64, 16), value, np.float32), NamedSharding(mesh, P("data", "model")))}


def _target(mesh):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(mesh, 0))


def _value(tree) -> float:
    values = np.unique(np.asarray(tree["w"]))
    assert values.size == 1, values
    return float(values[0])


def test_a_local_save_of_a_step_the_root_holds_from_another_history_is_not_passed_off_as_persisted(tmp_path, mesh):
    """Finding: after a rollback, a local-only save of a step number the root already holds (saved
    there by the abandoned history: force=True, a clock or preemption policy...) is accepted, and
    from then on the two tiers hold two different steps under one number. ``durability(4)`` says
    "persisted" although the local step 4 is not; ``restore(None, durability="persisted")`` picks
    step 4 and fills it from the *local* copy (the new history's values, 40) although the
    persistent step 4 holds 4; and ``item(4, "data")`` reads the root's item (the old history's):
    the state and the data-iterator state a resuming job gets come from two different saves.
    With several processes, or a local chunk that fails its CRC-32C, the regions without a usable
    local copy are read from the root, so one restored tree mixes the two histories region by
    region -- silently.

    Why it matters: ``durability="persisted"`` is the guarantee a job asks for before, e.g.,
    deleting its local directories or reporting a step as safe; the restore through the tiers
    assumes a step number names one state in both tiers (it plans a region from either).

    Fixed: a local save alone of a step at or before the root's newest is refused (ValueError, as
    a persistent save of it is: roll back by removing the root's newer steps first)."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}")
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        mgr.save(0, _state(mesh, 0), items={"data": dio.PerProcess({"history": "old", "pos": 0})}, force=True)
        mgr.save(4, _state(mesh, 4), items={"data": dio.PerProcess({"history": "old", "pos": 4})}, force=True)
        mgr.wait()
        mgr.restore(0, _target(mesh))  # a rollback: the job goes on from step 0
        for step in (2, 4):   # refused, as a persistent save would be: the root's step 4 is of the old history
            with pytest.raises(ValueError, match="root holds step 4, of the history before a rollback"):
                mgr.save(step, _state(mesh, 10 * step), items={"data": dio.PerProcess({"history": "new"})},
                         local=True)
        assert mgr.local.steps() == [] and mgr.durability(4) == "persisted"
        persisted = _value(mgr.restore(4, _target(mesh)))   # the root's step 4
        assert persisted == 4.0
        restored = mgr.restore(None, _target(mesh), durability="persisted")
        step = mgr.last_tier_restore.step
        item = mgr.item(step, "data")
        # a "persisted" restore gives the persisted state, and its items come from the same save
        assert (step, _value(restored), item["history"]) == (4, persisted, "old"), (
            f"restore(durability='persisted') gave step {step} = {_value(restored)} (the root's step {step} is "
            f"{persisted}) with the item of the {item['history']!r} history")


def test_a_fresh_start_after_no_step_is_whole_takes_its_local_saves(tmp_path, mesh):
    """Finding: a manager starts its local save policy after the newest local step any process's
    directory holds (``check_apart``'s ``newest``), and only a *successful* restore moves that on
    (``LocalTiers.resume``). When the documented resume pattern (docs/manager.md "Local tier":
    ``restore(None, target)``, and on FileNotFoundError a fresh start at step 0) finds no step
    whole -- here the only local step, 8, has a chunk failing its CRC-32C (a RAM-disk bit flip;
    equally a process whose directory was lost, without replicas) -- the fresh run's local saves
    are silently skipped up to step 8: ``should_save`` answers False at 2, 4 and 6. Worse, the
    persistent save of step 0 deletes the stale local step 8 (``drop_from``), so the local tier is
    left empty, and a preemption at step 7 loses the whole run again (restore raises
    FileNotFoundError once more).

    Why it matters: the local tier exists to bound the work lost to a preemption; here it
    silently saves nothing for as many steps as the lost run had reached.

    A fix should start the local save policy afresh once the job does not resume the abandoned
    local steps: e.g. a restore through the tiers that finds nothing whole resets the last local
    step (the first save then deletes the stale ones, as after a rollback), or ``drop_from`` moves
    the last local step back to before the step it drops from."""
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=sharding)}

    def state(step):
        return {"w": jax.device_put(np.arange(256 * 64, dtype=np.float32).reshape(256, 64) + step, sharding)}
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2),
                         keep_policy=policies.LatestN(1))
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(100),
                               local=tier) as mgr:
        for step in range(1, 9):  # a first run, never persisted (its step 0 is not in this range)
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
        assert mgr.persistent_steps() == [] and mgr.local.steps() == [8]
    sh.flip_byte(sh.chunks(tmp_path / "local" / "0" / "8", "['w']")[(0, 0)], 0)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(100),
                               local=tier) as mgr:
        with pytest.raises(FileNotFoundError):
            mgr.restore(None, target)            # nothing whole: the documented fresh start at step 0
        saved = []
        for step in range(0, 8):                 # preempted at step 7
            if mgr.should_save(step):
                mgr.save(step, state(100 + step))
                saved.append(step)
        mgr.wait()
        assert saved == [0, 2, 4, 6], f"the fresh run saved only steps {saved} (local steps {mgr.local.steps()})"
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(100),
                               local=tier) as mgr:
        restored = mgr.restore(None, target)    # the restart resumes the fresh run's step 6
        assert mgr.last_tier_restore.step == 6
        assert np.asarray(restored["w"]).tobytes() == np.asarray(state(106)["w"]).tobytes()
    dispatcher.close()


def test_promote_after_a_rollback_does_not_persist_the_abandoned_history(tmp_path, mesh):
    """Finding: after a rollback (``restore(0, target)`` with local steps 2 and 4 of the history
    being abandoned), ``promote(4)`` persists the abandoned local step 4 into the root without a
    word, though docs/manager.md "Local tier" promises the abandoned local steps "are never
    restored over the new one". The job goes on from step 0 (its local save of step 2 deletes the
    abandoned local steps, as documented), yet after a crash ``restore(None, target)`` resumes the
    root's step 4 -- the abandoned history -- over the new history's step 2; and the new
    history's own persistent save of step 4 is then refused (FileExistsError).

    Why it matters: a promotion is how a job persists "the local step it has"; after a rollback
    (a loss spike, a bad batch) the step it would promote by habit is the one the rollback was
    meant to discard, and the mistake only shows after the next crash.

    A fix should refuse to promote a local step newer than the step the job resumed (the local
    tier's last step after ``resume``) with a ValueError naming the rollback (the steps belong to
    an abandoned history), or else treat the promotion as the first save of the resumed history."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}")
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        mgr.save(0, _state(mesh, 0), force=True)
        mgr.save(2, _state(mesh, 2), local=True)
        mgr.save(4, _state(mesh, 4), local=True)
        mgr.wait()
        mgr.restore(0, _target(mesh))           # the rollback: steps 2 and 4 are abandoned
        try:
            mgr.promote(4).wait()
        except ValueError:
            return                              # refused: the step is of the abandoned history
        mgr.save(2, _state(mesh, 20), local=True)   # the new history (its first save drops the old local steps)
        mgr.wait()
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        restored = mgr.restore(None, _target(mesh))
        assert (mgr.last_tier_restore.step, _value(restored)) == (2, 20.0), (
            f"the restart resumed step {mgr.last_tier_restore.step} = {_value(restored)}: the abandoned history")


def test_abandoned_local_steps_older_than_the_first_save_after_a_rollback_are_never_resumed(tmp_path, mesh):
    """Finding: ``drop_from`` deletes the abandoned local steps *from* the first save of the
    resumed history on, but not those between the step the job rolled back to and that save.
    Local steps 2 and 4 (history A), rollback to the root's step 0, first save of the new history
    B at step 3: A's step 4 goes, A's step 2 stays -- and is still a candidate of every restore
    through the tiers. When B's step 3 is unusable (a chunk failing its CRC-32C: a RAM-disk bit
    flip, or a lost directory), the restore resumes A's step 2 instead of B's own step 0 from the
    root: the rollback is silently undone. (The same with ``durability="replicated"`` skipping a
    step 3 of one copy.)

    Why it matters: docs/manager.md "Local tier" promises the abandoned history's local steps
    "are never restored over the new one".

    A fix should delete, at the first save of the resumed history, every local step newer than the
    step resumed (not only those from the saved step on), or remember the resumed step so that a
    restore never picks a local step of the abandoned history."""
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct((64, 16), np.float32, sharding=sharding)}

    def state(value):
        return {"w": jax.device_put(np.full((64, 16), value, np.float32), sharding)}
    tier = dio.LocalTier(tmp_path / "local" / "{process}")
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(100),
                               local=tier) as mgr:
        mgr.save(0, state(0), force=True)
        mgr.save(2, state(2), local=True)       # history A
        mgr.save(4, state(4), local=True)
        mgr.wait()
        mgr.restore(0, target)                  # the rollback
        mgr.save(3, state(30), local=True)      # history B's first save
        mgr.wait()
    sh.flip_byte(sh.chunks(tmp_path / "local" / "0" / "3", "['w']")[(0, 0)], 0)   # B's step 3 is lost
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(100),
                               local=tier) as mgr:
        restored = mgr.restore(None, target)
        assert (mgr.last_tier_restore.step, float(np.asarray(restored["w"]).max())) == (0, 0.0), (
            f"resumed step {mgr.last_tier_restore.step} = {float(np.asarray(restored['w']).max())} of the "
            "abandoned history (local steps before the rollback's first save survive it)")
    dispatcher.close()


def test_a_bad_chunk_in_an_older_local_step_is_replaced_by_the_next_source(tmp_path, mesh):
    """Finding: before planning, a restore through the tiers checks only the *newest* local step
    against its CRC-32Cs (``TierRestore._held`` / ``_intact``); the others are checked as they are
    read (``local_verify``), and a bad chunk there raises CorruptCheckpointError out of the restore.
    So when the newest local step is unusable (here a bit flip; equally: not whole after a lost
    process) and the step the plan falls back to has a bad chunk too, the restore fails -- though
    the root holds that very step (step 2, persisted) and an older one (step 0). docs/manager.md
    "Local tier": "Local copies saved with checksums are always checked: a bad one is replaced by
    the next source"; README: "every local chunk is CRC-checked on the way back". (docs/design.md
    "Tiers" does state the raise for an older step: the docs disagree, and the user-facing ones
    promise the fallback.)

    Why it matters: RAM-disk damage tends to hit several steps at once (a bad DIMM, a filled
    tmpfs); a job that could resume from persistent storage cannot restart at all.

    A fix should check the regions of the step the plan picks before reading it (dropping bad
    ones and planning again, as for the newest), or fall back to the next source when the local
    pass finds a bad chunk."""
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct((64, 16), np.float32, sharding=sharding)}

    def state(value):
        return {"w": jax.device_put(np.full((64, 16), value, np.float32), sharding)}
    tier = dio.LocalTier(tmp_path / "local" / "{process}")
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(100),
                               local=tier) as mgr:
        mgr.save(0, state(0), force=True)
        mgr.save(2, state(2), local=True, force=True)   # in both tiers
        mgr.save(4, state(4), local=True)               # local only
        mgr.wait()
    for step in (2, 4):
        sh.flip_byte(sh.chunks(tmp_path / "local" / "0" / str(step), "['w']")[(0, 0)], 0)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(100),
                               local=tier) as mgr:
        restored = mgr.restore(None, target)           # CorruptCheckpointError: local step 2's bad chunk
        step = mgr.last_tier_restore.step
        assert step in (0, 2) and np.array_equal(np.asarray(restored["w"]), np.full((64, 16), step, np.float32))
    dispatcher.close()


@pytest.mark.parametrize("keep_without_metric", [True, False])
def test_a_local_best_n_keep_policy_sees_the_metrics_local_steps_carry(tmp_path, mesh, keep_without_metric):
    """Finding: local steps carry the step's metrics (``save(..., metrics=)``, in each local step's
    info: docs/manager.md "Items in local steps"), and ``LocalTier(keep_policy=...)`` takes any keep
    policy, ``BestN`` included -- but the local retention (``LocalTiers._finish``) builds its
    ``StepRecord``s without the metrics. So ``BestN(1, metric="loss")`` on the local tier sees no
    step scored: with ``keep_without_metric=True`` (the default) it never deletes anything (the RAM
    disk fills up), with ``False`` it deletes the best step at once, keeping only the latest.

    Why it matters: a local keep policy bounds RAM-disk use; BestN is accepted silently and does
    the opposite of what it says.

    A fix should pass each local step's recorded metrics to the keep policy (as the persistent
    retention does from the step info), or refuse a metric-reading keep policy for the local tier."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}",
                         keep_policy=policies.BestN(1, metric="loss", keep_without_metric=keep_without_metric))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        for step, loss in ((2, 0.1), (4, 0.9), (6, 0.5)):
            mgr.save(step, _state(mesh, step), metrics={"loss": loss}, local=True)
        mgr.wait()
        assert mgr.local.infos()[0][6]["metrics"] == {"loss": 0.5}   # the metrics are recorded...
        assert mgr.local.steps() == [2, 6]                          # ...the best and the latest kept


def test_local_retention_keeps_the_same_steps_on_every_process(tmp_path):
    """Finding: each process applies the local keep policy to its own local steps' commit times
    (``LocalTiers._finish``: ``StepRecord(step, info["committed"])`` of its own info), with no
    agreement. A time-reading keep policy (``EveryNSeconds``: the first step committed in each
    window) then keeps different steps on different processes wherever one step's commits straddle
    a window boundary -- here commit times 2 s apart (one process's save a little slower, or clocks
    a little off): process 0 keeps steps [0, 2, 12], process 1 [0, 10, 12]. Steps 2 and 10 are not
    whole in the job any more (each process deleted its part of the other's), so the older restore
    points the policy was meant to keep are lost, while each process still spends RAM disk on a step
    nobody can restore. (Local *save* decisions are agreed -- process 0 decides for a clock-reading
    policy with replicas --; local retention is not.)

    Why it matters: a local step is only useful whole; the keep policy's promise ("one step per
    window") holds per process, not per job.

    A fix should make local retention decide alike on every process: e.g. use one commit time per
    step for the whole job (process 0's, shared as save decisions are, or the step's ``started``
    time, identical everywhere), or let process 0 decide which local steps everyone keeps."""
    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiers_interplay_job.py")
    env, port = child_env(1, None), free_port()
    procs = [subprocess.Popen([sys.executable, job, str(i), str(port), str(tmp_path / "root"),
                               str(tmp_path / "local" / "{process}")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = _finish(procs)
    kept = [re.search(r"^local steps (\[.*\])$", out, re.M)[1] for out in outs]
    assert kept[0] == kept[1], f"local steps kept by process 0: {kept[0]}, by process 1: {kept[1]}"
    # Fixed (issue 35): each step's one time is process 0's clock at its save (1000 + 10 step - 1), shared:
    # the first step of each 100 s window (999 -> 0, 1019 -> 2, 1119 -> 12), and the newest, on both.
    assert kept[0] == "[0, 2, 12]", kept


def test_one_restored_array_never_mixes_two_histories_of_a_step(tmp_path, mesh):
    """Finding (the first one's worst case): with the root's step 4 from the abandoned history and
    a local step 4 of the new one (a local-only save after a rollback, accepted), one local chunk
    failing its CRC-32C makes the restore through the tiers read that region from the root's step 4
    and the rest from the local copy: a single array comes back with values of both histories
    (here 4.0 and 40.0), silently -- the CRC-32C check that was meant to protect it does the mixing.

    Fixed as the first finding: the local save is refused, so no local step 4 exists to mix."""
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct((64, 16), np.float32, sharding=sharding)}

    def state(value):
        return {"w": jax.device_put(np.full((64, 16), value, np.float32), sharding)}
    tier = dio.LocalTier(tmp_path / "local" / "{process}")
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(100),
                               local=tier) as mgr:
        mgr.save(0, state(0), force=True)
        mgr.save(4, state(4), force=True)
        mgr.wait()
        mgr.restore(0, target)                  # the rollback
        with pytest.raises(ValueError, match="root holds step 4"):
            mgr.save(4, state(40), local=True)  # refused: the tiers never disagree on step 4
        mgr.wait()
    assert not (tmp_path / "local" / "0" / "4").exists()
    dispatcher.close()
