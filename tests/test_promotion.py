"""Promotion of a local step to the root (``mgr.promote``, ``LocalTier(promote=True)``), and items
in local steps: one process, 8 CPU devices. Every restore is compared byte for byte with the state
saved; promoted chunks are compared raw (as stored, through the kvstores) with the local copy's; a
damaged or truncated local chunk is never promoted; a failed promotion leaves no step; a promotion
after a rollback persists only the live history."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
import storage_helpers as sh
from conftest import fail_batches_of, filled, filled_target, hooked_dispatcher, value_of
from dispatch_io import policies, tree as tree_lib
from dispatch_io.formats.detect import open_checkpoint
from dispatch_io.manager.tiers.promote_plan import items_of, plan_promotion
from dispatch_io.manifest import parse as parse_manifest
from dispatch_io.workers.layouts import NODE_CACHE


def _state(mesh, step):
    """Sharded, replicated, a PRNG key, a 0-d array, a numpy leaf and a Python scalar."""
    sharded, replicated = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P())
    return {"w": jax.device_put(np.arange(256 * 64, dtype=np.float32).reshape(256, 64) * (step + 1), sharded),
            "b": jax.device_put(np.arange(64, dtype=np.int32) - step, replicated),
            "k": jax.device_put(jax.random.key(step), replicated),
            "s": jax.device_put(np.float32(step), replicated),
            "h": np.arange(10, dtype=np.float64) + step, "n": step}


def _same(restored, expected):
    for key in ("w", "b", "s", "h"):
        assert np.asarray(restored[key]).tobytes() == np.asarray(expected[key]).tobytes(), key
    assert np.asarray(jax.random.key_data(restored["k"])).tobytes() == \
        np.asarray(jax.random.key_data(expected["k"])).tobytes()
    assert restored["n"] == expected["n"]


def _raw_chunks(path) -> dict[str, bytes]:
    """Every chunk key of the checkpoint's arrays -> its bytes as stored, read through TensorStore."""
    opened = open_checkpoint(os.fspath(path))
    store = ts.KvStore.open(opened.arrays, context=ts.Context(NODE_CACHE, parent=opened.context)).result()
    keys = [k for k in store.list().result() if re.fullmatch(rb"[0-9][^/]*/c(/[0-9]+)*", k)]
    return {k.decode(): store.read(k).result().value for k in keys}


KILLED = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import dispatch_io as dio
from dispatch_io.manager.tiers import promotion
tmp = sys.argv[1]
mesh = jax.make_mesh((4, 2), ("data", "model"))
w = jax.device_put(np.arange(256 * 64, dtype=np.float32).reshape(256, 64), NamedSharding(mesh, P("data", "model")))
dispatcher = dio.LocalDispatcher(host_memory_budget=16 << 10, small_leaf_bytes=0, checksums=True)
mgr = dio.CheckpointManager(tmp + "/root", dispatcher, local=dio.LocalTier(tmp + "/local/{process}"))
mgr.local.save(3, {"w": w}).wait()
real, calls = promotion.write_values, []


def write_values(*args):
    calls.append(1)
    if len(calls) == 3:       # two batches written, then SIGKILL: mid-promotion
        os.kill(os.getpid(), 9)
    return real(*args)
promotion.write_values = write_values
mgr.promote(3).wait()
print("not killed", flush=True)
"""


MEMORY = """
import gc, json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import dispatch_io as dio


def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

tmp, budget = sys.argv[1], int(sys.argv[2])
mesh = jax.make_mesh((4, 2), ("data", "model"))


def make(seed):
    block = lambda index: np.full(tuple(s.stop - s.start for s in index), seed, np.float32)
    return jax.make_array_from_callback((4096, 4096), NamedSharding(mesh, P("data", "model")), block)
