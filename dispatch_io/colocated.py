"""ColocatedDispatcher: the worker code runs through ``jax.experimental.colocated_python``.

On Pathways the controller holds no data; every accelerator has a CPU device on the host
next to it (``colocated_cpu_devices``), and colocated Python functions run on those hosts.

* Save: each chunk of a batch is moved to the CPU device colocated with the device it lives
  on (``jax.device_put`` -- this *is* the device-to-host copy), then one colocated call per
  CPU device writes them with the worker code (``workers.colocated.write_arrays``). The
  budget, priorities, pipelining and callbacks are the shared pipeline's (``save.driver``).
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
import queue

import jax
import numpy as np

from dispatch_io.dispatcher import Dispatcher
from dispatch_io.options import Options
from dispatch_io.jax_compat import slice_exact
from dispatch_io.plan.save_plan import Chunk, native_order
from dispatch_io.runner import IOThreads
from dispatch_io.workers import ChunkError, IOSettings, ReadItem, Region
from dispatch_io.workers import colocated as remote
from dispatch_io.jax_compat import single_device_sharding


@functools.cache
def _colocated_cpus() -> dict:
    """{device: its colocated CPU device} for this process's devices. Asked for all at once:
    without Pathways, JAX pairs CPU devices with devices by position in the list asked about,
    so asking one device at a time would put everything on the first CPU device."""
    devices = tuple(jax.local_devices())
    return dict(zip(devices, remote.colocated_python_module().colocated_cpu_devices(devices)))


@functools.cache
def _cpu_sharding(device) -> jax.sharding.Sharding:
    """A sharding on the CPU device colocated with ``device``."""
    return single_device_sharding(_colocated_cpus()[device])


@functools.cache
def _local_devices_by_id() -> dict:
    return {d.id: d for d in jax.local_devices()}


def _device(device_id: int | None):
    """The local device with ``device_id`` (None, host data: this process's first device)."""
    return _local_devices_by_id()[device_id] if device_id is not None else jax.local_devices()[0]


def _writer_name(cpu, lane: int = 0) -> str:
    """Each colocated host writes databases of its own (OCDBT layout), one per lane."""
    return f"cpu{cpu.id}" if lane == 0 else f"cpu{cpu.id}.{lane}"


class ColocatedRunner:
    """Runs the worker code on the CPU hosts colocated with the devices (see the module doc).
    Host copies are arrays on those CPU devices, not in the staging ring (which still counts
    their bytes against the budget)."""

    host_staging = False

    def __init__(self, settings: IOSettings, threads: IOThreads | None = None):
        remote.colocated_python_module()  # a missing cloudpickle fails here, not mid-save
        remote.release_large_buffers_at_once()  # the host copies are made in this process here
        self.settings = settings
        self.threads = threads or IOThreads(settings.threads, "dispatch_io-colocated")

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        """Run ``fn`` on the pool under the caller's x64 setting (``jax.enable_x64`` is
        thread-local, and colocated results are built with ``jax.device_put``)."""
        x64 = bool(jax.config.jax_enable_x64)

        def run():
            with jax.enable_x64(x64):
                return fn(*args)
        return self.threads.submit(run)

    def open_writer(self, target) -> "ColocatedWriter":
        return ColocatedWriter(self, target)

    def copy_to_host(self, plan, chunks, sources, staging) -> list[jax.Array]:
        """Each chunk onto the CPU device colocated with its device; returns once all arrived."""
        out = []
        for chunk in chunks:
            try:
                out.append(_to_colocated_cpu(chunk, sources))
            except Exception as exc:  # noqa: BLE001 - any failure is the chunk's, named by its key path
                raise ChunkError(plan.leaves[chunk.leaf].keypath, chunk.region, exc) from exc
        try:
            jax.block_until_ready(out)
        except Exception as exc:  # noqa: BLE001 - name a leaf of the batch
            chunk = chunks[0]
            raise ChunkError(plan.leaves[chunk.leaf].keypath, chunk.region, exc) from exc
        return out

    def open_reader(self, kvstore: dict, context) -> "ColocatedReader":
        return ColocatedReader(self, kvstore)

    def close(self):
        self.threads.shutdown()


class ColocatedWriter:
    """This process's part of a save: each colocated host writes the chunks of its devices.

    Each call opens its host's database afresh, and two commits to one database racing for its
    next manifest would write that object twice (object stores throttle rewrites of a name) and
    redo the loser's commit. So each batch in flight takes a *lane* (one per write thread) and
    writes into that lane's database on every host (``cpu<id>``, ``cpu<id>.1``, ...): batches
    still overlap, and no database has two writers."""

    def __init__(self, runner: ColocatedRunner, target):
        self._runner, self._arrays = runner, target.kvstore
        self._lanes: queue.SimpleQueue = queue.SimpleQueue()
        for lane in range(runner.settings.threads):
            self._lanes.put(lane)

    def write(self, regions, buffers):
        return self._runner.threads.submit(self._write, list(regions), list(buffers))

    def _write(self, regions: list[Region], arrays: list[jax.Array]) -> list:
        """One colocated write call per CPU device holding part of the batch, in a free lane;
        returns the CRC-32C per region (None without checksums), like ``workers.write_regions``."""
        settings = self._runner.settings
        groups: dict = {}
        for i, array in enumerate(arrays):
            groups.setdefault(array.sharding, []).append(i)
        sums: list = [None] * len(arrays)
        lane = self._lanes.get()
        try:
            calls: list = []
            try:
                for sharding, indices in groups.items():
                    writer = _writer_name(next(iter(sharding.device_set)), lane)
                    request = remote.encode_request(remote.WriteRequest(
                        self._arrays, writer, settings, tuple(regions[i] for i in indices)), sharding)
                    calls.append((indices, remote.write_arrays(request, [arrays[i] for i in indices])))
            finally:  # the lane is free once every call of the batch has ended, failed ones too
                ended = [(indices, _ended(result)) for indices, result in calls]
        finally:
            self._lanes.put(lane)
        for indices, result in ended:
            if isinstance(result, BaseException):
                raise result
            for i, crc in zip(indices, result.tolist()):
                sums[i] = crc if settings.checksums else None
        return sums

    def close(self):
        pass


class ColocatedReader:
    """Reads through one colocated call per CPU device and batch: each item on the CPU device
    colocated with the first device that needs it (host items: this process's first device)."""

    def __init__(self, runner: ColocatedRunner, kvstore: dict):
        self._runner, self._kvstore = runner, kvstore

    def read(self, items):
        return self._runner._submit(self._read, list(items))

    def _read(self, items: list[ReadItem]) -> list:
        groups: dict = {}
        for i, item in enumerate(items):
            groups.setdefault(_cpu_sharding(_device(item.device)), []).append(i)
        calls = []
        for sharding, indices in groups.items():
            mine = tuple(items[i] for i in indices)
            request = remote.encode_request(remote.ReadRequest(self._kvstore, self._runner.settings, mine), sharding)
            calls.append((indices, remote.reader(remote.read_out_specs(mine, sharding))(request)))
        results: list = [None] * len(items)
        for indices, arrays in calls:
            jax.block_until_ready(arrays)
            for i, array in zip(indices, arrays):
                item = items[i]
                if item.on_host:  # raw bytes -> a writable numpy array
                    array = np.array(array).view(item.dtype).reshape(item.shape)
                results[i] = array
        return results

    def checksums(self, regions):
        """CRC-32C of stored regions, computed by a colocated call next to this process's first device."""
        sharding = _cpu_sharding(jax.local_devices()[0])
        regions = tuple(regions)

        def run():
            request = remote.encode_request((self._kvstore, self._runner.settings, regions), sharding)
            return np.asarray(remote.checksummer(len(regions), sharding)(request)).tolist()
        return self._runner.threads.submit(run)

    def close(self):
        pass


class ColocatedDispatcher(Dispatcher):
    """Runs the worker code on the CPU hosts colocated with the devices (Pathways), through
    ``jax.experimental.colocated_python``. Same API and guarantees as ``LocalDispatcher``;
    ``host_memory_budget`` bounds the bytes held on the CPU side at once; other
    :class:`~dispatch_io.Options` fields may be given as keyword arguments, except
    ``host_transfer`` (ValueError unless ``"auto"``): its device-to-host copy is the move onto
    the colocated CPU devices, whose buffers the colocated writers read as they are.
    """

    def __init__(self, host_memory_budget: int = 1 << 30, **options):
        options = Options(host_memory_budget=host_memory_budget, **options)
        if options.host_transfer != "auto":
            raise ValueError(f"host_transfer={options.host_transfer!r}: ColocatedDispatcher moves chunks onto "
                             "the colocated CPU devices (jax.device_put), for LocalDispatcher only")
        super().__init__(options, ColocatedRunner(options.io_settings()))


def _ended(result: jax.Array):
    """A colocated call's result on the host once the call has ended, or the exception it raised."""
    try:
        return np.asarray(result)
    except Exception as exc:  # noqa: BLE001 - raised by the caller once every call has ended
        return exc


def _to_colocated_cpu(chunk: Chunk, sources) -> jax.Array:
    """The chunk's region as a new array on the CPU device colocated with its device."""
    data, local = sources.locate(chunk)
    cpu = _cpu_sharding(_device(chunk.device))
    if isinstance(data, np.ndarray):  # host data, as raw bytes (jax would turn float64 into float32)
        native = native_order(data.dtype)
        # a copy (CPU device_put may alias aligned numpy), in native byte order as stored
        raw = np.array(data[local], dtype=native, order="C").reshape(-1).view(np.uint8)
        return jax.device_put(raw, cpu)
    whole = all(sl.start == 0 and sl.stop == n for sl, n in zip(local, data.shape))
    piece = data if whole else slice_exact(data, local)
    # A copy even when the CPU device is the device itself: after on_transfer_end the trainer
    # may donate or overwrite its buffer, and the write must not see that.
    return jax.device_put(piece, cpu, may_alias=False if whole else None)
