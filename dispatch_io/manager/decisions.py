"""One answer for every process: a save decision that reads a clock is made by process 0.

Hosts' clocks drift. If each process of a job asked ``EveryNSeconds(900)`` itself, one could
save at step 1200 and another not, and the save would wait for the missing ones until it
timed out. So in a multi-process job a clock-reading decision is taken by process 0 and
published through the coordination service; the others wait for it (at most ``timeout``
seconds, then ``BarrierTimeoutError``). Decisions that read no clock are the same everywhere
by construction and cost nothing.

Every process asks in the same order (``should_save`` at every step), so the k-th decision of
a manager is the same question everywhere: it is published as ``decision/<k>`` with its step,
and a process that asked about another step raises, naming both. The keys live in a
:class:`~dispatch_io.multihost.coordination.Room` of the manager's root, cleared when the managers of a
job open it together (a manager made again on the same root never reads an old answer), and
process 0 removes the decision :data:`WINDOW` decisions back, so the service holds a bounded
number of keys however long the run.
"""

from __future__ import annotations

import json
from typing import Callable

from dispatch_io.multihost.coordination import Room
from dispatch_io.errors import BarrierTimeoutError, CheckpointError

WINDOW = 64


class _Published:
    """The k-th value of a sequence process 0 computes and publishes as ``<name>/<k>`` with its step,
    and every other process reads (``room`` None: one process, computed here)."""

    def __init__(self, room: Room | None, name: str):
        self.room, self.name = room, name
        self._asked = 0

    def next(self, step: int, compute: Callable[[], object], late: str, other: str):
        """``compute()`` on process 0 (or alone), its value everywhere. BarrierTimeoutError (``late``) if
        process 0 does not publish it within the room's timeout; CheckpointError (``other``, formatted with
        ``theirs`` and ``mine``) if process 0 published it for another step."""
        room = self.room
        if room is None:
            return compute()
        k, self._asked = self._asked, self._asked + 1
        key = f"{room.prefix}/{self.name}/{k}"
        if room.leader:
            value = compute()
            room.client.key_value_set(key, json.dumps([step, value]), allow_overwrite=True)
            if k >= WINDOW:
                room.client.key_value_delete(f"{room.prefix}/{self.name}/{k - WINDOW}")
            return value
        try:
            theirs, value = json.loads(room.client.blocking_key_value_get(key, int(room.timeout * 1000)))
        except Exception as exc:  # noqa: BLE001 - the service's errors have no type of their own
            raise BarrierTimeoutError(f"process 0 did not {late} within {room.timeout:g} s", processes=[0],
                                      barrier=key) from exc
        if theirs != step:
            raise CheckpointError(other.format(theirs=theirs, mine=step))
        return value


class SharedDecisions:
    """Process 0's answers, shared through ``room`` (None: one process, nothing to share)."""

    def __init__(self, room: Room | None):
        self.room = room
        self._published = _Published(room, "decision")

    def decide(self, step: int, decide: Callable[[], bool]) -> bool:
        """``decide()`` on process 0 (or alone), its answer everywhere."""
        return self._published.next(
            step, decide, f"decide whether to save step {step} (does every process call should_save at every step?)",
            "process 0 asked whether to save step {theirs} where this process asked about step {mine}: every "
            "process must call should_save at the same steps")


class SharedClock:
    """Process 0's clock at each of a sequence of saves, the same on every process: the one time a
    multi-process job records for a step whose processes commit on their own (a local step), so a
    clock-reading keep policy keeps the same steps everywhere. ``room`` None: this process's ``clock``.

    Every process asks in the same order (one question per save, the saves alike everywhere), so the
    k-th answer is published as ``time/<k>`` with its step (as :class:`SharedDecisions` does)."""

    def __init__(self, room: Room | None, clock: Callable[[], float]):
        self.room, self.clock = room, clock
        self._published = _Published(room, "time")

    def time_of(self, step: int) -> float:
        """Process 0's ``clock()`` as it saves ``step``; BarrierTimeoutError if it does not publish it within
        the room's timeout, CheckpointError if it saved another step there (naming both)."""
        return self._published.next(
            step, self.clock, f"share the time of its local save of step {step} (does every process take the same "
            "local saves?)", "process 0 saved step {theirs} locally where this process saved step {mine}: every "
            "process must take the same local saves")
