"""Parity in the local tier, the restore side: a lost process's regions rebuilt from its peers.

A restore through the tiers gathers, with what each process holds, each step's parity section
(``parity_plan``); :func:`augment` adds to the reports the regions parity can rebuild
(``parity_plan.rebuilt_steps``): the lost process then "holds" them, and the plan routes them as
its own. When a plan picks such a step, :func:`run` (every process together, once per step):

* each holder of a lost process's piece ``j`` reads its parity rows (``<step>/parity``), each
  other member of that group its own protected regions (its local copy), every read checked
  against its CRC-32C as it is read (``checks.mismatched``), and XORs its pieces into a row (the
  lost process's rows, zeros elsewhere) per lost process it feeds;
* the rows travel over the devices, one round per ring offset between a lost process and the
  processes that feed it (at most ``2k - 1``; :func:`_send`: in each round the process that many
  places on sends its row to the lost one, which sends nothing back -- a collective permute among the
  round's pairs alone), and each lost process XORs what it receives: its rows back, from which it cuts its
  regions by its recorded layout and serves them from memory (:class:`RebuiltCopy`, a ``runner.Reader`` of them: simpler
  than writing them to disk first, and nothing is read twice).

A rebuilt region is not checked against a peer's manifest (its CRC-32Cs are of the peer's chunks):
what it is rebuilt from was checked as read. A bad parity row or member region loses only the
regions with a byte in the pieces it feeds (``parity_plan.hit``): they are reported bad, and the
restore takes them from the next source (the root), or an older step.

It goes one row group (``rows.ROW_BYTES`` per device at most) at a time: a feeder holds one group's
reads and rows (one per lost process it feeds) on the host at once, whatever its share.

Costs: the members of a lost process's groups read their own regions once more than a restore
reads them; each round moves one row (a lost process's rows: its protected share, padded) per
lost process, whatever the job's size; a lost process holds its rebuilt share on the host until
the restore has placed it (beyond the restore's staging bound: the bytes it serves from memory).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os

import jax
import numpy as np
from absl import logging

from dispatch_io.read import loop as reading
from dispatch_io.errors import CorruptCheckpointError, IncompleteCheckpointError
from dispatch_io.formats.detect import open_ours
from dispatch_io.manager.tiers import checks, job_steps, parity_plan
from dispatch_io.manager.tiers.parity import PARITY, row_name
from dispatch_io.manifest import parse as parse_manifest
from dispatch_io.multihost import scaleout
from dispatch_io.multihost.rows import send
from dispatch_io.storage import Location
from dispatch_io.workers import ChunkError, ReadItem, Region, aligned_empty, crc32c, numpy_dtype


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


@dataclasses.dataclass
class RebuiltCopy(checks.LocalCopy):
    """A lost process's copy of a step, rebuilt in memory: ``regions`` {key path: {stored bounds:
    array}}; its manifest (``opened.manifest``) is a peer's without checksums (not of these bytes)."""

    regions: dict = dataclasses.field(default_factory=dict)

    def open_reader(self, runner):
        return _MemoryReader(self.regions)


@dataclasses.dataclass(frozen=True)
class _Opened:
    manifest: object


class _MemoryReader:
    """A ``runner.Reader`` of regions held in memory ({key path: {stored bounds: array}}); a region
    they do not make up whole fails its read (its future) with a ``ChunkError``, as a lost chunk does."""

    def __init__(self, regions: dict):
        self._regions = regions

    def _source(self, region: Region) -> np.ndarray:
        """``region`` cut from the regions held that it overlaps (of one sharding: disjoint) -- on
        another mesh, one region read is several rebuilt ones."""
        found, filled = None, 0
        for bounds, array in self._regions.get(region.keypath, {}).items():
            part = tuple((max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(region.bounds, bounds))
            if all(lo < hi for lo, hi in part):
                found = np.empty(region.shape, array.dtype) if found is None else found
                found[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(part, region.bounds))] = \
                    array[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(part, bounds))]
                filled += math.prod(hi - lo for lo, hi in part)
        if found is None or filled != math.prod(region.shape):
            raise ChunkError(region.keypath, region.bounds, KeyError("not rebuilt"))
        return found

    def read(self, items):
        out = []
        try:
            for item in items:
                buffer = aligned_empty(item.shape, numpy_dtype(item.dtype))
                for region, local in item.pieces:
                    buffer[tuple(slice(lo, hi) for lo, hi in local) + (Ellipsis,)] = self._source(region)
                out.append(buffer)
        except ChunkError as exc:
            return _done(error=exc)
        return _done(out)

    def checksums(self, regions):
        try:
            return _done([crc32c(np.ascontiguousarray(self._source(region))) for region in regions])
        except ChunkError as exc:
            return _done(error=exc)

    def close(self):
        pass


