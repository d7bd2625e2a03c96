"""A save batch off its devices through ``pinned_host`` memory, with no device program where it can.

The pinned path (``Options(host_transfer="pinned")``) in two steps, so the save driver can
start one batch's transfers before it waits for the previous batch's (:func:`start`, then
:meth:`PinnedBatch.finish`):

* **A whole shard in the batch** (every chunk of it is in this batch, which ``batches`` arranges
  wherever the shard fits a batch): the shard itself is ``device_put`` into the ``pinned_host``
  memory kind of its device -- a DMA of the buffer as it is, no program on the device's
  compute stream, no device allocation -- and each chunk is a numpy view of its rows of that
  pinned buffer. The writers read those views as they are (no host copy either).
* **Part of a shard** (the shard is larger than a batch may hold): the chunk is cut on the
  device by ``jax_compat.slice_exact``, one compiled program per leaf shape -- the offset is a traced
  argument, not a constant, so the first save does not compile a program per offset -- and
  that slice goes to pinned memory. Pinning the whole shard there would hold more pinned
  bytes than the budget counts.
* Host data (numpy leaves, leaves offloaded to a host memory kind) and whole-copied small
  leaves assembled from several shards are copied on the host, never through a device.

Every transfer of a batch is started before the first is awaited. Pinned bytes in flight are
the batch's chunks' bytes, which the staging ring counts (``StagingRing.acquire(view=False)``).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np

from dispatch_io.jax_compat import slice_exact
from dispatch_io.plan.save_plan import Chunk, Plan
from dispatch_io.save.transfer import HOST_KINDS
from dispatch_io.workers import ChunkError, aligned_empty


def pinned(data: jax.Array) -> jax.Array:
    """A copy of ``data`` in the ``pinned_host`` memory kind of its devices, its transfer started
    (not awaited)."""
    return jax.device_put(data, data.sharding.with_memory_kind("pinned_host"), may_alias=False)


def _in_host_memory(data) -> bool:
    # Not ``transfer.in_host_memory``: a CPU device's default memory is host memory too, but the
    # path forced on CPU devices must move it as an accelerator's (that is what it tests).
    return isinstance(data, np.ndarray) or getattr(data.sharding, "memory_kind", None) in HOST_KINDS


def _covers(data, members) -> bool:
    """Whether the chunks of ``members`` (distinct regions of ``data``) are all of it."""
    return sum(chunk.nbytes for _, chunk, _ in members) == math.prod(data.shape) * np.dtype(data.dtype).itemsize


class PinnedBatch:
    """One batch's transfers, started: :meth:`finish` waits for them and returns the chunks'
    host arrays in order. Counts what it did (``whole_shards``, ``device_slices``)."""

    def __init__(self, plan: Plan, chunks: Sequence[Chunk]):
        self.plan, self.chunks = plan, list(chunks)
        self.out: list = [None] * len(self.chunks)
        # (pinned array, where: "whole" -> [(k, local)], "part" -> (k, index in out[k] or None))
        self.transfers: list[tuple] = []
        self.whole_shards = self.device_slices = 0

    def _error(self, chunk: Chunk, exc: BaseException) -> ChunkError:
        return ChunkError(self.plan.leaves[chunk.leaf].keypath, chunk.region, exc)

    def finish(self) -> list[np.ndarray]:
        """Wait for every transfer (all of them, even after one fails: none may be left writing)
        and return the chunks' host data; raises ChunkError naming the first chunk that failed."""
        first = None
        for array, kind, where in self.transfers:
            try:
                host = np.asarray(array)  # waits for this transfer; no copy of pinned memory
                if kind == "whole":
                    for k, local in where:
                        self.out[k] = host[tuple(local) + (Ellipsis,)]   # ...: a view even when 0-d
                else:
                    k, part = where
                    if part is None:
                        self.out[k] = host
                    else:
                        np.copyto(part, host)
            except Exception as exc:  # noqa: BLE001 - named by the chunk, raised once all have ended
                k = where[0][0] if kind == "whole" else where[0]
                first = first or self._error(self.chunks[k], exc)
        self.transfers = []
        if first is not None:
            raise first
        return self.out


def start(plan: Plan, chunks: Sequence[Chunk], sources) -> PinnedBatch:
    """Start the transfers of ``chunks`` (module doc) and return them as a :class:`PinnedBatch`.
    ``sources``: a ``Sources`` of the save. Raises ChunkError naming a chunk whose transfer could
    not be started (the transfers already started are awaited first)."""
    batch = PinnedBatch(plan, chunks)
    shards: dict[int, tuple] = {}   # id(shard) -> (shard, [(k, chunk, local)])
    try:
        for k, chunk in enumerate(chunks):
            try:
                parts = sources.parts(chunk)
                data, local, within = parts[0]
                if len(parts) == 1 and not within and not _in_host_memory(data):
                    shards.setdefault(id(data), (data, []))[1].append((k, chunk, local))
                    continue
                spec = plan.leaves[chunk.leaf]
                dst = aligned_empty(tuple(hi - lo for lo, hi in chunk.region), spec.dtype)
                batch.out[k] = dst
                for data, local, within in parts:
                    part = dst[within] if within else dst   # dst[()] of a 0-d array is no view
                    if _in_host_memory(data):
                        np.copyto(part, np.asarray(data)[local])   # host memory: no device round trip
                    else:   # a shard of a whole-copied small leaf: moved as it is
                        batch.transfers.append((pinned(data), "part", (k, part)))
            except Exception as exc:  # noqa: BLE001 - any failure is the chunk's, named by its key path
                raise batch._error(chunk, exc) from exc
        for data, members in shards.values():
            try:
                if _covers(data, members):
                    batch.transfers.append((pinned(data), "whole", [(k, local) for k, _, local in members]))
                    batch.whole_shards += 1
                    continue
                for k, chunk, local in members:
                    batch.transfers.append((pinned(slice_exact(data, local)), "part", (k, None)))
                    batch.device_slices += 1
            except Exception as exc:  # noqa: BLE001
                raise batch._error(members[0][1], exc) from exc
    except ChunkError:
        try:
            batch.finish()
        except ChunkError:
            pass   # the failure to start is the one reported
        raise
    return batch
