"""Hedged reads: a region read that runs much longer than its peers is read again, and the first
answer wins.

The transport deadline (:mod:`workers.deadlines`) ends any request that stalls, but only after
``request_timeout`` seconds, the same for every request; a read of a restore can tell much sooner
that it is a straggler, from the reads of the same call that already finished. :class:`Hedger`
waits for a call's reads (TensorStore futures, one per region or packed span) and, for one
still pending past its deadline, issues the same read again in a TensorStore context of its own
(fresh caches: a read of the same chunk in the first context would join the stalled one; the
same HTTP transport, so a new connection). Whichever answers first is used, the other is
cancelled (its result dropped; TensorStore cannot abort a transfer in flight -- the transport
deadline ends it).

A read's deadline (:meth:`HedgePolicy.deadline`) counts from the call's start and covers the
bytes issued before it (reads queue behind those): ``SLOWER`` times what the reads finished so
far predict (their fastest latency plus those bytes at their throughput), at least ``after``
seconds, at most ``after`` plus those bytes at ``min_rate``. Before :data:`MIN_SAMPLES` reads
finished, only the latter counts.

Bounded: at most :data:`MAX_HEDGES` hedges in flight per session (all its calls together), each
read hedged once, and the bytes hedged in flight at most half the session's read window (a hedge
holds its region's bytes until it is copied out). Cannot make a result wrong: both reads are of the same stored bytes
(a committed checkpoint never changes), each checked by TensorStore as any read (and against
its CRC-32C by ``verify``); reads go into TensorStore's own arrays, never the caller's buffers,
so a loser that ends late writes nowhere the caller sees.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
import time
from typing import Callable, Sequence

from absl import logging

from .contract import ChunkError, Region

MAX_HEDGES = 2      # hedges in flight per session
SLOWER = 4.0        # a read this many times slower than its peers predict is a straggler
MIN_SAMPLES = 2     # finished reads before the peers' prediction counts
POLL = 0.1          # seconds between looks at the deadlines of reads still pending
SAMPLES = 64        # the latest finished reads of a session that predict the next ones


@dataclasses.dataclass(frozen=True)
class HedgePolicy:
    """When a read is hedged. ``after``: seconds a read may take before any hedge (the floor);
    ``min_rate``: bytes/s below which the reads up to a read are stragglers whatever the peers do."""

    after: float
    min_rate: int

    def deadline(self, ahead: int, finished: Sequence[tuple[int, float]]) -> float:
        """Seconds after the call's start at which a read is hedged. ``ahead``: the bytes of
        the read and of every read issued before it in the call (TensorStore serves them about
        in that order, so a read waits for those); ``finished``: (bytes, seconds since the
        start) of the reads of the call that finished. The peers predict the read done by
        their fastest latency plus ``ahead`` at their throughput; the deadline is ``SLOWER``
        times that, at least ``after``, at most ``after`` plus ``ahead`` at ``min_rate``."""
        cap = self.after + ahead / self.min_rate
        if len(finished) < MIN_SAMPLES:
            return cap
        latency = min(seconds for _, seconds in finished)
        rate = sum(b for b, _ in finished) / max(max(seconds for _, seconds in finished), 1e-6)
        predicted = latency + ahead / max(rate, 1.0)
        return min(cap, max(self.after, SLOWER * predicted))


@dataclasses.dataclass
class HedgeStats:
    """What hedging did in one session: reads hedged, hedges that won, bytes the hedges asked for."""

    hedged: int = 0
    won: int = 0
    bytes: int = 0


class Hedger:
    """Hedged waiting for one session's reads. ``companion`` makes the session that hedges are
    read in (once, when first needed); ``window``: the session's read window (bytes)."""

    def __init__(self, policy: HedgePolicy, companion: Callable[[], object], window: int):
        self.policy = policy
        self._companion_factory = companion
        self._companion = None
        self.window = window
        self.stats = HedgeStats()
        self._lock = threading.Lock()
        self._samples: collections.deque = collections.deque(maxlen=SAMPLES)  # (bytes, seconds) of finished reads
        self._in_flight: dict[tuple[int, int], int] = {}   # (call id, read) -> bytes: the session's hedges in flight

    def _reserve(self, key: tuple[int, int], nbytes: int) -> bool:
        """Count a hedge of ``nbytes`` in flight if the session's bounds allow it."""
        with self._lock:
            if len(self._in_flight) >= MAX_HEDGES or sum(self._in_flight.values()) + nbytes > self.window // 2:
                return False
            self._in_flight[key] = nbytes
            return True

    def _release(self, key: tuple[int, int]):
        with self._lock:
            self._in_flight.pop(key, None)

    def companion(self):
        with self._lock:
            if self._companion is None:
                self._companion = self._companion_factory()
            return self._companion

    def close(self):
        """Close the companion session, if one was made."""
        with self._lock:
            companion, self._companion = self._companion, None
        if companion is not None:
            companion.close()

    def opening(self, future, spec) -> "HedgedOpen":
        """``future`` (``ts.open`` of the stored array ``spec`` for reading) as a :class:`HedgedOpen`:
        opened in the companion too when it takes ``SLOWER`` times the floor (opens have no peers)."""
        return HedgedOpen(future, lambda: self.companion().open_arrays([spec], write=False)[spec.name],
                          SLOWER * self.policy.after)

    def wait_all(self, futures: list, sizes: Sequence[int], reissue: Callable[[object, int], object],
                 names: Sequence[str] | None = None):
        """Wait for every read in ``futures`` (TensorStore futures of arrays, ``sizes[i]`` bytes
        each); returns ``(results, errors)``: per read its array, or None and its exception.
        ``reissue(session, i)`` makes read ``i`` again in ``session`` (blocking is fine: it
        runs on a thread of its own). A read fails only once every attempt at it failed.
        ``names[i]``: read ``i`` in words, for the log line naming a straggler when it is hedged."""
        call = _Call(futures, list(sizes), reissue, names)
        for i, future in enumerate(futures):
            future.add_done_callback(lambda f, i=i: call.done.put((i, f)))
            future.force()
        try:
            self._wait(call)
        finally:
            with self._lock:   # hedges of this call still running are no longer waited for
                for key in [key for key in self._in_flight if key[0] == id(call)]:
                    del self._in_flight[key]
        return call.results, call.errors

    def _wait(self, call: "_Call"):
        left = len(call.results)
        while left:
            pending = [i for i in range(len(call.results)) if not call.resolved[i] and len(call.attempts[i]) == 1]
            with self._lock:
                finished = list(self._samples)   # this call's and the session's other calls' (a restore makes several)
            wait = None
            if pending:
                due = min(call.start + self.policy.deadline(call.ahead[i], finished) for i in pending)
                wait = min(POLL, max(0.0, due - time.monotonic()))   # other calls' reads move the deadline too
            try:
                i, future = call.done.get(timeout=wait)
            except queue.Empty:
                self._hedge_due(call, pending, finished)
                continue
            if call.resolved[i]:
                continue                                          # the loser, ending late
            call.open_attempts[i] -= 1
            primary = future is call.attempts[i][0]
            if not primary:
                self._release((id(call), i))                      # the hedge is no longer in flight
            failure = _failure(future)
            if failure is None:
                call.results[i], call.resolved[i] = future.result(), True
                left -= 1
                self._release((id(call), i))
                with self._lock:
                    if primary:
                        self._samples.append((call.sizes[i], time.monotonic() - call.start))
                    else:
                        self.stats.won += 1
                for other in call.attempts[i]:
                    if other is not future:
                        other.cancel()
            elif call.open_attempts[i] == 0:                      # every attempt failed
                call.errors[i], call.resolved[i] = failure, True
                left -= 1

    def _hedge_due(self, call: "_Call", pending: list[int], finished: list[tuple[int, float]]):
        """Hedge the reads of ``pending`` past their deadline, while the session's bounds allow."""
        now = time.monotonic()
        for i in pending:
            deadline = self.policy.deadline(call.ahead[i], finished)
            if now - call.start < deadline or not self._reserve((id(call), i), call.sizes[i]):
                continue
            logging.info("dispatch_io: straggler: the read of %s (%d bytes) has run %.1f s, past its %.1f s deadline "
                         "(%d reads of the session finished); reading it again",
                         call.names[i] if call.names else f"#{i}", call.sizes[i], now - call.start, deadline,
                         len(finished))
            hedge = _Hedge(lambda i=i: call.reissue(self.companion(), i), lambda f, i=i: call.done.put((i, f)))
            call.attempts[i].append(hedge)
            call.open_attempts[i] += 1
            with self._lock:
                self.stats.hedged += 1
                self.stats.bytes += call.sizes[i]
            hedge.start()


