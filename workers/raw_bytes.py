"""Reading regions of arrays stored as plain bytes at an offset of a key (``ArraySpec.driver == "raw"``).

A safetensors file holds each tensor C order, little-endian, at a known offset. A region of such
a tensor is a set of contiguous byte runs (one per index of the axes before the last partial
one), so reading it is a handful of byte-range reads: each process fetches only the bytes of the
regions it holds. On an object store these are kvstore reads, those of one call in one
``ts.Batch`` (the store may coalesce neighbouring ranges). From a local folder they are
``os.preadv`` straight into place, on a descriptor advised ``POSIX_FADV_RANDOM``: the kernel's
readahead would read the gaps between a process's runs too (the column blocks other processes
hold, a tensor's worth per process), and only the ranges read are dropped from the page cache
afterwards, not the pages other processes of the host read meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import os
import sys
from typing import Iterator, Sequence

import numpy as np
import tensorstore as ts

from .contract import ChunkError, Region, numpy_dtype

PART_BYTES = 2 << 20   # the most one kvstore read fetches (measured: 16 MiB reads, one at a time, ran at 0.5 GB/s)
READ_THREADS = 8       # local reads of one file in flight at once


def byte_runs(shape: tuple[int, ...], itemsize: int, bounds: tuple[tuple[int, int], ...]) -> Iterator[tuple[int, int]]:
    """(start, length) of each contiguous run of bytes, relative to the array's first byte, that
    the region ``bounds`` of a C-order array of ``shape`` covers, in the region's own C order
    (so the runs, concatenated, are the region's bytes)."""
    if any(hi <= lo for lo, hi in bounds):
        return
    # Trailing axes the region covers whole join the run; the axis before them is the run's.
    split = len(shape)
    while split > 0 and bounds[split - 1] == (0, shape[split - 1]):
        split -= 1
    if split == 0:
        yield 0, math.prod(shape) * itemsize
        return
    strides = [math.prod(shape[axis + 1:]) * itemsize for axis in range(len(shape))]
    lo, hi = bounds[split - 1]
    length = (hi - lo) * strides[split - 1]
    for index in itertools.product(*[range(a, b) for a, b in bounds[:split - 1]]):
        yield sum(i * s for i, s in zip(index, strides)) + lo * strides[split - 1], length


def read_regions(session, regions: Sequence[Region], out: Sequence[np.ndarray | None]) -> list[np.ndarray]:
    """Read each raw region (into ``out[i]`` where given, else a new array of the region's
    logical dtype) with byte-range reads through ``session`` (a ``session.Session``: its
    kvstore, context and ``read_window``; for a local folder, its ``raw_folder`` and whether to
    ``keep_page_cache``). Raises ChunkError naming the key path of the first
    region that fails (a key that is missing or shorter than the region's bytes).

    The byte runs of all the regions are sorted, and runs that continue each other (the two
    column halves of a row, held by two devices) are fetched by one read of at most
    :data:`PART_BYTES`: never a byte more than the regions hold, in few requests. A kvstore read
    returns a new ``bytes``, copied into place: reads go out in waves of at most an eighth of the
    read window, so these copies add little to the memory the reads hold."""
    targets, pieces = [], []   # pieces: (key, start in the key, length, region, destination bytes, start there)
    for region, dst in zip(regions, out):
        dtype = numpy_dtype(region.array.dtype)
        target = dst if dst is not None and dst.flags.c_contiguous else np.empty(region.shape, dtype)
        targets.append(target)
        flat = target.reshape(-1).view(np.uint8) if target.size else np.empty(0, np.uint8)
        at = 0
        for start, length in byte_runs(region.array.shape, dtype.itemsize, region.bounds):
            for part in range(0, length, PART_BYTES):
                size = min(PART_BYTES, length - part)
                pieces.append((region.array.name, region.array.offset + start + part, size, region, flat, at + part))
            at += length
    reads: list[list] = []   # [key, start, stop, [(region, destination bytes, start there, start in the read, length)]]
    for key, begin, length, region, flat, at in sorted(pieces, key=lambda p: (p[0], p[1])):
        last = reads[-1] if reads else None
        if last is None or last[0] != key or last[2] != begin or last[2] - last[1] + length > PART_BYTES:
            last = [key, begin, begin, []]
            reads.append(last)
        last[3].append((region, flat, at, begin - last[1], length))
        last[2] = begin + length
    if session.raw_folder is not None:
        _read_files(session.raw_folder, reads, drop=not session.keep_page_cache)
        return _finish(targets, out)
    kv = session.open_kvstore().result()
    wave_limit = max(session.read_window // 8, PART_BYTES)
    wave, size = [], 0
    for read in reads:
        wave.append(read)
        size += read[2] - read[1]
        if size >= wave_limit:
            _read_wave(kv, wave)
            wave, size = [], 0
    _read_wave(kv, wave)
    return _finish(targets, out)


def _finish(targets: list[np.ndarray], out: Sequence[np.ndarray | None]) -> list[np.ndarray]:
    """The regions read into ``targets`` in native byte order, copied into ``out`` where given."""
    results = []
    for target, dst in zip(targets, out):
        if sys.byteorder != "little" and target.dtype.itemsize > 1:
            target.byteswap(inplace=True)
        if dst is not None and dst is not target:
            np.copyto(dst, target)
        results.append(target if dst is None else dst)
    return results


def _read_wave(kv, wave: list):
    """Fetch the reads of ``wave`` (one ``ts.Batch``) and copy each one's bytes into place."""
    batch = ts.Batch()
    futures = [kv.read(key, byte_range=slice(begin, stop), batch=batch) for key, begin, stop, _ in wave]
    batch.submit()
    for future, (key, begin, stop, into) in zip(futures, wave):
        region = into[0][0]
        try:
            result = future.result()
        except Exception as exc:  # noqa: BLE001 - OUT_OF_RANGE, the store's failures: named below
            raise ChunkError(region.keypath, region.bounds, exc) from exc
        if result.state != "value" or len(result.value) != stop - begin:
            raise ChunkError(region.keypath, region.bounds, EOFError(f"{key} holds fewer bytes than its header says"))
        data = np.frombuffer(result.value, np.uint8)
        for _, flat, at, offset, length in into:
            flat[at:at + length] = data[offset:offset + length]


def _read_files(folder: str, reads: list, drop: bool):
    """Each read of ``reads`` from its file of the local ``folder``, with ``os.preadv`` into its
    destinations (a few threads at a time: the disk serves several requests at once); with
    ``drop``, then drop the ranges read from the page cache."""
    by_key: dict[str, list] = {}
    for read in reads:
        by_key.setdefault(read[0], []).append(read)
    for key, group in by_key.items():
        first = group[0][3][0][0]
        try:
            fd = os.open(os.path.join(folder, key), os.O_RDONLY)
        except OSError as exc:
            raise ChunkError(first.keypath, first.bounds, exc) from exc
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: only the ranges asked for
            with concurrent.futures.ThreadPoolExecutor(min(READ_THREADS, len(group))) as pool:
                for _ in pool.map(lambda read: _pread(fd, read), group):
                    pass
            if drop:
                for _, begin, stop, _ in group:
                    os.posix_fadvise(fd, begin, stop - begin, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _pread(fd: int, read: list):
    """One read ([key, start, stop, destinations]) from the open file ``fd``, into place."""
    key, position, _, into = read
    for region, flat, at, _, length in into:
        view = memoryview(flat)[at:at + length]
        while len(view):
            try:
                n = os.preadv(fd, [view], position)
            except OSError as exc:
                raise ChunkError(region.keypath, region.bounds, exc) from exc
            if n == 0:
                raise ChunkError(region.keypath, region.bounds, EOFError(f"{key} holds fewer bytes than its header says"))
            view, position = view[n:], position + n
