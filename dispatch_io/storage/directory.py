"""Checkpoints in local directories: write beside, then rename into place.

A save writes into a temporary sibling of its path (``.<name>.dispatch_io-tmp-<id>``, one per
save, claimed by a ``WRITING`` marker), fsyncs it, writes ``manifest.json`` then ``COMMITTED``
and renames it into place. A checkpoint it replaces is first moved aside
(``<name>.dispatch_io-old-<id>``) and put back if the rename fails. A manager's step is deleted by
renaming it away first (``.<step>.dispatch_io-deleting-<id>``), so a step is either listed and
whole or not listed at all. These sibling names are built and recognised by :class:`SiblingName`
alone; whatever a crash leaves under them is cleared by :meth:`DirectoryRoot.remove_leftovers`,
only when provably ours and dead.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import uuid
from typing import Mapping

from absl import logging

from dispatch_io.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from dispatch_io.storage import (ARRAYS, COMMITTED, MANIFEST, MANIFEST_MARK, MAX_MANIFEST_BYTES, STEP, WRITING, JoinedWrite,
                                 Location, StepRoot, WriteTarget, manifest_doc)
from dispatch_io.storage.markers import Marker


class SiblingName:
    """One kind of name dispatch_io gives a sibling of a checkpoint directory:
    ``[.]<name>.dispatch_io-<kind>-<hex id>`` (``.``: ``hidden``)."""

    def __init__(self, kind: str, hidden: bool, id_chars: int):
        self.kind, self.id_chars = kind, id_chars
        self.prefix = "." if hidden else ""
        self._pattern = re.compile(re.escape(self.prefix) + r"(.+)\.dispatch_io-" + kind + r"-[0-9a-f]+")

    def make(self, name: str) -> str:
        """A new name of this kind for checkpoint ``name`` (a random id: never one in use)."""
        return f"{self.prefix}{name}.dispatch_io-{self.kind}-{uuid.uuid4().hex[:self.id_chars]}"

    def parse(self, entry: str) -> str | None:
        """The checkpoint name ``entry`` was made from by :meth:`make`, or None if it was not."""
        match = self._pattern.fullmatch(entry)
        return match[1] if match else None

    def step(self, entry: str) -> str | None:
        """As :meth:`parse`, but only for a manager's step name (else None)."""
        name = self.parse(entry)
        return name if name is not None and STEP.match(name) else None


TEMPORARY = SiblingName("tmp", hidden=True, id_chars=12)      # a save being written
REPLACED = SiblingName("old", hidden=False, id_chars=8)       # a checkpoint an overwrite moved aside
DELETED = SiblingName("deleting", hidden=True, id_chars=8)    # a manager's step being deleted


def _arrays_kvstore(directory: str, arrays: str = ARRAYS) -> dict:
    return {"driver": "file", "path": os.path.join(directory, arrays)}


def links_outside(directory: str) -> list[str]:
    """The symbolic links under ``directory`` (which may itself be a link) whose target is not
    inside it, or does not exist, relative to it; the tree is walked without following links.
    A folder under it that is gone by the time the walk reaches it is passed over: a save
    committing beside the walk renames or removes its temporary folders (a local step's parity
    rows are written while its promotion opens the step). FileNotFoundError if ``directory`` is."""
    root = os.path.realpath(directory)
    found, pending = [], [directory]
    while pending:
        path = pending.pop()
        try:
            entries = os.scandir(path)
        except FileNotFoundError:
            if path == directory:
                raise
            continue
        with entries:
            for entry in entries:
                if entry.is_symlink():
                    target = os.path.realpath(entry.path)
                    if os.path.commonpath([root, target]) != root or not os.path.exists(target):
                        found.append(os.path.relpath(entry.path, directory))
                elif entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
    return sorted(found)


MAX_MARKER_BYTES = 1 << 16   # a commit marker is a few hundred bytes


