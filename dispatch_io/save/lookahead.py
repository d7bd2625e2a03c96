"""The save driver's batch loop, one batch ahead where the runner can start a copy and await it later.

On the pinned path (``runner.start_copy``) batch k+1's device -> host transfers are started
before batch k's are awaited, so the link never idles while the driver waits, hands a batch to
its writer or fires callbacks -- SYNC batches included: ``save()`` returns once the last SYNC
batch's transfers are awaited, having overlapped the ones before. Batch k+1 is taken from the
staging ring only if it fits beside what is held (a try, never a wait): waiting for room while
holding batch k unwritten could wait forever, so batch k is handed over first.

Runners whose copies are synchronous (the pageable path's memcpy into staging, colocated
``device_put``) go one batch at a time, as before. Batches are handed to the writer in order,
so ``on_transfer_end`` and the SYNC bookkeeping see them in order either way.
"""

from __future__ import annotations

from dispatch_io.workers import ChunkError


class Lookahead:
    """The loop over ``run``'s batches (a ``save.SaveRun``): :meth:`next` for each batch in order,
    then :meth:`drain` (also after an exception: the batch started ahead is awaited and handed
    over or given back). ``writes`` collects each handed batch's accounted future."""

    def __init__(self, run, writer, writes: list):
        self.run, self.writer, self.writes = run, writer, writes
        start = getattr(run.runner, "start_copy", None)
        self.start = start if start is not None and not run.runner.host_staging else None
        self.pending = None   # (k, batch, ticket, staging, started): started, not yet handed over

    def next(self, k: int, batch) -> bool:
        """Copy batch ``k`` (start it, on the pinned path); False once the loop must stop (a
        failure, recorded on the run, or no room while the save is cancelled)."""
        run = self.run
        ring, view = run.ring, run.runner.host_staging
        if self.start is None:
            ticket, staging = ring.acquire(batch.nbytes, cancelled=run._failed, view=view)
            return ticket is not None and self._hand((k, batch, ticket, staging, None))
        ticket, staging = ring.acquire(batch.nbytes, cancelled=lambda: self.pending is not None or run._failed(),
                                       view=view)
        if ticket is None and self.pending is not None:   # no room beside the held batch: hand it over first
            if not self._hand_pending():
                return False
            ticket, staging = ring.acquire(batch.nbytes, cancelled=run._failed, view=view)
        if ticket is None:
            return False
        plan = run.job.plan
        chunks = [plan.chunks[i] for i in batch.chunks]
        try:
            started = self.start(plan, chunks, run.sources, staging)
        except Exception as exc:  # noqa: BLE001 - the batch's failure, named by its key path
            ring.release(ticket)
            run._fail(run._worker_error("copying to host", exc, chunks))
            return False
        except BaseException:
            ring.release(ticket)
            raise
        if self.pending is not None:
            try:
                handed = self._hand_pending()
            except BaseException:   # raised on: this batch is nobody's but ours to await and give back
                self._abandon((k, batch, ticket, staging, started))
                raise
            if not handed:
                self._abandon((k, batch, ticket, staging, started))
                return False
        self.pending = (k, batch, ticket, staging, started)
        return True

    def drain(self):
        """Hand over the batch started ahead (or, after a failure, await and give it back)."""
        if self.pending is not None:
            if self.run._failed():
                pending, self.pending = self.pending, None
                self._abandon(pending)
            else:
                self._hand_pending()

    def _hand_pending(self) -> bool:
        pending, self.pending = self.pending, None
        return self._hand(pending)

    def _hand(self, pending) -> bool:
        k, batch, ticket, staging, started = pending
        accounted = None
        try:
            accounted = self.run._transfer(k, batch, ticket, staging, self.writer, started)
        finally:
            if accounted is None:  # never handed to a writer: nobody else releases it
                self.run.ring.release(ticket)
        if accounted is None:
            return False
        self.writes.append(accounted)
        return not (self.run._failed() or self.run.commit.peer_failed())

    def _abandon(self, pending):
        """A batch started but never to be written: its transfers are awaited (nothing may still
        write into what it holds), their failure is not this save's first, and its room is freed."""
        _, _, ticket, _, started = pending
        try:
            started.finish()
        except ChunkError:   # the save already failed with its first error
            pass
        finally:
            self.run.ring.release(ticket)
