"""Each stored array's own ``zarr.json`` (ours) agrees with the manifest: shape, dtype, chunk grid, codecs.

:func:`check_stored` reads them all at once (each at most :data:`MAX_ZARR_JSON_BYTES`) when the
checkpoint is opened, before any buffer; :func:`stored_problem` is the comparison of one.
"""

from __future__ import annotations

import json
import re

import tensorstore as ts

from dispatch_io.validate.fields import malformed, short
from dispatch_io.workers import COMPRESSIONS, ArraySpec, brief_error
from dispatch_io.workers.layouts import NODE_CACHE

MAX_ZARR_JSON_BYTES = 1 << 20


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
        return f"zarr.json is not an object: {short(metadata)}"
    for field in ("zarr_format", "node_type", "shape", "data_type", "chunk_grid"):
        if metadata.get(field) != expected[field]:
            return f"zarr.json {field} {short(metadata.get(field))}, the manifest says {short(expected[field])}"
    if metadata.get("chunk_key_encoding", expected["chunk_key_encoding"]) != expected["chunk_key_encoding"]:
        return f"zarr.json chunk_key_encoding {short(metadata['chunk_key_encoding'])}, expected the default"
    codecs = metadata.get("codecs")   # as written (equal: equal as compared), else as compared
    if codecs != expected["codecs"] and _codecs(codecs) != _codecs(expected["codecs"]):
        return f"zarr.json codecs {short(metadata.get('codecs'))}, the manifest says {short(expected['codecs'])}"
    if metadata.get("storage_transformers", []) != []:
        return f"zarr.json storage_transformers {short(metadata['storage_transformers'])}, none written"
    for field, value in metadata.items():   # zarr v3: an unknown field must be understood unless marked
        if field not in _ZARR_FIELDS and not (isinstance(value, dict) and value.get("must_understand") is False):
            return f"zarr.json field {field!r}, which this reader does not understand"
    fill = metadata.get("fill_value")
    if not (_fill_number(fill, expected["fill_value"]) if not isinstance(expected["fill_value"], list) else
            isinstance(fill, list) and len(fill) == 2 and all(_fill_number(f, 0.0) for f in fill)):
        return f"zarr.json fill_value {short(fill)}, not a fill value of {expected['data_type']}"
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
