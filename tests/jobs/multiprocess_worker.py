"""One process of a multi-process dispatch_io test (run by tests/test_multiprocess.py).

    python multiprocess_worker.py SCENARIO PROCESS_ID NUM_PROCESSES PORT PATH

The harness sets XLA_FLAGS (devices per process) and JAX_PLATFORMS=cpu. With NUM_PROCESSES > 1
the process joins a ``jax.distributed`` job whose coordinator (process 0) listens on
127.0.0.1:PORT; with 1 it runs alone, without jax.distributed. Every process builds the same
global arrays from the same host data (each supplies only its own shards), runs SCENARIO and
prints one line ``RESULT {json}`` to stdout. Checks that need every process's view (bytes
written, error messages) are made by the test from these results; byte comparisons of restored
shards are made here, where the shards are, and reported as ``mismatches``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dispatch_io as dio
from dispatch_io.workers import ChunkError
from dispatch_io.jax_compat import single_device_sharding

BARRIER_TIMEOUT = float(os.environ.get("DIO_TEST_BARRIER_TIMEOUT", "30"))


# ---- the saved tree -------------------------------------------------------------------------------

def entries(big: bool = False) -> dict:
    """{name: (host data, how it is placed)}. Placement: a PartitionSpec over the (4, 2) mesh,
    "device5" (a SingleDeviceSharding on jax.devices()[5]), "numpy" (a host leaf) or
    ("key", impl, spec) for a typed PRNG key array whose key_data is the host data."""
    rng = np.random.default_rng(1234)
    # big: each of the four main arrays is 1 MiB (so 64 chunks of 16 KiB in the "shares" scenario)
    shape = (lambda small: (512, 512)) if big else (lambda small: small)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    keys = lambda impl: rng.integers(0, 2**32, (8, 4 if impl == "rbg" else 2), dtype=np.uint32)
    return {
        "w": (f32(*shape((64, 32))), P("data", "model")),
        "emb": (f32(*shape((64, 32))), P("data")),
        "proj": (f32(*shape((16, 64))), P(None, "model")),
        "rep": (f32(*shape((32, 64))), P()),
        "single": (f32(6, 5), "device5"),
        "rng": (keys("threefry2x32"), ("key", "threefry2x32", P("data"))),
        "rng_rbg": (keys("rbg"), ("key", "rbg", P("data"))),
        "opt": {
            "mu": (rng.standard_normal((8, 6)).astype(jnp.bfloat16), P("data", "model")),
            "count": (rng.integers(-128, 128, (4, 10), dtype=np.int8), P(None, "model")),
        },
        "mask": (rng.random((12, 4)) < 0.5, P(None, "model")),
        "host_stats": (np.arange(5, dtype=np.float64) / 3, "numpy"),
    }


SCALARS = {"step": 1000, "lr": 0.1 + 2**-40, "done": False, "name": "run-α"}

is_entry = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], np.ndarray)


def _sharding(mesh, placement):
    if isinstance(placement, tuple):  # a key: its key_data has one more (unsharded) axis
        placement = placement[2]
    if placement == "device5":
        return single_device_sharding(jax.devices()[5])
    return NamedSharding(mesh, placement)


def build(mesh, table) -> dict:
    """The concrete tree: global arrays whose addressable shards come from the host data."""
    def leaf(entry):
        host, placement = entry
        if placement == "numpy":
            return host
        # Only shards on this process's devices are kept (a "device5" array is global: its
        # one shard lives on the process owning jax.devices()[5]).
        array = jax.make_array_from_callback(host.shape, _sharding(mesh, placement), lambda index: host[index],
                                             dtype=host.dtype)
        if isinstance(placement, tuple):
            array = jax.random.wrap_key_data(array, impl=placement[1])
        return array
    tree = jax.tree.map(leaf, table, is_leaf=is_entry)
    tree.update(SCALARS)
    return tree


def abstract(mesh, table) -> dict:
    """A restore target naming only shapes, dtypes and shardings (numpy leaves: a numpy array)."""
    def leaf(entry):
        host, placement = entry
        if placement == "numpy":
            return np.zeros_like(host)
        if isinstance(placement, tuple):
            dtype = jax.random.key(0, impl=placement[1]).dtype
            return jax.ShapeDtypeStruct(host.shape[:-1], dtype, sharding=_sharding(mesh, placement))
        return jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=_sharding(mesh, placement))
    tree = jax.tree.map(leaf, table, is_leaf=is_entry)
    tree.update(SCALARS)
    return tree


def stored_nbytes(table) -> int:
    """Bytes the checkpoint stores for the arrays: every leaf once (keys as key_data)."""
    return sum(host.nbytes for host, _ in jax.tree.leaves(table, is_leaf=is_entry))


def compare(restored, mesh, table) -> tuple[int, list[str]]:
    """(shards checked, mismatches) of the restored tree against the host data."""
    checked, bad = 0, []
    flat_table = dict(_flat_entries(table))
    flat_out = dict(dio.tree.flatten(restored)[0])
    for keypath, (host, placement) in flat_table.items():
        out = flat_out.get(keypath)
        if placement == "numpy":
            checked += 1
            if not (isinstance(out, np.ndarray) and out.dtype == host.dtype and out.tobytes() == host.tobytes()):
                bad.append(f"{keypath}: numpy leaf differs: {out!r}")
            continue
        if not isinstance(out, jax.Array):
            bad.append(f"{keypath}: restored as {type(out).__name__}")
            continue
        if isinstance(placement, tuple):
            if str(jax.random.key_impl(out)) != str(jax.random.key_impl(jax.random.key(0, impl=placement[1]))):
                bad.append(f"{keypath}: key impl {jax.random.key_impl(out)}")
            out = jax.random.key_data(out)
        if out.shape != host.shape or out.dtype != host.dtype:
            bad.append(f"{keypath}: {out.dtype}{out.shape}, expected {host.dtype}{host.shape}")
            continue
        if not out.sharding.is_equivalent_to(_sharding(mesh, placement) if not isinstance(placement, tuple)
                                             else NamedSharding(mesh, placement[2]), out.ndim):
            bad.append(f"{keypath}: sharding {out.sharding}")
        for shard in out.addressable_shards:
            checked += 1
            if np.asarray(shard.data).tobytes() != np.ascontiguousarray(host[shard.index]).tobytes():
                bad.append(f"{keypath}: shard {shard.index} on {shard.device} differs")
    for name, value in SCALARS.items():
        got = restored.get(name)
        if type(got) is not type(value) or got != value:
            bad.append(f"['{name}']: scalar {got!r}, expected {value!r}")
    return checked, bad


def _flat_entries(table, prefix=""):
    for name, value in table.items():
        keypath = f"{prefix}['{name}']"
        if is_entry(value):
            yield keypath, value
        else:
            yield from _flat_entries(value, keypath)


# ---- helpers ------------------------------------------------------------------------------------

def os_bytes_written() -> int:
    """Bytes this process has passed to write(2)-like calls so far (all threads; Linux)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def error_fields(exc: BaseException) -> dict:
    return {"error_type": type(exc).__name__, "error_message": str(exc),
            "processes": getattr(exc, "processes", None), "worker": getattr(exc, "worker", None),
            "keypath": getattr(exc, "keypath", None),
            "is_worker_error": isinstance(exc, dio.WorkerError),
            "is_barrier_timeout": isinstance(exc, dio.BarrierTimeoutError)}


