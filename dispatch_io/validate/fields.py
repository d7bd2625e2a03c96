"""``manifest.json`` as JSON (ours): every field typed and bounded before anything reads it.

:func:`check_document` is the first check a reader makes: each field of the documented type and
within bounds (:data:`MAX_RANK`, :data:`MAX_DIM`, :data:`MAX_TEXT`, :data:`MAX_STRUCTURE_DEPTH`),
the structure's depth bounded, names of stored arrays matching :data:`NAME` (one path component:
nothing outside ``arrays/`` can be named). Also the error every check raises (:func:`malformed`).
"""

from __future__ import annotations

import math
import re

from dispatch_io import tree as tree_lib
from dispatch_io.errors import CorruptCheckpointError

MAX_RANK = 32                 # TensorStore's own limit
MAX_DIM = 1 << 62             # any one dimension
MAX_STRUCTURE_DEPTH = 200     # nesting of the structure JSON (two JSON levels each: far from Python's recursion limit)
MAX_TEXT = 1 << 16            # characters of a key path, dtype or impl name
NAME = re.compile(r"(?:packed\.)?[0-9]{5,12}(?:\.[A-Za-z0-9_-][A-Za-z0-9_.-]{0,79})?")
_CRC = re.compile(r"[0-9a-f]{8}")
_HEX32 = re.compile(r"(?:[0-9a-f]{4}(?:0[0-9a-f]|10)00)*")   # UTF-32-LE code points in hex (at most 0x10ffff)
_KINDS = (tree_lib.ARRAY, tree_lib.KEY, tree_lib.SCALAR)
_ORIGINS = ("jax", "numpy", "numpy_scalar", "python")


def malformed(where: str, what: str, keypath: str | None = None) -> CorruptCheckpointError:
    """The error for a checkpoint at ``where`` whose description is wrong: ``what`` says how,
    ``keypath`` (if any) names the leaf."""
    at = f"{keypath}: " if keypath else ""
    return CorruptCheckpointError(f"{where}: malformed checkpoint: {at}{what}", keypath=keypath, path=where)


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
                raise malformed(where, f"{what} {short(value)} has more than {MAX_DIM} elements besides "
                                       "its zeros", keypath)  # (even with a 0: numpy cannot make it)
            return
    raise malformed(where, f"{what} must be a list of at most {MAX_RANK} ints >= {low}, got {short(value)}",
                    keypath)


def short(value) -> str:
    """``repr(value)``, cut to 80 characters: a crafted value quoted in an error stays readable."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_document(doc: dict, where: str) -> None:
    """Raise CorruptCheckpointError unless the manifest ``doc`` (JSON-decoded, ``format`` and
    ``format_version`` already checked) has every field of the documented type and within
    bounds: what :func:`dispatch_io.manifest.parse` may then read without further checks."""
    leaves, packs = doc.get("leaves"), doc.get("packs", {})
    if not isinstance(leaves, list):
        raise malformed(where, f"manifest.json: leaves must be a list, got {short(leaves)}")
    if not isinstance(packs, dict) or not all(
            isinstance(p, dict) and _is_int(p.get("nbytes")) and NAME.fullmatch(name) and name.startswith("packed.")
            for name, p in packs.items()):
        raise malformed(where, "manifest.json: packs must map pack names to {'nbytes': int}")
    total = doc.get("total_bytes", 0)
    if not _is_int(total):
        raise malformed(where, f"manifest.json: total_bytes must be an int >= 0, got {short(total)}")
    _check_structure(doc.get("structure"), where)
    for i, entry in enumerate(leaves):
        _check_entry(entry, i, packs, where)


def _check_structure(structure, where: str) -> None:
    """The structure JSON's nodes are objects, their children lists, at most
    :data:`MAX_STRUCTURE_DEPTH` deep: checked level by level, without recursion."""
    if not isinstance(structure, dict):
        raise malformed(where, f"manifest.json: structure must be an object, got {short(structure)}")
    level, depth = [structure], 0
    while level:
        depth += 1
        if depth > MAX_STRUCTURE_DEPTH:
            raise malformed(where, f"manifest.json: structure nested deeper than {MAX_STRUCTURE_DEPTH}")
        following = []
        for node in level:
            if not isinstance(node, dict):
                raise malformed(where, f"manifest.json: structure node {short(node)} is not an object")
            for key in ("list", "tuple", "children"):
                children = node.get(key)
                if children is not None:
                    if not isinstance(children, list):
                        raise malformed(where, f"manifest.json: structure {key} must be a list")
                    following += children
        level = following


def _is_scalar(value) -> bool:
    """A scalar leaf's value as ``tree.encode_scalar`` writes it (numbers: finite)."""
    if not isinstance(value, dict) or value.get("type") not in ("bool", "int", "float", "complex", "str", "utf32"):
        return False
    if value["type"] == "utf32":   # a string with surrogates, as UTF-32-LE bytes in hex: whole code points
        return isinstance(value.get("value"), str) and _HEX32.fullmatch(value["value"]) is not None
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
        raise malformed(where, f"kind {short(kind)} / origin {short(entry.get('origin'))} "
                               f"(kinds {_KINDS}, origins {_ORIGINS})", keypath)
    if kind == tree_lib.SCALAR:
        if not _is_scalar(entry.get("value")):
            raise malformed(where, f"scalar {short(entry.get('value'))} is not {{'type': bool | int | float | "
                                   "complex | str, 'value': text or finite numbers}", keypath)
        return
    shape, key_impl = entry.get("shape"), entry.get("key_impl")
    _shape(shape, "shape", where, keypath)
    if not _is_text(entry.get("dtype")) or not (key_impl is None or _is_text(key_impl)):
        raise malformed(where, "dtype and key_impl must be text", keypath)
    if (kind == tree_lib.KEY) != (key_impl is not None):
        raise malformed(where, "a key_impl is for key leaves, and every key leaf has one", keypath)
    if not describes_sharding(sharding := entry.get("sharding")):
        raise malformed(where, f"sharding {short(sharding)} is not a described sharding", keypath)
    stored = entry.get("stored")
    if stored is None:
        if math.prod(shape):
            raise malformed(where, f"a leaf of shape {shape} has nothing stored", keypath)
        return
    if not isinstance(stored, dict) or not _is_text(stored.get("dtype")):
        raise malformed(where, f"stored must be an object with a text dtype, got {short(stored)}", keypath)
    _shape(stored.get("shape"), "stored shape", where, keypath)
    _shape(stored.get("chunk_shape"), "chunk_shape", where, keypath, low=1)
    if "pack" in stored:
        pack = stored["pack"]
        if not isinstance(pack, str) or pack not in packs or not _is_int(stored.get("offset")):
            raise malformed(where, f"stored in pack {short(pack)} at offset "
                                   f"{short(stored.get('offset'))}, which the manifest's packs do not list", keypath)
    elif not (isinstance(stored.get("name"), str) and NAME.fullmatch(stored["name"])):
        raise malformed(where, f"stored array name {short(stored.get('name'))} is not '<index>.<hint>' "
                               f"({NAME.pattern})", keypath)
    crc = stored.get("crc32c")
    if crc is not None and not (isinstance(crc, dict) and all(
            isinstance(k, str) and _CHUNK_INDEX.fullmatch(k) and isinstance(v, str) and _CRC.fullmatch(v)
            for k, v in crc.items())):
        raise malformed(where, "crc32c must map chunk indices 'i,j,...' to 8 hex digits", keypath)


