"""Restore through the dispatcher's read ring (``dispatch_io.read_ring``), the pinned path forced
on CPU devices: TensorStore reads into ring slots, regions are placed from there, the ring is
allocated once across restores, and host memory stays within what is restored plus the budget."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io import runner
from dispatch_io.jax_compat import single_device_sharding
from dispatch_io.read import ring as read_ring
from conftest import assert_trees_bit_equal
from test_roundtrip import DEVICE_DTYPES, every_dtype_tree

MiB = 1 << 20


def test_every_dtype_and_key_impl_round_trips_through_the_ring(mesh, tmp_path, monkeypatch):
    """Every device dtype and PRNG key impl, sharded, single-device and replicated, restored
    through ring slots (each placed region counted), and again into a target that names a host
    memory kind; the ring is made once for both restores."""
    placed = []
    place = read_ring._place
    monkeypatch.setattr(read_ring, "_place", lambda view, out, device: placed.append(view.nbytes) or
                        place(view, out, device))
    with jax.enable_x64(True):
        tree = every_dtype_tree(mesh, seed=2)
        with dio.LocalDispatcher(16 << 10, host_transfer="pinned", max_chunk_bytes=256, small_leaf_bytes=0,
                                 progress=False) as d:
            d.save(tmp_path / "ckpt", tree).wait()
            assert_trees_bit_equal(tree, d.restore(tmp_path / "ckpt", tree))
            assert len(placed) >= len(jax.tree_util.tree_leaves(tree))
            offloaded = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding.with_memory_kind("pinned_host")),
                {name: tree[name] for name in DEVICE_DTYPES})
            back = d.restore(tmp_path / "ckpt", offloaded, partial=True)
            assert d._read_ring.allocations == 1
    assert_trees_bit_equal({name: tree[name] for name in DEVICE_DTYPES}, back)
    assert {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(back)} == {"pinned_host"}


def test_three_batches_read_at_once(tmp_path, monkeypatch):
    """Reads are submitted three deep (a ring of four slots): no read finishes until three have
    been submitted, and the restore still completes (it would hang at a depth of two)."""
    submitted, lock, gate = [0], threading.Lock(), threading.Event()

    def held(self, items, out=None):
        with lock:
            submitted[0] += 1
            if submitted[0] >= 3:
                gate.set()

        def read():
            assert gate.wait(60), "fewer than three reads in flight"
            return runner.read_items(self._session, items, out)
        return self._threads.submit(read)

    monkeypatch.setattr(runner.LocalReader, "read", held)
    tree = {f"w{i}": jax.device_put(np.full((256, 64), i, np.float32), jax.devices()[i]) for i in range(8)}
    with dio.LocalDispatcher(256 << 10, host_transfer="pinned", small_leaf_bytes=0, progress=False) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        assert_trees_bit_equal(tree, d.restore(tmp_path / "ckpt", tree))
    assert submitted[0] == 8


def test_the_ring_is_allocated_once_and_restores_stay_within_the_budget(tmp_path):
    """20 restores of a 128 MiB state under a 32 MiB budget, in a fresh process: the ring is made
    once, each restore's peak RSS growth is at most the restored bytes + budget + 64 MiB, and
    the peak (VmHWM) is flat from the second restore on."""
    script = textwrap.dedent(f"""
        import gc, jax, numpy as np
        import dispatch_io as dio
        status = lambda k: int(dict(l.split(":") for l in open("/proc/self/status").read().splitlines())[k].split()[0]) << 10
        mesh = jax.make_mesh((8,), ("d",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
        tree = {{f"w{{i}}": jax.device_put(np.full((2048, 2048), i, np.float32), sharding) for i in range(8)}}
        target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        growth, peaks = [], []
        with dio.LocalDispatcher(32 << 20, host_transfer="pinned", progress=False) as d:
            d.save({str(tmp_path)!r} + "/ckpt", tree).wait()
            for n in range(20):
                gc.collect()
                open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
                before = status("VmRSS")
                back = d.restore({str(tmp_path)!r} + "/ckpt", target)
                jax.block_until_ready(back)
                growth.append(status("VmHWM") - before)
                peaks.append(status("VmHWM"))
                if n == 0:
                    assert all(np.array_equal(np.asarray(back[k]), np.asarray(tree[k])) for k in tree)
                del back
            allocations = d._read_ring.allocations
        print(allocations, max(growth), max(peaks[1:]) - min(peaks[1:]))
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # A fixed mmap threshold: freed multi-MiB arrays go back to the OS (test_pinned_transfer).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root, "MALLOC_MMAP_THRESHOLD_": str(MiB),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    allocations, growth, spread = map(int, out.stdout.split())
    assert allocations == 1
    assert growth <= 128 * MiB + 32 * MiB + 64 * MiB, growth / MiB
    assert spread <= 16 * MiB, spread / MiB


def test_a_restore_that_finds_the_ring_taken_reads_without_it(tmp_path, monkeypatch):
    """Two restores on one dispatcher at once: while the first holds the ring (its reads held
    back), the second completes bit-exact through fresh buffers (two sharing the slots could
    each wait for the other's); then the first completes through the ring."""
    placed, gate, holding = [], threading.Event(), threading.Event()
    place = read_ring._place
    monkeypatch.setattr(read_ring, "_place", lambda view, out, device: placed.append(1) or place(view, out, device))
    read = runner.LocalReader.read

    def held(self, items, out=None):
        if out is not None and threading.current_thread().name == "first":
            holding.set()
            assert gate.wait(60)
        return read(self, items, out)

    tree = {f"w{i}": jax.device_put(np.full((256, 64), i, np.float32), jax.devices()[i]) for i in range(4)}
    with dio.LocalDispatcher(256 << 10, host_transfer="pinned", small_leaf_bytes=0, progress=False) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        monkeypatch.setattr(runner.LocalReader, "read", held)
        results = {}
        first = threading.Thread(target=lambda: results.update(first=d.restore(tmp_path / "ckpt", tree)), name="first")
        first.start()
        assert holding.wait(60)
        second = d.restore(tmp_path / "ckpt", tree)
        assert placed == []   # the second went around the ring
        gate.set()
        first.join(60)
    assert_trees_bit_equal(tree, second)
    assert_trees_bit_equal(tree, results["first"])
    assert len(placed) == 4


def test_an_interrupted_restore_returns_no_slot_still_being_read_into(tmp_path, monkeypatch):
    """A restore interrupted (KeyboardInterrupt: no ``Exception``) while later batches are still
    being read into their slots returns only once those reads have ended -- a slot given back
    while TensorStore still writes into it would be read into by the next restore too -- and
    the next restore through the ring is bit-exact with every slot free after it."""
    read = runner.LocalReader.read
    calls, running, lock = [0], [0], threading.Lock()

    def interrupted(self, items, out=None):
        with lock:
            calls[0] += 1
            running[0] += 1   # from its submission: a read queued for a thread is one in flight too
            first = calls[0] == 1

        def run():
            try:
                if first:
                    raise KeyboardInterrupt
                time.sleep(1.0)   # the later reads are still running when the first has failed
                return runner.read_items(self._session, items, out)
            finally:
                with lock:
                    running[0] -= 1
        return self._threads.submit(run)

    tree = {f"w{i}": jax.device_put(np.full((256, 64), i, np.float32), jax.devices()[i]) for i in range(8)}
    with dio.LocalDispatcher(256 << 10, host_transfer="pinned", small_leaf_bytes=0, progress=False) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        monkeypatch.setattr(runner.LocalReader, "read", interrupted)
        with pytest.raises(KeyboardInterrupt):
            d.restore(tmp_path / "ckpt", tree)
        assert running[0] == 0 and calls[0] == 3
        monkeypatch.setattr(runner.LocalReader, "read", read)
        assert_trees_bit_equal(tree, d.restore(tmp_path / "ckpt", tree))
        ring = d._read_ring
        assert sorted(ring._free) == list(range(ring.slots))


def test_a_restore_that_casts_reads_through_the_ring(mesh, tmp_path):
    """``cast=True`` onto narrower and wider dtypes (float32 -> bfloat16, int32 -> int16,
    int16 -> float32) through ring slots: each region's slot view is its target's bytes, not
    the stored ones' (the stored width made 'cannot reshape' of a narrower target and would let a
    wider one run past its slot)."""
    sharded = NamedSharding(mesh, P("data", "model"))
    values = np.arange(64 * 32).reshape(64, 32) % 251   # exact in every dtype here
    tree = {"f32": jax.device_put(values.astype(np.float32), sharded),
            "i32": jax.device_put(values.astype(np.int32), sharded),
            "i16": jax.device_put(values.astype(np.int16), single_device_sharding(jax.devices()[6]))}
    wanted = {"f32": jnp.bfloat16, "i32": np.int16, "i16": np.float32}
    target = {k: jax.ShapeDtypeStruct(v.shape, wanted[k], sharding=NamedSharding(mesh, P("model")))
              for k, v in tree.items()}
    with dio.LocalDispatcher(64 << 10, host_transfer="pinned", max_chunk_bytes=1024, small_leaf_bytes=0,
                             progress=False) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        back = d.restore(tmp_path / "ckpt", target, cast=True)
    for k, x in back.items():
        assert x.dtype == np.dtype(wanted[k]) and x.sharding == target[k].sharding, k
        assert np.asarray(x).tobytes() == values.astype(wanted[k]).tobytes(), k
