"""Device -> host copies of one save batch: the pageable path and the pinned path.

* :func:`copy_chunks_to_host` (``PAGEABLE``): each chunk into its slice of the staging ring.
  On CPU devices (and for leaves already in a host memory kind) the buffer *is* host memory:
  ``np.asarray`` views it and the one copy is into staging. On accelerators each region is
  sliced on the device, ``copy_to_host_async`` started for all, then copied into staging.
* The pinned path (``PINNED``) is :mod:`dispatch_io.pinned_save`'s: whole shards ``device_put``
  into the ``pinned_host`` memory kind and written from numpy views of their rows, a device
  slice (one program per leaf) only for a shard larger than a batch (docs/design.md, "The
  accelerator path").
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from dispatch_io.jax_compat import slice_exact
from dispatch_io.plan.save_plan import Chunk, Plan
from dispatch_io.plan.batches import aligned
from dispatch_io.workers import ChunkError

PAGEABLE, PINNED, AUTO = "pageable", "pinned", "auto"
MODES = (AUTO, PINNED, PAGEABLE)
HOST_KINDS = ("pinned_host", "unpinned_host")   # memory kinds whose buffers are host memory


def resolve(mode: str, device=None) -> str:
    """``PINNED`` or ``PAGEABLE`` for ``Options.host_transfer``: ``"auto"`` is pinned on
    accelerators whose devices have the ``pinned_host`` memory kind (``device``: default, this
    process's first), pageable on CPU devices, whose memory is host memory already."""
    if mode not in MODES:
        raise ValueError(f"host_transfer must be one of {MODES}, got {mode!r}")
    if mode != AUTO:
        return mode
    device = device or jax.local_devices()[0]
    kinds = {memory.kind for memory in device.addressable_memories()}
    return PINNED if device.platform != "cpu" and "pinned_host" in kinds else PAGEABLE


def platform(array) -> str:
    """The platform (``cpu``, ``gpu``, ``tpu``) of the devices holding ``array``."""
    return next(iter(array.sharding.device_set)).platform


def in_host_memory(array) -> bool:
    """Whether ``array``'s buffers are host memory: on CPU devices, or in a host memory kind
    (an offloaded leaf)."""
    return getattr(array.sharding, "memory_kind", None) in HOST_KINDS or platform(array) == "cpu"


def _chunk_view(buffer: np.ndarray, chunk: Chunk, dtype) -> np.ndarray:
    return buffer.view(dtype).reshape(tuple(hi - lo for lo, hi in chunk.region))


def copy_chunks_to_host(plan: Plan, chunks: Sequence[Chunk], sources, staging: np.ndarray) -> list[np.ndarray]:
    """The pageable path (module doc): each chunk's region into consecutive staging slices."""
    out, pending, offset = [], [], 0
    for chunk in chunks:
        spec = plan.leaves[chunk.leaf]
        try:
            dst = _chunk_view(staging[offset:offset + chunk.nbytes], chunk, spec.dtype)
            offset += aligned(chunk.nbytes)
            for data, local, within in sources.parts(chunk):
                part = dst[within] if within else dst  # dst[()] of a 0-d array is no view
                if isinstance(data, np.ndarray):
                    np.copyto(part, data[local])
                elif in_host_memory(data):
                    np.copyto(part, np.asarray(data)[local])
                else:
                    piece = slice_exact(data, local)   # a cut on the device that keeps NaN payloads
                    piece.copy_to_host_async()
                    pending.append((part, piece, spec, chunk))
            out.append(dst)
        except Exception as exc:  # noqa: BLE001 - any failure is the chunk's, named by its key path
            raise ChunkError(spec.keypath, chunk.region, exc) from exc
    for dst, piece, spec, chunk in pending:
        try:
            np.copyto(dst, np.asarray(piece))
        except Exception as exc:  # noqa: BLE001
            raise ChunkError(spec.keypath, chunk.region, exc) from exc
    return out
