"""The controller-facing API: :class:`Dispatcher` plans, batches and hands the work to a runner.

``Dispatcher(options, runner)`` owns what every way of running the workers shares: planning
(cached per tree structure), batching, per-path locks, the staging ring, the multi-process
coordinator, and the check that no call comes from one of its own IO threads. Where the
worker code runs is the runner's business (``runner.py``): :class:`LocalDispatcher` and
``ColocatedDispatcher`` are the same class with a different runner.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from typing import Callable

import jax

from dispatch_io import collector
from dispatch_io.multihost import commit as commit_lib
from dispatch_io import manifest as manifest_lib
from dispatch_io.plan import held
from dispatch_io import read_api
from dispatch_io.save import transfer
from dispatch_io.incremental import changes as incremental_lib
from dispatch_io.read import ring as read_ring
from dispatch_io.save import pinned_pool
from dispatch_io.formats import exporting
from dispatch_io.formats import to_orbax
from dispatch_io.formats import to_safetensors
from dispatch_io.plan.batches import Priority, leaf_priorities, make_batches, sync_overflow
from dispatch_io.formats.convert import StoredSource, check_apart, plan_stored, source_session
from dispatch_io.errors import WorkerError
from dispatch_io.options import Options
from dispatch_io.workers import deadlines
from dispatch_io.plan.save_plan import Plan, PlanCache, with_packs
from dispatch_io.progress import RestoreStats
from dispatch_io.runner import LocalRunner, Runner
from dispatch_io.save.transfer import platform
from dispatch_io.save.driver import SaveHandle, SaveRun, check_callbacks
from dispatch_io.save.job import Attachments, SaveJob
from dispatch_io.locks import PathLocks
from dispatch_io.save.staging import StagingRing
from dispatch_io.formats.detect import open_checkpoint
from dispatch_io.storage import Location

PriorityFn = Callable[[str, jax.ShapeDtypeStruct], Priority]

# A CPU device's memory is host memory: a snapshot there would be host memory outside the budget.
NO_SNAPSHOT_PLATFORMS = ("cpu",)


class Dispatcher:
    """Save / restore through a memory-budgeted pipeline, worker code run by ``runner`` (module doc).
    ValueError for a ``LocalRunner`` whose transfer contradicts ``options.host_transfer``."""

    def __init__(self, options: Options, runner: Runner):
        if isinstance(runner, LocalRunner) and options.host_transfer not in (transfer.AUTO, runner.transfer):
            raise ValueError(f"host_transfer={options.host_transfer!r}, but the runner copies {runner.transfer!r} "
                             "(LocalRunner(transfer=transfer.resolve(options.host_transfer)))")
        deadlines.configure(options.request_timeout, options.min_request_rate)  # before any object-store request
        self.options = options
        self.runner = runner
        self._plans = PlanCache(options.chunk_bytes, options.small_leaf_bytes)
        self._ring = StagingRing(options.staging_bytes)
        self._read_ring = read_ring.ring_for(runner, options.host_memory_budget)   # the pinned path's restores
        self._paths = PathLocks()
        self._digests = incremental_lib.DigestCache()  # of the jax arrays saved incrementally, while they live
        self._active: dict[SaveRun, str] = {}  # runs in flight -> their path's key
        self._lock = threading.Lock()
        self._closed = False
        # RestoreStats of the restore that finished last on this dispatcher (from any thread).
        self.last_restore_stats: RestoreStats | None = None
        self.coordinator = commit_lib.for_this_job(options.barrier_timeout)

    # ---- save -------------------------------------------------------------------------------

    def save(self, path, tree, *, priority: PriorityFn | None = None,
             on_transfer_end: Callable[[str], None] | None = None,
             on_write_end: Callable[[str], None] | None = None, overwrite: bool = False,
             attachments: Attachments | None = None, own: bool = False, copies=None,
             incremental: bool | str = False) -> SaveHandle:
        """Save ``tree`` to ``path``; returns once every SYNC leaf is off the device.

        ``priority(keypath, spec)`` gives each array leaf a :class:`Priority` (default SYNC).
        ``on_transfer_end(keypath)`` fires exactly once per array leaf, once its device data is
        no longer needed (copied, or the save failed first); ``on_write_end(keypath)`` once its
        bytes are written (not for leaves a failed save did not write). ``attachments``: small
        files committed with the arrays (what ``CheckpointManager`` stores beside a step). ``own``: a
        local-tier save (``held.own_plan``), committed by this process alone, unpacked; ``copies``
        (with ``own``): key path -> other processes' regions received here (``held.Replica``), saved too.
        ``incremental``: ``path`` is ``<root>/<step>``; chunks unchanged since the root's newest
        committed step are stored by reference to it, not copied or written (``incremental.changes``;
        with ``own``, the ``copies`` received too);
        ``"whole"``: every chunk written and its digest recorded, so the incremental saves after it can
        reference it (a local tier's step that promotion copies byte for byte).
        Raises before anything is written: ``TypeError`` (unsupported leaf, naming its key path;
        a callback argument not callable; a priority not a ``Priority``), ``RuntimeError`` (the
        priority callback raised, chained; after ``close()``; from this dispatcher's own
        callbacks) or ``FileExistsError``. Call ``.wait()`` on the handle for durability and errors.
        """
        self._check_usable("save")
        check_callbacks(priority=priority, on_transfer_end=on_transfer_end, on_write_end=on_write_end)
        started = time.perf_counter()
        location = Location.parse(path)
        with collector.paused():
            plan, leaves, cached = self._plans.get(tree)
            copies = held.copies_by_leaf(plan, copies, own)
            if own:
                placed = tuple((i, tuple((r.device.id, r.region) for r in rs)) for i, rs in copies.items())
                plan = self._plans.derive(plan, ("own", placed),
                                          lambda: held.own_plan(plan, jax.process_index(), copies))
            priorities = leaf_priorities(plan, priority)
            packed, batches, describe = self._layout(plan, priorities, packs=not own)
        overflow = self._snapshot_sync_overflow(packed, leaves, batches)
        if overflow:  # on their devices now: to host later, with HIGH priority
            priorities = [Priority.HIGH if i in overflow else p for i, p in enumerate(priorities)]
            with collector.paused():
                packed, batches, describe = self._layout(plan, priorities, packs=not own)
        increment, attachments = None, attachments or Attachments()
        if incremental:  # only changed chunks are copied and written
            batches, increment, attachments = incremental_lib.plan_save(
                location, packed, leaves, batches, self.options.checksums, attachments, self._digests, alone=own,
                whole=incremental == "whole", copies=copies)
        job = SaveJob(packed, manifest_lib.scalar_values(plan, leaves),
                      batches, location.display, on_transfer_end, on_write_end, started,
                      plan_seconds=time.perf_counter() - started, plan_cached=cached,
                      snapshot_bytes=sum(plan.leaves[i].nbytes for i in overflow), progress=self.options.progress,
                      describe=describe, attachments=attachments, increment=increment)
        single = commit_lib.SingleProcess() if own else None
        run = self.launch(location, job, leaves, self.runner, overwrite, single, copies)
        run.wait_until_sync_copied()
        return SaveHandle(run)

    def launch(self, location: Location, job: SaveJob, leaves: list, runner, overwrite: bool, coordinator=None,
                copies: dict | None = None) -> SaveRun:
        """Start ``job`` (a planned save: ``save``, ``convert``, a promotion), its bytes from ``runner``: take the
        path's lock (it goes with the run), open the commit (same plan everywhere), start the driver."""
        self._paths.acquire(location.key)  # released by the run when it is over
        commit = None
        try:
            opened = (coordinator or self.coordinator).open(location)
            settings = runner.settings
            opened.check_same_plan(job.plan, settings.stored_as, job.attachments.agreed)
            opened.start(overwrite)
            commit = opened
            run = SaveRun(job, leaves, runner, commit, self._ring, settings, self._finished, copies)
            self._start(run, location.key)
        except BaseException as exc:
            if commit is not None:
                commit.abandon(exc)
            self._paths.release(location.key)
            raise
        return run

    def convert(self, src, dst, *, overwrite: bool = False, to: str = "dispatch_io", names: Callable | None = None,
                skip_unsupported: bool = False, max_shard_size: int | None = None):
        """Copy the checkpoint at ``src`` (dispatch_io, Orbax's or safetensors) into a new checkpoint
        at ``dst``: ``to="dispatch_io"`` (keeping key paths, dtypes, PRNG key impls and saved
        shardings; returns the save's :class:`SaveStats`), ``"safetensors"`` or ``"orbax"`` (a local
        path or an ``s3://`` / ``gs://`` prefix, committed by a file written last; return an
        :class:`~dispatch_io.formats.exporting.ExportStats`). See docs/format.md.

        Streams: at most the host memory budget of stored bytes is held at once, however large
        the checkpoint; no device memory is used. Exports name leaves by their key names joined
        by ``.`` unless ``names(key path) -> str`` says otherwise; what the format cannot hold
        (safetensors: PRNG keys, Python scalars, int4...) raises ValueError naming the key path,
        or is left out with ``skip_unsupported``; ``max_shard_size``: bytes of tensor data per
        file (default 5 GB); these three are for safetensors only. Raises as ``restore`` does for
        ``src``, as ``save`` does for ``dst`` (``FileExistsError`` unless ``overwrite``); ``ValueError``
        if ``dst`` is ``src``, inside it or holds it. A failure leaves nothing at ``dst``."""
        self._check_usable("convert")
        exporting.check_keywords(to, names, skip_unsupported, max_shard_size)
        started = time.perf_counter()
        location = Location.parse(dst)
        check_apart(Location.parse(src), location)
        source = open_checkpoint(src)
        session = source_session(source, self.runner.settings, self.options.chunk_bytes)
        if to != "dispatch_io":
            common = dict(overwrite=overwrite, chunk_limit=self.options.chunk_bytes,
                          batch_limit=self.options.read_batch_bytes)
            try:
                if to == "safetensors":
                    return to_safetensors.export(session, source, dst, names=names, skip=skip_unsupported,
                                                 max_shard_size=max_shard_size, **common)
                return to_orbax.export(session, source, dst, settings=self.runner.settings, **common)
            finally:
                session.close()
        plan = plan_stored(source.manifest, self.options.chunk_bytes, self.options.small_leaf_bytes)
        batches = make_batches(plan, [Priority.LOW] * len(plan.leaves), self.options.batch_bytes,
                               worker=jax.process_index())
        job = SaveJob(plan, manifest_lib.scalar_values(plan, [s.value for s in source.manifest.leaves]),
                      batches, location.display, started=started, plan_seconds=time.perf_counter() - started,
                      progress=self.options.progress)
        local = self.runner if isinstance(self.runner, LocalRunner) else LocalRunner(self.runner.settings,
                                                                                      self.runner.threads)
        reader = StoredSource(local, session, [s.stored for s in source.manifest.leaves], source.check_unchanged)
        try:
            return SaveHandle(self.launch(location, job, [None] * len(plan.leaves), reader, overwrite)).wait()
        finally:
            reader.close()

    def _snapshot_sync_overflow(self, plan: Plan, leaves: list, batches) -> set[int]:
        """``Options.device_snapshots``: replace the SYNC leaves beyond the host budget (on
        accelerators) by copies on the same devices, wait for the copies, return their indices."""
        if not self.options.device_snapshots:
            return set()
        indices = sorted(i for i in sync_overflow(plan, batches, self.options.staging_bytes)
                         if platform(leaves[i]) not in NO_SNAPSHOT_PLATFORMS)
        worker = jax.process_index()

        def failed(i, exc):
            keypath = plan.leaves[i].keypath
            return WorkerError(f"worker {worker} failed copying {keypath} on its devices: "
                               f"{type(exc).__name__}: {exc}", worker=worker, keypath=keypath)

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

    def _layout(self, plan: Plan, priorities: list[Priority], packs: bool = True):
        """(``plan`` with its small leaves packed, this process's batches, ``manifest.describe`` of it, lazily)
        for ``priorities``: a training loop saving the same state packs, batches and describes it once."""
        options, worker = self.options, jax.process_index()

        def make():
            packed = with_packs(plan, options.small_leaf_bytes, options.chunk_bytes // 2, priorities) if packs else plan
            batches = make_batches(packed, priorities, options.batch_bytes, worker=worker,
                                   whole_shards=getattr(self.runner, "transfer", None) == transfer.PINNED)
            return packed, batches, functools.cache(lambda: manifest_lib.describe(packed))
        return self._plans.derive(plan, ("layout", tuple(priorities), worker, packs), make)

    def _start(self, run: SaveRun, run_key: str):
        """Register ``run`` (unless the dispatcher was closed meanwhile) and start its driver."""
        with self._lock:
            self._check_usable("save")
            if not self._active:  # peak_host_bytes is per save (overlapping saves share the ring)
                self._ring.reset_peak()
            self._active[run] = run_key
        try:
            run.start()
        except BaseException:  # e.g. no thread can be started: nothing may wait for this run
            with self._lock:
                self._active.pop(run, None)
            raise

    def _finished(self, run: SaveRun):
        """Called by a run when it is over, from its driver thread."""
        with self._lock:
            key = self._active.pop(run)
            idle = not self._active
        self._paths.release(key)
        if idle and not self.options.keep_staging_warm:
            self._ring.drop_buffer()

    def _check_usable(self, what: str):
        """RuntimeError for a closed dispatcher or a call from one of its own IO threads (not a hang)."""
        self.check_not_io_thread(f"{type(self).__name__}.{what}")
        if self._closed:
            raise RuntimeError(f"{type(self).__name__}.{what}() called after close()")

    def check_not_io_thread(self, caller: str):
        """RuntimeError if the calling thread is one of this dispatcher's IO threads (the save callbacks'):
        ``caller`` (e.g. ``"CheckpointManager.wait"``) would wait there for their work, and deadlock."""
        if self.runner.threads.is_current():
            raise RuntimeError(f"{caller}() called from one of {type(self).__name__}'s own IO threads "
                               "(an on_transfer_end / on_write_end callback): that would deadlock; "
                               "hand the work to another thread or dispatcher")

    # ---- restore ------------------------------------------------------------------------------

    def restore(self, path, target=None, *, partial: bool = False, cast: bool = False, verify: bool = False,
                names: Callable | None = None):
        """Read the checkpoint at ``path``.

        ``target`` (a pytree) says what to build: ``jax.ShapeDtypeStruct`` leaves with a
        sharding (None: the default device), ``jax.Array`` leaves (their sharding is used),
        ``np.ndarray`` leaves (host numpy). ``target=None`` returns the saved tree with numpy
        arrays and PRNG keys as key arrays on the default device. Strict: every mismatch is
        reported at once (``TreeMismatchError``) before anything is read; ``partial=True``
        lets the target name a subset of the leaves, ``cast=True`` allows dtype changes.
        ``verify=True`` first checks every stored chunk it reads against the CRC-32C saved with
        it (``Options(checksums=True)``): ``CorruptCheckpointError`` names each bad chunk.
        ``path`` may also hold Orbax's or Hugging Face safetensors (docs/format.md). ``names``: a
        function from a target leaf's JAX key path to the name of the saved leaf it reads (its key
        names joined by ``.``: a safetensors tensor name such as ``"model.layers.3.mlp.up_proj.weight"``);
        default for safetensors: the target's own key names joined by ``.``.

        What it did (bytes, batches, seconds per stage) is then ``self.last_restore_stats``.
        """
        self._check_usable("restore")
        result, self.last_restore_stats = read_api.restore(self.runner, self.options, path, target, partial=partial,
                                                           cast=cast, verify=verify, names=names,
                                                           ring=self._read_ring)
        return result

    def verify(self, path) -> RestoreStats:
        """Read every stored chunk of the checkpoint at ``path`` once and, if it was saved with
        checksums, check each against its CRC-32C; returns what it did (``verify_seconds``).

        Chunk by chunk, two budget halves at a time: host memory stays within the budget however
        large the checkpoint -- or two stored chunks, for chunks larger than half the budget:
        every chunk is read whole, as a restore would decode it. Raises ``CorruptCheckpointError``
        naming each bad chunk's key path, ``WorkerError`` / ``CheckpointError`` for what cannot
        be read, before that ``FileNotFoundError`` / ``IncompleteCheckpointError`` for a path
        that holds no committed checkpoint. In a multi-process job (all processes call it) each
        process checks a share of the chunks and every process raises what any found
        (``shared_verify``). A local tier's step (its step info says so) holds one process's
        regions: only those are checked, by the process that calls it. ``dispatch-io verify`` calls it.
        """
        self._check_usable("verify")
        return read_api.verify(self.runner, self.options, path)

    # ---- lifecycle ------------------------------------------------------------------------------

    def wait_all(self):
        """Wait for every save in flight (errors stay with their handles)."""
        self.check_not_io_thread(f"{type(self).__name__}.wait_all")
        with self._lock:
            runs = list(self._active)
        concurrent.futures.wait([r.future for r in runs])
        for r in runs:
            r.join()

    def close(self):
        """Wait for saves in flight and free the staging memory. Later ``save()`` / ``restore()``
        calls raise RuntimeError; closing twice is fine."""
        self.check_not_io_thread(f"{type(self).__name__}.close")
        with self._lock:
            self._closed = True
        self.wait_all()
        self.runner.close()
        self._ring.drop_buffer()
        if self._read_ring is not None:
            self._read_ring.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LocalDispatcher(Dispatcher):
    """Runs the worker code in-process on a thread pool: one worker per JAX process.

    ``host_memory_budget`` bounds the host bytes the IO holds at any moment; other
    :class:`Options` fields may be given as keyword arguments.
    """

    def __init__(self, host_memory_budget: int = 1 << 30, **options):
        options = Options(host_memory_budget=host_memory_budget, **options)
        mode = transfer.resolve(options.host_transfer)
        super().__init__(options, LocalRunner(options.io_settings(), transfer=mode))
        device = jax.local_devices()[0]
        # The first save then runs at the steady speed (pinned_pool); CPU devices have no pool.
        if mode == transfer.PINNED and device.platform != "cpu":
            pinned_pool.grow(device, options.staging_bytes)
