"""Who reads each shared piece of a scale-out restore, and who receives it (pure).

A region of a result held by several processes (its *holders*) is read once in the job: cut
into pieces (:func:`~dispatch_io.read.loop.read_pieces`), each read by one holder and delivered to
the other holders only. :func:`plan_delivery` plans that for the whole job from plain data --
for each shared leaf, ``{region: holder processes}`` -- so every process computes the same plan,
and ``benchmarks/scale.py`` runs this very code for jobs of 1,024 processes without devices.

**Replica groups.** The regions of one sharding are held by groups of processes: for a
``NamedSharding`` over a mesh, the processes along the mesh axes its spec leaves out (FSDP x
data parallelism over 128 x 2 hosts: 128 groups of 2). Where a leaf's holder sets are disjoint
and of one size S (:func:`replica_groups`), the job is partitioned into groups of S processes
(processes holding none of the leaf fill groups of their own) and each round's rows are
all-gathered *within* each group: a process receives the rows of the S - 1 other holders of
its regions, nothing else; a round's collective runs over the groups in which a member reads
(the others, agreeing from the same plan, take part in none). Leaves with the same groups
(sorted: one partition, one key) share rounds; the rounds of different partitions are taken in
turn (so their readers -- e.g. the holders of a lost process's copies spread over several peers,
each pair a partition of its own -- read at the same time). Where one leaf's holder sets overlap
or differ in size, its regions are split into a few classes of disjoint sets of one size
(:func:`partitions`), each a partition of its own; where that takes too many, or the other
processes do not divide into groups of S, one group holds the whole job (an all-gather over every
process, the fallback: correct for any sharding, every process receiving every row).

**Rounds.** Each piece's reader is the least loaded of its holders, the largest pieces given
first (so the holders of a region read about equal shares of it), and each process's pieces are packed
into rows of at most ``batch_limit / S`` bytes: a round's gathered rows (S of them) stay within
``batch_limit``, and the number of rounds is about the bytes a process holds / ``batch_limit``,
whatever the number of processes. A round where few members of a group have pieces
(small replicated leaves: norms, biases) is *summed* over the group instead: one row per group,
each member's pieces at their own offsets, the others adding zeros -- 2 (S - 1) / S of that row
moves per process, rather than S - 1 mostly empty rows. In groups of two where one member reads
(the holder of a lost process's copy), the row is *sent* one way: the other member sends nothing. A piece larger than the share (a stored
chunk over the chunk limit, read whole so that it is read once) travels one per row: gathered in
groups of two, summed one per group and round in larger ones.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import math
from typing import Sequence

import numpy as np

from dispatch_io.plan.balance import LeastLoaded
from dispatch_io.plan.batches import aligned, pack
from dispatch_io.read.loop import read_pieces
from dispatch_io.workers import ReadItem, Region

HEADER = 64  # each row starts with its round's identity, checked after the collective


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece of a shared region: ``reader`` reads it, every process in ``holders`` gets it."""

    output: int                  # index of its Output in the restore's outputs
    region: tuple                # the result region whose buffer it fills
    local: tuple                 # its bounds in that buffer
    stored: Region               # the stored region it is read from
    dtype: str                   # the result's dtype, which the reader reads it as
    reader: int
    holders: tuple[int, ...]
    nbytes: int

    @functools.cached_property
    def item(self) -> ReadItem:
        """What the reader reads: host bytes in the result's dtype (made when read: a job's plan
        has a piece for every region of every process)."""
        shape = tuple(hi - lo for lo, hi in self.local)
        return ReadItem(((self.stored, tuple((0, n) for n in shape)),), shape, self.dtype, on_host=True)


