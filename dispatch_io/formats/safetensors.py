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
from dispatch_io.errors import CheckpointError, IncompleteCheckpointError
from dispatch_io.manifest import Manifest, SavedLeaf
from dispatch_io.plan.save_plan import storage_chunk_shape
from dispatch_io.storage import COMMITTED, MANIFEST, DirectoryLocation, Location
from dispatch_io.storage.objectstore import kvstore_spec
from dispatch_io.workers import RAW, ArraySpec, numpy_dtype

FORMAT = "safetensors"
SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # what the safetensors library itself accepts (an index file too)
MAX_AXES = 64                   # numpy's limit
LIMIT = 1 << 63                 # dimensions and byte offsets: numpy and TensorStore index with int64
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
_SHARD_NAME = re.compile(r"(.+)-([0-9]+)-of-([0-9]+)\.safetensors")   # Hugging Face's shard names


# The default tensor name of a target leaf: its key names joined by ``.`` (the export's rule too).
tensor_name = tree_lib.dotted_name


def is_data_file(name: str) -> bool:
    """Whether the file ``name`` of a folder is a safetensors file of its set: ``*.safetensors``,
    except macOS's ``._*`` resource-fork files that copies to some disks leave beside each file."""
    return _FILE_NAME.fullmatch(name) is not None and not name.startswith("._")


def find(path) -> tuple[dict, list[str] | None, str | None] | None:
    """What safetensors ``path`` holds, or None if it holds none (or a dispatch_io checkpoint):
    (kvstore spec of its folder, the file names -- None: every ``*.safetensors`` there --, the
    index file's name or None). ``path``: a ``.safetensors`` file, or a directory / URL prefix
    holding such files (and an ``*.safetensors.index.json``). CheckpointError listing them for
    a folder with several index files (Hugging Face variants such as ``model.fp16``)."""
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
    index = sorted(n for n in names if n.endswith(INDEX_SUFFIX) and not n.startswith("._"))
    files = sorted(n for n in names if is_data_file(n))
    if not index and not files:
        return None
    if len(index) > 1:
        raise CheckpointError(f"{text} holds {len(index)} safetensors index files ({', '.join(index)}): which set "
                              f"is meant cannot be told; open one file, or a folder holding one set")
    if not index:
        _check_complete(files, text)
    return spec, None, index[0] if index else None


def _check_complete(files: list[str], display: str):
    """IncompleteCheckpointError if ``files`` (a folder without an index) hold shards of a set
    named ``<name>-<i>-of-<N>`` but not all N: an export under way or interrupted (an export to
    an object store writes its index last), or a copy that stopped."""
    sets: dict[tuple[str, int], int] = {}
    for match in filter(None, map(_SHARD_NAME.fullmatch, files)):
        key = (match[1], int(match[3]))
        sets[key] = sets.get(key, 0) + 1
    for (name, count), present in sorted(sets.items()):
        if present != count:
            raise IncompleteCheckpointError(f"{display} holds {present} of the {count} shards of {name} and no index: "
                                            "an export or copy under way, or one that was interrupted")


def _fetch(kv: ts.KvStore, requests: list[tuple[str, int, int | None]], display: str) -> list:
    """The results of the byte-range reads ``requests`` ((key, start, stop) each), issued
    together (one round trip however many files); CheckpointError if a file is missing or
    shorter than a read."""
    batch = ts.Batch()
    futures = [kv.read(key, byte_range=slice(start, stop), batch=batch) for key, start, stop in requests]
    batch.submit()
    results = []
    for (key, start, stop), future in zip(requests, futures):
        try:
            result = future.result()
        except ValueError as exc:  # OUT_OF_RANGE: the file is shorter
            raise CheckpointError(f"{display}: {key} is shorter than its header says (no bytes [{start}, {stop}))") from exc
        if result.state != "value":
            raise CheckpointError(f"{display}: {key} is missing")
        results.append(result)
    return results


