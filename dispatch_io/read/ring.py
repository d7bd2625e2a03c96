"""Restore through a ring of host buffers: one host copy per byte, reads never wait for placements.

The pinned path's restore (``Options(host_transfer="pinned")``, a ``LocalDispatcher``):

* :class:`ReadRing` -- ``slots`` host buffers of ``budget // slots`` bytes each, owned by the
  dispatcher, allocated once (on first use) and reused by every batch of every restore, so the
  memory is warm: no page faults, no allocation per read.
* :func:`read_outputs` -- each batch of regions (at most one slot) is read by TensorStore
  straight into its slot (``read_items(..., out=views)``: the decoded chunk is written where it
  will be sent from), then each region is put on its device from there: the one host copy is
  TensorStore's, the next is host -> device. ``slots - 1`` batches read at once; a slot is
  given back by a thread of the ring once its batch's placements are done, so a read never
  waits for a placement unless every slot is still being placed from.

What does not fit a slot -- a region larger than one, results kept on the host, small leaves
read whole -- is read as ``read_loop.RegionReads`` reads it (fresh buffers), in the same loop.

Host memory: the ring (the budget) plus what is restored. On CPU devices the "device" copy
is host memory too (a copy made here, since JAX would adopt the slot itself).
"""

from __future__ import annotations

import concurrent.futures
import math
import threading

import jax
import numpy as np

from dispatch_io.jax_compat import single_device_sharding
from dispatch_io.plan.batches import aligned, pack
from dispatch_io.progress import Progress
from dispatch_io.read import loop as read_loop
from dispatch_io.read.loop import needed_regions, pipelined, read_failure, read_item
from dispatch_io.read.targets import DEVICE, finish
from dispatch_io.workers import aligned_empty, numpy_dtype

SLOTS = 4   # three batches read while one is placed


class ReadRing:
    """``slots`` host buffers of ``slot_bytes`` each (module doc). ``allocations`` counts the
    times the buffers were made: once per ring unless :meth:`drop` freed them."""

    def __init__(self, budget: int, slots: int = SLOTS):
        if slots < 2:
            raise ValueError(f"a read ring needs at least 2 slots, got {slots}")
        self.slots = slots
        self.slot_bytes = budget // slots // 64 * 64
        self.allocations = 0
        self._buffers: list | None = None
        self._free = list(range(slots))
        self._cond = threading.Condition()
        self.taken = threading.Lock()   # held by the restore reading through the ring
        self._placer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dispatch_io-place")

    def acquire(self) -> tuple[int, np.ndarray]:
        """(slot, its uint8 buffer), once one is free."""
        with self._cond:
            while not self._free:
                self._cond.wait()
            if self._buffers is None:
                self._buffers = [aligned_empty((self.slot_bytes,), np.uint8) for _ in range(self.slots)]
                self.allocations += 1
            slot = self._free.pop(0)
            return slot, self._buffers[slot]

    def release(self, slot: int):
        with self._cond:
            self._free.append(slot)
            self._cond.notify_all()

    def release_when_placed(self, slot: int, placed: list) -> concurrent.futures.Future:
        """Give ``slot`` back once every array of ``placed`` is on its device (read from the
        slot no more); the future raises what a placement failed with."""
        def wait():
            try:
                jax.block_until_ready(placed)
            finally:
                self.release(slot)
        return self._placer.submit(wait)

    def drop(self):
        """Free the buffers (when nothing is in flight); the next restore makes them again."""
        with self._cond:
            if len(self._free) == self.slots:
                self._buffers = None

    def close(self):
        self._placer.shutdown(wait=True)
        self.drop()


class _Batch:
    def __init__(self, work: list, ringed: bool):
        self.work, self.ringed, self.slot = work, ringed, None