dispatcher = dio.LocalDispatcher(host_memory_budget=budget, keep_staging_warm=False)
mgr = dio.CheckpointManager(tmp + "/root", dispatcher, local=dio.LocalTier(tmp + "/local/{process}"))
tree = {"a": make(1), "b": make(2)}                      # 128 MiB
mgr.local.save(5, tree).wait()
del tree
gc.collect()
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")            # VmHWM := VmRSS
stats = mgr.promote(5).wait()
print(json.dumps({"growth": status("VmHWM") - before, "written": stats.bytes_written}))
"""


def _two_leaves(mesh, step):
    sharded, replicated = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P())
    return {"w": jax.device_put(np.arange(256 * 64, dtype=np.float32).reshape(256, 64) * (step + 1), sharded),
            "b": jax.device_put(np.arange(64, dtype=np.int32) - step, replicated)}


def _same_two(restored, expected):
    for key in expected:
        assert np.asarray(restored[key]).tobytes() == np.asarray(expected[key]).tobytes(), key


@pytest.mark.parametrize("options", [dict(checksums=True), dict(compression="zstd", checksums=True, layout="files")],
                         ids=["ocdbt-crc", "files-zstd"])


def test_a_local_step_is_promoted_byte_for_byte_with_its_items(tmp_path, mesh, options):
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    dispatcher = dio.LocalDispatcher(host_memory_budget=64 << 10, small_leaf_bytes=0, **options)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(100),
                               local=tier) as mgr:
        for step in range(1, 5):
            if mgr.should_save(step):
                mgr.save(step, _state(mesh, step), items={"data": dio.PerProcess(b"\x00it" + bytes([step])),
                                                          "cfg": dio.Json({"lr": 0.5, "step": step})},
                         metrics={"loss": 1.0 / step}, metadata={"git": "abc"})
        mgr.wait()
        assert mgr.persistent_steps() == [] and mgr.local.steps() == [2, 4]
        assert mgr.item(4, "data") == b"\x00it\x04" and mgr.item(2, "cfg") == {"lr": 0.5, "step": 2}
        stats = mgr.promote(4).wait()
        assert stats.bytes_written == 256 * 64 * 4 + 64 * 4 + 2 * 4 + 4 + 80, stats   # each chunk once
        mgr.wait()
        assert mgr.persistent_steps() == [4]
        info = mgr.step_info(4)
        assert (info.metrics, info.metadata, info.items) == ({"loss": 0.25}, {"git": "abc"},
                                                             {"data": "per_process", "cfg": "json"})
        assert mgr.item(4, "data") == b"\x00it\x04" and mgr.item(4, "cfg") == {"lr": 0.5, "step": 4}
        with pytest.raises(FileExistsError):
            mgr.promote(4)
        with pytest.raises(ValueError, match="step 4 is newer"):
            mgr.promote(2)
    local, root = tmp_path / "local" / "0" / "4", tmp_path / "root" / "4"
    promoted = _raw_chunks(root)
    assert promoted == _raw_chunks(local)   # every chunk, byte for byte (the local copy holds all: one process)
    assert len(promoted) == sum(len(leaf["stored"]["crc32c"]) for leaf in sh.manifest(root)["leaves"]
                                if leaf.get("stored"))
    assert json.loads((root / "info.json").read_text())["promoted"] == "local"
    manifest = sh.manifest(root)
    assert manifest["compression"] == sh.manifest(local)["compression"]
    assert all(leaf["stored"]["crc32c"] == local_leaf["stored"]["crc32c"]
               for leaf, local_leaf in zip(manifest["leaves"], sh.manifest(local)["leaves"]) if leaf.get("stored"))
    dispatcher.verify(os.fspath(root))   # every chunk read back against its CRC-32C
    _same(dispatcher.restore(os.fspath(root), _state(mesh, 0)), _state(mesh, 4))
    dispatcher.close()


def test_promotion_to_an_object_store(tmp_path, mesh, store_prefix):
    """A manager with a local tier whose root is on S3 or GCS: a step saved locally only, then
    promoted; what reaches the root is the local step's chunks byte for byte."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(1))
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True)
    with dio.CheckpointManager(store_prefix, dispatcher, save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        mgr.save(3, _state(mesh, 3), items={"cfg": dio.Json([1, 2])})
        assert mgr.persistent_steps() == []
        mgr.promote(3).wait()
        assert mgr.item(3, "cfg") == [1, 2]
        assert mgr.persistent_steps() == [3]
        _same(mgr.restore(3, _state(mesh, 0)), _state(mesh, 3))
    assert _raw_chunks(f"{store_prefix}/3") == _raw_chunks(tmp_path / "local" / "0" / "3")
    dispatcher.close()


def test_a_step_not_held_locally_is_refused_and_a_failed_promotion_leaves_no_step(tmp_path, mesh):
    tier = dio.LocalTier(tmp_path / "local" / "{process}")
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, local=tier) as mgr:
        with pytest.raises(FileNotFoundError, match="no process has a local copy of step 7"):
            mgr.promote(7)
        mgr.local.save(7, _state(mesh, 7)).wait()
        value = sh.chunks(tmp_path / "local" / "0" / "7", "['w']")[(1, 0)]
        sh.flip_byte(value)
        with pytest.raises(dio.CheckpointError, match=r"\['w'\].*CRC-32C"):
            mgr.promote(7).wait()
        with pytest.raises(dio.CheckpointError):
            mgr.wait()
        assert mgr.persistent_steps() == [] and os.listdir(tmp_path / "root") == []
    with dio.CheckpointManager(tmp_path / "root2", dispatcher) as mgr, pytest.raises(ValueError, match="local tier"):
        mgr.promote(7)
    dispatcher.close()


