"""The pinned save path with no device programs (``dispatch_io.pinned_save``), forced on CPU devices.

A shard that fits a batch is moved to ``pinned_host`` memory whole and written from numpy
views of it: no program is compiled or run for it. A shard larger than a batch is cut on the
device by one compiled program per leaf shape, whatever the offset. Counted with JAX's own
compile events (``jax.monitoring``) and the slices asked for.
"""

import jax
import jax.monitoring
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io.jax_compat import single_device_sharding
from dispatch_io.save import pinned_save
from dispatch_io.plan.batches import make_batches
from dispatch_io.plan.save_plan import plan_tree
from conftest import assert_trees_bit_equal
from test_roundtrip import DEVICE_DTYPES, every_dtype_tree, random_bits

MiB = 1 << 20
COMPILE = "/jax/core/compile/backend_compile_duration"


@pytest.fixture
def compiles():
    """The list of backend compiles JAX reports from now on (one entry each)."""
    seen: list = []
    listening = [True]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: seen.append(event) if listening[0] and event == COMPILE else None)
    yield seen
    listening[0] = False   # JAX has no way to unregister one listener


@pytest.fixture
def slices(monkeypatch):
    """Each (shape, slice) the pinned path cuts on the device (``pinned_save.slice_exact``) during the test."""
    seen = []
    real = pinned_save.slice_exact
    monkeypatch.setattr(pinned_save, "slice_exact", lambda data, local: seen.append((data.shape, local)) or
                        real(data, local))
    return seen


def _tree(mesh, rows: int):
    """Float leaves of shapes no other test uses (so nothing is compiled for them yet)."""
    sharding = NamedSharding(mesh, P("data", "model"))
    return {f"w{i}": jax.device_put(np.arange(rows * (i + 3) * 10, dtype=np.float32).reshape(rows, (i + 3) * 10),
                                    sharding) for i in range(3)}


def test_a_whole_shard_chunk_runs_no_device_program(mesh, tmp_path, compiles, slices):
    """Shards of 4 chunks each, which fit a batch: nothing compiled, nothing sliced on a device."""
    tree = _tree(mesh, 4 * 37)
    jax.block_until_ready(tree)
    before = len(compiles)
    with dio.LocalDispatcher(8 * MiB, host_transfer="pinned", progress=False, small_leaf_bytes=0,
                             max_chunk_bytes=37 * 5 * 4) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        assert len(compiles) == before and slices == []
        assert_trees_bit_equal(tree, d.restore(tmp_path / "ckpt", tree))


def test_a_shard_larger_than_a_batch_is_sliced_by_one_program_per_leaf(mesh, tmp_path, compiles, slices):
    """A budget whose batches hold a fraction of a shard: every chunk is a device slice, and JAX
    compiles one program per leaf shape and device -- 3 for three single-device leaves, not one
    per offset (10 or more chunks each) -- and 3 x 8 for the same leaves sharded over 8 devices."""
    rows = 160   # 16 chunks of 10 rows (600, 800, 1000 bytes) per leaf; batches of 2048 bytes
    single = single_device_sharding(jax.devices()[5])
    tree = {f"w{i}": jax.device_put(np.arange(rows * (i + 3) * 5, dtype=np.float32).reshape(rows, (i + 3) * 5)
                                    + 0.5, single) for i in range(3)}
    sharded = _tree(mesh, 4 * 40)   # shards of 40 rows of 60, 80, 100 bytes, 4 chunks each
    for k, (data, budget) in enumerate([(tree, 4096), (sharded, 4096)]):
        jax.block_until_ready(data)
        before, asked = len(compiles), len(slices)
        with dio.LocalDispatcher(budget, host_transfer="pinned", progress=False, small_leaf_bytes=0,
                                 max_chunk_bytes=1000, write_threads=1) as d:   # batches of 2048 bytes
            d.save(tmp_path / f"ckpt{k}", data).wait()
            assert_trees_bit_equal(data, d.restore(tmp_path / f"ckpt{k}", data))
        offsets = {tuple((sl.start, sl.stop) for sl in local) for _, local in slices[asked:]}
        assert len(slices) - asked > (3 * 8 if k == 0 else 3 * 24) and len(offsets) >= 4
        assert len(compiles) - before <= (3 if k == 0 else 24), len(compiles) - before


