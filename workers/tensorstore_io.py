"""TensorStore reads and writes of array regions, for one save or restore at a time."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorstore as ts

from . import hedged, packs, raw_bytes
from .runs import runs
from .contract import RAW, ArraySpec, ChunkError, ReadItem, Region, numpy_dtype
from .page_cache import release_page_cache
from .session import Session, aligned_empty


def _ended(futures):
    """Wait until every future has ended, raising nothing (the caller raises what it has)."""
    for future in futures:
        future.exception()


def _wait_all(futures, regions):
    """Wait for every future (even after one fails: its buffer may still be read), then
    raise the first failure as a ChunkError."""
    first = None
    results = []
    for future, region in zip(futures, regions):
        try:
            results.append(future.result())
        except Exception as exc:  # noqa: BLE001 - reported with its key path below
            results.append(None)
            if first is None:
                first = ChunkError(region.keypath, region.bounds, exc)
                first.__cause__ = exc
    if first is not None:
        raise first
    return results


def crc32c(buffer: np.ndarray) -> int:
    """CRC-32C of an array's bytes (in memory order; C-contiguous arrays)."""
    import google_crc32c

    view = np.ascontiguousarray(buffer).reshape(-1).view(np.uint8)
    view.flags.writeable = False  # google_crc32c takes read-only buffers only
    return google_crc32c.value(view)


def write_regions(session: Session, regions: Sequence[Region], buffers: Sequence[np.ndarray],
                  staging: bool = False) -> list[int | None]:
    """Write each host buffer into its region; returns once all are durable, with each
    region's CRC-32C when the session computes checksums (else None per region).

    The buffers are referenced, not copied: the caller keeps them unchanged until this returns.
    A transactional session (OCDBT) writes them in one transaction: one commit per call.
    Packed leaves go into their pack, which is written whole (``packs.assemble``: with
    ``staging``, the buffers are slices of the caller's staging memory and a pack whose leaves
    lie at their offsets in it is written from there, the bytes between them zeroed; every
    leaf of a pack must be in the call). Regions that continue each other in their array and
    in memory are written with one call (``runs.runs``).
    """
    written, data = runs(*packs.assemble(regions, buffers, staging))
    txn = ts.Transaction() if session.transactional else None
    futures, commit = [], None  # both done before this returns, whatever is raised
    stores = session.open_arrays([r.array for r in written], write=True)
    try:
        for region, buf in zip(written, data):
            try:
                store = stores[region.array.name].result()
                if txn is not None:
                    store = store.with_transaction(txn)
                stored = numpy_dtype(region.array.storage_dtype)
                view = buf.view(stored) if buf.dtype != stored else buf
                write = store[region.index].write(view, can_reference_source_data_indefinitely=session.reference_sources)
                futures.append(write.copy if txn else write.commit)
            except Exception as exc:  # noqa: BLE001
                raise ChunkError(region.keypath, region.bounds, exc) from exc
        sums = [crc32c(b) if session.checksums else None for b in buffers]  # overlaps the writes
        if txn is not None:
            # The commit waits for the writes (it would leave out one that failed: checked below).
            commit = txn.commit_async()
            try:
                commit.result()
            except Exception:
                _wait_all(futures, written)  # a failed write names its leaf; else the commit's failure
                raise                        # names the batch's key paths (the caller's)
    except BaseException:  # KeyboardInterrupt too: TensorStore must be done with the buffers
        _ended(futures if commit is None else [*futures, commit])  # before the caller reuses them
        raise
    _wait_all(futures, written)
    if session.fsync:  # clean pages only: unsynced ones would stay anyway
        release_page_cache(session, written, written=True)
    return sums


def read_regions(session: Session, regions: Sequence[Region], out: Sequence[np.ndarray | None] | None = None
                 ) -> list[np.ndarray]:
    """Read each region (in parallel) as an array of the region's logical dtype.

    ``out[i]``, when given, is filled in place: TensorStore decodes straight into it, so the
    bytes are touched once and no temporary is allocated. Otherwise a new array is returned.
    Packed leaves are read from their pack, one read per run of nearby leaves (``packs.spans``);
    ``raw`` arrays as byte ranges of their key (``raw_bytes``)."""
    out = list(out) if out is not None else [None] * len(regions)
    raw = [i for i, r in enumerate(regions) if r.array.driver == RAW]
    if raw:
        return _read_raw(session, regions, out, raw)
    spans = packs.spans(regions)
    futures, waited = [], []
    stores = session.open_arrays([r.array for r in regions], write=False)
    hedger = session.hedger  # hedged reads go into TensorStore's arrays, never into ``out`` (workers.hedged)
    region = None
    try:
        for pack, start, stop, keypath in spans:
            region = Region(pack, ((start, stop),), keypath)
            futures.append(stores[pack.name].result()[start:stop].read())
            waited.append(region)
        for region, dst in zip(regions, out):
            if region.array.packed is not None:
                continue
            source = stores[region.array.name].result()[region.index]
            if dst is None or hedger is not None:
                futures.append(source.read())
            else:
                stored = numpy_dtype(region.array.storage_dtype)
                view = dst.view(stored) if dst.dtype != stored else dst
                futures.append(ts.array(view, copy=False, write=True).write(source).commit)
            waited.append(region)
    except Exception as exc:  # noqa: BLE001
        _wait_all(futures, waited)
        raise ChunkError(region.keypath, region.bounds, exc) from exc
    try:
        arrays = _wait_all(futures, waited) if hedger is None else hedged.wait_regions(hedger, futures, waited)
    except ChunkError:
        for span, future in zip(spans, futures):
            if not future.cancelled() and future.exception() is not None:
                _blame_leaf(stores, regions, span)
        raise
    release_page_cache(session, waited, written=False)
    read = {}
    for (pack, start, _, _), data in zip(spans, arrays):
        read.setdefault(pack.name, []).append((start, data))
    results = []
    plain = iter(arrays[len(spans):])
    for region, dst in zip(regions, out):
        arr = packs.extract(region, read) if region.array.packed is not None else next(plain)
        if dst is not None:
            if region.array.packed is not None or hedger is not None:
                np.copyto(dst.view(arr.dtype) if dst.dtype != arr.dtype else dst, arr)
            results.append(dst)
            continue
        if region.array.packed is not None:
            arr = arr.copy()  # not a view holding the whole span
        dtype = numpy_dtype(region.array.dtype)
        results.append(arr if arr.dtype == dtype else arr.view(dtype))
    return results


