"""Parity in the local tier, the restore side: a lost process's regions rebuilt from its peers.

A restore through the tiers gathers, with what each process holds, each step's parity section
(``parity_plan``); :func:`augment` adds to the reports the regions parity can rebuild
(``parity_plan.rebuilt_steps``): the lost process then "holds" them, and the plan routes them as
its own. When a plan picks such a step, :func:`run` (every process together, once per step) brings
each lost piece back along a chain (``parity_plan.transfers``: rounds of collective permutes among
each round's processes, :func:`~dispatch_io.manager.tiers.rebuild_rounds.senders`; every transfer carries one piece, so the lost process
receives its share once):

* early, the piece's holder sends its parity row (``<step>/parity``, read and checked from the start
  of the restore's local pass: :func:`read_ahead`) to the group's first other member;
* late, each other member XORs into the sum that came to it the piece of its row that the holder's
  parity covers, packed from its own protected regions as the restore's local pass read and
  checked them (``have``: nothing is read twice; the pass reads them first; what it did not read of
  its copy -- a region received from a peer, read as another dtype, or on another mesh -- is read
  from its copy, checked as read), and sends the sum on, the last member to the lost process;
* the lost process cuts its regions out of its rows by its recorded layout and serves them from
  memory (:class:`~dispatch_io.manager.tiers.rebuild_reads.RebuiltCopy`: simpler than writing them
  to disk first).

A rebuilt region is not checked against a peer's manifest (its CRC-32Cs are of the peer's chunks):
what it is rebuilt from was checked as read. A bad parity row or member region loses only the
regions with a byte in the pieces it feeds (``parity_plan.hit``): they are reported bad, and the
restore takes them from the next source (the root), or an older step.

It goes one row group (``packed_rows.ROW_BYTES`` per device at most) at a time: a feeder holds one
group's pieces (and a holder the next group's parity rows) on the host at once, whatever its share.
Before a group's rounds every process says it is ready, its parity rows and pieces in hand
(:func:`_all_ready`; one barrier a group, and the rounds then run back to back: a second barrier
between the early and the late rounds cost more than the early rounds overlapping the members'
reads bought): one that failed to get them, or does not come within the barrier timeout, fails the
rebuild in every process, named, before anyone enters a collective it would never join. One that
fails making a row inside the rounds still takes its part in each (its idle row instead: its
partners wait in the collective) and then fails the rebuild everywhere, named -- at the next row
group's barrier, or after the last.

Costs: the holders read their parity rows (1/k of a share); per lost process, each holder and each
other member sends one piece (1/k of its protected rows) per chain it is in -- ``k`` per chain, ``k``
chains --; a lost process holds its rebuilt share on the host until the restore has placed it
(beyond the restore's staging bound).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import numpy as np
from absl import logging

from dispatch_io.errors import CheckpointError
from dispatch_io.manager.tiers import job_steps, parity_plan
from dispatch_io.manager.tiers.rebuild_reads import Opened, RebuiltCopy, Source
from dispatch_io.manager.tiers.rebuild_rounds import Part, Ready, Rows, exchange
from dispatch_io.manager.tiers.parity import PARITY, row_name
from dispatch_io.manifest import parse as parse_manifest
from dispatch_io.storage import Location
from dispatch_io.workers import numpy_dtype


def augment(gathered: dict, reports: dict, count: int) -> tuple[dict, dict]:
    """Add to ``reports`` (process -> {step: {key path: set of regions}}) the regions parity rebuilds;
    returns ({step: {lost process: {key path: regions}}}, {step: {process: its parity section}}).
    ``gathered``: process -> {"held": {step: held JSON}, "parity": {step: local_steps.parity_report}}."""
    by_process = {p: {int(s): {"held": held, **r.get("parity", {}).get(s, {})} for s, held in r["held"].items()}
                  for p, r in gathered.items()}
    lost = parity_plan.rebuilt_steps(by_process, count)
    sections = {}
    for step, rebuilt in lost.items():
        sections[step] = {p: steps[step]["parity"] for p, steps in by_process.items()
                          if step in steps and isinstance(steps[step].get("parity"), dict)}
        for p, regions in rebuilt.items():
            reports.setdefault(p, {})[step] = {k: set(v) for k, v in regions.items()}
    return lost, sections


def _stored(group: dict, keypath: str, region) -> tuple:
    """The stored bounds of ``region`` of ``keypath`` (a leaf of ``group``): PRNG keys' data has more dimensions."""
    return tuple(tuple(b) for b in region) + tuple((0, n) for n in group["trail"][group["leaves"].index(keypath)])