@pytest.mark.parametrize("cls,options", [(dio.LocalDispatcher, dict(host_transfer="pinned")),
                                         (dio.ColocatedDispatcher, {})], ids=["local-pinned", "colocated"])
def test_every_dtype_and_key_impl_bit_exact_through_whole_shards(mesh, tmp_path, cls, options):
    """Every device dtype and PRNG key impl, with shards cut into chunks that fit a batch whole
    (the views path), sharded, single-device and replicated."""
    with jax.enable_x64(True):
        tree = every_dtype_tree(mesh, seed=1, single=8, replicated=4, device=2)
        with cls(host_memory_budget=MiB, progress=False, max_chunk_bytes=24, small_leaf_bytes=0, **options) as d:
            d.save(tmp_path / "ckpt", tree).wait()
            assert_trees_bit_equal(tree, d.restore(tmp_path / "ckpt", tree))


def test_a_shards_chunks_share_a_batch_where_they_fit():
    """Planning (no IO): the chunks of one shard are never split between batches when the shard
    fits one, even where greedy packing would have cut it."""
    sharding = NamedSharding(jax.make_mesh((8,), ("d",)), P("d"))
    tree = {"a": jax.device_put(np.zeros((8 * 3, 16), np.float32), sharding),     # shards of 3 rows of 64 B
            "b": jax.device_put(np.zeros((8 * 10, 16), np.float32), sharding)}    # shards of 10 rows
    plan = plan_tree(tree, chunk_limit=64)   # a chunk per row
    batches = make_batches(plan, [dio.Priority.SYNC] * 2, limit=768, whole_shards=True)
    shard_of = lambda c: (c.leaf, c.device)  # noqa: E731 - one shard per (leaf, device) here
    where = {}
    for k, batch in enumerate(batches):
        for i in batch.chunks:
            where.setdefault(shard_of(plan.chunks[i]), set()).add(k)
    assert all(len(ks) == 1 for ks in where.values()), where
    assert all(b.nbytes <= 768 for b in batches) and len(batches) == 2 + 8
    packed = make_batches(plan, [dio.Priority.SYNC] * 2, limit=768)   # the pageable path: as full as they go
    assert len(packed) == -(-len(plan.chunks) * 64 // 768) < len(batches)


def test_a_sync_save_starts_the_next_batch_before_awaiting_this_one(mesh, tmp_path, monkeypatch):
    """Every batch but the first is started before the one before it is awaited (all SYNC),
    and the save is still bit-exact; with a failure in one batch's transfer the save fails
    naming that leaf and nothing is left started."""
    events = []
    start, finish = pinned_save.start, pinned_save.PinnedBatch.finish

    def started(plan, chunks, sources):
        batch = start(plan, chunks, sources)
        batch.label = len([e for e in events if e[0] == "start"])
        events.append(("start", batch.label))
        return batch

    def finished(self):   # also called by a start that failed (no label): not counted
        events.append(("finish", getattr(self, "label", None)))
        return finish(self)

    monkeypatch.setattr(pinned_save, "start", started)
    monkeypatch.setattr(pinned_save.PinnedBatch, "finish", finished)
    sharding = NamedSharding(mesh, P("data", "model"))
    tree = {f"w{i}": jax.device_put(np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024) * i, sharding)
            for i in range(6)}   # 4 MiB each
    # Batches of 8 MiB (64 MiB / (7 + 1)): the ring always has room for the next one.
    with dio.LocalDispatcher(64 * MiB, host_transfer="pinned", write_threads=7, small_leaf_bytes=0,
                             progress=False) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        batches = len([e for e in events if e[0] == "start"])
        assert batches >= 3
        for k in range(batches - 1):
            assert events.index(("start", k + 1)) < events.index(("finish", k)), events
        assert_trees_bit_equal(tree, d.restore(tmp_path / "ckpt", tree))
        tree["w3"].delete()   # its transfer fails
        events.clear()
        with pytest.raises(dio.WorkerError) as info:
            d.save(tmp_path / "broken", tree).wait()
    assert info.value.keypath == "['w3']"
    assert sorted(e[1] for e in events if e[0] == "start") == sorted(
        e[1] for e in events if e[0] == "finish" and e[1] is not None)


