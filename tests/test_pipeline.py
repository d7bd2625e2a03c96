"""The save pipeline: memory budget, priorities and callbacks, donation, plan cache, background saves."""

import collections
import concurrent.futures
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import types
import weakref

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from conftest import HookedRunner, RUNNERS, assert_trees_bit_equal, host_bytes, put, random_array

KiB, MiB = 1 << 10, 1 << 20
TIMEOUT = 60  # seconds any single wait in these tests may take before it counts as a hang


def numpy_copy(tree):
    """Host copies of every array leaf (keys as key_data), taken before anything is saved."""
    return jax.tree.map(lambda x: np.frombuffer(host_bytes(x), np.uint8).copy() if hasattr(x, "shape") else x, tree)


def assert_matches_copy(restored, copy):
    """``restored`` (any leaves) holds exactly the bytes recorded by :func:`numpy_copy`."""
    fr, tr = jax.tree_util.tree_flatten_with_path(restored)
    fc, tc = jax.tree_util.tree_flatten_with_path(copy)
    assert tr == tc
    for (path, got), (_, want) in zip(fr, fc):
        if isinstance(want, np.ndarray):
            assert host_bytes(got) == want.tobytes(), f"{jax.tree_util.keystr(path)}: bytes differ"
        else:
            assert got == want, jax.tree_util.keystr(path)


def abstract(tree):
    """ShapeDtypeStruct target (with the saved shardings) for a tree of jax arrays."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        tree)


def array_keypaths(tree):
    return [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(x, "shape")]


class Recorder:
    """Thread-safe log of callback events, with one Event per key path and kind."""

    def __init__(self):
        self.lock = threading.Lock()
        self.log = []            # [(kind, keypath)] in the order they fired
        self.fired = collections.defaultdict(threading.Event)

    def _record(self, kind, keypath):
        with self.lock:
            self.log.append((kind, keypath))
            event = self.fired[(kind, keypath)]
        event.set()

    def transfer(self, keypath):
        self._record("transfer", keypath)

    def write(self, keypath):
        self._record("write", keypath)

    def of(self, kind):
        with self.lock:
            return [k for what, k in self.log if what == kind]

    def wait_for(self, kind, keypath):
        with self.lock:
            event = self.fired[(kind, keypath)]
        assert event.wait(TIMEOUT), f"on_{kind}_end({keypath}) never fired"


# ---- 1. budget ------------------------------------------------------------------------------

def test_leaf_four_times_the_budget(tmp_path, mesh, dispatcher_cls):
    budget = 1 * MiB
    big = random_array(0, (1024, 1024))                       # 4 MiB, 4x the budget
    tree = {
        "sharded": put(mesh, big, "data", "model"),           # 8 shards of 512 KiB, each split
        "single": jax.device_put(big[::-1].copy()),           # one 4 MiB shard on one device
        "replicated": put(mesh, random_array(1, (512, 2048)), None, None),  # 4 MiB on every device
        "host": random_array(2, (2048, 512), np.int32),      # numpy leaf, 4 MiB
    }
    with dispatcher_cls(host_memory_budget=budget) as d:
        stats = d.save(tmp_path / "ckpt", tree).wait(TIMEOUT)
        assert 0 < stats.peak_host_bytes <= budget
        assert stats.batches > 1
        assert stats.bytes_written == 4 * 4 * MiB     # replicas written once
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt"), jax.device_get(tree))
        restored = d.restore(tmp_path / "ckpt", abstract(tree))
        assert_trees_bit_equal(restored, tree)
        assert restored["sharded"].sharding == tree["sharded"].sharding


# ---- 2. peak RSS (subprocess: the process's own high-water mark) ------------------------------

RSS_SCRIPT = textwrap.dedent(r"""
    import gc, json, sys
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import dispatch_io as dio

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    def reset_hwm():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    path, budget, dispatcher_cls = sys.argv[1], int(sys.argv[2]), getattr(dio, sys.argv[3])
    compression = None if sys.argv[4] == "none" else sys.argv[4]
    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((4, 2), ("data", "model"))

    def make(seed, shape, dtype, spec):
        sharding = NamedSharding(mesh, P(*spec))
        def block(index):   # each shard built on its own: no full-size numpy temporary
            shard = tuple(s.stop - s.start if s.start is not None else n for s, n in zip(index, shape))
            return np.random.default_rng([seed, *(s.start or 0 for s in index)]).standard_normal(shard).astype(dtype)
        return jax.make_array_from_callback(shape, sharding, block)

    tree = {
        "a": make(1, (4096, 4096), np.float32, ("data", "model")),   # 64 MiB
        "b": make(2, (8192, 2048), np.float32, ("data",)),           # 64 MiB, replicated over 'model'
        "c": make(3, (2048, 8192), np.float32, (None, "model")),     # 64 MiB, replicated over 'data'
        "d": make(4, (4096, 4096), np.float32, (("data", "model"),)),  # 64 MiB
        "e": make(5, (16, 16), np.float32, ()),                      # small, fully replicated
    }
    jax.block_until_ready(tree)
    tree_bytes = sum(x.nbytes for x in jax.tree.leaves(tree))
    gc.collect()

    d = dispatcher_cls(host_memory_budget=budget, compression=compression)
    rss_before_save = status("VmRSS")
    reset_hwm()
    stats = d.save(path, tree).wait()
    save_hwm = status("VmHWM")

    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    gc.collect()
    rss_before_restore = status("VmRSS")
    reset_hwm()
    restored = d.restore(path, target)
    jax.block_until_ready(restored)
    restore_hwm = status("VmHWM")
    shards = {s.data.unsafe_buffer_pointer(): s.data.nbytes for x in jax.tree.leaves(restored) for s in x.addressable_shards}
    restored_bytes = sum(shards.values())  # host memory the restored tree holds (CPU replicas may share)
    replica_bytes = sum(s.data.nbytes for x in jax.tree.leaves(restored) for s in x.addressable_shards)

    equal = all(
        r.sharding == t.sharding and all(
            np.asarray(rs.data).tobytes() == np.asarray(ts.data).tobytes()
            for rs, ts in zip(r.addressable_shards, t.addressable_shards))
        for r, t in zip(jax.tree.leaves(restored), jax.tree.leaves(tree)))
    print(json.dumps(dict(
        tree_bytes=tree_bytes, bytes_written=stats.bytes_written, peak_host_bytes=stats.peak_host_bytes,
        rss_before_save=rss_before_save, save_hwm=save_hwm, rss_before_restore=rss_before_restore,
        restore_hwm=restore_hwm, restored_bytes=restored_bytes, replica_bytes=replica_bytes, equal=equal)))
