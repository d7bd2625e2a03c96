"""Promotion: a persistent step made from the local tier's copies of a step, byte for byte.

    mgr.save(step, state, local=True)          # every N steps: fast, this process's regions only
    ...
    mgr.promote(step)                          # later, every process: the step in the root, no device touched

A promotion is an ordinary save of the root (the save driver, its staging budget and batches, the
job's commit protocol, the step's info and items attached) whose "copy to host" reads stored
chunks from the local copies and whose writer writes them unchanged: each chunk's encoded bytes
are read through a TensorStore kvstore and written under the same key in the persistent step's
arrays (zarr3 arrays of the same metadata), so no chunk is re-encoded and no device is used.
Which process copies which chunk (once job-wide, by a process whose copy holds it) is the pure
``promote_plan``; the processes agree on it from one gather of what their copies hold.
Checks: every chunk is checked before it is written (``_Copies.checked``): an uncompressed one's
length and CRC-32C as stored, a compressed one decoded from the local copy; a bad local chunk fails
the promotion (nothing is committed), naming its key path. Each chunk's CRC-32C (of its decoded
data, as a save records it) is carried over into the promoted step's manifest. The promoted step
keeps the local steps' unpacked layout (docs/format.md). See docs/manager.md "Local tier".
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import jax
import numpy as np
from absl import logging

from dispatch_io import manifest as manifest_lib
from dispatch_io.manager.tiers import promote_plan
from dispatch_io.plan.batches import Priority, make_batches
from dispatch_io.multihost.coordination import open_room
from dispatch_io.errors import CheckpointError, CorruptCheckpointError
from dispatch_io.formats.detect import open_ours
from dispatch_io.manager import info as info_lib
from dispatch_io.manager import items as items_lib
from dispatch_io.manager.tiers import job_steps, local_steps
from dispatch_io.save.driver import SaveHandle
from dispatch_io.save.job import Attachments, SaveJob
from dispatch_io.storage import Location
from dispatch_io.workers import ChunkError, Session, checksum_regions, crc32c, numpy_dtype
from dispatch_io.workers.raw_chunks import chunk_key, read_values, write_values


def _grid(region, chunk_shape) -> tuple[int, ...]:
    return tuple(lo // step for (lo, _), step in zip(region, chunk_shape))


class _Copies:
    """The runner of a promotion's save (``SaveRun`` calls it as it calls a dispatcher's):
    ``copy_to_host`` reads the batch's chunks as stored in this process's local copy (``opened``;
    None: it has none, and the plan gives it nothing to copy); its writer checks them
    (:meth:`checked`) and writes them unchanged. The staging ring only counts their bytes
    (``host_staging = False``)."""

    host_staging = False

    def __init__(self, threads, settings, opened, display: str):
        self.threads, self.settings, self.display = threads, settings, display
        self._session = None if opened is None else Session(opened.arrays, settings, opened.context)
        # (stored array, chunk grid index) -> CRC-32C of the chunk's decoded data, as this copy's save recorded it
        self.checksums = {} if opened is None else {
            (leaf.stored.name, grid): crc for leaf in opened.manifest.leaves if leaf.checksums
            for grid, crc in leaf.checksums.items()}

    def open_writer(self, target) -> "_Writer":
        return _Writer(self, target)

    def copy_to_host(self, plan, chunks, sources, staging) -> list[bytes]:
        specs = [plan.leaves[c.leaf] for c in chunks]
        keys = [chunk_key(s.storage, _grid(c.region, s.chunk_shape)) for c, s in zip(chunks, specs)]
        values = read_values(self._session.open_kvstore().result(), keys)
        for value, key, chunk, spec in zip(values, keys, chunks, specs):
            if value is None:
                raise ChunkError(spec.keypath, chunk.region, FileNotFoundError(
                    f"chunk {key} is missing from {self.display} (its info says it holds it)"))
        return values

    def checked(self, regions, values) -> list[int | None]:
        """The CRC-32C of each chunk (``values[i]``: the stored bytes of the chunk ``regions[i]``,
        a whole chunk of its array), once checked against the local copy's manifest, or None
        (no CRC-32C saved, and the promotion saves none). A damaged chunk raises ChunkError (its
        cause a CorruptCheckpointError) naming its key path: nothing of the promotion is committed.

        * Uncompressed: the stored bytes are the chunk's data, always the whole chunk shape (zarr
          pads edge chunks), so a value of another length (a torn write) is damaged even where no
          CRC-32C was saved; the bytes' CRC-32C is the data's (a local step's chunks tile its arrays
          exactly, as JAX's shards do: no chunk holds padding).
        * Compressed: the bytes cannot be checked as they are; TensorStore decodes the chunk from the
          local copy (``workers.checksum_regions``: what ``Dispatcher.verify`` reads), which fails for a
          damaged frame or a chunk of the wrong size, and gives the data's CRC-32C."""
        saved = [self.checksums.get((r.array.name, _grid(r.bounds, r.array.chunk_shape))) for r in regions]
        if self.settings.compression is not None:
            found = checksum_regions(self._session, regions)  # ChunkError naming the key path if it cannot decode
        else:
            found = [self._raw_checksum(region, value, crc is not None)
                     for region, value, crc in zip(regions, values, saved)]
        for region, crc, got in zip(regions, saved, found):
            if crc is not None and got != crc:
                grid = list(_grid(region.bounds, region.array.chunk_shape))
                raise ChunkError(region.keypath, region.bounds, CorruptCheckpointError(
                    f"{self.display}: chunk {grid} of {region.keypath} does not match its CRC-32C ({got:08x}, "
                    f"saved {crc:08x}): the local copy is damaged", keypath=region.keypath, chunk=grid))
        return [crc if crc is not None else got if self.settings.checksums else None for crc, got in zip(saved, found)]

    def _raw_checksum(self, region, value: bytes, saved: bool) -> int | None:
        """The CRC-32C of an uncompressed chunk's stored bytes (None if there is none to compare
        or to save), once its length is checked."""
        expected = math.prod(region.array.chunk_shape) * numpy_dtype(region.array.storage_dtype).itemsize
        if len(value) != expected:
            grid = _grid(region.bounds, region.array.chunk_shape)
            raise ChunkError(region.keypath, region.bounds, CorruptCheckpointError(
                f"{self.display}: chunk {list(grid)} of {region.keypath} is {len(value)} bytes, not the {expected} of "
                f"its {list(region.array.chunk_shape)} {region.array.storage_dtype} chunk shape: the local copy is "
                "damaged (cut short?)", keypath=region.keypath))
        return crc32c(np.frombuffer(value, np.uint8)) if saved or self.settings.checksums else None

    def close(self):
        if self._session is not None:
            self._session.close()


class _Writer:
    """Writes a batch's chunk values, once checked (:meth:`_Copies.checked`), under their keys in
    this process's writer database of the persistent step (one transaction per batch with OCDBT);
    resolves to their CRC-32Cs."""

    def __init__(self, copies: _Copies, target):
        self._copies = copies
        self._session = Session.writer(target.kvstore, f"p{jax.process_index()}", copies.settings, target.context)

    def write(self, regions, values):
        return self._copies.threads.submit(self._write, regions, values)

    def _write(self, regions, values) -> list[int | None]:
        sums = self._copies.checked(regions, values)
        out = {chunk_key(r.array.name, _grid(r.bounds, r.array.chunk_shape)): v for r, v in zip(regions, values)}
        write_values(self._session.open_kvstore().result(), out, self._session.transactional)
        return sums

    def close(self):
        self._session.close()


def _report(local, step: int) -> tuple[dict, dict | None]:
    """(What this process's local copy of ``step`` holds, as the others need it (JSON), its manifest
    JSON). A copy whose info or manifest cannot be read is no copy (logged), as a wiped one."""
    info = local.infos()[0].get(step)
    try:
        doc = None if info is None else Location.parse(local.root.step_path(step)).read_manifest()
    except (CheckpointError, OSError) as exc:
        logging.warning("dispatch_io: local step %s is not promoted from: %s", local.root.step_path(step), exc)
        info = doc = None
    if info is None:
        return {"has": False, "held": {}, "items": {}, "info": None}, None
    return {"has": True, "held": info["held"], "items": info.get("items", {}), "agreed": local_steps.agreed(info),
            "info": {"started": info.get("started"), "metrics": info.get("metrics", {}),
                     "metadata": info.get("metadata")}}, doc


def _gather(local, step: int, path: str, report: dict, doc: dict | None) -> tuple[dict, dict | None]:
    """({process: report}, the step's manifest JSON) of every process's local copy (``report``,
    ``doc``: this process's, :func:`_report`): one gather, then the manifest from the first process
    with a copy to those without (None if none has one)."""
    if local.count == 1:
        return {0: report}, doc
    room = open_room("promote", path, f"the promotion of step {step} to {path}", local.dispatcher.options.barrier_timeout)
    try:
        room.set(f"report/{local.process}", report)
        reports = room.gather("report")
        having = sorted(p for p, r in reports.items() if r["has"])
        doc = job_steps.share_manifest(room, step, having, local.process, lambda: doc) or doc
    finally:
        room.close()
    return reports, doc


# A chunk value in flight is held about this many times over: as read (TensorStore's buffer, then its
# bytes), and as written (in the transaction, then in the data file being written; freed at commit).
# A compressed chunk is decoded too, to check it (``_Copies.checked``): once more, at its decoded size.
COPIES = 4


def _batches(plan, options, process: int, compressed: bool) -> tuple:
    """This process's batches of ``plan``, each counting ``COPIES`` (``compressed``: one more)
    times its chunks' bytes in the staging ring (which only counts: ``_Copies.host_staging``), so
    the values in flight stay within the budget as a save's staged chunks do."""
    copies = COPIES + compressed
    batches = make_batches(plan, [Priority.LOW] * len(plan.leaves), max(1, options.batch_bytes // copies),
                           worker=process)
    return tuple(dataclasses.replace(b, nbytes=min(b.nbytes * copies, options.staging_bytes)) for b in batches)


def _described(doc: dict) -> tuple:
    """``manifest.describe``'s (structure, entries, packs) of the local step's manifest, without
    its checksums (the promotion's are added by ``manifest.build``)."""
    entries = [{**e, "stored": {k: v for k, v in e["stored"].items() if k != "crc32c"}} if e.get("stored") else e
               for e in doc["leaves"]]
    return doc["structure"], entries, {}


def _item_files(local, step: int, items: dict, json_writer: bool) -> dict[str, bytes]:
    """This process's item files of the promoted step, read from its local copy: its own value of
    each PerProcess item, and the Json items where it is the one writing them."""
    location, files = Location.parse(local.root.step_path(step)), {}
    for name, entry in items.items():
        if entry["kind"] == "json" and not json_writer:
            continue
        key, data, _ = items_lib.read(lambda k: location.read_file(manifest_lib.ARRAYS + k), name, entry, step,
                                      local.process, local.count, location.display)  # a damaged file fails, named
        files[key] = data
    return files


class Deferred:
    """The handle of the persistent save of ``step`` (at ``path``) by promotion of its local save
    ``first``: the promotion starts once the local save is over, on the first thread that waits
    for it then (the manager's, which waits for every persistent save). The step is kept from
    local retention until the promotion is over, or could not start.

    A failed local save (whatever its error) is no copy: the promotion still goes on, from the
    peers' copies, or fails in every process alike (it is collective: the other processes wait
    for this one's report). That failure is the step's report in this process (``LocalTiers.wait``
    raises it, once); a promotion failing after it is raised by this handle, never again by the
    manager (:func:`to_report`)."""

    def __init__(self, first: SaveHandle, local, step: int, path: str, launch):
        self._first, self._local, self._step, self._launch = first, local, step, launch
        self.path = Location.parse(path).display  # the persistent step's, as a save's handle names it
        self._lock = threading.Lock()
        self._started: SaveHandle | BaseException | None = None   # the promotion's handle, or why it did not start
        self.local_failure: BaseException | None = None           # why the local save failed, if it did
        local.promoting.add(step)

    def wait(self, timeout: float | None = None):
        """Wait for the local save, start the promotion if no thread did, then wait for it, as
        ``SaveHandle.wait`` does: TimeoutError once ``timeout`` seconds are over, wherever it is (the
        promotion goes on). A promotion that could not start raises the same error to every caller
        (it is never started twice: it is a collective call)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        left = lambda: None if deadline is None else max(0.0, deadline - time.monotonic())  # noqa: E731
        failure = None
        try:
            self._first.wait(left())
        except BaseException as exc:
            if not self._first.done():  # the timeout (or an interrupt of this thread): nothing is decided
                raise
            failure = exc               # the local save's own failure
        if not self._lock.acquire(timeout=-1 if deadline is None else left()):  # another thread is starting it
            raise TimeoutError(f"the promotion of step {self._step} to {self.path} not started after {timeout} s")
        try:
            if self._started is None:
                self._start(failure)
        finally:
            self._lock.release()
        if isinstance(self._started, BaseException):
            raise self._started
        return self._started.wait(left())

    def _start(self, failure: BaseException | None):
        """Start the promotion (the local save is over; ``failure``: why it failed, or None)."""
        if failure is not None:
            self.local_failure = failure
            logging.warning("dispatch_io: the local save of step %d failed (%s); promoting it from the other "
                            "processes' copies, if they hold it whole", self._step, failure)
        try:
            self._started = self._launch()  # pins the step itself until its save is over
        except BaseException as exc:  # noqa: BLE001 - kept for every caller, raised by wait()
            if exc.__cause__ is None and failure is not None:
                exc.__cause__ = failure
            self._started = exc
            self._local.promoting.discard(self._step)

    def done(self) -> bool:
        return isinstance(self._started, BaseException) or (self._started is not None and self._started.done())


def to_report(handle, error: BaseException) -> BaseException | None:
    """What the manager raises (once, from the next ``save()`` / ``wait()``) for its persistent save
    ``handle`` that failed with ``error``: ``error``, or None for a promotion after a failed local
    save of the step in this process (:class:`Deferred`): that failure, which ``LocalTiers.wait``
    raises, is the step's report; the promotion's (most likely "no copy") is its consequence."""
    return None if isinstance(handle, Deferred) and handle.local_failure is not None else error


def after(first: SaveHandle, local, step: int, version: str, clock, overwrite: bool):
    """``launch(path)`` for the manager's persistent save of ``step`` by promotion of the local
    save ``first`` (``LocalTier(promote=True)``): returns a :class:`Deferred` handle."""
    return lambda path: Deferred(first, local, step, path, lambda: promote(
        local, step, path, version, clock, overwrite=overwrite, wait_local=False))


def promote(local, step: int, path: str, version: str, clock, *, overwrite: bool = False,
            wait_local: bool = True) -> SaveHandle:
    """Save local ``step`` as the persistent step at ``path`` from the local copies of every
    process (every process calls it together; see the module doc). Returns the save's handle.
    ``local``: this process's ``tiers.LocalTiers``; ``version``: dispatch_io's, for the step info;
    ``clock``: UNIX seconds, its commit time. ``wait_local``: wait for the local save in flight first
    (the step's own, maybe; False: the caller did). Local retention keeps the step until the save is over.

    Raises (every process alike, before anything is written): FileNotFoundError naming the step if
    no process has a local copy of it, or naming a key path no copy holds whole; ValueError if a
    process without a copy would lose its PerProcess items, if the step is of a history the job
    left (``LocalTiers.abandoned``), or (``wait_local``) if the job never agreed it whole; and as ``Dispatcher.save`` does for
    ``path``. ``wait()`` raises ``WorkerError`` (naming the key path) for a chunk that cannot be
    read or fails its CRC-32C; nothing is committed then. ValueError without a local tier (``local`` None)."""
    if local is None:
        raise ValueError("promote() needs a local tier: CheckpointManager(..., local=dio.LocalTier(...))")
    if local.abandoned(step):
        raise ValueError(f"local step {step} is of a history the job left (it restored an older step since, or "
                         "started afresh): it is never persisted")
    if wait_local:
        local.wait()  # raising its failure
    local.promoting.add(step)  # from the first look at the step: a local save meanwhile must not delete it
    copies = None

    def over(_=None):
        if copies is not None:
            copies.close()
        local.promoting.discard(step)
    try:
        job, copies = _job(local, step, path, version, clock, agreed=wait_local)
        # the dispatcher's save launch: its path lock, commit protocol, staging ring and driver
        run = local.dispatcher.launch(Location.parse(path), job, [None] * len(job.plan.leaves), copies, overwrite)
    except BaseException:
        over()
        raise
    run.future.add_done_callback(over)
    return SaveHandle(run)


def _job(local, step: int, path: str, version: str, clock, agreed: bool) -> tuple[SaveJob, _Copies]:
    """The promotion's save job (plan, batches, manifest entries, items and info) and its runner.
    ``agreed``: refuse a step no process's info says the job agreed whole (a promotion of a step the
    job saved long before; one of the step just saved, ``LocalTier(promote=True)``, starts as the
    local save ends, before the agreement: its gather fails if a process is missing)."""
    started = time.perf_counter()
    dispatcher = local.dispatcher
    report, own = _report(local, step)
    reports, doc = _gather(local, step, path, report, own)
    where = f"local step {step} of {local.tier.process_path('{process}')}"
    if doc is None:
        raise FileNotFoundError(f"{where}: no process has a local copy of step {step}: it cannot be promoted")
    if agreed and not any(r["has"] and r["agreed"] for r in reports.values()):
        raise ValueError(f"{where} was never agreed whole by the job (some process's local save of it failed): it "
                         "is not promoted")
    manifest = manifest_lib.parse(doc, where)
    if doc.get(manifest_lib.REFERENCES):   # its unchanged chunks are in an older local step's arrays, not its own
        steps = ", ".join(sorted({str(r.get("step")) for r in doc[manifest_lib.REFERENCES]}, key=int))
        raise ValueError(f"{where} was saved incrementally (it references local step(s) {steps}): it cannot be copied byte for byte; a step saved "
                         "to both tiers with LocalTier(promote=True) is stored whole locally, and promotes")
    try:
        plan = promote_plan.plan_promotion(manifest, {p: r["held"] for p, r in reports.items() if r["has"]}, where)
    except FileNotFoundError as exc:
        lacking = sorted(p for p, r in reports.items() if not r["has"])
        if not lacking:
            raise
        raise FileNotFoundError(f"{exc}: process(es) {lacking} have no local copy of it (lost?); a restore rebuilds "
                                "a lost process's regions from parity, a promotion does not -- save the restored "
                                "state to the root instead") from None
    index, json_writer = promote_plan.items_of(step, reports, local.count)
    files = _item_files(local, step, report["items"], json_writer == local.process) if report["has"] else {}
    meta = reports[json_writer]["info"]
    info = {**info_lib.make(step, meta["started"], meta["metrics"] or {}, meta["metadata"], index, local.count,
                            version), "promoted": "local"}
    settings = dataclasses.replace(dispatcher.runner.settings, compression=manifest.compression)
    opened = open_ours(local.root.step_path(step)) if report["has"] else None
    described = _described(doc)
    batches = _batches(plan, dispatcher.options, local.process, manifest.compression is not None)
    job = SaveJob(plan, tuple(e.get("value") for e in doc["leaves"]), batches,
                  Location.parse(path).display, started=started, plan_seconds=time.perf_counter() - started,
                  progress=dispatcher.options.progress, describe=lambda: described,
                  attachments=Attachments(files, info, clock, agreed=index))
    return job, _Copies(dispatcher.runner.threads, settings, opened, where)
