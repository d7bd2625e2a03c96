"""The save pipeline, shared by every dispatcher.

One driver thread per save walks the batches in priority order::

    acquire staging (blocks while the budget is full) -> copy the batch to host
      -> [last SYNC batch: save() may return] -> hand the batch to a worker to write
      -> (worker done) release staging, fire on_write_end
    ... all written -> manifest -> commit

Copying batch k+1 overlaps writing batch k, and the staging ring bounds host bytes in flight
at every moment. A failure anywhere stops new copies, waits for writes already handed out
(their buffers are still being read), removes the partial data and surfaces from ``wait()``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Callable

import jax
import numpy as np
from absl import logging

from dispatch_io import manifest as manifest_lib
from dispatch_io import progress as progress_lib
from dispatch_io import tree as tree_lib
from dispatch_io.batches import Batch, Priority
from dispatch_io.errors import CheckpointError, WorkerError
from dispatch_io.plan import Plan
from dispatch_io.staging import StagingRing
from dispatch_io.storage import Location
from workers import ChunkError, Region, merge_writers


# ``io_thread.owner`` is set on every thread a dispatcher runs its IO on (save drivers, pool
# workers) to that dispatcher's ``io_token``: callbacks run there, and must not wait on it.
io_thread = threading.local()


@dataclasses.dataclass(frozen=True)
class SaveStats:
    """What one save did (this process's part of it). Seconds are wall time; transfer and
    write overlap. The same numbers go to ``jax.monitoring`` (``dispatch_io.progress.EVENTS``)
    and, in short, to the INFO line a committed save logs."""

    path: str
    bytes_written: int
    batches: int
    plan_seconds: float
    blocked_seconds: float     # how long save() blocked the caller
    transfer_seconds: float    # device -> host copies
    write_seconds: float       # first write handed out -> last write durable
    commit_seconds: float
    total_seconds: float       # save() called -> committed
    peak_host_bytes: int       # most staging bytes held at once (<= host_memory_budget)
    plan_cached: bool
    snapshot_bytes: int = 0    # SYNC bytes copied on their devices first (Options.device_snapshots)


class SaveHandle:
    """A save in flight. ``wait()`` returns :class:`SaveStats` once the checkpoint is durable
    and committed, or raises what went wrong (``WorkerError`` names the worker and key path)."""

    def __init__(self, run: "SaveRun"):
        self._run = run

    def wait(self, timeout: float | None = None) -> SaveStats:
        try:
            return self._run.future.result(timeout)
        except concurrent.futures.TimeoutError:  # also the save's own TimeoutErrors (BarrierTimeoutError)
            if self._run.future.done():
                return self._run.future.result()
            raise TimeoutError(f"save to {self._run.display} not finished after {timeout} s") from None

    def done(self) -> bool:
        return self._run.future.done()

    @property
    def path(self) -> str:
        return self._run.display


class Sources:
    """The device (or host) data of the leaves being saved, found by (leaf, device id).

    References are dropped as soon as a leaf is fully copied, so the trainer's memory is
    not held longer than the copy needs."""

    def __init__(self, plan: Plan, leaves: list):
        self._plan = plan
        self._leaves = list(leaves)
        self._shards: dict[int, dict] = {}

    def locate(self, chunk) -> tuple:
        """(data, index): the shard holding ``chunk`` (a jax.Array or np.ndarray) and the
        slices of it that are the chunk's region."""
        start, data = self._shard(chunk.leaf, chunk.device)
        return data, tuple(slice(lo - s, hi - s) for (lo, hi), s in zip(chunk.region, start))

    def _shard(self, leaf: int, device: int | None):
        """(start offsets, data) of the shard on ``device``."""
        shards = self._shards.get(leaf)
        if shards is None:
            value, spec = self._leaves[leaf], self._plan.leaves[leaf]
            if spec.origin != "jax":
                shards = {None: ((0,) * len(spec.shape), np.asarray(value))}
            else:
                if spec.kind == tree_lib.KEY:
                    value = jax.random.key_data(value)
                shards = {s.device.id: (tuple(i.start or 0 for i in s.index), s.data)
                          for s in value.addressable_shards}
            self._shards[leaf] = shards
        return shards[device]

    def drop(self, leaf: int):
        self._shards.pop(leaf, None)
        self._leaves[leaf] = None


class SaveRun:
    """One save's state; ``engine`` is the dispatcher (how to copy, where to write)."""

    def __init__(self, engine, plan: Plan, leaves: list, batches: tuple[Batch, ...], save,
                 location: Location, ring: StagingRing, on_transfer_end: Callable | None,
                 on_write_end: Callable | None, started: float, plan_seconds: float, plan_cached: bool):
        self.engine = engine
        self.plan = plan
        # The manifest needs only the Python scalars; array leaves are held by ``sources`` alone,
        # which lets go of each as soon as it is copied.
        self.scalars = [leaf if spec.kind == tree_lib.SCALAR else None for spec, leaf in zip(plan.leaves, leaves)]
        self.sources = Sources(plan, leaves)
        self.batches = batches
        self.save = save   # coordination.LocalSave / DistributedSave: its target, and how to commit
        self.display = location.display
        self.location_key = location.key
        self.ring = ring
        self.on_transfer_end = on_transfer_end
        self.on_write_end = on_write_end
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.sync_done = threading.Event()
        self.sync_copied = False   # every SYNC leaf copied (sync_done is also set when the save fails)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._started, self._plan_seconds, self._plan_cached = started, plan_seconds, plan_cached
        self._blocked = None
        self._sync_at = None  # when the last SYNC batch was copied (save() returns soon after)
        self._transfer_seconds = 0.0
        self._first_write = self._last_write = None
        self._bytes = 0
        self.snapshot_bytes = 0
        self._checksums: dict[int, int] = {}   # chunk index -> CRC-32C (Options.checksums)
        # Chunks of each leaf still to copy / write *by this worker*.
        self._to_copy = [0] * len(plan.leaves)
        for b in batches:
            for i in b.chunks:
                self._to_copy[plan.chunks[i].leaf] += 1
        self._to_write = list(self._to_copy)
        self._last_sync = max((k for k, b in enumerate(batches) if b.priority == Priority.SYNC), default=-1)
        self.progress = progress_lib.Progress("save", self.display, enabled=engine.options.progress)
        self.progress.phase("", len(batches), sum(plan.chunks[i].nbytes for b in batches for i in b.chunks))
        self._thread = threading.Thread(target=self._run, name=f"dispatch_io-save:{self.display}")

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self):
        self._thread.start()

    def join(self):
        """Wait until the driver thread has finished (the future is resolved before that)."""
        self._thread.join()

    def wait_until_sync_copied(self):
        """Block until every SYNC leaf is off the device (or the save failed before that); raise
        the error then. A failure after the SYNC copies surfaces from ``wait()`` only, however
        late this thread wakes."""
        self.sync_done.wait()
        self._blocked = time.perf_counter() - self._started
        if not self.sync_copied and self.future.done() and self.future.exception() is not None:
            raise self.future.exception()

    def _sync_finished(self):
        self._sync_at = time.perf_counter()
        self.sync_copied = True
        self.sync_done.set()

    def _failed(self) -> bool:
        return self._error is not None

    def _fail(self, error: BaseException):
        with self._lock:
            if self._error is None:
                self._error = error

    def _worker_error(self, action: str, exc: BaseException, chunks=()) -> WorkerError:
        worker = self.engine.worker_id
        keypath = getattr(exc, "keypath", None)
        cause = exc.__cause__ if isinstance(exc, ChunkError) and exc.__cause__ else exc
        where = f" {keypath}" if keypath else ""
        if keypath is None and chunks:  # the failure names no leaf: name the batch's
            keypaths = list(dict.fromkeys(self.plan.leaves[c.leaf].keypath for c in chunks))
            keypath = keypaths[0] if len(keypaths) == 1 else None
            where = f" {keypath}" if keypath else f" a batch of {', '.join(keypaths)}"
        err = WorkerError(f"worker {worker} failed {action}{where} for {self.display}: "
                          f"{type(cause).__name__}: {cause}", worker=worker, keypath=keypath)
        err.__cause__ = exc
        return err

    def _callback(self, fn, keypath):
        if fn is None:
            return
        try:
            fn(keypath)
        except BaseException:  # noqa: BLE001 - a trainer's callback bug must not lose the checkpoint
            # BaseException too: raised on an IO thread, SystemExit / KeyboardInterrupt would only
            # kill that thread (a pool worker, or the driver holding a staging slice) and hang saves.
            logging.exception("dispatch_io: callback %r raised for %s", fn, keypath)

    # -- the driver thread ---------------------------------------------------------------------

    def _run(self):
        io_thread.owner = self.engine.io_token
        writes = []
        session = None
        try:
            try:
                for spec in self.plan.leaves:  # leaves with nothing to copy here are done already
                    if spec.kind != tree_lib.SCALAR and self._to_copy[spec.index] == 0:
                        self._callback(self.on_transfer_end, spec.keypath)
                        self._callback(self.on_write_end, spec.keypath)
                if self._last_sync < 0:
                    self._sync_finished()
                session = self.engine.open_write_session(
                    self.save.target, [self.plan.chunks[i] for batch in self.batches for i in batch.chunks], self.plan)
                for k, batch in enumerate(self.batches):
                    ticket, staging = self.ring.acquire(batch.nbytes, cancelled=self._failed)
                    if ticket is None:
                        break
                    accounted = None
                    try:
                        accounted = self._transfer(k, batch, ticket, staging, session)
                    finally:
                        if accounted is None:  # never handed to a writer: nobody else releases it
                            self.ring.release(ticket)
                    if accounted is None:
                        break
                    writes.append(accounted)
                    if self._failed() or self.save.peer_failed():
                        break
            except BaseException as exc:  # noqa: BLE001 - decided on (and surfaced) below
                self._fail(exc)
            self._settle(writes, session)
            t0 = time.perf_counter()
            # Commit, or remove the partial save and raise; with several processes, all agree first.
            # Every process contributes its chunks' checksums; the committing one writes them all.
            self.save.finish(self._error, self._checksums, self._seal, fsync=self.engine.options.fsync)
            done = time.perf_counter()
            stats = SaveStats(
                path=self.display, bytes_written=self._bytes, batches=len(self.batches),
                plan_seconds=self._plan_seconds, blocked_seconds=self._blocked_seconds(),
                transfer_seconds=self._transfer_seconds,
                write_seconds=(self._last_write - self._first_write) if self._first_write else 0.0,
                commit_seconds=done - t0, total_seconds=done - self._started,
                peak_host_bytes=self.ring.peak, plan_cached=self._plan_cached, snapshot_bytes=self.snapshot_bytes)
            progress_lib.report("save", self.progress, stats)
            self.future.set_result(stats)
        except BaseException as exc:  # noqa: BLE001 - surfaces from wait()
            self.progress.fail()
            self._settle(writes, session)
            self._let_go_of_uncopied()
            if not isinstance(exc, (CheckpointError, FileExistsError)):
                err = CheckpointError(f"save to {self.display} failed: {type(exc).__name__}: {exc}")
                err.__cause__ = exc
                exc = err
            self.future.set_exception(exc)
        finally:
            if session is not None:
                session.close()
            self.sources = None
            self.sync_done.set()
            self.engine.save_finished(self)

    def _blocked_seconds(self) -> float:
        """How long save() blocked its caller: measured there once it returned; if the save
        committed before the caller's thread woke up, until the last SYNC batch was copied."""
        if self._blocked is not None:
            return self._blocked
        return (self._sync_at or self._started) - self._started

    @staticmethod
    def _settle(writes, session):
        """Wait until nothing of this save writes any more (the writes, and the arrays' creation,
        which runs in the background): only then may a failed save's files be removed."""
        pending = list(writes)
        if session is not None and session.arrays_created is not None:
            pending.append(session.arrays_created)
        concurrent.futures.wait(pending)

    def _seal(self, checksums: dict) -> bytes:
        """Run by the committing process once every process has written: the arrays in their
        final form (writer databases merged) and the manifest that describes them."""
        layout = self.engine.options.layout
        if layout == "ocdbt":
            merge_writers(self.save.target.kvstore, self.save.target.context)
        return manifest_lib.build(self.plan, self.scalars, checksums, layout, arrays=self.save.target.arrays)

    def _transfer(self, k: int, batch: Batch, ticket: int, staging: np.ndarray, session
                  ) -> concurrent.futures.Future | None:
        """Copy batch ``k`` into its staging slice and hand it to a writer, which releases the
        slice. Returns a future that resolves once the write is accounted for, or None if the
        copy failed (the error is recorded; the slice is still the caller's)."""
        chunks = [self.plan.chunks[i] for i in batch.chunks]
        t0 = time.perf_counter()
        try:
            buffers = self.engine.copy_to_host(self.plan, chunks, self.sources, staging)
        except Exception as exc:  # noqa: BLE001
            self._fail(self._worker_error("copying to host", exc, chunks))
            return None
        self._transfer_seconds += time.perf_counter() - t0
        self._copied(chunks)
        if k == self._last_sync:
            self._sync_finished()
        regions = [Region(self.plan.leaves[c.leaf].array, c.region, self.plan.leaves[c.leaf].keypath)
                   for c in chunks]
        if self._first_write is None:
            self._first_write = time.perf_counter()
        future = self.engine.submit_write(session, regions, buffers)
        # Wait on this, not on the write: waiters wake before done-callbacks run, and the
        # bookkeeping (errors, bytes, staging, on_write_end) must be complete first.
        accounted: concurrent.futures.Future = concurrent.futures.Future()
        future.add_done_callback(lambda f: self._written(f, batch.chunks, ticket, accounted))
        return accounted

    def _let_go_of_uncopied(self):
        """A failed save copies no more: the leaves it never finished copying are released too,
        so a trainer waiting for ``on_transfer_end`` before donating a buffer never hangs."""
        for spec in self.plan.leaves:
            if self._to_copy[spec.index] > 0:
                self._to_copy[spec.index] = 0
                self._callback(self.on_transfer_end, spec.keypath)

    def _copied(self, chunks):
        for c in chunks:
            self._to_copy[c.leaf] -= 1
            if self._to_copy[c.leaf] == 0:
                self.sources.drop(c.leaf)
                self._callback(self.on_transfer_end, self.plan.leaves[c.leaf].keypath)

    def _written(self, future, indices, ticket, accounted: concurrent.futures.Future):
        chunks = [self.plan.chunks[i] for i in indices]
        try:
            self.ring.release(ticket)
            self._last_write = time.perf_counter()
            exc = future.exception()
            if exc is not None:
                self._fail(self._worker_error("writing", exc, chunks))
                return
            with self._lock:
                self._bytes += sum(c.nbytes for c in chunks)
                for i, crc in zip(indices, future.result()):
                    if crc is not None:
                        self._checksums[i] = crc
                written = self._bytes
                finished = []
                for c in chunks:
                    self._to_write[c.leaf] -= 1
                    if self._to_write[c.leaf] == 0:
                        finished.append(self.plan.leaves[c.leaf].keypath)
            self.progress.advance(sum(c.nbytes for c in chunks))
            try:
                self.save.progress(written)  # other processes wait on this, not on a clock
            except Exception:  # noqa: BLE001 - only a liveness hint
                logging.exception("dispatch_io: could not report progress")
            for keypath in finished:
                self._callback(self.on_write_end, keypath)
        finally:
            accounted.set_result(None)