def test_items_of_a_step_only_the_local_tier_holds(tmp_path, mesh):
    """A job resuming a local-only step gets its items from its local copy; a lost local directory
    loses them, with an error naming the step and process."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                          if isinstance(x, jax.Array) else x, _state(mesh, 0))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        for step in range(5):
            if mgr.should_save(step):
                mgr.save(step, _state(mesh, step), items={"data": dio.PerProcess({"pos": step})})
        mgr.wait()
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        restored = mgr.restore(None, target)
        step = mgr.last_tier_restore.step
        assert step == 4 and mgr.persistent_steps() == [0, 3]
        _same(restored, _state(mesh, 4))
        assert mgr.item(step, "data") == {"pos": 4} and mgr.item(3, "data") == {"pos": 3}
        with pytest.raises(KeyError, match="has no item 'cfg'"):
            mgr.item(step, "cfg")
    shutil.rmtree(tmp_path / "local" / "0" / "4")
    with dio.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        with pytest.raises(FileNotFoundError, match="step 4 .*process 0"):
            mgr.item(4, "data")


def test_the_promotion_plan_writes_each_chunk_once_by_a_holder():
    """Pure: two processes hold w's halves and both hold r; each chunk has one writer, a holder,
    spread by bytes; a chunk no copy holds is an error naming the key path."""
    structure = tree_lib.encode_structure(jax.tree.structure({"r": 0, "w": 0}))
    doc = {"format": "dispatch_io", "format_version": 1, "layout": "ocdbt", "structure": structure,
        "leaves": [{"keypath": "['r']", "kind": "array", "origin": "jax", "shape": [8], "dtype": "float32",
                    "stored": {"name": "00000.r", "shape": [8], "dtype": "float32", "chunk_shape": [4]}},
                   {"keypath": "['w']", "kind": "array", "origin": "jax", "shape": [4, 2], "dtype": "float32",
                    "stored": {"name": "00001.w", "shape": [4, 2], "dtype": "float32", "chunk_shape": [2, 2]}}],
        "total_bytes": 64}
    manifest = parse_manifest(doc, "test")
    held = {0: {"['r']": [[[0, 8]]], "['w']": [[[0, 2], [0, 2]]]}, 1: {"['r']": [[[0, 8]]], "['w']": [[[2, 4], [0, 2]]]}}
    plan = plan_promotion(manifest, held, "test")
    cells = [(c.leaf, c.region, c.worker) for c in plan.chunks]
    assert cells == [(0, ((0, 4),), 0), (0, ((4, 8),), 1), (1, ((0, 2), (0, 2)), 0), (1, ((2, 4), (0, 2)), 1)]
    with pytest.raises(FileNotFoundError, match=r"\['w'\] is not held whole"):
        plan_promotion(manifest, {0: held[0]}, "test")
    reports = {0: {"has": True, "items": {"d": {"kind": "per_process", "processes": 2}}, "info": {}},
               1: {"has": False, "items": {}, "info": None}}
    with pytest.raises(ValueError, match=r"process\(es\) \[1\].*d"):
        items_of(5, reports, 2)


def test_a_promotion_killed_midway_leaves_no_step_and_can_be_done_again(tmp_path, mesh):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, "-c", KILLED, os.fspath(tmp_path)], capture_output=True, text=True,
                           timeout=120, env=env, cwd=repo)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr[-4000:]
    assert any(n.startswith(".3.") for n in os.listdir(tmp_path / "root")), "killed before the promotion wrote"
    w = jax.device_put(np.arange(256 * 64, dtype=np.float32).reshape(256, 64), NamedSharding(mesh, P("data", "model")))
    dispatcher = dio.LocalDispatcher(host_memory_budget=16 << 10, small_leaf_bytes=0, checksums=True)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, local=dio.LocalTier(tmp_path / "local" / "{process}")) as mgr:
        assert mgr.persistent_steps() == [] and os.listdir(tmp_path / "root") == []   # the dead promotion's leftovers go
        mgr.promote(3).wait()
        assert np.asarray(mgr.restore(3, {"w": w})["w"]).tobytes() == np.asarray(w).tobytes()
    dispatcher.close()


def test_local_retention_keeps_a_step_while_it_is_promoted(tmp_path, mesh, monkeypatch):
    """A local save during a promotion (keep LatestN(1)) would delete the step being read: kept until
    the promotion is over, then dropped by the next local retention."""
    from dispatch_io.manager.tiers import promotion
    release, real = threading.Event(), promotion.write_values

    def write_values(*args):
        assert release.wait(60)
        return real(*args)
    monkeypatch.setattr(promotion, "write_values", write_values)
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2),
                         keep_policy=policies.LatestN(1))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        try:
            mgr.save(2, _state(mesh, 2))
            handle = mgr.promote(2)
            mgr.save(4, _state(mesh, 4))
            mgr.local.wait()                  # step 4 committed, its retention done: step 2 still there
            assert mgr.local.steps() == [2, 4]
        finally:
            release.set()
        handle.wait()
        _same(mgr.restore(2, _state(mesh, 0)), _state(mesh, 2))
        mgr.save(6, _state(mesh, 6))
        mgr.local.wait()
        assert mgr.local.steps() == [6]


def test_a_promotion_streams_within_the_budget(tmp_path):
    """128 MiB promoted under an 8 MiB budget, in a fresh process: peak RSS grows by less than the
    budget + 32 MiB (a save's bound: + 64 MiB), far less than the step (measured: 18 MiB; 46 MiB
    before each value in flight was counted COPIES times in the staging ring)."""
    repo, budget = os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 8 << 20
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, "-c", MEMORY, os.fspath(tmp_path), str(budget)], capture_output=True,
                           text=True, timeout=180, env=env, cwd=repo)
    assert child.returncode == 0, child.stdout + child.stderr[-4000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    print(result)
    assert result["written"] == 128 << 20 and result["growth"] < budget + (32 << 20), result


def test_save_with_promote_persists_from_the_local_copy(tmp_path, mesh):
    """LocalTier(promote=True): a step both tiers save is copied off the devices once (each leaf's
    on_transfer_end fires once; the arrays are deleted as soon as save() returns) and persisted by
    promotion of the local copy, with its items."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(1), promote=True)
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(2), local=tier) as mgr:
        for step in range(1, 5):
            state, copied = _state(mesh, step), []
            mgr.save(step, state, items={"data": dio.PerProcess({"pos": step})}, on_transfer_end=copied.append)
            for leaf in jax.tree.leaves(state):
                if isinstance(leaf, jax.Array):
                    leaf.delete()                           # the device has moved on
            assert sorted(copied) == sorted(set(copied)) and len(copied) == 5, copied   # once each
        mgr.wait()
        assert mgr.persistent_steps() == [2, 4] and mgr.local.steps() == [1, 2, 3, 4]
        assert mgr.item(4, "data") == {"pos": 4} and mgr.item(3, "data") == {"pos": 3}
        _same(mgr.restore(4, _state(mesh, 0)), _state(mesh, 4))
    for step in (2, 4):
        assert json.loads((tmp_path / "root" / str(step) / "info.json").read_text())["promoted"] == "local"
        assert _raw_chunks(tmp_path / "root" / str(step)) == _raw_chunks(tmp_path / "local" / "0" / str(step))
    dispatcher.close()


