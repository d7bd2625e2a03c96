"""A TensorStore session: the context, kvstore and open arrays one save or restore of one worker
reads and writes through (``tensorstore_io`` does the reads and writes), and the host buffers
TensorStore fills (:func:`aligned_empty`)."""

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

from . import deadlines, hedged
from .contract import ArraySpec, IOSettings
from .layouts import NODE_CACHE, layout_kvstore, storage_of


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
