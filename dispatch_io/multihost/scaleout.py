"""Scale-out restore: in a multi-process job, every stored byte is read once per job, and each
piece goes only to the processes that hold it.

Read naively, each process reads every region its devices hold, so N processes that each hold
a replica read the checkpoint N times (N times the egress, the requests and the time). Here a
restore splits the regions this process holds in two (:func:`plan_split`, the same in every
process):

* **local** regions, held by this process alone: read here, as a single-process restore does;
* **shared** regions, held by several processes (or wanted on the host by all): delivered as
  ``delivery.py`` plans (pure): cut into pieces, each read by one of its holders, in rounds
  whose rows travel only within replica groups -- the processes holding the same regions.

In round k each process reads its next pieces into a row of bytes headed by the round's
identity, and says it is ready. A round's **decision** is published once (``Room.decide``: the
first write wins): "go" when every process is ready, else a reported failure or the processes
that made no progress for ``barrier_timeout`` -- so either every process enters the round's
collective or none does, and each raises the same error. Then one jitted reshard over one
device per process, a ``(groups, members, width)`` array sharded one row per process ->
sharded by group (``rows.gather``: an all-gather within each group; gloo on CPU, NVLink / ICI
on accelerators), gives each process the rows of its group; the headers are checked (a
collective crossed by another thread's fails loudly, never silently); each process copies out
the pieces of the regions it holds. The next round's reads run while a round is exchanged, and
the regions this process holds alone are read between the rounds, one batch after each (so they
are read while a round waits for the others). A round where few members of a group have pieces
is summed over the group instead (``rows.group_sum``: each member writes its part of one row, the
others add zeros), as is a piece over a process's share in a group of more than two; in groups of
two where one member reads, its row is sent to the other alone (``rows.send``, a collective
permute: the other sends nothing back). The last process to be ready decides "go" (an atomic
count on the service), so a round does not wait for a poll.

Bounds, per process: host memory holds at most two reads in flight (a round's pieces, or a batch
of its own regions, which are restored arrays) and one gathered round (``read_batch_bytes`` each,
plus padding) beyond the restored arrays; device memory on the carrying device one round's row and
its gathered copy. A stored chunk larger than the share costs about four times its size while it
is sent.

Every process must restore the same checkpoint onto the same target (same shardings), in the
same order: the plans are compared first, and processes that planned differently all raise.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import itertools
import threading
import time
import types

import jax
import numpy as np

from dispatch_io.multihost.coordination import Room, open_room
from dispatch_io.multihost.delivery import HEADER, Round, plan_delivery
from dispatch_io.multihost.rows import carriers, gather, group_sum, send
from dispatch_io.errors import BarrierTimeoutError, CheckpointError, WorkerError
from dispatch_io.plan.save_plan import device_regions
from dispatch_io.progress import Progress
from dispatch_io.read.loop import RegionReads, each_alone, pipelined, read_failure, verify_stored
from dispatch_io.read.targets import HOST, Output, output_regions
from dispatch_io.plan.batches import aligned
from dispatch_io.workers import aligned_empty


@dataclasses.dataclass(frozen=True)
class Split:
    local: list      # (Output, region): held by this process alone
    rounds: list     # [delivery.Round]
    digest: str      # of the shared part, equal in every process that planned the same restore
    first: int = 0   # how many of ``local``, at its head, were asked for first


@dataclasses.dataclass(frozen=True)
class Exchanged:
    """What a scale-out restore moved between this process and the others."""

    useful: int      # bytes of the result received from other processes' reads
    received: int    # bytes of the rows received through the collectives (headers and padding too)
    sent: int        # bytes of this process's rows sent to others


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


def plan_split(outputs: list, process: int, count: int, chunk_limit: int, batch_limit: int,
               routes=None, first=frozenset()) -> Split:
    """Split the restore of ``outputs`` (sets each ``out.regions``; allocates the buffers of the
    shared regions this process holds) into local regions and the rounds of shared pieces
    (:func:`~dispatch_io.multihost.delivery.plan_delivery`). ``routes(index, out)``, if given, says
    instead which regions travel and who may read them -- ({region: processes it goes to},
    [regions this process reads for itself], {region: processes that may read it}) -- for a
    restore that fills only some regions from this checkpoint (the local tier's). ``first``:
    {(key path, region)} of the local regions read before the others (in order otherwise)."""
    local, shared, seen, readers = [], [], {}, {}
    for index, out in enumerate(outputs):
        if not isinstance(out, Output) or out.saved.stored is None:
            continue
        out.regions = output_regions(out)
        if routes is None:
            held = {region: procs for region, procs in holders(out, count, seen).items() if len(procs) > 1}
            mine = [region for region in out.regions if region not in held]
        else:
            held, mine, may = routes(index, out)
            readers.update({(index, region): procs for region, procs in may.items()})
        local += [(out, region) for region in mine]
        for region, procs in held.items():
            if process in procs:
                out.buffers[region] = aligned_empty(out.buffer_shape(region), out.dtype)
        if held:
            shared.append((index, out, held))
    plan = plan_delivery(shared, count, chunk_limit, batch_limit, readers)
    local.sort(key=lambda item: (item[0].saved.keypath, item[1]) not in first)   # stable: else in order
    return Split(local, plan.rounds, plan.digest, sum((out.saved.keypath, region) in first for out, region in local))


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
    process acts on the same one: all enter the collective, or none does.

    The last process to be ready decides ``GO`` (an atomic count on the service: no poll's delay).
    The leader watches too (its polls read every process's entries, between waits on the
    service for the decision); the others wait on the service for the decision, and watch too
    only if none comes within the timeout: a round costs each of them three operations, not polls
    of P entries. (So a stalled leader is named after up to twice the timeout.)"""
    if room.arrive(f"ready_count/{k}"):   # this process's ready/{k} entry is published: the last one
        room.decide(f"decision/{k}", GO)
    if not room.leader:
        decided = room.wait_for(f"decision/{k}", room.timeout)
        if decided is not None:
            return decided
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
            room.wait_for(f"decision/{k}", pause)
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


def _header(room: Room, k: int) -> np.ndarray:
    """Round ``k``'s identity, at the head of every row (checked after the collective)."""
    digest = hashlib.sha256(f"{room.prefix}/{k}".encode()).digest()
    return np.frombuffer(digest + bytes(HEADER - len(digest)), np.uint8)


def _index(bounds) -> tuple:
    return tuple(slice(lo, hi) for lo, hi in bounds) + (Ellipsis,)


# A job's collectives must be issued in the same order by every process: two restores gathering
# at once from two threads (two dispatchers) could cross and swap rows. One at a time per process
# (and every row is checked for its round, see _rounds).
_ONE_AT_A_TIME = threading.Lock()


def fill_outputs(reader, outputs: list, options, progress: Progress, *, verify: bool, times: list,
                 routes=None, check=None, first=frozenset(), rounds_over=None) -> Exchanged:
    """Fill every output's buffers in a multi-process job, every stored byte read by one
    process (see the module doc); ``verify=True`` checks what this process reads first. All
    processes call it together, restoring the same checkpoints in the same order. Appends the
    time the verify ended to ``times``; returns what this process exchanged with the others.

    Raises WorkerError naming the process and key path of a read that failed anywhere,
    BarrierTimeoutError naming the processes that stopped making progress, ValueError where
    the processes planned different restores. ``routes``: see :func:`plan_split` (``progress.path``
    then names the restore alike in every process: its coordination keys derive from it). ``check``: as
    ``reading.read_regions``, for the regions this process reads for itself alone, and
    ``check(out, region, array, stored bounds)`` for each piece it reads for a round (one it says False
    to, or whose read fails with a ``ChunkError``, is not sent: the caller fills that region again).
    ``first``: as :func:`plan_split`'s. ``rounds_over()``, if given, is called once this process is
    through its last round (at once if it has none; also when a round fails): from then on this restore
    runs no collective, so a caller may start its own on another thread; the rounds then come before
    this process's own reads, not between them."""
    with _ONE_AT_A_TIME:
        return _fill(reader, outputs, options, progress, verify, times, routes, check, first, rounds_over)


def _fill(reader, outputs: list, options, progress: Progress, verify: bool, times: list, routes,
          check=None, first=frozenset(), rounds_over=None) -> Exchanged:
    process, count, display = jax.process_index(), jax.process_count(), progress.path
    split = plan_split(outputs, process, count, options.chunk_bytes, options.read_batch_bytes, routes, first)
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
        mine = [p for r in split.rounds for p in r.row(process)]
        if verify:
            verify_stored(reader, [(outputs[p.output], p.stored.bounds) for p in mine] +
                          [(out, out.stored_bounds(region)) for out, region in split.local],
                          options.read_batch_bytes, progress, on_batch=report)
        times.append(time.perf_counter())
        local = RegionReads(reader, split.local, options.chunk_bytes, options.read_batch_bytes, display, report, check,
                            apart=split.first)
        exchanged = _rounds(reader, outputs, split.rounds, local, room, progress, upcoming, check, rounds_over)
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
    return exchanged


def _rounds(reader, outputs: list, rounds: list, local: RegionReads, room: Room, progress: Progress, upcoming: list,
            check=None, rounds_over=None) -> Exchanged:
    """Run the rounds (see the module doc) and, between them, read this process's own regions
    (``local``: its reads go on while a round waits for the others or is exchanged); returns what
    this process exchanged. ``upcoming[0]``: the next round this process has not said it is ready
    for. ``check``, ``rounds_over``: as :func:`fill_outputs`."""
    process, display = room.process, progress.path
    devices = carriers(room.count)
    useful = received = sent = 0

    def submit(round_: Round):
        if not round_.row(process):
            done = concurrent.futures.Future()
            done.set_result([])
            return done
        return reader.read([p.item for p in round_.row(process)])

    def consume(round_: Round, arrays):
        nonlocal useful, received, sent
        k, group = round_.index, round_.group(process)
        starts = round_.starts(group)
        if round_.summed:  # this process's part of its group's row; zeros elsewhere
            row = np.zeros(round_.width, np.uint8)
        else:
            row = aligned_empty((round_.width,), np.uint8)
        if not round_.summed or process == group[0]:
            row[:HEADER] = _header(room, k)
        offset = starts[process]
        for piece, array in zip(round_.row(process), arrays):
            # checked in memory; a bad piece is not sent (its region is filled again, from the next source)
            if check is None or check(outputs[piece.output], piece.region, array, piece.stored.bounds):
                data = np.asarray(array).reshape(-1).view(np.uint8)
                row[offset:offset + data.size] = data
            offset += aligned(piece.nbytes)
        room.set(f"ready/{k}/{process}", True)
        upcoming[0] = k + 1
        _proceed(room, k, display)
        if not round_.takes_part(process):  # its group reads nothing this round: no collective (all agree)
            return
        if round_.summed:
            table = dict.fromkeys(group, group_sum(row, round_.active, devices))
        elif round_.sent:   # a holder's row to the other member alone
            reader = next(p for p in group if round_.row(p))
            incoming = send(row, round_.active, devices, round_.pairs)
            table = {reader: row if reader == process else incoming}
        else:
            table = dict(zip(group, gather(row, round_.active, devices)))
        if not all((r[:HEADER] == _header(room, k)).all() for r in table.values()):
            raise CheckpointError(f"round {k} of the restore of {display}: the processes' collectives crossed "
                                  "(another collective ran at the same time on some process); nothing was restored")
        for member, data in table.items():
            offset = starts[member]
            for piece in round_.row(member):
                if process in piece.holders:
                    buffer = outputs[piece.output].buffers[piece.region]
                    buffer[_index(piece.local)] = data[offset:offset + piece.nbytes].view(buffer.dtype).reshape(
                        piece.item.shape)
                    useful += piece.nbytes if member != process else 0
                offset += aligned(piece.nbytes)
        got, gave = round_.traffic(process)
        received, sent = received + got, sent + gave

    def again(exc, round_: Round):   # with a check, a piece that cannot be read is left out (as a bad one)
        if check is None:
            raise exc
        return each_alone(reader, [p.item for p in round_.row(process)], exc)

    def through(round_: Round, arrays):
        try:
            consume(round_, arrays)
        finally:
            if round_ is rounds[-1] and rounds_over is not None:
                rounds_over()

    if not rounds and rounds_over is not None:
        rounds_over()
    # One loop: round k, then a batch of this process's own regions, and so on -- each with its own calls;
    # the rounds first where a caller waits to run collectives of its own beside this restore.
    rounds_calls = types.SimpleNamespace(submit=submit, consume=through, again=again,
                                         size=lambda r: sum(p.nbytes for p in r.row(process)),
                                         failure=lambda exc, r: read_failure(exc, r.row(process)[0].item.keypath, display))
    pairs = itertools.zip_longest(rounds, local.batches) if rounds_over is None else \
        [(r, None) for r in rounds] + [(None, b) for b in local.batches]
    work = [(calls, item) for pair in pairs for calls, item in zip((rounds_calls, local), pair) if item is not None]
    # fenced: the rest after what a rebuild waits for; with rounds_over, the first own batch too (the
    # rounds then have the reader to themselves: the caller's collectives wait for them)
    fenced = [b for b in (local.fence, local.batches[0] if rounds_over is not None and rounds and local.batches
                          else None) if b is not None]
    pipelined(work, lambda w: w[0].submit(w[1]), lambda w, result: w[0].consume(w[1], result),
              lambda w: w[0].size(w[1]), progress, "read", lambda exc, w: w[0].failure(exc, w[1]),
              again=lambda exc, w: w[0].again(exc, w[1]), fence=lambda w: any(w[1] is b for b in fenced))
    return Exchanged(useful, received, sent)
