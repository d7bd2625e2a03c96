"""What a valid checkpoint description is: every check a reader makes before it plans or allocates.

Checkpoints travel (shared buckets, downloads, a teammate's directory), so a reader treats every
file of one as untrusted input. A damaged or crafted description must end in a prompt
:class:`~dispatch_io.errors.CorruptCheckpointError` ("malformed checkpoint", what is wrong, the
key path, the path), never in a plan sized by what a file claims. The checks, in the order a
checkpoint is opened:

* :func:`check_document` -- ``manifest.json`` as JSON (ours): every field typed and bounded,
  the structure's depth and size bounded, names of stored arrays matching the documented
  pattern (one path component, so nothing outside ``arrays/`` can be named).
* :func:`check_manifest` -- the parsed description (ours and Orbax's): logical and stored
  shapes agree, chunk shapes tile the stored shape in at most :data:`MAX_CHUNKS` chunks, saved
  checksums name chunks of the grid, sizes add up to ``total_bytes``.
* :func:`check_stored` -- each stored array's own ``zarr.json`` (ours) agrees with the manifest:
  shape, dtype, chunk grid, codecs. Read when the checkpoint is opened, before any buffer.

What a reader checks is listed in ``docs/format.md`` ("What a reader checks").
"""

from __future__ import annotations

import functools
import json
import math
import re

import tensorstore as ts

from dispatch_io import tree as tree_lib
from dispatch_io.errors import CorruptCheckpointError
from workers import COMPRESSIONS, ArraySpec, brief_error, numpy_dtype
from workers.layouts import NODE_CACHE

MAX_RANK = 32                 # TensorStore's own limit
MAX_DIM = 1 << 62             # any one dimension
MAX_CHUNKS = 1 << 24          # chunks of one stored array: what a plan or a verify may iterate over
MAX_STRUCTURE_DEPTH = 200     # nesting of the structure JSON (two JSON levels each: far from Python's recursion limit)
MAX_TEXT = 1 << 16            # characters of a key path, dtype or impl name
MAX_ZARR_JSON_BYTES = 1 << 20
NAME = re.compile(r"(?:packed\.)?[0-9]{5,12}(?:\.[A-Za-z0-9_-][A-Za-z0-9_.-]{0,79})?")
_CRC = re.compile(r"[0-9a-f]{8}")
_KINDS = (tree_lib.ARRAY, tree_lib.KEY, tree_lib.SCALAR)
_ORIGINS = ("jax", "numpy", "numpy_scalar", "python")


def malformed(where: str, what: str, keypath: str | None = None) -> CorruptCheckpointError:
    """The error for a checkpoint at ``where`` whose description is wrong: ``what`` says how,
    ``keypath`` (if any) names the leaf."""
    at = f"{keypath}: " if keypath else ""
    return CorruptCheckpointError(f"{where}: malformed checkpoint: {at}{what}", keypath=keypath, path=where)


# ---- manifest.json, as JSON --------------------------------------------------------------------

def _is_int(value, low: int = 0, high: int = MAX_DIM) -> bool:
    return type(value) is int and low <= value <= high


def _is_text(value) -> bool:
    return isinstance(value, str) and len(value) <= MAX_TEXT


def _shape(value, what: str, where: str, keypath: str, low: int = 0) -> None:
    """Raise unless ``value`` is a list of at most :data:`MAX_RANK` ints in ``[low, MAX_DIM]``
    whose non-zero ones multiply to at most :data:`MAX_DIM` (a loop: it runs thrice per leaf)."""
    if isinstance(value, list) and len(value) <= MAX_RANK:
        for n in value:
            if type(n) is not int or n < low or n > MAX_DIM:
                break
        else:
            if len(value) > 1 and math.prod(value if 0 not in value else [n for n in value if n]) > MAX_DIM:
                raise malformed(where, f"{what} {_short(value)} has more than {MAX_DIM} elements besides "
                                       "its zeros", keypath)  # (even with a 0: numpy cannot make it)
            return
    raise malformed(where, f"{what} must be a list of at most {MAX_RANK} ints >= {low}, got {_short(value)}",
                    keypath)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_document(doc: dict, where: str) -> None:
    """Raise CorruptCheckpointError unless the manifest ``doc`` (JSON-decoded, ``format`` and
    ``format_version`` already checked) has every field of the documented type and within
    bounds: what :func:`dispatch_io.manifest.parse` may then read without further checks."""
    leaves, packs = doc.get("leaves"), doc.get("packs", {})
    if not isinstance(leaves, list):
        raise malformed(where, f"manifest.json: leaves must be a list, got {_short(leaves)}")
    if not isinstance(packs, dict) or not all(
            isinstance(p, dict) and _is_int(p.get("nbytes")) and NAME.fullmatch(name) and name.startswith("packed.")
            for name, p in packs.items()):
        raise malformed(where, "manifest.json: packs must map pack names to {'nbytes': int}")
    total = doc.get("total_bytes", 0)
    if not _is_int(total):
        raise malformed(where, f"manifest.json: total_bytes must be an int >= 0, got {_short(total)}")
    _check_structure(doc.get("structure"), where)
    for i, entry in enumerate(leaves):
        _check_entry(entry, i, packs, where)


