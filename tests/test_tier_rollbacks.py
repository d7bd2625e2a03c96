"""The local tier across histories (one process, 8 CPU devices): a rollback (explicit, with or
without names, or a step saved again) abandons the newer local steps, a new run reusing a local
path resumes the old one, a restore onto another mesh or sharding keeps or drops local steps alike
everywhere, and a local step is never passed off as a root step of another history."""

import functools
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
import storage_helpers as sh
from conftest import asked_tiers, filled, filled_target, one_leaf, same_leaf, train, train_one_leaf, value_of
from dispatch_io import policies


def test_a_local_save_of_a_rolled_back_history_replaces_the_abandoned_local_steps(tmp_path, mesh):
    """A restore onto another sharding changes nothing. restore(0) onto the training sharding after
    local steps 2..6: nothing is deleted by the restore (an inspection may follow), local saves go
    on after 0, and the new history's first save (step 1, persistent) deletes local steps 2..6."""
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=sharding)}
    other = {"w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=NamedSharding(mesh, P()))}

    def state(step):
        return {"w": jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8) + step, sharding)}

    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        for step in (0, 2, 4, 6):
            mgr.save(step, state(step), local=True)                                # 0 persisted too
        mgr.wait()
        assert mgr.persistent_steps() == [0]
        mgr.restore(None, other)
        assert mgr.local.steps() == [0, 2, 4, 6] and not mgr.should_save(4)     # an eval copy: nothing changes
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        mgr.restore(0, target)
        assert mgr.local.steps() == [0, 2, 4, 6] and mgr.should_save(2)
        with pytest.raises(TypeError, match="bogus"):
            mgr.save(3, state(3), bogus=1)                                        # checked, though nothing is saved
        assert mgr.local.steps() == [0, 2, 4, 6]
        mgr.save(1, state(1), force=True)                                         # the new history's first save
        mgr.wait()
        assert mgr.local.steps() == [0] and mgr.should_save(2)


def test_a_tiered_restore_after_an_explicit_rollback_resumes_the_new_history(tmp_path, mesh):
    """Train 0..8 (local every 2, persistent every 4); roll back explicitly to step 4 (restore(4)),
    deleting the persistent steps after it; train a new history 5..9 (state + 100): a restart through
    the tiers resumes the new history, never the abandoned history's local step 8."""
    target, state = one_leaf(mesh)

    def state_b(step):
        return jax.tree.map(lambda x: x + 100, state(step))
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    train(tmp_path / "root", tier, state, steps=9, persist_every=4)
    shutil.rmtree(tmp_path / "root" / "8")
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        mgr.restore(4, target)
        saved = []
        for step in range(5, 10):
            if mgr.should_save(step):
                mgr.save(step, state_b(step))
                saved.append(step)
        mgr.wait()
        skipped = f"local saves of the new history: {saved}, local steps {mgr.local.steps()}"
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        restored = mgr.restore(None, target)
        step = mgr.last_tier_restore.step
        assert same_leaf(restored, state_b(step)), f"step {step} restored from the abandoned history ({skipped})"


def test_explicit_rollback_with_names_resumes_like_without(tmp_path, mesh):
    """``restore(4, target, names=...)`` (an explicit rollback onto the training sharding, the target's
    leaves named differently from the saved ones) counts as resuming step 4 exactly as without names=:
    the target's key paths are mapped through names= before they are compared with the local step's
    regions (recorded by saved key path). docs/manager.md: a restore that resumes an older step "lets
    local saves go on after it, and the first save ... then deletes the local steps from that step on" --
    so local saves of steps 5..8 go on, and the first save of step 8 replaces the abandoned local step 8
    (a restart must never resume it over the new history)."""
    target, state = one_leaf(mesh)
    renamed = {"weights": target["w"]}
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    train(tmp_path / "root", tier, state, steps=9, persist_every=4)
    shutil.rmtree(tmp_path / "root" / "8")
    answers = {}
    for how, args in {"plain": (target, {}), "names=": (renamed, {"names": lambda path: "w"})}.items():
        with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
            restored = mgr.restore(4, args[0], **args[1])
            assert np.asarray(jax.tree.leaves(restored)[0]).tobytes() == np.asarray(state(4)["w"]).tobytes()
            answers[how] = [step for step in range(5, 10) if mgr.local.should_save(step)]
    assert answers["names="] == answers["plain"], f"local saves after the rollback to 4: {answers}"