class _Call:
    """The state of one :meth:`Hedger.wait_all`: per read its attempts (the primary first), how
    many have not ended, whether it is resolved, and its result or error; ``done`` receives
    ``(read, attempt)`` as attempts end."""

    def __init__(self, futures: list, sizes: list[int], reissue, names):
        self.start = time.monotonic()
        self.sizes, self.reissue, self.names = sizes, reissue, names
        self.ahead = list(itertools.accumulate(sizes))
        self.done: queue.Queue = queue.Queue()
        n = len(futures)
        self.results, self.errors = [None] * n, [None] * n
        self.attempts: list[list] = [[future] for future in futures]
        self.open_attempts = [1] * n
        self.resolved = [False] * n


class HedgedOpen:
    """An array being opened for reading, future-like (``result()``): when the open has not
    ended ``after`` seconds after it started, ``reopen()`` (a TensorStore future of the same
    array opened in the companion session) is started too, and the first to open is the result
    -- the arrays a stalled metadata read would hold are then read through the companion."""

    def __init__(self, future, reopen: Callable[[], object], after: float):
        self._futures = [future]
        self._reopen, self._after = reopen, after
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._value = self._error = None
        self._failed = 0
        future.add_done_callback(self._ended)
        future.force()

    def _ended(self, future):
        with self._lock:
            if self._done.is_set():
                return
            failure = _failure(future)
            if failure is None:
                self._value = future.result()
            else:
                self._failed += 1
                if self._failed < len(self._futures):
                    return                      # the other attempt may still open it
                self._error = failure
            others = [f for f in self._futures if f is not future]
            self._done.set()
        for other in others:
            other.cancel()

    def result(self):
        error = self.exception()
        if error is not None:
            raise error
        return self._value

    def exception(self) -> BaseException | None:
        """Wait for the open (hedging it when due); its failure, None if it opened."""
        if not self._done.wait(max(0.0, self._started + self._after - time.monotonic())):
            with self._lock:
                hedge = len(self._futures) == 1 and not self._done.is_set()
                if hedge:
                    future = self._reopen()
                    self._futures.append(future)
            if hedge:
                future.add_done_callback(self._ended)   # may run at once: outside the lock
                future.force()
            self._done.wait()
        return self._error

    def cancelled(self) -> bool:
        return False


