"""Scale-out restore: in a multi-process job, every stored byte is read once per job.

Read naively, each process reads every region its devices hold, so N processes that each hold
a replica read the checkpoint N times (N times the egress, the requests and the time). Here a
restore splits the regions this process holds in two (:func:`plan_split`, pure, the same in
every process):

* **local** regions, held by this process alone: read here, as a single-process restore does;
* **shared** regions, held by several processes (or wanted on the host by all): cut into
  pieces of at most the chunk limit, and each piece given one reader among its holders -- the
  least loaded so far, as a save picks the writer of a replicated chunk, so every process
  reads about its share.

The shared pieces travel in **rounds**. In round k each process reads its next pieces (at most
``batch_bytes / processes`` of them, so a round's rows together stay within half the budget)
into a row of bytes; once every process has said its read succeeded (the coordination
service: a failure anywhere ends the round everywhere, naming the reader and key path), one
all-gather over one device per process (:func:`all_gather`, a jitted reshard: gloo on CPU,
NVLink / ICI on accelerators) gives every process every row, and each copies out the pieces
of the regions it holds. The next round's reads run while a round is gathered.

Bounds, per process: host memory holds at most two rounds' reads (``batch_bytes``) and one
gathered round (``batch_bytes`` plus padding) beyond the restored arrays; device memory on the
carrying device holds one round's row and its gathered copy (about ``batch_bytes``) at a time.

Every process must restore the same checkpoint onto the same target (same shardings), in the
same order: the plans are compared first, and processes that planned differently all raise.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import math
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dispatch_io.batches import aligned, pack
from dispatch_io.coordination import Room, open_room
from dispatch_io.errors import WorkerError
from dispatch_io.plan import device_regions
from dispatch_io.progress import Progress
from dispatch_io.reading import pipelined, read_failure, read_pieces, read_regions, verify_stored
from dispatch_io.restore import HOST, Output, output_regions
from workers import ReadItem, aligned_empty, numpy_dtype


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece of a shared region: ``reader`` reads it, every process in ``holders`` gets it."""

    output: int                  # index of its Output in the restore's outputs
    region: tuple                # the result region whose buffer it fills
    local: tuple                 # its bounds in that buffer
    item: ReadItem               # what the reader reads: host bytes in the result's dtype
    reader: int
    holders: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.item.shape) * numpy_dtype(self.item.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Round:
    """The pieces each process reads in one round (``rows[process]``, in row order); every
    row is ``width`` bytes, pieces at 64-byte aligned offsets."""

    index: int
    rows: tuple[tuple[Piece, ...], ...]
    width: int


@dataclasses.dataclass(frozen=True)
class Split:
    local: list      # (Output, region): held by this process alone
    rounds: list     # [Round]
    digest: str      # of the shared part, equal in every process that planned the same restore


def holders(out: Output, count: int, seen: dict) -> dict:
    """{region of the result: the processes holding it}, over the whole job (host results: one
    region, wanted by every process). ``seen`` caches it per (sharding, shape): a model's layers
    share a few."""
    if out.where == HOST:
        return {region: tuple(range(count)) for region in output_regions(out)}
    key = (out.sharding, out.saved.shape)
    if key not in seen:
        seen[key] = {region: tuple(sorted({d.process_index for d in devices}))
                     for region, devices in device_regions(out.sharding, out.saved.shape).items()}
    return seen[key]


def _width(nbytes: int) -> int:
    """Row width for ``nbytes``: rounded up by at most 1/16, so few distinct shapes are compiled."""
    step = 1 << max(6, nbytes.bit_length() - 5)
    return max(step, -(-nbytes // step) * step)


def plan_split(outputs: list, process: int, count: int, chunk_limit: int, batch_limit: int) -> Split:
    """Split the restore of ``outputs`` (sets each ``out.regions``; allocates the buffers of the
    shared regions this process holds) into local regions and rounds of shared pieces."""
    local, load, seen = [], [0] * count, {}
    pieces: list[list[Piece]] = [[] for _ in range(count)]   # by reader
    for index, out in enumerate(outputs):
        if not isinstance(out, Output) or out.saved.stored is None:
            continue
        out.regions = output_regions(out)
        shared = {region: procs for region, procs in holders(out, count, seen).items() if len(procs) > 1}
        local += [(out, region) for region in out.regions if region not in shared]
        for region, procs in shared.items():
            if process in procs:
                out.buffers[region] = aligned_empty(out.buffer_shape(region), out.dtype)
            for stored, bounds in read_pieces(out, region, chunk_limit):
                shape = tuple(hi - lo for lo, hi in bounds)
                item = ReadItem(((stored, tuple((0, n) for n in shape)),), shape, np.dtype(out.dtype).name,
                                on_host=True)
                reader = min(procs, key=lambda p: (load[p], p))
                piece = Piece(index, region, bounds, item, reader, procs)
                load[reader] += piece.nbytes
                pieces[reader].append(piece)
    share = max(1, batch_limit // count)
    queues = [pack(mine, lambda p: p.nbytes, share) for mine in pieces]
    rounds = []
    for k in range(max(map(len, queues), default=0)):
        rows = tuple(tuple(q[k][0]) if k < len(q) else () for q in queues)
        rounds.append(Round(k, rows, _width(max(q[k][1] if k < len(q) else 0 for q in queues))))
    digest = hashlib.sha256(repr([(outputs[p.output].saved.keypath, p.region, p.local, p.reader, p.item.dtype)
                                  for mine in pieces for p in mine]).encode()).hexdigest()
    return Split(local, rounds, digest)


@functools.partial(jax.jit, static_argnums=1)
def _reshard(rows, sharding):
    return jax.lax.with_sharding_constraint(rows, sharding)


def carriers(count: int) -> list:
    """The device of each process that carries its rows: its first."""
    return [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(count)]


def all_gather(row: np.ndarray, devices: list) -> np.ndarray:
    """Every process's ``row`` (uint8, the same length everywhere), as a (processes, len) host
    array, through ``devices`` (:func:`carriers`); all processes call it together."""
    count = len(devices)
    mesh = Mesh(np.array(devices), ("processes",))
    mine = jax.device_put(row[None], devices[jax.process_index()])
    rows = jax.make_array_from_single_device_arrays((count, row.size), NamedSharding(mesh, PartitionSpec("processes")),
                                                    [mine])
    return np.asarray(_reshard(rows, NamedSharding(mesh, PartitionSpec())).addressable_data(0))


class PeerFailure(WorkerError):
    """Another process of the job failed its part of a restore (so this one fails too)."""


def _peer_failed(room: Room, display: str):
    """Raise PeerFailure if another process reported a failure."""
    failed = room.get("failed")
    if failed is not None:
        what = f"reading {failed['keypath']} from" if failed["keypath"] else "its part of the restore of"
        raise PeerFailure(f"process {failed['process']} failed {what} {display}, so every process's restore "
                          f"fails: {failed['error']}", worker=failed["process"], keypath=failed["keypath"])


def _index(bounds) -> tuple:
    return tuple(slice(lo, hi) for lo, hi in bounds) + (Ellipsis,)


def fill_outputs(reader, outputs: list, options, progress: Progress, *, verify: bool, times: list) -> int:
    """Fill every output's buffers in a multi-process job, every stored byte read by one
    process (see the module doc); ``verify=True`` checks what this process reads first. All
    processes call it together. Appends the time the verify ended to ``times``; returns the
    bytes this process received from other processes' reads.

    Raises WorkerError naming the process and key path of a read that failed anywhere,
    BarrierTimeoutError naming the processes that stopped making progress, ValueError where
    the processes planned different restores."""
    process, count, display = jax.process_index(), jax.process_count(), progress.path
    split = plan_split(outputs, process, count, options.chunk_bytes, options.batch_bytes)
    room = open_room("restore", display, f"the restore of {display}", options.barrier_timeout)
    try:
        room.set(f"plan/{process}", split.digest)
        plans = room.gather("plan", check=lambda: _peer_failed(room, display))
        if len(set(plans.values())) != 1:
            differ = sorted(p for p, d in plans.items() if d != plans[0])
            raise ValueError(f"the processes planned different restores of {display}: process(es) {differ} differ "
                             "from process 0. Every process must restore the same checkpoint onto the same "
                             "target (the same global shardings), in the same order.")
        mine = [p for r in split.rounds for p in r.rows[process]]
        if verify:
            verify_stored(reader, [(outputs[p.output], p.item.pieces[0][0].bounds) for p in mine] +
                          [(out, out.stored_bounds(region)) for out, region in split.local],
                          options.batch_bytes, progress)
        times.append(time.perf_counter())
        received = _rounds(reader, outputs, split.rounds, room, progress)
        read_regions(reader, split.local, options.chunk_bytes, options.batch_bytes, progress,
                     on_batch=lambda done: room.set(f"progress/{process}", done))
    except BaseException as exc:
        if not isinstance(exc, PeerFailure):  # the first failure is the one every process reports
            room.set("failed", {"process": process, "keypath": getattr(exc, "keypath", None),
                                "error": f"{type(exc).__name__}: {exc}"})
        raise
    room.set(f"status/{process}", True)
    room.gather("status", doing="finish reading their part of", check=lambda: _peer_failed(room, display),
                together=False)
    room.close()
    return received


def _rounds(reader, outputs: list, rounds: list, room: Room, progress: Progress) -> int:
    """Run the rounds (see the module doc); returns the bytes received from other processes."""
    process, display = room.process, progress.path
    devices = carriers(room.count)
    received = 0

    def submit(round_: Round):
        if not round_.rows[process]:
            done = concurrent.futures.Future()
            done.set_result([])
            return done
        return reader.read([p.item for p in round_.rows[process]])

    def consume(round_: Round, arrays):
        nonlocal received
        row = aligned_empty((round_.width,), np.uint8)
        offset = 0
        for piece, array in zip(round_.rows[process], arrays):
            data = np.asarray(array).reshape(-1).view(np.uint8)
            row[offset:offset + data.size] = data
            offset += aligned(data.size)
        room.set(f"round{round_.index}/{process}", True)
        room.gather(f"round{round_.index}", check=lambda: _peer_failed(room, display), together=False)
        table = all_gather(row, devices)
        for reader_process, pieces in enumerate(round_.rows):
            offset = 0
            for piece in pieces:
                if process in piece.holders:
                    buffer = outputs[piece.output].buffers[piece.region]
                    data = table[reader_process, offset:offset + piece.nbytes]
                    buffer[_index(piece.local)] = data.view(buffer.dtype).reshape(piece.item.shape)
                    received += piece.nbytes if reader_process != process else 0
                offset += aligned(piece.nbytes)

    pipelined(rounds, submit, consume, lambda r: sum(p.nbytes for p in r.rows[process]), progress, "broadcast",
              lambda exc, r: read_failure(exc, r.rows[process][0].item.keypath, display))
    return received
