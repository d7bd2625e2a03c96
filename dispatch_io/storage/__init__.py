"""Where a checkpoint lives, how it is committed, and where a manager's numbered steps live.

A path maps to a :class:`Location` (``Location.parse``), one implementation per backend:

* a local directory (``str`` / ``os.PathLike``, relative or absolute, or ``file://``): data is
  written into a temporary sibling (one per save, marked with a ``WRITING`` file that says who
  made it), files and directories are fsynced, ``manifest.json`` then ``COMMITTED`` are written
  last, and the directory is renamed into place. Nothing at ``path`` is ever half-written. See
  :mod:`dispatch_io.storage.directory`.
* a kvstore URL: ``s3://bucket/prefix``, ``gs://bucket/prefix`` (object stores) or ``memory://``
  (tests): there is no rename, so a save claims the prefix (``WRITING``), writes its arrays under
  ``arrays/<save id>/`` and the ``COMMITTED`` marker, written last, is what makes it visible.
  Readers and listings ignore a prefix without it; an overwrite deletes the old marker first.
  See :mod:`dispatch_io.storage.objectstore`.

Both layouts are identical once committed::

    <path>/manifest.json   versioned description of the tree (see manifest.py)
    <path>/arrays/<name>/  one zarr3 array per stored leaf
    <path>/COMMITTED       written last

A :class:`StepRoot` (``StepRoot.open``) is the folder of a CheckpointManager: ``<root>/<step>/``
is an ordinary checkpoint. Both kinds list only committed dispatch_io checkpoints with step names
and delete only those; anything else under the root is never touched. Leftovers of killed saves
are removed only when their markers (:mod:`dispatch_io.storage.markers`) prove them ours and dead.
"""

from __future__ import annotations

import os
import re
from typing import Mapping

import tensorstore as ts

from dispatch_io.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from dispatch_io.storage import sealed

# The keys of a checkpoint (relative to its path). ARRAYS is the default folder of the arrays (a
# manifest names another one when a save wrote its arrays elsewhere).
FORMAT = "dispatch_io"     # the "format" a manifest.json of ours starts with
MANIFEST = "manifest.json"
ARRAYS = "arrays/"
MAX_MANIFEST_BYTES = 256 << 20   # a larger manifest.json is refused unread (a 10k-leaf one is ~2 MiB)
COMMITTED = "COMMITTED"    # written last: the checkpoint is complete (a Marker: who, and a unique id)
WRITING = "WRITING"        # a save under way claims its directory / prefix (a Marker)
DELETING = "DELETING"      # kvstores: a checkpoint being deleted (what is left is provably ours)
INFO = "info.json"         # optional: what a save attached for tools (a manager's step info), small JSON
PARITY = "parity"          # a local tier's step: the nested checkpoint of its process's parity rows

STEP = re.compile(r"^(0|[1-9][0-9]*)\Z")   # the name of a manager's step: a number, no leading zeros
# A manifest of ours starts with its "format", however it is spaced (written compact; older ones indented).
MANIFEST_MARK = re.compile(rb'^\{\s*"format"\s*:\s*"' + FORMAT.encode() + rb'"')


def manifest_doc(data: bytes, display: str) -> dict:
    """The manifest in ``data`` (a committed checkpoint's :data:`MANIFEST` at ``display``), its
    seal checked (:mod:`~dispatch_io.storage.sealed`), parsed, not yet validated (manifest.py).
    Raises CorruptCheckpointError if it changed after it was written -- its seal fails, or it starts
    as ours (:data:`MANIFEST_MARK`) but is no longer JSON: both caused by a ``BrokenSeal``
    (``sealed.broken``) --, IncompleteCheckpointError if it is not JSON (not a manifest of ours)."""
    try:
        return sealed.loads(data)
    except sealed.BrokenSeal as exc:
        raise CorruptCheckpointError(f"{display}: malformed checkpoint: its {MANIFEST} {exc}", path=display) from exc
    except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        if MANIFEST_MARK.match(bytes(data[:256])):   # written whole before the commit marker: damaged since
            raise CorruptCheckpointError(f"{display}: malformed checkpoint: its {MANIFEST} is no longer JSON "
                                         f"({exc}): it changed after it was written", path=display) \
                from sealed.BrokenSeal(f"not JSON: {exc}")
        raise IncompleteCheckpointError(f"{display} is marked committed but its {MANIFEST} "
                                        f"cannot be read: {exc}") from exc