def test_local_retention_keeps_a_step_while_save_promotes_it(tmp_path, mesh, monkeypatch):
    """LocalTier(promote=True, keep_policy=LatestN(1)): the next local save commits while step 2's
    promotion still reads it (held in its first write); step 2 stays until the promotion is over."""
    from dispatch_io.manager.tiers import promotion
    entered, release, real = threading.Event(), threading.Event(), promotion.write_values

    def write_values(*args):
        entered.set()
        assert release.wait(60)
        return real(*args)
    monkeypatch.setattr(promotion, "write_values", write_values)
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(1),
                         keep_policy=policies.LatestN(1), promote=True)
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(2), local=tier) as mgr:
        try:
            mgr.save(2, _state(mesh, 2))            # local, then its promotion on the manager's thread
            assert entered.wait(60)
            mgr.save(3, _state(mesh, 3))            # local only: its retention would drop step 2
            mgr.local.wait()
            assert mgr.local.steps() == [2, 3]
        finally:
            release.set()
        mgr.wait()
        assert mgr.persistent_steps() == [2]
        _same(mgr.restore(2, _state(mesh, 0)), _state(mesh, 2))


def test_a_deferred_promotion_after_any_local_failure_unpins_the_step_and_is_reported_once():
    """promotion.Deferred (LocalTier(promote=True)): a local save failing with an error that is not a
    CheckpointError is still a failed local save: the promotion starts without a copy, and, failing,
    releases the step's pin against local retention; its error is the handle's (chained to the local
    failure), which the manager does not raise again (the local tier reports the local failure)."""
    from dispatch_io.manager.tiers import promotion

    class Failed:
        path = "/local/0/3"

        def wait(self, timeout=None):
            raise RuntimeError("a callback of the local save raised")

        def done(self):
            return True

    class Local:
        def __init__(self):
            self.promoting = set()

    def launch():
        raise FileNotFoundError("no process has a local copy of step 3")
    local = Local()
    handle = promotion.Deferred(Failed(), local, 3, "/root/3", launch)
    assert local.promoting == {3} and handle.path == "/root/3"
    with pytest.raises(FileNotFoundError, match="no process has a local copy") as raised:
        handle.wait()
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert local.promoting == set() and handle.done()
    assert promotion.to_report(handle, raised.value) is None
    with pytest.raises(FileNotFoundError):   # the same error to every caller; never started twice
        handle.wait(timeout=1)


