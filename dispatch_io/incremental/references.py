"""References: the part of a manifest that says where an incremental step's unchanged chunks are.

A step saved with ``incremental=True`` stores only the chunks that changed since the newest
committed step of its root; each unchanged chunk is a reference to the step that stores its bytes
(docs/format.md, "Incremental steps")::

    "format_version": 3,
    "references": [{"step": "3", "commit": "<id of step 3's COMMITTED marker>"}, ...],
    leaf "stored": {..., "digests": {"i,j": "<algorithm>:<hex>", ...},   # every chunk saved
                         "refs": {"0": ["i,j", ...], ...}}                # reference index -> chunks

A reference names a sibling step of the same root (``../<step>/``), never a path, and always
the step that *stores* the chunk (references are never chained), so a cycle cannot be written
and is refused when read. The manifest writes them (``manifest.build``'s ``increment``);
:func:`resolve` checks every reference of an opened manifest (the
step exists, is the commit named, stores each referenced chunk with the same shape, dtype and
chunk grid) and gives the leaves :class:`~workers.ArraySpec` layers that read those chunks
from there; anything wrong is a ``CorruptCheckpointError`` naming the key path.
"""

from __future__ import annotations

import dataclasses
import math
import re

from dispatch_io import manifest as manifest_lib
from dispatch_io.manifest import REFERENCES, parse_grid
from dispatch_io.errors import CheckpointError
from dispatch_io.validate import malformed
from dispatch_io.workers import brief_error, numpy_dtype
from dispatch_io.storage import MANIFEST, Location, Marker, manifest_doc

RETAINED = "RETAINED"     # a step retention dropped whose bytes kept steps still reference (manager)
_STEP = re.compile(r"^(0|[1-9][0-9]*)\Z")
_COMMIT = re.compile(r"^[0-9a-f]{1,64}\Z")
_GRID = re.compile(r"^(0|[1-9][0-9]*)(,(0|[1-9][0-9]*))*\Z|^\Z")


def sibling(location: Location, step: str) -> Location:
    """The checkpoint ``step`` beside ``location`` (the same root)."""
    url = location.display.rstrip("/")
    parent = url.rpartition("/")[0]
    return Location.parse(f"{parent}/{step}" if parent else step)


def step_name(location: Location) -> str:
    """The last name of ``location``'s path."""
    return location.display.rstrip("/").rpartition("/")[2]


def commit_id(location: Location) -> str | None:
    """The id of the commit ``location`` holds: its ``COMMITTED`` marker's, or (a step retention
    retired, ``manager.retained``) its ``RETAINED`` copy of it; None if it has neither."""
    marker = location.commit_marker()
    if marker is None:
        marker = location.read_file(RETAINED)
    if marker is None:
        return None
    return Marker.parse(marker).id


def check_fields(doc: dict, where: str) -> list[tuple[str, str]]:
    """The references of the manifest ``doc`` as (step, commit id) pairs, once every field this
    module reads is of its documented form; CorruptCheckpointError otherwise."""
    refs = doc.get(REFERENCES, [])
    if not isinstance(refs, list) or not all(
            isinstance(r, dict) and set(r) == {"step", "commit"} and isinstance(r["step"], str)
            and _STEP.match(r["step"]) and isinstance(r["commit"], str) and _COMMIT.match(r["commit"]) for r in refs):
        raise malformed(where, "manifest.json: references must be a list of {'step': '<number>', 'commit': '<hex>'}")
    for entry in doc.get("leaves", []):
        stored = entry.get("stored") if isinstance(entry, dict) else None
        if not isinstance(stored, dict):
            continue
        keypath = entry.get("keypath")
        digests, chunk_refs = stored.get("digests", {}), stored.get("refs", {})
        if not isinstance(digests, dict) or not all(
                isinstance(k, str) and _GRID.match(k) and isinstance(v, str) and len(v) < 200 for k, v in digests.items()):
            raise malformed(where, "digests must map chunk indices 'i,j,...' to text", keypath)
        if not isinstance(chunk_refs, dict) or not all(
                isinstance(k, str) and k.isdigit() and int(k) < len(refs) and isinstance(v, list)
                and all(isinstance(g, str) and _GRID.match(g) for g in v) for k, v in chunk_refs.items()):
            raise malformed(where, "refs must map reference indices to lists of chunk indices 'i,j,...'", keypath)
        if chunk_refs and "pack" in stored:
            raise malformed(where, "a packed leaf has references", keypath)
    return [(r["step"], r["commit"]) for r in refs]