def wait_regions(hedger: Hedger, futures: list, waited: Sequence[Region]) -> list:
    """The arrays read by ``futures`` (TensorStore reads of arrays, ``waited[i]`` the region read
    ``i`` covers), each read again in the hedger's companion session (a ``Session``) when it
    lags. ChunkError naming the region's key path for a read whose every attempt failed."""
    def reissue(companion, i: int):
        region = waited[i]
        store = companion.open_arrays([region.array], write=False)[region.array.stored.name].result()
        return store[region.index].read()
    results, errors = hedger.wait_all(futures, [region.nbytes for region in waited], reissue,
                                      [f"{region.keypath} {list(region.bounds)}" for region in waited])
    for region, error in zip(waited, errors):
        if error is not None:
            raise ChunkError(region.keypath, region.bounds, error) from error
    return results


def _failure(future) -> BaseException | None:
    if future.cancelled():
        return RuntimeError("cancelled")
    return future.exception()


class _Hedge:
    """A hedge: ``make()`` (the read issued again, a TensorStore future; it may block on opening
    the array) on a thread of its own; ``on_done(self)`` once it ended. Future-like: ``result``,
    ``exception``, ``cancelled``, ``cancel``."""

    def __init__(self, make, on_done):
        self._make, self._on_done = make, on_done
        self._future = None
        self._value = self._error = None
        self._cancelled = False
        self._lock = threading.Lock()

    def start(self):
        threading.Thread(target=self._run, name="dispatch_io-hedge", daemon=True).start()

    def _run(self):
        try:
            future = self._make()
            with self._lock:
                self._future = future
                if self._cancelled:
                    future.cancel()
            self._value = future.result()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, which reports or drops it
            self._error = exc
        self._on_done(self)

    def result(self):
        return self._value

    def exception(self):
        return self._error

    def cancelled(self) -> bool:
        return False

    def cancel(self):
        with self._lock:
            self._cancelled = True
            if self._future is not None:
                self._future.cancel()
