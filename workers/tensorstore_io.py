"""TensorStore reads and writes of array regions, for one save or restore at a time."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import posixpath
import threading
from typing import Any, Sequence

import numpy as np
import tensorstore as ts

from . import deadlines, hedged, packs, raw_bytes
from .runs import runs
from .contract import RAW, ArraySpec, ChunkError, IOSettings, ReadItem, Region, numpy_dtype
from .layouts import NODE_CACHE, layout_kvstore, storage_of
from .page_cache import release_page_cache


@functools.cache
def _memory_context() -> ts.Context:
    # memory:// data lives in a context resource: every save and restore of this process must
    # share one context to see the same data (it is process-wide by nature, like the data).
    return ts.Context()


def shared_context(kvstore: dict) -> ts.Context | None:
    """The process-wide context for kvstores whose data lives in a context (``memory``):
    writers and readers must share it to see each other's data. None for the rest."""
    return _memory_context() if storage_of(kvstore).get("driver") == "memory" else None


def aligned_empty(shape, dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialized array whose data starts on an ``alignment``-byte boundary (which
    ``jax.device_put`` on CPU adopts without a copy)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


class Session:
    """Open arrays for one save or restore, under a TensorStore context of its own.

    ``kvstore`` is the TensorStore kvstore spec of the arrays (``layout_kvstore`` of the
    checkpoint's arrays folder); ``settings`` says how to move bytes; ``context`` is a shared
    ``ts.Context`` (e.g. the memory kvstore's) or ``None`` for a fresh one that goes away with
    the session (no process-global cache outlives an operation). ``cache_bytes``: decoded chunks
    the session may keep (for reads that take a stored chunk in several pieces; default none).
    """

    def __init__(self, kvstore: dict, settings: IOSettings, context: ts.Context | None = None,
                 cache_bytes: int = 0):
        self.kvstore = kvstore
        self.fsync = settings.fsync
        self.checksums = settings.checksums  # write_regions returns each region's crc32c
        self.read_window = settings.read_window
        self.compression = settings.compression  # of the chunks this session writes
        storage = storage_of(kvstore)
        if storage.get("driver") in ("gcs", "s3"):  # before this process's first HTTP request, if it is
            deadlines.configure(settings.request_timeout, settings.min_request_rate)
        # Local files only: the directory whose page cache write_regions / read_regions drop.
        keep = settings.keep_page_cache
        self.directory = storage.get("path") if storage.get("driver") == "file" and not keep else None
        # Raw arrays of a local folder (a plain file kvstore) are read with os.pread (raw_bytes).
        self.raw_folder = kvstore.get("path") if kvstore.get("driver") == "file" else None
        self.keep_page_cache = keep
        self.dropped: dict[str, tuple] = {}   # file -> (inode, size, mtime) when its page cache was dropped
        if context is None:
            context = shared_context(kvstore)
        # OCDBT commits once per transaction: write_regions makes each call one transaction, so
        # a batch becomes a few data files (IOSettings.data_file_bytes), not a file per chunk.
        self.transactional = kvstore.get("driver") == "ocdbt"
        # A shared context (the memory kvstore's) is a parent: this session still gets OCDBT
        # caches of its own, which cannot be stale from an earlier save to the same place.
        self.context = ts.Context(NODE_CACHE, parent=context) if context is not None else ts.Context({
            "cache_pool": {"total_bytes_limit": cache_bytes}, **NODE_CACHE,
            "file_io_concurrency": {"limit": settings.io_concurrency},
            "data_copy_concurrency": {"limit": settings.copy_concurrency},
            "file_io_sync": settings.fsync,
        })
        # The memory kvstore keeps written values by reference: they must not alias the
        # caller's buffers (reused staging), so TensorStore copies them there.
        self.reference_sources = storage.get("driver") != "memory"
        self._open: dict[str, Any] = {}
        self._kvstore = None  # future of the opened kvstore, for raw byte-range reads
        # Object stores: reads that lag their peers are read again in a session of its own (workers.hedged).
        self.hedger = hedged.Hedger(
            hedged.HedgePolicy(settings.hedge_after, settings.min_request_rate),
            lambda: Session(kvstore, dataclasses.replace(settings, hedge_reads=False), context, cache_bytes),
            self.read_window) if settings.hedge_reads and storage.get("driver") in ("gcs", "s3") else None
        self._lock = threading.Lock()

    @classmethod
    def writer(cls, arrays: dict, writer: str, settings: IOSettings, context: ts.Context | None = None
               ) -> "Session":
        """The session of one writer (a process, a colocated host) of a save whose arrays
        folder is ``arrays``: with the OCDBT layout, a database of its own (``layout_kvstore``)."""
        kvstore = layout_kvstore(arrays, settings.layout, writer=writer, data_file_bytes=settings.data_file_bytes)
        return cls(kvstore, settings, context)

    def open_arrays(self, specs: Sequence[ArraySpec], *, write: bool) -> dict[str, Any]:
        """{name: future of the opened TensorStore} for ``specs``: each array is opened once per
        session (shared by threads), and those not open yet are opened all at once. Packed
        leaves open their pack (named alike). ``write``: open to write chunks, with the metadata
        the session writes (nothing is read or written for it: :func:`workers.layouts.finish_arrays`
        stores it when the save commits); else read the stored metadata."""
        specs = [spec.stored for spec in specs]
        with self._lock:
            for spec in specs:
                if (spec.name, spec.layers) not in self._open:
                    try:
                        future = ts.open(self._spec(spec, write), assume_metadata=write, open=True, context=self.context)
                        if self.hedger is not None and not write:
                            future = self.hedger.opening(future, spec)
                    except Exception as exc:  # noqa: BLE001 - raised by .result(), named by the caller
                        future = concurrent.futures.Future()
                        future.set_exception(exc)
                    self._open[spec.name, spec.layers] = future
            return {spec.name: self._open[spec.name, spec.layers] for spec in specs}

    def open_kvstore(self):
        """Future of the session's kvstore itself, opened once (reads of ``raw`` arrays)."""
        with self._lock:
            if self._kvstore is None:
                self._kvstore = ts.KvStore.open(self.kvstore, context=self.context)
            return self._kvstore

    def _spec(self, spec: ArraySpec, write: bool) -> dict:
        """The TensorStore spec that writes or reads the array ``spec``."""
        tspec = spec.tensorstore_spec(self.kvstore)
        if write:
            tspec["metadata"] = spec.zarr_metadata(self.compression)
            # Every chunk gets a file, all-zero ones too, so a missing file means lost data.
            tspec["store_data_equal_to_fill_value"] = True
        elif not spec.missing_is_fill:
            tspec["fill_missing_data_reads"] = False  # a lost chunk file is an error, not zeros
        if spec.layers and not write:
            return _stacked(tspec, spec, self.kvstore)
        return tspec

    def close(self):
        with self._lock:
            self._open.clear()
            self._kvstore = None
        if self.hedger is not None:
            self.hedger.close()


def _stacked(tspec: dict, spec: ArraySpec, kvstore: dict) -> dict:
    """The read spec of an incremental step's array (``ArraySpec.layers``): a ``stack`` of the
    array itself and, over it (later layers win), each chunk another step stores, read there."""
    base = kvstore["base"] if kvstore.get("driver") == "ocdbt" else kvstore
    layers = [{**tspec, "transform": {"input_inclusive_min": [0] * len(spec.shape),
                                      "input_exclusive_max": list(spec.shape)}}]
    for home, layout, name, boxes in spec.layers:
        there = layout_kvstore({**base, "path": posixpath.normpath(base.get("path", "") + home) + "/"}, layout)
        for box in boxes:
            layers.append({**tspec, "kvstore": {**there, "path": there.get("path", "") + name + "/"},
                           "transform": {"input_inclusive_min": [lo for lo, _ in box],
                                         "input_exclusive_max": [hi for _, hi in box]}})
    return {"driver": "stack", "dtype": spec.storage_dtype, "layers": layers}


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
