"""Reading a checkpoint: one pipelined loop, used by restore and verify on every runner.

:func:`pipelined` is the loop: batches go to the runner's reader with at most two in flight
(the next one reads while this one's results are placed or compared), each is counted on the
progress, and a failure waits for the reads still in flight before it is raised -- nothing
reads into a buffer, or from a session, that the caller has let go of.

* :func:`read_outputs` (restore): every distinct region this process holds is one
  :class:`~workers.ReadItem` (read once even where several devices hold it), its pieces
  no larger than the chunk limit; items are packed into batches of at most half the budget.
  ``scaleout.py`` uses the same pieces for the regions several processes hold.
* :func:`verify_outputs` (``verify=True`` and ``Dispatcher.verify``): every stored chunk the
  restore needs, read whole, and its CRC-32C compared with the one saved in the manifest.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import math
from typing import Callable, Sequence

import jax
import numpy as np

from dispatch_io.plan.batches import pack, packs
from dispatch_io.errors import CheckpointError, CorruptCheckpointError, WorkerError
from dispatch_io.plan.save_plan import storage_chunk_shape
from dispatch_io.progress import Progress
from dispatch_io.read.targets import DEVICE, HOST, Output, finish, output_regions
from dispatch_io.workers import ChunkError, ReadItem, Region, brief_error, numpy_dtype

EAGER_CHUNKS = 1 << 16   # a verify of more chunks makes its batches as it reads (exact progress below)


def pipelined(batches: Sequence[list], submit: Callable[[list], concurrent.futures.Future],
              consume: Callable[[list, object], None], size: Callable[[list], int], progress: Progress,
              phase: str, failure: Callable[[BaseException, list], BaseException], totals: tuple | None = None,
              again: Callable[[BaseException, list], object] | None = None, depth: int = 2,
              fence: Callable[[list], bool] | None = None):
    """Run ``batches`` through ``submit`` (a future per batch), at most ``depth`` in flight, and hand
    each batch's result to ``consume`` in order; count each on ``progress`` (as ``phase``).

    Raises ``failure(exc, batch)`` (chained to ``exc``) for the first batch that fails, and
    what ``consume`` raises as it is, once nothing submitted is still running. ``batches`` may
    be an iterator (made as it is consumed) where ``totals`` gives (batches, bytes) for the
    progress ahead. ``again(exc, batch)``, if given, is asked first for a failed batch's result
    another way (consumed in its place); what it raises is the batch's failure. A batch ``fence``
    says True for is submitted only once every batch before it has been consumed (what comes before
    it lands without sharing the reader with what comes after)."""
    if totals is None:
        batches = list(batches)
        totals = len(batches), sum(map(size, batches))
    progress.phase(phase, *totals)
    in_flight: collections.deque = collections.deque()   # (batch, its future), until its result is taken
    pending, held = iter(batches), None   # held: a fence waiting for the batches before it
    try:
        while True:
            while len(in_flight) < depth:  # the next ones read meanwhile
                batch, held = (held if held is not None else next(pending, None)), None
                if batch is None:
                    break
                if in_flight and fence is not None and fence(batch):
                    held = batch
                    break
                in_flight.append((batch, submit(batch)))
            if not in_flight:
                return
            batch, future = in_flight[0]
            try:
                try:
                    result = future.result()
                except Exception as exc:  # noqa: BLE001 - raised below unless ``again`` gets the result
                    if again is None:
                        raise
                    result = again(exc, batch)
            except Exception as exc:  # noqa: BLE001 - each caller says what a failed batch means
                raise failure(exc, batch) from exc
            in_flight.popleft()
            consume(batch, result)
            del result  # what consume did not keep is freed before the next batch is submitted
            progress.advance(size(batch))
    except BaseException:
        # Whatever ends the loop (a failure, KeyboardInterrupt while waiting), no read is left
        # running: a caller frees or reuses the buffers they read into (the read ring's slots).
        concurrent.futures.wait([f for _, f in in_flight])
        raise


def needed_regions(outputs: list, only: Callable | None = None) -> list[tuple[Output, tuple]]:
    """(output, region) for every distinct region this process needs; sets ``out.regions``.
    ``only(index, out)``: the regions of ``outputs[index]`` to keep (None: all)."""
    found = []
    for index, out in enumerate(outputs):
        if not isinstance(out, Output) or out.saved.stored is None:
            continue
        out.regions = output_regions(out)
        kept = None if only is None else set(only(index, out))
        found += [(out, region) for region in out.regions if kept is None or region in kept]
    return found


def read_pieces(out: Output, region, chunk_limit: int, part=None) -> list[tuple[Region, tuple]]:
    """The stored pieces filling ``region`` of the result ``out`` (or only its sub-region
    ``part``): (stored region, bounds in the region's buffer) pairs, each at most ``chunk_limit``
    bytes, cut from the leading axes -- or one per stored chunk where those are larger. Where the
    span read starts and ends on stored chunk bounds, each piece is whole stored chunks (a chunk
    is never decoded for two pieces, and a piece's CRC-32Cs can be checked in memory)."""
    saved = out.saved
    full = out.stored_bounds(region)
    span = full if part is None else out.stored_bounds(part)
    itemsize = np.dtype(out.dtype).itemsize
    pieces = []
    chunk = saved.stored.chunk_shape
    if math.prod(chunk) * itemsize > chunk_limit:
        # Stored chunks over the limit (other writers' checkpoints) are decoded whole whatever
        # is read of them: one piece per stored chunk, so each is decoded once, not per piece.
        for _, cell in stored_cells(saved.stored, span):
            bounds = tuple((max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(cell, span))
            local = tuple((a - lo, b - lo) for (a, b), (lo, _) in zip(bounds, full))
            pieces.append((Region(saved.stored, bounds, saved.keypath), local))
        return pieces
    whole = all(lo % c == 0 and (hi % c == 0 or hi == n) for (lo, hi), c, n in zip(span, chunk, saved.stored.shape))
    for cut in _cuts(tuple(hi - lo for lo, hi in span), itemsize, chunk_limit, chunk if whole else None):
        bounds = tuple((lo + a, lo + b) for (lo, _), (a, b) in zip(span, cut))
        local = tuple((a - lo, b - lo) for (a, b), (lo, _) in zip(bounds, full))
        pieces.append((Region(saved.stored, bounds, saved.keypath), local))
    return pieces


@functools.lru_cache(maxsize=1024)
def _cuts(shape: tuple, itemsize: int, chunk_limit: int, unit: tuple | None = None) -> tuple:
    """The bounds of the pieces of at most ``chunk_limit`` bytes a buffer of ``shape`` is read in,
    each a whole number of ``unit`` blocks (stored chunks; the last ones along an axis may be cut
    by its end) where given (cached: a model's regions have few shapes, and a job's plan cuts every
    region of it)."""
    unit = unit or (1,) * len(shape)
    blocks = tuple(-(-n // u) for n, u in zip(shape, unit))
    step = tuple(k * u for k, u in zip(storage_chunk_shape(blocks, itemsize * math.prod(unit), chunk_limit), unit))
    return tuple(tuple((s, min(s + k, n)) for s, k, n in zip(starts, step, shape))
                 for starts in itertools.product(*[range(0, n, s) for n, s in zip(shape, step)]))


def read_item(out: Output, region, chunk_limit: int) -> ReadItem:
    """The worker's view of one region of one result (:func:`read_pieces`), read for the first
    device holding it (host results: on the host)."""
    home = out.regions[region][0]
    return ReadItem(tuple(read_pieces(out, region, chunk_limit)), out.buffer_shape(region), np.dtype(out.dtype).name,
                    key_impl=out.saved.key_impl, on_host=out.where == HOST, device=None if home is None else home.id)


def read_regions(reader, wanted: list[tuple[Output, tuple]], chunk_limit: int, batch_limit: int,
                 progress: Progress, on_batch: Callable[[int], None] | None = None, check: Callable | None = None,
                 place: bool = False):
    """Fill ``out.buffers[region]`` for each (output, region) of ``wanted`` through ``reader``
    (host arrays, or arrays on a colocated CPU device), batches of at most ``batch_limit``
    bytes, two in flight; counted on ``progress`` as ``read``. ``on_batch(bytes read so far)``
    is called after each batch. ``check(out, region, array)``, if given, sees each region as it is
    read: one it says False to is left out (its buffer is not kept). With ``check``, a region that
    cannot be read is left out too, not the whole read failed: where a batch fails with a
    ``ChunkError``, its regions are read again one by one (:func:`each_alone`), and one whose own read
    fails with a ``ChunkError`` is shown to ``check`` with that error as its ``array``.

    ``place``: every device result is put on its devices (:func:`finish`) as soon as its last
    region is read -- the host-to-device transfers of one batch run while the next batch is
    read (JAX orders each device's transfers: one stream per device), and each batch's are
    awaited before another read is submitted, so the host holds at most two batches. Without it
    only ``whole`` results are placed early (the caller may still add to the others' buffers)."""
    reads = RegionReads(reader, wanted, chunk_limit, batch_limit, progress.path, on_batch, check, place)
    pipelined(reads.batches, reads.submit, reads.consume, reads.size, progress, "read", reads.failure,
              again=reads.again, fence=lambda batch: batch is reads.fence)


class RegionReads:
    """:func:`read_regions`' work, batch by batch (``batches``), and the calls :func:`pipelined` runs
    it with -- for a caller that runs these batches in a pipelined loop of its own, between other work
    (``scaleout``: between its rounds). Arguments as :func:`read_regions` (``display``: the checkpoint,
    in errors); ``apart``: the first that many of ``wanted`` are read in batches of their own, first
    (:attr:`fence`: the batch of the rest a ``pipelined`` loop submits only once they have landed)."""

    def __init__(self, reader, wanted: list, chunk_limit: int, batch_limit: int, display: str,
                 on_batch: Callable[[int], None] | None = None, check: Callable | None = None, place: bool = False,
                 apart: int = 0):
        self.reader, self.display, self.on_batch, self.check, self.place = reader, display, on_batch, check, place
        work = [(out, region, read_item(out, region, chunk_limit)) for out, region in wanted]
        # the first ``apart`` regions in small batches of their own, read before the rest (``fence``: the
        # first batch of the rest waits for them), each alongside the next
        first, rest = ([items for items, _ in pack(part, lambda w: w[2].nbytes, limit)]
                       for part, limit in ((work[:apart], max(1, batch_limit // 8)), (work[apart:], batch_limit)))
        self.batches = first + rest
        self.fence = rest[0] if first and rest else None
        self.done = 0   # bytes read so far

    def submit(self, batch) -> concurrent.futures.Future:
        return self.reader.read([item for _, _, item in batch])

    @staticmethod
    def size(batch) -> int:
        return sum(item.nbytes for _, _, item in batch)

    def consume(self, batch, arrays):
        placed = []
        for (out, region, item), array in zip(batch, arrays):
            self.done += item.nbytes
            if self.check is not None and (not self.check(out, region, array) or isinstance(array, ChunkError)):
                continue
            out.buffers[region] = array
            if out.whole or (self.place and out.where == DEVICE and len(out.buffers) == len(out.regions)):
                placed.append(finish(out))
        jax.block_until_ready(placed)  # their host buffers are free before the next read is submitted
        if self.on_batch is not None:
            self.on_batch(self.done)

    def failure(self, exc: BaseException, batch) -> WorkerError:
        return read_failure(exc, batch[0][2].keypath, self.display)

    def again(self, exc: BaseException, batch) -> list:
        """A failed batch read again region by region where ``check`` is given (:func:`each_alone`);
        else ``exc`` raised."""
        if self.check is None:
            raise exc
        return each_alone(self.reader, [item for _, _, item in batch], exc)


def each_alone(reader, items: list, exc: BaseException) -> list:
    """The result of a read of ``items`` that failed with ``exc``, each item read again alone: its
    array, or the ``ChunkError`` its own read failed with (the region cannot be read: a chunk lost or
    damaged). Raises ``exc`` if it is no ``ChunkError``, and what a read alone fails with otherwise
    (once every read alone has ended)."""
    if not isinstance(exc, ChunkError):
        raise exc
    futures = [reader.read([item]) for item in items]
    concurrent.futures.wait(futures)
    found = []
    for future in futures:
        error = future.exception()
        if error is not None and not isinstance(error, ChunkError):
            raise error
        found.append(error or future.result()[0])
    return found


def read_failure(exc: BaseException, keypath: str, display: str) -> WorkerError:
    """The WorkerError of this process's failed read (``keypath``: the batch's, unless the
    worker's error names its own)."""
    keypath = getattr(exc, "keypath", None) or keypath
    worker = jax.process_index()
    return WorkerError(f"worker {worker} failed reading {keypath} from {display}: "
                       f"{type(exc).__name__}: {brief_error(exc)}", worker=worker, keypath=keypath)


def read_outputs(reader, outputs: list, chunk_limit: int, batch_limit: int, progress: Progress, *,
                 only: Callable | None = None, check: Callable | None = None, place: bool = False):
    """Fill every output's ``buffers`` with every region this process holds (:func:`read_regions`;
    ``only``: as :func:`needed_regions`; ``check``, ``place``: as :func:`read_regions`)."""
    read_regions(reader, needed_regions(outputs, only), chunk_limit, batch_limit, progress, check=check, place=place)


def stored_cells(stored, bounds):
    """(grid index, bounds) of every chunk of the stored array ``stored`` overlapping ``bounds``
    (whole chunks)."""
    axes = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(bounds, stored.chunk_shape)]
    for grid in itertools.product(*axes):
        yield grid, tuple((g * c, min((g + 1) * c, n)) for g, c, n in zip(grid, stored.chunk_shape, stored.shape))


def verify_outputs(reader, outputs: list, batch_limit: int, progress: Progress, *, compare: bool = True,
                   only: Callable | None = None):
    """:func:`verify_stored` for every region of the outputs that this process holds (``only``: as
    :func:`needed_regions`)."""
    verify_stored(reader, [(out, out.stored_bounds(region)) for out, region in needed_regions(outputs, only)],
                  batch_limit, progress, compare=compare)


def verify_stored(reader, wanted: list[tuple[Output, tuple]], batch_limit: int, progress: Progress, *,
                  compare: bool = True, on_batch: Callable[[int], None] | None = None,
                  share: tuple[int, int] = (0, 1)):
    """Check every stored chunk overlapping each (output, stored bounds) of ``wanted`` against
    the CRC-32C saved in the manifest; with ``share=(k, n)``, only the k-th of n shares of those
    chunks (:func:`share_of`: n processes given the same ``wanted`` check each chunk once).

    Each chunk is read whole by ``reader.checksums``, at most ``batch_limit`` bytes a call and
    two calls at a time, so host memory stays within the budget (or two chunks, for chunks
    over half of it) however large the leaves. Raises CorruptCheckpointError naming every bad
    chunk's key path. ``compare=False`` (a checkpoint saved without checksums): only read every
    chunk, which still finds what cannot be read or decoded. Counted on ``progress`` as ``verify``;
    ``on_batch(bytes checked so far)`` is called after each batch."""
    display = progress.path
    count = covered = 0   # chunks, and their bytes, counting a chunk of several wanted regions in each
    for out, wanted_bounds in wanted:
        if compare and out.saved.checksums is None:
            raise CheckpointError(f"{display} was saved without checksums (Options(checksums=True)): "
                                  f"cannot verify {out.saved.keypath}")
        stored = out.saved.stored
        count += math.prod(-(-hi // c) - lo // c for (lo, hi), c in zip(wanted_bounds, stored.chunk_shape))
        covered += np.dtype(numpy_dtype(stored.dtype)).itemsize * math.prod(
            min(-(-hi // c) * c, n) - lo // c * c
            for (lo, hi), c, n in zip(wanted_bounds, stored.chunk_shape, stored.shape))
    nbytes = lambda w: w[2].nbytes  # noqa: E731
    work = _shares(_cells(wanted), nbytes, *share)
    if count <= EAGER_CHUNKS:
        batches, totals = [batch for batch, _ in pack(work, nbytes, batch_limit)], None
    else:  # made as they are read, in budgeted batches (progress: estimated)
        batches = (batch for batch, _ in packs(work, nbytes, batch_limit))
        totals = -(-covered // share[1] // max(1, batch_limit)), covered // share[1]
    bad = []

    done = 0

    def consume(batch, sums):
        nonlocal done
        for (grid, out, region), crc in zip(batch, sums):
            expected = out.saved.checksums.get(tuple(grid)) if compare else crc
            if expected != crc:
                bad.append((region.keypath, grid, region.bounds, expected, crc))
            done += region.nbytes
        if on_batch is not None:
            on_batch(done)

    def failure(exc, batch):
        keypath = getattr(exc, "keypath", None) or batch[0][2].keypath
        return CorruptCheckpointError(f"cannot read {keypath} from {display} to verify it: "
                                      f"{type(exc).__name__}: {brief_error(exc)}", keypath=keypath)

    pipelined(batches, lambda batch: reader.checksums([region for _, _, region in batch]), consume,
              lambda batch: sum(region.nbytes for _, _, region in batch), progress, "verify", failure, totals)
    if bad:
        raise mismatches(display, bad)


def mismatches(display: str, bad: list[tuple]) -> CorruptCheckpointError:
    """The error for chunks whose bytes do not match their saved checksums: ``bad`` holds
    (key path, grid index, stored region, saved CRC-32C or None, read CRC-32C) each."""
    lines = "\n".join(f"  {k} chunk {list(g)} (region {[list(b) for b in r]}): saved crc32c "
                      f"{'none' if e is None else f'{e:08x}'}, read {c:08x}" for k, g, r, e, c in bad)
    return CorruptCheckpointError(f"{display}: {len(bad)} chunk(s) do not match their checksums:\n{lines}",
                                  keypath=bad[0][0], chunk=bad[0][1], chunks=bad)


def _cells(wanted: list):
    """(grid index, output, stored region) of every stored chunk overlapping each (output,
    stored bounds) of ``wanted``, each chunk once (where its first wanted region is), made lazily."""
    earlier = collections.defaultdict(list)   # key path -> the chunk grid ranges of its earlier wanted bounds
    for out, wanted_bounds in wanted:
        stored, keypath = out.saved.stored, out.saved.keypath
        before = list(earlier[keypath])
        earlier[keypath].append([range(lo // c, -(-hi // c)) for (lo, hi), c in zip(wanted_bounds, stored.chunk_shape)])
        for grid, bounds in stored_cells(stored, wanted_bounds):
            if not any(all(g in axis for g, axis in zip(grid, axes)) for axes in before):
                yield grid, out, Region(stored, bounds, keypath)


def share_of(work: list, nbytes: Callable, index: int, count: int) -> list:
    """The ``index``-th of ``count`` shares of ``work``: in order, each item goes to the share
    holding the fewest bytes so far (the lowest index on ties), so the shares are even and every
    process given the same ``work`` computes the same ones."""
    return work if count == 1 else list(_shares(work, nbytes, index, count))


def _shares(work, nbytes: Callable, index: int, count: int):
    """:func:`share_of`, lazily."""
    held = [0] * count
    for item in work:
        least = held.index(min(held))
        held[least] += nbytes(item)
        if least == index:
            yield item
