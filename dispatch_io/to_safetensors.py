"""Exporting a checkpoint (ours, Orbax's, safetensors) to Hugging Face safetensors.

``dst`` ending in ``.safetensors`` is one file holding every tensor; any other ``dst`` is a
directory: ``model.safetensors`` when everything fits in ``max_shard_size`` bytes, else shards
``model-00001-of-0000N.safetensors`` (each at most ``max_shard_size`` of tensor data, or one
larger tensor alone) and ``model.safetensors.index.json`` mapping each tensor to its shard, as
Hugging Face writes them. Tensor names are the leaves' key names joined by ``.``
(``exporting.default_name``) unless ``names`` says otherwise. Headers carry
``{"format": "pt"}`` in ``__metadata__`` (what Hugging Face loaders expect).

safetensors holds tensors of its own dtypes only: PRNG key arrays, Python scalars and dtypes it
has no code for (int4, float4, float64 complex...) are refused with their key path, or left out
with ``skip_unsupported``. Local destinations only (a file is written as a stream; object
stores take whole objects).
"""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np

from dispatch_io import exporting, safetensors
from dispatch_io import tree as tree_lib
from dispatch_io.exporting import ExportStats, Leaf, LocalOutput
from dispatch_io.manifest import SavedLeaf
from dispatch_io.storage import DirectoryLocation, Location

CODES = {name: code for code, name in safetensors.DTYPES.items()}   # numpy dtype name -> safetensors code
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9   # Hugging Face's default, "5GB"
_MARKER = "dispatch_io-export"


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
    doc: dict = {"__metadata__": {"format": "pt"}}
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
    return safetensors.find(path) is not None


def export(session, manifest, dst, *, overwrite: bool, names, skip: bool, max_shard_size: int | None,
           chunk_limit: int, batch_limit: int, check_unchanged) -> ExportStats:
    """Write the leaves of ``manifest`` (read through ``session``, the source's arrays) as
    safetensors at ``dst``; see the module docstring. ``check_unchanged()`` raises if the source
    was replaced meanwhile (called before the commit). Raises ValueError for a leaf safetensors
    cannot hold (naming its key path), for two leaves given one name, for a non-local ``dst``;
    FileExistsError if ``dst`` exists and not ``overwrite``. A failure leaves nothing at ``dst``."""
    started = time.perf_counter()
    if not isinstance(Location.parse(dst), DirectoryLocation):
        raise ValueError(f"export to safetensors writes local files: {dst} is not a local path")
    path = Location.parse(dst).path
    exported, skipped = exporting.leaves(manifest, names, refusal, skip)
    one_file = path.endswith(safetensors.SUFFIX)
    files = [exported] if one_file else shards(exported, max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    names_of = [SINGLE] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                                 for i in range(len(files))]
    output = LocalOutput(path, overwrite, _replaceable, _MARKER, is_dir=not one_file)
    try:
        where = [output.tmp] if one_file else [os.path.join(output.tmp, name) for name in names_of]
        handles = [open(p, "wb") for p in where]
        try:
            for handle, leaves in zip(handles, files):
                handle.write(header(leaves))
            work = [(i, region) for i, leaves in enumerate(files) for leaf in leaves
                    for region in exporting.pieces(leaf.saved, chunk_limit)]
            for batch in exporting.stream(session, work, batch_limit):
                for i, _, array in batch:
                    handles[i].write(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        finally:
            for handle in handles:
                handle.close()
        if len(files) > 1:
            weight_map = {leaf.name: name for name, leaves in zip(names_of, files) for leaf in leaves}
            total = sum(exporting.nbytes(leaf.saved) for leaf in exported)
            with open(os.path.join(output.tmp, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        check_unchanged()
        output.commit()
    except BaseException:
        output.abort()
        raise
    written = tuple([os.fspath(dst)] if one_file else names_of + ([INDEX] if len(files) > 1 else []))
    return ExportStats(os.fspath(dst), sum(exporting.nbytes(leaf.saved) for leaf in exported), written,
                       tuple(skipped), time.perf_counter() - started)
