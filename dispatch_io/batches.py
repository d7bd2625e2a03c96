"""Order chunks by transfer priority and pack them into memory-budgeted batches (pure)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

from dispatch_io.plan import Plan

ALIGN = 64  # staging offsets are cache-line aligned


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class Priority(enum.IntEnum):
    """When a leaf's device data is copied to host.

    SYNC: before ``save()`` returns; the caller may donate or delete it right after.
    HIGH: first after ``save()`` returns. LOW: last. For HIGH/LOW leaves wait for
    ``on_transfer_end(keypath)`` before donating the buffer.
    """

    SYNC = 0
    HIGH = 1
    LOW = 2


@dataclasses.dataclass(frozen=True)
class Batch:
    """Chunks copied to host together; ``nbytes`` counts staging space (aligned)."""

    priority: Priority
    chunks: tuple[int, ...]   # indices into plan.chunks
    nbytes: int


def make_batches(plan: Plan, priorities: Sequence[Priority], limit: int, worker: int | None = None
                 ) -> tuple[Batch, ...]:
    """Batches of ``worker``'s chunks (all if None): SYNC, then HIGH, then LOW, each in tree
    order; a batch never mixes priorities and never holds more than ``limit`` staging bytes."""
    order = sorted(
        (i for i, c in enumerate(plan.chunks) if worker is None or c.worker == worker),
        key=lambda i: (priorities[plan.chunks[i].leaf], i))
    batches: list[Batch] = []
    current: list[int] = []
    size = 0
    prio = None
    for i in order:
        chunk_prio = priorities[plan.chunks[i].leaf]
        need = aligned(plan.chunks[i].nbytes)
        if current and (chunk_prio != prio or size + need > limit):
            batches.append(Batch(prio, tuple(current), size))
            current, size = [], 0
        current.append(i)
        size += need
        prio = chunk_prio
    if current:
        batches.append(Batch(prio, tuple(current), size))
    return tuple(batches)
