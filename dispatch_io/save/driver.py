"""The save driver, shared by every dispatcher.

One driver thread per save walks the batches in priority order::

    acquire staging (blocks while the budget is full) -> runner copies the batch to host
      -> [last SYNC batch: save() may return] -> the runner's writer writes it
      -> (write done) release staging, fire on_write_end
    ... all written -> agree -> (leader) manifest -> commit -> end

Copying batch k+1 overlaps writing batch k, and the staging ring bounds host bytes in flight
at every moment. A failure anywhere stops new copies, waits for writes already handed out
(their buffers are still being read), removes the partial data and surfaces from ``wait()``.

The driver is given what it works with -- a :class:`~dispatch_io.save.job.SaveJob` (what to save), a runner, a commit
object (``multihost.commit``), the staging ring, a completion callback -- and never calls back up.
Its end, once every batch is written (agree, the leader's manifest, commit), is
:mod:`dispatch_io.save.finish`.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable

import jax
import numpy as np
from absl import logging

from dispatch_io.save import lookahead
from dispatch_io import progress as progress_lib
from dispatch_io.save import finish
from dispatch_io import tree as tree_lib
from dispatch_io.plan.batches import Batch, Priority
from dispatch_io.errors import CheckpointError, WorkerError
from dispatch_io.progress import SaveStats
from dispatch_io.save.job import Attachments, SaveJob
from dispatch_io.save.sources import Sources
from dispatch_io.save.staging import StagingRing
from dispatch_io.workers import ChunkError, IOSettings, Region, brief_error, write_files


def check_callbacks(**callbacks):
    """``TypeError`` naming the argument for a callback that is neither None nor callable
    (called later on an IO thread, it could only be logged, once per leaf)."""
    for name, fn in callbacks.items():
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable or None, got {fn!r}")


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
            raise TimeoutError(f"save to {self._run.job.display} not finished after {timeout} s") from None

    def done(self) -> bool:
        return self._run.future.done()

    @property
    def path(self) -> str:
        return self._run.job.display


class SaveRun:
    """One save: its driver thread and bookkeeping (see the module doc).

    ``leaves`` are the tree's leaves in plan order (let go of as each is copied), ``runner``
    copies and writes, ``commit`` agrees and commits, ``ring`` bounds the host bytes,
    ``settings`` are the workers' (fsync, layout), ``on_done(run)`` is called once when the run
    is over, whatever the outcome; ``copies``: leaf index -> its replicas (``Sources``)."""

    def __init__(self, job: SaveJob, leaves: list, runner, commit, ring: StagingRing, settings: IOSettings,
                 on_done: Callable[["SaveRun"], None], copies: dict | None = None):
        self.job, self.runner, self.commit, self.ring, self.settings = job, runner, commit, ring, settings
        self._on_done = on_done
        plan = job.plan
        # Array leaves are held by ``sources`` alone, which lets go of each as soon as it is copied.
        self.sources = Sources(plan, leaves, copies)
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.sync_done = threading.Event()
        self.sync_copied = False   # every SYNC leaf copied (sync_done is also set when the save fails)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._blocked = None
        self._sync_at = None  # when the last SYNC batch was copied (save() returns soon after)
        self._transfer_seconds = 0.0
        self._first_write = self._last_write = None
        self._bytes = 0
        self._checksums: dict[int, int] = {}   # chunk index -> CRC-32C (Options.checksums)
        # Chunks of each leaf still to copy / write *by this worker*.
        self._to_copy = [0] * len(plan.leaves)
        for b in job.batches:
            for i in b.chunks:
                self._to_copy[plan.chunks[i].leaf] += 1
        self._to_write = list(self._to_copy)
        self._last_sync = max((k for k, b in enumerate(job.batches) if b.priority == Priority.SYNC), default=-1)
        self.progress = progress_lib.Progress("save", job.display, enabled=job.progress)
        self.progress.phase("", len(job.batches), sum(plan.chunks[i].nbytes for b in job.batches for i in b.chunks))
        self._thread = threading.Thread(target=self._run, name=f"dispatch_io-save:{job.display}")

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
        self._blocked = time.perf_counter() - self.job.started
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
        worker = jax.process_index()
        keypath = getattr(exc, "keypath", None)
        cause = exc.__cause__ if isinstance(exc, ChunkError) and exc.__cause__ else exc
        where = f" {keypath}" if keypath else ""
        if keypath is None and chunks:  # the failure names no leaf: name the batch's
            keypaths = list(dict.fromkeys(self.job.plan.leaves[c.leaf].keypath for c in chunks))
            keypath = keypaths[0] if len(keypaths) == 1 else None
            where = f" {keypath}" if keypath else f" a batch of {', '.join(keypaths)}"
        err = WorkerError(f"worker {worker} failed {action}{where} for {self.job.display}: "
                          f"{type(cause).__name__}: {brief_error(cause)}", worker=worker, keypath=keypath)
        err.__cause__ = exc
        return err

    @staticmethod
    def _callback(fn, keypath):
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
        self.runner.threads.mark()  # callbacks run here: they must not wait for the dispatcher
        job, plan = self.job, self.job.plan
        writes = []
        writer = None
        try:
            try:
                for spec in plan.leaves:  # leaves with nothing to copy here are done already
                    if spec.kind != tree_lib.SCALAR and self._to_copy[spec.index] == 0:
                        self._callback(job.on_transfer_end, spec.keypath)
                        self._callback(job.on_write_end, spec.keypath)
                if self._last_sync < 0:
                    self._sync_finished()
                writer = self.runner.open_writer(self.commit.target)
                ahead = lookahead.Lookahead(self, writer, writes)
                try:
                    for k, batch in enumerate(job.batches):
                        if not ahead.next(k, batch):
                            break
                finally:
                    ahead.drain()
            except BaseException as exc:  # noqa: BLE001 - decided on (and surfaced) below
                self._fail(exc)
            self._settle(writes)
            self._attach_files()
            t0 = time.perf_counter()
            finish.commit(job, self.commit, self.settings, self._error, self._checksums)
            done = time.perf_counter()
            stats = SaveStats(
                path=job.display, bytes_written=self._bytes, batches=len(job.batches),
                plan_seconds=job.plan_seconds, blocked_seconds=self._blocked_seconds(),
                transfer_seconds=self._transfer_seconds,
                write_seconds=(self._last_write - self._first_write) if self._first_write else 0.0,
                commit_seconds=done - t0, total_seconds=done - job.started,
                peak_host_bytes=self.ring.peak, plan_cached=job.plan_cached, snapshot_bytes=job.snapshot_bytes)
            progress_lib.report("save", self.progress, stats)
            self.future.set_result(stats)
        except BaseException as exc:  # noqa: BLE001 - surfaces from wait()
            self.progress.fail()
            self._settle(writes)
            self._let_go_of_uncopied()
            if not isinstance(exc, (CheckpointError, FileExistsError)):
                err = CheckpointError(f"save to {job.display} failed: {type(exc).__name__}: {brief_error(exc)}")
                err.__cause__ = exc
                exc = err
            self.future.set_exception(exc)
        finally:
            if writer is not None:
                writer.close()
            self.sources = None
            self.sync_done.set()
            self._on_done(self)

    def _attach_files(self):
        """Write this process's attached files (once its arrays are written: a failed save
        writes none)."""
        files = self.job.attachments.files
        if files and not self._failed():
            target = self.commit.target
            try:
                write_files(target.kvstore, target.context, dict(files))
            except Exception as exc:  # noqa: BLE001 - fails the save, naming this worker
                self._fail(self._worker_error(f"writing {', '.join(files)}", exc))

    def _blocked_seconds(self) -> float:
        """How long save() blocked its caller: measured there once it returned; if the save
        committed before the caller's thread woke up, until the last SYNC batch was copied."""
        if self._blocked is not None:
            return self._blocked
        return (self._sync_at or self.job.started) - self.job.started

    @staticmethod
    def _settle(writes):
        """Wait until nothing of this save writes any more: only then may a failed save's files
        be removed."""
        concurrent.futures.wait(writes)

    def _transfer(self, k: int, batch: Batch, ticket: int, staging: np.ndarray, writer, started=None
                  ) -> concurrent.futures.Future | None:
        """Copy batch ``k`` into its staging slice and hand it to the writer, which releases the
        slice. Returns a future that resolves once the write is accounted for, or None if the
        copy failed (the error is recorded; the slice is still the caller's). ``started``: the
        batch's transfers as the runner's ``start_copy`` began them (``lookahead``): awaited here."""
        plan = self.job.plan
        chunks = [plan.chunks[i] for i in batch.chunks]
        t0 = time.perf_counter()
        try:
            if started is not None:
                buffers = started.finish()
            else:
                buffers = self.runner.copy_to_host(plan, chunks, self.sources, staging)
        except Exception as exc:  # noqa: BLE001
            self._fail(self._worker_error("copying to host", exc, chunks))
            return None
        self._transfer_seconds += time.perf_counter() - t0
        self._copied(chunks)
        if k == self._last_sync:
            self._sync_finished()
        regions = [Region(plan.leaves[c.leaf].array, c.region, plan.leaves[c.leaf].keypath) for c in chunks]
        if self._first_write is None:
            self._first_write = time.perf_counter()
        future = writer.write(regions, buffers)
        # Wait on this, not on the write: waiters wake before done-callbacks run, and the
        # bookkeeping (errors, bytes, staging, on_write_end) must be complete first.
        accounted: concurrent.futures.Future = concurrent.futures.Future()
        future.add_done_callback(lambda f: self._written(f, batch.chunks, ticket, accounted))
        return accounted

    def _let_go_of_uncopied(self):
        """A failed save copies no more: the leaves it never finished copying are released too,
        so a trainer waiting for ``on_transfer_end`` before donating a buffer never hangs."""
        for spec in self.job.plan.leaves:
            if self._to_copy[spec.index] > 0:
                self._to_copy[spec.index] = 0
                self._callback(self.job.on_transfer_end, spec.keypath)

    def _copied(self, chunks):
        for c in chunks:
            self._to_copy[c.leaf] -= 1
            if self._to_copy[c.leaf] == 0:
                self.sources.drop(c.leaf)
                self._callback(self.job.on_transfer_end, self.job.plan.leaves[c.leaf].keypath)

    def _written(self, future, indices, ticket, accounted: concurrent.futures.Future):
        plan = self.job.plan
        chunks = [plan.chunks[i] for i in indices]
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
                        finished.append(plan.leaves[c.leaf].keypath)
            self.progress.advance(sum(c.nbytes for c in chunks))
            try:
                self.commit.progress(written)  # other processes wait on this, not on a clock
            except Exception:  # noqa: BLE001 - only a liveness hint
                logging.exception("dispatch_io: could not report progress")
            for keypath in finished:
                self._callback(self.job.on_write_end, keypath)
        finally:
            accounted.set_result(None)