@dataclasses.dataclass(frozen=True)
class Round:
    """One collective within ``groups`` (a partition of the job's processes, all groups of one
    size S; ``group_of``: process -> its group; the collective runs over the :attr:`active`
    ones). ``rows[process]``: the pieces that process reads (no entry: none), each at a 64-byte
    aligned offset after the previous one.

    Gathered: each process sends a row of ``width`` bytes -- a HEADER, then its pieces -- and
    receives the rows of its group. ``summed``: each group has one row of ``width`` bytes, the
    HEADER (written by the group's first member), then its members' pieces one member after the
    other; each member writes its own part, the others zeros, and the group sums them: cheaper
    than a gather where few members have pieces (2 (S - 1) / S of the row moves per process
    instead of S - 1 rows). ``sent`` (groups of two, one member reading in each active group): the
    reader's row goes to the other member alone, who sends nothing back (a gather would send
    its unused row too)."""

    index: int
    groups: tuple[tuple[int, ...], ...]
    rows: dict
    width: int
    summed: bool = False
    group_of: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    sent: bool = False

    def row(self, process: int) -> tuple:
        """The pieces ``process`` reads and sends in this round."""
        return self.rows.get(process, ())

    def group(self, process: int) -> tuple[int, ...]:
        """The group ``process`` exchanges rows with (itself included)."""
        return self.group_of[process]

    def starts(self, group: tuple[int, ...]) -> dict[int, int]:
        """{member: offset of its first piece in the row that carries it}."""
        starts, offset = {}, HEADER
        for member in group:
            starts[member] = offset if self.summed else HEADER
            offset += _row_bytes(self.row(member))
        return starts

    @functools.cached_property
    def active(self) -> tuple[tuple[int, ...], ...]:
        """The groups in which a member reads something this round: the collective runs over
        them alone (a process of another group takes part in none, exchanges nothing)."""
        return tuple(g for g in self.groups if any(p in self.rows for p in g))

    def takes_part(self, process: int) -> bool:
        return any(p in self.rows for p in self.group_of[process])

    @functools.cached_property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """A ``sent`` round's (sender, receiver), as positions in the (active group, member) grid."""
        return tuple((2 * g + group.index(reader), 2 * g + 1 - group.index(reader))
                     for g, group in enumerate(self.active) for reader in group if reader in self.rows)

    def traffic(self, process: int) -> tuple[int, int]:
        """(bytes ``process`` receives, bytes it sends) in this round, whole rows: a gather
        sends its row to the S - 1 others of its group and receives theirs; a sum over a group
        (a ring all-reduce) sends and receives 2 (S - 1) / S of the row; a sent row goes one way;
        a group in which nobody reads this round, nothing."""
        if not self.takes_part(process):
            return 0, 0
        if self.sent:
            return (0, self.width) if process in self.rows else (self.width, 0)
        return (_moved(len(self.groups[0]), self.width, self.summed),) * 2


def _row_bytes(pieces) -> int:
    return sum(aligned(p.nbytes) for p in pieces)


def _moved(members: int, row: int, summed: bool) -> int:
    return 2 * (members - 1) * row // members if summed else (members - 1) * row


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
    # Sorted: one partition is one key, whichever leaf's holders it was built from (shared rounds).
    return tuple(sorted([*holder_sets, *(tuple(rest[i:i + size]) for i in range(0, len(rest), size))]))


def partitions(holder_sets: set, count: int, most: int = 4) -> dict[tuple, tuple]:
    """{holder set: the groups its regions' rows travel in} for one leaf's distinct
    ``holder_sets``: split into classes whose sets are disjoint and of one size (first fit, in
    sorted order), each class's groups as :func:`replica_groups` gives them -- a leaf whose
    regions have overlapping holders (a lost process's share spread over several peers, region
    by region) then travels in a few partitions of small groups, not in one group of every
    process. More than ``most`` classes (each takes rounds of its own): every set in
    :func:`replica_groups`' groups for all of them."""
    classes: list[list[tuple]] = []
    for held in sorted(holder_sets):
        for members in classes:
            if len(members[0]) == len(held) and not any(set(held) & set(other) for other in members):
                members.append(held)
                break
        else:
            classes.append([held])
    if len(classes) > most:
        classes = [sorted(holder_sets)]
    return {held: groups for members in classes for groups in [replica_groups(set(members), count)]
            for held in members}


