"""Host staging memory: one ring buffer the size of the budget, reused across batches.

Every batch takes one contiguous slice and gives it back when its writes are durable. The
ring *is* the budget: nothing is copied off a device without a slice, so host bytes in
flight can never exceed it. Reusing one buffer matters for speed too: memory returned to the
OS is slow to touch again, while a warm buffer copies at memcpy speed. How a batch is laid out
in its slice (aligned offsets) is the plan's (``plan.batches.aligned``).
"""

from __future__ import annotations

import collections
import threading

import numpy as np


class StagingRing:
    """Slices of one buffer of ``capacity`` bytes, allocated when a slice is first asked for
    with a view: runners whose copies live elsewhere (pinned host memory, colocated CPU
    devices) only count their bytes here (``acquire(..., view=False)``)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._buffer: np.ndarray | None = None
        self._live: collections.OrderedDict[int, list] = collections.OrderedDict()  # id -> [start, end, freed]
        self._next_id = 0
        self._cond = threading.Condition()
        self.in_use = 0
        self.peak = 0

    def acquire(self, nbytes: int, cancelled=lambda: False, view: bool = True) -> tuple[int, np.ndarray]:
        """Block until ``nbytes`` contiguous bytes are free; returns (ticket, uint8 view, or None
        without ``view``: the bytes are counted, not staged here). Returns (None, None) if
        ``cancelled()`` turns true while waiting."""
        if not 0 < nbytes <= self.capacity:  # an empty slice would make a full ring look empty
            raise ValueError(f"batch of {nbytes} bytes: must be in (0, {self.capacity}], the staging budget")
        with self._cond:
            while (start := self._fit(nbytes)) is None:
                if cancelled():
                    return None, None
                self._cond.wait(0.1)
            if view and self._buffer is None:
                self._buffer = np.empty(self.capacity, dtype=np.uint8)
            ticket = self._next_id
            self._next_id += 1
            self._live[ticket] = [start, start + nbytes, False]
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            return ticket, (self._buffer[start:start + nbytes] if view else None)

    def _fit(self, n: int) -> int | None:
        if not self._live:
            return 0
        tail = next(iter(self._live.values()))[0]
        newest_start, head, _ = next(reversed(self._live.values()))
        if newest_start >= tail:        # not wrapped: live is [tail, head); free [head, cap) + [0, tail)
            if head + n <= self.capacity:
                return head
            return 0 if n <= tail else None
        return head if head + n <= tail else None  # wrapped: free is [head, tail)

    def release(self, ticket: int):
        with self._cond:
            entry = self._live[ticket]
            entry[2] = True
            self.in_use -= entry[1] - entry[0]
            while self._live and next(iter(self._live.values()))[2]:
                self._live.popitem(last=False)
            self._cond.notify_all()

    def reset_peak(self):
        with self._cond:
            self.peak = self.in_use

    def drop_buffer(self):
        """Free the memory (when nothing is in flight)."""
        with self._cond:
            if not self._live:
                self._buffer = None
