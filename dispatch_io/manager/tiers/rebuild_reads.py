"""What a parity rebuild reads, and what it serves (``rebuild``).

* :class:`Source`: a local checkpoint a rebuild reads pieces from -- a member's own copy, a holder's
  parity rows --, opened on first use, each read cut from whole stored chunks and checked against
  their CRC-32Cs as it is read;
* :class:`RebuiltCopy`: a lost process's copy of a step, rebuilt in memory, which a restore reads
  through :class:`MemoryReader` (a ``runner.Reader`` of regions held in memory) like a copy on disk.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math

import numpy as np
from absl import logging

from dispatch_io.errors import CorruptCheckpointError, IncompleteCheckpointError
from dispatch_io.formats.detect import open_ours
from dispatch_io.manager.tiers import checks
from dispatch_io.read import loop as reading
from dispatch_io.workers import ChunkError, ReadItem, Region, aligned_empty, crc32c, numpy_dtype


@dataclasses.dataclass
class RebuiltCopy(checks.LocalCopy):
    """A lost process's copy of a step, rebuilt in memory: ``regions`` {key path: {stored bounds:
    array}}; its manifest (``opened.manifest``) is a peer's without checksums (not of these bytes)."""

    regions: dict = dataclasses.field(default_factory=dict)

    def open_reader(self, runner):
        return MemoryReader(self.regions)


@dataclasses.dataclass(frozen=True)
class Opened:
    manifest: object


class MemoryReader:
    """A ``runner.Reader`` of regions held in memory ({key path: {stored bounds: array}}); a region
    they do not make up whole fails its read (its future) with a ``ChunkError``, as a lost chunk does."""

    def __init__(self, regions: dict):
        self._regions = regions
        self._handed: set = set()   # the regions handed over whole: each to one result only

    def _fill(self, region: Region, into: np.ndarray):
        """Write ``region`` into ``into`` (its shape), cut from the regions held that it overlaps (of
        one sharding: disjoint) -- on another mesh, one region read is several rebuilt ones.
        ChunkError if they do not make it up whole."""
        filled = 0
        for bounds, array in self._regions.get(region.keypath, {}).items():
            part = tuple((max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(region.bounds, bounds))
            if all(lo < hi for lo, hi in part):
                into[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(part, region.bounds))] = \
                    array[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(part, bounds))]
                filled += math.prod(hi - lo for lo, hi in part)
        if filled != math.prod(region.shape):
            raise ChunkError(region.keypath, region.bounds, KeyError("not rebuilt"))

    def read(self, items):
        out = []
        try:
            for item in items:
                whole = self._whole(item)
                if whole is not None:   # a region as it was rebuilt: handed over, not copied
                    out.append(whole)
                    continue
                buffer = aligned_empty(item.shape, numpy_dtype(item.dtype))
                for region, local in item.pieces:
                    self._fill(region, buffer[tuple(slice(lo, hi) for lo, hi in local) + (Ellipsis,)])
                out.append(buffer)
        except ChunkError as exc:
            return _done(error=exc)
        return _done(out)

    def _whole(self, item) -> np.ndarray | None:
        """The region held that ``item`` reads whole as one piece (the same bounds and dtype), or None
        (also for a second read of it: two results -- ``names=`` mapping two leaves to one -- never
        share a buffer; and for a read-only one -- a view of a row as it came, numpy's view of the
        collective's result -- read for a host result: a numpy result is the caller's to write)."""
        if len(item.pieces) != 1:
            return None
        region, local = item.pieces[0]
        key = (region.keypath, tuple(region.bounds))
        array = self._regions.get(region.keypath, {}).get(key[1])
        if array is None or key in self._handed or array.dtype != numpy_dtype(item.dtype) or \
                array.shape != tuple(item.shape) or tuple(local) != tuple((0, n) for n in item.shape) or \
                (item.on_host and not array.flags.writeable):
            return None
        self._handed.add(key)
        return array

    def checksums(self, regions):
        try:
            found = []
            for region in regions:
                held = self._regions.get(region.keypath)
                if not held:
                    raise ChunkError(region.keypath, region.bounds, KeyError("not rebuilt"))
                array = np.empty(region.shape, next(iter(held.values())).dtype)
                self._fill(region, array)
                found.append(crc32c(array))
            return _done(found)
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


class Source:
    """A checkpoint a rebuild reads from (a member's copy, a holder's parity rows), opened on its
    first read, once for every row group (if it cannot be: logged, and every read of it fails)."""

    def __init__(self, path: str, runner):
        self.path, self._runner, self._reader, self.opened = path, runner, None, None

    def _open(self) -> bool:
        if self._reader is None and self.path is not None:
            try:
                self.opened = open_ours(self.path)
            except (IncompleteCheckpointError, CorruptCheckpointError, OSError) as exc:
                logging.warning("dispatch_io: %s is not used to rebuild a lost process: %s", self.path, exc)
                self.path = None   # not tried again
            else:
                self._reader = self._runner.open_reader(self.opened.arrays, self.opened.context)
        return self._reader is not None

    def read(self, wanted: list[tuple[str, tuple]]) -> dict:
        """{(key path, stored bounds): array, or None if it cannot be read or fails its CRC-32C (logged)}
        (all None if the checkpoint cannot be opened). Each is cut from its whole stored chunks, read
        once and checked (a chunk's CRC-32C is of all of it: a process holding both device regions of
        a small leaf may store them as one chunk)."""
        if not self._open():
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