def test_abandoned_local_steps_older_than_the_first_save_after_a_rollback_are_never_resumed(tmp_path, mesh):
    """Local steps 2 and 4 (history A), rollback to the root's step 0, first save of the new history B at
    step 3: every local step of A newer than the step resumed goes, not only those from the saved step
    on. When B's step 3 is unusable (a chunk failing its CRC-32C: a RAM-disk bit flip, or a lost
    directory), the restore resumes B's own step 0 from the root, never A's step 2: the rollback is not
    silently undone. (The same with ``durability="replicated"`` skipping a step 3 of one copy.)

    Why it matters: docs/manager.md "Local tier" promises the abandoned history's local steps "are never
    restored over the new one"."""
    target, state = filled_target(mesh), functools.partial(filled, mesh)
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True)
    with asked_tiers(tmp_path, dispatcher) as mgr:
        mgr.save(0, state(0), force=True)
        mgr.save(2, state(2), local=True)       # history A
        mgr.save(4, state(4), local=True)
        mgr.wait()
        mgr.restore(0, target)                  # the rollback
        mgr.save(3, state(30), local=True)      # history B's first save
        mgr.wait()
    sh.flip_byte(sh.chunks(tmp_path / "local" / "0" / "3", "['w']")[(0, 0)], 0)   # B's step 3 is lost
    with asked_tiers(tmp_path, dispatcher) as mgr:
        restored = mgr.restore(None, target)
        assert (mgr.last_tier_restore.step, float(np.asarray(restored["w"]).max())) == (0, 0.0), (
            f"resumed step {mgr.last_tier_restore.step} = {float(np.asarray(restored['w']).max())} of the "
            "abandoned history (local steps before the rollback's first save survive it)")
    dispatcher.close()


def test_a_local_save_of_a_step_the_root_holds_from_another_history_is_not_passed_off_as_persisted(tmp_path, mesh):
    """After a rollback, a local-only save of a step number the root already holds (saved there by the
    abandoned history: force=True, a clock or preemption policy...) is refused (ValueError, as a
    persistent save of it is: roll back by removing the root's newer steps first). Accepted, the two
    tiers would hold two different steps under one number: ``durability(4)`` would say "persisted" of a
    local step that is not, ``restore(None, durability="persisted")`` would fill step 4 from the local
    copy (the new history's 40) while ``item(4, "data")`` read the root's (the old history's), and
    regions without a usable local copy would come from the root -- one tree mixing two histories.

    Why it matters: ``durability="persisted"`` is the guarantee a job asks for before, e.g., deleting its
    local directories or reporting a step as safe; a restore through the tiers assumes a step number
    names one state in both tiers (it plans a region from either)."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}")
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        mgr.save(0, filled(mesh, 0), items={"data": dio.PerProcess({"history": "old", "pos": 0})}, force=True)
        mgr.save(4, filled(mesh, 4), items={"data": dio.PerProcess({"history": "old", "pos": 4})}, force=True)
        mgr.wait()
        mgr.restore(0, filled_target(mesh))  # a rollback: the job goes on from step 0
        for step in (2, 4):   # refused, as a persistent save would be: the root's step 4 is of the old history
            with pytest.raises(ValueError, match="root holds step 4, of the history before a rollback"):
                mgr.save(step, filled(mesh, 10 * step), items={"data": dio.PerProcess({"history": "new"})},
                         local=True)
        assert mgr.local.steps() == [] and mgr.durability(4) == "persisted"
        persisted = value_of(mgr.restore(4, filled_target(mesh)))   # the root's step 4
        assert persisted == 4.0
        restored = mgr.restore(None, filled_target(mesh), durability="persisted")
        step = mgr.last_tier_restore.step
        item = mgr.item(step, "data")
        # a "persisted" restore gives the persisted state, and its items come from the same save
        assert (step, value_of(restored), item["history"]) == (4, persisted, "old"), (
            f"restore(durability='persisted') gave step {step} = {value_of(restored)} (the root's step {step} is "
            f"{persisted}) with the item of the {item['history']!r} history")


def test_a_fresh_start_after_no_step_is_whole_takes_its_local_saves(tmp_path, mesh):
    """When the documented resume pattern (docs/manager.md "Local tier": ``restore(None, target)``, and on
    FileNotFoundError a fresh start at step 0) finds no step whole -- here the only local step, 8, has a
    chunk failing its CRC-32C (a RAM-disk bit flip; equally a process whose directory was lost, without
    replicas) -- the fresh run's local save policy starts afresh: ``should_save`` answers True at 2, 4 and
    6 (not only after the stale step 8), the first save deletes the stale local step, and a preemption at
    step 7 resumes from the fresh run's local steps.

    Why it matters: the local tier exists to bound the work lost to a preemption; it must not save
    nothing for as many steps as the lost run had reached."""
    target, state = one_leaf(mesh)
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


def test_a_new_run_reusing_the_local_path_resumes_the_old_run(tmp_path, mesh):
    """Run A (root a) leaves local steps up to 8 in a /dev/shm-like path; run B, a new root, reuses the
    same local path for steps 0..4: a restore of run B resumes a step of run B (its values + 100), never
    run A's step 8 from the local directory it left behind."""
    target, state = one_leaf(mesh)
    local = tmp_path / "local" / "{process}"
    train_one_leaf(tmp_path / "a", local, mesh)
    saved, steps = train_one_leaf(tmp_path / "b", local, mesh, steps=5, offset=100)
    tier = dio.LocalTier(local, save_policy=policies.EveryNSteps(2))
    with dio.CheckpointManager(tmp_path / "b", save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        restored = mgr.restore(None, target)
        step = mgr.last_tier_restore.step
        assert same_leaf(restored, jax.tree.map(lambda x: x + 100, state(step))), \
            f"run B restored step {step} of run A (run B saved {saved}, local steps {steps})"


def test_a_restore_onto_another_sharding_does_not_delete_newer_local_steps(tmp_path, mesh):
    """Local step 8 is whole, persistent 6 is the newest root step. A restore onto another sharding (an
    eval copy, replicated) resumes nothing, so it leaves local step 8 in place (not "an abandoned
    history"), and the training job's next restore through the tiers resumes step 8."""
    target, state = one_leaf(mesh)
    local = tmp_path / "local" / "{process}"
    train_one_leaf(tmp_path / "root", local, mesh)
    tier = dio.LocalTier(local, save_policy=policies.EveryNSteps(2))
    replicated = {"w": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=NamedSharding(mesh, P()))}
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        mgr.restore(None, replicated)
        other = mgr.last_tier_restore.step
        assert 8 in mgr.local.steps(), f"a restore onto another sharding (step {other}) deleted local steps: " \
                                       f"{mgr.local.steps()} left"
        mgr.restore(None, target)
        assert mgr.last_tier_restore.step == 8


