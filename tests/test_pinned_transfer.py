"""The accelerator path, forced on CPU devices: device -> host through the ``pinned_host``
memory kind (``Options(host_transfer="pinned")``), and leaves offloaded to host memory kinds.

JAX's CPU backend has the ``pinned_host`` and ``unpinned_host`` memory kinds, so the code a GPU
runs is run here: every dtype and PRNG key impl bit for bit, pinned bytes in flight within the
budget (measured from the OS), failures named by key path, donation after ``on_transfer_end``.
"""

import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io.save import pinned_save, transfer
from conftest import assert_trees_bit_equal, hooked_dispatcher, host_bytes
from test_roundtrip import DEVICE_DTYPES, dtype_of, every_dtype_tree
from dispatch_io.jax_compat import single_device_sharding

MiB = 1 << 20
PINNED = dict(host_transfer="pinned")
# The pinned path of LocalDispatcher, and ColocatedDispatcher (whose move onto the colocated CPU
# devices is its device -> host copy) on the same trees.
FORCED = [(dio.LocalDispatcher, PINNED), (dio.ColocatedDispatcher, {})]
FORCED_IDS = ["local-pinned", "colocated"]


@pytest.fixture(params=FORCED, ids=FORCED_IDS)
def forced(request):
    cls, options = request.param
    return lambda budget=MiB, **more: cls(host_memory_budget=budget, progress=False, **options, **more)


def test_auto_is_pinned_only_off_cpu():
    cpu = jax.devices()[0]
    assert {m.kind for m in cpu.addressable_memories()} >= {"pinned_host", "unpinned_host"}
    assert transfer.resolve("auto", cpu) == "pageable"
    assert transfer.resolve("pinned", cpu) == "pinned" and transfer.resolve("pageable", cpu) == "pageable"
    with dio.LocalDispatcher(MiB) as d:
        assert d.runner.host_staging  # CPU keeps the staging ring path
    with dio.LocalDispatcher(MiB, **PINNED) as d:
        assert not d.runner.host_staging
    with pytest.raises(ValueError, match="host_transfer"):
        dio.Options(host_transfer="fast")
    with pytest.raises(ValueError, match="host_transfer"):
        dio.ColocatedDispatcher(MiB, **PINNED)
    # a runner built by hand: a typo is refused, not taken as "pinned"; options it would contradict too
    settings = dio.Options().io_settings()
    with pytest.raises(ValueError, match=r"transfer must be 'pageable' or 'pinned'.*'pinnned'"):
        dio.LocalRunner(settings, transfer="pinnned")
    with pytest.raises(ValueError, match=r"host_transfer='pinned'.*runner copies 'pageable'"):
        dio.Dispatcher(dio.Options(**PINNED), dio.LocalRunner(settings))


def test_every_dtype_and_key_impl_round_trips_bit_exact(forced, mesh, tmp_path):
    """One tree of every device dtype (sharded, a slice of a shard per chunk, single-device,
    replicated) and every PRNG key impl, under a budget that cuts the shards into chunks."""
    with jax.enable_x64(True):
        tree = every_dtype_tree(mesh, seed=0)
        with forced(budget=4096, max_chunk_bytes=256, small_leaf_bytes=0) as d:
            d.save(tmp_path / "ckpt", tree).wait()
            restored = d.restore(tmp_path / "ckpt", tree)
        assert_trees_bit_equal(tree, restored)
    assert {np.dtype(restored[n]["sharded"].dtype) for n in DEVICE_DTYPES} == {dtype_of(n) for n in DEVICE_DTYPES}


def test_a_failing_transfer_names_its_key_path(tmp_path, mesh):
    """A donated (deleted) leaf fails its device_put into pinned memory: the save fails naming it."""
    sharding = NamedSharding(mesh, P("data", "model"))
    tree = {f"l{i}": jax.device_put(np.full((64, 8), i, np.float32), sharding) for i in range(4)}
    tree["l2"].delete()
    with dio.LocalDispatcher(64 << 10, small_leaf_bytes=0, progress=False, **PINNED) as d:
        with pytest.raises(dio.WorkerError) as info:
            d.save(tmp_path / "ckpt", tree, priority=lambda k, s: dio.Priority.LOW).wait()
    assert info.value.keypath == "['l2']" and "deleted" in str(info.value), info.value
    assert not (tmp_path / "ckpt").exists()


def test_a_sync_save_returns_once_its_leaves_are_pinned_not_written(tmp_path, mesh):
    """save() returns while every write is still held back: the SYNC leaves are in pinned
    buffers, and the writes then finish from them."""
    sharding = NamedSharding(mesh, P("data", "model"))
    tree = {f"w{i}": jax.device_put(np.arange(4096, dtype=np.float32).reshape(64, 64) * i, sharding) for i in range(4)}
    release, writes = threading.Event(), []

    def held(regions):
        writes.append(len(regions))
        assert release.wait(60)

    with hooked_dispatcher(dio.LocalDispatcher, write_hook=held, host_memory_budget=MiB, progress=False,
                           **PINNED) as d:
        assert not d.runner.host_staging
        handle = d.save(tmp_path / "ckpt", tree)   # every leaf SYNC (the default)
        assert not handle.done()
        release.set()
        handle.wait()
        assert writes
        assert_trees_bit_equal(tree, d.restore(tmp_path / "ckpt", tree))


