"""Where the bytes of a checkpoint's stored chunks are, in either chunk layout, so that tests
can count, read, corrupt or remove exactly one chunk.

``"files"``: ``arrays/<name>/c/<i>/<j>...`` is one file per chunk holding exactly its bytes.
``"ocdbt"``: ``arrays/`` is one OCDBT database; its B-tree (walked with ``tensorstore.ocdbt.dump``)
maps each zarr key ``<name>/c/<i>/<j>...`` to a value that is either inline (small values,
stored inside a compressed B-tree node) or a reference ``value:<base>:<file>:<offset>:<length>``
to a byte range of a data file ``arrays/<base><file>`` (``<base>`` is a writer's directory,
``p0/`` or ``cpu3/``, after the merge).
"""

from __future__ import annotations

import dataclasses
import os
import re

import tensorstore as ts
from dispatch_io.storage import sealed


@dataclasses.dataclass(frozen=True)
class StoredValue:
    """One stored key of ``arrays/`` and where its bytes are."""

    key: str                     # e.g. "00003.w/c/1/0", "00003.w/zarr.json"
    file: str | None             # absolute path of the file holding the bytes; None: OCDBT inline
    offset: int = 0
    length: int = 0
    inline: bytes | None = None  # the bytes of an OCDBT inline value

    def read(self) -> bytes:
        if self.file is None:
            return self.inline
        with open(self.file, "rb") as f:
            f.seek(self.offset)
            data = f.read(self.length)
        assert len(data) == self.length, (self, len(data))
        return data


def manifest(path) -> dict:
    """The checkpoint's manifest, its seal taken out (an edited one is written back unsealed)."""
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return sealed.loads(f.read())


def layout(path) -> str:
    """The chunk layout the checkpoint's manifest records (absent: "files")."""
    return manifest(path).get("layout", "files")


def stored_name(path, keypath: str) -> str:
    (name,) = [leaf["stored"]["name"] for leaf in manifest(path)["leaves"]
               if leaf["keypath"] == keypath and leaf.get("stored")]
    return name


def arrays_dir(path) -> str:
    return os.path.join(os.fspath(path), "arrays")


# ---- OCDBT -----------------------------------------------------------------------------------------

_LOCATION = re.compile(r"^(value|btreenode|versionnode):([^:]*):([^:]+):(\d+):(\d+)$")


def parse_location(location: str) -> tuple[str, str, str, int, int]:
    """``"<type>:<base>:<file>:<offset>:<length>"`` -> (type, base, file, offset, length)."""
    m = _LOCATION.match(location)
    assert m, location
    return m.group(1), m.group(2), m.group(3), int(m.group(4)), int(m.group(5))


def ocdbt_base(directory) -> ts.KvStore:
    """The (file) kvstore an OCDBT database lives in."""
    return ts.KvStore.open({"driver": "file", "path": os.fspath(directory).rstrip("/") + "/"}).result()


def ocdbt_values(directory) -> dict[str, StoredValue]:
    """Every key of the OCDBT database in ``directory`` (its latest version) and where its value is."""
    base = ocdbt_base(directory)
    doc = ts.ocdbt.dump(base).result()
    latest = doc["versions"][-1]   # the manifest keeps the newest versions inline, oldest first
    out: dict[str, StoredValue] = {}
    root = latest["root"].get("location")
    if root is None:               # an empty database
        return out

    def walk(location: str, prefix: bytes):
        node = ts.ocdbt.dump(base, location).result()
        for entry in node["entries"]:
            if "location" in entry:    # interior node: child keys are relative to prefix + common prefix
                walk(entry["location"], prefix + entry["subtree_common_prefix"])
                continue
            key = (prefix + entry["key"]).decode()
            if "inline_value" in entry:
                value = bytes(entry["inline_value"])
                out[key] = StoredValue(key, None, 0, len(value), value)
            else:
                kind, base_path, file, offset, length = parse_location(entry["indirect_value"])
                assert kind == "value", entry
                out[key] = StoredValue(key, os.path.join(os.fspath(directory), base_path + file), offset, length)

    walk(root, b"")
    return out