def _headers(kv: ts.KvStore, keys: list[str], display: str) -> list[tuple[dict, int, str]]:
    """(header JSON, where the data starts, the file's generation) of each file of ``keys``,
    checked: every file's length field in one round trip, then every header in another."""
    firsts = _fetch(kv, [(key, 0, 8) for key in keys], display)
    sizes = [int.from_bytes(first.value, "little") for first in firsts]
    for key, size in zip(keys, sizes):
        if size > MAX_HEADER_BYTES:
            raise CheckpointError(f"{display}: {key} has a header of {size} bytes (at most {MAX_HEADER_BYTES} are "
                                  "read): not a safetensors file")
    found = []
    for key, size, first, text in zip(keys, sizes, firsts,
                                      _fetch(kv, [(key, 8, 8 + size) for key, size in zip(keys, sizes)], display)):
        try:
            header = json.loads(text.value)
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(f"{display}: {key} has a header that is not JSON: not a safetensors file") from exc
        if not isinstance(header, dict):
            raise CheckpointError(f"{display}: {key} has a header that is not a JSON object")
        found.append((header, 8 + size, first.stamp.generation))
    return found


def _tensors(key: str, header: dict, data: int, display: str) -> tuple[list[tuple[str, str, tuple, int]], int]:
    """(name, dtype name, shape, absolute offset) of every tensor of a checked ``header``, and
    where its data ends in the file. Shapes and offsets are bounded as numpy and TensorStore
    index them (at most :data:`MAX_AXES` axes, every dimension and byte offset below 2**63)."""
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
        if not (isinstance(shape, list) and len(shape) <= MAX_AXES
                and all(type(n) is int and 0 <= n < LIMIT for n in shape)):
            raise CheckpointError(f"{where}: malformed shape {str(shape)[:200]} (at most {MAX_AXES} axes, "
                                  "each of 0 to 2**63 - 1)")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int and n >= 0 for n in offsets)
                and offsets[0] <= offsets[1] and data + offsets[1] < LIMIT):
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
    return tensors, data + end


def _index(kv: ts.KvStore, index: str, display: str) -> dict[str, str]:
    """The weight map (tensor name -> file) of the index file ``index``, read only if it is at
    most :data:`MAX_HEADER_BYTES` (a real one is a few hundred KB)."""
    try:
        too_large = kv.read(index, byte_range=slice(MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1)).result().state == "value"
    except ValueError:  # OUT_OF_RANGE: smaller than that
        too_large = False
    if too_large:
        raise CheckpointError(f"{display}: {index} is larger than {MAX_HEADER_BYTES} bytes: not a safetensors index")
    try:
        weight_map = json.loads(_fetch(kv, [(index, 0, None)], display)[0].value)["weight_map"]
        return {str(name): str(file) for name, file in weight_map.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{display}: {index} is not a safetensors index (no weight_map)") from exc


def read(spec: dict, files: list[str] | None, index: str | None, display: str,
         context: ts.Context | None = None) -> tuple[Manifest, list[tuple[str, str]]]:
    """The safetensors at ``spec`` (:func:`find`) as (Manifest, [(file, generation)]).

    The files' headers are read together, in three round trips in all (length fields, headers,
    each file's last data byte), however many files: every process of a job opens the set.
    Raises CheckpointError naming the file (and tensor) for a malformed or inconsistent header or
    index, a tensor held by two files, a file the index names that is missing."""
    kv = ts.KvStore.open(spec, context=context).result()
    expected = None
    if index is not None:
        expected = _index(kv, index, display)
        files = sorted(set(expected.values()))
    elif files is None:
        files = sorted(key.decode() for key in kv.list().result() if is_data_file(key.decode()))
    for name in files:
        if not _FILE_NAME.fullmatch(name) or posixpath.normpath(name) != name:
            raise CheckpointError(f"{display}: {index} names {name[:200]!r}, not a .safetensors file of its folder")
    held: dict[str, tuple] = {}
    generations, ends = [], []
    for name, (header, data, generation) in zip(files, _headers(kv, files, display)):
        generations.append((name, generation))
        tensors, end = _tensors(name, header, data, display)
        if end > data:
            ends.append((name, end - 1, end))
        for tensor, dtype, shape, offset in tensors:
            if tensor in held:
                raise CheckpointError(f"{display}: tensor {tensor!r} is in both {held[tensor][0]} and {name}")
            held[tensor] = (name, dtype, shape, offset)
    _fetch(kv, ends, display)  # every file's data lies inside it
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