def test_donating_after_on_transfer_end_never_reaches_the_checkpoint(forced, mesh, tmp_path):
    """Each leaf is donated to a jitted step that overwrites its buffer as soon as its
    on_transfer_end fires; the checkpoint still holds the values it had at save()."""
    sharding = NamedSharding(mesh, P("data"))
    tree = {f"w{i}": jax.device_put(np.arange(4096, dtype=np.float32) + i, sharding) for i in range(6)}
    expected = {k: np.asarray(v).copy() for k, v in tree.items()}
    step = jax.jit(lambda x: x * 0 - 1, donate_argnums=0)
    stepped, errors, lock = {}, [], threading.Lock()

    def on_transfer_end(keypath):
        try:
            name = keypath[2:-2]
            out = step(tree[name])  # the buffer is donated: XLA may write the result into it
            out.block_until_ready()
            with lock:
                stepped[name] = out
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with forced(budget=32 << 10, max_chunk_bytes=4096, small_leaf_bytes=0) as d:
        d.save(tmp_path / "ckpt", tree, priority=lambda k, s: dio.Priority.LOW, on_transfer_end=on_transfer_end).wait()
        assert not errors and sorted(stepped) == sorted(tree)
        assert all(tree[k].is_deleted() and np.all(np.asarray(v) == -1) for k, v in stepped.items())
        restored = d.restore(tmp_path / "ckpt")
    assert_trees_bit_equal(expected, restored)


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_offloaded_leaves_save_without_the_device_and_restore_into_their_kind(forced, mesh, tmp_path, kind,
                                                                              monkeypatch):
    """Leaves in a host memory kind (an offloaded optimizer state) are copied on the host, never
    put through the device (no pinned transfer of them), and a target naming a memory kind gets it."""
    pinned_calls = []
    pinned = pinned_save.pinned
    monkeypatch.setattr(pinned_save, "pinned", lambda data: pinned_calls.append(data.sharding) or pinned(data))
    on_device = NamedSharding(mesh, P("data", "model"))
    offloaded = on_device.with_memory_kind(kind)
    tree = {"params": jax.device_put(np.arange(512, dtype=np.float32).reshape(64, 8), on_device),
            "mu": jax.device_put(np.arange(512, dtype=jnp.bfloat16).reshape(64, 8), offloaded),
            "nu": jax.device_put(np.linspace(0, 1, 64, dtype=np.float32), single_device_sharding(
                jax.devices()[1], memory_kind=kind))}
    with forced(budget=16 << 10, max_chunk_bytes=512, small_leaf_bytes=0) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        assert all(s.memory_kind == "device" for s in pinned_calls)
        back = d.restore(tmp_path / "ckpt", tree)
        assert_trees_bit_equal(tree, back)
        assert [back[k].sharding.memory_kind for k in ("params", "mu", "nu")] == ["device", kind, kind]
        # Into another kind than saved: the target decides.
        swapped = {"params": jax.ShapeDtypeStruct((64, 8), np.float32, sharding=offloaded),
                   "mu": jax.ShapeDtypeStruct((64, 8), jnp.bfloat16, sharding=on_device),
                   "nu": jax.ShapeDtypeStruct((64,), np.float32, sharding=single_device_sharding(jax.devices()[1]))}
        other = d.restore(tmp_path / "ckpt", swapped)
    assert [other[k].sharding.memory_kind for k in ("params", "mu", "nu")] == [kind, "device", "device"]
    assert all(host_bytes(other[k]) == host_bytes(tree[k]) for k in tree)


def test_pinned_bytes_in_flight_stay_within_the_budget(tmp_path):
    """A 256 MiB state saved through pinned memory under a 32 MiB budget, in a fresh process:
    the peak RSS (VmHWM, reset before the save) grows by at most the budget + 64 MiB, where
    pinning every chunk before writing would grow it by the state."""
    script = textwrap.dedent(f"""
        import jax, numpy as np
        import dispatch_io as dio
        status = lambda k: int(dict(l.split(":") for l in open("/proc/self/status").read().splitlines())[k].split()[0]) << 10
        mesh = jax.make_mesh((8,), ("d",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
        tree = {{f"w{{i}}": jax.device_put(np.full((4096, 2048), i, np.float32), sharding) for i in range(8)}}
        jax.block_until_ready(tree)
        growth = []
        with dio.LocalDispatcher(32 << 20, host_transfer="pinned", progress=False) as d:
            d.save({str(tmp_path)!r} + "/warm", {{"w": tree["w0"]}}).wait()   # first-use costs
            for n in range(2):   # pinned buffers are reused, not accumulated, across saves
                open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
                before = status("VmRSS")
                stats = d.save({str(tmp_path)!r} + f"/ckpt{{n}}", tree).wait()
                growth.append(status("VmHWM") - before)
            back = d.restore({str(tmp_path)!r} + "/ckpt1", tree)
        assert all(np.array_equal(np.asarray(back[k]), np.asarray(tree[k])) for k in tree)
        print(*growth, stats.bytes_written)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # On CPU devices the pinned buffers are malloc'ed; glibc's dynamic mmap threshold would keep
    # each freed 4 MiB shard in its heap (RSS then counts the allocator's cache, 70-110 MiB more,
    # not bytes in flight): a fixed threshold returns them to the OS as they are freed.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root, "MALLOC_MMAP_THRESHOLD_": str(MiB),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    *growth, written = map(int, out.stdout.split())
    assert written == 256 * MiB
    assert all(g <= 32 * MiB + 64 * MiB for g in growth), [g / MiB for g in growth]