def _done(value=None, error: BaseException | None = None) -> concurrent.futures.Future:
    """A future done with ``value``, or failed with ``error``."""
    future = concurrent.futures.Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future


class _Source:
    """A checkpoint a rebuild reads from (a member's copy, a holder's parity rows), opened once for
    every row group (None if it cannot be: logged, and every read of it fails)."""

    def __init__(self, path: str, runner):
        self.path, self._reader = path, None
        try:
            self.opened = open_ours(path)
        except (IncompleteCheckpointError, CorruptCheckpointError, OSError) as exc:
            logging.warning("dispatch_io: %s is not used to rebuild a lost process: %s", path, exc)
            self.opened = None
        else:
            self._reader = runner.open_reader(self.opened.arrays, self.opened.context)

    def read(self, wanted: list[tuple[str, tuple]]) -> dict:
        """{(key path, stored bounds): array, or None if it cannot be read or fails its CRC-32C (logged)}
        (all None if the checkpoint cannot be opened). Each is cut from its whole stored chunks, read
        once and checked (a chunk's CRC-32C is of all of it: a process holding both device regions of
        a small leaf may store them as one chunk)."""
        if self.opened is None:
            return dict.fromkeys(wanted)
        found, spans = {}, {}
        for keypath, bounds in wanted:
            saved = self.opened.manifest.by_keypath.get(keypath)
            try:
                if saved is None or saved.stored is None:
                    raise KeyError(f"{keypath} is not in it")
                cells = [cell for _, cell in reading.stored_cells(saved.stored, bounds)]
                span = tuple((min(c[a][0] for c in cells), max(c[a][1] for c in cells)) for a in range(len(bounds)))
                if (keypath, span) not in spans:
                    spans[(keypath, span)] = _read_span(self._reader, saved, span)
                array = spans[(keypath, span)]
                if isinstance(array, Exception):
                    raise array
                found[(keypath, bounds)] = array[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(bounds, span))]
            except (KeyError, ChunkError, CorruptCheckpointError) as exc:
                logging.warning("dispatch_io: %s %s of %s is not used to rebuild a lost process: %s", keypath,
                                [list(b) for b in bounds], self.path, exc)
                found[(keypath, bounds)] = None
        return found

    def close(self):
        if self._reader is not None:
            self._reader.close()


def _read_span(reader, saved, span: tuple):
    """The stored bounds ``span`` (whole chunks) of the leaf ``saved``, read and checked against its
    CRC-32Cs; the ``ChunkError`` / ``CorruptCheckpointError`` it fails with instead."""
    shape = tuple(hi - lo for lo, hi in span)
    item = ReadItem(((Region(saved.stored, span, saved.keypath), tuple((0, n) for n in shape)),), shape,
                    saved.stored.dtype)
    try:
        array = reader.read([item]).result()[0]
    except ChunkError as exc:
        return exc
    wrong = checks.mismatched(saved, span, array) if saved.checksums else []
    if wrong:
        return CorruptCheckpointError(f"{len(wrong)} chunk(s) do not match their CRC-32C", keypath=saved.keypath)
    return array


