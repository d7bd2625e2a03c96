"""The versioned manifest: everything needed to read a checkpoint back, as plain JSON.

::

    {"format": "dispatch_io", "format_version": 2,     # 1: written without packs
     "layout": "ocdbt" | "files",           # how arrays/ stores chunks (absent: "files")
     "compression": {"codec": "zstd", "level": 3} | null,   # of every stored array (absent: null)
     "structure": {...},                   # tree.encode_structure
     "leaves": [{"keypath": "['params']['w']", "kind": "array" | "key" | "scalar",
                 "origin": "jax" | "numpy" | "numpy_scalar" | "python",
                 "shape": [...], "dtype": "bfloat16",    # logical; keys: "key<fry>"
                 "key_impl": "threefry2x32" | null,
                 "stored": {"name": "00003.params.w", "shape": [...], "dtype": "bfloat16",
                            "chunk_shape": [...],
                            "pack": "packed.00001.layer", "offset": 4096,  # packed leaves only
                            "crc32c": {"0,1": "8c3f0a1e", ...}} | null,  # crc32c: Options(checksums=True);
                                                                         # null: scalars, zero-size arrays
                 "sharding": {...} | null,               # as saved, for people (inspect)
                 "value": {...}},                         # Python scalars only
                ...],
     "packs": {"packed.00001.layer": {"nbytes": N}, ...},   # version 2 only
     "keys": "names",                      # converted from Orbax: targets match by key names
     "total_bytes": N}

Dtypes are stored by their numpy / ml_dtypes name, never by numpy descr strings. A packed
leaf's bytes (C order, stored dtype) are ``[offset, offset + nbytes)`` of its pack, a 1-D
``uint8`` array under ``arrays/`` (``workers.packs``); its one chunk is the whole leaf.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable

import jax

from dispatch_io import tree as tree_lib
from dispatch_io import validate
from dispatch_io.errors import CheckpointError, TreeMismatchError
from dispatch_io.plan.save_plan import Plan, native_order
from dispatch_io.storage import ARRAYS, FORMAT, sealed
from dispatch_io.workers import LAYOUTS, ArraySpec, compression_codec, numpy_dtype, pack_spec, packed_leaf
from dispatch_io.jax_compat import is_single_device_sharding

FORMAT_VERSION = 2            # written when the checkpoint has packs; 1 otherwise
READS_VERSIONS = (1, 2, 3)   # 3: an incremental step's references (dispatch_io.incremental.references)
REFERENCES_VERSION = 3       # written when the checkpoint has references
REFERENCES = "references"    # the top-level field naming the steps an incremental step references


def describe_sharding(sharding) -> dict | None:
    if sharding is None:
        return None
    if isinstance(sharding, jax.sharding.NamedSharding):
        return {"type": "NamedSharding", "mesh": {str(axis): size for axis, size in sharding.mesh.shape.items()},
                "spec": [None if p is None else ([str(a) for a in p] if isinstance(p, tuple) else str(p))
                         for p in sharding.spec]}
    if is_single_device_sharding(sharding):
        return {"type": "SingleDeviceSharding", "device": next(iter(sharding.device_set)).id}
    return {"type": type(sharding).__name__, "repr": repr(sharding)}


_ARRAYS_PATH = re.compile(r"^arrays/([0-9a-f]+/)?\Z")


def describe(plan: Plan) -> tuple[dict, list[dict], dict]:
    """(structure, leaf entries, packs) of the manifest of ``plan``: what every save of the
    plan writes the same (:func:`build` adds scalar values and checksums). Callers may keep it
    for later saves of the plan; nothing here changes it."""
    entries, packs = [], {}
    for spec in plan.leaves:
        entry: dict[str, Any] = {"keypath": spec.keypath, "kind": spec.kind, "origin": spec.origin}
        if spec.kind != tree_lib.SCALAR:
            entry.update(
                shape=list(spec.spec.shape), dtype=str(spec.spec.dtype), key_impl=spec.key_impl,
                sharding=describe_sharding(spec.spec.sharding),
                stored=None if spec.storage is None else {
                    "name": spec.storage, "shape": list(spec.shape), "dtype": spec.dtype.name,
                    "chunk_shape": list(spec.chunk_shape)})
            if spec.packed is not None:
                name, size, offset = spec.packed
                entry["stored"].update(pack=name, offset=offset)
                packs[name] = {"nbytes": size}
        entries.append(entry)
    return tree_lib.encode_structure(plan.treedef), entries, packs


def scalar_values(plan: Plan, leaves) -> tuple:
    """Per leaf of ``plan``, its Python scalar value in ``leaves`` as the manifest stores it (None
    for arrays). Made when a save starts, so that a value the manifest cannot hold fails the
    save before anything is written: ValueError naming the key path (an int of more digits than
    Python writes, ``sys.get_int_max_str_digits()``)."""
    out = []
    for spec, leaf in zip(plan.leaves, leaves):
        if spec.kind != tree_lib.SCALAR:
            out.append(None)
            continue
        try:
            out.append(tree_lib.encode_scalar(leaf))
        except ValueError as exc:
            raise ValueError(f"{spec.keypath}: this Python {type(leaf).__name__} cannot be saved: {exc}") from exc
    return tuple(out)


def build(plan: Plan, scalars: tuple, checksums: dict[int, int] | None = None, layout: str = "ocdbt",
          arrays: str = ARRAYS, compression: tuple[str, int] | None = None, described=None,
          increment=None) -> bytes:
    """The manifest for a save of ``plan``; ``scalars`` (:func:`scalar_values`) the Python scalars,
    ``checksums`` (chunk index -> CRC-32C) the per-chunk checksums, if computed, ``layout``
    the chunk layout of ``arrays`` (where in the checkpoint the arrays are: ``arrays/``, or on
    object stores ``arrays/<save id>/``), ``compression`` the ``(codec, level)`` every array
    was written with (None: uncompressed), ``described`` :func:`describe` of ``plan`` if
    already known; ``increment`` an incremental save's decisions, every process's, as plain data
    (``incremental.changes.Increment``: ``digests`` chunk index -> digest of every chunk saved,
    ``refs`` chunk index -> (step, commit id) of the unchanged ones, ``crcs`` chunk index ->
    CRC-32C carried over from the step that stores it), None for a full save."""
    structure, entries, packs = described or describe(plan)
    by_leaf: dict[int, dict[str, str]] = {}
    for i, crc in (checksums or {}).items():
        chunk = plan.chunks[i]
        grid = (lo // step for (lo, _), step in zip(chunk.region, plan.leaves[chunk.leaf].chunk_shape))
        by_leaf.setdefault(chunk.leaf, {})[",".join(map(str, grid))] = f"{crc:08x}"
    entries = list(entries)
    for spec, value in zip(plan.leaves, scalars):
        if spec.kind == tree_lib.SCALAR:
            entries[spec.index] = {**entries[spec.index], "value": value}
        elif spec.index in by_leaf:  # chunk grid index "i,j,..." -> CRC-32C, hex
            entry = entries[spec.index]
            entries[spec.index] = {**entry, "stored": {**entry["stored"], "crc32c": dict(sorted(by_leaf[spec.index].items()))}}
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION if packs else 1, "layout": layout,
           "compression": None if compression is None else {"codec": compression[0], "level": compression[1]},
           **({"arrays": arrays} if arrays != ARRAYS else {}),
           "structure": structure, "leaves": entries, **({"packs": packs} if packs else {}),
           **({"keys": "names"} if plan.keys_by_name else {}),
           # the leaves' bytes, not the chunks': a local-tier save writes only its own regions of them
           "total_bytes": sum(spec.nbytes for spec in plan.leaves if spec.storage), "jax_version": jax.__version__}
    if increment is not None:
        _add_increment(doc, plan, increment.digests, increment.refs, increment.crcs)
    return sealed.dumps(doc)  # compact: C-encoded, 10x faster on 10k leaves; sealed: a flipped byte is caught


def grid_key(grid) -> str:
    """A chunk's grid index as a manifest's key: ``"i,j,..."``."""
    return ",".join(map(str, grid))


def parse_grid(key: str) -> tuple[int, ...]:
    return tuple(int(i) for i in key.split(",") if i)


def _add_increment(doc: dict, plan: Plan, digests: dict, refs: dict, crcs: dict) -> None:
    """Add to the manifest ``doc`` (being built for ``plan``) each chunk's digest, the references
    of the unchanged ones and the CRC-32Cs carried over (as :func:`build`'s ``increment``); a
    manifest with references is format version 3 (docs/format.md, "Incremental steps")."""
    targets = sorted(set(refs.values()))
    index = {t: k for k, t in enumerate(targets)}
    per_leaf: dict[int, dict] = {}
    for i, d in digests.items():
        chunk = plan.chunks[i]
        grid = grid_key(lo // c for (lo, _), c in zip(chunk.region, plan.leaves[chunk.leaf].chunk_shape))
        entry = per_leaf.setdefault(chunk.leaf, {"digests": {}, "refs": {}, "crc32c": {}})
        entry["digests"][grid] = d
        if i in refs:
            entry["refs"].setdefault(str(index[refs[i]]), []).append(grid)
        if i in crcs:
            entry["crc32c"][grid] = f"{crcs[i]:08x}"
    leaves = doc["leaves"]
    for leaf, entry in per_leaf.items():
        stored = {**leaves[leaf]["stored"], "digests": dict(sorted(entry["digests"].items()))}
        if entry["crc32c"]:
            stored["crc32c"] = dict(sorted({**stored.get("crc32c", {}), **entry["crc32c"]}.items()))
        if entry["refs"]:
            stored["refs"] = {k: sorted(v, key=parse_grid) for k, v in entry["refs"].items()}
        leaves[leaf] = {**leaves[leaf], "stored": stored}
    if targets:
        doc[REFERENCES] = [{"step": s, "commit": c} for s, c in targets]
        doc["format_version"] = REFERENCES_VERSION


@functools.cache
def key_dtype(impl: str):
    """The key dtype (``key<fry>`` ...) of a PRNG impl name."""
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


@dataclasses.dataclass(frozen=True)
class SavedLeaf:
    """One leaf as the manifest describes it."""

    keypath: str
    kind: str
    origin: str
    shape: tuple[int, ...] = ()
    dtype: Any = None              # np.dtype, or a key dtype for keys
    key_impl: str | None = None
    stored: ArraySpec | None = None
    value: Any = None              # Python scalars
    checksums: dict | None = None  # chunk grid index (tuple) -> CRC-32C, when saved with checksums
    sharding: Any = None           # the saved jax Sharding, where the format records one usable here
    described_sharding: dict | None = None  # the saved sharding for people (describe_sharding's form)

    @property
    def abstract(self):
        """ShapeDtypeStruct (with the saved sharding, if known) for arrays and keys; the value
        itself for Python scalars."""
        if self.kind == tree_lib.SCALAR:
            return self.value
        return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=self.sharding)


@dataclasses.dataclass(frozen=True)
class Manifest:
    treedef: Any
    leaves: tuple[SavedLeaf, ...]
    total_bytes: int
    layout: str = "files"
    arrays: str = ARRAYS   # where the arrays are, relative to the checkpoint
    compression: tuple[str, int] | None = None  # (codec, level) of our arrays; None: raw (or not ours)
    format: str = FORMAT   # who wrote it: "dispatch_io", or "orbax" (read by dispatch_io.formats.orbax)
    keys_by_name: bool = False  # targets match leaves by key names (:meth:`saved_leaf`)
    # Targets match the leaf whose key names joined by "." are tensor_names(target key path)
    # (safetensors; restore(names=...) for any checkpoint).
    tensor_names: Callable[[tuple], str] | None = None

    @property
    def has_checksums(self) -> bool:
        """Saved with ``Options(checksums=True)``: CRC-32Cs of the stored chunks."""
        return any(leaf.checksums for leaf in self.leaves)

    @functools.cached_property
    def by_keypath(self) -> dict[str, SavedLeaf]:
        return {leaf.keypath: leaf for leaf in self.leaves}

    def saved_leaf(self, path, keypath: str) -> SavedLeaf | None:
        """The saved leaf that a restore target's leaf at ``path`` (a JAX key path; ``keypath``
        its text, ``jax.tree_util.keystr``, which the caller has) is read from, or None. Our
        checkpoints match the key path exactly, as text.
        An Orbax checkpoint, and ours converted from one, matches as Orbax does, by its names of
        the keys (:func:`~dispatch_io.tree.key_names`): Orbax stores a NamedTuple field or
        dataclass attribute as a dict key and an int dict key as its text, so a target holding
        them matches the checkpoint they were saved from. With ``tensor_names`` (safetensors, or
        ``restore(names=...)``), the leaf whose key names joined by ``.`` are
        :meth:`tensor_name` of ``path``; TreeMismatchError naming both if that names two leaves
        (``{"a.b": x}`` beside ``{"a": {"b": y}}``)."""
        if self.tensor_names is not None:
            name = self.tensor_name(path)
            held = self._by_tensor_name.get(name, ())
            if len(held) > 1:
                raise TreeMismatchError([(keypath, f"names() gave {name!r}, the name of "
                                                   f"{' and '.join(s.keypath for s in held)}: which is meant "
                                                   "cannot be told")])
            return held[0] if held else None
        if not self.keys_by_name:
            return self.by_keypath.get(keypath)
        return self._by_key_names.get(tree_lib.key_names(path))

    def tensor_name(self, path) -> str | None:
        """The name a target leaf at the JAX key path ``path`` is looked up by (None: it is
        matched by key path): ``tensor_names(path)`` (``tree.call_names``: ValueError naming the
        key path if that raises or gives no str)."""
        return None if self.tensor_names is None else tree_lib.call_names(self.tensor_names, path)

    @functools.cached_property
    def _by_tensor_name(self) -> dict[str, list[SavedLeaf]]:
        found: dict[str, list[SavedLeaf]] = {}
        for names, leaf in self._by_key_names_all:
            found.setdefault(".".join(names), []).append(leaf)
        return found

    @functools.cached_property
    def _by_key_names_all(self) -> list[tuple[tuple[str, ...], SavedLeaf]]:
        tree = jax.tree_util.tree_unflatten(self.treedef, self.leaves)
        return [(tree_lib.key_names(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]

    @functools.cached_property
    def _by_key_names(self) -> dict[tuple[str, ...], SavedLeaf]:
        return dict(self._by_key_names_all)


def parse(doc: dict, where: str) -> Manifest:
    """The manifest ``doc`` (JSON-decoded) as a Manifest; ``CheckpointError`` naming ``where``
    for anything this version cannot read, malformed documents included."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a dispatch_io manifest")
    version = doc.get("format_version")
    if version not in READS_VERSIONS:
        raise CheckpointError(f"{where}: manifest format version {version} is not supported "
                              f"by this dispatch_io (reads versions {', '.join(map(str, READS_VERSIONS))})")
    validate.check_document(doc, where)
    try:
        manifest = _parse(doc, where)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
        raise validate.malformed(where, f"manifest.json: {type(exc).__name__}: {exc}") from exc
    if manifest.treedef.num_leaves != len(manifest.leaves):
        raise validate.malformed(where, f"manifest.json: its structure has {manifest.treedef.num_leaves} "
                                        f"leaves, its leaf list {len(manifest.leaves)}")
    try:  # a custom node's own unflatten runs here, once, not first deep inside a restore
        jax.tree_util.tree_unflatten(manifest.treedef, manifest.leaves)
    except Exception as exc:  # noqa: BLE001 - a registered class's code may raise anything; chained
        raise validate.malformed(where, f"manifest.json: its structure cannot be rebuilt "
                                        f"({type(exc).__name__}: {exc})") from exc
    validate.check_manifest(manifest, where)
    return manifest


