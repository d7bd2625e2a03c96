"""Runs (``workers.runs``): a leaf sharded over the leading mesh axis is still stored one chunk
per shard, but the chunks a batch holds stacked along axis 0, back to back in staging, go to
TensorStore in one write."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
import storage_helpers as sh
import dispatch_io.workers.tensorstore_io
from dispatch_io import workers
from conftest import assert_trees_bit_equal
from dispatch_io.workers import ArraySpec, Region
from dispatch_io.workers.runs import address, runs

F32 = np.dtype(np.float32)


def _chunk(staging, offset, shape, dtype=F32):
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return staging[offset:offset + nbytes].view(dtype).reshape(shape)


def test_chunks_stacked_in_their_array_and_in_memory_become_one_region_and_view():
    staging = np.arange(1024, dtype=np.uint8)
    a = ArraySpec("a", (8, 8), "float32", (2, 4))
    regions = [Region(a, ((0, 2), (0, 4)), "['a']"), Region(a, ((2, 4), (0, 4)), "['a']"),
               Region(a, ((4, 6), (0, 4)), "['a']"), Region(a, ((0, 2), (4, 8)), "['a']")]
    buffers = [_chunk(staging, 32 * i, (2, 4)) for i in range(4)]
    merged, data = runs(regions, buffers)
    assert [r.bounds for r in merged] == [((0, 6), (0, 4)), ((0, 2), (4, 8))]
    assert [r.keypath for r in merged] == ["['a']", "['a']"]
    assert data[0].shape == (6, 4) and address(data[0]) == address(staging)   # a view, not a copy
    assert data[0].tobytes() == b"".join(b.tobytes() for b in buffers[:3])
    assert data[1] is buffers[3]


@pytest.mark.parametrize("case", ["gap", "other_memory", "other_array", "other_columns", "not_next_rows",
                                  "other_dtype", "strided", "0-d"])
def test_regions_that_do_not_continue_each_other_are_written_as_they_are(case):
    staging = np.zeros(1024, np.uint8)
    a, b = ArraySpec("a", (8, 8), "float32", (2, 4)), ArraySpec("b", (8, 8), "float32", (2, 4))
    first, second = Region(a, ((0, 2), (0, 4)), "['a']"), Region(a, ((2, 4), (0, 4)), "['a']")
    one, two = _chunk(staging, 0, (2, 4)), _chunk(staging, 32, (2, 4))
    if case == "gap":
        two = _chunk(staging, 64, (2, 4))
    elif case == "other_memory":
        two = np.zeros((2, 4), np.float32)
    elif case == "other_array":
        second = Region(b, second.bounds, "['b']")
    elif case == "other_columns":
        second = Region(a, ((2, 4), (4, 8)), "['a']")
    elif case == "not_next_rows":
        second = Region(a, ((4, 6), (0, 4)), "['a']")
    elif case == "other_dtype":
        two = _chunk(staging, 32, (2, 4), np.dtype(np.int32))
    elif case == "strided":
        one = staging[:64].view(F32).reshape(4, 4)[::2]
    elif case == "0-d":
        z = ArraySpec("z", (), "float32", ())
        first, second = Region(z, (), "['z']"), Region(z, (), "['z']")
        one, two = _chunk(staging, 0, ()), _chunk(staging, 4, ())
    merged, data = runs([first, second], [one, two])
    assert merged == [first, second] and data[0] is one and data[1] is two


def test_a_save_writes_each_stacked_column_of_shards_once_and_keeps_a_chunk_per_shard(tmp_path, mesh, monkeypatch,
                                                                                     layout):
    writes = []

    def counting(regions, buffers):
        merged = runs(regions, buffers)
        writes.append((len(regions), len(merged[0])))
        return merged

    monkeypatch.setattr(workers.tensorstore_io, "runs", counting)
    rng = np.random.default_rng(0)
    tree = {"w": jax.device_put(rng.standard_normal((64, 32), dtype=np.float32), NamedSharding(mesh, P("data", "model"))),
            "o": jax.device_put(rng.standard_normal((32, 64), dtype=np.float32), NamedSharding(mesh, P("model", "data")))}
    with dio.LocalDispatcher(host_memory_budget=64 << 20, layout=layout, small_leaf_bytes=0, progress=False) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", tree), tree)
    # 8 shards each; stacked 4 high ('data' on axis 0) and 2 high ('model' on axis 0).
    assert writes == [(16, 2 + 4)]
    assert set(sh.chunks(tmp_path / "ckpt", "['w']")) == {(i, j) for i in range(4) for j in range(2)}
    assert set(sh.chunks(tmp_path / "ckpt", "['o']")) == {(i, j) for i in range(2) for j in range(4)}


def test_an_interrupt_while_writing_returns_only_once_tensorstore_is_done_with_the_buffers(tmp_path, monkeypatch):
    """A KeyboardInterrupt (no Exception) between issuing the writes and their end still waits for
    them: the caller's next batch reuses the staging they read. Files layout: writes in flight."""
    n = 1 << 21   # 8 MiB float32 per array
    session = workers.tensorstore_io.Session.writer({"driver": "file", "path": f"{tmp_path}/"}, "p0",
                                                    workers.IOSettings(layout="files", checksums=True))
    specs = [ArraySpec(f"a{i}", (n,), "float32", (n,)) for i in range(6)]
    buffers = [np.full(n, i + 1, np.float32) for i in range(6)]

    def interrupt(buffer):
        raise KeyboardInterrupt

    monkeypatch.setattr(workers.tensorstore_io, "crc32c", interrupt)
    with pytest.raises(KeyboardInterrupt):
        workers.tensorstore_io.write_regions(session, [Region(s, ((0, n),), f"['a{i}']") for i, s in enumerate(specs)],
                                             buffers)
    sizes = [os.path.getsize(tmp_path / f"a{i}" / "c" / "0") for i in range(6)]   # right away: all written
    assert sizes == [4 * n] * 6
