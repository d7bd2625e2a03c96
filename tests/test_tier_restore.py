"""Restore through the tiers (one process, 8 CPU devices): each region from its own local copy,
else the next source (another copy, the root); damaged, torn, malformed or unrecorded local steps
lost, not fatal; each byte of a local copy read once; the one training loop listing and restoring
steps of either tier; the same keywords as a plain restore; never two histories of a step in one
array. Every restore is compared byte for byte."""

import contextlib
import functools
import json
import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io.storage import sealed
import storage_helpers as sh
from conftest import asked_tiers, filled, filled_target, one_leaf, same_leaf, train, train_one_leaf
from dispatch_io import policies


SHAPE = (1024, 2048)                      # float32: 8 MiB, 8 regions of 1 MiB (mesh data=4, model=2)
TOTAL = SHAPE[0] * SHAPE[1] * 4
REGION = TOTAL // 8


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["rchar"])


def _restore(mgr, step, target):
    before = _rchar()
    restored = mgr.restore(step, target)
    return restored, _rchar() - before


def _train_0_2_4(tmp_path, state):
    """Local steps 0, 2, 4 (every 2), persistent steps 0, 3 (every 3); returns the manager's arguments."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        for step in range(5):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
        assert mgr.local.steps() == [0, 2, 4] and mgr.persistent_steps() == [0, 3]
    return tier


def _edit_local_info(tmp_path, step, edit):
    path = tmp_path / "local" / "0" / str(step) / "info.json"
    info = sealed.loads(path.read_text())   # edited: written back unsealed, as by hand
    edit(info)
    path.write_text(json.dumps(info))


def test_one_process_saves_locally_between_persistent_steps_and_restores_from_either(tmp_path, mesh):
    """One process (8 devices): local steps hold every region once; a wiped local tier -> the root.
    A manager without ``local=`` sees only the persistent steps, as before."""
    sharding, replicated = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P())
    target = {"w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=sharding),
              "r": jax.ShapeDtypeStruct((64,), np.int32, sharding=replicated)}

    def state(step):
        return {"w": jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8) + step, sharding),
                "r": jax.device_put(np.arange(64, dtype=np.int32) * step, replicated)}

    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0)   # leaves stored by region, not whole
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        for step in range(5):
            assert mgr.should_save(step) == (step % 2 == 0 or step % 3 == 0)
            mgr.save(step, state(step))
        mgr.wait()
        assert mgr.local.steps() == [0, 2, 4] and mgr.persistent_steps() == [0, 3]
        assert mgr.all_steps() == [0, 2, 3, 4] and mgr.latest_step() == 4   # restorable whole, from either tier
        # r is on all 8 devices: its one region is stored once (w: one chunk per device's region)
        assert len(sh.chunks(tmp_path / "local" / "0" / "4", "['r']")) == 1
        assert len(sh.chunks(tmp_path / "local" / "0" / "4", "['w']")) == 8
        restored = mgr.restore(None, target)
        stats = mgr.last_tier_restore
        assert (stats.step, stats.bytes_read_local, stats.bytes_read_persistent) == (4, 512 + 256, 0), stats
        assert all(np.array_equal(np.asarray(restored[k]), np.asarray(state(4)[k])) for k in target)
        # One process: one copy of each region -- "local"; a restore that requires more picks step 3.
        assert [mgr.durability(s) for s in (0, 2, 3, 4, 5)] == ["persisted", "local", "persisted", "local", None]
        assert mgr.step_info(3).durability == "persisted"
        restored = mgr.restore(None, target, durability="replicated")
        assert mgr.last_tier_restore.step == 3 and np.array_equal(np.asarray(restored["w"]), np.asarray(state(3)["w"]))
        with pytest.raises(ValueError, match="durability='safe'"):
            mgr.restore(None, target, durability="safe")
    shutil.rmtree(tmp_path / "local" / "0")
    with dio.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        restored = mgr.restore(None, target)
        stats = mgr.last_tier_restore
        assert (stats.step, stats.bytes_read_local, stats.bytes_read_persistent) == (3, 0, 512 + 256), stats
        assert all(np.array_equal(np.asarray(restored[k]), np.asarray(state(3)[k])) for k in target)
    dispatcher.close()
    with dio.CheckpointManager(tmp_path / "root") as mgr:
        assert mgr.latest_step() == 3 and mgr.local is None
    with dio.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        with pytest.raises(ValueError, match="needs a target"):
            mgr.restore(None)
        assert mgr.restore(3)["w"].shape == (16, 8)                     # a step named: the root, as before
    shutil.rmtree(tmp_path / "root")
    with dio.CheckpointManager(tmp_path / "root", local=tier) as mgr, pytest.raises(FileNotFoundError):
        mgr.restore(None, target)


def test_one_process_lists_and_restores_steps_of_either_tier(tmp_path, mesh):
    target, state = one_leaf(mesh)
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    d = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True)
    with dio.CheckpointManager(tmp_path / "root", d, save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        for step in range(5):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
        assert mgr.persistent_steps() == [0, 3] and mgr.all_steps() == [0, 2, 3, 4] and mgr.latest_step() == 4
        assert mgr.steps() == {0: "persisted", 2: "local", 3: "persisted", 4: "local"}   # one process: one copy
        assert [mgr.durability(s) for s in mgr.all_steps()] == list(mgr.steps().values())
        for step in (2, 3, 4):     # a local-only step, a persistent one (read from the local copy), the newest
            assert same_leaf(mgr.restore(step, target), state(step)), step
            stats = mgr.last_tier_restore
            assert (stats.step, stats.bytes_read_persistent) == (step, 0 if step != 3 else 256 * 64 * 4), stats
        with pytest.raises(FileNotFoundError, match="at step 1, neither"):
            mgr.restore(1, target)
        assert mgr.best_step("loss", "min") is None        # persistent steps only, as before
    shutil.rmtree(tmp_path / "local" / "0" / "4")   # the only copy of step 4 lost: not restorable whole
    with dio.CheckpointManager(tmp_path / "root", d, save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        assert mgr.all_steps() == [0, 2, 3] and mgr.latest_step() == 3
    d.close()


def test_a_restore_through_the_tiers_reads_each_byte_once_and_a_bad_region_alone_from_the_root(tmp_path, mesh):
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding)}

    def state(step):
        return {"w": jax.device_put(np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) * 3 + step, sharding)}
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    d = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True)
    with dio.CheckpointManager(tmp_path / "root", d, save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        for step in range(5):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
        expected = np.asarray(state(4)["w"]).tobytes()
        restored, read = _restore(mgr, 4, target)          # step 4: local and persistent; all from the local copy
        stats = mgr.last_tier_restore
        assert np.asarray(restored["w"]).tobytes() == expected
        assert (stats.bytes_read_local, stats.bytes_read_persistent) == (TOTAL, 0), stats
        assert 0.95 * TOTAL <= read <= 1.05 * TOTAL, read  # once, checksums checked (the lower bound: counted)
        # One flipped byte in the local copy of region 0: found as it is read, that region alone from the root,
        # verified there before it is read (a region bad in both is never restored unchecked): read twice
        sh.flip_byte(sh.chunks(tmp_path / "local" / "0" / "4", "['w']")[(0, 0)])
        restored, read = _restore(mgr, 4, target)
        stats = mgr.last_tier_restore
        assert np.asarray(restored["w"]).tobytes() == expected
        assert (stats.step, stats.persistent_regions) == (4, 1), stats
        assert (stats.bytes_read_local, stats.bytes_read_persistent) == (TOTAL, REGION), stats
        assert 0.95 * (TOTAL + 2 * REGION) <= read <= 1.05 * (TOTAL + 2 * REGION), read
    d.close()


def test_flipped_byte_in_local_copy_without_verify_is_detected(tmp_path, mesh):
    """Issue 28: "Every stored chunk's CRC-32C is checked on the way back; a bad local copy falls back to
    the next source". Local steps saved with checksums, one bit flipped in a RAM-disk chunk:
    restore(None, target) (verify defaults to False) never returns the flipped bytes -- it raises
    CorruptCheckpointError or restores a sound step bit-exact."""
    target, state = one_leaf(mesh)
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    d = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True)
    with dio.CheckpointManager(tmp_path / "root", d, save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        for step in range(5):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
        sh.flip_byte(sh.chunks(tmp_path / "local" / "0" / "4", "['w']")[(0, 0)], 0)
        try:
            restored = mgr.restore(None, target)
        except dio.CorruptCheckpointError:
            return
        assert same_leaf(restored, state(mgr.last_tier_restore.step)), "silently wrong bytes from a corrupt local copy"
    d.close()


def test_a_bad_chunk_in_an_older_local_step_is_replaced_by_the_next_source(tmp_path, mesh):
    """When the newest local step is unusable (here a bit flip; equally: not whole after a lost process)
    and the older local step the plan falls back to has a bad chunk too, the bad region comes from the
    next source -- the root holds that very step (2, persisted) -- and the restore is bit-exact, as
    docs/manager.md "Local tier" promises ("Local copies saved with checksums are always checked: a bad
    one is replaced by the next source"; README: "every local chunk is CRC-checked on the way back").
    Not only the newest local step is checked before planning.

    Why it matters: RAM-disk damage tends to hit several steps at once (a bad DIMM, a filled tmpfs); a
    job that can resume from persistent storage must be able to restart."""
    target, state = filled_target(mesh), functools.partial(filled, mesh)
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True)
    with asked_tiers(tmp_path, dispatcher) as mgr:
        mgr.save(0, state(0), force=True)
        mgr.save(2, state(2), local=True, force=True)   # in both tiers
        mgr.save(4, state(4), local=True)               # local only
        mgr.wait()
    for step in (2, 4):
        sh.flip_byte(sh.chunks(tmp_path / "local" / "0" / str(step), "['w']")[(0, 0)], 0)
    with asked_tiers(tmp_path, dispatcher) as mgr:
        restored = mgr.restore(None, target)           # CorruptCheckpointError: local step 2's bad chunk
        step = mgr.last_tier_restore.step
        assert step in (0, 2) and np.array_equal(np.asarray(restored["w"]), np.full((64, 16), step, np.float32))
    dispatcher.close()


def test_an_unreadable_newest_local_step_is_lost_not_fatal(tmp_path, mesh):
    """The newest local step's manifest torn (a full RAM disk): that copy is lost to the restore,
    as a wiped one is; the next source serves (here the older local step 2 or persistent 3)."""
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=sharding)}

    def state(step):
        return {"w": jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8) + step, sharding)}

    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    dispatcher = dio.LocalDispatcher(checksums=True)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        for step in range(5):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
        (tmp_path / "local" / "0" / "4" / "manifest.json").write_text('{"format": "dispatch_')
        restored = mgr.restore(None, target)
        step = mgr.last_tier_restore.step
        assert step == 3 and np.array_equal(np.asarray(restored["w"]), np.asarray(state(3)["w"]))
    dispatcher.close()


def test_garbage_local_info_names_the_file(tmp_path, mesh):
    """A local step whose info.json is garbage (a torn RAM-disk write) is a CheckpointError naming it (or
    the step is skipped), never a bare JSONDecodeError."""
    target, _ = one_leaf(mesh)
    local = tmp_path / "local" / "{process}"
    train_one_leaf(tmp_path / "root", local, mesh)
    (tmp_path / "local" / "0" / "8" / "info.json").write_text("{not json")
    tier = dio.LocalTier(local, save_policy=policies.EveryNSteps(2))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        try:
            mgr.restore(None, target)
        except dio.CheckpointError as exc:
            assert "8" in str(exc) and "info.json" in str(exc), exc


@pytest.mark.parametrize("held", [5, [["a"]], [None], [[[0, 1, 2]]]], ids=["int", "strings", "null", "triple"])


def test_a_local_step_with_malformed_held_regions_is_skipped_for_the_next_step(tmp_path, mesh, held):
    """A local step's info.json whose "held" is valid JSON but not a list of regions (a bit flip on a RAM
    disk, a hand edit, a future format) makes that step unreadable -- logged, not used, as an unreadable
    info.json is -- and restore(None, target) picks the next step, bit-exact, rather than raising a bare
    TypeError / ValueError from deep inside the planner. In a multi-process job every process plans on
    every report gathered, so one bad file on one host must not block the whole job's resume."""
    target, state = one_leaf(mesh)
    tier = _train_0_2_4(tmp_path, state)
    _edit_local_info(tmp_path, 4, lambda info: info.__setitem__("held", {"['w']": held}))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        restored = mgr.restore(None, target)
        step = mgr.last_tier_restore.step
        assert step in (2, 3), step        # step 4's copy is unusable: the next newest step serves
        assert np.asarray(restored["w"]).tobytes() == np.asarray(state(step)["w"]).tobytes()


