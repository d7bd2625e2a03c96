"""Reading Hugging Face safetensors files: one file, or a sharded set, described as a Manifest.

A safetensors file is::

    8 bytes          N, the header's length (unsigned, little-endian)
    N bytes          JSON: {"<tensor name>": {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]},
                            ..., "__metadata__": {"<str>": "<str>"}}   (padded with spaces)
    the data         each tensor C order, little-endian, at [8 + N + begin, 8 + N + end)

A sharded set is a directory (or object-store prefix) of such files, usually with
``model.safetensors.index.json`` (``{"weight_map": {"<tensor name>": "<file>"}}``) saying which
file holds which tensor. What comes out is an ordinary :class:`~dispatch_io.manifest.Manifest`:
a flat dict of tensor names, each leaf an ``ArraySpec`` of driver ``raw`` at its byte offset, so
restore reads only the byte ranges of the regions each process holds (``workers.raw_bytes``).
Targets match tensors by name: a target leaf's name is its key names joined by ``.``
(:func:`tensor_name`: ``{"model": {"layers": [{"w": ...}]}}`` reads ``model.layers.0.w``), or what
``restore(..., names=fn)`` says.

Headers are untrusted: every one is checked (its size bounded, dtypes known, shapes x itemsize
equal to their byte ranges, the ranges tiling the data inside the file) before anything is read.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import re

import jax
import numpy as np
import tensorstore as ts

from dispatch_io import tree as tree_lib
from dispatch_io.errors import CheckpointError
from dispatch_io.manifest import Manifest, SavedLeaf
from dispatch_io.plan import storage_chunk_shape
from dispatch_io.storage import COMMITTED, MANIFEST, DirectoryLocation, Location
from dispatch_io.storage.objectstore import kvstore_spec
from workers import RAW, ArraySpec, numpy_dtype

FORMAT = "safetensors"
SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # what the safetensors library itself accepts
# The "chunk" of a tensor (it has none): at most the chunk limit of any budget of 4 MiB or more,
# so reads are cut by the limit (reading.read_pieces) and regions several processes hold are
# shared piece by piece (scaleout); verify reads this much at a time.
READ_PIECE_BYTES = 1 << 20
# safetensors dtype code -> numpy / ml_dtypes name (sub-byte F4 / F6 kinds are not read)
DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
          "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16",
          "F32": "float32", "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
          "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
          "F8_E8M0": "float8_e8m0fnu"}
_FILE_NAME = re.compile(r"[^/\\]+\.safetensors")


def tensor_name(path) -> str:
    """The default tensor name of a target leaf at the JAX key path ``path``: its key names
    (``tree.key_names``: dict keys, sequence indices, attribute names) joined by ``.``."""
    return ".".join(tree_lib.key_names(path))


def find(path) -> tuple[dict, list[str] | None, str | None] | None:
    """What safetensors ``path`` holds, or None if it holds none (or a dispatch_io checkpoint):
    (kvstore spec of its folder, the file names -- None: every ``*.safetensors`` there --, the
    index file's name or None). ``path``: a ``.safetensors`` file, or a directory / URL prefix
    holding such files (and an ``*.safetensors.index.json``)."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else path
    location = Location.parse(path)
    if isinstance(location, DirectoryLocation):
        if os.path.isfile(location.path):
            if not location.path.endswith(SUFFIX):
                return None
            folder, name = os.path.split(os.path.abspath(location.path))
            return {"driver": "file", "path": folder + "/"}, [name], None
        if not os.path.isdir(location.path) or any(os.path.exists(os.path.join(location.path, n))
                                                   for n in (MANIFEST, COMMITTED)):
            return None
        names = os.listdir(location.path)
        spec = {"driver": "file", "path": os.path.abspath(location.path) + "/"}
    else:
        if text.endswith(SUFFIX):
            folder, name = text.rsplit("/", 1)
            return kvstore_spec(folder), [name], None
        if location.commit_marker() is not None:
            return None
        spec = location.spec
        names = [key.decode() for key in ts.KvStore.open(spec, context=location.context).result().list().result()]
    index = sorted(n for n in names if n.endswith(INDEX_SUFFIX))
    files = sorted(n for n in names if _FILE_NAME.fullmatch(n))
    if not index and not files:
        return None
    return spec, None, index[0] if index else None


def _read(kv: ts.KvStore, key: str, start: int, stop: int, display: str):
    """Bytes [start, stop) of ``key``; CheckpointError if the file is missing or shorter."""
    try:
        result = kv.read(key, byte_range=slice(start, stop)).result()
    except ValueError as exc:  # OUT_OF_RANGE: the file is shorter
        raise CheckpointError(f"{display}: {key} is shorter than its header says (no bytes [{start}, {stop}))") from exc
    if result.state != "value":
        raise CheckpointError(f"{display}: {key} is missing")
    return result


def _header(kv: ts.KvStore, key: str, display: str) -> tuple[dict, int, str]:
    """(header JSON, where the data starts, the file's generation), checked."""
    first = _read(kv, key, 0, 8, display)
    size = int.from_bytes(first.value, "little")
    if size > MAX_HEADER_BYTES:
        raise CheckpointError(f"{display}: {key} has a header of {size} bytes (at most {MAX_HEADER_BYTES} are read): "
                              "not a safetensors file")
    try:
        header = json.loads(_read(kv, key, 8, 8 + size, display).value)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{display}: {key} has a header that is not JSON: not a safetensors file") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{display}: {key} has a header that is not a JSON object")
    return header, 8 + size, first.stamp.generation


