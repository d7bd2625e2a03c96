"""Runs: regions of one write that continue each other in their array and in memory, written
with one call.

A leaf sharded over the leading axis of a mesh is stored as (at least) one chunk per shard. The plan
orders a leaf's chunks so that those stacked along axis 0 (equal bounds on every other axis)
follow each other, and a save's batch lays its chunks out back to back in staging: such a run
of chunks is one C-contiguous block of the array, and TensorStore writes the block's chunks
from one call as it would from one call each -- without a Python call, a future and a copy
job per chunk, which on a transformer-shaped state (thousands of 128 KiB chunks) cost about as
much as the bytes.

Buffers that do not lie so (other memory, such as a colocated writer's arrays; padding between
them; another dtype; chunks cut from a shard along a later axis) are written as they are:
merging is an optimisation, never a requirement.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .contract import Region


def address(buffer: np.ndarray) -> int:
    """Where ``buffer``'s data starts in memory."""
    return buffer.__array_interface__["data"][0]


def root(buffer: np.ndarray) -> np.ndarray:
    """The array that owns ``buffer``'s memory (``buffer`` itself if it owns it)."""
    while isinstance(buffer.base, np.ndarray):
        buffer = buffer.base
    return buffer


def runs(regions: Sequence[Region], buffers: Sequence[np.ndarray]) -> tuple[list[Region], list[np.ndarray]]:
    """``regions`` / ``buffers`` with every run of consecutive regions that continue one another
    along axis 0 of one array (the next starts where the previous one stops, the other axes
    alike), whose buffers (C-contiguous, one dtype) lie back to back in one C-contiguous array,
    made one region and one buffer: a view of that memory. Order is kept; a region's key path
    is its first one's (a run never leaves its array, hence its leaf)."""
    out_regions: list[Region] = []
    out_buffers: list[np.ndarray] = []
    end = None   # (owner, address just past it) of the last buffer, if a run could go on from it
    for region, buffer in zip(regions, buffers):
        owner = root(buffer)
        start = address(buffer)
        if end is not None and end[0] is owner and end[1] == start and buffer.flags.c_contiguous \
                and _continues(out_regions[-1], out_buffers[-1], region, buffer):
            first = out_regions[-1]
            out_regions[-1] = Region(first.array, ((first.bounds[0][0], region.bounds[0][1]),) + first.bounds[1:],
                                     first.keypath)
            out_buffers[-1] = _joined(owner, out_buffers[-1], buffer)
        else:
            out_regions.append(region)
            out_buffers.append(buffer)
        contiguous = owner.flags.c_contiguous and buffer.flags.c_contiguous and buffer.ndim > 0
        end = (owner, start + buffer.nbytes) if contiguous else None
    return out_regions, out_buffers


def _continues(region: Region, buffer: np.ndarray, after: Region, following: np.ndarray) -> bool:
    """Whether ``after`` / ``following`` extend ``region`` / ``buffer`` along axis 0 of one
    array (their memory is known to follow on)."""
    return (after.array.name == region.array.name and len(after.bounds) == len(region.bounds) > 0
            and after.bounds[0][0] == region.bounds[0][1] and after.bounds[1:] == region.bounds[1:]
            and following.dtype == buffer.dtype and following.shape[1:] == buffer.shape[1:])


def _joined(owner: np.ndarray, buffer: np.ndarray, following: np.ndarray) -> np.ndarray:
    """One array over ``buffer`` then ``following``, both in ``owner`` (C-contiguous), back to back."""
    start = address(buffer) - address(owner)
    data = owner.reshape(-1).view(np.uint8)[start:start + buffer.nbytes + following.nbytes]
    return data.view(buffer.dtype).reshape((buffer.shape[0] + following.shape[0],) + buffer.shape[1:])