def test_a_local_step_without_recorded_copies_is_skipped_by_a_default_restore(tmp_path, mesh):
    """restore(None, target) (durability="local": every usable local step, placement.eligible's doc) takes
    a local step whose info.json has no integer "copies" -- written before durability was recorded (a job
    restarted on an upgraded library), or malformed; it counts as 1 copy for "replicated". Here local step
    4 is resumed rather than the older persistent step 3: skipping it would silently lose training
    progress."""
    target, state = one_leaf(mesh)
    tier = _train_0_2_4(tmp_path, state)
    _edit_local_info(tmp_path, 4, lambda info: [info.pop(k, None) for k in ("copies", "domains", "durability")])
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        restored = mgr.restore(None, target)
        assert mgr.last_tier_restore.step == 4, mgr.last_tier_restore   # not 3 (the persistent step)
        assert np.asarray(restored["w"]).tobytes() == np.asarray(state(4)["w"]).tobytes()


@pytest.mark.parametrize("kwargs", [{"partial": True}, {"cast": True}])


def test_restore_through_the_tiers_takes_the_same_keywords_as_a_restore(tmp_path, mesh, kwargs):
    """CheckpointManager.restore takes the "same keywords as Dispatcher.restore" with a local tier too:
    restore(None, target, partial=True) (the params of a train state) or cast=True (another dtype)
    resumes the local step 4 bit-exact, as the root alone restores step 3."""
    _, state = one_leaf(mesh)
    sharding = NamedSharding(mesh, P("data", "model"))
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        for step in range(5):
            if mgr.should_save(step):
                mgr.save(step, {**state(step), "v": state(step)["w"] * 2})
        mgr.wait()
        dtype = jax.numpy.bfloat16 if kwargs.get("cast") else np.float32
        target = {"w": jax.ShapeDtypeStruct((256, 64), dtype, sharding=sharding)}
        if kwargs.get("cast"):
            target["v"] = jax.ShapeDtypeStruct((256, 64), dtype, sharding=sharding)
        root = mgr.restore(3, target, **kwargs)                   # the root alone: fine
        assert np.asarray(root["w"]).tobytes() == np.asarray(state(3)["w"], dtype).tobytes()
        restored = mgr.restore(None, target, **kwargs)
        assert mgr.last_tier_restore.step == 4
        assert np.asarray(restored["w"]).tobytes() == np.asarray(state(4)["w"], dtype).tobytes()