def _parity_rows(source: Source, rows: Rows) -> tuple[dict, set]:
    """({device position: this process's parity row of ``rows``' group there, read from ``source``
    (its ``<step>/parity``, CRC-checked)}, the device positions whose row could not be read)."""
    width = rows.groups[0]["W"] // rows.k
    wanted = {i: (f"['{row_name(g, i)}']", ((0, 1), (0, width))) for g, _, i, _ in rows.cells()}
    read = source.read(sorted(wanted.values()))
    found = {i: read[key] for i, key in wanted.items()}
    return {i: np.asarray(a).reshape(-1) for i, a in found.items() if a is not None}, \
        {i for i, a in found.items() if a is None}


def _feeding_spans(rows: Rows, own: list, pieces: set):
    """(group index, group, device position, key path, region, byte offset in the row, bytes, the
    ``pieces`` it has a byte in) of each region of this process's layout ``own`` in ``rows``' group
    with a byte in one of ``pieces``: what its member pieces are cut from."""
    for g, group, i, width in rows.cells():
        for kp, region, start, nbytes in parity_plan.spans(group, own[g][i]):
            sent = parity_plan.touched(start, nbytes, width, rows.k) & pieces
            if sent:
                yield g, group, i, kp, region, start, nbytes, sent


def _own_pieces(rows: Rows, own: list, found: dict, have, source: Source) -> dict:
    """Pack into ``found`` {piece: zeros, one piece of a row per device position} that piece of this
    process's rows of ``rows``' group, every device position's in turn (a row as a transfer carries
    it), from its own regions by its layout ``own``; returns {device position: the pieces with a
    byte it could not get}. Each region is ``have(key path, stored bounds)`` (what the restore
    read and checked, in memory; None if it does not hold it) or else read from its copy (``source``)."""
    width = rows.groups[0]["W"] // rows.k
    spans = list(_feeding_spans(rows, own, set(found)))
    wanted = sorted({(kp, _stored(group, kp, region)) for _, group, _, kp, region, _, _, _ in spans})
    read = {key: have(*key) for key in wanted}
    missing = [key for key, array in read.items() if array is None]
    if missing:
        read.update(source.read(missing))
    broken = {i: set() for i in range(rows.devices)}
    for _, group, i, kp, region, start, nbytes, sent in spans:
        data = read.get((kp, _stored(group, kp, region)))
        if data is None:
            broken[i] |= sent
            continue
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        for j, into, part in parity_plan.carried(i, start, nbytes, width, sent):
            found[j][into] = flat[part]
    return broken


def _all_ready(room, step: int, group: int, me: int, error: BaseException | None):
    """Every process says whether it is ready for row group ``group``'s rounds (a holder's parity
    rows and a member's pieces in hand) before any enters them: a process that failed, or does not come
    within the barrier timeout (BarrierTimeoutError naming it), fails the rebuild everywhere, rather
    than leaving the others in a collective without it. Raises ``error`` in the process that had it."""
    room.set(f"rebuild-ready/{step}/{group}/{me}", None if error is None else f"{type(error).__name__}: {error}")
    failed = {p: e for p, e in room.gather(f"rebuild-ready/{step}/{group}",
                                           doing="start rebuilding the lost processes' regions").items() if e}
    if error is not None:
        raise error
    if failed:
        p = min(failed)
        raise CheckpointError(f"process {p} could not take its part in rebuilding local step {step} from parity: "
                              f"{failed[p]}")


