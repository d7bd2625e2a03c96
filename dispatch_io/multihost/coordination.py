"""The coordination service, as one collective operation of a ``jax.distributed`` job sees it.

A :class:`Room` is the keys and barriers of one operation (a save or a restore of one path)
under ``dispatch_io/<kind>/<hash of the path>/``. Keys and barrier ids derive from the path and
the phase only -- never from process-local counters, which diverge. The save's commit protocol
(``commit.py``) and the scale-out restore (``scaleout.py``) both talk through one, so waiting,
timing out and naming the processes that never came are written once:

* :meth:`Room.barrier` waits until every process is there;
* :meth:`Room.gather` waits until every process has published a phase's value (the deadline
  moves while the missing ones report progress);
* :meth:`Room.from_leader` waits for what process 0 published.

Each raises :class:`BarrierTimeoutError` naming the processes that did not arrive in time. A gather
names the processes it still waits for long before that (absl WARNING and a jax.monitoring event,
:func:`first_straggler_report`): at a thousand hosts, one slow process holds every other at the
next gather, and the log says which.
"""

from __future__ import annotations

import hashlib
import json
import time

import jax
from absl import logging

from dispatch_io.errors import BarrierTimeoutError, CheckpointError

STRAGGLER_EVENT = "/dispatch_io/straggler_wait_secs"   # a gather still waiting for some processes


def job_client():
    """The coordination service client of this ``jax.distributed`` job; RuntimeError if there is
    none although several processes run."""
    from jax._src.distributed import global_state  # the coordination service's client

    if global_state.client is None:
        raise RuntimeError("several JAX processes but no coordination service client: "
                           "call jax.distributed.initialize() before creating a dispatcher")
    return global_state.client


