"""Packs: many small leaves stored as byte ranges of one 1-D ``uint8`` array.

A checkpoint of thousands of small leaves would otherwise be thousands of arrays, each with
its metadata to write and open and its own chunk to read. A packed leaf is an
:class:`~workers.ArraySpec` with ``packed=(pack, offset)``: its bytes (C order, stored dtype)
are ``pack[offset:offset + nbytes]``. Everything above the workers handles it as a one-chunk
array of the leaf's shape; this module is how workers turn that into pack IO:

* :func:`assemble` (writes): the packed leaves of a write become one buffer per pack, written
  whole -- a pack is always written in one call, so no chunk of it is ever read back and merged.
* :func:`spans` / :func:`extract` (reads): the byte spans of the packs a read needs, one read
  per run of nearby leaves, and each leaf's region taken from them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .contract import ArraySpec, Region, numpy_dtype
from .runs import address, root

PACK_CHUNK_BYTES = 1 << 20   # chunk size of pack arrays: the most a read of one small leaf decodes
PACK_ALIGN = 64               # leaves start at multiples of this (the staging ring's alignment too)


def pack_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """(offset of each leaf, pack bytes) of leaves of ``sizes`` bytes packed in this order: each
    at the first ``PACK_ALIGN`` multiple after the previous one, no gap after the last."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(-(-end // PACK_ALIGN) * PACK_ALIGN)
        end = offsets[-1] + n
    return offsets, end


def pack_spec(name: str, nbytes: int) -> ArraySpec:
    """The 1-D ``uint8`` array ``name`` of ``nbytes`` that leaves are packed into, in chunks of
    ``PACK_CHUNK_BYTES``."""
    return ArraySpec(name, (nbytes,), "uint8", (min(nbytes, PACK_CHUNK_BYTES),))


def packed_leaf(pack: ArraySpec, offset: int, shape: Sequence[int], dtype: str) -> ArraySpec:
    """The ArraySpec of a leaf of ``shape`` / ``dtype`` (a numpy or ml_dtypes name) stored at
    byte ``offset`` of ``pack``. ValueError if it does not fit or is not aligned."""
    leaf = ArraySpec(pack.name, tuple(shape), dtype, tuple(shape), packed=(pack, offset))
    if offset < 0 or offset % PACK_ALIGN or offset + leaf.nbytes > pack.shape[0]:
        raise ValueError(f"a leaf of {leaf.nbytes} bytes at offset {offset} does not fit in pack {pack.name!r} "
                         f"of {pack.shape[0]} bytes at a multiple of {PACK_ALIGN}")
    return leaf


