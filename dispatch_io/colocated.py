"""ColocatedDispatcher: the worker code runs through ``jax.experimental.colocated_python``.

On Pathways the controller holds no data; every accelerator has a CPU device on the host
next to it (``colocated_cpu_devices``), and colocated Python functions run on those hosts.

* Save: each chunk of a batch is moved to the CPU device colocated with the device it lives
  on (``jax.device_put`` -- this *is* the device-to-host copy), then one colocated call per
  CPU device writes them with the worker code (``workers.colocated.write_arrays``). The
  budget, priorities, pipelining and callbacks are the shared pipeline's (``save.py``).
* Restore: the controller builds the result specs -- per distinct shard region, a
  ``ShapeDtypeStruct`` on the colocated CPU device of a device holding it, PRNG keys with
  their key dtype and logical shape -- and one colocated call per CPU device and batch reads
  them; the controller then puts each region on its target devices and assembles the array.
  Working per region, never per sharding type, is what makes any JAX sharding work.

Here (no Pathways) colocated_python runs in-process on the CPU devices; the code is the same.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math

import jax
import numpy as np

from dispatch_io import restore as restore_lib
from dispatch_io import tree as tree_lib
from dispatch_io.batches import pack
from dispatch_io.dispatcher import Dispatcher, arrays_of, stored_arrays
from dispatch_io.errors import WorkerError
from dispatch_io.manifest import Manifest
from dispatch_io.options import Options
from dispatch_io.plan import Chunk, Plan
from dispatch_io.progress import Progress
from dispatch_io.save import Sources
from dispatch_io.storage import Location, WriteTarget
from workers import ChunkError, Region, Session, layout_kvstore
from workers import colocated as remote


class RemoteSession:
    """What a colocated worker needs to open the checkpoint's arrays (plain, picklable data).
    Reads use ``kvstore`` as is; a save's session holds the ``arrays/`` kvstore, and the host
    of each CPU device writes ``writer_kvstore(cpu)`` under it."""

    def __init__(self, kvstore: dict, fsync: bool = True, checksums: bool = False,
                 layout: str = "files", keep_page_cache: bool = False):
        self.kvstore, self.fsync, self.checksums = kvstore, fsync, checksums
        self.layout, self.keep_page_cache = layout, keep_page_cache
        self.arrays_created = None  # a future: writes wait for it

    def writer_kvstore(self, cpu) -> dict:
        """The kvstore the colocated host of CPU device ``cpu`` writes (OCDBT: a database of its own)."""
        return layout_kvstore(self.kvstore, self.layout, writer=f"cpu{cpu.id}")

    def close(self):
        pass


@functools.cache
def _colocated_cpus() -> dict:
    """{device: its colocated CPU device} for this process's devices. Asked for all at once:
    without Pathways, JAX pairs CPU devices with devices by position in the list asked about,
    so asking one device at a time would put everything on the first CPU device."""
    devices = tuple(jax.local_devices())
    return dict(zip(devices, remote.colocated_python_module().colocated_cpu_devices(devices)))


@functools.cache
def _cpu_sharding(device) -> jax.sharding.SingleDeviceSharding:
    """A sharding on the CPU device colocated with ``device``."""
    return jax.sharding.SingleDeviceSharding(_colocated_cpus()[device])


class ColocatedDispatcher(Dispatcher):
    """Runs the worker code on the CPU hosts colocated with the devices (Pathways), through
    ``jax.experimental.colocated_python``. Same API and guarantees as :class:`LocalDispatcher`;
    ``host_memory_budget`` bounds the bytes held on the CPU side at once.
    """

    host_staging = False  # the colocated CPU devices hold the host copies; the budget still counts them
    thread_name = "dispatch_io-colocated"

    def __init__(self, host_memory_budget: int = 1 << 30, **options):
        remote.colocated_python_module()  # a missing cloudpickle fails here, not mid-save
        remote.release_large_buffers_at_once()  # the host copies are made in this process here
        super().__init__(Options(host_memory_budget=host_memory_budget, **options))

    # ---- save -----------------------------------------------------------------------------------

    def open_write_session(self, target: WriteTarget, chunks, plan: Plan) -> RemoteSession:
        session = RemoteSession(target.kvstore, self.options.fsync, self.options.checksums,
                                layout=self.options.layout, keep_page_cache=self.options.keep_page_cache)
        # Each colocated host writes the chunks of its devices; their arrays are created first,
        # from here, so that the hosts' concurrent writes only ever add chunks.
        by_cpu: dict = {}
        for chunk in chunks:
            by_cpu.setdefault(_colocated_cpus()[_chunk_device(chunk)], []).append(chunk)

        def create():
            for cpu, mine in by_cpu.items():
                Session(session.writer_kvstore(cpu), context=target.context,
                        fsync=self.options.fsync).create_arrays(arrays_of(mine, plan))
        session.arrays_created = self._pool.submit(create)  # SYNC copies need not wait for it
        return session

    def copy_to_host(self, plan: Plan, chunks, sources: Sources, staging) -> list[jax.Array]:
        """Each chunk onto the CPU device colocated with its device; returns once all arrived."""
        out = []
        for chunk in chunks:
            spec = plan.leaves[chunk.leaf]
            try:
                out.append(_to_colocated_cpu(chunk, sources))
            except Exception as exc:  # noqa: BLE001
                raise ChunkError(spec.keypath, chunk.region, exc) from exc
        try:
            jax.block_until_ready(out)
        except Exception as exc:  # noqa: BLE001 - name a leaf of the batch
            chunk = chunks[0]
            raise ChunkError(plan.leaves[chunk.leaf].keypath, chunk.region, exc) from exc
        return out

    def submit_write(self, session: RemoteSession, regions, buffers) -> concurrent.futures.Future:
        return self._pool.submit(_write_on_workers, session, list(regions), list(buffers))

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        """Run ``fn`` on the pool under the caller's x64 setting (``jax.enable_x64`` is
        thread-local, and colocated results are built with ``jax.device_put``)."""
        x64 = bool(jax.config.jax_enable_x64)

        def run():
            with jax.enable_x64(x64):
                return fn(*args)
        return self._pool.submit(run)

    # ---- restore --------------------------------------------------------------------------------

    def read_outputs(self, location: Location, manifest: Manifest, outputs: list, progress: Progress):
        """Fill each output's regions with arrays read by colocated calls (see module doc);
        count each batch on ``progress``."""
        display = progress.path
        units = restore_lib.units(outputs)
        batches = [items for items, _ in pack(units, _unit_bytes, self.options.batch_bytes)]
        progress.phase("read", len(batches), sum(map(_unit_bytes, units)))
        kvstore = stored_arrays(location, manifest)
        submit = lambda batch: self._submit(self._read_batch, kvstore, batch)  # noqa: E731
        in_flight = [submit(batches[0])] if batches else []
        for k, batch in enumerate(batches):
            if k + 1 < len(batches):  # at most two batches in flight
                in_flight.append(submit(batches[k + 1]))
            try:
                arrays = in_flight.pop(0).result()
            except Exception as exc:  # noqa: BLE001
                for f in in_flight:
                    f.exception()
                keypath = getattr(exc, "keypath", None) or batch[0][0].saved.keypath
                raise WorkerError(f"worker {self.worker_id} (colocated) failed reading {keypath} from {display}: "
                                  f"{type(exc).__name__}: {exc}", worker=self.worker_id, keypath=keypath) from exc
            for (out, region), array in zip(batch, arrays):
                if out.where == restore_lib.HOST:  # raw bytes -> a writable numpy array
                    shape = tuple(hi - lo for lo, hi in region)
                    array = np.array(array).view(out.dtype).reshape(shape)
                out.buffers[region] = array
            progress.advance(sum(map(_unit_bytes, batch)))

    def _read_batch(self, kvstore: dict, batch) -> list[jax.Array]:
        """One colocated call per CPU device for the batch's regions; results in batch order."""
        chunk_limit = self.options.chunk_bytes
        groups: dict = {}
        for i, (out, region) in enumerate(batch):
            groups.setdefault(_cpu_sharding(_home_device(out, region)), []).append(i)
        calls = []
        for sharding, indices in groups.items():
            items, specs = [], []
            for i in indices:
                out, region = batch[i]
                item, spec = _read_item(out, region, chunk_limit, sharding)
                items.append(item)
                specs.append(spec)
            request = remote.encode_request(
                remote.ReadRequest(kvstore, tuple(items), self.options.keep_page_cache), sharding)
            calls.append((indices, remote.reader(tuple(specs))(request)))
        results: list = [None] * len(batch)
        for indices, arrays in calls:
            jax.block_until_ready(arrays)
            for i, array in zip(indices, arrays):
                results[i] = array
        return results

    def open_read_session(self, location: Location, manifest: Manifest) -> RemoteSession:
        return RemoteSession(stored_arrays(location, manifest))

    def submit_checksums(self, session: RemoteSession, regions) -> concurrent.futures.Future:
        """CRC-32C of stored regions, computed by a colocated call next to this process's first device."""
        sharding = _cpu_sharding(jax.local_devices()[0])

        def run():
            request = remote.encode_request((session.kvstore, tuple(regions)), sharding)
            return np.asarray(remote.checksummer(len(regions), sharding)(request)).tolist()
        return self._pool.submit(run)


