"""Dispatchers: the controller-facing API, and where worker code runs.

:class:`Dispatcher` holds everything shared (planning, batching, the save pipeline, restore
validation and reading). A concrete dispatcher only says how a batch reaches host memory
(``copy_to_host``) and where the worker functions from ``workers/`` run (``submit_write`` /
``submit_read``). :class:`LocalDispatcher` runs them in-process on a thread pool: one worker
per JAX process, any number of devices.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np

from dispatch_io import coordination
from dispatch_io import manifest as manifest_lib
from dispatch_io.manifest import Manifest
from dispatch_io import progress as progress_lib
from dispatch_io import restore as restore_lib
from dispatch_io import tree as tree_lib
from dispatch_io.batches import Priority, aligned, make_batches, sync_overflow
from dispatch_io.errors import WorkerError
from dispatch_io.options import Options
from dispatch_io.plan import Chunk, Plan, PlanCache
from dispatch_io.progress import Progress
from dispatch_io.restore import RestoreStats
from dispatch_io.save import SaveHandle, SaveRun, Sources, io_thread
from dispatch_io.staging import StagingRing
from dispatch_io.storage import Location, WriteTarget
from workers import ChunkError, Region, Session, checksum_regions, layout_kvstore, read_regions, write_regions

PriorityFn = Callable[[str, jax.ShapeDtypeStruct], Priority]


def metadata(path):
    """The saved tree with ``jax.ShapeDtypeStruct`` leaves (PRNG keys with their key dtype),
    Python scalars as saved. Reads only the manifest; needs no devices beyond the default."""
    location = Location.parse(path)
    return manifest_lib.abstract_tree(manifest_lib.parse(location.read_manifest(), location.display))


class Dispatcher:
    """Base class: save / restore through a memory-budgeted pipeline (see module doc)."""

    def __init__(self, options: Options):
        self.options = options
        self._plans = PlanCache(options.chunk_bytes)
        self._ring = StagingRing(options.host_memory_budget, allocate=self.host_staging)
        self._active: set[SaveRun] = set()
        self._path_locks: dict[str, list] = {}  # path key -> [lock, saves holding or waiting for it]
        self._lock = threading.Lock()
        self._closed = False
        self.io_token = object()  # marks this dispatcher's IO threads (see save.io_thread)
        # RestoreStats of the restore that finished last on this dispatcher (from any thread).
        self.last_restore_stats: RestoreStats | None = None
        self.coordinator = coordination.for_this_job(options.barrier_timeout)
        # Where writes and reads are handed out (LocalDispatcher runs the worker functions here;
        # ColocatedDispatcher issues its colocated calls from here).
        self._pool = concurrent.futures.ThreadPoolExecutor(
            options.write_threads, thread_name_prefix=self.thread_name,
            initializer=_mark_io_thread, initargs=(self.io_token,))

    @property
    def worker_id(self) -> int:
        return jax.process_index()

    # ---- save -------------------------------------------------------------------------------

    def save(self, path, tree, *, priority: PriorityFn | None = None,
             on_transfer_end: Callable[[str], None] | None = None,
             on_write_end: Callable[[str], None] | None = None, overwrite: bool = False) -> SaveHandle:
        """Save ``tree`` to ``path``; returns once every SYNC leaf is off the device.

        ``priority(keypath, spec)`` gives each array leaf a :class:`Priority` (default SYNC).
        ``on_transfer_end(keypath)`` fires exactly once per array leaf, once its device data is
        no longer needed (copied, or the save failed first); ``on_write_end(keypath)`` once its
        bytes are written (not for leaves a failed save did not write).
        Raises ``TypeError`` (unsupported leaf, naming its key path) or ``FileExistsError``
        before anything is written; ``RuntimeError`` after ``close()`` or from this dispatcher's
        own callbacks. Call ``.wait()`` on the handle for durability and errors.
        """
        self._check_usable("save")
        started = time.perf_counter()
        location = Location.parse(path)
        hits = self._plans.hits
        plan = self._plans.get(tree)
        plan_cached = self._plans.hits > hits
        leaves = jax.tree_util.tree_leaves(tree)
        priorities = self._priorities(plan, priority)
        batches = self._batches(plan, priorities)
        overflow = self._snapshot_sync_overflow(plan, leaves, batches)
        if overflow:  # on their devices now: to host later, with HIGH priority
            priorities = [Priority.HIGH if i in overflow else p for i, p in enumerate(priorities)]
            batches = self._batches(plan, priorities)
        plan_seconds = time.perf_counter() - started
        self._lock_path(location.key)  # saves to one path never overlap; the run unlocks it when done
        save = None
        try:
            save = self.coordinator.start_write(location, overwrite, plan)
            run = SaveRun(self, plan, leaves, batches, save, location, self._ring,
                          on_transfer_end, on_write_end, started, plan_seconds, plan_cached)
            run.snapshot_bytes = sum(plan.leaves[i].nbytes for i in overflow)
            self._start(run)
        except BaseException as exc:
            if save is not None:
                save.abandon(exc)
            with self._lock:
                self._unlock_path(location.key)
            raise
        run.wait_until_sync_copied()
        return SaveHandle(run)

    def _snapshot_sync_overflow(self, plan: Plan, leaves: list, batches) -> set[int]:
        """``Options.device_snapshots``: replace the SYNC leaves beyond the host budget (on
        accelerators) by copies on the same devices, wait for the copies, return their indices."""
        if not self.options.device_snapshots:
            return set()
        indices = sorted(i for i in sync_overflow(plan, batches, self.options.host_memory_budget)
                         if _platform(leaves[i]) not in NO_SNAPSHOT_PLATFORMS)

        def failed(i, exc):
            keypath = plan.leaves[i].keypath
            return WorkerError(f"worker {self.worker_id} failed copying {keypath} on its devices: "
                               f"{type(exc).__name__}: {exc}", worker=self.worker_id, keypath=keypath)

        for i in indices:  # all dispatched first (asynchronous), then waited for
            try:
                leaves[i] = jax.device_put(leaves[i], leaves[i].sharding, may_alias=False)
            except Exception as exc:  # noqa: BLE001 - e.g. a deleted or donated array
                raise failed(i, exc) from exc
        for i in indices:
            try:
                leaves[i].block_until_ready()
            except Exception as exc:  # noqa: BLE001
                raise failed(i, exc) from exc
        return set(indices)

    def _batches(self, plan: Plan, priorities: list[Priority]):
        key = ("batches", tuple(priorities), self.options.batch_bytes, self.worker_id)
        batches = plan.memo.get(key)
        if batches is None:  # a training loop saving the same state batches once
            if len(plan.memo) >= 8:
                plan.memo.clear()
            batches = plan.memo[key] = make_batches(plan, priorities, self.options.batch_bytes, worker=self.worker_id)
        return batches

    def _start(self, run: SaveRun):
        """Register ``run`` (unless the dispatcher was closed meanwhile) and start its driver."""
        with self._lock:
            self._check_usable("save")
            if not self._active:  # peak_host_bytes is per save (overlapping saves share the ring)
                self._ring.reset_peak()
            self._active.add(run)
        try:
            run.start()
        except BaseException:  # e.g. no thread can be started: nothing may wait for this run
            with self._lock:
                self._active.discard(run)
            raise

    @staticmethod
    def _priorities(plan: Plan, priority: PriorityFn | None) -> list[Priority]:
        if priority is None:
            return [Priority.SYNC] * len(plan.leaves)
        out = []
        for spec in plan.leaves:
            if spec.kind == tree_lib.SCALAR:
                out.append(Priority.SYNC)
                continue
            value = priority(spec.keypath, spec.spec)
            try:
                out.append(Priority(value))
            except ValueError:
                raise TypeError(f"priority callback returned {value!r} for {spec.keypath}; "
                                "expected a dispatch_io.Priority") from None
        return out

    def _check_usable(self, what: str):
        """RuntimeError, instead of a hang or an obscure failure, for a closed dispatcher or a
        call from one of its own IO threads."""
        self._check_not_io_thread(what)
        if self._closed:
            raise RuntimeError(f"{type(self).__name__}.{what}() called after close()")

    def _check_not_io_thread(self, what: str):
        """Callbacks run on the dispatcher's IO threads; waiting there for the dispatcher deadlocks."""
        if getattr(io_thread, "owner", None) is self.io_token:
            raise RuntimeError(f"{type(self).__name__}.{what}() called from one of its own IO threads "
                               "(an on_transfer_end / on_write_end callback): that would deadlock; "
                               "hand the work to another thread or dispatcher")

    def _lock_path(self, key: str):
        """Take the lock serializing saves to ``key``; entries go away when unused."""
        with self._lock:
            entry = self._path_locks.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        try:
            entry[0].acquire()
        except BaseException:  # interrupted while waiting
            with self._lock:
                self._unlock_path(key, held=False)
            raise

    def _unlock_path(self, key: str, *, held: bool = True):
        """Release the lock of ``key`` (or, not ``held``, stop waiting for it); ``self._lock`` held."""
        entry = self._path_locks[key]
        if held:
            entry[0].release()
        entry[1] -= 1
        if entry[1] == 0:
            del self._path_locks[key]

    def save_finished(self, run: SaveRun):
        with self._lock:
            self._active.discard(run)
            idle = not self._active
            self._unlock_path(run.location_key)
        if idle and not self.options.keep_staging_warm:
            self._ring.drop_buffer()

    # ---- restore ------------------------------------------------------------------------------

    def restore(self, path, target=None, *, partial: bool = False, cast: bool = False, verify: bool = False):
        """Read the checkpoint at ``path``.

        ``target`` (a pytree) says what to build: ``jax.ShapeDtypeStruct`` leaves with a
        sharding (None: the default device), ``jax.Array`` leaves (their sharding is used),
        ``np.ndarray`` leaves (host numpy). ``target=None`` returns the saved tree with numpy
        arrays and PRNG keys as key arrays on the default device. Strict: every mismatch is
        reported at once (``TreeMismatchError``) before anything is read; ``partial=True``
        lets the target name a subset of the leaves, ``cast=True`` allows dtype changes.
        ``verify=True`` first checks every stored chunk it reads against the CRC-32C saved with
        it (``Options(checksums=True)``): ``CorruptCheckpointError`` names each bad chunk.

        What it did (bytes, batches, seconds per stage) is then ``self.last_restore_stats``.
        """
        self._check_usable("restore")
        started = time.perf_counter()
        location = Location.parse(path)
        marker = location.commit_marker()  # a save that replaces the checkpoint changes it
        manifest = manifest_lib.parse(location.read_manifest(), location.display)
        treedef, outputs = restore_lib.plan_outputs(manifest, target, partial, cast)
        progress = Progress("restore", location.display, enabled=self.options.progress)
        times = [time.perf_counter()]  # planned | verified | read
        with progress:  # a terminal line is ended if this raises
            try:
                if verify:
                    self.verify_outputs(location, manifest, outputs, progress)
                times.append(time.perf_counter() if verify else times[0])  # verify_seconds 0 without it
                self.read_outputs(location, manifest, outputs, progress)
                times.append(time.perf_counter())
            except Exception as exc:
                location.check_commit_marker(marker, exc)  # a read failure caused by a replacement
                raise
            location.check_commit_marker(marker)  # else the result may mix two checkpoints
            result = jax.tree_util.tree_unflatten(treedef, [restore_lib.finish(o) for o in outputs])
        stats = _read_stats(progress, location.display, verify, started, times)
        self.last_restore_stats = stats
        progress_lib.report("restore", progress, stats)
        return result

    def verify(self, path) -> RestoreStats:
        """Read every stored chunk of the checkpoint at ``path`` once and, if it was saved with
        checksums, check each against its CRC-32C; returns what it did (``verify_seconds``).

        Chunk by chunk, two budget halves at a time: host memory stays within the budget however
        large the checkpoint -- or two stored chunks, for chunks larger than half the budget:
        every chunk is read whole, as a restore would decode it. Raises ``CorruptCheckpointError`` naming each bad chunk's key path, ``WorkerError`` /
        ``CheckpointError`` for what cannot be read, before that ``FileNotFoundError`` /
        ``IncompleteCheckpointError`` for a path that holds no committed checkpoint. Reads the
        whole checkpoint in every process (``dispatch-io verify`` calls it).
        """
        self._check_usable("verify")
        started = time.perf_counter()
        location = Location.parse(path)
        marker = location.commit_marker()
        manifest = manifest_lib.parse(location.read_manifest(), location.display)
        _, outputs = restore_lib.plan_outputs(manifest, None, partial=False, cast=False)
        checksums = manifest.has_checksums
        progress = Progress("verify", location.display, enabled=self.options.progress)
        times = [time.perf_counter()]
        with progress:
            try:
                self.verify_outputs(location, manifest, outputs, progress, compare=checksums)
                times += [time.perf_counter()] * 2  # nothing read into a result
            except Exception as exc:
                location.check_commit_marker(marker, exc)
                raise
            location.check_commit_marker(marker)
        stats = _read_stats(progress, location.display, checksums, started, times)
        progress_lib.report("verify", progress, stats)
        return stats

    def read_outputs(self, location: Location, manifest: Manifest, outputs: list, progress: Progress):
        """Fill the outputs' region buffers (``restore.finish`` builds the arrays from them);
        count each batch on ``progress`` (its phase ``read``)."""
        session = self.open_read_session(location, manifest)
        try:
            restore_lib.read_outputs(self, session, outputs, progress)
        finally:
            session.close()

    def verify_outputs(self, location: Location, manifest: Manifest, outputs: list, progress: Progress, *,
                       compare: bool = True):
        """Check the chunks the outputs need against their saved checksums (``compare=False``:
        only read them); count each batch on ``progress`` (its phase ``verify``)."""
        session = self.open_read_session(location, manifest)
        try:
            restore_lib.verify_checksums(outputs, self.options.batch_bytes,
                                         lambda regions: self.submit_checksums(session, regions),
                                         progress, compare=compare)
        finally:
            session.close()

    # ---- what a concrete dispatcher provides ---------------------------------------------------

    host_staging = True  # copies land in the staging ring (False: elsewhere, the ring only counts bytes)
    thread_name = "dispatch_io-worker"

    def open_write_session(self, target: WriteTarget, chunks: Sequence[Chunk], plan: Plan):
        """A session writing ``chunks`` (this process's) into ``target``, their arrays created."""
        raise NotImplementedError

    def open_read_session(self, location: Location, manifest: Manifest):
        """A session reading the arrays of the checkpoint ``manifest`` describes."""
        raise NotImplementedError

    def copy_to_host(self, plan: Plan, chunks: Sequence[Chunk], sources: Sources, staging: np.ndarray
                     ) -> list[np.ndarray]:
        raise NotImplementedError

    def submit_write(self, session, regions: Sequence[Region], buffers) -> concurrent.futures.Future:
        raise NotImplementedError

    def submit_read(self, session, regions: Sequence[Region], out: Sequence[np.ndarray | None]
                    ) -> concurrent.futures.Future:
        raise NotImplementedError

    def submit_checksums(self, session, regions: Sequence[Region]) -> concurrent.futures.Future:
        raise NotImplementedError

    # ---- lifecycle ------------------------------------------------------------------------------

    def wait_all(self):
        """Wait for every save in flight (errors stay with their handles)."""
        self._check_not_io_thread("wait_all")
        with self._lock:
            runs = list(self._active)
        concurrent.futures.wait([r.future for r in runs])
        for r in runs:
            r.join()

    def close(self):
        """Wait for saves in flight and free the staging memory. Later ``save()`` / ``restore()``
        calls raise RuntimeError; closing twice is fine."""
        self._check_not_io_thread("close")
        with self._lock:
            self._closed = True
        self.wait_all()
        self._pool.shutdown(wait=True)
        self._ring.drop_buffer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def stored_arrays(location: Location, manifest: Manifest) -> dict:
    """The kvstore a restore reads the arrays of ``manifest`` from (its folder, its layout)."""
    return layout_kvstore(location.arrays_kvstore(manifest.arrays), manifest.layout)