def test_growing_the_pinned_pool_leaves_nothing_allocated():
    """``pinned_pool.grow`` (run by a pinned-path LocalDispatcher on an accelerator) allocates
    the bytes in the ``pinned_host`` kind and frees them: on a CPU device, where it can run, no
    live array is left behind."""
    from dispatch_io.save import pinned_pool
    before = len(jax.live_arrays())
    assert pinned_pool.grow(jax.devices()[0], 4 * MiB) > 0
    assert pinned_pool.grow(jax.devices()[0], 0) == 0
    assert len(jax.live_arrays()) == before



def test_every_dtype_bit_exact_through_device_slices(tmp_path, slices):
    """Every device dtype (NaN payloads of the narrow floats included) through the device-slice
    path: shards of several batches (2 KiB), so their chunks are cut on the device. JAX 0.12's CPU
    backend quiets float8_e5m2 NaN payloads in a ``dynamic_slice`` of the float itself."""
    single = single_device_sharding(jax.devices()[3])
    with jax.enable_x64(True):
        tree = {name: jax.device_put(random_bits(name, (1024, 8), seed=len(name) + 7), single)
                for name in DEVICE_DTYPES}
        with dio.LocalDispatcher(4096, host_transfer="pinned", progress=False, small_leaf_bytes=0,
                                 max_chunk_bytes=256, write_threads=1) as d:
            d.save(tmp_path / "ckpt", tree).wait()
            assert {shape for shape, _ in slices} == {(1024, 8)} and len(slices) >= 4 * len(tree)
            assert_trees_bit_equal(tree, d.restore(tmp_path / "ckpt", tree))


def test_a_batch_whose_hand_over_raises_leaves_no_staging_held(mesh, tmp_path, monkeypatch):
    """Handing batch k to its writer raises (here the writer refusing work, as a shut-down pool
    does) while batch k+1's transfers are started: the save fails, batch k+1 is awaited and its
    staging room given back -- a ticket left held in the ring would block every later save of
    the dispatcher once the ring wraps around to it -- and the next save is bit-exact."""
    from dispatch_io import runner
    write, calls = runner.LocalWriter.write, [0]

    def refusing(self, regions, buffers):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("cannot schedule new futures after shutdown")
        return write(self, regions, buffers)

    sharding = NamedSharding(mesh, P("data", "model"))
    tree = {f"w{i}": jax.device_put(np.arange(1 << 18, dtype=np.float32).reshape(512, 512) + i, sharding)
            for i in range(6)}   # 1 MiB each; batches of 2 MiB
    with dio.LocalDispatcher(8 * MiB, host_transfer="pinned", write_threads=3, small_leaf_bytes=0,
                             progress=False) as d:
        monkeypatch.setattr(runner.LocalWriter, "write", refusing)
        with pytest.raises(Exception, match="cannot schedule new futures"):
            d.save(tmp_path / "broken", tree).wait()
        assert d._ring.in_use == 0 and not d._ring._live
        monkeypatch.setattr(runner.LocalWriter, "write", write)
        d.save(tmp_path / "ckpt", tree).wait()
        assert_trees_bit_equal(tree, d.restore(tmp_path / "ckpt", tree))