class WriteTarget:
    """An in-progress save: workers write arrays under ``kvstore``; then :meth:`commit` or :meth:`abort`.

    Attributes: ``kvstore`` (TensorStore kvstore spec of the arrays folder), ``context`` (the
    TensorStore context to open it with; None: any), ``token`` (lets other processes of a
    multi-process job join it: ``Location.join_write``), ``arrays`` (where, relative to the
    checkpoint, ``kvstore`` is; the manifest says it)."""

    kvstore: dict
    context: ts.Context | None
    token: str
    arrays: str = ARRAYS

    def commit(self, manifest: bytes, fsync: bool = True, files: Mapping[str, bytes] | None = None):
        """Write ``manifest`` (the manifest's bytes) and make the checkpoint visible, replacing
        what was at the path. ``fsync``: make it durable first (directories). ``files``: small
        files (name -> bytes, e.g. :data:`INFO`) written beside the manifest, before it.

        Raises CheckpointError (or OSError) if it cannot: another save took the path over or
        committed first, the store failed. Nothing is committed then; call :meth:`abort`."""
        raise NotImplementedError

    def abort(self):
        """Remove what this save wrote, and nothing else."""
        raise NotImplementedError

    def superseded(self) -> Exception | None:
        """The CheckpointError to raise if another save is known to have taken the path over
        (then a failed write is a symptom of that, not the cause); None otherwise, also when
        that cannot be told."""
        return None


class JoinedWrite(WriteTarget):
    """The share of a save another process started (``Location.join_write``): this process only
    writes arrays into ``kvstore``; the process that started the save commits or aborts it."""

    def __init__(self, kvstore: dict, context: ts.Context | None, token: str, arrays: str = ARRAYS):
        self.kvstore, self.context, self.token, self.arrays = kvstore, context, token, arrays

    def commit(self, manifest: bytes, fsync: bool = True, files: Mapping[str, bytes] | None = None):
        raise RuntimeError("only the process that started a save commits it")

    def abort(self):
        pass  # the process that started the save removes it