def _read_raw(session: Session, regions: Sequence[Region], out: list, raw: list[int]) -> list[np.ndarray]:
    """:func:`read_regions` where the regions ``raw`` (indices) are of raw arrays."""
    results: list = [None] * len(regions)
    rest = sorted(set(range(len(regions))) - set(raw))
    for i, array in zip(raw, raw_bytes.read_regions(session, [regions[i] for i in raw], [out[i] for i in raw])):
        results[i] = array
    if rest:
        for i, array in zip(rest, read_regions(session, [regions[i] for i in rest], [out[i] for i in rest])):
            results[i] = array
    return results  # raw_bytes drops the page cache of the ranges it read: only those


def _blame_leaf(stores: dict, regions: Sequence[Region], span: tuple[ArraySpec, int, int, str]):
    """``span`` (``packs.spans``) failed to read: read the leaves of ``regions`` in it one by
    one and raise the ChunkError of the first that fails, naming that leaf; returns if each
    reads alone (the span's failure then names its first leaf)."""
    pack, start, stop, _ = span
    for region in regions:
        if region.array.packed is None or region.array.packed[0].name != pack.name:
            continue
        offset = region.array.packed[1]
        if start <= offset < stop:
            try:
                stores[pack.name].result()[offset:offset + region.array.nbytes].read().result()
            except Exception as exc:  # noqa: BLE001 - this leaf's bytes are what failed
                raise ChunkError(region.keypath, region.bounds, exc) from exc


def read_items(session: Session, items: Sequence[ReadItem], out: Sequence[np.ndarray] | None = None
               ) -> list[np.ndarray]:
    """Read each item into a host buffer of its shape and dtype (``out[i]`` if given, else a new
    64-byte aligned one, which ``jax.device_put`` adopts on CPU) and return the buffers.

    Pieces are read in groups of at most ``session.read_window`` stored bytes, so TensorStore's
    temporary memory stays bounded however large an item is; where the item's dtype differs from
    the stored one (``cast=True``) each group is read as stored and converted into the buffer.
    Every stored array is opened, and checked against its ArraySpec, before any buffer is made
    (:func:`_check_opened`)."""
    _check_opened(session, [region for item in items for region, _ in item.pieces])
    buffers = list(out) if out is not None else [aligned_empty(item.shape, numpy_dtype(item.dtype)) for item in items]
    group: list = []   # (region, destination view, whether it needs converting)
    size = 0
    for item, buf in zip(items, buffers):
        convert = item.dtype != item.stored_dtype
        for region, local in item.pieces:
            if group and size + region.nbytes > session.read_window:
                _read_group(session, group)
                group, size = [], 0
            view = buf[tuple(slice(lo, hi) for lo, hi in local) + (Ellipsis,)]  # ...: a view even when 0-d
            group.append((region, view, convert))
            size += region.nbytes
    if group:
        _read_group(session, group)
    return buffers


def _check_opened(session: Session, regions: Sequence[Region]):
    """Open the stored arrays of ``regions`` and raise ChunkError (naming a key path that reads
    it) for one that cannot be opened or whose stored shape or dtype is not its ArraySpec's:
    a reader sizes its buffers from the spec, so the stored metadata must agree first. Raw
    arrays have no metadata of their own (their file's header was checked when it was opened)."""
    first = {region.array.stored.name: region for region in reversed(regions) if region.array.driver != RAW}
    stores = session.open_arrays([region.array for region in first.values()], write=False)
    for name, region in first.items():
        try:
            store = stores[name].result()
        except Exception as exc:  # noqa: BLE001 - TensorStore's error kinds, named by the key path
            raise ChunkError(region.keypath, region.bounds, exc) from exc
        spec = region.array.stored
        if tuple(store.shape) != spec.shape or store.dtype.name != spec.storage_dtype:
            found = ValueError(f"stored array {name} is {list(store.shape)} {store.dtype.name}, "
                               f"not {list(spec.shape)} {spec.storage_dtype}")
            raise ChunkError(region.keypath, region.bounds, found)


def _read_group(session: Session, group: list):
    regions = [region for region, _, _ in group]
    read = read_regions(session, regions, [None if convert else view for _, view, convert in group])
    for (_, view, convert), piece in zip(group, read):
        if convert:
            np.copyto(view, piece, casting="unsafe")


def checksum_regions(session: Session, regions: Sequence[Region]) -> list[int]:
    """Read each region (whole stored chunks, for ``restore(verify=True)``) and return the
    CRC-32C of its bytes as stored."""
    buffers = [aligned_empty(r.shape, numpy_dtype(r.array.dtype)) for r in regions]
    read_regions(session, regions, buffers)
    return [crc32c(b) for b in buffers]