def _check_structure(structure, where: str) -> None:
    """The structure JSON's nodes are objects, their children lists, at most
    :data:`MAX_STRUCTURE_DEPTH` deep: checked level by level, without recursion."""
    if not isinstance(structure, dict):
        raise malformed(where, f"manifest.json: structure must be an object, got {_short(structure)}")
    level, depth = [structure], 0
    while level:
        depth += 1
        if depth > MAX_STRUCTURE_DEPTH:
            raise malformed(where, f"manifest.json: structure nested deeper than {MAX_STRUCTURE_DEPTH}")
        following = []
        for node in level:
            if not isinstance(node, dict):
                raise malformed(where, f"manifest.json: structure node {_short(node)} is not an object")
            for key in ("list", "tuple", "children"):
                children = node.get(key)
                if children is not None:
                    if not isinstance(children, list):
                        raise malformed(where, f"manifest.json: structure {key} must be a list")
                    following += children
        level = following


def _is_scalar(value) -> bool:
    """A scalar leaf's value as ``tree.encode_scalar`` writes it (numbers: finite)."""
    if not isinstance(value, dict) or value.get("type") not in ("bool", "int", "float", "complex", "str"):
        return False
    parts = value.get("value")
    parts = parts if value["type"] == "complex" and isinstance(parts, list) and len(parts) == 2 else [parts]
    return all(isinstance(p, str) or (isinstance(p, (int, float)) and math.isfinite(p)) for p in parts)


def describes_sharding(value) -> bool:
    """Whether ``value`` is a saved sharding as the manifest describes it for people
    (``manifest.describe_sharding``'s form, or None), which ``inspect`` prints."""
    if value is None:
        return True
    if not isinstance(value, dict) or not _is_text(value.get("type")):
        return False
    if value["type"] == "NamedSharding":
        mesh, spec = value.get("mesh"), value.get("spec")
        if not isinstance(mesh, dict) or not isinstance(spec, list):
            return False
        if not all(_is_text(axis) and _is_int(size) for axis, size in mesh.items()):
            return False
        return all(p is None or _is_text(p) or (isinstance(p, list) and all(map(_is_text, p))) for p in spec)
    if value["type"] == "SingleDeviceSharding":
        return "device" in value and (value["device"] is None or _is_int(value["device"]) or _is_text(value["device"]))
    return True


_CHUNK_INDEX = re.compile(r"[0-9]{1,19}(?:,[0-9]{1,19})*|")


