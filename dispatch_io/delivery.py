"""Who reads each shared piece of a scale-out restore, and who receives it (pure).

A region of a result held by several processes (its *holders*) is read once in the job: cut
into pieces (:func:`~dispatch_io.reading.read_pieces`), each read by one holder and delivered to
the other holders only. :func:`plan_delivery` plans that for the whole job from plain data --
for each shared leaf, ``{region: holder processes}`` -- so every process computes the same plan,
and ``benchmarks/scale.py`` runs this very code for jobs of 1,024 processes without devices.

**Replica groups.** The regions of one sharding are held by groups of processes: for a
``NamedSharding`` over a mesh, the processes along the mesh axes its spec leaves out (FSDP x
data parallelism over 128 x 2 hosts: 128 groups of 2). Where a leaf's holder sets are disjoint
and of one size S (:func:`replica_groups`), the job is partitioned into groups of S processes
(processes holding none of the leaf fill groups of their own) and each round's rows are
all-gathered *within* each group: a process receives the rows of the S - 1 other holders of
its regions, nothing else. Leaves with the same groups share rounds. Where the holder sets
overlap or differ in size, one group holds the whole job (an all-gather over every process, the
fallback: correct for any sharding, every process receiving every row).

**Rounds.** Within a leaf's groups, each piece's reader is the holder that has read least so far
(so the holders of a region read about equal shares of it), and each process's pieces are packed
into rows of at most ``batch_limit / S`` bytes: a round's gathered rows (S of them) stay within
``batch_limit``, and the number of rounds is about the bytes a process holds / ``batch_limit``,
whatever the number of processes. A piece larger than that share (a stored chunk over the chunk
limit, read whole so that it is read once) goes in a *solo* round, at most one per group, summed
over the group (the others add zeros) rather than gathered S times.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Sequence

import numpy as np

from dispatch_io.balance import LeastLoaded
from dispatch_io.batches import pack
from dispatch_io.reading import read_pieces
from dispatch_io.staging import aligned
from workers import ReadItem

HEADER = 64  # each row starts with its round's identity, checked after the collective


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece of a shared region: ``reader`` reads it, every process in ``holders`` gets it."""

    output: int                  # index of its Output in the restore's outputs
    region: tuple                # the result region whose buffer it fills
    local: tuple                 # its bounds in that buffer
    item: ReadItem               # what the reader reads: host bytes in the result's dtype
    reader: int
    holders: tuple[int, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Round:
    """One collective: ``rows[process]`` are the pieces that process reads (no entry: none), in
    row order, at 64-byte aligned offsets after a HEADER, each row ``width`` bytes. The rows
    travel within ``groups`` only (a partition of the job's processes, all groups of one size;
    ``group_of``: process -> its group): gathered, or summed where ``solo`` (at most one row
    per group carries pieces)."""

    index: int
    groups: tuple[tuple[int, ...], ...]
    rows: dict
    width: int
    solo: bool = False
    group_of: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def row(self, process: int) -> tuple:
        """The pieces ``process`` reads and sends in this round."""
        return self.rows.get(process, ())

    def group(self, process: int) -> tuple[int, ...]:
        """The group ``process`` exchanges rows with (itself included)."""
        return self.group_of[process]

    def traffic(self, process: int) -> tuple[int, int]:
        """(bytes ``process`` receives, bytes it sends) in this round, whole rows: a gather
        sends its row to the S - 1 others of its group and receives theirs; a sum over a group
        (a ring all-reduce) sends and receives 2 (S - 1) / S rows."""
        members = len(self.groups[0])
        moved = (members - 1) * self.width if not self.solo else 2 * (members - 1) * self.width // members
        return moved, moved


@dataclasses.dataclass(frozen=True)
class Delivery:
    rounds: list          # [Round]
    digest: str           # equal in every process that planned the same restore


def replica_groups(holder_sets: set, count: int) -> tuple[tuple[int, ...], ...]:
    """The groups a leaf's rows travel in, given its regions' distinct ``holder_sets`` (sorted
    tuples of processes, each of two or more): the holder sets themselves where they are
    disjoint and of one size S, completed with groups of S of the other processes (in order);
    else -- overlapping or unequal sets, or other processes that do not divide into S -- one
    group of all ``count`` processes."""
    everyone = (tuple(range(count)),)
    sizes = {len(s) for s in holder_sets}
    if len(sizes) != 1:
        return everyone
    size = sizes.pop()
    covered = [p for s in holder_sets for p in s]
    if len(covered) != len(set(covered)):
        return everyone
    rest = sorted(set(range(count)) - set(covered))
    if len(rest) % size:
        return everyone
    return tuple(sorted(holder_sets)) + tuple(tuple(rest[i:i + size]) for i in range(0, len(rest), size))


def width(nbytes: int) -> int:
    """Row width for ``nbytes``: rounded up by at most 1/16, so few distinct shapes are compiled."""
    step = 1 << max(6, nbytes.bit_length() - 5)
    return max(step, -(-nbytes // step) * step)


def plan_delivery(shared: Sequence[tuple[int, object, dict]], count: int, chunk_limit: int,
                  batch_limit: int) -> Delivery:
    """The rounds delivering the shared regions of a restore in a job of ``count`` processes.

    Args:
      shared: (output index, Output, {region: holders}) per result leaf with regions held by
        several processes; ``holders``: sorted tuple of two or more process indices. Only the
        Output's stored leaf and dtype are used (no device, no sharding): plain data.
      chunk_limit: the largest piece read (``Options.chunk_bytes``); stored chunks larger than
        it are one piece each.
      batch_limit: bytes of one round's gathered rows per process (``Options.read_batch_bytes``).

    Returns the same :class:`Delivery` in every process given the same arguments."""
    load = [0] * count
    least = LeastLoaded(lambda p: (load[p], p))
    by_groups: dict[tuple, list[list[Piece]]] = {}    # groups -> pieces by reader, in plan order
    for index, out, holders in shared:
        groups = replica_groups(set(holders.values()), count)
        if groups not in by_groups:
            by_groups[groups] = [[] for _ in range(count)]
        pieces = by_groups[groups]
        name, itemsize = np.dtype(out.dtype).name, np.dtype(out.dtype).itemsize
        for region, procs in holders.items():
            for stored, bounds in read_pieces(out, region, chunk_limit):
                shape = tuple(hi - lo for lo, hi in bounds)
                item = ReadItem(((stored, tuple((0, n) for n in shape)),), shape, name, on_host=True)
                reader = least.pick(procs)
                piece = Piece(index, region, bounds, item, reader, procs, math.prod(shape) * itemsize)
                load[reader] += piece.nbytes
                pieces[reader].append(piece)
    rounds: list[Round] = []
    for groups, pieces in by_groups.items():
        rounds += _rounds(groups, pieces, max(64, batch_limit // len(groups[0])), len(rounds))
    # With the share: processes with different budgets would cut different rounds.
    digest = hashlib.sha256(repr((batch_limit, [(i, out.saved.keypath) for i, out, _ in shared], [
        (r.groups, r.width, r.solo, [(p, [(x.output, x.region, x.local, x.item.dtype) for x in row])
                                     for p, row in sorted(r.rows.items())]) for r in rounds])).encode()).hexdigest()
    return Delivery(rounds, digest)


def _rounds(groups: tuple, pieces: list[list[Piece]], share: int, first: int) -> list[Round]:
    """The rounds of one set of groups: each process's pieces (``pieces[reader]``) packed into
    rows of at most ``share`` bytes (and the header); larger pieces one per row."""
    group_of = {p: g for g in groups for p in g}
    fits = lambda p: aligned(p.nbytes) <= share  # noqa: E731
    queues = {r: pack([p for p in mine if fits(p)], lambda p: p.nbytes, share) for r, mine in enumerate(pieces) if mine}
    rounds = []
    for k in range(max(map(len, queues.values()), default=0)):
        rows = {r: tuple(q[k][0]) for r, q in queues.items() if k < len(q)}
        used = max(q[k][1] for q in queues.values() if k < len(q))
        rounds.append(Round(first + len(rounds), groups, rows, width(HEADER + used), group_of=group_of))
    # Larger pieces: one per row. In groups of two, gathered (every member sends one; the
    # gathered copy holds what a sum's row and result would); in larger groups, where a gather
    # would hold S of them, one per group and round, summed over the group.
    solo = len(groups[0]) > 2
    if solo:
        big = [[p for member in g for p in pieces[member] if not fits(p)] for g in groups]
    else:
        big = [[p for p in mine if not fits(p)] for mine in pieces]
    big = [q for q in big if q]
    for k in range(max(map(len, big), default=0)):
        rows = {q[k].reader: (q[k],) for q in big if k < len(q)}
        most = max(aligned(row[0].nbytes) for row in rows.values())
        rounds.append(Round(first + len(rounds), groups, rows, width(HEADER + most), solo=solo, group_of=group_of))
    return rounds