def _stored(group: dict, keypath: str, region) -> tuple:
    """The stored bounds of ``region`` of ``keypath`` (a leaf of ``group``): PRNG keys' data has more dimensions."""
    return tuple(tuple(b) for b in region) + tuple((0, n) for n in group["trail"][group["leaves"].index(keypath)])


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Rows laid out in one buffer of bytes: a slot of ``W`` bytes per (row group, device position),
    each cut into ``k`` pieces; ``groups`` are the step's row groups from index ``first`` on (a
    rebuild goes one row group at a time)."""

    k: int
    groups: list
    devices: int
    first: int = 0

    def cells(self):
        """(group index, group, device position, offset of its slot, piece width) of every row."""
        offset = 0
        for g, group in enumerate(self.groups, self.first):
            for i in range(self.devices):
                yield g, group, i, offset, group["W"] // self.k
                offset += group["W"]

    @property
    def size(self) -> int:
        return sum(group["W"] for group in self.groups) * self.devices

    def add(self, row: np.ndarray, offset: int, j: int, piece: np.ndarray):
        """XOR ``piece`` into piece ``j`` of the slot at ``offset`` of ``row``."""
        start = offset + j * piece.size
        row[start:start + piece.size] ^= piece


def _holder_part(out: dict, rows: _Rows, source: _Source, holding: list) -> list:
    """XOR this process's parity rows (``source``: its ``<step>/parity``, CRC-checked) into ``out`` ({lost process: its
    rows}) for the pieces it holds (``holding``: (lost process, piece j)); the (lost, group, device, j)
    of those it could not read."""
    wanted = {(g, i): (f"['{row_name(g, i)}']", ((0, 1), (0, width))) for g, _, i, _, width in rows.cells()}
    read, bad = source.read(sorted(wanted.values())), []
    for p, j in holding:
        for g, _, i, offset, _ in rows.cells():
            data = read[wanted[(g, i)]]
            if data is None:
                bad.append((p, g, i, j))
            else:
                rows.add(out[p], offset, j, np.asarray(data).reshape(-1))
    return bad


def _member_part(out: dict, rows: _Rows, source: _Source, own: list, parts: list) -> list:
    """XOR this process's own pieces (its rows, packed from its own regions by its layout ``own``, read
    from its copy at ``path``, CRC-checked) into ``out`` ({lost process: its rows}; ``parts``: (lost
    process, piece j of theirs, piece of this process's row)); the (lost, group, device, j) of those with
    a byte it could not read."""
    wanted = {(kp, _stored(group, kp, region)) for g, group, i, _, _ in rows.cells()
              for kp, region, _, _ in parity_plan.spans(group, own[g][i])}
    read, bad = source.read(sorted(wanted)), []
    for g, group, i, offset, width in rows.cells():
        full, broken = np.zeros(group["W"], np.uint8), set()
        for kp, region, start, nbytes in parity_plan.spans(group, own[g][i]):
            data = read[(kp, _stored(group, kp, region))]
            if data is None:
                broken |= {j for j in range(rows.k) if start < (j + 1) * width and j * width < start + nbytes}
            else:
                full[start:start + nbytes] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        for p, j, piece in parts:
            if piece in broken:
                bad.append((p, g, i, j))
            else:
                rows.add(out[p], offset, j, full[piece * width:(piece + 1) * width])
    return bad


def _send(row: np.ndarray, pairs: list[tuple[int, int]]) -> np.ndarray:
    """Each (sender, receiver) of ``pairs`` (disjoint) sends its ``row`` to the receiver alone, over
    their first devices (``multihost.rows.send``: a collective permute among the pairs' processes,
    nothing sent back); the row this process receives (zeros in a sender). The processes of ``pairs``
    call it together; the others take no part."""
    groups = tuple(tuple(pair) for pair in pairs)
    return send(row, groups, scaleout.carriers(jax.process_count()), tuple((2 * g, 2 * g + 1) for g in range(len(groups))))


def run(step: int, lost: dict, sections: dict, having: list[int], room, outputs_of, *, process: int,
        step_path: str, runner) -> tuple[RebuiltCopy | None, dict, int]:
    """Rebuild the ``lost`` processes' regions of ``step`` (every process together; see the module
    doc). ``sections``: {process: its parity section}; ``having``: the processes with a copy of
    their own; ``outputs_of(manifest)``: the restore's (treedef, outputs); ``process``: this one;
    ``step_path``: its local step's directory (its copy, and its parity rows under it); ``runner``:
    the dispatcher's, which opens the readers. Returns (this process's
    :class:`RebuiltCopy` if it is lost, else None; {key path: [region as JSON]} of its regions that
    could not be rebuilt; the bytes it received from the others)."""
    me = process
    first = sections[min(sections)]
    order, k = tuple(first["ring"]), first["k"]
    devices = len(first["layouts"][str(min(sections))][0])
    path = step_path
    sources = [(p, j, holder, others) for p in sorted(lost) for j, holder, others in parity_plan.sources(order, k, p)]
    holding = [(p, j) for p, j, holder, _ in sources if holder == me]
    parts = [(p, j, i) for p, j, _, others in sources for m, i in others if m == me]
    # One round per ring offset d between a lost process and a process feeding it (at most 2k - 1): the
    # process d places on sends its pieces to the lost one, which XORs them (the pairs of a round are disjoint).
    position, n = {p: t for t, p in enumerate(order)}, len(order)
    rounds: dict = {}
    for p, _, holder, others in sources:
        for c in (holder, *(m for m, _ in others)):
            rounds.setdefault((position[c] - position[p]) % n, set()).add((c, p))
    rebuilt, bad, received = [], [], 0
    holder = _Source(os.path.join(path, PARITY), runner) if holding else None
    member = _Source(path, runner) if parts else None
    try:
        for g, group in enumerate(first["groups"]):   # one row group at a time: a feeder holds one group's rows
            rows = _Rows(k, [group], devices, g)
            out = {p: np.zeros(rows.size, np.uint8) for p in {p for p, *_ in holding + parts}}
            if holder is not None:
                bad += _holder_part(out, rows, holder, holding)
            if member is not None:
                bad += _member_part(out, rows, member, sections[me]["layouts"][str(me)], parts)
            data = np.zeros(rows.size, np.uint8) if me in lost else None
            for d in sorted(rounds):
                pairs = sorted(rounds[d])
                partner = next((a if b == me else b for a, b in pairs if me in (a, b)), None)
                if partner is None:
                    continue
                got = _send(out.get(partner, np.zeros(rows.size, np.uint8)), pairs)
                received += got.size if me in lost else 0
                if data is not None:
                    np.bitwise_xor(data, got, out=data)
            if data is not None:
                rebuilt.append((rows, data))
    finally:
        for source in (holder, member):
            if source is not None:
                source.close()
    manifest = job_steps.share_manifest(room, step, having, me, lambda: Location.parse(path).read_manifest())
    room.set(f"rebuild/{step}/{me}", [list(b) for b in bad])   # every process learns what failed
    bad = [tuple(b) for found in room.gather(f"rebuild/{step}").values() for b in found]
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
    described = parse_manifest(manifest, path)
    described = dataclasses.replace(described, leaves=tuple(dataclasses.replace(leaf, checksums=None)
                                                            for leaf in described.leaves))
    copy = RebuiltCopy(_Opened(described), regions=regions)
    copy.treedef, copy.outputs = outputs_of(described)
    logging.info("dispatch_io: process %d's regions of local step %d rebuilt from parity (%d left out)", me, step,
                 sum(len(v) for v in failed.values()))
    return copy, failed, received


def _cut(data: np.ndarray, rows: _Rows, me: int, mine: list, bad: list) -> tuple[dict, dict]:
    """({key path: {stored bounds: array}} of this lost process's regions cut out of its rebuilt rows
    ``data`` by its layout ``mine``, {key path: [region as JSON]} of those with a byte in a bad piece)."""
    regions, failed = {}, {}
    for g, group, i, slot, _ in rows.cells():
        pieces = {j for p, gg, ii, j in bad if (p, gg, ii) == (me, g, i)}
        lose = set(parity_plan.hit(group, mine[g][i], rows.k, pieces))
        for kp, region, offset, nbytes in parity_plan.spans(group, mine[g][i]):
            if (kp, region) in lose:
                failed.setdefault(kp, []).append([list(b) for b in region])
                continue
            stored = _stored(group, kp, region)
            dtype = numpy_dtype(group["dtypes"][group["leaves"].index(kp)])
            array = data[slot + offset:slot + offset + nbytes].view(dtype)
            regions.setdefault(kp, {})[stored] = array.reshape(tuple(hi - lo for lo, hi in stored))
    return regions, failed