class Room:
    """One operation's keys and barriers.

    Args:
      client: the coordination service client (:func:`job_client`).
      process, count: this process's index and the number of processes.
      timeout: seconds a wait goes on while the others make no progress.
      kind: ``"save"`` or ``"restore"`` (keeps their keys apart).
      key: what identifies the operation among concurrent ones (the checkpoint path's key).
      what: the operation in messages (``"the save to ckpt/7"``).
    """

    def __init__(self, client, process: int, count: int, timeout: float, kind: str, key: str, what: str):
        self.client, self.process, self.count, self.timeout = client, process, count, timeout
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        self.prefix = f"dispatch_io/{kind}/{digest}"
        self.arrivals = f"dispatch_io/arrived/{kind}/{digest}"
        self.what = what
        self.leader = process == 0

    def open(self):
        """Start the operation together: once every process is here (none is still in an
        earlier operation on the path, reading its keys), the leader clears those keys."""
        self.barrier("begin")
        if self.leader:
            self.client.key_value_delete(self.prefix + "/")
        self.barrier("opened")

    def close(self):
        """Leave together; the leader removes the operation's keys."""
        self.barrier("end")
        if self.leader:
            self.client.key_value_delete(self.prefix + "/")
            self.client.key_value_delete(self.arrivals + "/")

    def set(self, key: str, value):
        """Publish ``value`` (JSON) under ``key``."""
        self.client.key_value_set(f"{self.prefix}/{key}", json.dumps(value), allow_overwrite=True)

    def get(self, key: str):
        """The value published under ``key``, or None if there is none (yet)."""
        try:
            return json.loads(self.client.key_value_try_get(f"{self.prefix}/{key}"))
        except Exception:  # noqa: BLE001 - NOT_FOUND has no exception type of its own
            return None

    def wait_for(self, key: str, seconds: float):
        """The value published under ``key``, waiting up to ``seconds`` for it (the service holds
        the request: no polling); None if nothing was published by then."""
        try:
            return json.loads(self.client.blocking_key_value_get(f"{self.prefix}/{key}", max(1, int(seconds * 1000))))
        except Exception:  # noqa: BLE001 - DEADLINE_EXCEEDED has no exception type of its own
            return None

    def decide(self, key: str, value):
        """Publish ``value`` under ``key`` unless something was published there first; returns
        what is there now. Every process that decides the same key gets the same answer."""
        try:
            self.client.key_value_set(f"{self.prefix}/{key}", json.dumps(value), allow_overwrite=False)
            return value
        except Exception:  # noqa: BLE001 - ALREADY_EXISTS has no type of its own: the key tells
            decided = self.get(key)
            if decided is None:
                raise
            return decided

    def arrive(self, key: str) -> bool:
        """Count this process in under ``key`` (each process once); True for exactly one process: the
        last of the ``count`` to arrive (an atomic increment on the service)."""
        return self.client.key_value_increment(f"{self.prefix}/{key}", 1) == self.count

    def entries(self, directory: str) -> dict[int, object]:
        """{process: value} of what the processes published as ``directory/<process>``."""
        found = self.client.key_value_dir_get(f"{self.prefix}/{directory}/")
        return {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in found}

    def _report_stragglers(self, phase: str, doing: str | None, missing: list[int], waited: float, left: float):
        """Log (absl WARNING) and record (``/dispatch_io/straggler_wait_secs``) that this process has
        waited ``waited`` seconds for ``missing`` at ``phase``. Never raises: it is a report."""
        logging.warning("dispatch_io: process %d has waited %.1f s for process(es) %s to %s %s "
                        "(a timeout in %.0f s unless they make progress)", self.process, waited, missing,
                        doing or f"reach {phase!r} of", self.what, max(left, 0.0))
        try:
            jax.monitoring.record_event_duration_secs(STRAGGLER_EVENT, waited)
        except Exception:  # noqa: BLE001 - a metrics sink's bug must not fail the checkpoint
            logging.exception("dispatch_io: a jax.monitoring listener raised for %s", STRAGGLER_EVENT)

    def barrier(self, phase: str):
        """Wait until every process is here. Each process records its arrival first (outside
        the operation's keys, which the leader clears on open while others may already be
        waiting), so a timeout names the processes that never came."""
        barrier = f"{self.prefix}/{phase}"
        arrivals = f"{self.arrivals}/{phase}/"
        self.client.key_value_set(f"{arrivals}{self.process}", "1", allow_overwrite=True)
        started = time.monotonic()
        try:
            self.client.wait_at_barrier(barrier, int(self.timeout * 1000))
        except Exception as exc:  # noqa: BLE001 - the service's errors have no type of their own
            timed_out = time.monotonic() - started >= self.timeout * 0.99
            try:
                arrived = {int(k.rsplit("/", 1)[1]) for k, _ in self.client.key_value_dir_get(arrivals)}
            except Exception:  # noqa: BLE001 - the service itself is gone
                arrived = set(range(self.count))
            missing = sorted(set(range(self.count)) - arrived)
            if not (missing or timed_out):
                raise CheckpointError(f"barrier '{phase}' of {self.what} failed (is the coordination "
                                      f"service, on process 0, still up?): {exc}") from exc
            who = f"process(es) {missing}" if missing else "some processes"
            raise BarrierTimeoutError(f"{who} did not reach barrier '{phase}' of {self.what} within "
                                      f"{self.timeout:g} s", processes=missing, barrier=barrier) from exc

    def from_leader(self, phase: str):
        """What process 0 published for ``phase`` (waiting up to the timeout for it)."""
        try:
            return json.loads(self.client.blocking_key_value_get(f"{self.prefix}/{phase}",
                                                                 int(self.timeout * 1000)))
        except Exception as exc:  # noqa: BLE001 - not there in time, or the service is gone
            raise BarrierTimeoutError(f"process 0 did not {phase} {self.what} within {self.timeout:g} s: {exc}",
                                      processes=[0], barrier=f"{self.prefix}/{phase}") from exc

    def gather(self, phase: str, *, doing: str | None = None, check=None, together: bool = True) -> dict[int, object]:
        """Wait until every process has published ``phase/<process>`` (each calls it once, after
        publishing); returns {process: value}. The last to arrive says so, ending the others' waits
        at once (between polls of the entries, which also catch a last arrival that never says so).

        The deadline moves while a missing process still publishes ``progress/<process>``.
        ``check()`` (optional) is called while waiting and raises to end the wait early (e.g.
        another process reported a failure). ``together``: then a barrier, so all leave
        together. ``doing`` says what the missing processes did not do, in the timeout's
        message (default: reach the phase)."""
        started = time.monotonic()
        deadline, report_at = started + self.timeout, started + first_straggler_report(self.timeout)
        last_progress, pause = None, 0.002
        if self.arrive(f"arrived/{phase}"):   # the last to arrive wakes the others' waits below
            self.set(f"complete/{phase}", True)
        while True:
            entries = self.entries(phase)
            if len(entries) == self.count:
                break
            if check is not None:
                check()
            progress = self.entries("progress")
            if progress != last_progress:
                last_progress, deadline = progress, time.monotonic() + self.timeout
            now = time.monotonic()
            if now >= report_at:   # name who holds the job back, long before the timeout names them
                self._report_stragglers(phase, doing, sorted(set(range(self.count)) - set(entries)),
                                        now - started, deadline - now)
                report_at = started + 2 * (now - started)
            if now > deadline:
                missing = sorted(set(range(self.count)) - set(entries))
                raise BarrierTimeoutError(
                    f"process(es) {missing} did not {doing or f'reach {phase!r} of'} {self.what} "
                    f"and made no progress for {self.timeout:g} s",
                    processes=missing, barrier=f"{self.prefix}/{phase}")
            self.wait_for(f"complete/{phase}", pause)   # the service holds it until the last arrives
            pause = min(pause * 2, 0.2)
        if together:
            self.barrier(phase)
        return entries


def first_straggler_report(timeout: float) -> float:
    """Seconds a gather waits before it first names the processes it waits for (then again each
    time the wait has doubled): a tenth of ``timeout``, at least 5 s and at most 60 s (never past the
    timeout), so a slow process is named while there is time to act on it."""
    return min(max(timeout / 10, 5.0), 60.0, timeout)


def open_room(kind: str, key: str, what: str, timeout: float) -> Room:
    """A :class:`Room` of the running job (all processes call it together) and opened."""
    room = Room(job_client(), jax.process_index(), jax.process_count(), timeout, kind, key, what)
    room.open()
    return room