def _read_stats(progress: Progress, path: str, verified: bool, started: float, times: list) -> RestoreStats:
    """RestoreStats from a restore's / verify's progress counts and its stage boundaries
    ``times`` = [planned, verified, read]."""
    phases = progress.phases.values()
    return RestoreStats(
        path=path, bytes_read=sum(p.bytes_done for p in phases), batches=sum(p.batches_done for p in phases),
        plan_seconds=times[0] - started, verify_seconds=times[1] - times[0], read_seconds=times[2] - times[1],
        total_seconds=time.perf_counter() - started, verified=verified)


def copy_chunks_to_host(plan: Plan, chunks: Sequence[Chunk], sources: Sources, staging: np.ndarray
                        ) -> list[np.ndarray]:
    """Copy each chunk's region from its device shard into consecutive staging slices.

    On CPU the device buffer is host memory: ``np.asarray`` views it without a copy and the
    one copy is into staging. On accelerators the region is sliced on the device and all
    copies of the batch are started before the first is awaited."""
    out, pending, offset = [], [], 0
    for chunk in chunks:
        spec = plan.leaves[chunk.leaf]
        try:
            data, local = sources.locate(chunk)
            shape = tuple(hi - lo for lo, hi in chunk.region)
            dst = staging[offset:offset + chunk.nbytes].view(spec.dtype).reshape(shape)
            offset += aligned(chunk.nbytes)
            if isinstance(data, np.ndarray):
                np.copyto(dst, data[local])
            elif _on_cpu(data):
                np.copyto(dst, np.asarray(data)[local])
            else:
                piece = data[local]
                piece.copy_to_host_async()
                pending.append((dst, piece, spec, chunk))
            out.append(dst)
        except Exception as exc:  # noqa: BLE001
            raise ChunkError(spec.keypath, chunk.region, exc) from exc
    for dst, piece, spec, chunk in pending:
        try:
            np.copyto(dst, np.asarray(piece))
        except Exception as exc:  # noqa: BLE001
            raise ChunkError(spec.keypath, chunk.region, exc) from exc
    return out