def test_a_restore_through_the_tiers_with_names_ignores_the_local_steps(tmp_path, mesh):
    """restore(None, target, names=...) (Dispatcher.restore's keyword: the target read under other names,
    e.g. a train state's params restored into {"params": {...}}) plans the target's leaves under their
    saved key paths, so local step 4, which holds every region, is resumed -- not the older persistent
    step 3 (or, with none, FileNotFoundError), as if no local step matched the target's own names."""
    _, state = one_leaf(mesh)
    tier = _train_0_2_4(tmp_path, state)
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"params": {"w": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=sharding)}}
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        from_root = mgr.restore(3, target, names=lambda path: "w")
        assert np.asarray(from_root["params"]["w"]).tobytes() == np.asarray(state(3)["w"]).tobytes()
        restored = mgr.restore(None, target, names=lambda path: "w")
        assert mgr.last_tier_restore.step == 4, mgr.last_tier_restore      # not 3: the local steps are used
        assert np.asarray(restored["params"]["w"]).tobytes() == np.asarray(state(4)["w"]).tobytes()


def test_a_tiered_restore_reads_an_orbax_step_with_a_step_prefix(tmp_path, mesh):
    """The manager lists Orbax steps named with a step_prefix (checkpoint_7) and restore(7) reads it;
    through the tiers (local tier empty) the persistent pass opens the same step, so restore(None,
    target) resumes step 7 -- not FileNotFoundError, which a loop takes for "no checkpoint" and starts
    from scratch."""
    import orbax.checkpoint as ocp
    target, state = one_leaf(mesh)
    orbax_mgr = ocp.CheckpointManager(str(tmp_path / "root"), options=ocp.CheckpointManagerOptions(
        step_prefix="checkpoint"))
    orbax_mgr.save(7, args=ocp.args.StandardSave(state(7)))
    orbax_mgr.wait_until_finished()
    orbax_mgr.close()
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        assert mgr.persistent_steps() == [7] and same_leaf(mgr.restore(7, target), state(7))
        restored = mgr.restore(None, target)
        assert mgr.last_tier_restore.step == 7 and same_leaf(restored, state(7))