def _check_entry(entry, i: int, packs: dict, where: str) -> None:
    """Raise unless the ``i``-th leaf entry is as :func:`check_document` says (each field read once)."""
    if not isinstance(entry, dict) or not _is_text(entry.get("keypath")):
        raise malformed(where, f"manifest.json: leaf {i} must be an object with a text keypath")
    keypath, kind = entry["keypath"], entry.get("kind")
    if kind not in _KINDS or entry.get("origin") not in _ORIGINS:
        raise malformed(where, f"kind {_short(kind)} / origin {_short(entry.get('origin'))} "
                               f"(kinds {_KINDS}, origins {_ORIGINS})", keypath)
    if kind == tree_lib.SCALAR:
        if not _is_scalar(entry.get("value")):
            raise malformed(where, f"scalar {_short(entry.get('value'))} is not {{'type': bool | int | float | "
                                   "complex | str, 'value': text or finite numbers}", keypath)
        return
    shape, key_impl = entry.get("shape"), entry.get("key_impl")
    _shape(shape, "shape", where, keypath)
    if not _is_text(entry.get("dtype")) or not (key_impl is None or _is_text(key_impl)):
        raise malformed(where, "dtype and key_impl must be text", keypath)
    if (kind == tree_lib.KEY) != (key_impl is not None):
        raise malformed(where, "a key_impl is for key leaves, and every key leaf has one", keypath)
    if not describes_sharding(sharding := entry.get("sharding")):
        raise malformed(where, f"sharding {_short(sharding)} is not a described sharding", keypath)
    stored = entry.get("stored")
    if stored is None:
        if math.prod(shape):
            raise malformed(where, f"a leaf of shape {shape} has nothing stored", keypath)
        return
    if not isinstance(stored, dict) or not _is_text(stored.get("dtype")):
        raise malformed(where, f"stored must be an object with a text dtype, got {_short(stored)}", keypath)
    _shape(stored.get("shape"), "stored shape", where, keypath)
    _shape(stored.get("chunk_shape"), "chunk_shape", where, keypath, low=1)
    if "pack" in stored:
        pack = stored["pack"]
        if not isinstance(pack, str) or pack not in packs or not _is_int(stored.get("offset")):
            raise malformed(where, f"stored in pack {_short(pack)} at offset "
                                   f"{_short(stored.get('offset'))}, which the manifest's packs do not list", keypath)
    elif not (isinstance(stored.get("name"), str) and NAME.fullmatch(stored["name"])):
        raise malformed(where, f"stored array name {_short(stored.get('name'))} is not '<index>.<hint>' "
                               f"({NAME.pattern})", keypath)
    crc = stored.get("crc32c")
    if crc is not None and not (isinstance(crc, dict) and all(
            isinstance(k, str) and _CHUNK_INDEX.fullmatch(k) and isinstance(v, str) and _CRC.fullmatch(v)
            for k, v in crc.items())):
        raise malformed(where, "crc32c must map chunk indices 'i,j,...' to 8 hex digits", keypath)


# ---- the parsed description (ours and Orbax's) --------------------------------------------------

@functools.cache
def _key_data(impl: str) -> tuple[tuple[int, ...], str]:
    """(trailing dims, dtype name) of the ``key_data`` of one PRNG key of ``impl``."""
    import jax

    data = jax.eval_shape(jax.random.key_data, jax.random.key(0, impl=impl))
    return data.shape, data.dtype.name