def test_a_job_resumed_on_another_mesh_never_mixes_in_the_abandoned_local_step(tmp_path, mesh):
    """A restore through the tiers onto another mesh that resumes training there (the restart on another
    mesh docs/design.md "Onto another mesh" supports) makes the newer local steps unusable, as one on the
    training layout does. Train on mesh A (local steps 0..8, persistent 0, 4, 8; the persistent save of 8
    killed before its commit); restart on mesh B with ``restore(None, target_b, durability="persisted")``:
    step 4. The new history's local saves of 6 and 8 go on, its persistent save of 8 replaces the
    abandoned local step 8, and the next restart's restore of step 8 reads the new history's values,
    never the abandoned local copy."""
    target, state = one_leaf(mesh)
    mesh_b = jax.make_mesh((2, 4), ("data", "model"))
    sharding_b = NamedSharding(mesh_b, P("data", "model"))
    target_b = {"w": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=sharding_b)}
    base = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    train(tmp_path / "root", tier, state, steps=9, persist_every=4)
    shutil.rmtree(tmp_path / "root" / "8")   # its persistent save killed before its commit
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        mgr.restore(None, target_b, durability="persisted")
        assert mgr.last_tier_restore.step == 4
        saved = []
        for step in range(5, 10):      # the new history, on mesh B: + 100
            if mgr.should_save(step):
                mgr.save(step, {"w": jax.device_put(base + step + 100, sharding_b)})
                saved.append(step)
        mgr.wait()
        info = f"saves of the new history: {saved}, local steps {mgr.local.steps()}"
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        restored = mgr.restore(None, target_b)
        step = mgr.last_tier_restore.step
        assert np.asarray(restored["w"]).tobytes() == (base + step + 100).tobytes(), \
            f"step {step} restored from the abandoned history ({info})"


def test_restore_of_a_named_step_onto_another_mesh_resumes_alike_in_every_process(tmp_path, mesh):
    """After ``restore(step, target)`` of a named step onto another sharding (the job restarted on another
    mesh resumes step 4 there; or an eval copy), whether it resumed is the job's decision, not each
    process's: a process whose local directory is gone answers ``should_save`` as its peers that still
    have their steps do. Processes that disagreed would take different local saves -- with replicas a
    ``replicas.send`` collective (and a ``SharedDecisions`` round) only some processes enter (a hang),
    without them a local step on one process only."""
    target, state = one_leaf(mesh)
    eval_sharding = NamedSharding(jax.make_mesh((2, 4), ("data", "model")), P("data", "model"))
    eval_target = {"w": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=eval_sharding)}
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    train(tmp_path / "root", tier, state, steps=9, persist_every=4)
    answers = {}
    for lost in (False, True):
        with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
            if lost:   # the disk of this process is gone (its peers keep theirs)
                for entry in (tmp_path / "local" / "0").iterdir():
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            mgr.restore(4, eval_target)   # step 4 onto another mesh
            answers[lost] = [step for step in range(5, 10) if mgr.local.should_save(step)]
    assert answers[True] == answers[False], f"local saves after restoring 4 onto another mesh: with its steps {answers[False]}, " \
                                            f"without them {answers[True]}"


def test_a_restore_onto_a_target_no_step_fits_deletes_no_older_local_step(tmp_path, mesh):
    """A restore whose target no step holds (here: a key path never saved -- the caller's mistake)
    raises FileNotFoundError, and the job goes on as a fresh start -- but the next save (of step 8, as
    a loop that carries on would make) deletes only what it replaces, not the older local steps 2 and 4
    the job never left: a corrected restore still resumes step 4. Before, the first save after it
    deleted every local step."""
    target, state = one_leaf(mesh)
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        for step in (2, 4):
            mgr.save(step, state(step))
        mgr.wait()
        with pytest.raises(FileNotFoundError):
            mgr.restore(None, {"not_saved": target["w"]})
        mgr.save(8, state(8))
        mgr.wait()
        assert mgr.local.steps() == [2, 4, 8], mgr.local.steps()
        restored = mgr.restore(4, target)
        assert same_leaf(restored, state(4))