def read_regular(path: str, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (a link followed). OSError if it cannot be read;
    ValueError if it is not a regular file or holds more than ``limit`` bytes, found before
    anything is read (a FIFO is never opened blocking, ``/dev/zero`` never read)."""
    with _open_regular(path) as f:
        data = f.read(limit + 1) if os.fstat(f.fileno()).st_size <= limit else None
    if data is None or len(data) > limit:
        raise ValueError(f"is larger than {limit} bytes")
    return data


def _open_regular(path: str):
    """``path`` opened for reading in binary; ValueError (nothing opened) unless a regular file."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError("is not a regular file")
    f = open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb")
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # replaced since the stat
        f.close()
        raise ValueError("is not a regular file")
    return f


def _read(path: str, limit: int = MAX_MARKER_BYTES) -> bytes | None:
    """The bytes of the regular file ``path`` (:func:`read_regular`), or None if it cannot be read."""
    try:
        return read_regular(path, limit)
    except (OSError, ValueError):
        return None


def _write_file(path: str, data: bytes, fsync: bool):
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def _fsync_path(path: str, directory: bool = False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirectoryLocation(Location):
    """A checkpoint in the local directory ``path`` (``~`` expanded, made absolute)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(os.path.expanduser(path))
        self.display = path

    def arrays_kvstore(self, arrays: str = ARRAYS) -> dict:
        return _arrays_kvstore(self.path, arrays)

    def is_committed(self) -> bool:
        return os.path.isfile(os.path.join(self.path, COMMITTED))

    def commit_marker(self) -> bytes | None:
        return _read(os.path.join(self.path, COMMITTED))

    def read_file(self, key: str) -> bytes | None:
        return _read(os.path.join(self.path, key), MAX_MANIFEST_BYTES)

    def read_manifest(self) -> dict:
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"no checkpoint at {self.display}: the path does not exist")
        if not os.path.isdir(self.path):
            raise IncompleteCheckpointError(f"{self.display} is a file, not a checkpoint directory")
        if not self.is_committed():
            raise IncompleteCheckpointError(
                f"{self.display} holds no committed checkpoint (no {COMMITTED} marker): "
                "the save failed, was interrupted, is still running, or this is not a dispatch_io checkpoint")
        try:
            data = read_regular(os.path.join(self.path, MANIFEST), MAX_MANIFEST_BYTES)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{self.display}: malformed checkpoint: its {MANIFEST} {exc}",
                                         path=self.display) from exc
        except OSError as exc:
            raise IncompleteCheckpointError(f"{self.display} is marked committed but its {MANIFEST} "
                                            f"cannot be read: {exc}") from exc
        return manifest_doc(data, self.display)

    def links_outside(self) -> list[str]:
        """The symbolic links in the checkpoint that lead outside it (or nowhere), as paths
        relative to it: a reader refuses such a checkpoint rather than read another file."""
        return links_outside(self.path)

    @property
    def key(self) -> str:
        return self.path

    def check_writable(self, overwrite: bool):
        """FileExistsError unless nothing (or an empty directory) is at the path, or a committed
        checkpoint and ``overwrite``. Anything else (a file, a directory of other things) is never
        replaced: ``overwrite=True`` on a mistyped path must not delete someone's data."""
        if not os.path.lexists(self.path):
            return
        if self.is_committed():
            if not overwrite:
                raise FileExistsError(f"a checkpoint is already committed at {self.display}; pass overwrite=True to replace it")
            return
        if not os.path.isdir(self.path) or os.path.islink(self.path) or os.listdir(self.path):
            raise FileExistsError(f"{self.display} exists and is not a dispatch_io checkpoint; refusing to "
                                  "replace it, even with overwrite=True (remove it first if it may go)")

    def start_write(self, overwrite: bool) -> "DirectoryWrite":
        self.check_writable(overwrite)
        return DirectoryWrite(self, overwrite)

    def join_write(self, token: str) -> JoinedWrite:
        parent, name = os.path.split(self.path)
        tmp = os.path.join(parent, token)
        if not (TEMPORARY.parse(token) == name and os.path.isfile(os.path.join(tmp, WRITING))):
            raise CheckpointError(f"cannot join the save of {self.display}: {tmp} is not its temporary directory "
                                  "(do all processes see the same file system?)")
        return JoinedWrite(_arrays_kvstore(tmp), None, token)


class DirectoryWrite(WriteTarget):
    """One save of a directory checkpoint, into its own temporary sibling (``token`` is that
    sibling's name). Creating one makes the sibling and its ``WRITING`` marker (OSError if it
    cannot, with nothing left behind)."""

    def __init__(self, location: DirectoryLocation, overwrite: bool):
        self.location = location
        self.overwrite = overwrite
        parent, name = os.path.split(location.path)
        os.makedirs(parent, exist_ok=True)
        # One directory per save: two saves of one path never share (or delete) each other's data.
        self.token = TEMPORARY.make(name)
        self.tmp = os.path.join(parent, self.token)
        os.makedirs(os.path.join(self.tmp, ARRAYS))
        try:
            with open(os.path.join(self.tmp, WRITING), "wb") as f:
                f.write(Marker.new().encode())
        except BaseException:
            self.abort()
            raise
        self.kvstore = _arrays_kvstore(self.tmp)
        self.context = None

    def commit(self, manifest: bytes, fsync: bool = True, files: Mapping[str, bytes] | None = None):
        """Write ``files``, the manifest and ``COMMITTED``, then rename the directory into place (moving a
        replaced checkpoint aside first, and back if the rename fails). FileExistsError if the
        path was taken meanwhile (see ``check_writable``); OSError if the file system fails."""
        final = self.location.path
        for name, data in (files or {}).items():
            _write_file(os.path.join(self.tmp, name), data, fsync)
        _write_file(os.path.join(self.tmp, MANIFEST), manifest, fsync)
        if fsync:
            for root, dirs, _ in os.walk(self.tmp):
                for d in dirs:
                    _fsync_path(os.path.join(root, d), directory=True)
        _write_file(os.path.join(self.tmp, COMMITTED), Marker.new().encode(), fsync)
        # Only now: until the rename, one of the two markers always names this process, so a
        # manager can prove the directory a leftover if this process is killed.
        os.remove(os.path.join(self.tmp, WRITING))
        if fsync:
            _fsync_path(self.tmp, directory=True)
        self.location.check_writable(self.overwrite)  # again: another save may have committed meanwhile
        old = None
        if os.path.lexists(final):
            parent, name = os.path.split(final)
            old = os.path.join(parent, REPLACED.make(name))
            os.rename(final, old)
        try:
            os.rename(self.tmp, final)
        except BaseException:
            if old is not None:  # put the replaced checkpoint back rather than lose it
                os.rename(old, final)
            raise
        if fsync:
            _fsync_path(os.path.dirname(final), directory=True)
        if old is None:
            return
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:  # a file, or a link to a checkpoint: the link goes, the checkpoint it named stays
            os.remove(old)

    def abort(self):
        shutil.rmtree(self.tmp, ignore_errors=True)


# ---- a manager's steps ---------------------------------------------------------------------------

def _delete_directory(path: str):
    """Delete a checkpoint directory, its COMMITTED marker last: whatever a crash leaves
    still proves itself ours (or is an empty directory). OSError if it cannot."""
    shutil.rmtree(os.path.join(path, ARRAYS.rstrip("/")), ignore_errors=True)  # (a link is not followed)
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
        with _open_regular(os.path.join(path, MANIFEST)) as f:
            return MANIFEST_MARK.match(f.read(256)) is not None
    except (OSError, ValueError):
        return False


class DirectoryRoot(StepRoot):
    """A manager's steps in a local directory (made if missing); ``display`` is its absolute path.
    A save appears by rename; a deleted step is renamed away first (:data:`DELETED`)."""

    def __init__(self, location: DirectoryLocation):
        self.root = self.display = location.path
        os.makedirs(self.root, exist_ok=True)

    def step_path(self, step: int) -> str:
        return os.path.join(self.root, str(step))

    def committed_steps(self, listed=None) -> list[int]:
        names = os.listdir(self.root) if listed is None else listed.names()
        return sorted(int(name) for name in names
                      if STEP.match(name) and _is_checkpoint(os.path.join(self.root, name)))

    def delete(self, step: int):
        """OSError if the step cannot be renamed away (it stays listed) or removed (a hidden
        leftover stays, cleared by the next :meth:`remove_leftovers`)."""
        doomed = os.path.join(self.root, DELETED.make(str(step)))
        os.rename(self.step_path(step), doomed)  # unlisted at once; a crash below leaves only a hidden leftover
        _delete_directory(doomed)

    def remove_leftovers(self):
        """A killed save's temporary directory whose marker names a process of this host that
        is gone (:attr:`Marker.process_gone`: never one of this process, which may still be
        writing it); an unfinished delete; a checkpoint moved aside by an overwrite that was
        killed (put back if its step is missing, else removed)."""
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            try:
                if TEMPORARY.step(name) and (Marker.read(os.path.join(path, WRITING)).process_gone or
                                             Marker.read(os.path.join(path, COMMITTED)).process_gone):
                    shutil.rmtree(path)  # (killed while committing: only COMMITTED names the writer)
                elif DELETED.step(name) and (Marker.read(os.path.join(path, COMMITTED)).ours or
                                             not os.listdir(path)):
                    _delete_directory(path)
                elif REPLACED.step(name) and _is_checkpoint(path):
                    final = os.path.join(self.root, REPLACED.step(name))
                    if not os.path.lexists(final):  # killed between the two renames: put it back
                        os.rename(path, final)
                    elif _is_checkpoint(final):
                        shutil.rmtree(path)
            except OSError:
                logging.exception("dispatch_io: could not clean up %s", path)