def _damaged_step_is_not_promoted(tmp_path, mesh, dispatcher, damage):
    """Save local step 7 with ``dispatcher``, ``damage`` one stored chunk of its ``['w']`` (its
    ``storage_helpers`` value), and check that its promotion fails naming ``['w']`` and commits
    nothing (the step is not listed, nor "persisted"); closes ``dispatcher``."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}")
    with dio.CheckpointManager(tmp_path / "root", dispatcher, local=tier) as mgr:
        mgr.local.save(7, _two_leaves(mesh, 7)).wait()
        damage(sh.chunks(tmp_path / "local" / "0" / "7", "['w']")[(1, 0)])
        try:
            with pytest.raises(dio.CheckpointError, match=r"\['w'\]"):
                mgr.promote(7).wait()
        finally:
            try:
                mgr.wait()
            except dio.CheckpointError:
                pass
        assert mgr.persistent_steps() == [] and mgr.durability(7) != "persisted"
    dispatcher.close()


@pytest.mark.parametrize("layout", ["files", "ocdbt"])


def test_a_damaged_compressed_local_chunk_is_not_promoted(tmp_path, mesh, layout):
    """A damaged local chunk stored compressed (zstd) is not promoted: the promotion decodes compressed
    chunks that carry a CRC-32C before writing them and fails naming the key path, committing nothing.
    Why: the root is the durable tier and local retention then deletes the local copy; a promoted
    unreadable chunk would leave the job's only persisted copy of that step unreadable, with nothing said
    at promotion time (it would be listed, "persisted", and every restore of it would fail)."""
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True, compression="zstd", layout=layout)
    _damaged_step_is_not_promoted(tmp_path, mesh, dispatcher, lambda value: sh.flip_byte(value, 10))


def test_a_truncated_local_chunk_is_not_promoted_without_checksums(tmp_path, mesh):
    """With default options (checksums=False, no compression) a local chunk cut short -- the torn write on a
    full RAM disk, the local tier's failure model -- is not promoted: each raw chunk's length is checked
    against its stored array's chunk shape and dtype (known from the manifest, so the check is free), and
    the promotion fails naming the key path, committing nothing (else the step would be listed,
    "persisted", and unreadable)."""
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0, layout="files")
    _damaged_step_is_not_promoted(tmp_path, mesh, dispatcher, lambda value: os.truncate(value.file, value.length // 2))


def test_a_failed_local_save_with_promote_is_reported_once_and_the_next_save_persists(tmp_path, mesh):
    """``LocalTier(promote=True)``, the local save of step 1 fails (ENOSPC on the RAM disk): ``mgr.wait()``
    reports that failure once (the promotion that then finds no local copy adds no second error), and the
    next, healthy ``save(2)`` goes through to the root. Why: a training loop that logs the failure from
    wait() and carries on must not crash at an unrelated save that is left half-done (step 2 saved
    locally, never persisted)."""
    dispatcher = hooked_dispatcher(dio.LocalDispatcher, write_hook=fail_batches_of(None), small_leaf_bytes=0)
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(1), promote=True)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(1), local=tier) as mgr:
        mgr.save(1, _two_leaves(mesh, 1))
        with pytest.raises(dio.CheckpointError, match="No space left"):
            mgr.wait()
        dispatcher.runner.write_hook = None          # the disk was cleaned: the job goes on
        mgr.save(2, _two_leaves(mesh, 2))
        mgr.wait()
        assert mgr.persistent_steps() == [2]
        _same_two(mgr.restore(2, _two_leaves(mesh, 0)), _two_leaves(mesh, 2))
    dispatcher.close()


def test_the_promote_on_save_handle_honours_wait_timeout(tmp_path, mesh):
    """The handle ``save()`` returns with ``LocalTier(promote=True)`` (``promotion.Deferred``) honours
    ``wait(timeout)`` while the local save is in flight: it raises TimeoutError after ``timeout``, as
    ``SaveHandle.wait`` does, rather than blocking for the whole local save (here 6 s against a 0.5 s
    timeout). A loop polling ``handle.wait(timeout=...)`` (to log progress, or to bound a preemption grace
    period) depends on it."""
    gate = threading.Event()

    def hold(regions):
        assert gate.wait(60)
    dispatcher = hooked_dispatcher(dio.LocalDispatcher, write_hook=hold, small_leaf_bytes=0)
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(1), promote=True)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(1), local=tier) as mgr:
        handle = mgr.save(1, _two_leaves(mesh, 1))
        timer = threading.Timer(6, gate.set)
        timer.start()
        began = time.monotonic()
        try:
            with pytest.raises(TimeoutError):
                handle.wait(timeout=0.5)
            took = time.monotonic() - began
        finally:
            gate.set()
            timer.cancel()
        assert took < 3, took
        handle.wait()
        assert mgr.persistent_steps() == [1]
    dispatcher.close()


def test_the_promote_on_save_handle_names_the_persistent_step(tmp_path, mesh):
    """With ``LocalTier(promote=True)`` the handle ``save()`` returns has ``path`` = the root's step, as the
    same save without promote: the handle stands for the persistent save (its ``wait()`` is the
    promotion's), and code that logs, verifies or uploads ``handle.path`` must not act on the node-local
    RAM-disk copy, which local retention deletes."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(1), promote=True)
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(1), local=tier) as mgr:
        handle = mgr.save(1, _two_leaves(mesh, 1))
        handle.wait()
        assert handle.path == os.fspath(tmp_path / "root" / "1")