def ocdbt_files(directory) -> set[str]:
    """Every file an OCDBT database in ``directory`` references in its latest version: the
    data files of its values and of its B-tree nodes (absolute paths)."""
    base = ocdbt_base(directory)
    doc = ts.ocdbt.dump(base).result()
    files = set()
    root = doc["versions"][-1]["root"].get("location")

    def walk(location):
        _, base_path, file, _, _ = parse_location(location)
        files.add(os.path.join(os.fspath(directory), base_path + file))
        for entry in ts.ocdbt.dump(base, location).result()["entries"]:
            if "location" in entry:
                walk(entry["location"])
            elif "indirect_value" in entry:
                _, base_path, file, _, _ = parse_location(entry["indirect_value"])
                files.add(os.path.join(os.fspath(directory), base_path + file))

    if root is not None:
        walk(root)
    return files


# ---- either layout ---------------------------------------------------------------------------------

def stored_values(path) -> dict[str, StoredValue]:
    """Every key stored under the checkpoint's ``arrays/`` (zarr metadata and chunks)."""
    root = arrays_dir(path)
    if layout(path) == "ocdbt":
        return ocdbt_values(root)
    out = {}
    for directory, _, names in os.walk(root):
        for n in names:
            file = os.path.join(directory, n)
            key = os.path.relpath(file, root).replace(os.sep, "/")
            out[key] = StoredValue(key, file, 0, os.path.getsize(file))
    return out


def array_names(path) -> set[str]:
    """The stored arrays' names (the first component of every key under ``arrays/``)."""
    return {key.split("/", 1)[0] for key in stored_values(path)}


def chunks(path, keypath: str) -> dict[tuple[int, ...], StoredValue]:
    """The stored chunks of one leaf by chunk grid index (zarr3 keys ``<name>/c/<i>/<j>...``, or
    ``<name>/c`` for a 0-d array)."""
    name = stored_name(path, keypath)
    out = {}
    for key, value in stored_values(path).items():
        if key == f"{name}/c":
            out[()] = value
        elif key.startswith(f"{name}/c/"):
            out[tuple(int(i) for i in key[len(name) + 3:].split("/"))] = value
    return out


def flip_byte(value: StoredValue, offset: int = 5):
    """Flip one bit of the byte at ``offset`` inside the stored value (in its file)."""
    assert value.file is not None, f"{value.key} is an OCDBT inline value (inside a B-tree node)"
    assert 0 <= offset < value.length, (value, offset)
    with open(value.file, "r+b") as f:
        f.seek(value.offset + offset)
        byte = f.read(1)
        f.seek(value.offset + offset)
        f.write(bytes([byte[0] ^ 0x01]))


def files_holding(path, keypath: str, *, exclusive: bool = True) -> set[str]:
    """The files holding the chunks of one leaf (files: the chunk files; OCDBT: the data files
    its chunk values reference). With ``exclusive``, asserts that those files hold no other
    key's value, so that removing them loses this leaf's chunks and nothing else."""
    mine = chunks(path, keypath)
    assert mine and all(v.file is not None for v in mine.values()), (keypath, mine)
    files = {v.file for v in mine.values()}
    if exclusive:
        others = {v.key for v in stored_values(path).values() if v.file in files and v not in mine.values()}
        assert not others, f"the files of {keypath} also hold {sorted(others)}"
    return files


def remove_chunk(path, keypath: str, grid: tuple[int, ...]):
    """Lose one chunk of one leaf: its file (files), or its key in the database (OCDBT: a new
    version without it; the data stays where it is)."""
    value = chunks(path, keypath)[grid]
    if layout(path) == "files":
        os.remove(value.file)
        return
    store = ts.KvStore.open({"driver": "ocdbt", "base": ocdbt_base(arrays_dir(path)).spec().to_json()}).result()
    store.write(value.key, None).result()
    assert grid not in chunks(path, keypath)


def all_files(path) -> list[str]:
    """Every file under ``path``, relative to it, sorted."""
    root = os.fspath(path)
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names)