def read_doc(location: Location, where: str) -> dict:
    """The JSON manifest of the (committed or retained) step at ``location``, its seal checked
    (``storage.manifest_doc``: raises as that does)."""
    raw = location.read_file(MANIFEST)
    if raw is None:
        raise CheckpointError(f"{where}: no {MANIFEST}")
    return manifest_doc(raw, where)


def resolve(manifest, doc: dict, location: Location):
    """``manifest`` (parsed from ``doc``, the checkpoint at ``location``) with each referenced
    chunk read from the step that stores it. CorruptCheckpointError naming the key path for a
    reference to a step that is missing or another commit, to a chunk that step does not store
    itself (a chain, or a cycle), or to an array of another shape, dtype or chunk grid."""
    where = location.display
    targets = check_fields(doc, where)
    if not targets:
        return manifest
    origins = []
    for step, commit in targets:
        if step == step_name(location):
            raise malformed(where, f"references step {step}, which is this checkpoint itself (a cycle)")
        origin = sibling(location, step)
        try:
            found = commit_id(origin)
            origin_doc = read_doc(origin, origin.display) if found == commit else None
            origin_manifest = manifest_lib.parse(origin_doc, origin.display) if origin_doc else None
        except (CheckpointError, OSError, ValueError) as exc:
            raise malformed(where, f"references step {step}, which cannot be read: {type(exc).__name__}: {brief_error(exc)}") from exc
        if origin_manifest is None:
            raise malformed(where, f"references step {step} (commit {commit}), which is missing"
                              f"{'' if found is None else ' (another save is there)'}")
        home = "../" * (manifest.arrays.count("/") + 1) + step + "/" + origin_manifest.arrays
        origins.append((step, origin_manifest, origin_doc, home))
    entries = {e["keypath"]: e for e in doc["leaves"]}
    leaves = []
    for leaf in manifest.leaves:
        stored = (entries[leaf.keypath].get("stored") or {}) if leaf.stored is not None else {}
        chunk_refs = stored.get("refs")
        leaves.append(leaf if not chunk_refs else
                      _with_layers(leaf, chunk_refs, origins, where))
    return dataclasses.replace(manifest, leaves=tuple(leaves))


def _with_layers(leaf, chunk_refs: dict, origins: list, where: str):
    """``leaf`` whose referenced chunks are read from the steps that store them."""
    spec, layers, seen = leaf.stored, [], set()
    grid_shape = tuple(-(-n // c) for n, c in zip(spec.shape, spec.chunk_shape))
    for k, grids in chunk_refs.items():
        step, origin, origin_doc, home = origins[int(k)]
        there = origin.by_keypath.get(leaf.keypath)
        theirs = there.stored if there is not None else None
        if theirs is None or theirs.packed is not None or (theirs.shape, theirs.dtype, theirs.chunk_shape) != (
                spec.shape, spec.dtype, spec.chunk_shape):
            raise malformed(where, f"references step {step}, which stores no array of shape {list(spec.shape)}, dtype "
                              f"{spec.dtype} and chunks {list(spec.chunk_shape)} for this leaf", leaf.keypath)
        their_refs = next(e for e in origin_doc["leaves"] if e["keypath"] == leaf.keypath)["stored"].get("refs", {})
        chained = {g for gs in their_refs.values() for g in gs}
        bounds = []
        for g in grids:
            grid = parse_grid(g)
            if len(grid) != len(grid_shape) or not all(i < n for i, n in zip(grid, grid_shape)) or grid in seen:
                raise malformed(where, f"reference to chunk [{g}] outside the chunk grid, or given twice", leaf.keypath)
            if g in chained:
                raise malformed(where, f"chunk [{g}] refers to step {step}, which does not store it either (a chain "
                                  "or a cycle of references)", leaf.keypath)
            seen.add(grid)
            bounds.append(tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(grid, spec.chunk_shape, spec.shape)))
        layers.append((home, origin.layout, theirs.name, tuple(bounds)))
    return dataclasses.replace(leaf, stored=dataclasses.replace(spec, layers=tuple(layers)))


def referenced(spec) -> dict[str, int]:
    """{step: bytes} of the chunks of the stored array ``spec`` (an ``ArraySpec`` from
    :func:`resolve`) that other steps store (what ``dispatch-io inspect`` shows)."""
    itemsize = numpy_dtype(spec.dtype).itemsize
    out: dict[str, int] = {}
    for home, _, _, boxes in spec.layers:
        step = home.strip("./").split("/")[0]
        out[step] = out.get(step, 0) + sum(math.prod(hi - lo for lo, hi in box) for box in boxes) * itemsize
    return out