def _to_colocated_cpu(chunk: Chunk, sources: Sources) -> jax.Array:
    """The chunk's region as a new array on the CPU device colocated with its device."""
    data, local = sources.locate(chunk)
    cpu = _cpu_sharding(_chunk_device(chunk))
    if isinstance(data, np.ndarray):  # host data, as raw bytes (jax would turn float64 into float32)
        raw = np.array(data[local], order="C").reshape(-1).view(np.uint8)  # a copy: CPU device_put may alias aligned numpy
        return jax.device_put(raw, cpu)
    whole = all(sl.start == 0 and sl.stop == n for sl, n in zip(local, data.shape))
    piece = data if whole else data[local]
    # A copy even when the CPU device is the device itself: after on_transfer_end the trainer
    # may donate or overwrite its buffer, and the write must not see that.
    return jax.device_put(piece, cpu, may_alias=False if whole else None)


def _chunk_device(chunk: Chunk):
    """The local device whose colocated host copies and writes ``chunk`` (host data: the first)."""
    return _local_devices_by_id()[chunk.device] if chunk.device is not None else jax.local_devices()[0]


@functools.cache
def _local_devices_by_id() -> dict:
    return {d.id: d for d in jax.local_devices()}


def _write_on_workers(session: RemoteSession, regions: list[Region], arrays: list[jax.Array]) -> list:
    """One colocated write call per CPU device holding part of the batch; returns the
    CRC-32C per region (None without checksums), like ``workers.write_regions``."""
    session.arrays_created.result()
    groups: dict = {}
    for i, array in enumerate(arrays):
        groups.setdefault(array.sharding, []).append(i)
    calls = []
    for sharding, indices in groups.items():
        request = remote.encode_request(remote.WriteRequest(
            session.writer_kvstore(next(iter(sharding.device_set))), session.fsync, session.checksums,
            tuple(regions[i] for i in indices), session.keep_page_cache), sharding)
        calls.append((indices, remote.write_arrays(request, [arrays[i] for i in indices])))
    sums: list = [None] * len(arrays)
    for indices, result in calls:
        for i, crc in zip(indices, np.asarray(result).tolist()):
            sums[i] = crc if session.checksums else None
    return sums