def test_save_with_promote_raises_file_exists_before_writing(tmp_path, mesh):
    """``save()`` raises FileExistsError "before anything is written" for a step the root already holds
    (without overwrite) with ``LocalTier(promote=True)`` too, as without promote: ``save(2, ..., force=True)``
    neither overwrites the local copy of step 2 with a state that differs from the root's nor defers the
    error to a later, unrelated ``wait()``/``save()`` (a resumed loop re-saving its restored step relies on
    save() to refuse)."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(1), promote=True)
    with dio.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        mgr.save(2, _two_leaves(mesh, 2), local=False)
        mgr.wait()
        assert mgr.persistent_steps() == [2]
        try:
            with pytest.raises(FileExistsError):
                mgr.save(2, _two_leaves(mesh, 5), force=True)
        finally:
            try:
                mgr.wait()
            except FileExistsError:
                pass
        _same_two(mgr.restore(2, _two_leaves(mesh, 0)), _two_leaves(mesh, 2))


def test_promote_after_a_rollback_does_not_persist_the_abandoned_history(tmp_path, mesh):
    """After a rollback (``restore(0, target)`` with local steps 2 and 4 of the history being abandoned),
    ``promote(4)`` does not persist the abandoned local step 4 into the root (docs/manager.md "Local tier":
    the abandoned local steps "are never restored over the new one"). Persisting it would let a restart's
    ``restore(None, target)`` resume the abandoned history over the new one's step 2, and refuse the new
    history's own persistent save of step 4 (FileExistsError).

    Why it matters: a promotion is how a job persists "the local step it has"; after a rollback (a loss
    spike, a bad batch) the step it would promote by habit is the one the rollback was meant to discard,
    and the mistake would only show after the next crash."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}")
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        mgr.save(0, filled(mesh, 0), force=True)
        mgr.save(2, filled(mesh, 2), local=True)
        mgr.save(4, filled(mesh, 4), local=True)
        mgr.wait()
        mgr.restore(0, filled_target(mesh))           # the rollback: steps 2 and 4 are abandoned
        try:
            mgr.promote(4).wait()
        except ValueError:
            return                              # refused: the step is of the abandoned history
        mgr.save(2, filled(mesh, 20), local=True)   # the new history (its first save drops the old local steps)
        mgr.wait()
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        restored = mgr.restore(None, filled_target(mesh))
        assert (mgr.last_tier_restore.step, value_of(restored)) == (2, 20.0), (
            f"the restart resumed step {mgr.last_tier_restore.step} = {value_of(restored)}: the abandoned history")