def sync(name: str, timeout_ms: int = 60_000):
    """Line the processes up (through the coordination service, not a device collective)."""
    if jax.process_count() > 1:
        from jax._src.distributed import global_state
        global_state.client.wait_at_barrier(f"dio-test/{name}", timeout_ms)


class TallyRunner(dio.LocalRunner):
    """The LocalRunner, counting the bytes written and read per key path (``written``, ``read``);
    while ``fail_keypath`` is set, a batch holding that leaf fails with ``error()`` as the real
    worker fails: a ChunkError naming the leaf (reads too, or only reads with
    ``fail_reads_only``). ``stall_read`` (keypath, seconds): the first read holding that leaf
    sleeps first; ``stall_checksums`` (seconds): the first checksum call (verify) sleeps first."""

    def __init__(self, settings, fail_keypath=None, error=lambda: ValueError("injected")):
        super().__init__(settings)
        self.fail_keypath, self.error, self.written, self.read = fail_keypath, error, {}, {}
        self.stall_read = self.stall_checksums = None

    def open_reader(self, kvstore, context):
        reader = super().open_reader(kvstore, context)
        real_read, real_checksums = reader.read, reader.checksums

        def checksums(regions):
            if self.stall_checksums:
                time.sleep(self.stall_checksums)
                self.stall_checksums = None
            return real_checksums(regions)
        reader.checksums = checksums

        def read(items):
            keypaths = {item.keypath for item in items}
            if self.fail_keypath in keypaths:
                cause = self.error()
                error = ChunkError(self.fail_keypath, (), cause)
                error.__cause__ = cause
                failed = concurrent.futures.Future()
                failed.set_exception(error)
                return failed
            if self.stall_read and self.stall_read[0] in keypaths:
                time.sleep(self.stall_read[1])
                self.stall_read = None
            for item in items:
                self.read[item.keypath] = self.read.get(item.keypath, 0) + item.nbytes
            return real_read(items)
        reader.read = read
        return reader

    def open_writer(self, target):
        writer = super().open_writer(target)
        real_write = writer.write

        def write(regions, buffers):
            for region in regions:
                if region.keypath == self.fail_keypath:
                    cause = self.error()
                    failed = concurrent.futures.Future()
                    error = ChunkError(region.keypath, region.bounds, cause)
                    error.__cause__ = cause
                    failed.set_exception(error)
                    return failed
            future = real_write(regions, buffers)

            def count(f):  # runs before the save's own bookkeeping (added first)
                if f.exception() is None:
                    for region, buf in zip(regions, buffers):
                        self.written[region.keypath] = self.written.get(region.keypath, 0) + int(buf.nbytes)
            future.add_done_callback(count)
            return future
        writer.write = write
        return writer