def _parse(doc: dict, where: str) -> Manifest:
    compression = doc.get("compression")
    if compression is not None:  # a malformed value is a ValueError: "malformed manifest"
        compression = compression_codec((compression["codec"], compression["level"]))
    packs = {name: pack_spec(name, _count(p["nbytes"])) for name, p in doc.get("packs", {}).items()}
    leaves = []
    for e in doc["leaves"]:
        if e["kind"] == tree_lib.SCALAR:
            leaves.append(SavedLeaf(e["keypath"], e["kind"], e["origin"], value=tree_lib.decode_scalar(e["value"])))
            continue
        stored = e.get("stored")
        if e["kind"] == tree_lib.KEY:
            dtype = key_dtype(e["key_impl"])
        else:
            dtype = native_order(numpy_dtype(e["dtype"]))  # an older save of a ">f4" leaf recorded ">f4"
        leaves.append(SavedLeaf(
            e["keypath"], e["kind"], e["origin"], tuple(e["shape"]), dtype, e.get("key_impl"),
            _stored_array(stored, packs),
            checksums=None if stored is None or "crc32c" not in stored else {
                tuple(int(i) for i in grid.split(",") if i): int(crc, 16) for grid, crc in stored["crc32c"].items()},
            described_sharding=e.get("sharding")))
    treedef = tree_lib.decode_structure(doc["structure"])
    layout = doc.get("layout", "files")
    if layout not in LAYOUTS:
        raise validate.malformed(where, f"manifest.json: unknown chunk layout {layout!r} "
                                        f"(this dispatch_io reads {LAYOUTS})")
    arrays = doc.get("arrays", ARRAYS)
    if not isinstance(arrays, str) or not _ARRAYS_PATH.match(arrays):
        raise validate.malformed(where, f"manifest.json: arrays at {arrays!r}")
    keys = doc.get("keys", "paths")
    if keys not in ("paths", "names"):
        raise validate.malformed(where, f"manifest.json: keys {keys!r}")
    return Manifest(treedef, tuple(leaves), int(doc.get("total_bytes", 0)), layout, arrays, compression=compression,
                    keys_by_name=keys == "names")


def _stored_array(stored: dict | None, packs: dict[str, ArraySpec]) -> ArraySpec | None:
    """The ArraySpec of a leaf's ``stored`` entry (KeyError: a pack the manifest does not list;
    ValueError: a leaf that does not fit in its pack)."""
    if stored is None:
        return None
    if "pack" in stored:
        return packed_leaf(packs[stored["pack"]], _count(stored["offset"]), tuple(stored["shape"]), stored["dtype"])
    return ArraySpec(stored["name"], tuple(stored["shape"]), stored["dtype"], tuple(stored["chunk_shape"]))


def _count(value) -> int:
    """``value`` if it is a JSON integer >= 0 (ValueError otherwise: a malformed manifest)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a byte count, got {value!r}")
    return value


def abstract_tree(manifest: Manifest):
    """The saved tree with ShapeDtypeStruct leaves (Python scalars as saved)."""
    return jax.tree_util.tree_unflatten(manifest.treedef, [leaf.abstract for leaf in manifest.leaves])