def test_resuming_a_step_partly_read_from_persistent_storage_counts_as_resuming_it(tmp_path, mesh):
    """A restore that resumes a step partly from the root (both holders of some regions lost their disks)
    counts as resuming it, whatever the surviving copies report: here step 4 is restored with local
    step 8 present, and the first save of step 6 (either tier) drops local step 8 -- else the abandoned
    local step 8 would survive the next save of 8 and a later restore would mix two histories."""
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=sharding)}

    def state(step):
        return {"w": jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8) + step, sharding)}
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    train(tmp_path / "root", tier, state, steps=9, persist_every=4)
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        mgr.restore(None, target, durability="persisted")      # step 8 is persisted: resumed
        assert mgr.last_tier_restore.step == 8
        shutil.rmtree(tmp_path / "root" / "8")                 # a rollback to 4: the root's newer step goes
        mgr.restore(4, target)
        assert mgr.should_save(6) and not mgr.should_save(4)
        mgr.save(6, state(6 + 1000))
        mgr.wait()
        assert 8 not in mgr.local.steps(), mgr.local.steps()


def test_one_restored_array_never_mixes_two_histories_of_a_step(tmp_path, mesh):
    """With the root's step 4 from an abandoned history, the new history cannot save a local step 4 (the
    local save is refused, see tests/test_tier_rollbacks.py), so a local chunk failing its CRC-32C can
    never make the restore read that region from the root's step 4 and the rest from a local copy: one
    array never comes back with values of both histories (here 4.0 and 40.0)."""
    target, state = filled_target(mesh), functools.partial(filled, mesh)
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True)
    with asked_tiers(tmp_path, dispatcher) as mgr:
        mgr.save(0, state(0), force=True)
        mgr.save(4, state(4), force=True)
        mgr.wait()
        mgr.restore(0, target)                  # the rollback
        with pytest.raises(ValueError, match="root holds step 4"):
            mgr.save(4, state(40), local=True)  # refused: the tiers never disagree on step 4
        mgr.wait()
    assert not (tmp_path / "local" / "0" / "4").exists()
    dispatcher.close()