class Location:
    """A checkpoint path. ``Location.parse`` picks the implementation."""

    display: str                       # the path as the user gave it, for messages
    context: ts.Context | None = None  # shared TensorStore context (None: each session makes its own)

    @staticmethod
    def parse(path) -> "Location":
        """The location of ``path``: a :class:`~dispatch_io.storage.objectstore.KvLocation` for a
        URL (``s3://``, ``gs://``, ``memory://``), else a
        :class:`~dispatch_io.storage.directory.DirectoryLocation` (a path or ``file://``).

        Raises TypeError unless ``path`` is a non-empty ``str`` or ``os.PathLike``; ValueError
        for a URL TensorStore does not support."""
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise TypeError(f"checkpoint path must be a non-empty str or os.PathLike, got {path!r}")
        if path.startswith("file://"):
            return DirectoryLocation(path[len("file://"):])
        if "://" in path:
            return KvLocation(path)
        return DirectoryLocation(path)

    @property
    def key(self) -> str:
        """Identifies the checkpoint location (saves to one key are serialized)."""
        raise NotImplementedError

    def arrays_kvstore(self, arrays: str = ARRAYS) -> dict:
        """The kvstore of the checkpoint's ``arrays`` (``Manifest.arrays``)."""
        raise NotImplementedError

    def is_committed(self) -> bool:
        raise NotImplementedError

    def read_manifest(self) -> dict:
        """The committed checkpoint's manifest, parsed (not validated: see manifest.py).

        Raises FileNotFoundError if nothing is at the path, IncompleteCheckpointError if it holds
        no committed checkpoint or an unreadable manifest, CheckpointError if the store fails."""
        raise NotImplementedError

    def commit_marker(self) -> bytes | None:
        """The ``COMMITTED`` marker's bytes (unique per commit), or None if there is none."""
        raise NotImplementedError

    def read_file(self, key: str) -> bytes | None:
        """The bytes of the small file ``key`` (relative to the checkpoint, e.g. :data:`INFO` or
        ``arrays/items/...``), or None if there is none. CheckpointError if the store fails."""
        raise NotImplementedError

    def check_commit_marker(self, marker: bytes | None, cause: BaseException | None = None):
        """CheckpointError if the checkpoint is no longer the one whose marker was ``marker``:
        another save replaced it while it was being read, so what was read may mix the two."""
        if self.commit_marker() != marker:
            raise CheckpointError(f"the checkpoint at {self.display} was replaced by another save while "
                                  "it was being restored; restore it again") from cause

    def start_write(self, overwrite: bool) -> WriteTarget:
        """Start a save to this path. A committed checkpoint is replaced only with ``overwrite``,
        anything that is not a dispatch_io checkpoint never.

        Raises FileExistsError if the path is taken (see above, or another save is under way),
        CheckpointError (or OSError) if the store fails."""
        raise NotImplementedError

    def join_write(self, token: str) -> JoinedWrite:
        """The save another process started (its target's ``token``): this process only
        writes arrays into it; the process that started it commits or aborts.

        Raises CheckpointError if ``token`` is not a save of this path."""
        raise NotImplementedError


class StepRoot:
    """The folder of a CheckpointManager's numbered steps: ``<root>/<step>/`` is a checkpoint."""

    display: str

    @staticmethod
    def open(root) -> "StepRoot":
        """The root at ``root`` (a path or URL, as for ``Location.parse``); a directory is made
        if missing. Raises as ``Location.parse`` does."""
        location = Location.parse(root)
        return KvRoot(location) if isinstance(location, KvLocation) else DirectoryRoot(location)

    def step_path(self, step: int) -> str:
        """The path of ``step``'s checkpoint (for ``Location.parse``)."""
        raise NotImplementedError

    def committed_steps(self, listed: Folder | None = None) -> list[int]:
        """Committed dispatch_io checkpoints with step names, ascending. ``listed``: this root
        opened as a :class:`~dispatch_io.storage.folders.Folder`, whose listing is used instead
        of a listing of its own (on an object store one LIST answers this and a reader of the
        Orbax steps beside ours)."""
        raise NotImplementedError

    def delete(self, step: int):
        """Unlist ``step`` at once, then remove its data (our own files only)."""
        raise NotImplementedError

    def remove_leftovers(self):
        """Remove what killed saves and deletes left, where provably ours and dead; log (never
        raise) what cannot be removed."""
        raise NotImplementedError


# The backends (they build on the definitions above).
from dispatch_io.storage.directory import DirectoryLocation, DirectoryRoot, DirectoryWrite  # noqa: E402
from dispatch_io.storage.markers import Marker  # noqa: E402
from dispatch_io.storage.objectstore import KvLocation, KvRoot, KvWrite, kvstore_spec  # noqa: E402
from dispatch_io.storage.folders import Folder  # noqa: E402  (StepRoot.committed_steps is given one)

# (OBJECT_STORE_RETRIES is not re-exported: set it where kvstore_spec reads it, in objectstore.)
__all__ = [
    "ARRAYS", "COMMITTED", "DELETING", "FORMAT", "INFO", "MANIFEST", "STEP", "WRITING",
    "DirectoryLocation", "DirectoryRoot", "DirectoryWrite", "JoinedWrite", "KvLocation", "KvRoot", "KvWrite",
    "Location", "Marker", "StepRoot", "WriteTarget", "kvstore_spec",
]
