"""Scale-out restore: in a multi-process job, every stored byte is read once per job.

Read naively, each process reads every region its devices hold, so N processes that each hold
a replica read the checkpoint N times (N times the egress, the requests and the time). Here a
restore splits the regions this process holds in two (:func:`plan_split`, pure, the same in
every process):

* **local** regions, held by this process alone: read here, as a single-process restore does;
* **shared** regions, held by several processes (or wanted on the host by all): cut into
  pieces of at most the chunk limit (or one stored chunk, where those are larger: read once),
  and each piece given one reader among its holders -- the least loaded so far, as a save
  picks the writer of a replicated chunk, so every process reads about its share.

The shared pieces travel in **rounds**. In round k each process reads its next pieces (at most
``read_batch_bytes / processes`` of them, so a round's rows together stay within half the budget)
into a row of bytes headed by the round's identity, and says it is ready. A round's
**decision** is published once (``Room.decide``: the first write wins): "go" when every
process is ready, else a reported failure or the processes that made no progress for
``barrier_timeout`` -- so either every process enters the round's collective or none does,
and each raises the same error. Then one all-gather over one device per process
(:func:`all_gather`, a jitted reshard: gloo on CPU, NVLink / ICI on accelerators) gives every
process every row; the headers are checked (a collective crossed by another thread's fails
loudly, never silently); each process copies out the pieces of the regions it holds. The next
round's reads run while a round is gathered. A piece over a process's share is sent alone, by a
broadcast (:func:`broadcast`, a sum where the others add zeros), not by an all-gather that would
make every row that large.

Bounds, per process: host memory holds at most two rounds' reads (``read_batch_bytes``) and one
gathered round (``read_batch_bytes`` plus padding) beyond the restored arrays; device memory on the
carrying device one round's row and its gathered copy. A stored chunk larger than the share
costs about four times its size while it is sent.

Every process must restore the same checkpoint onto the same target (same shardings), in the
same order: the plans are compared first, and processes that planned differently all raise.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import math
import threading
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dispatch_io.batches import pack
from dispatch_io.staging import aligned
from dispatch_io.coordination import Room, open_room
from dispatch_io.errors import BarrierTimeoutError, CheckpointError, WorkerError
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


HEADER = 64  # each row starts with its round's identity, checked after the gather


def _header(room: Room, k: int) -> np.ndarray:
    digest = hashlib.sha256(f"{room.prefix}/{k}".encode()).digest()
    return np.frombuffer(digest + bytes(HEADER - len(digest)), np.uint8)


@dataclasses.dataclass(frozen=True)
class Round:
    """The pieces each process reads in one round (``rows[process]``, in row order); every
    row is ``width`` bytes: a HEADER, then the pieces at 64-byte aligned offsets."""

    index: int
    rows: tuple[tuple[Piece, ...], ...]
    width: int
    solo: int | None = None      # the one process whose row is sent (a piece over the share)


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
    queues = [pack([p for p in mine if p.nbytes <= share], lambda p: p.nbytes, share) for mine in pieces]
    rounds = []
    for k in range(max(map(len, queues), default=0)):
        rows = tuple(tuple(q[k][0]) if k < len(q) else () for q in queues)
        rounds.append(Round(k, rows, _width(HEADER + max(q[k][1] if k < len(q) else 0 for q in queues))))
    # A piece over the share (a stored chunk larger than the chunk limit, read whole so that it is
    # read once) is sent alone, by a broadcast: an all-gather would give every process a row that size.
    for piece in (p for mine in pieces for p in mine if p.nbytes > share):
        rows = tuple((piece,) if r == piece.reader else () for r in range(count))
        rounds.append(Round(len(rounds), rows, _width(HEADER + piece.nbytes), solo=piece.reader))
    # With the share: processes with different budgets would cut different rounds.
    digest = hashlib.sha256(repr((share, [(outputs[p.output].saved.keypath, p.region, p.local, p.reader, p.item.dtype)
                                          for mine in pieces for p in mine])).encode()).hexdigest()
    return Split(local, rounds, digest)


@functools.partial(jax.jit, static_argnums=1)
def _reshard(rows, sharding):
    return jax.lax.with_sharding_constraint(rows, sharding)


def carriers(count: int) -> list:
    """The device of each process that carries its rows: its first."""
    return [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(count)]


@functools.partial(jax.jit, static_argnums=1)
def _sum_rows(rows, sharding):
    return jax.lax.with_sharding_constraint(rows.sum(0, dtype=rows.dtype), sharding)


def _rows(row: np.ndarray, devices: list):
    """(this process's ``row`` as its row of a (processes, len) array sharded over ``devices``, the mesh)."""
    mesh = Mesh(np.array(devices), ("processes",))
    mine = jax.device_put(row[None], devices[jax.process_index()])
    return jax.make_array_from_single_device_arrays((len(devices), row.size),
                                                    NamedSharding(mesh, PartitionSpec("processes")), [mine]), mesh


def broadcast(row: np.ndarray, devices: list) -> np.ndarray:
    """The one process's ``row`` whose is not all zeros (uint8, the same length everywhere),
    through ``devices`` (:func:`carriers`): a sum over the processes; all call it together."""
    rows, mesh = _rows(row, devices)
    return np.asarray(_sum_rows(rows, NamedSharding(mesh, PartitionSpec())).addressable_data(0))


def all_gather(row: np.ndarray, devices: list) -> np.ndarray:
    """Every process's ``row`` (uint8, the same length everywhere), as a (processes, len) host
    array, through ``devices`` (:func:`carriers`); all processes call it together."""
    rows, mesh = _rows(row, devices)
    return np.asarray(_reshard(rows, NamedSharding(mesh, PartitionSpec())).addressable_data(0))


class PeerFailure(WorkerError):
    """Another process of the job failed its part of a restore (so this one fails too)."""


def _peer_failure(room: Room, display: str) -> PeerFailure | None:
    """The failure another process reported, if any."""
    failed = room.get("failed")
    if failed is None:
        return None
    what = f"reading {failed['keypath']} from" if failed["keypath"] else "its part of the restore of"
    return PeerFailure(f"process {failed['process']} failed {what} {display}, so every process's restore fails: "
                       f"{failed['error']}", worker=failed["process"], keypath=failed["keypath"])


def _check_peers(room: Room, display: str):
    failure = _peer_failure(room, display)
    if failure is not None:
        raise failure


GO = "go"


def _decision(room: Room, k: int) -> str:
    """Wait for round ``k``'s decision and return it: ``GO`` once every process is ready (any
    process may decide it), or why not -- a failure reported, or processes that made no
    progress for the timeout. The first decision published wins (``Room.decide``), so every
    process acts on the same one: all enter the collective, or none does."""
    deadline, seen, pause = time.monotonic() + room.timeout, None, 0.002
    while True:
        decided = room.get(f"decision/{k}")
        if decided is not None:
            return decided
        ready = room.entries(f"ready/{k}")
        if len(ready) == room.count:
            room.decide(f"decision/{k}", GO)
        elif room.get("failed") is not None:
            room.decide(f"decision/{k}", "failed")
        else:
            now = (sorted(ready), room.entries("progress"))
            if now != seen:
                seen, deadline = now, time.monotonic() + room.timeout
            elif time.monotonic() > deadline:
                missing = sorted(set(range(room.count)) - set(ready))
                room.decide(f"decision/{k}", {"missing": missing})
            time.sleep(pause)
            pause = min(pause * 2, 0.1)


def _proceed(room: Room, k: int, display: str):
    """Return once every process will take part in round ``k``'s collective; else raise what
    stopped it (PeerFailure, or BarrierTimeoutError naming the processes that made no progress)."""
    decided = _decision(room, k)
    if decided == GO:
        return
    if isinstance(decided, dict):
        missing = decided["missing"]
        raise BarrierTimeoutError(f"process(es) {missing} did not finish their reads for round {k} of the restore "
                                  f"of {display} and made no progress for {room.timeout:g} s",
                                  processes=missing, barrier=f"{room.prefix}/ready/{k}")
    raise _peer_failure(room, display) or PeerFailure(f"another process failed the restore of {display}")


def _index(bounds) -> tuple:
    return tuple(slice(lo, hi) for lo, hi in bounds) + (Ellipsis,)


# A job's collectives must be issued in the same order by every process: two restores gathering
# at once from two threads (two dispatchers) could cross and swap rows. One at a time per process
# (and every row is checked for its round, see _rounds).
_ONE_AT_A_TIME = threading.Lock()


def fill_outputs(reader, outputs: list, options, progress: Progress, *, verify: bool, times: list) -> int:
    """Fill every output's buffers in a multi-process job, every stored byte read by one
    process (see the module doc); ``verify=True`` checks what this process reads first. All
    processes call it together, restoring the same checkpoints in the same order. Appends the
    time the verify ended to ``times``; returns the bytes this process received from other
    processes' reads.

    Raises WorkerError naming the process and key path of a read that failed anywhere,
    BarrierTimeoutError naming the processes that stopped making progress, ValueError where
    the processes planned different restores."""
    with _ONE_AT_A_TIME:
        return _fill(reader, outputs, options, progress, verify, times)


def _fill(reader, outputs: list, options, progress: Progress, verify: bool, times: list) -> int:
    process, count, display = jax.process_index(), jax.process_count(), progress.path
    split = plan_split(outputs, process, count, options.chunk_bytes, options.read_batch_bytes)
    room = open_room("restore", display, f"the restore of {display}", options.barrier_timeout)
    report = lambda done: room.set(f"progress/{process}", done)  # noqa: E731 - moves the others' deadlines
    upcoming = [0]   # the next round this process has not said it is ready for
    try:
        room.set(f"plan/{process}", split.digest)
        plans = room.gather("plan", check=lambda: _check_peers(room, display))
        if len(set(plans.values())) != 1:
            differ = sorted(p for p, d in plans.items() if d != plans[0])
            raise ValueError(f"the processes planned different restores of {display}: process(es) {differ} differ "
                             "from process 0. Every process must restore the same checkpoint onto the same "
                             "target (the same global shardings), in the same order.")
        mine = [p for r in split.rounds for p in r.rows[process]]
        if verify:
            verify_stored(reader, [(outputs[p.output], p.item.pieces[0][0].bounds) for p in mine] +
                          [(out, out.stored_bounds(region)) for out, region in split.local],
                          options.read_batch_bytes, progress, on_batch=report)
        times.append(time.perf_counter())
        received = _rounds(reader, outputs, split.rounds, room, progress, upcoming)
        read_regions(reader, split.local, options.chunk_bytes, options.read_batch_bytes, progress, on_batch=report)
    except BaseException as exc:
        if not isinstance(exc, PeerFailure):  # the first failure is the one every process reports
            room.set("failed", {"process": process, "keypath": getattr(exc, "keypath", None),
                                "error": f"{type(exc).__name__}: {exc}"})
        if upcoming[0] < len(split.rounds):  # nobody may wait for this process in a collective
            room.decide(f"decision/{upcoming[0]}", "failed")
        raise
    room.set(f"status/{process}", True)
    room.gather("status", doing="finish reading their part of", check=lambda: _check_peers(room, display),
                together=False)
    room.close()
    return received


def _rounds(reader, outputs: list, rounds: list, room: Room, progress: Progress, upcoming: list) -> int:
    """Run the rounds (see the module doc); returns the bytes received from other processes.
    ``upcoming[0]``: the next round this process has not said it is ready for."""
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
        k = round_.index
        if round_.solo not in (None, process):  # a broadcast: this row only adds zeros
            row = np.zeros(round_.width, np.uint8)
        else:
            row = aligned_empty((round_.width,), np.uint8)
            row[:HEADER] = _header(room, k)
        offset = HEADER
        for piece, array in zip(round_.rows[process], arrays):
            data = np.asarray(array).reshape(-1).view(np.uint8)
            row[offset:offset + data.size] = data
            offset += aligned(data.size)
        room.set(f"ready/{k}/{process}", True)
        upcoming[0] = k + 1
        _proceed(room, k, display)
        if round_.solo is None:
            table = dict(enumerate(all_gather(row, devices)))
        else:
            table = {round_.solo: broadcast(row, devices)}
        if not all((r[:HEADER] == _header(room, k)).all() for r in table.values()):
            raise CheckpointError(f"round {k} of the restore of {display}: the processes' collectives crossed "
                                  "(another collective ran at the same time on some process); nothing was restored")
        for reader_process, pieces in enumerate(round_.rows):
            offset = HEADER
            for piece in pieces:
                if process in piece.holders:
                    buffer = outputs[piece.output].buffers[piece.region]
                    data = table[reader_process][offset:offset + piece.nbytes]
                    buffer[_index(piece.local)] = data.view(buffer.dtype).reshape(piece.item.shape)
                    received += piece.nbytes if reader_process != process else 0
                offset += aligned(piece.nbytes)

    pipelined(rounds, submit, consume, lambda r: sum(p.item.nbytes for p in r.rows[process]), progress, "broadcast",
              lambda exc, r: read_failure(exc, r.rows[process][0].item.keypath, display))
    return received

