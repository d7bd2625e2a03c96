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
        self.heaps: dict[tuple, list] = {}

    def pick(self, candidates: Sequence[Hashable]):
        """The least loaded of ``candidates`` (a sequence of one candidate set, in any order
        that is the same each time the set is given)."""
        if len(candidates) == 1:
            return candidates[0]
        group = tuple(candidates)
        heap = self.heaps.get(group)
        if heap is None:
            heap = self.heaps[group] = [(self.key(c), i, c) for i, c in enumerate(group)]
            heapq.heapify(heap)
        while True:
            seen, position, candidate = heap[0]
            now = self.key(candidate)
            if now == seen:  # keys only grow: no other entry's can be smaller
                return candidate
            heapq.heapreplace(heap, (now, position, candidate))