def _place(view: np.ndarray, out, device) -> jax.Array:
    """``view`` (a region in a slot) on ``device``, in the target's memory kind; a copy that no
    longer reads the slot once it is ready."""
    kind = getattr(out.sharding, "memory_kind", None)
    where = single_device_sharding(device, memory_kind=kind)
    if device.platform == "cpu":   # JAX would adopt the slot's memory itself on CPU: copy it
        view = np.array(view)
    return jax.device_put(view, where)


def read_outputs(reader, outputs: list, ring: ReadRing, chunk_limit: int, batch_limit: int, progress: Progress):
    """Fill and place every output this process holds, through ``ring`` (module doc); the
    outputs are then finished (``restore.finish``). Raises as ``read_loop.read_outputs`` does.

    One restore reads through the ring at a time: two sharing its slots could each hold some
    read but unconsumed while waiting for another. A restore that finds the ring taken reads
    as ``read_loop.read_outputs(place=True)`` does (fresh buffers, ``batch_limit`` bytes a batch)."""
    if not ring.taken.acquire(blocking=False):
        read_loop.read_outputs(reader, outputs, chunk_limit, batch_limit, progress, place=True)
        return
    try:
        _read_through(reader, outputs, ring, chunk_limit, progress)
    finally:
        ring.taken.release()


def _slot_bytes(item) -> int:
    """The bytes ``item``'s buffer takes in a slot: its result's dtype, which ``cast=True`` may
    make narrower or wider than the stored one (``item.nbytes``)."""
    return aligned(math.prod(item.shape) * numpy_dtype(item.dtype).itemsize)


def _read_through(reader, outputs: list, ring: ReadRing, chunk_limit: int, progress: Progress):
    work = [(out, region, read_item(out, region, chunk_limit)) for out, region in needed_regions(outputs)]
    fits = lambda w: (w[0].where == DEVICE and not w[0].whole  # noqa: E731
                      and _slot_bytes(w[2]) <= ring.slot_bytes)
    batches = [_Batch(items, fits(items[0])) for items, _ in
               pack(work, lambda w: _slot_bytes(w[2]), ring.slot_bytes, group=fits)]
    placements: list[concurrent.futures.Future] = []

    def submit(batch):
        items = [item for _, _, item in batch.work]
        if not batch.ringed:
            return reader.read(items)
        batch.slot, buffer = ring.acquire()
        views, offset = [], 0
        for item in items:
            dtype = numpy_dtype(item.dtype)
            views.append(buffer[offset:offset + math.prod(item.shape) * dtype.itemsize].view(dtype).reshape(item.shape))
            offset += _slot_bytes(item)
        try:
            return reader.read(items, views)
        except BaseException:
            ring.release(batch.slot)
            batch.slot = None
            raise

    def consume(batch, arrays):
        placed = []
        for (out, region, _), array in zip(batch.work, arrays):
            if batch.ringed:
                array = _place(array, out, out.regions[region][0])
                placed.append(array)
            out.buffers[region] = array
            if len(out.buffers) == len(out.regions) and out.where == DEVICE or out.whole:
                result = finish(out)
                if not batch.ringed:
                    placed.append(result)
        if batch.ringed:
            placements.append(ring.release_when_placed(batch.slot, placed))
            batch.slot = None
        else:
            jax.block_until_ready(placed)   # fresh buffers: freed before the next read

    try:
        pipelined(batches, submit, consume, lambda b: sum(item.nbytes for _, _, item in b.work), progress, "read",
                  lambda exc, b: read_failure(exc, b.work[0][2].keypath, progress.path), depth=ring.slots - 1)
    finally:
        for batch in batches:   # read (or failed) but never consumed: nothing reads into it any more
            if batch.slot is not None:
                ring.release(batch.slot)
        concurrent.futures.wait(placements)
    for future in placements:
        future.result()


def ring_for(runner, budget: int) -> ReadRing | None:
    """The read ring a dispatcher owns for ``runner``: one for a ``LocalRunner`` on the pinned
    path (whose reader reads into given buffers), None for the rest."""
    return ReadRing(budget) if getattr(runner, "transfer", None) == "pinned" else None
