"""Device -> host copies of one save batch: the pageable path and the pinned path.

* :func:`copy_chunks_to_host` (``PAGEABLE``): each chunk into its slice of the staging ring.
  On CPU devices (and for leaves already in a host memory kind) the buffer *is* host memory:
  ``np.asarray`` views it and the one copy is into staging. On accelerators each region is
  sliced on the device, ``copy_to_host_async`` started for all, then copied into staging.
* :func:`copy_chunks_pinned` (``PINNED``): each chunk ``jax.device_put`` into the
  ``pinned_host`` memory kind of its device -- every transfer of the batch started before the
  first is awaited -- and the writers read the pinned buffers as they are (``np.asarray`` of a
  pinned array is no copy): one copy off the device, at the link's speed (XLA serves pinned
  buffers from a pool it reuses), and nothing cached on the trainer's arrays. The staging
  ring only counts these bytes, so pinned bytes in flight stay within the budget.

A chunk that is a whole shard is transferred as it is; a chunk that is part of a shard is
sliced on the device first: pinning the whole shard and slicing on the host would hold the
whole shard in pinned memory for one chunk of it, beyond the budget where shards are larger
than chunks (docs/design.md, "The accelerator path").
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from dispatch_io.jax_compat import slice_exact
from dispatch_io.plan.save_plan import Chunk, Plan
from dispatch_io.plan.batches import aligned
from dispatch_io.workers import ChunkError, aligned_empty

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
                    piece = data[local]
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


def to_pinned(data: jax.Array, local: tuple) -> jax.Array:
    """A new array holding ``data[local]`` in the ``pinned_host`` memory kind of ``data``'s
    device, its transfer started (not awaited): the whole of ``data`` as it is, a part sliced
    on the device first."""
    whole = all((sl.start or 0) == 0 and (sl.stop is None or sl.stop == n) for sl, n in zip(local, data.shape))
    piece = data if whole else slice_exact(data, local)
    return jax.device_put(piece, piece.sharding.with_memory_kind("pinned_host"), may_alias=False)


def copy_chunks_pinned(plan: Plan, chunks: Sequence[Chunk], sources) -> list[np.ndarray]:
    """The pinned path (module doc): the chunks' data on the host, in order -- a chunk that is
    one device region is its pinned buffer itself; one assembled from several parts (a leaf
    copied whole) or from host data is a fresh host array. Raises ChunkError naming the chunk
    whose transfer failed."""
    out: list = []
    transfers = []   # (pinned array, index in out, where in out[index] or None: it is out[index])
    for k, chunk in enumerate(chunks):
        spec = plan.leaves[chunk.leaf]
        try:
            parts = sources.parts(chunk)
            data, local, within = parts[0]
            if len(parts) == 1 and not within and not isinstance(data, np.ndarray) and not in_host_memory(data):
                transfers.append((to_pinned(data, local), k, None, chunk))
                out.append(None)
                continue
            dst = _chunk_view(aligned_empty((chunk.nbytes,), np.uint8), chunk, spec.dtype)
            out.append(dst)
            for data, local, within in parts:
                part = dst[within] if within else dst
                if isinstance(data, np.ndarray) or in_host_memory(data):
                    np.copyto(part, np.asarray(data)[local])  # host memory: copied, no device round trip
                else:
                    transfers.append((to_pinned(data, local), k, part, chunk))
        except Exception as exc:  # noqa: BLE001 - any failure is the chunk's, named by its key path
            raise ChunkError(spec.keypath, chunk.region, exc) from exc
    for pinned, k, part, chunk in transfers:
        try:
            host = np.asarray(pinned)  # waits for this transfer; no copy of pinned memory
            if part is None:
                out[k] = host
            else:
                np.copyto(part, host)
        except Exception as exc:  # noqa: BLE001
            raise ChunkError(plan.leaves[chunk.leaf].keypath, chunk.region, exc) from exc
    return out
