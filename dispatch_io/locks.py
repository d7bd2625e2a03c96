"""Per-path locks: saves to one checkpoint path never overlap."""

from __future__ import annotations

import threading


class PathLocks:
    """One lock per checkpoint path, so that saves to one path never overlap; entries go away
    when no save holds or waits for them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._locks: dict[str, list] = {}  # key -> [lock, saves holding or waiting for it]

    def acquire(self, key: str):
        with self._lock:
            entry = self._locks.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        try:
            entry[0].acquire()
        except BaseException:  # interrupted while waiting
            self._leave(key, held=False)
            raise

    def release(self, key: str):
        self._leave(key, held=True)

    def _leave(self, key: str, held: bool):
        with self._lock:
            entry = self._locks[key]
            if held:
                entry[0].release()
            entry[1] -= 1
            if entry[1] == 0:
                del self._locks[key]

    def __len__(self) -> int:
        return len(self._locks)