def _unit_bytes(unit) -> int:
    out, region = unit
    return math.prod(out.buffer_shape(region)) * out.saved_dtype.itemsize


def _home_device(out, region):
    """The device a region is read for first (host outputs: this process's first device)."""
    devices = out.regions[region]
    return jax.local_devices()[0] if devices[0] is None else devices[0]


def _read_item(out, region, chunk_limit: int, sharding):
    """(worker ReadItem, result spec) for one region of one output."""
    saved = out.saved
    stored = saved.stored
    pieces = tuple((Region(stored, bounds, saved.keypath), tuple((sl.start, sl.stop) for sl in local))
                   for bounds, local in restore_lib.pieces(out, region, chunk_limit))
    shape = out.buffer_shape(region)
    key = saved.kind == tree_lib.KEY
    host = out.where == restore_lib.HOST
    item = remote.ReadItem(pieces, shape, stored.dtype, np.dtype(out.dtype).name,
                           saved.key_impl if key else None, as_bytes=host)
    if key:  # logical shape and key dtype: colocated_python converts keys at its boundary
        spec = jax.ShapeDtypeStruct(tuple(hi - lo for lo, hi in region), saved.dtype, sharding=sharding)
    elif host:
        spec = jax.ShapeDtypeStruct((math.prod(shape) * np.dtype(out.dtype).itemsize,), np.uint8, sharding=sharding)
    else:
        spec = jax.ShapeDtypeStruct(shape, out.dtype, sharding=sharding)
    return item, spec