def test_the_promotion_plan_picks_the_least_loaded_holder_among_many():
    """Pure: 12 processes, each chunk held by a different set of 1 to 12 of them (most sets larger
    than the few where a plain ``min`` is used), chunks of two sizes: every chunk's writer is the
    one a ``min`` over its holders by (bytes so far, index) gives, chunk after chunk."""
    rng = np.random.default_rng(42)
    processes, cells = 12, 48
    structure = tree_lib.encode_structure(jax.tree.structure({"a": 0, "b": 0}))
    leaves = [{"keypath": f"['{k}']", "kind": "array", "origin": "jax", "shape": [cells * 4, width], "dtype": "float32",
               "stored": {"name": f"0000{i}.{k}", "shape": [cells * 4, width], "dtype": "float32",
                          "chunk_shape": [4, width]}} for i, (k, width) in enumerate((("a", 3), ("b", 5)))]
    manifest = parse_manifest({"format": "dispatch_io", "format_version": 1, "layout": "ocdbt", "structure": structure,
                               "leaves": leaves, "total_bytes": cells * 4 * 8 * 4}, "test")
    holders = {}   # (leaf, cell) -> sorted holders
    held = {p: {} for p in range(processes)}
    for leaf, entry in enumerate(leaves):
        for c in range(cells):
            these = sorted(rng.choice(processes, size=rng.integers(1, processes + 1), replace=False).tolist())
            holders[leaf, c] = these
            for p in these:
                held[p].setdefault(entry["keypath"], []).append([[c * 4, c * 4 + 4], [0, entry["shape"][1]]])
    plan = plan_promotion(manifest, held, "test")
    load, expected = dict.fromkeys(range(processes), 0), []
    for leaf, entry in enumerate(leaves):
        for c in range(cells):
            writer = min(holders[leaf, c], key=lambda p: (load[p], p))
            load[writer] += 4 * entry["shape"][1] * 4
            expected.append((leaf, ((c * 4, c * 4 + 4), (0, entry["shape"][1])), writer))
    assert [(k.leaf, k.region, k.worker) for k in plan.chunks] == expected
    assert sum(len(h) > 4 for h in holders.values()) > cells  # the heap, not the plain min, picked most
