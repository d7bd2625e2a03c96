"""Exporting a checkpoint (ours, Orbax's, safetensors) to Hugging Face safetensors.

``dst`` ending in ``.safetensors`` is one file holding every tensor; any other ``dst`` is a
directory: ``model.safetensors`` when everything fits in ``max_shard_size`` bytes, else shards
``model-00001-of-0000N.safetensors`` (each at most ``max_shard_size`` of tensor data, or one
larger tensor alone) and ``model.safetensors.index.json`` mapping each tensor to its shard, as
Hugging Face writes them. Tensor names are the leaves' key names joined by ``.``
(``tree.dotted_name``) unless ``names`` says otherwise. Headers carry
``{"format": "pt"}`` in ``__metadata__`` (what Hugging Face loaders expect).

safetensors holds tensors of its own dtypes only: PRNG key arrays, Python scalars and dtypes it
has no code for (int4, float4, float64 complex...) are refused with their key path, or left out
with ``skip_unsupported``.

A local ``dst`` is written as a stream into a temporary sibling renamed into place. An
object-store ``dst`` (an ``s3://`` / ``gs://`` folder prefix) takes whole objects: each shard is
built in memory, so shards are at most a quarter of the budget (``max_shard_size`` or less; a
larger tensor is refused naming it) and the source is read in quarter-budget batches, and the
export is committed by the file its readers open first, written last: the index
(``model.safetensors.index.json``) of several shards, or the one ``model.safetensors`` (one
object, whole or absent). A folder holding shards named ``-of-N`` without their index is read
as incomplete (``safetensors.find``).
"""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np

from dispatch_io.formats import exporting
from dispatch_io.formats import safetensors
from dispatch_io import tree as tree_lib
from dispatch_io.formats.exporting import ExportStats, Leaf, LocalOutput, ObjectOutput
from dispatch_io.manifest import SavedLeaf
from dispatch_io.storage import Location
from dispatch_io.storage.folders import Folder

CODES = {name: code for code, name in safetensors.DTYPES.items()}   # numpy dtype name -> safetensors code
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9   # Hugging Face's default, "5GB"
_MARKER = "dispatch_io-export"
METADATA_KEY = "__metadata__"   # the header's own entry: no tensor may be named so


def refusal(saved: SavedLeaf) -> str | None:
    """Why ``saved`` cannot be a safetensors tensor, or None if it can."""
    if saved.kind == tree_lib.KEY:
        return "a PRNG key array: safetensors holds no key arrays (export jax.random.key_data(key) instead)"
    if saved.kind == tree_lib.SCALAR:
        return f"a Python {type(saved.value).__name__}: safetensors holds tensors only"
    if np.dtype(saved.dtype).name not in CODES:
        return f"dtype {np.dtype(saved.dtype).name} has no safetensors code (it holds {', '.join(sorted(CODES))})"
    return None


def shards(leaves: list[Leaf], max_shard_size: int) -> list[list[Leaf]]:
    """The leaves cut into files of at most ``max_shard_size`` bytes of data each, in order (a
    larger leaf alone in its file)."""
    files: list[list[Leaf]] = [[]]
    size = 0
    for leaf in leaves:
        n = exporting.nbytes(leaf.saved)
        if files[-1] and size + n > max_shard_size:
            files.append([])
            size = 0
        files[-1].append(leaf)
        size += n
    return files