@contextlib.contextmanager
def _local_step_4_flipped(tmp_path, mesh, persist_every: int):
    """(manager, target, state) after steps 1..4 saved with checksums (local every 2 steps, persistent
    every ``persist_every``), one byte of the local copy of step 4 flipped."""
    target, state = one_leaf(mesh)
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.LocalDispatcher(small_leaf_bytes=0, checksums=True, progress=False) as d, \
            dio.CheckpointManager(tmp_path / "root", d, save_policy=policies.EveryNSteps(persist_every),
                                  local=tier) as mgr:
        for step in range(1, 5):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
        sh.flip_byte(sh.chunks(tmp_path / "local" / "0" / "4", "['w']")[(0, 0)], 0)
        yield mgr, target, state


def test_a_named_step_whose_only_copy_is_corrupt_says_so(tmp_path, mesh):
    """The loop ``restore(latest_step(), target)`` on a local-only step whose one copy has a flipped
    byte: no other source has the region, so it cannot be restored -- and the error says why (the
    copy of ['w'] failed its CRC-32C check), not only that no tier holds it; an older step is whole."""
    with _local_step_4_flipped(tmp_path, mesh, 100) as (mgr, target, state):
        assert mgr.persistent_steps() == [] and mgr.latest_step() == 4   # listed from what the copies record
        with pytest.raises(FileNotFoundError, match=r"at step 4, .*the local copies of \['w'\] at step 4 failed "
                                                    r"their CRC-32C check"):
            mgr.restore(4, target)
        assert same_leaf(mgr.restore(None, target), state(2)) and mgr.last_tier_restore.step == 2


@pytest.mark.parametrize("items", [[], {"c": []}, {"c": {"kind": "json", "crc32c": "yes"}},
                                   {"d": {"kind": "per_process", "processes": "x"}}],
                         ids=["list", "entry", "crc-flag", "count"])