def chunk_count(spec: ArraySpec) -> int:
    """How many chunks tile the stored array ``spec`` (its chunk shape over its shape)."""
    return math.prod(-(-n // c) for n, c in zip(spec.shape, spec.chunk_shape))


def check_manifest(manifest, where: str, names: re.Pattern | None = NAME) -> None:
    """Raise CorruptCheckpointError unless the parsed ``manifest`` (a Manifest) is consistent:
    each leaf's stored shape is its logical shape (keys: plus the impl's trailing dims), its
    chunk shape has its rank and tiles it in at most :data:`MAX_CHUNKS` chunks, its checksums
    name chunks of that grid, a packed leaf lies inside its pack, stored names match ``names``
    (None: names only need to be safe relative paths: Orbax's) and the stored bytes add up to
    ``total_bytes`` (when it is known, non-zero). A pair of stored and leaf dtype, and a
    stored array (a pack that thousands of leaves share), are checked once, not once per leaf."""
    total = 0
    dtypes_agree, arrays_checked = set(), set()   # (stored dtype, leaf dtype or key impl); id(stored array)
    for leaf in manifest.leaves:
        spec = leaf.stored
        if spec is None:
            continue
        keypath, expected = leaf.keypath, tuple(leaf.shape)
        if leaf.key_impl is not None:
            expected += _key_data(leaf.key_impl)[0]
        if spec.shape != expected:
            raise malformed(where, f"stored shape {list(spec.shape)} is not the leaf's {list(expected)}", keypath)
        pair = (spec.dtype, leaf.dtype if leaf.key_impl is None else leaf.key_impl)
        if pair not in dtypes_agree:
            _check_dtype(spec.dtype, leaf, where)
            dtypes_agree.add(pair)
        if id(array := spec.stored) not in arrays_checked:
            _check_tiling(array, names, where, keypath)
            arrays_checked.add(id(array))
        nbytes = spec.nbytes
        if spec.packed is not None:
            pack, offset = spec.packed
            if offset + nbytes > pack.shape[0]:
                raise malformed(where, f"bytes [{offset}, {offset + nbytes}) are not inside pack "
                                       f"{pack.name} of {pack.shape[0]} bytes", keypath)
        if leaf.checksums:
            grid = [-(-n // c) for n, c in zip(spec.shape, spec.chunk_shape)]
            for index in leaf.checksums:
                if len(index) != len(grid) or not all(0 <= i < n for i, n in zip(index, grid)):
                    raise malformed(where, f"a checksum of chunk {list(index)}, outside its chunk grid {grid}", keypath)
        total += nbytes
    if manifest.total_bytes and manifest.total_bytes != total:
        raise malformed(where, f"manifest.json: total_bytes {manifest.total_bytes} is not the {total} bytes "
                               "its leaves store")


def _check_dtype(stored: str, leaf, where: str) -> None:
    """Raise unless the stored dtype name ``stored`` is ``leaf``'s dtype (keys: its impl's key
    data dtype) and holds no Python objects."""
    dtype = getattr(leaf.dtype, "name", None) if leaf.key_impl is None else _key_data(leaf.key_impl)[1]
    if numpy_dtype(stored).name != dtype:
        raise malformed(where, f"stored dtype {stored} is not the leaf's {dtype}", leaf.keypath)
    if numpy_dtype(stored).hasobject:  # bytes read into Python object pointers
        raise malformed(where, f"dtype {stored} holds Python objects, never stored", leaf.keypath)


def _check_tiling(array: ArraySpec, names: re.Pattern | None, where: str, keypath: str) -> None:
    """Raise unless the stored ``array``'s chunk shape has its rank and tiles it in at most
    :data:`MAX_CHUNKS` chunks, and its name matches ``names`` (:func:`check_name`)."""
    if len(array.chunk_shape) != len(array.shape) or min(array.chunk_shape, default=1) < 1:
        raise malformed(where, f"chunk shape {list(array.chunk_shape)} does not tile stored shape "
                               f"{list(array.shape)}", keypath)
    if (count := chunk_count(array)) > MAX_CHUNKS:
        raise malformed(where, f"stored shape {list(array.shape)} in chunks of {list(array.chunk_shape)} is "
                               f"{count} chunks, more than {MAX_CHUNKS}", keypath)
    check_name(array.name, names, where, keypath)


def check_name(name: str, pattern: re.Pattern | None, where: str, keypath: str) -> None:
    """Raise CorruptCheckpointError unless the stored array name ``name`` matches ``pattern``
    (None: Orbax's names, which need only be relative paths without empty, ``.`` or ``..``
    components) -- a name that could lead outside the checkpoint's arrays."""
    if pattern is not None:
        safe = pattern.fullmatch(name) is not None
    else:
        parts = name.split("/")  # "": Orbax's tree of one leaf, stored at the item itself
        safe = name == "" or ("\0" not in name and "\\" not in name and all(p not in ("", ".", "..") for p in parts))
    if not safe:
        raise malformed(where, f"stored array name {name!r} is not a name inside the checkpoint", keypath)


# ---- the stored arrays' own metadata (ours) -----------------------------------------------------

def _codecs(codecs) -> list:
    """zarr3 codecs as (name, configuration) pairs; the ``bytes`` codec's endianness only where
    it matters (TensorStore writes it for one-byte types or not)."""
    out = []
    for codec in codecs if isinstance(codecs, list) else [codecs]:
        if not isinstance(codec, dict):
            return [("invalid", codec)]
        config = codec.get("configuration") or {}
        if not isinstance(config, dict):
            return [("invalid", codec)]
        if codec.get("name") == "bytes":
            config = {k: v for k, v in config.items() if k != "endian" or v != "little"}
        out.append((codec.get("name"), config))
    return out


def stored_problem(metadata, spec: ArraySpec, compression) -> str | None:
    """What in the stored array's zarr v3 ``metadata`` (``zarr.json``, decoded) disagrees with
    ``spec`` written with ``compression`` (the manifest's ``(codec, level)`` or None); None if
    nothing does."""
    expected = spec.zarr_metadata(compression)
    if not isinstance(metadata, dict):
        return f"zarr.json is not an object: {_short(metadata)}"
    for field in ("zarr_format", "node_type", "shape", "data_type", "chunk_grid"):
        if metadata.get(field) != expected[field]:
            return f"zarr.json {field} {_short(metadata.get(field))}, the manifest says {_short(expected[field])}"
    if metadata.get("chunk_key_encoding", expected["chunk_key_encoding"]) != expected["chunk_key_encoding"]:
        return f"zarr.json chunk_key_encoding {_short(metadata['chunk_key_encoding'])}, expected the default"
    codecs = metadata.get("codecs")   # as written (equal: equal as compared), else as compared
    if codecs != expected["codecs"] and _codecs(codecs) != _codecs(expected["codecs"]):
        return f"zarr.json codecs {_short(metadata.get('codecs'))}, the manifest says {_short(expected['codecs'])}"
    if metadata.get("storage_transformers", []) != []:
        return f"zarr.json storage_transformers {_short(metadata['storage_transformers'])}, none written"
    for field, value in metadata.items():   # zarr v3: an unknown field must be understood unless marked
        if field not in _ZARR_FIELDS and not (isinstance(value, dict) and value.get("must_understand") is False):
            return f"zarr.json field {field!r}, which this reader does not understand"
    fill = metadata.get("fill_value")
    if not (_fill_number(fill, expected["fill_value"]) if not isinstance(expected["fill_value"], list) else
            isinstance(fill, list) and len(fill) == 2 and all(_fill_number(f, 0.0) for f in fill)):
        return f"zarr.json fill_value {_short(fill)}, not a fill value of {expected['data_type']}"
    return None


_ZARR_FIELDS = frozenset(("zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding",
                          "fill_value", "codecs", "attributes", "dimension_names", "storage_transformers"))


def _fill_number(value, zero) -> bool:
    """Whether ``value`` is a zarr v3 fill value of the kind of ``zero`` (bool, int or float)."""
    if isinstance(zero, bool) or isinstance(value, bool):
        return isinstance(zero, bool) and isinstance(value, bool)
    if isinstance(zero, int):
        return isinstance(value, int)
    return isinstance(value, (int, float)) or (isinstance(value, str) and (
        value in ("NaN", "Infinity", "-Infinity") or re.fullmatch(r"0x[0-9a-fA-F]{1,32}", value) is not None))


def check_stored(manifest, kvstore: dict, context: ts.Context | None, where: str) -> None:
    """Raise CorruptCheckpointError unless every stored array of ``manifest`` (ours) has a
    ``zarr.json`` under ``kvstore`` (the arrays, ``workers.layout_kvstore``) that agrees with
    it (:func:`stored_problem`): all read at once, before anything is planned. Codecs other
    than :data:`workers.COMPRESSIONS` are refused. A ``zarr.json`` that cannot be read is lost
    data, left to the read of its leaf (which opens the array before it makes a buffer for it,
    ``workers.read_items``)."""
    arrays: dict[str, tuple[ArraySpec, str]] = {}
    unpacked: set[str] = set()   # names of arrays that are one leaf's own: no other leaf may name them
    for leaf in manifest.leaves:
        if leaf.stored is not None:
            name = leaf.stored.stored.name
            if name in arrays and (name in unpacked or leaf.stored.packed is None):
                raise malformed(where, f"stored array {name} is also {arrays[name][1]}'s", leaf.keypath)
            arrays.setdefault(name, (leaf.stored.stored, leaf.keypath))
            if leaf.stored.packed is None:
                unpacked.add(name)
    if not arrays:
        return
    if manifest.compression is not None and manifest.compression[0] not in COMPRESSIONS:
        raise malformed(where, f"manifest.json: compression {manifest.compression}")
    context = ts.Context(NODE_CACHE, parent=context) if context is not None else ts.Context(NODE_CACHE)
    try:
        store = ts.KvStore.open(kvstore, context=context).result()
    except Exception as exc:  # noqa: BLE001 - TensorStore's error kinds; condensed here, chained
        raise malformed(where, f"cannot open its arrays: {brief_error(exc)}") from exc
    past = slice(MAX_ZARR_JSON_BYTES, MAX_ZARR_JSON_BYTES + 1)   # a byte past the bound: none for a real one
    with ts.Batch() as batch:   # each batch submitted at once (OCDBT: its tree nodes read once for all)
        probes = {name: store.read(f"{name}/zarr.json", byte_range=past, batch=batch) for name in arrays}
    for name, probe in probes.items():
        if probe.exception() is None and probe.result().state == "value":
            raise malformed(where, f"{name}/zarr.json is larger than {MAX_ZARR_JSON_BYTES} bytes", arrays[name][1])
    with ts.Batch() as batch:
        reads = {name: store.read(f"{name}/zarr.json", batch=batch) for name in arrays}
    for name, future in reads.items():
        spec, keypath = arrays[name]
        if future.exception() is not None or future.result().state != "value":
            continue  # lost, not malformed: reading the leaf fails naming it, a partial restore of others works
        try:
            metadata = json.loads(future.result().value)
        except (ValueError, RecursionError) as exc:
            raise malformed(where, f"{name}/zarr.json is not JSON ({exc})", keypath) from exc
        problem = stored_problem(metadata, spec, manifest.compression)
        if problem is not None:
            raise malformed(where, f"stored array {name}: {problem}", keypath)