def header(leaves: list[Leaf]) -> bytes:
    """The 8-byte length and JSON header of a file holding ``leaves`` in order, padded with spaces
    to a multiple of 8 bytes (so the data is aligned, as the safetensors library writes it)."""
    doc: dict = {METADATA_KEY: {"format": "pt"}}
    offset = 0
    for leaf in leaves:
        n = math.prod(leaf.saved.shape) * np.dtype(leaf.saved.dtype).itemsize
        doc[leaf.name] = {"dtype": CODES[np.dtype(leaf.saved.dtype).name], "shape": list(leaf.saved.shape),
                          "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _replaceable(path: str) -> bool:
    """Whether an export may replace ``path``: a ``.safetensors`` file, or a directory (or
    object-store prefix) holding nothing but safetensors files and index files (what an export
    writes). A model folder with ``config.json`` or a tokenizer beside its weights is not:
    replacing it would delete them."""
    folder = Folder.open(path)
    if not folder.exists():
        return path.endswith(safetensors.SUFFIX)
    held = folder.names()
    return bool(held) and all(safetensors.is_data_file(n) or n.endswith(safetensors.INDEX_SUFFIX) for n in held)


def _little_endian(array: np.ndarray) -> np.ndarray:
    """``array``'s bytes as safetensors stores them: C order, little-endian."""
    array = np.ascontiguousarray(array)
    return array.astype(array.dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8)


def export(session, source, dst, *, overwrite: bool, names, skip: bool, max_shard_size: int | None,
           chunk_limit: int, batch_limit: int) -> ExportStats:
    """Write the leaves of ``source`` (a ``formats.Opened``, its arrays read through ``session``)
    as safetensors at ``dst``; see the module docstring. Raises ValueError for a leaf
    safetensors cannot hold (``exporting.Unsupported``, naming its key path), for a leaf named
    ``__metadata__`` (the header's own key) or two leaves given one name, for a ``dst`` directory
    holding other files than safetensors (a model folder's config), an object-store ``dst``
    naming a file (it takes a folder prefix) or a tensor larger than an object-store shard;
    FileExistsError if ``dst`` exists and not ``overwrite``; WorkerError naming the key path for
    a source region that cannot be read. A failure leaves nothing at ``dst``. The shards are
    written one after the other: one file is open at a time, however many there are."""
    started = time.perf_counter()
    local = exporting.is_local(dst)
    path = Location.parse(dst).path if local else Location.parse(dst).display
    exported, skipped = exporting.leaves(source.manifest, names, refusal, skip)
    for leaf in exported:
        if leaf.name == METADATA_KEY:
            raise ValueError(f"{leaf.saved.keypath}: {METADATA_KEY!r} is the safetensors header's metadata key, "
                             "not a tensor name (pass names= to name the leaf otherwise)")
    one_file = path.endswith(safetensors.SUFFIX)
    limit = DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size
    if not local:
        batch_limit = _held_in_memory(exported, one_file, dst, batch_limit)
        limit = min(limit, batch_limit)
    files = [exported] if one_file else shards(exported, limit)
    names_of = [SINGLE] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                                 for i in range(len(files))]
    index = None
    if len(files) > 1:
        weight_map = {leaf.name: name for name, leaves in zip(names_of, files) for leaf in leaves}
        total = sum(exporting.nbytes(leaf.saved) for leaf in exported)
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode()
    if local:
        output = LocalOutput(path, overwrite, _replaceable, _MARKER, is_dir=not one_file)
        where = [output.tmp] if one_file else [os.path.join(output.tmp, name) for name in names_of]
        opener = lambda i: open(where[i], "wb")  # noqa: E731
    else:
        output = ObjectOutput(dst, overwrite, lambda folder: _replaceable(folder.display), (INDEX, SINGLE))
        opener = lambda i: _Object(output, names_of[i])  # noqa: E731
    try:
        shard = _Shards(opener, files)
        try:
            work = [(i, region) for i, leaves in enumerate(files) for leaf in leaves
                    for region in exporting.pieces(leaf.saved, chunk_limit)]
            exporting.stream(session, work, batch_limit, shard.write, source.display)
            shard.finish()
        finally:
            shard.close()
        source.check_unchanged()
        if local:
            if index is not None:
                with open(os.path.join(output.tmp, INDEX), "wb") as f:
                    f.write(index)
            output.commit()
        else:   # the shards are all written: the index makes them a set (one shard: it is whole already)
            output.commit([] if index is None else [(INDEX, index)])
    except BaseException:
        output.abort()
        raise
    written = tuple([os.fspath(dst)] if one_file else names_of + ([INDEX] if len(files) > 1 else []))
    return ExportStats(os.fspath(dst), sum(exporting.nbytes(leaf.saved) for leaf in exported), written,
                       tuple(skipped), time.perf_counter() - started)


def _held_in_memory(exported: list[Leaf], one_file: bool, dst: str, batch_limit: int) -> int:
    """The shard limit of an export to an object store, which builds each shard in memory: half
    the read batches' ``batch_limit`` (half the budget), read batches then of that size too (two
    in flight), so shard, its upload and the reads stay within the budget. ValueError for a
    ``dst`` naming a file, or a tensor larger than that limit (naming its key path)."""
    if one_file:
        raise ValueError(f"an export to an object store writes a folder prefix of safetensors files, not one file: "
                         f"{dst} (name the folder)")
    limit = max(1, batch_limit // 2)
    for leaf in exported:
        if exporting.nbytes(leaf.saved) > limit:
            raise ValueError(f"{leaf.saved.keypath}: {exporting.nbytes(leaf.saved)} bytes, more than an object-store "
                             f"export holds in memory for one shard ({limit} bytes, a quarter of the budget): raise "
                             "the budget, or export to a local path")
    return limit


class _Object:
    """A shard bound for an object store: gathered in memory, written as one object on close."""

    def __init__(self, output: ObjectOutput, name: str):
        self.output, self.name, self.data = output, name, bytearray()

    def write(self, data):
        self.data += memoryview(data).cast("B")

    def close(self):
        self.output.write(self.name, self.data)
        self.data = bytearray()


class _Shards:
    """The shard files ``opener(i)`` opens (holding ``files[i]``'s leaves each), written in order,
    one open at a time: :meth:`write` takes the stream's (shard index, region, array) triples."""

    def __init__(self, opener, files: list[list[Leaf]]):
        self._opener, self._files = opener, files
        self._current, self._handle = -1, None

    def _open_until(self, index: int):
        """Finish the shards before ``index`` (headers alone for those without data) and open it."""
        while self._current < index:
            self.close()
            self._current += 1
            self._handle = self._opener(self._current)
            self._handle.write(header(self._files[self._current]))

    def write(self, batch: list[tuple]):
        for i, _, array in batch:
            self._open_until(i)
            self._handle.write(_little_endian(array))

    def finish(self):
        """Write the shards after the last one holding data."""
        self._open_until(len(self._files) - 1)

    def close(self):
        if self._handle is not None:
            self._handle.close()
            self._handle = None