def feeding(sections: dict, lost, me: int) -> frozenset:
    """{(key path, region)} of this process's own regions with a byte in a piece it sends a holder
    in the rebuild of ``lost`` (as :func:`run`): what a restore's local pass beside the rebuild
    reads first, so that the rounds can start while it reads the rest."""
    part = Part.of(sections, lost, me)
    if not part.pieces:
        return frozenset()
    own = sections[me]["layouts"][str(me)]
    return frozenset((kp, region) for rows in part.groups
                     for _, _, _, kp, region, _, _, _ in _feeding_spans(rows, own, part.pieces))


class ParityReads:
    """A holder's parity rows of a step (``<step>/parity``), read row group by row group on a thread
    of their own, one group ahead of the rounds (:func:`read_ahead` starts the first before the
    restore's local pass, so that read overlaps it)."""

    def __init__(self, path: str, runner, groups: list):
        self._source, self._groups, self._ahead = Source(path, runner), groups, {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1)

    def start(self, g: int = 0) -> "ParityReads":
        """Start reading row group ``g`` (if there is one and it is not started)."""
        if g < len(self._groups) and g not in self._ahead:
            self._ahead[g] = self._pool.submit(_parity_rows, self._source, self._groups[g])
        return self

    def rows(self, g: int) -> tuple[dict, set]:
        """Row group ``g``'s parity rows (as ``_parity_rows``); the next group's read is started."""
        self.start(g)
        future = self._ahead.pop(g)
        self.start(g + 1)
        return future.result()

    def close(self):
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._source.close()


def read_ahead(lost: dict, sections: dict, process: int, step_path: str, runner) -> ParityReads | None:
    """This process's parity rows of the local step at ``step_path`` being read, from the first row
    group, if it holds a piece of one of the ``lost`` processes (else None): started before the
    restore's local pass, handed to :func:`run` (which closes it)."""
    part = Part.of(sections, lost, process)
    return ParityReads(os.path.join(step_path, PARITY), runner, part.groups).start() if part.holding else None