def width(nbytes: int) -> int:
    """Row width for ``nbytes``: rounded up by at most 1/16, so few distinct shapes are compiled."""
    step = 1 << max(6, nbytes.bit_length() - 5)
    return max(step, -(-nbytes // step) * step)


def plan_delivery(shared: Sequence[tuple[int, object, dict]], count: int, chunk_limit: int,
                  batch_limit: int, readers: dict | None = None) -> Delivery:
    """The rounds delivering the shared regions of a restore in a job of ``count`` processes.

    Args:
      shared: (output index, Output, {region: holders}) per result leaf with regions held by
        several processes; ``holders``: sorted tuple of two or more process indices. Only the
        Output's stored leaf and dtype are used (no device, no sharding): plain data.
      chunk_limit: the largest piece read (``Options.chunk_bytes``); stored chunks larger than
        it are one piece each.
      batch_limit: bytes of one round's gathered rows per process (``Options.read_batch_bytes``).
      readers: (output index, region) -> the holders that may read it (default: any holder): the
        local tier's, whose copies are on some holders only (``placement``); or {part of the
        region: the processes that may read it}, the parts making up the region (copies of
        another mesh's regions), each piece cut within one part.

    Returns the same :class:`Delivery` in every process given the same arguments."""
    load = [0] * count
    least = LeastLoaded(lambda p: (load[p], p))
    by_groups: dict[tuple, list[list[Piece]]] = {}    # groups -> pieces by reader, in plan order
    todo = []   # every piece: (its groups' lists, output, region, bounds, stored region, holders, readers, bytes, dtype)
    for index, out, holders in shared:
        groups_of = partitions(set(holders.values()), count)
        name, itemsize = np.dtype(out.dtype).name, np.dtype(out.dtype).itemsize
        for region, procs in holders.items():
            lists = by_groups.setdefault(groups_of[procs], [[] for _ in range(count)])
            may = (readers or {}).get((index, region), procs)
            for part, part_may in may.items() if isinstance(may, dict) else [(None, may)]:
                for stored, bounds in read_pieces(out, region, chunk_limit, part):
                    todo.append((lists, index, region, bounds, stored, procs, part_may,
                                 math.prod(hi - lo for lo, hi in bounds) * itemsize, name))
    # Readers: the largest pieces first, each to the least loaded of its holders, so that the
    # loads end within a small piece of each other (in plan order, a large one).
    chosen = [0] * len(todo)
    for i in sorted(range(len(todo)), key=lambda i: -todo[i][7]):
        chosen[i] = reader = least.pick(todo[i][6])
        load[reader] += todo[i][7]
    for (lists, index, region, bounds, stored, procs, _, nbytes, name), reader in zip(todo, chosen):
        lists[reader].append(Piece(index, region, bounds, stored, name, reader, procs, nbytes))
    # The rounds of different partitions taken in turn, not one partition's after another's: each
    # process reads its next round while one is exchanged, so where the partitions' readers differ
    # (a lost process's share spread over several holders, each with the lost process in its groups)
    # they read at the same time.
    by_partition = [_rounds(groups, pieces, max(64, batch_limit // len(groups[0])))
                    for groups, pieces in by_groups.items()]
    rounds = [dataclasses.replace(r, index=i) for i, r in enumerate(
        r for turn in itertools.zip_longest(*by_partition) for r in turn if r is not None)]
    # With the share: processes with different budgets would cut different rounds.
    digest = hashlib.sha256(repr((batch_limit, [(i, out.saved.keypath) for i, out, _ in shared], [
        (r.groups, r.width, r.summed, r.sent, [(p, [(x.output, x.region, x.local, x.dtype) for x in row])
                                       for p, row in sorted(r.rows.items())]) for r in rounds])).encode()).hexdigest()
    return Delivery(rounds, digest)


def _round(index: int, groups: tuple, rows: dict, group_of: dict, summed: bool | None = None) -> Round:
    """The round carrying ``rows``: gathered or summed, whichever moves fewer bytes (or as
    ``summed`` says), its width rounded (:func:`width`)."""
    members = len(groups[0])
    gathered = width(HEADER + max(map(_row_bytes, rows.values())))
    totals = collections.Counter()
    for reader, row in rows.items():
        totals[group_of[reader][0]] += _row_bytes(row)   # by first member: hashing a group costs S
    joined = width(HEADER + max(totals.values()))
    if summed is None:
        summed = _moved(members, joined, True) < _moved(members, gathered, False)
    sent = members == 2 and not summed and len(totals) == len(rows)   # one reader in each group reading
    return Round(index, groups, rows, joined if summed else gathered, summed, group_of, sent)


def _rounds(groups: tuple, pieces: list[list[Piece]], share: int) -> list[Round]:
    """The rounds of one set of groups: each process's pieces (``pieces[reader]``) packed into
    rows of at most ``share`` bytes (and the header); larger pieces one per row. Indexed from 0:
    :func:`plan_delivery` numbers the job's rounds once it has interleaved the partitions'."""
    group_of = {p: g for g in groups for p in g}
    fits = lambda p: aligned(p.nbytes) <= share  # noqa: E731
    queues = {r: pack([p for p in mine if fits(p)], lambda p: p.nbytes, share) for r, mine in enumerate(pieces) if mine}
    rounds = []
    for k in range(max(map(len, queues.values()), default=0)):
        rows = {r: tuple(q[k][0]) for r, q in queues.items() if k < len(q)}
        rounds.append(_round(len(rounds), groups, rows, group_of))
    # Larger pieces: one per row. In groups of two, gathered (every member sends one; the
    # gathered copy holds what a sum's row and result would); in larger groups, where a gather
    # would hold S of them, one per group and round, summed over the group.
    summed = len(groups[0]) > 2
    if summed:
        big = [[p for member in g for p in pieces[member] if not fits(p)] for g in groups]
    else:
        big = [[p for p in mine if not fits(p)] for mine in pieces]
    big = [q for q in big if q]
    for k in range(max(map(len, big), default=0)):
        rows = {q[k].reader: (q[k],) for q in big if k < len(q)}
        rounds.append(_round(len(rounds), groups, rows, group_of, summed))
    return rounds