def _as_bytes(buffer: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(buffer).reshape(-1).view(np.uint8)


def assemble(regions: Sequence[Region], buffers: Sequence[np.ndarray], staging: bool = False
             ) -> tuple[list[Region], list[np.ndarray]]:
    """``regions`` / ``buffers`` with every packed leaf replaced by its pack: one region
    covering the whole pack and one buffer holding its leaves at their offsets (zeros between
    them). Unpacked regions are passed through in order, packs follow.

    ``staging=True``: the buffers are slices of the caller's staging memory, which this may
    write between them. Where a pack's leaves already sit at their pack offsets in one such
    buffer (a save's batch lays a pack's leaves out in order, 64-byte aligned, as
    :func:`pack_offsets` does), the pack is that memory with its gaps zeroed: no copy, no memory
    beyond the batch's. Otherwise (and always without ``staging``) the leaves are copied into a
    new buffer.

    The pack region is named by the key path of its first leaf. Raises ValueError naming the
    key path of a packed region that is not its whole leaf, and the pack, if its leaves are not
    all in the call, once each (:func:`pack_offsets` says where they are: a gap means one
    missing, and the pack would be written with zeros in its place)."""
    plain_regions, plain_buffers = [], []
    packs: dict[str, tuple[ArraySpec, list]] = {}
    for region, buffer in zip(regions, buffers):
        if region.array.packed is None:
            plain_regions.append(region)
            plain_buffers.append(buffer)
            continue
        pack, offset = region.array.packed
        if region.bounds != tuple((0, n) for n in region.array.shape):
            raise ValueError(f"{region.keypath}: a packed leaf is written whole, not region {list(region.bounds)}")
        packs.setdefault(pack.name, (pack, []))[1].append((offset, region.array.nbytes, region.keypath, buffer))
    for pack, members in packs.values():
        members.sort(key=lambda m: m[0])
        if pack_offsets([n for _, n, _, _ in members]) != ([offset for offset, *_ in members], pack.shape[0]):
            raise ValueError(f"pack {pack.name!r}: its leaves must be written together, once each")
        plain_regions.append(Region(pack, ((0, pack.shape[0]),), members[0][2]))
        data = _in_place(members, pack.shape[0]) if staging else None
        plain_buffers.append(data if data is not None else _copied(members, pack.shape[0]))
    return plain_regions, plain_buffers


def _in_place(members: list, nbytes: int) -> np.ndarray | None:
    """The pack of ``members`` ((offset, nbytes, key path, buffer), by offset) as a view of the
    writable byte buffer they all lie in at their offsets, with the bytes between them zeroed;
    None where they do not lie so."""
    owner = root(members[0][3])
    if owner.ndim != 1 or owner.dtype != np.uint8 or not owner.flags.c_contiguous or not owner.flags.writeable:
        return None
    start = address(members[0][3]) - address(owner)
    if not 0 <= start <= owner.size - nbytes:
        return None
    for offset, _, _, buffer in members:
        if root(buffer) is not owner or not buffer.flags.c_contiguous or not buffer.flags.writeable \
                or address(buffer) != address(owner) + start + offset:
            return None
    data = owner[start:start + nbytes]
    for (offset, size, _, _), (following, *_) in zip(members, members[1:]):
        data[offset + size:following] = 0
    return data


def _copied(members: list, nbytes: int) -> np.ndarray:
    """A new buffer of the pack of ``members`` (as for :func:`_in_place`), zeros between them."""
    data = np.zeros(nbytes, np.uint8)
    for offset, size, _, buffer in members:
        data[offset:offset + size] = _as_bytes(buffer)
    return data


def spans(regions: Sequence[Region]) -> list[tuple[ArraySpec, int, int, str]]:
    """(pack, start, stop, key path of its first leaf): the byte spans to read for the packed
    leaves among ``regions``, one per run of leaves no more than a pack chunk apart (each chunk
    is then decoded once)."""
    wanted: dict[str, tuple[ArraySpec, dict]] = {}
    for region in regions:
        if region.array.packed is not None:
            pack, offset = region.array.packed
            wanted.setdefault(pack.name, (pack, {}))[1][offset] = (offset + region.array.nbytes, region.keypath)
    out = []
    for pack, leaves in wanted.values():
        chunk = pack.chunk_shape[0]
        run = None   # [start, stop, key path]
        for lo, (hi, keypath) in sorted(leaves.items()):
            if run is not None and lo < -(-run[1] // chunk) * chunk:  # starts in the chunk the run ends in
                run[1] = max(run[1], hi)
                continue
            if run is not None:
                out.append((pack, *run))
            run = [lo, hi, keypath]
        out.append((pack, *run))
    return out


def extract(region: Region, read: dict[str, list[tuple[int, np.ndarray]]]) -> np.ndarray:
    """The packed leaf ``region`` as an array of its stored dtype, a view of the span that
    holds it; ``read`` maps each pack name to its spans as read ((start, bytes), ...)."""
    pack, offset = region.array.packed
    nbytes = region.array.nbytes
    for start, data in read[pack.name]:
        if start <= offset and offset + nbytes <= start + data.size:
            leaf = data[offset - start:offset - start + nbytes]
            stored = numpy_dtype(region.array.storage_dtype)
            return leaf.view(stored).reshape(region.array.shape)[region.index]
    raise KeyError(f"{region.keypath}: bytes [{offset}, {offset + nbytes}) of {pack.name} were not read")