def os_bytes_read() -> int:
    """Bytes this process has received from read(2)-like calls so far (all threads; Linux)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def tallying_dispatcher(fail_keypath=None, error=lambda: ValueError("injected"), **options):
    """(a Dispatcher on a TallyRunner, the runner); ``options`` as LocalDispatcher's."""
    options = dio.Options(**{"host_memory_budget": 1 << 20, "barrier_timeout": BARRIER_TIMEOUT, **options})
    runner = TallyRunner(options.io_settings(), fail_keypath, error)
    return dio.Dispatcher(options, runner), runner


def restore_and_compare(d, path, target, mesh, table, verify=False) -> dict:
    """Restore ``target`` and compare it with the host data, reported as checked / mismatches.
    (The "device5" leaf has no shard on most processes: they get a global array all the same.)"""
    restored = d.restore(path, target, verify=verify)
    checked, bad = compare(restored, mesh, table)
    without = [k for k, x in dio.tree.flatten(restored)[0] if isinstance(x, jax.Array) and not x.addressable_shards]
    return {"checked": checked, "mismatches": bad, "without_local_shards": without}


# ---- scenarios ----------------------------------------------------------------------------------

def roundtrip(mesh, path):
    """Save, then restore with the tree itself as target; compare every addressable shard."""
    table = entries()
    tree = build(mesh, table)
    with dio.LocalDispatcher(host_memory_budget=1 << 20, barrier_timeout=BARRIER_TIMEOUT) as d:
        stats = d.save(path, tree).wait()
        checks = restore_and_compare(d, path, tree, mesh, table)
    return {"bytes_written": stats.bytes_written, "total_bytes": stored_nbytes(table), **checks}


def save_only(mesh, path):
    """Save with per-chunk checksums (each process computes its own chunks'; process 0 writes all)."""
    table = entries()
    with dio.LocalDispatcher(host_memory_budget=1 << 20, barrier_timeout=BARRIER_TIMEOUT, checksums=True) as d:
        stats = d.save(path, build(mesh, table)).wait()
    return {"bytes_written": stats.bytes_written, "total_bytes": stored_nbytes(table)}


