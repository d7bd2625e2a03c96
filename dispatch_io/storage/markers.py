"""Markers: the small JSON files that prove who wrote a checkpoint, and whether it still runs.

Every ``WRITING``, ``COMMITTED`` and ``DELETING`` marker dispatch_io writes says who wrote it::

    {"host": "node-7", "pid": 4242, "started": "123456", "time": 1718000000.0, "id": "<32 hex>"}

``started`` is the writing process's start time (clock ticks since boot, from ``/proc``; None
where there is no ``/proc``): with the pid it names one process even after the pid is reused.
``id`` names one operation (a save or a delete) and makes every ``COMMITTED`` unique.

Nothing is ever deleted on a guess: a leftover may go only when its marker proves it ours
(:attr:`Marker.ours`) and its writer dead (:attr:`Marker.process_gone`, :attr:`Marker.abandoned`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import threading
import time
import uuid


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, as ``/proc/<pid>/stat`` says).

    Returns None if there is no such process (or no ``/proc``). With the pid it identifies a
    process even after its pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class LiveOperations:
    """The ids of this process's operations (kvstore saves and deletes) that are under way.

    A marker naming this very process cannot be judged by its pid (the process runs, so every
    operation it ever started would look alive): it is alive while its id is registered here.
    One that names this process but is not registered was left by an operation of ours that
    failed, and may be taken over. The registry is process-wide (:data:`LIVE`) because a marker
    names a process, not an object: every location and root of this process must see the same
    set. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ids: set[str] = set()

    def add(self, operation_id: str):
        with self._lock:
            self._ids.add(operation_id)

    def discard(self, operation_id: str):
        """Forget ``operation_id`` (no error if it is not registered)."""
        with self._lock:
            self._ids.discard(operation_id)

    def __contains__(self, operation_id: object) -> bool:
        with self._lock:
            return operation_id in self._ids

    @contextlib.contextmanager
    def live(self, marker: "Marker"):
        """While the block runs, the operation ``marker`` names counts as alive in this process."""
        self.add(marker.id)
        try:
            yield
        finally:
            self.discard(marker.id)


LIVE = LiveOperations()


@dataclasses.dataclass(frozen=True)
class Marker:
    """The contents of one marker. Build one with :meth:`new` (to write) or :meth:`parse` /
    :meth:`read` (found in storage); a field is None where the marker does not have it."""

    host: str | None = None
    pid: int | None = None
    started: str | None = None
    time: float | None = None
    id: str | None = None

    @classmethod
    def new(cls) -> "Marker":
        """A marker naming this process and a new operation id."""
        return cls(socket.gethostname(), os.getpid(), process_start(os.getpid()), time.time(), uuid.uuid4().hex)

    def encode(self) -> bytes:
        """The bytes to store (JSON)."""
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def parse(cls, data: bytes | None) -> "Marker":
        """The marker stored as ``data`` (None: there is none). Never raises: bytes that are not
        a dispatch_io marker give an empty marker, which is not :attr:`ours`."""
        try:
            fields = json.loads(data)
            return cls(fields["host"], int(fields["pid"]), fields.get("started"), fields.get("time"), fields["id"])
        except (ValueError, TypeError, KeyError, RecursionError):  # RecursionError: JSON nested too deep
            return cls()

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Marker":
        """The marker in file ``path`` (an empty one if the file cannot be read)."""
        try:
            with open(path, "rb") as f:
                return cls.parse(f.read())
        except OSError:
            return cls()

    @property
    def ours(self) -> bool:
        """Written by dispatch_io (it names a host, a process and an operation)."""
        return None not in (self.host, self.pid, self.id)

    @property
    def here(self) -> bool:
        """One of ours, written on this host."""
        return self.ours and self.host == socket.gethostname()

    @property
    def process_gone(self) -> bool:
        """One of ours, and the process that wrote it provably no longer runs: same host, and
        that pid is gone or belongs to a later process. Never true for this process, whatever
        became of the operation (a directory save of this process is not registered in
        :data:`LIVE`, so only the process can be judged)."""
        return self.here and self.started is not None and process_start(self.pid) != self.started

    @property
    def alive(self) -> bool:
        """The operation still runs in a process of this host: for this process, its id is
        registered in :data:`LIVE`; for another, that process has not provably exited."""
        if not self.here:
            return False
        if self.pid == os.getpid():
            return self.id in LIVE
        return not self.process_gone

    @property
    def abandoned(self) -> bool:
        """One of ours, written on this host by an operation that provably no longer runs (its
        process exited, or it is this process's and no longer registered in :data:`LIVE`)."""
        return self.here and not self.alive