""")


@pytest.mark.parametrize("dispatcher_name, allocator, compression", [
    ("LocalDispatcher", "glibc-default", "none"),
    ("LocalDispatcher", "fixed-mmap-threshold", "none"),
    # zstd: TensorStore holds a batch's compressed chunks until its write commits; a quarter of
    # the budget stages, the rest is theirs (Options.staging_bytes)
    ("LocalDispatcher", "glibc-default", "zstd"),
    # ColocatedDispatcher's host copies are fresh XLA buffers per chunk (no reused staging buffer),
    # which glibc's dynamic threshold would keep in per-thread arenas once freed (VmHWM ~7x the
    # budget): the dispatcher fixes the threshold itself (workers.colocated.release_large_buffers_at_once),
    # so the default environment must hold the bound too.
    ("ColocatedDispatcher", "glibc-default", "none"),
    ("ColocatedDispatcher", "fixed-mmap-threshold", "none"),
], ids=["local-glibc-default", "local-fixed-mmap-threshold", "local-zstd", "colocated-glibc-default",
        "colocated-fixed-mmap-threshold"])
def test_peak_rss_of_save_and_restore_stays_within_budget(tmp_path, dispatcher_name, allocator, compression):
    # zstd: a budget large next to the slack, so compressed copies beyond it would show
    budget = 128 * MiB if compression == "zstd" else 32 * MiB
    slack = 64 * MiB
    colocated = dispatcher_name == "ColocatedDispatcher"
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        + ["--xla_force_host_platform_device_count=8"])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if allocator == "fixed-mmap-threshold":
        # glibc's dynamic mmap threshold keeps freed multi-MiB blocks (TensorStore's read
        # buffers) in the heap, where VmHWM counts memory already freed: a fixed threshold makes
        # the high-water mark what the process actually held.
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 * MiB)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path / "ckpt"), str(budget), dispatcher_name,
                           compression],
                          env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["equal"], r
    assert r["bytes_written"] == r["tree_bytes"] > 200 * MiB, r
    assert r["peak_host_bytes"] <= budget, r
    # LocalDispatcher: the save bound holds with any allocator: staging is one buffer, reused.
    # ColocatedDispatcher: the ring bounds the bytes copied and not yet written to the budget,
    # but each copy is an XLA buffer, released only after its ring slice (once the pool drops
    # the write's arguments and TensorStore its reference to the data; measured: ~90 MiB growth
    # against LocalDispatcher's ~35), so allow one more budget's worth.
    save_bound = (2 * budget if colocated else budget) + slack
    save_growth = r["save_hwm"] - r["rss_before_save"]
    assert save_growth <= save_bound, (
        f"save grew RSS by {save_growth / MiB:.1f} MiB, more than {save_bound / MiB:.0f} MiB "
        f"({budget / MiB:.0f} MiB budget): {r}")
    # Restore: the restored arrays + the budget, plus (default glibc only) freed read buffers
    # that the allocator keeps; see the closing note of the core issue.
    kept_by_glibc = 2 * budget if allocator == "glibc-default" else 0
    # ColocatedDispatcher reads each region into a buffer on the colocated CPU device (CPU 0
    # here, for every device) that XLA adopts, then copies it to each target device, so the
    # restored arrays share no replica buffers (restored_bytes counts them all). An adopted
    # numpy buffer whose last reference goes away on an XLA thread (the async copies finishing)
    # is only freed at the next Python GC (jax._src.lib._xla_gc_callback -> collect_garbage),
    # so until then up to every read buffer (the distinct regions: tree_bytes) may be held.
    deferred_reads = r["tree_bytes"] if colocated else 0
    restore_bound = r["restored_bytes"] + budget + kept_by_glibc + deferred_reads + slack
    restore_growth = r["restore_hwm"] - r["rss_before_restore"]
    assert restore_growth <= restore_bound, (
        f"restore grew RSS by {restore_growth / MiB:.1f} MiB for {r['restored_bytes'] / MiB:.1f} MiB "
        f"restored (bound {restore_bound / MiB:.0f} MiB): {r}")


def test_restore_onto_cpu_devices_adopts_one_buffer_per_region(tmp_path, mesh):
    """A region read in one piece is copied once into an aligned buffer that every replica's
    device adopts, not once per device (TensorStore's own arrays are not 64-byte aligned)."""
    tree = {"replicated": put(mesh, random_array(0, (256, 256)), None, None),   # one region, 8 devices
            "half": put(mesh, random_array(1, (256, 256)), "data", None),      # 4 regions, 2 devices each
            "key": jax.device_put(jax.random.split(jax.random.key(0), 8), NamedSharding(mesh, P()))}
    with dio.LocalDispatcher(host_memory_budget=2 * MiB) as d:   # 512 KiB chunks: one piece per region
        d.save(tmp_path / "ckpt", tree).wait(TIMEOUT)
        restored = d.restore(tmp_path / "ckpt", abstract(tree))
    assert_trees_bit_equal(restored, tree)
    for name, regions in [("replicated", 1), ("half", 4)]:
        buffers = {s.data.unsafe_buffer_pointer() for s in restored[name].addressable_shards}
        assert len(buffers) == regions, (name, len(buffers))


# ---- 3. priority order and callbacks ------------------------------------------------------------

def priority_tree(mesh):
    tree = {"step": 7, "key": jax.random.key(3)}
    for i in range(12):
        tree[f"p{i:02d}"] = put(mesh, random_array(10 + i, (64, 128 + 32 * (i % 3))), "data", "model")
    tree["host"] = random_array(40, (50, 70), np.int32)
    return tree


def test_priority_order_and_callbacks(tmp_path, mesh, dispatcher_cls):
    tree = priority_tree(mesh)
    # Interleaved in tree order, so that tree order alone would not pass.
    cycle = [dio.Priority.LOW, dio.Priority.SYNC, dio.Priority.HIGH]
    prio = {k: cycle[i % 3] for i, k in enumerate(array_keypaths(tree))}
    assert set(prio.values()) == set(cycle)
    asked = []

    def priority(keypath, spec):
        assert isinstance(spec, jax.ShapeDtypeStruct)
        asked.append(keypath)
        return prio[keypath]

    rec = Recorder()
    with dispatcher_cls(host_memory_budget=64 * KiB) as d:
        handle = d.save(tmp_path / "ckpt", tree, priority=priority,
                        on_transfer_end=rec.transfer, on_write_end=rec.write)
        transferred_at_return = set(rec.of("transfer"))
        stats = handle.wait(TIMEOUT)
        assert handle.done()
        restored = d.restore(tmp_path / "ckpt", abstract(tree))

    assert_trees_bit_equal(restored, tree)
    assert stats.batches >= 10, stats
    assert sorted(asked) == sorted(prio)                    # asked about array leaves only, once each

    sync = {k for k, p in prio.items() if p == dio.Priority.SYNC}
    assert sync <= transferred_at_return, sync - transferred_at_return

    transfers, writes = rec.of("transfer"), rec.of("write")
    expected = collections.Counter(list(prio))
    assert collections.Counter(transfers) == expected
    assert collections.Counter(writes) == expected
    order = [prio[k] for k in transfers]
    assert order == sorted(order), [(k, prio[k].name) for k in transfers]
    # Within one priority, transfers follow tree order.
    keys = array_keypaths(tree)
    assert transfers == sorted(keys, key=lambda k: (prio[k], keys.index(k)))
    position = {event: i for i, event in enumerate(rec.log)}
    for k in prio:
        assert position[("transfer", k)] < position[("write", k)], k


def test_callbacks_fire_once_for_zero_size_and_single_chunk_leaves(tmp_path, dispatcher):
    tree = {"empty": np.zeros((0, 5), np.float32), "empty_jax": jax.numpy.zeros((3, 0)),
            "tiny": np.float32(1.5), "key": jax.random.key(1), "n": None, "s": "text"}
    rec = Recorder()
    prio = {"['empty']": dio.Priority.LOW, "['empty_jax']": dio.Priority.HIGH,
            "['tiny']": dio.Priority.LOW, "['key']": dio.Priority.SYNC}
    dispatcher.save(tmp_path / "ckpt", tree, priority=lambda k, s: prio[k],
                    on_transfer_end=rec.transfer, on_write_end=rec.write).wait(TIMEOUT)
    assert collections.Counter(rec.of("transfer")) == collections.Counter(list(prio))
    assert collections.Counter(rec.of("write")) == collections.Counter(list(prio))
    assert_trees_bit_equal(dispatcher.restore(tmp_path / "ckpt"),
                           {**tree, "empty_jax": np.zeros((3, 0), np.float32),
                            "key": tree["key"]})


def test_write_bookkeeping_is_finished_before_wait_returns(tmp_path, mesh, dispatcher_cls):
    """wait() must not return (nor the save commit) until every finished write has been
    accounted for: on_write_end fired, bytes counted. Write futures whose done-callbacks run
    late (as concurrent.futures allows: waiters are woken before callbacks run) expose a
    pipeline that waits on the raw futures instead of its own bookkeeping."""

    class LateCallbacks(concurrent.futures.Future):
        def add_done_callback(self, fn):
            def late(f):
                threading.Event().wait(0.3)
                fn(f)
            super().add_done_callback(late)

    class LateRunner(HookedRunner):   # every write's future runs its done-callbacks late
        def open_writer(self, target):
            writer = self.runner.open_writer(target)

            def write(regions, buffers):
                inner, outer = writer.write(regions, buffers), LateCallbacks()
                inner.add_done_callback(lambda f: outer.set_exception(f.exception()) if f.exception()
                                        else outer.set_result(f.result()))
                return outer
            return types.SimpleNamespace(write=write, close=writer.close)

    tree = {"a": put(mesh, random_array(0, (64, 64)), "data"), "b": random_array(1, (32, 16))}
    rec = Recorder()
    options = dio.Options(host_memory_budget=1 * MiB)
    with dio.Dispatcher(options, LateRunner(RUNNERS[dispatcher_cls](options.io_settings()))) as d:
        stats = d.save(tmp_path / "ckpt", tree, on_write_end=rec.write).wait(TIMEOUT)
        assert collections.Counter(rec.of("write")) == collections.Counter(array_keypaths(tree))
        assert stats.bytes_written == 64 * 64 * 4 + 32 * 16 * 4
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt"), jax.device_get(tree))


# ---- 4. donation right after save() returns ---------------------------------------------------------

def test_donating_sync_leaves_right_after_save_returns(tmp_path, mesh, dispatcher_cls):
    state = {
        "params": {f"w{i}": put(mesh, random_array(i, (128, 256)), "data", "model") for i in range(4)},
        "opt": {"mu": put(mesh, random_array(9, (256, 128)), "data"),
                "count": put(mesh, np.arange(16, dtype=np.int32), None)},
        "key": jax.random.key(5),
    }
    before = numpy_copy(state)

    def _step(s):
        return jax.tree.map(lambda x: jax.random.fold_in(x, 1) if dio.tree.is_prng_key(x) else x * 3 + 1, s)

    step = jax.jit(_step, donate_argnums=0)
    jax.block_until_ready(step(jax.tree.map(lambda x: x.copy(), state)))   # compiled before the save
    inputs = jax.tree.leaves(state)
    with dispatcher_cls(host_memory_budget=256 * KiB) as d:   # ~1.2 MiB tree: many batches
        handle = d.save(tmp_path / "ckpt", state)                   # all SYNC (the default)
        new_state = step(state)
        jax.block_until_ready(new_state)
        assert all(x.is_deleted() for x in inputs), "CPU donation did not delete the inputs"
        del state
        stats = handle.wait(TIMEOUT)
        assert stats.batches > 4
        assert_matches_copy(d.restore(tmp_path / "ckpt"), before)
        assert_matches_copy(d.restore(tmp_path / "ckpt", abstract(new_state)), before)


# ---- 5. HIGH / LOW leaves deleted as soon as their transfer ends --------------------------------

def test_high_low_leaves_deleted_after_transfer_end(tmp_path, mesh, dispatcher_cls):
    tree = {f"l{i}": put(mesh, random_array(100 + i, (128, 128)), "data", "model") for i in range(9)}
    tree["single"] = jax.device_put(random_array(200, (256, 128)))
    before = numpy_copy(tree)
    keys = array_keypaths(tree)
    cycle = [dio.Priority.SYNC, dio.Priority.HIGH, dio.Priority.LOW]
    prio = {k: cycle[i % 3] for i, k in enumerate(keys)}
    rec = Recorder()
    leaf_of = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    with dispatcher_cls(host_memory_budget=128 * KiB) as d:
        handle = d.save(tmp_path / "ckpt", tree, priority=lambda k, s: prio[k],
                        on_transfer_end=rec.transfer, on_write_end=rec.write)
        for k in sorted(keys, key=lambda k: prio[k]):   # SYNC ones at once, the others when released
            rec.wait_for("transfer", k)
            leaf_of[k].delete()
        stats = handle.wait(TIMEOUT)
        assert stats.batches > 3
        assert all(x.is_deleted() for x in leaf_of.values())
        assert_matches_copy(d.restore(tmp_path / "ckpt"), before)


def test_transferred_leaves_are_not_kept_alive_by_the_save(tmp_path, mesh, dispatcher_cls):
    """Once on_transfer_end(keypath) fired and the caller dropped its references, the save must
    not keep the leaf's (device) memory alive until the whole save finishes."""
    tree = {"first": put(mesh, random_array(1, (128, 128)), "data"),
            "second": put(mesh, random_array(2, (128, 128)), "data")}
    before = numpy_copy(tree)
    ref = weakref.ref(tree["first"])
    gate = threading.Event()
    rec = Recorder()

    def on_transfer_end(keypath):
        rec.transfer(keypath)
        if keypath == "['second']":
            gate.wait(TIMEOUT)   # hold the save open while the test looks

    with dispatcher_cls(host_memory_budget=1 * MiB) as d:
        handle = d.save(tmp_path / "ckpt", tree, priority=lambda k, s: dio.Priority.LOW,
                        on_transfer_end=on_transfer_end)
        try:
            del tree
            rec.wait_for("transfer", "['first']")
            rec.wait_for("transfer", "['second']")
            gc.collect()
            assert not handle.done()
            assert ref() is None, "the save still references a leaf whose transfer has ended"
        finally:
            gate.set()
        handle.wait(TIMEOUT)
        assert_matches_copy(d.restore(tmp_path / "ckpt"), before)


# ---- 6. plan cache ------------------------------------------------------------------------------

def test_plan_cache_second_save_same_structure(tmp_path, mesh, dispatcher_cls):
    def make(seed):
        return {"w": put(mesh, random_array(seed, (64, 32)), "data", "model"),
                "b": put(mesh, random_array(seed + 1, (32,)), None),
                "k": jax.random.key(seed), "step": seed, "h": random_array(seed + 2, (5,), np.int32)}

    first, second = make(1), make(2)
    with dispatcher_cls(host_memory_budget=64 * KiB) as d:
        s1 = d.save(tmp_path / "one", first).wait(TIMEOUT)
        s2 = d.save(tmp_path / "two", second).wait(TIMEOUT)
        assert not s1.plan_cached
        assert s2.plan_cached
        assert s1.batches == s2.batches and s1.bytes_written == s2.bytes_written
        assert_trees_bit_equal(d.restore(tmp_path / "two", abstract(second)), second)
        assert_trees_bit_equal(d.restore(tmp_path / "one", abstract(first)), first)
        # A different sharding is a different plan.
        third = {**make(3), "w": put(mesh, random_array(3, (64, 32)), "model", "data")}
        s3 = d.save(tmp_path / "three", third).wait(TIMEOUT)
        assert not s3.plan_cached
        assert_trees_bit_equal(d.restore(tmp_path / "three", abstract(third)), third)


def test_plan_cache_tells_apart_keys_equal_in_value(tmp_path, mesh, dispatcher_cls):
    # Treedefs compare dict keys by ==: {0: ..} and {np.int64(0): ..} have equal treedefs but
    # different key paths; the cache once reused the first plan (the second save written with the
    # first's keys) or raised comparing np.int64(1) with (1, "a").
    trees = [{np.int64(0): random_array(0, (4,)), np.int64(1): random_array(1, (4,))},
             {(1, "a"): random_array(2, (4,)), (0, "b"): random_array(3, (4,))},
             {0: random_array(4, (4,)), 1: random_array(5, (4,))},
             {False: random_array(6, (4,)), 1.0: random_array(7, (4,))}]
    with dispatcher_cls(host_memory_budget=64 * KiB) as d:
        for i, tree in enumerate(trees):
            assert not d.save(tmp_path / str(i), tree).wait(TIMEOUT).plan_cached
        assert d.save(tmp_path / "again", trees[0]).wait(TIMEOUT).plan_cached
        for name, tree in [*((str(i), t) for i, t in enumerate(trees)), ("again", trees[0])]:
            assert_trees_bit_equal(d.restore(tmp_path / name, tree), tree)
        for i in (1, 2, 3):  # keys that are Python literals come back as saved with target=None
            assert sorted(map(repr, d.restore(tmp_path / str(i)))) == sorted(map(repr, trees[i]))


# ---- 7. background saves ---------------------------------------------------------------------------

def test_low_priority_save_runs_in_the_background(tmp_path, mesh, dispatcher_cls):
    tree = {f"x{i}": put(mesh, random_array(i, (128, 64)), "data") for i in range(4)}
    gate = threading.Event()
    rec = Recorder()

    def on_transfer_end(keypath):   # blocks the pipeline (not the caller) until the test says so
        rec.transfer(keypath)
        gate.wait(TIMEOUT)

    with dispatcher_cls(host_memory_budget=64 * KiB) as d:
        try:
            handle = d.save(tmp_path / "ckpt", tree, priority=lambda k, s: dio.Priority.LOW,
                            on_transfer_end=on_transfer_end, on_write_end=rec.write)
            assert not gate.is_set(), "save() waited for LOW transfers"
            assert rec.of("write") == []
            assert not handle.done()
            with pytest.raises(TimeoutError):
                handle.wait(timeout=0)
            with pytest.raises(TimeoutError):
                handle.wait(timeout=0.05)
            assert not os.path.exists(tmp_path / "ckpt")     # not visible until committed
        finally:
            gate.set()
        stats = handle.wait(TIMEOUT)
        assert handle.done()
        assert handle.wait(0) == stats                       # a finished handle answers again
        assert collections.Counter(rec.of("write")) == collections.Counter(array_keypaths(tree))
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", abstract(tree)), tree)


# ---- SYNC leaves beyond the host budget: device snapshots -------------------------------------------

def sync_tree(mesh):
    """Eight 256 KiB SYNC leaves: 2 MiB, eight times a 256 KiB budget."""
    return {f"w{i}": put(mesh, random_array(100 + i, (256, 256)), "data", "model") for i in range(8)}


@pytest.mark.parametrize("snapshots", [True, False])
def test_sync_leaves_beyond_the_budget_are_snapshotted_on_their_devices(tmp_path, mesh, dispatcher_cls,
                                                                       monkeypatch, snapshots):
    """With device snapshots, SYNC leaves that do not fit in the budget are copied on their
    devices and save() returns without waiting for writes; the caller may delete the originals
    at once. CPU devices are excluded in production (their memory is host memory); here the
    exclusion is lifted to exercise the accelerator path on the simulated devices."""
    monkeypatch.setattr(dio.dispatcher, "NO_SNAPSHOT_PLATFORMS", ())
    tree = sync_tree(mesh)
    expected = numpy_copy(tree)
    transferred_at_return = []
    transferred = []
    with dispatcher_cls(host_memory_budget=256 * KiB, device_snapshots=snapshots) as d:
        handle = d.save(tmp_path / "ckpt", tree, on_transfer_end=transferred.append)
        transferred_at_return = list(transferred)
        for x in tree.values():
            x.delete()  # allowed for SYNC leaves as soon as save() returns
        stats = handle.wait(60)
        restored = d.restore(tmp_path / "ckpt")
    assert_matches_copy(restored, expected)
    keypaths = sorted(f"['{k}']" for k in expected)
    assert sorted(transferred) == keypaths
    if snapshots:
        # the budget holds one leaf's worth of SYNC copies at once; the other 7 leaves were snapshotted
        assert stats.snapshot_bytes == 7 * 256 * KiB
        assert len(transferred_at_return) < len(keypaths)
    else:
        assert stats.snapshot_bytes == 0
        assert sorted(transferred_at_return) == keypaths


def test_no_snapshots_on_cpu_devices(tmp_path, mesh, dispatcher_cls):
    """On CPU devices a snapshot would be host memory outside the budget: never taken."""
    tree = sync_tree(mesh)
    with dispatcher_cls(host_memory_budget=256 * KiB) as d:
        stats = d.save(tmp_path / "ckpt", tree).wait(60)
    assert stats.snapshot_bytes == 0


def test_snapshot_of_a_deleted_leaf_names_it(tmp_path, mesh, dispatcher_cls, monkeypatch):
    monkeypatch.setattr(dio.dispatcher, "NO_SNAPSHOT_PLATFORMS", ())
    tree = sync_tree(mesh)
    tree["w5"].delete()
    with dispatcher_cls(host_memory_budget=256 * KiB) as d:
        with pytest.raises(dio.WorkerError, match=r"\['w5'\]") as info:
            d.save(tmp_path / "ckpt", tree)
        assert info.value.keypath == "['w5']"
        assert not os.path.exists(tmp_path / "ckpt")


# ---- page cache: a checkpoint's bytes are not left cached --------------------------------------------

def resident_bytes(folder) -> int:
    """Bytes of the files under ``folder`` that are in the OS page cache (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            if size == 0:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
                total += sum(v & 1 for v in vec) * page
                libc.munmap(addr, size)
            finally:
                os.close(fd)
    return total


@pytest.mark.parametrize("layout", ["ocdbt", "files"])
@pytest.mark.parametrize("keep", [False, True])
def test_checkpoint_files_leave_the_page_cache(tmp_path, mesh, dispatcher_cls, layout, keep):
    """By default written (durable) and read files are dropped from the page cache batch by batch;
    keep_page_cache=True leaves them there."""
    tree = {f"w{i}": put(mesh, random_array(200 + i, (512, 512)), "data", "model") for i in range(4)}  # 4 MiB
    path = tmp_path / "ckpt"
    with dispatcher_cls(host_memory_budget=2 * MiB, layout=layout, keep_page_cache=keep) as d:
        d.save(path, tree).wait(60)
        after_save = resident_bytes(path / "arrays")
        restored = d.restore(path, abstract(tree))
        after_restore = resident_bytes(path / "arrays")
    assert_trees_bit_equal(tree, restored)
    if keep:  # the restore has just read every byte through the page cache
        assert after_restore >= 4 * MiB
    else:
        assert after_save < 256 * KiB and after_restore < 256 * KiB  # metadata and B-tree nodes at most


def test_page_cache_is_dropped_once_per_unchanged_file(tmp_path, monkeypatch):
    """After a write, each batch drops the page cache of the data files written since the last
    one: unchanged ones (earlier batches') are not dropped again, changed ones and small files
    (B-tree nodes, which commits read back) are; after a read, every file."""
    from dispatch_io.workers import page_cache, tensorstore_io
    from dispatch_io.workers.contract import IOSettings

    folder = tmp_path / "arrays"
    (folder / "d").mkdir(parents=True)
    big = page_cache.SKIP_UNCHANGED_FROM
    for name in ("a", "b"):
        (folder / "d" / name).write_bytes(b"x" * big)
    (folder / "d" / "node").write_bytes(b"n" * 4096)   # small: a B-tree node later commits read
    session = tensorstore_io.Session({"driver": "ocdbt", "base": {"driver": "file", "path": str(folder) + "/"}},
                                     IOSettings())
    dropped = []
    advise = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, *a: dropped.append(os.readlink(f"/proc/self/fd/{fd}"))
                        or advise(fd, *a))
    page_cache.release_page_cache(session, [], written=True)
    assert sorted(map(os.path.basename, dropped)) == ["a", "b", "node"]
    del dropped[:]
    (folder / "d" / "c").write_bytes(b"y" * big)
    with open(folder / "d" / "a", "ab") as f:   # grown since it was dropped
        f.write(b"z")
    page_cache.release_page_cache(session, [], written=True)
    assert sorted(map(os.path.basename, dropped)) == ["a", "c", "node"]
    del dropped[:]
    page_cache.release_page_cache(session, [], written=False)   # reads may cache any file again
    assert sorted(map(os.path.basename, dropped)) == ["a", "b", "c", "node"]


def test_a_save_leaves_no_host_copy_on_the_trainers_arrays(tmp_path, mesh, dispatcher_cls):
    """Small sharded leaves are copied whole, shard by shard: never through the whole array,
    whose host copy JAX would keep cached on the trainer's array for as long as it lives."""
    sharding = NamedSharding(mesh, P("data", "model"))
    tree = {f"l{i}": jax.device_put(np.full((64, 64), i, np.float32), sharding) for i in range(4)}
    with dispatcher_cls(host_memory_budget=8 << 20) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        assert all(x._npy_value is None for x in tree.values())   # JAX's cache of a host copy
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", tree), tree)
