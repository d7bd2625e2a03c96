"""A folder of files another tool wrote (an Orbax checkpoint), read the same way where it lives:
a local directory or a kvstore prefix (``s3://``, ``gs://``).

Object stores have no directories: a prefix's "children" are the first path components of the
keys under it. A :class:`KvFolder` lists the keys under the folder it was opened at once (one
listing, however many questions are asked of it and of its sub-folders) and answers from that.
Files are read with a bound: one larger than ``limit`` is refused before it is read whole,
as :func:`~dispatch_io.storage.directory.read_regular` does for local files, and a listing
with more than :data:`MAX_LISTED_KEYS` keys is refused (a folder read as a checkpoint; a manager's
root, which holds every step's keys, is listed whole).
"""

from __future__ import annotations

import os

import tensorstore as ts

from dispatch_io.errors import CheckpointError
from dispatch_io.storage import DirectoryLocation, Location
from dispatch_io.storage.directory import links_outside, read_regular
from dispatch_io.storage.objectstore import KvLocation, child_spec

# The most keys a folder's listing may hold: a zarr3 Orbax checkpoint has a key per chunk (a
# large model's run: tens of thousands per step); millions under one prefix is not a checkpoint
# to read, and every question asked of the folder would walk them all.
MAX_LISTED_KEYS = 1 << 20


class Folder:
    """A read-only folder: a local directory or a kvstore prefix. ``Folder.open(path)``."""

    display: str   # the path as the user would write it, for messages

    @staticmethod
    def open(path, bounded: bool = True) -> "Folder":
        """The folder at ``path`` (a path, ``file://`` or a kvstore URL: ``Location.parse``).
        ``bounded``: its listing is refused over :data:`MAX_LISTED_KEYS` keys (a folder read as a
        checkpoint); False for a manager's root, which holds every step's keys."""
        location = Location.parse(path)
        if isinstance(location, DirectoryLocation):
            return DirectoryFolder(location.path, location.display)
        return KvFolder(location, "", bounded=bounded)

    @property
    def name(self) -> str:
        """The last component of the folder's path."""
        return self.display.rstrip("/").rsplit("/", 1)[-1]

    def child(self, name: str) -> "Folder":
        raise NotImplementedError

    def parent(self) -> "Folder | None":
        """The folder holding this one (None at the top of a bucket or file system)."""
        raise NotImplementedError

    def exists(self) -> bool:
        """Whether anything is there (a directory; a prefix with keys under it)."""
        raise NotImplementedError

    def names(self) -> list[str]:
        """The names of the files and folders directly in it, sorted ([] if it does not exist)."""
        raise NotImplementedError

    def is_file(self, name: str) -> bool:
        raise NotImplementedError

    def is_folder(self, name: str) -> bool:
        raise NotImplementedError

    def read(self, name: str, limit: int) -> bytes:
        """The bytes of file ``name``. FileNotFoundError if there is none; ValueError if it is
        not a regular file or holds more than ``limit`` bytes (found before it is read whole;
        on an object store, one replaced by a larger file after that is refused once read);
        OSError (a ``CheckpointError`` from an object store) if it cannot be read."""
        raise NotImplementedError

    def stamp(self, name: str):
        """What changes when file ``name`` is replaced (None if it cannot be told)."""
        raise NotImplementedError

    def kvstore(self) -> dict:
        """The TensorStore kvstore spec of the folder (its path ending in ``/``)."""
        raise NotImplementedError

    def links_outside(self) -> list[str]:
        """Symbolic links in it that lead outside it (directories only: object stores have none)."""
        return []