def restore_only(mesh, path):
    """Restore onto ShapeDtypeStructs over this job's own mesh (whatever saved it), verifying
    every chunk read against the checksums in the manifest."""
    table = entries()
    with dio.LocalDispatcher(host_memory_budget=1 << 20, barrier_timeout=BARRIER_TIMEOUT) as d:
        return restore_and_compare(d, path, abstract(mesh, table), mesh, table, verify=True)


def restore_orbax(mesh, path):
    """Restore a checkpoint Orbax wrote (from the same table, by one process) onto this job's mesh."""
    table = entries()
    with dio.LocalDispatcher(host_memory_budget=1 << 20, barrier_timeout=BARRIER_TIMEOUT) as d:
        return restore_and_compare(d, path, abstract(mesh, table), mesh, table)


def shares(mesh, path):
    """A 4 MiB tree in 16 KiB chunks: who writes what, by dispatch_io's count and the OS's."""
    table = entries(big=True)
    tree = build(mesh, table)
    d, runner = tallying_dispatcher(max_chunk_bytes=16 << 10)
    written = runner.written
    with d:
        sync("shares")
        before = os_bytes_written()
        stats = d.save(path, tree).wait()
        os_written = os_bytes_written() - before
        checks = restore_and_compare(d, path, tree, mesh, table)
    return {"bytes_written": stats.bytes_written, "batches": stats.batches, "os_written": os_written,
            "per_keypath": written, "total_bytes": stored_nbytes(table),
            "array_bytes": {k: h.nbytes for k, (h, _) in _flat_entries(table)}, **checks}


def scaleout(mesh, path):
    """A 4 MiB tree with replicated, model-sharded (held by every process) and data-sharded
    (held by one) leaves and a numpy leaf, restored with and without the broadcast: bytes read
    by dispatch_io's count (per key path) and the OS's, bytes received, every shard compared."""
    table = entries(big=True)
    tree = build(mesh, table)
    out = {"total_bytes": stored_nbytes(table), "array_bytes": {k: h.nbytes for k, (h, _) in _flat_entries(table)}}
    with dio.LocalDispatcher(host_memory_budget=1 << 20, barrier_timeout=BARRIER_TIMEOUT, checksums=True) as d:
        d.save(path, tree).wait()
    target = abstract(mesh, table)
    for broadcast in (True, False):
        d, runner = tallying_dispatcher(max_chunk_bytes=64 << 10, restore_broadcast=broadcast)
        with d:
            sync(f"scaleout/{broadcast}")
            before = os_bytes_read()
            checks = restore_and_compare(d, path, target, mesh, table)
            stats = d.last_restore_stats
            out["on" if broadcast else "off"] = {
                "os_read": os_bytes_read() - before, "per_keypath": runner.read, "bytes_read": stats.bytes_read,
                "bytes_broadcast": stats.bytes_broadcast, **checks}
    with dio.LocalDispatcher(host_memory_budget=1 << 20, barrier_timeout=BARRIER_TIMEOUT) as d:
        out["verified"] = restore_and_compare(d, path, target, mesh, table, verify=True)
        out["replicated"] = restore_replicated(d, path, mesh, table)
    return out


def restore_replicated(d, path, mesh, table) -> dict:
    """A partial restore (no ['opt']) onto a different replica structure: every array leaf,
    PRNG keys too, replicated over the whole mesh; every shard compared with the host data."""
    flat = {k: v for k, v in _flat_entries(table) if not k.startswith("['opt']") and v[1] not in ("numpy", "device5")}
    replicated = NamedSharding(mesh, P())
    target = {}
    for keypath, (host, placement) in flat.items():
        name = keypath[2:-2]
        if isinstance(placement, tuple):
            target[name] = jax.ShapeDtypeStruct(host.shape[:-1], jax.random.key(0, impl=placement[1]).dtype,
                                                sharding=replicated)
        else:
            target[name] = jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=replicated)
    restored = d.restore(path, target, partial=True)
    bad, checked = [], 0
    for name, out in restored.items():
        host = flat[f"['{name}']"][0]
        if jax.dtypes.issubdtype(out.dtype, jax.dtypes.prng_key):
            out = jax.random.key_data(out)
        for shard in out.addressable_shards:
            checked += 1
            if np.asarray(shard.data).tobytes() != host.tobytes():
                bad.append(f"{name} on {shard.device}")
    return {"checked": checked, "mismatches": bad, "bytes_read": d.last_restore_stats.bytes_read,
            "bytes_broadcast": d.last_restore_stats.bytes_broadcast}


