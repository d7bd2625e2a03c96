"""``Dispatcher.verify`` in a multi-process job: each stored chunk is checked by one process.

Every process plans the same chunks (from the manifest) and checks its share of them
(``reading.share_of``: even in bytes, the same split everywhere), then publishes what it found
and waits for the others' findings. So the job reads each stored byte once, not once per
process, and every process raises the same error:

* a process that could not check its share (a chunk it cannot read, an interrupt): every
  process raises for it (that process its own exception; the others a ``WorkerError``, or a
  ``CorruptCheckpointError`` where the failure was an unreadable chunk), naming it and the leaf;
* otherwise, chunks that do not match their checksums, wherever found: one
  ``CorruptCheckpointError`` listing them all, in key path order.

A process whose wait for the others times out (``BarrierTimeoutError``) leaves word, so that one
that comes late raises too instead of waiting for it at the end.
"""

from __future__ import annotations

import jax

from dispatch_io.multihost.coordination import open_room
from dispatch_io.errors import BarrierTimeoutError, CheckpointError, CorruptCheckpointError, WorkerError
from dispatch_io.progress import Progress
from dispatch_io.read.loop import mismatches, needed_regions, verify_stored


def verify_shared(reader, outputs: list, batch_limit: int, timeout: float, progress: Progress, *, compare: bool):
    """Check this process's share of the stored chunks of ``outputs`` (all processes call it
    together, for the same checkpoint), then raise what any process found (see the module doc).

    ``batch_limit``: most bytes one read call checks (``reading.verify_stored``); ``timeout``:
    seconds to wait for processes that make no progress (then ``BarrierTimeoutError``);
    ``compare``: compare with the saved checksums (else only read every chunk)."""
    process, count, display = jax.process_index(), jax.process_count(), progress.path
    room = open_room("verify", display, f"the verify of {display}", timeout)
    wanted = [(out, out.stored_bounds(region)) for out, region in needed_regions(outputs)]
    mine, outcome = None, {}
    try:
        verify_stored(reader, wanted, batch_limit, progress, compare=compare, share=(process, count),
                      on_batch=lambda done: room.set(f"progress/{process}", done))  # moves the others' deadlines
    except CorruptCheckpointError as exc:
        mine, outcome = exc, {"bad": exc.chunks} if exc.chunks else _failure(exc)
    except BaseException as exc:
        mine, outcome = exc, _failure(exc)
    room.set(f"outcome/{process}", outcome)
    if mine is not None and not isinstance(mine, Exception):  # KeyboardInterrupt: the others see it
        raise mine
    try:
        outcomes = room.gather("outcome", doing="finish verifying their part of", check=lambda: _check_left(room),
                               together=False)
    except BarrierTimeoutError:
        room.set("left", process)  # a late process must not wait for this one to leave together
        raise
    _check_left(room)
    failed = sorted(p for p, found in outcomes.items() if "error" in found)
    if failed:  # its process may be gone: nobody waits for the others to leave
        first = outcomes[failed[0]]
        if failed[0] == process:
            raise mine
        message = f"process {failed[0]} could not verify its part of {display}: {first['error']}"
        if first["corrupt"]:
            raise CorruptCheckpointError(message, keypath=first["keypath"])
        raise WorkerError(message, worker=failed[0], keypath=first["keypath"])
    room.close()
    bad = sorted((keypath, tuple(grid), tuple(map(tuple, region)), saved, read)  # JSON made them lists
                 for found in outcomes.values() for keypath, grid, region, saved, read in found.get("bad", ()))
    if bad:
        raise mismatches(display, bad)


def _check_left(room):
    """Raise if a process stopped waiting for the others (its wait timed out)."""
    left = room.get("left")
    if left is not None:
        raise CheckpointError(f"process {left} gave up waiting for the other processes' parts of {room.what} "
                              f"after {room.timeout:g} s (barrier_timeout), so it fails here too")


def _failure(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}", "keypath": getattr(exc, "keypath", None),
            "corrupt": isinstance(exc, CorruptCheckpointError)}