class DirectoryFolder(Folder):
    def __init__(self, path: str, display: str):
        self.path, self.display = path, display

    def child(self, name: str) -> "DirectoryFolder":
        return DirectoryFolder(os.path.join(self.path, name), os.path.join(self.display, name))

    def parent(self) -> "DirectoryFolder | None":
        path = os.path.dirname(os.path.abspath(self.path))
        return None if path == os.path.abspath(self.path) else DirectoryFolder(path, os.path.dirname(
            self.display.rstrip("/")) or path)

    def exists(self) -> bool:
        return os.path.isdir(self.path)

    def names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.path))
        except OSError:
            return []

    def is_file(self, name: str) -> bool:
        return os.path.isfile(os.path.join(self.path, name))

    def is_folder(self, name: str) -> bool:
        return os.path.isdir(os.path.join(self.path, name))

    def read(self, name: str, limit: int) -> bytes:
        return read_regular(os.path.join(self.path, name), limit)

    def stamp(self, name: str):
        try:
            st = os.stat(os.path.join(self.path, name))
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def kvstore(self) -> dict:
        return {"driver": "file", "path": os.path.abspath(self.path) + "/"}

    def links_outside(self) -> list[str]:
        return links_outside(self.path)


class KvFolder(Folder):
    """The folder ``sub`` (``""`` or ending in ``/``) under a kvstore location; its keys are
    listed once, on first use, and shared with its sub-folders (``bounded``: see :meth:`Folder.open`)."""

    def __init__(self, location: KvLocation, sub: str, keys: list[str] | None = None, up: "KvFolder | None" = None,
                 bounded: bool = True):
        self.location, self.sub, self.bounded = location, sub, bounded
        self.display = location.display.rstrip("/") + ("/" + sub.rstrip("/") if sub else "")
        self._keys, self._up = keys, up

    def keys(self) -> list[str]:
        """Every key under the folder, relative to it (listed on first use). CheckpointError if
        the store fails or, ``bounded``, holds more than :data:`MAX_LISTED_KEYS` keys under it."""
        if self._keys is None:
            listed = self.location.wait(self._kv().list(), f"list {self.display}")
            if self.bounded and len(listed) > MAX_LISTED_KEYS:
                raise CheckpointError(f"{self.display}: {len(listed)} keys are stored under it, more than the "
                                      f"{MAX_LISTED_KEYS} a folder read as a checkpoint may hold")
            self._keys = [k.decode() for k in listed]
        return self._keys

    def child(self, name: str) -> "KvFolder":
        prefix = name.rstrip("/") + "/"
        below = None if self._keys is None else [k[len(prefix):] for k in self._keys if k.startswith(prefix)]
        return KvFolder(self.location, self.sub + prefix, below, self, self.bounded)

    def parent(self) -> "KvFolder | None":
        if self._up is not None:
            return self._up
        if self.sub:
            head = self.sub[:-1].rpartition("/")[0]
            return KvFolder(self.location, head + "/" if head else "")
        scheme, _, rest = self.location.url.rstrip("/").partition("://")
        if "/" not in rest:   # a bucket
            return None
        return KvFolder(KvLocation(f"{scheme}://{rest.rpartition('/')[0]}"), "")

    def exists(self) -> bool:
        return bool(self.keys())

    def names(self) -> list[str]:
        return sorted({k.split("/", 1)[0] for k in self.keys()})

    def is_file(self, name: str) -> bool:
        return name in set(self.keys())

    def is_folder(self, name: str) -> bool:
        prefix = name.rstrip("/") + "/"
        return any(k.startswith(prefix) for k in self.keys())

    def _kv(self) -> ts.KvStore:
        return self.location.open_kv(self.sub)

    def read(self, name: str, limit: int) -> bytes:
        data = self.location.read_bounded(name, limit, self.sub)
        if data is None:
            raise FileNotFoundError(f"{self.display}/{name}: no such file")
        return data

    def stamp(self, name: str):
        try:  # its first byte: the generation, without the rest
            result = self._kv().read(name, byte_range=slice(0, 1)).result()
        except ValueError:
            return None
        return result.stamp.generation if result.state == "value" else None

    def kvstore(self) -> dict:
        return child_spec(self.location.spec, self.sub)