def restore_colocated(mesh, path):
    """Save the 4 MiB tree, then restore it with a ColocatedDispatcher (broadcast on)."""
    from dispatch_io.colocated import ColocatedDispatcher

    table = entries(big=True)
    with dio.LocalDispatcher(host_memory_budget=1 << 20, barrier_timeout=BARRIER_TIMEOUT) as d:
        d.save(path, build(mesh, table)).wait()
    with ColocatedDispatcher(host_memory_budget=1 << 20, max_chunk_bytes=64 << 10,
                             barrier_timeout=BARRIER_TIMEOUT) as d:
        checks = restore_and_compare(d, path, abstract(mesh, table), mesh, table)
        return {"bytes_read": d.last_restore_stats.bytes_read, "total_bytes": stored_nbytes(table), **checks}


def scaleout_crossing(mesh, path):
    """Two dispatchers in each process restore two checkpoints of the same shapes at once, from
    two threads: each restore gives the right bytes or raises -- never another's data."""
    table = entries(big=True)
    tree = build(mesh, table)
    swapped = {k: np.ascontiguousarray(h[::-1]) if not isinstance(p, tuple) else h for k, (h, p) in
               _flat_entries(table)}
    other = jax.tree.map(lambda x: x, table, is_leaf=is_entry)
    for keypath, host in swapped.items():   # the second checkpoint: the first's rows reversed
        node = other
        names = keypath[2:-2].split("']['")
        for name in names[:-1]:
            node = node[name]
        node[names[-1]] = (host, node[names[-1]][1])
    with dio.LocalDispatcher(host_memory_budget=1 << 20, barrier_timeout=BARRIER_TIMEOUT) as d:
        d.save(f"{path}/a", tree).wait()
        d.save(f"{path}/b", build(mesh, other)).wait()
    sync("crossing")
    outcomes = {}

    def restore(name, which):
        with dio.LocalDispatcher(host_memory_budget=1 << 20, max_chunk_bytes=64 << 10,
                                 barrier_timeout=BARRIER_TIMEOUT) as d:
            try:
                checks = restore_and_compare(d, f"{path}/{name}", abstract(mesh, which), mesh, which)
                outcomes[name] = "right" if not checks["mismatches"] else "wrong"
            except Exception as exc:  # noqa: BLE001 - an error is an acceptable outcome, wrong data is not
                outcomes[name] = type(exc).__name__

    threads = [threading.Thread(target=restore, args=args) for args in (("a", table), ("b", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"outcomes": outcomes}


def save_big(mesh, path):
    """Save the 4 MiB tree (the one ``restore_big`` restores), with checksums where
    DIO_TEST_CHECKSUMS=1."""
    table = entries(big=True)
    with dio.LocalDispatcher(host_memory_budget=1 << 20, barrier_timeout=BARRIER_TIMEOUT,
                             checksums=os.environ.get("DIO_TEST_CHECKSUMS") == "1") as d:
        stats = d.save(path, build(mesh, table)).wait()
    return {"bytes_written": stats.bytes_written, "total_bytes": stored_nbytes(table)}


def verify(mesh, path):
    """``Dispatcher.verify`` of the checkpoint at ``path`` in 64 KiB batches: the bytes this
    process checked, by dispatch_io's count and the OS's, or what it raised (every process
    stays up until all have returned)."""
    with dio.LocalDispatcher(host_memory_budget=128 << 10, barrier_timeout=BARRIER_TIMEOUT) as d:
        sync("verify")
        before = os_bytes_read()
        try:
            stats = d.verify(path)
            out = {"bytes_read": stats.bytes_read, "verified": stats.verified}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out = error_fields(exc)
            out["chunk_is_tuple"] = isinstance(getattr(exc, "chunk", ()), tuple)
        out.update(os_read=os_bytes_read() - before, total_bytes=stored_nbytes(entries(big=True)))
        sync("verify/done")
    return out


def verify_stalls(mesh, path):
    """Process 1's verify stalls past the barrier timeout; then both verify again (``retry``)."""
    d, runner = tallying_dispatcher()
    if jax.process_index() == 1:
        runner.stall_checksums = BARRIER_TIMEOUT + 2
    out = {}
    with d:
        sync("verify_stalls")
        try:
            d.verify(path)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out = error_fields(exc)
        sync("verify_stalls/failed", timeout_ms=int(4 * BARRIER_TIMEOUT * 1000))
        out["retry"] = d.verify(path).verified
    return out


def restore_big(mesh, path):
    """Restore the 4 MiB tree with the broadcast on, or off where DIO_TEST_BROADCAST=0."""
    table = entries(big=True)
    broadcast = os.environ.get("DIO_TEST_BROADCAST", "1") == "1"
    with dio.LocalDispatcher(host_memory_budget=1 << 20, max_chunk_bytes=64 << 10, barrier_timeout=BARRIER_TIMEOUT,
                             restore_broadcast=broadcast) as d:
        checks = restore_and_compare(d, path, abstract(mesh, table), mesh, table)
        return {"bytes_read": d.last_restore_stats.bytes_read, "seconds": d.last_restore_stats.total_seconds, **checks}


def loopback_bytes() -> int:
    """Bytes the loopback interface has received so far (``lo`` in /proc/net/dev; every byte
    sent over it is received once, so this is also what was sent). Machine-wide."""
    with open("/proc/net/dev") as f:
        return int(next(line for line in f if line.strip().startswith("lo:")).split(":")[1].split()[0])


def scaleout_fsdp(mesh, path):
    """8 processes x 1 device, mesh ("data", "fsdp") = (2, 4): a 32 MiB state (8 leaves of
    4 MiB) sharded over fsdp, replicated over data, so each region is held by two processes.
    Saved in 256 KiB chunks, then restored with the broadcast on: every shard compared; this process's bytes
    read, received and sent (RestoreStats) beside the bytes of the regions it holds; and
    (process 0) the loopback interface's bytes over the restore, all processes lined up."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    rng = np.random.default_rng(27)
    table = {f"layer{i}": (rng.standard_normal((1024, 1024)).astype(np.float32), P("fsdp")) for i in range(8)}
    with dio.LocalDispatcher(host_memory_budget=8 << 20, max_chunk_bytes=256 << 10, barrier_timeout=BARRIER_TIMEOUT) as d:
        d.save(path, build(mesh, table)).wait()
    target = abstract(mesh, table)
    held = sum(int(np.prod(shard.data.shape)) * 4 for leaf in jax.tree.leaves(build(mesh, table))
               if isinstance(leaf, jax.Array) for shard in leaf.addressable_shards)
    with dio.LocalDispatcher(host_memory_budget=4 << 20, max_chunk_bytes=256 << 10,
                             barrier_timeout=BARRIER_TIMEOUT) as d:
        sync("fsdp/before")
        before = loopback_bytes()
        checks = restore_and_compare(d, path, target, mesh, table)
        sync("fsdp/after")
        moved = loopback_bytes() - before
        stats = d.last_restore_stats
    return {"total_bytes": stored_nbytes(table), "held": held, "bytes_read": stats.bytes_read,
            "bytes_received": getattr(stats, "bytes_received", stats.bytes_broadcast),
            "bytes_sent": getattr(stats, "bytes_sent", None), "loopback": moved, **checks}


def _scaleout_fault(kind, faulty=1, timeouts=1):
    """Process ``faulty``'s read of ['rep'] (1 MiB held by every process, read in 64 KiB pieces
    by both) fails (``kind`` "fails") or stalls for ``timeouts`` x BARRIER_TIMEOUT + 3 s ("stalls"), in a
    restore with the broadcast on. Every process then stays up until all have failed, and all
    retry the restore without the fault (``retry``: what it gave)."""
    def scenario(mesh, path):
        table = entries(big=True)
        with dio.LocalDispatcher(host_memory_budget=1 << 20, barrier_timeout=BARRIER_TIMEOUT) as d:
            d.save(path, build(mesh, table)).wait()
        d, runner = tallying_dispatcher(max_chunk_bytes=64 << 10)
        if jax.process_index() == faulty:
            if kind == "fails":
                runner.fail_keypath = "['rep']"
            else:
                runner.stall_read = ("['rep']", timeouts * BARRIER_TIMEOUT + 3)
        sync("scaleout_fault")
        start = time.monotonic()
        out = {}
        with d:
            try:
                d.restore(path, abstract(mesh, table))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out = error_fields(exc)
            out["elapsed"] = time.monotonic() - start
            runner.fail_keypath = None
            sync("scaleout_fault/failed", timeout_ms=int(4 * BARRIER_TIMEOUT * 1000))  # nobody left in the restore
            try:
                out["retry"] = restore_and_compare(d, path, abstract(mesh, table), mesh, table)
            except Exception as exc:  # noqa: BLE001
                out["retry"] = error_fields(exc)
        return out
    return scenario


def write_fails(mesh, path):
    """Process 1's write of ['w'] raises; every process must raise from wait()."""
    tree = build(mesh, entries())
    d, _ = tallying_dispatcher(fail_keypath="['w']" if jax.process_index() == 1 else None)
    with d:
        sync("write_fails")
        start = time.monotonic()
        try:
            d.save(path, tree).wait()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {**error_fields(exc), "elapsed": time.monotonic() - start}
    return {"elapsed": time.monotonic() - start}


def manager_write_fails(mesh, path):
    """A CheckpointManager (max_to_keep=1) on a shared root: step 1 saved by both processes; at
    step 2 process 1's write of ['w'] fails with ENOSPC; step 3 saved without a fault."""
    import errno

    table = entries()
    tree, target = build(mesh, table), abstract(mesh, table)
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[name] = error_fields(exc)

    dispatcher, runner = tallying_dispatcher()
    with dispatcher, dio.CheckpointManager(path, dispatcher, max_to_keep=1) as manager:
        manager.save(1, tree).wait()
        manager.wait()
        sync("manager/1")
        out["steps_after_1"] = manager.all_steps()

        if jax.process_index() == 1:
            runner.fail_keypath = "['w']"
            runner.error = lambda: OSError(errno.ENOSPC, "No space left on device")
        sync("manager/2")
        start = time.monotonic()
        attempt("step_2", lambda: manager.save(2, tree).wait())
        out["elapsed"] = time.monotonic() - start
        attempt("manager_wait", manager.wait)          # the failure, once more
        attempt("manager_wait_again", manager.wait)    # and no more
        runner.fail_keypath = None
        sync("manager/2-failed")
        out["steps_after_2"] = manager.all_steps()
        out["step_2_exists"] = os.path.lexists(manager.step_path(2))
        out["restore_1"] = compare(manager.restore(1, target), mesh, table)

        attempt("step_3", lambda: manager.save(3, tree).wait())
        attempt("manager_wait_3", manager.wait)        # process 0: retention ran by now
        sync("manager/3")
        out["steps_after_3"] = manager.all_steps()
        out["restore_latest"] = compare(manager.restore(target=target), mesh, table)
    return out


def _sleeper(where):
    """Process 1 stalls (``where``: "before_save" or "in_write") for BARRIER_TIMEOUT + 3 s."""
    def scenario(mesh, path):
        tree = build(mesh, entries())
        stall = jax.process_index() == 1
        slept = []

        def on_write_end(keypath):
            if stall and where == "in_write" and keypath == "['w']" and not slept:
                slept.append(keypath)
                time.sleep(BARRIER_TIMEOUT + 3)

        d = dio.LocalDispatcher(host_memory_budget=1 << 20, barrier_timeout=BARRIER_TIMEOUT)
        sync("sleep")
        start = time.monotonic()
        try:
            if stall and where == "before_save":
                time.sleep(BARRIER_TIMEOUT + 3)
            d.save(path, tree, on_write_end=on_write_end).wait()
        except Exception as exc:  # noqa: BLE001
            return {**error_fields(exc), "elapsed": time.monotonic() - start, "clean_exit": False}
        return {"elapsed": time.monotonic() - start, "clean_exit": False}
    return scenario


def process_local_leaf(mesh, path):
    """A leaf that is not a global array (jnp.ones: on this process's default device) next to a
    replicated array in chunks. Each process plans its own tree, so the plans disagree."""
    host = np.arange(64 * 128, dtype=np.float32).reshape(64, 128)
    rep = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P()), lambda index: host[index])
    tree = {"a_local": jnp.ones(8), "rep": rep}
    with dio.LocalDispatcher(host_memory_budget=1 << 20, max_chunk_bytes=8 << 10,
                             barrier_timeout=BARRIER_TIMEOUT) as d:
        try:
            stats = d.save(path, tree).wait()
        except Exception as exc:  # noqa: BLE001 - refusing such a tree is a correct outcome
            return {"save_error": f"{type(exc).__name__}: {exc}"}
        try:
            restored = d.restore(path, {"rep": rep}, partial=True)["rep"]
        except Exception as exc:  # noqa: BLE001
            return {"bytes_written": stats.bytes_written, "restore_error": f"{type(exc).__name__}: {exc}"}
    same = all(np.asarray(s.data).tobytes() == host[s.index].tobytes() for s in restored.addressable_shards)
    return {"bytes_written": stats.bytes_written, "restored_equal": same}


