"""Picking the least loaded of many candidates, over and over, in O(log n) a pick (pure).

A save gives each chunk of a replicated leaf to the least loaded process holding it, and a
scale-out restore each shared piece to the least loaded of its holders. With 1,024 processes
holding every leaf (data parallelism), a ``min`` over the holders per chunk costs chunks x
processes; :class:`LeastLoaded` keeps a heap per candidate set instead.
"""

from __future__ import annotations

import heapq
from typing import Callable, Hashable, Sequence


class LeastLoaded:
    """``pick(candidates)``: the candidate with the smallest ``key(candidate)`` -- the same one
    ``min(candidates, key=key)`` gives -- provided keys are distinct and only ever grow between
    picks (loads added to, never taken away). Each candidate set has a heap of (key when last
    seen, position, candidate); an entry whose key has grown since is pushed down again."""

    def __init__(self, key: Callable[[Hashable], tuple]):
        self.key = key
        self.heaps: dict[int, tuple[Sequence, list]] = {}   # id(candidates) -> (candidates, heap)

    def pick(self, candidates: Sequence[Hashable]):
        """The least loaded of ``candidates``. A candidate set is known by the identity of the
        sequence given (callers pass the same object for the same set; it is kept, so its id is
        not reused): hashing a thousand holders per pick would cost what the heap saves."""
        if len(candidates) <= 4:  # a heap costs more than it saves
            return min(candidates, key=self.key)
        known = self.heaps.get(id(candidates))
        if known is None or known[0] is not candidates:
            heap = [(self.key(c), i, c) for i, c in enumerate(candidates)]
            heapq.heapify(heap)
            known = self.heaps[id(candidates)] = (candidates, heap)
        heap = known[1]
        while True:
            seen, position, candidate = heap[0]
            now = self.key(candidate)
            if now == seen:  # keys only grow: no other entry's can be smaller
                return candidate
            heapq.heapreplace(heap, (now, position, candidate))