# A CPU device's memory is host memory: a snapshot there would be host memory outside the budget.
NO_SNAPSHOT_PLATFORMS = ("cpu",)


def _platform(array) -> str:
    return next(iter(array.sharding.device_set)).platform


def arrays_of(chunks: Sequence[Chunk], plan: Plan) -> list:
    """The stored arrays (``ArraySpec``) the chunks belong to, each once, in order."""
    return list(dict.fromkeys(plan.leaves[c.leaf].array for c in chunks))


def _on_cpu(array) -> bool:
    return _platform(array) == "cpu"


def _mark_io_thread(token):
    io_thread.owner = token


class LocalDispatcher(Dispatcher):
    """Runs the worker code in-process on a thread pool: one worker per JAX process.

    ``host_memory_budget`` bounds the host bytes the IO holds at any moment; other
    :class:`Options` fields may be given as keyword arguments.
    """

    def __init__(self, host_memory_budget: int = 1 << 30, **options):
        super().__init__(Options(host_memory_budget=host_memory_budget, **options))

    def open_write_session(self, target: WriteTarget, chunks: Sequence[Chunk], plan: Plan) -> Session:
        kvstore = layout_kvstore(target.kvstore, self.options.layout, writer=f"p{self.worker_id}")
        session = Session(kvstore, context=target.context, fsync=self.options.fsync, checksums=self.options.checksums,
                          keep_page_cache=self.options.keep_page_cache)
        # In the background: the SYNC copies need not wait for it, only the writes.
        session.arrays_created = self._pool.submit(session.create_arrays, arrays_of(chunks, plan))
        return session

    def open_read_session(self, location: Location, manifest: Manifest) -> Session:
        return Session(stored_arrays(location, manifest), context=location.context,
                       keep_page_cache=self.options.keep_page_cache)

    def copy_to_host(self, plan, chunks, sources, staging):
        return copy_chunks_to_host(plan, chunks, sources, staging)

    def submit_write(self, session, regions, buffers):
        return self._pool.submit(write_regions, session, regions, buffers)

    def submit_read(self, session, regions, out):
        return self._pool.submit(read_regions, session, regions, out)

    def submit_checksums(self, session, regions):
        return self._pool.submit(checksum_regions, session, regions)
