"""Checking a restore's local copies against their CRC-32Cs, each byte read once where it can be.

A local step saved with checksums records the CRC-32C of every stored chunk (its bytes as stored).
A restore through the tiers checks:

* **what it reads, as it reads it** (:class:`ReadCheck`): its own regions (called by
  ``reading.read_regions`` for each region read) and the pieces of the regions it reads for other
  processes (called by ``scaleout`` for each piece, before it goes into a round's row). A local
  save chunks each region within its bounds, and ``reading.read_pieces`` cuts such a region along
  its stored chunks, so what is in memory is whole chunks: their CRC-32Cs are computed there --
  nothing is read twice. A region with a bad chunk, or one that cannot be read (a chunk file lost
  from a partly wiped RAM disk), is not used (a bad piece is not sent): the restore gets that region
  alone from the next source (a peer's copy, then the root), for every process it was read for;
* **before the read**, what it cannot check that way (:func:`before_read`, :meth:`LocalCopy.bad`):
  the parts of regions cut from copies of another mesh's regions, and regions whose chunks cross
  the region's bounds or are converted as read (``cast=True``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from absl import logging

from dispatch_io.read import loop as reading
from dispatch_io.read import targets as restore_lib
from dispatch_io.errors import CorruptCheckpointError, IncompleteCheckpointError, WorkerError
from dispatch_io.formats.detect import open_ours
from dispatch_io.manager.tiers import placement
from dispatch_io.progress import Progress
from dispatch_io.workers import ChunkError, crc32c, numpy_dtype


def checkable(out: restore_lib.Output, region) -> bool:
    """Whether ``region`` of ``out`` can be checked in memory as it is read: its checkpoint has
    checksums, it is read as stored (no conversion), and every stored chunk it overlaps lies inside it."""
    saved = out.saved
    if saved.checksums is None or numpy_dtype(np.dtype(out.dtype).name) != out.saved_dtype:
        return False
    stored = saved.stored
    return all(lo % c == 0 and (hi % c == 0 or hi == n)
               for (lo, hi), c, n in zip(out.stored_bounds(region), stored.chunk_shape, stored.shape))


class ReadCheck:
    """``check(out, region, array, stored=None)`` for ``reading.read_regions`` (a region read whole)
    and ``scaleout`` (a piece of it: ``stored``, its stored bounds). True if every stored chunk of
    what was just read (``array``: its buffer) matches its CRC-32C, or it is something
    :func:`before_read` checked; else -- or if it could not be read (``array``: the ``ChunkError``
    its read failed with) -- the region is recorded in :attr:`bad` ({key path: [region]}), logged,
    and False (the read leaves it out). ``held``: {key path: set of regions} this process's copy
    holds at the step; a piece of another region (a part of a held one) was checked before the read."""

    def __init__(self, display: str, copy: "LocalCopy | None", held: dict | None = None):
        self.display, self.copy, self.held = display, copy, held or {}
        self.bad: dict[str, list] = {}

    def __call__(self, out: restore_lib.Output, region, array, stored=None) -> bool:
        keypath = out.saved.keypath
        if stored is not None and region not in self.held.get(keypath, ()):
            if isinstance(array, ChunkError):   # checked before the read, unreadable now: nothing to fall back on
                raise reading.read_failure(array, keypath, self.display)
            return True
        if isinstance(array, ChunkError):
            return self._leave_out(out, region, f"{self.display}: cannot read {array}")
        if not checkable(out, region):
            return True
        # a cell reaching past ``bounds`` (a piece cut across chunks) reads short and fails: never passed unchecked
        wrong = mismatched(out.saved, out.stored_bounds(region) if stored is None else stored, array)
        if not wrong:
            if self.copy is not None and stored is None:  # checked: a later plan reading it for others need not
                self.copy.checked.add((keypath, region))
            return True
        return self._leave_out(out, region, reading.mismatches(self.display, wrong))

    def _leave_out(self, out: restore_lib.Output, region, problem) -> bool:
        logging.warning("dispatch_io: a region of the local copy is not used: %s", problem)
        found = self.bad.setdefault(out.saved.keypath, [])
        if [list(b) for b in region] not in found:   # one entry per region, however many of its pieces failed
            found.append([list(b) for b in region])
        return False


def mismatched(saved, bounds, array) -> list[tuple]:
    """(key path, grid index, stored region, saved CRC-32C, read CRC-32C) of each stored chunk of
    ``saved`` (a manifest's leaf, with checksums; its chunks inside ``bounds``) whose bytes in
    ``array`` (the stored region ``bounds``, just read) do not match its CRC-32C."""
    data, wrong = np.asarray(array), []
    for grid, cell in reading.stored_cells(saved.stored, bounds):
        crc = crc32c(data[tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(cell, bounds))])
        expected = saved.checksums.get(tuple(grid))
        if crc != expected:
            wrong.append((saved.keypath, grid, cell, expected, crc))
    return wrong


def before_read(plan: placement.TierPlan, process: int, outputs: dict, held: dict) -> list[tuple]:
    """(output, region to check, the held region it is part of) for every copy ``process`` reads at
    ``plan.step`` that it cannot check in memory as it reads it: any part of a region cut from copies
    (which any holder of the part may read), and the regions it reads for itself or others that
    :func:`checkable` says no to. ``outputs``: {saved key path: Output} of its copy; ``held``: {key
    path: set of regions} it holds at the step."""
    found = []
    for keypath, routes in plan.routes.items():
        out = outputs.get(keypath)
        if out is None:
            continue
        for region, route in routes.items():
            if route.parts:
                found += [(out, part, mine) for part, procs in route.parts if process in procs
                          for mine in held.get(keypath, ()) if _inside(part, mine)]
            elif (process in route.own or route.reader == process) and not checkable(out, region):
                found.append((out, region, region))
    return found


def _inside(part, region) -> bool:
    return all(lo <= a and b <= hi for (a, b), (lo, hi) in zip(part, region))


@dataclasses.dataclass
class LocalCopy:
    """This process's copy of one local step, as a restore uses it: its opened checkpoint (None: it
    cannot be opened, the step is lost to this process), the restore's (treedef, outputs) planned with
    its manifest (the local pass fills them), and the regions already checked (:meth:`bad` checks
    each once; a :class:`ReadCheck` adds those it passed)."""

    opened: object
    treedef: object = None
    outputs: list = dataclasses.field(default_factory=list)
    checked: set = dataclasses.field(default_factory=set)

    @property
    def by_keypath(self) -> dict:
        """{saved key path: Output} of the restore's outputs planned with this copy's manifest."""
        return {o.saved.keypath: o for o in self.outputs if isinstance(o, restore_lib.Output)}

    @classmethod
    def open(cls, path: str, outputs_of) -> "LocalCopy":
        """The copy at ``path`` (``outputs_of(manifest)``: the restore's (treedef, outputs)); a copy
        that cannot be opened is logged and has no ``opened``."""
        try:
            opened = open_ours(path)
        except (IncompleteCheckpointError, CorruptCheckpointError, OSError) as exc:
            logging.warning("dispatch_io: the local step %s is not used: %s", path, exc)
            return cls(None)
        return cls(opened, *outputs_of(opened.manifest))

    def open_reader(self, runner):
        """A reader of this copy's arrays (``runner.open_reader``)."""
        return runner.open_reader(self.opened.arrays, self.opened.context)

    def bad(self, dispatcher, wanted: list[tuple]) -> dict[str, list]:
        """{key path: [held region]} of the ``wanted`` (:func:`before_read`) a stored chunk of which
        fails its CRC-32C or cannot be read (logged); each region checked once per restore. A copy
        saved without checksums has nothing to check against: {}."""
        wanted = [w for w in wanted if (w[0].saved.keypath, w[1]) not in self.checked]
        if not wanted or not self.opened.manifest.has_checksums:  # saved without checksums: nothing to check against
            return {}
        reader = self.open_reader(dispatcher.runner)
        progress = Progress("verify", self.opened.display, enabled=False)
        found: dict[str, list] = {}
        try:
            with progress:
                for out, region, mine in wanted:
                    self.checked.add((out.saved.keypath, region))
                    try:
                        reading.verify_stored(reader, [(out, out.stored_bounds(region))],
                                              dispatcher.options.read_batch_bytes, progress)
                    except (CorruptCheckpointError, WorkerError) as exc:
                        logging.warning("dispatch_io: a region of the local copy is not used: %s", exc)
                        found.setdefault(out.saved.keypath, []).append([list(b) for b in mine])
        finally:
            reader.close()
        return found
