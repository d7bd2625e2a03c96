"""A restore puts each device result on its devices as soon as its last region is read: the
host-to-device transfers of one batch overlap the reading of the next, and a batch's host
buffers are released before another read is submitted."""

import threading

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io.read import loop as reading
from conftest import assert_trees_bit_equal


def test_each_leaf_is_placed_before_the_reads_two_batches_on(tmp_path, mesh, monkeypatch, dispatcher_cls):
    sharding = NamedSharding(mesh, P("data", "model"))
    tree = {f"w{i}": jax.device_put(np.arange(8192, dtype=np.float32).reshape(256, 32) + i, sharding)
            for i in range(6)}
    events, lock = [], threading.Lock()
    finish = reading.finish

    def placed(out):
        with lock:
            events.append(("placed", out.saved.keypath))
        return finish(out)

    submit = reading.RegionReads.submit

    def submitted(self, batch):  # recorded as the read is submitted, on the restoring thread (IO threads
        with lock:                # run reads in any order)
            events.append(("read", tuple(sorted({p[0].keypath for _, _, item in batch for p in item.pieces}))))
        return submit(self, batch)

    monkeypatch.setattr(reading, "finish", placed)
    monkeypatch.setattr(reading.RegionReads, "submit", submitted)
    # 32 KiB a leaf, batches of half the 64 KiB budget: one leaf a batch.
    with dispatcher_cls(host_memory_budget=64 << 10, small_leaf_bytes=0, progress=False) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        restored = d.restore(tmp_path / "ckpt", tree)
    assert_trees_bit_equal(tree, restored)
    reads = [e for e in events if e[0] == "read"]
    assert [r[1] for r in reads] == [(f"['w{i}']",) for i in range(6)]
    for i in range(4):  # w_i is placed before the read of w_{i+2} is submitted
        assert events.index(("placed", f"['w{i}']")) < events.index(("read", (f"['w{i + 2}']",))), events
