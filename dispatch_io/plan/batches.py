"""Order chunks by transfer priority and pack them into memory-budgeted batches (pure).

A batch is laid out in one slice of the host staging ring (``save.staging``): each chunk at an
``ALIGN``-aligned offset, so a batch takes the sum of its chunks' :func:`aligned` sizes.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from typing import Callable, Sequence

from dispatch_io import tree as tree_lib
from dispatch_io.plan.save_plan import Plan

ALIGN = 64  # a batch's chunks (and the leaves in packs) start at cache-line aligned offsets of its staging slice


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``: the staging bytes a chunk of ``nbytes`` takes."""
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


def leaf_priorities(plan: Plan, priority: Callable | None) -> list[Priority]:
    """Each leaf's :class:`Priority`: ``priority(keypath, spec)`` for array leaves (None: all
    SYNC); Python scalars are SYNC (nothing to copy).

    A plain int equal to a priority's value (0, 1, 2) counts as that priority. Raises
    ``TypeError`` naming the key path for anything else (a bool, float or other int: a likely
    mistake); ``RuntimeError`` naming the key path for an exception the callback raised (chained)."""
    if priority is None:
        return [Priority.SYNC] * len(plan.leaves)
    out = []
    for spec in plan.leaves:
        if spec.kind == tree_lib.SCALAR:
            out.append(Priority.SYNC)
            continue
        try:
            value = priority(spec.keypath, spec.spec)
        except Exception as exc:  # noqa: BLE001 - re-raised, naming the leaf it was asked about
            raise RuntimeError(f"the priority callback raised for {spec.keypath}: {type(exc).__name__}: {exc}") \
                from exc
        if not isinstance(value, Priority):
            if not (isinstance(value, numbers.Integral) and not isinstance(value, bool)
                    and int(value) in tuple(Priority)):  # an IntEnum: members equal their ints
                raise TypeError(f"priority callback returned {value!r} for {spec.keypath}; "
                                "expected a dispatch_io.Priority (SYNC, HIGH or LOW)")
            value = Priority(int(value))
        out.append(value)
    return out


@dataclasses.dataclass(frozen=True)
class Batch:
    """Chunks copied to host together; ``nbytes`` counts staging space (aligned)."""

    priority: Priority
    chunks: tuple[int, ...]   # indices into plan.chunks
    nbytes: int


def pack(items, nbytes, limit: int, group=lambda item: None) -> list[tuple[list, int]]:
    """Greedy packing in order: (items, staging bytes) lists of at most ``limit`` aligned bytes
    (one item alone may exceed it), a new list wherever ``group(item)`` changes."""
    return list(packs(items, nbytes, limit, group))


def packs(items, nbytes, limit: int, group=lambda item: None):
    """:func:`pack`, one list at a time (``items`` may be an iterator: nothing is held ahead)."""
    current: list = []
    size = 0
    for item in items:
        need = aligned(nbytes(item))
        if current and (group(item) != group(current[-1]) or size + need > limit):
            yield current, size
            current, size = [], 0
        current.append(item)
        size += need
    if current:
        yield current, size


def make_batches(plan: Plan, priorities: Sequence[Priority], limit: int, worker: int | None = None,
                 whole_shards: bool = False) -> tuple[Batch, ...]:
    """Batches of ``worker``'s chunks (all if None): SYNC, then HIGH, then LOW, each in tree
    order; a batch never mixes priorities and never holds more than ``limit`` staging bytes.

    ``whole_shards`` (the pinned path): the chunks of one leaf on one device that fit one batch
    together stay together (a batch may then close early), so the shard moves whole and its
    chunks are views of it (``pinned_save``). Without it batches are packed as full as they go.

    The leaves of a pack (``LeafSpec.packed``) stay together, in the batch of their most
    urgent leaf, in pack order (so a staging slice holds them at their pack offsets), and
    count their pack's bytes twice: a writer that cannot write the pack from staging copies them
    into a pack buffer (``workers.packs.assemble``)."""
    units: dict = {}   # pack name, or first chunk index of a shard's run -> [chunk indices]
    for key, i in _unit_keys(plan, worker, limit if whole_shards else 0):
        units.setdefault(key, []).append(i)
    prio = {key: min(priorities[plan.chunks[i].leaf] for i in chunks) for key, chunks in units.items()}
    size = {key: sum(aligned(plan.chunks[i].nbytes) for i in chunks) + _pack_bytes(plan, chunks)
            for key, chunks in units.items()}
    order = sorted(units, key=lambda key: (prio[key], units[key][0]))
    return tuple(Batch(prio[keys[0]], tuple(i for key in keys for i in units[key]), nbytes)
                 for keys, nbytes in pack(order, size.__getitem__, limit, group=prio.__getitem__))


def _unit_keys(plan: Plan, worker: int | None, limit: int):
    """(unit key, chunk index) of ``worker``'s chunks: a pack's leaves are one unit; so are the
    consecutive chunks of one leaf on one device (a shard cut into chunks, as ``plan_chunks``
    lists them) where together they fit one batch of ``limit`` bytes (``limit`` 0: never) --
    the pinned path then moves the shard whole and writes views of it (``pinned_save``), not a
    device slice per chunk."""
    run: list[int] = []

    def flush():
        size = sum(aligned(plan.chunks[i].nbytes) for i in run)
        for i in run:
            yield (run[0] if size <= limit else i), i

    for i, c in enumerate(plan.chunks):
        if worker is not None and c.worker != worker:
            continue
        packed = plan.leaves[c.leaf].packed
        if packed is not None:
            yield from flush()
            run = []
            yield packed[0], i
            continue
        if run and (plan.chunks[run[-1]].leaf, plan.chunks[run[-1]].device) != (c.leaf, c.device):
            yield from flush()
            run = []
        run.append(i)
    yield from flush()


def _pack_bytes(plan: Plan, chunks: list[int]) -> int:
    packed = plan.leaves[plan.chunks[chunks[0]].leaf].packed
    return 0 if packed is None else aligned(packed[1])


def sync_overflow(plan: Plan, batches: Sequence[Batch], capacity: int) -> set[int]:
    """The jax-array leaves of SYNC batches beyond the first ``capacity`` staging bytes: copying
    them to host before ``save()`` returns would have to wait for earlier batches' writes."""
    used = 0
    over: set[int] = set()
    for batch in batches:
        if batch.priority != Priority.SYNC:
            break
        used += batch.nbytes
        if used > capacity:
            over.update(leaf for leaf in (plan.chunks[i].leaf for i in batch.chunks)
                        if plan.leaves[leaf].origin == "jax")
    return over
