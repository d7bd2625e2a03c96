"""Where a CheckpointManager's numbered steps live: listing, deleting, clearing leftovers.

``<root>/<step>/`` is an ordinary checkpoint. Two kinds of root, one interface:

* :class:`DirectoryRoot`, a local directory: a save appears by rename, a deleted step is renamed
  away first (``.<step>.dispatch_io-deleting-<id>``), so a step is either listed and whole or not
  listed at all.
* :class:`KvRoot`, a kvstore prefix (``s3://``, ``gs://``, ``memory://``): a step is listed once
  its ``COMMITTED`` marker exists, and a deleted step loses that marker before anything else.

Both list only committed dispatch_io checkpoints with step names and delete only those; anything
else under the root is never touched. Leftovers of killed saves are removed only when provably
ours and dead (a ``WRITING`` marker naming a process of this host that no longer runs).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid

from absl import logging

from dispatch_io import manifest as manifest_lib
from dispatch_io.storage import (COMMITTED, DELETING, MANIFEST, TMP_SUFFIX, WRITING, KvLocation, Location,
                                 delete_checkpoint, is_our_marker, marker_is_abandoned, marker_is_ours, writer_is_gone)

STEP = re.compile(r"^(0|[1-9][0-9]*)$")
_OLD = re.compile(r"^(0|[1-9][0-9]*)\.dispatch_io-old-[0-9a-f]+$")
_TMP = re.compile(r"^\.(0|[1-9][0-9]*)" + re.escape(TMP_SUFFIX) + r"-[0-9a-f]+$")
_DELETING = re.compile(r"^\.(0|[1-9][0-9]*)\.dispatch_io-deleting-[0-9a-f]+$")
_MANIFEST_MARK = f'"format": "{manifest_lib.FORMAT}"'.encode()


class StepRoot:
    """The interface the manager uses."""

    display: str

    @staticmethod
    def open(root) -> "StepRoot":
        location = Location.parse(root)
        return KvRoot(location) if isinstance(location, KvLocation) else DirectoryRoot(location.path)

    def step_path(self, step: int) -> str:
        raise NotImplementedError

    def committed_steps(self) -> list[int]:
        """Committed dispatch_io checkpoints with step names, ascending."""
        raise NotImplementedError

    def delete(self, step: int):
        """Unlist ``step`` at once, then remove its data."""
        raise NotImplementedError

    def remove_leftovers(self):
        raise NotImplementedError


# ---- local directories ------------------------------------------------------------------------

def _delete_directory(path: str):
    """Delete a checkpoint directory, its COMMITTED marker last: whatever a crash leaves
    still proves itself ours (or is an empty directory)."""
    shutil.rmtree(os.path.join(path, "arrays"), ignore_errors=True)
    for name in os.listdir(path):
        if name != COMMITTED:
            full = os.path.join(path, name)
            shutil.rmtree(full) if os.path.isdir(full) and not os.path.islink(full) else os.remove(full)
    shutil.rmtree(path)


def _is_checkpoint(path: str) -> bool:
    """A committed checkpoint written by dispatch_io (commit marker and our manifest)."""
    if not (os.path.isdir(path) and not os.path.islink(path) and os.path.isfile(os.path.join(path, COMMITTED))):
        return False
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            return _MANIFEST_MARK in f.read(256)
    except OSError:
        return False


class DirectoryRoot(StepRoot):
    def __init__(self, root: str):
        self.root = self.display = os.path.abspath(os.path.expanduser(root))
        os.makedirs(self.root, exist_ok=True)

    def step_path(self, step: int) -> str:
        return os.path.join(self.root, str(step))

    def committed_steps(self) -> list[int]:
        return sorted(int(name) for name in os.listdir(self.root)
                      if STEP.match(name) and _is_checkpoint(os.path.join(self.root, name)))

    def delete(self, step: int):
        doomed = os.path.join(self.root, f".{step}.dispatch_io-deleting-{uuid.uuid4().hex[:8]}")
        os.rename(self.step_path(step), doomed)  # unlisted at once; a crash below leaves only a hidden leftover
        _delete_directory(doomed)

    def remove_leftovers(self):
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            try:
                if _TMP.match(name) and (writer_is_gone(os.path.join(path, WRITING)) or
                                         writer_is_gone(os.path.join(path, COMMITTED))):
                    shutil.rmtree(path)  # (killed while committing: only COMMITTED names the writer)
                elif _DELETING.match(name) and (is_our_marker(os.path.join(path, COMMITTED)) or
                                                not os.listdir(path)):
                    _delete_directory(path)
                elif _OLD.match(name) and _is_checkpoint(path):
                    final = os.path.join(self.root, name.split(".", 1)[0])
                    if not os.path.lexists(final):  # killed between the two renames: put it back
                        os.rename(path, final)
                    elif _is_checkpoint(final):
                        shutil.rmtree(path)
            except OSError:
                logging.exception("dispatch_io: could not clean up %s", path)


# ---- kvstore prefixes -------------------------------------------------------------------------

class KvRoot(StepRoot):
    def __init__(self, location: KvLocation):
        self.location = location
        self.url, self.display = location.url, location.display
        self.kv = location.open_kv()

    def step_path(self, step: int) -> str:
        return f"{self.url}{step}"

    def _steps(self) -> dict[int, set[str]]:
        """Every step-named prefix and the keys under it (relative to it)."""
        steps: dict[int, set[str]] = {}
        for key in self.kv.list().result():
            name, _, rest = key.decode().partition("/")
            if STEP.match(name) and rest:
                steps.setdefault(int(name), set()).add(rest)
        return steps

    def _read_all(self, keys: list[str]) -> list[bytes | None]:
        reads = [self.kv.read(key) for key in keys]  # in flight together
        return [bytes(r.value) if r.state == "value" else None for r in (f.result() for f in reads)]

    def committed_steps(self) -> list[int]:
        candidates = [step for step, keys in self._steps().items() if {COMMITTED, MANIFEST} <= keys]
        markers = self._read_all([f"{step}/{COMMITTED}" for step in candidates])
        return sorted(step for step, marker in zip(candidates, markers) if marker_is_ours(marker))

    def delete(self, step: int):
        delete_checkpoint(self.location.open_kv(f"{step}/"))  # COMMITTED first: unlisted at once

    def remove_leftovers(self):
        """Uncommitted step prefixes our markers prove ours and abandoned: an unfinished delete
        (``DELETING``) or save (``WRITING``) of a process of this host that no longer runs it.
        Only our own keys are removed."""
        steps = [step for step, keys in self._steps().items()
                 if COMMITTED not in keys and (DELETING in keys or WRITING in keys)]
        deleting = self._read_all([f"{step}/{DELETING}" for step in steps])
        writing = self._read_all([f"{step}/{WRITING}" for step in steps])
        for step, d, w in zip(steps, deleting, writing):
            if marker_is_abandoned(d) or marker_is_abandoned(w):
                try:
                    self.delete(step)
                except ValueError:
                    logging.exception("dispatch_io: could not clean up %s%s/", self.url, step)