def _tensors(kv: ts.KvStore, key: str, header: dict, data: int, display: str) -> list[tuple[str, str, tuple, int]]:
    """(name, dtype name, shape, absolute offset) of every tensor of a checked ``header``."""
    tensors, ranges = [], []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{display}: tensor {name!r} in {key}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{where}: malformed header entry {str(entry)[:200]}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise CheckpointError(f"{where}: dtype {str(dtype)[:40]!r} is not one dispatch_io reads ({', '.join(DTYPES)})")
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
            raise CheckpointError(f"{where}: malformed shape {str(shape)[:200]}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int and n >= 0 for n in offsets)
                and offsets[0] <= offsets[1]):
            raise CheckpointError(f"{where}: malformed data_offsets {str(offsets)[:200]}")
        nbytes = math.prod(shape) * numpy_dtype(DTYPES[dtype]).itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise CheckpointError(f"{where}: {dtype} {shape} is {nbytes} bytes but its data_offsets "
                                  f"{offsets} span {offsets[1] - offsets[0]}")
        tensors.append((name, DTYPES[dtype], tuple(shape), data + offsets[0]))
        ranges.append(tuple(offsets))
    end = 0
    for begin, stop in sorted(ranges):
        if begin != end:
            raise CheckpointError(f"{display}: {key}: tensor data {'overlaps' if begin < end else 'has a gap'} "
                                  f"at byte {min(begin, end)} of its data: not a valid safetensors file")
        end = stop
    if end:
        _read(kv, key, data + end - 1, data + end, display)  # the data lies inside the file
    return tensors


def read(spec: dict, files: list[str] | None, index: str | None, display: str,
         context: ts.Context | None = None) -> tuple[Manifest, list[tuple[str, str]]]:
    """The safetensors at ``spec`` (:func:`find`) as (Manifest, [(file, generation)]).

    Raises CheckpointError naming the file (and tensor) for a malformed or inconsistent header or
    index, a tensor held by two files, a file the index names that is missing."""
    kv = ts.KvStore.open(spec, context=context).result()
    expected = None
    if index is not None:
        try:
            weight_map = json.loads(_read(kv, index, 0, None, display).value)["weight_map"]
            expected = {str(name): str(file) for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{display}: {index} is not a safetensors index (no weight_map)") from exc
        files = sorted(set(expected.values()))
    elif files is None:
        files = sorted(key.decode() for key in kv.list().result() if _FILE_NAME.fullmatch(key.decode()))
    for name in files:
        if not _FILE_NAME.fullmatch(name) or posixpath.normpath(name) != name:
            raise CheckpointError(f"{display}: {index} names {name[:200]!r}, not a .safetensors file of its folder")
    held: dict[str, tuple] = {}
    generations = []
    for name in files:
        header, data, generation = _header(kv, name, display)
        generations.append((name, generation))
        for tensor, dtype, shape, offset in _tensors(kv, name, header, data, display):
            if tensor in held:
                raise CheckpointError(f"{display}: tensor {tensor!r} is in both {held[tensor][0]} and {name}")
            held[tensor] = (name, dtype, shape, offset)
    if expected is not None:
        for tensor, (name, *_) in held.items():
            if expected.get(tensor, name) != name:
                raise CheckpointError(f"{display}: {index} puts tensor {tensor!r} in {expected[tensor]}, "
                                      f"but {name} holds it")
        missing = sorted(set(expected) - set(held))
        if missing:
            raise CheckpointError(f"{display}: {index} lists {len(missing)} tensor(s) no file holds: "
                                  f"{', '.join(map(repr, missing[:5]))}")
    return _manifest(held), generations


def _manifest(held: dict[str, tuple]) -> Manifest:
    """A flat dict of the tensors (name -> (file, dtype name, shape, offset)) as a Manifest."""
    treedef = jax.tree_util.tree_structure({name: 0 for name in held})
    leaves, total = [], 0
    for name in sorted(held):  # a dict flattens in sorted key order
        file, dtype, shape, offset = held[name]
        itemsize = numpy_dtype(dtype).itemsize
        stored = ArraySpec(file, shape, dtype, storage_chunk_shape(shape, itemsize, READ_PIECE_BYTES),
                           driver=RAW, offset=offset) if all(shape) else None
        total += math.prod(shape) * itemsize
        leaves.append(SavedLeaf(jax.tree_util.keystr((jax.tree_util.DictKey(name),)), tree_lib.ARRAY, "numpy",
                                shape, np.dtype(numpy_dtype(dtype)), stored=stored))
    return Manifest(treedef, tuple(leaves), total, "files", arrays="", format=FORMAT, tensor_names=tensor_name)


def check_unchanged(spec: dict, generations: list[tuple[str, str]], display: str, context: ts.Context | None = None,
                    cause: BaseException | None = None):
    """CheckpointError (chained to ``cause``) if a file of ``generations`` ((file, generation) as
    :func:`read` returned) was replaced since it was read."""
    kv = ts.KvStore.open(spec, context=context).result()
    futures = [(name, kv.read(name, if_not_equal=generation, byte_range=slice(0, 0))) for name, generation in generations]
    for name, future in futures:
        if future.result().state != "unspecified":
            raise CheckpointError(f"{display}: {name} was replaced while it was being read; read it again") from cause