def different_compression(mesh, path):
    """Process 1 saves with zstd, process 0 without: the same plan stored two ways."""
    host = np.arange(64 * 128, dtype=np.float32).reshape(64, 128)
    tree = {"w": jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("data")), lambda index: host[index])}
    compression = "zstd" if jax.process_index() == 1 else None
    with dio.LocalDispatcher(host_memory_budget=1 << 20, compression=compression, barrier_timeout=BARRIER_TIMEOUT) as d:
        try:
            d.save(path, tree).wait()
        except Exception as exc:  # noqa: BLE001 - refusing it is the correct outcome
            return {"save_error": f"{type(exc).__name__}: {exc}"}
    return {"saved": True}


SCENARIOS = {"process_local_leaf": process_local_leaf, "different_compression": different_compression, "roundtrip": roundtrip, "save": save_only, "restore": restore_only,
             "restore_orbax": restore_orbax, "shares": shares, "scaleout": scaleout,
             "save_big": save_big, "verify": verify, "verify_stalls": verify_stalls, "restore_colocated": restore_colocated, "restore_big": restore_big,
             "scaleout_fails": _scaleout_fault("fails"), "scaleout_stalls": _scaleout_fault("stalls"),
             "scaleout_leader_fails": _scaleout_fault("fails", faulty=0), "scaleout_crossing": scaleout_crossing,
             "scaleout_fsdp": scaleout_fsdp, "scaleout_leader_stalls": _scaleout_fault("stalls", faulty=0, timeouts=2),
             "write_fails": write_fails, "manager_write_fails": manager_write_fails, "sleep_before_save": _sleeper("before_save"),
             "sleep_in_write": _sleeper("in_write")}


def main():
    scenario, pid, count, port, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    if count > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=pid,
                                   initialization_timeout=60, shutdown_timeout_seconds=20)
    result = {"process": pid}
    clean = True
    try:
        assert jax.device_count() == 8, jax.devices()
        mesh = jax.make_mesh((4, 2), ("data", "model"))
        result.update(SCENARIOS[scenario](mesh, path))
        clean = result.pop("clean_exit", True)
    except BaseException as exc:  # noqa: BLE001 - the test shows it
        result.update(error_fields(exc), traceback=traceback.format_exc())
        clean = False
    print("RESULT " + json.dumps(result), flush=True)
    sys.stderr.flush()
    if count > 1 and clean:  # a peer that is gone or stuck would make shutdown wait
        jax.distributed.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