def run(step: int, lost: dict, sections: dict, having: list[int], room, outputs_of, *, process: int,
        step_path: str, runner, have=None, reads: ParityReads | None = None,
        gate=None) -> tuple[RebuiltCopy | None, dict, int]:
    """Rebuild the ``lost`` processes' regions of ``step`` (every process together; see the module
    doc). ``sections``: {process: its parity section}; ``having``: the processes with a copy of
    their own; ``outputs_of(manifest)``: the restore's (treedef, outputs); ``process``: this one;
    ``step_path``: its local step's directory (its copy, and its parity rows under it); ``runner``:
    the dispatcher's, which opens the readers; ``have(key path, stored bounds)``: a region of this
    process's own that the restore's local pass read of its copy and checked, in memory as stored
    (None where it is not: read from its copy; ``tier_fill.Fill.in_memory``); ``reads``: its parity
    rows already being read (:func:`read_ahead`; None: read here); ``gate``: a ``threading.Event`` set
    when this process may start collectives (a restore's pass beside it has run its own; None: now). Returns (this process's
    :class:`RebuiltCopy` if it is lost, else None; {key path: [region as JSON]} of its regions that
    could not be rebuilt; the bytes it received from the others)."""
    me, part = process, Part.of(sections, lost, process)
    rebuilt, bad, received, broke = [], [], 0, None
    if part.holding and reads is None:
        reads = ParityReads(os.path.join(step_path, PARITY), runner, part.groups)
    member = Source(step_path, runner)   # its own copy: read only for what ``have`` does not hold
    own = sections[me]["layouts"][str(me)] if part.pieces else None
    have = have or (lambda keypath, bounds: None)
    try:
        for rows in part.groups:   # one row group at a time: a feeder holds one group's rows
            error, held, unread, broken, ready = broke, {}, set(), {}, None   # a round that broke: fail here
            try:   # everything its rounds need: a holder's parity rows, a member's pieces
                ready = Ready.of(part, rows, me in lost)
                held, unread = reads.rows(rows.first) if part.holding else ({}, set())
                broken = _own_pieces(rows, own, ready.pieces, have, member) if part.pieces else {}
            except Exception as exc:  # noqa: BLE001 - reported to the others first, then raised
                error = exc
            if gate is not None:
                gate.wait()
            _all_ready(room, step, rows.first, me, error)
            for phase, senders in ((part.early, ready.early), (part.late, ready.late)):
                got, error = exchange(rows, phase, senders, me, held, ready)
                received, broke = received + got, broke or error
            bad += [(p, rows.first, i, j) for p, j in sorted(part.holding) for i in unread]
            bad += [(move[2], rows.first, i, move[3]) for r in part.late for move in r
                    if move[0] == me and move[4] is not None for i in range(rows.devices) if move[4] in broken[i]]
            if ready.data is not None:
                rebuilt.append((rows, ready.data))
    finally:
        for source in (reads, member):
            if source is not None:
                source.close()
    manifest = job_steps.share_manifest(room, step, having, me, lambda: Location.parse(step_path).read_manifest())
    room.set(f"rebuild/{step}/{me}", {"bad": [list(b) for b in bad],   # every process learns what failed
                                      "broke": None if broke is None else f"{type(broke).__name__}: {broke}"})
    found = room.gather(f"rebuild/{step}")
    if broke is not None:
        raise broke
    broken = {p: r["broke"] for p, r in found.items() if r["broke"]}
    if broken:   # its rows went out as zeros: what they fed is unknown, so the rebuild fails everywhere
        p = min(broken)
        raise CheckpointError(f"process {p} failed in the rounds rebuilding local step {step} from parity: "
                              f"{broken[p]}")
    bad = [tuple(b) for r in found.values() for b in r["bad"]]
    if me not in lost:
        return None, {}, received
    mine = next(s["layouts"][str(me)] for s in sections.values() if str(me) in s["layouts"])
    regions, failed = {}, {}
    for rows, data in rebuilt:
        cut, lost_here = _cut(data, rows, me, mine, bad)
        for kp, found in cut.items():
            regions.setdefault(kp, {}).update(found)
        for kp, found in lost_here.items():
            failed.setdefault(kp, []).extend(found)
    described = parse_manifest(manifest, step_path)
    described = dataclasses.replace(described, leaves=tuple(dataclasses.replace(leaf, checksums=None)
                                                            for leaf in described.leaves))
    copy = RebuiltCopy(Opened(described), regions=regions)
    copy.treedef, copy.outputs = outputs_of(described)
    logging.info("dispatch_io: process %d's regions of local step %d rebuilt from parity (%d left out)", me, step,
                 sum(len(v) for v in failed.values()))
    return copy, failed, received


def _cut(data: dict, rows: Rows, me: int, mine: list, bad: list) -> tuple[dict, dict]:
    """({key path: {stored bounds: array}} of this lost process's regions cut out of its rebuilt rows
    ``data`` ({j: piece j of each device position's row, in turn}, as ``rebuild_rounds.exchange``
    keeps them) by its layout ``mine``, {key path: [region as JSON]} of those with a byte in a bad
    piece). A region inside one piece is a view of it (read-only, as the collective's result came:
    ``rebuild_reads.MemoryReader`` copies it for a numpy result); only one across pieces is copied together."""
    regions, failed = {}, {}
    for g, group, i, width in rows.cells():
        pieces = {j for p, gg, ii, j in bad if (p, gg, ii) == (me, g, i)}
        lose = set(parity_plan.hit(group, mine[g][i], rows.k, pieces))
        for kp, region, offset, nbytes in parity_plan.spans(group, mine[g][i]):
            if (kp, region) in lose:
                failed.setdefault(kp, []).append([list(b) for b in region])
                continue
            cut = [data[j][at] for j, at, _ in parity_plan.carried(i, offset, nbytes, width, range(rows.k))]
            array = cut[0] if len(cut) == 1 else np.concatenate(cut)
            stored = _stored(group, kp, region)
            dtype = numpy_dtype(group["dtypes"][group["leaves"].index(kp)])
            regions.setdefault(kp, {})[stored] = array.view(dtype).reshape(tuple(hi - lo for lo, hi in stored))
    return regions, failed