def test_malformed_items_in_a_local_info_are_named_not_a_crash(tmp_path, items):
    """A local step's info.json whose "items" is not what a local save records (a bit flip on a RAM disk):
    reading an item of it is a CorruptCheckpointError naming the step's path (was an AttributeError, or a
    CRC-32C flag of "yes" silently not checked), as the root's step info is checked."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))

    def manager():
        return dio.CheckpointManager(tmp_path / "root", dio.LocalDispatcher(checksums=True, progress=False),
                                     save_policy=policies.EveryNSteps(100), local=tier)
    with manager() as mgr:
        mgr.save(2, {"x": np.arange(4)}, items={"c": dio.Json(1), "d": dio.PerProcess(b"x")})
        mgr.wait()
        assert mgr.item(2, "d") == b"x"
    path = tmp_path / "local" / "0" / "2" / "info.json"
    info = sealed.loads(path.read_text())
    path.write_text(json.dumps({**info, "items": items}))
    with manager() as mgr:
        for name in ("c", "d"):
            with pytest.raises(dio.CorruptCheckpointError, match=r"local/0/2: its info's items .*malformed checkpoint"):
                mgr.item(2, name)


def test_a_region_bad_in_every_source_is_an_error_not_silently_wrong(tmp_path, mesh):
    """Step 4 in both tiers, saved with checksums; the same chunk flipped in the local copy and in the
    root: the local region fails its CRC-32C and is filled again from the root -- which must be checked
    too (a CorruptCheckpointError naming the root's step), not taken unchecked (it returned the flipped
    float, verify off, for restore(4) and for restore(None) alike). With a sound root it is bit-exact."""
    with _local_step_4_flipped(tmp_path, mesh, 4) as (mgr, target, state):
        assert same_leaf(mgr.restore(4, target), state(4)) and mgr.last_tier_restore.persistent_regions == 1
        sh.flip_byte(sh.chunks(tmp_path / "root" / "4", "['w']")[(0, 0)], 0)
        for step in (4, None):
            with pytest.raises(dio.CorruptCheckpointError, match=r"root/4: 1 chunk\(s\) do not match their checksums"):
                mgr.restore(step, target)


def test_a_local_copy_missing_a_chunk_file_falls_back_like_a_corrupt_one(tmp_path, mesh):
    """Local step 6 (local only) loses one chunk file of its own region (a partly wiped RAM disk); step 4
    is persisted. As for a chunk that fails its CRC-32C, restore(None, target) must not use that copy:
    it resumes step 4, bit-exact, instead of raising WorkerError."""
    target, state = one_leaf(mesh)
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.LocalDispatcher(small_leaf_bytes=0, checksums=True, progress=False, layout="files") as d, \
            dio.CheckpointManager(tmp_path / "root", d, save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        for step in range(1, 7):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
        os.unlink(sh.chunks(tmp_path / "local" / "0" / "6", "['w']")[(0, 0)].file)
        restored = mgr.restore(None, target)
        assert mgr.last_tier_restore.step == 4 and same_leaf(restored, state(4))


def test_verify_checks_the_items_through_the_tiers_as_from_the_root(tmp_path, mesh):
    """restore(step, target, verify=True) checks the step's items against their CRC-32Cs without a local
    tier (steps.verify_items); through the tiers it did not: a flipped byte in an item of a persistent step,
    or of a local step's copy, restored without a word (verify=True silently narrower with local=)."""
    target, state = one_leaf(mesh)
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.LocalDispatcher(small_leaf_bytes=0, checksums=True, progress=False) as d, \
            dio.CheckpointManager(tmp_path / "root", d, save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        for step in (4, 6):
            mgr.save(step, state(step), items={"data": dio.PerProcess(bytes(range(64)) * 4)})
        mgr.wait()
        assert mgr.persistent_steps() == [4] and mgr.steps() == {4: "persisted", 6: "local"}
        for folder in (tmp_path / "root" / "4" / mgr.step_info(4).arrays, tmp_path / "local" / "0" / "6" / "arrays"):
            item = folder / "items" / "data" / "0.json"
            data = bytearray(item.read_bytes())
            data[data.index(b'"bytes": "') + 20] ^= 0x01   # still base64, one value different
            item.write_bytes(bytes(data))
        for step in (4, 6):
            assert same_leaf(mgr.restore(step, target), state(step))   # the state itself is sound
            with pytest.raises(dio.CorruptCheckpointError, match=rf"item 'data' \(process 0's value\) of step {step} "
                                                                 r"at .* does not match its CRC-32C"):
                mgr.restore(step, target, verify=True)
