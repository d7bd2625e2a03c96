"""Exporting a checkpoint (ours, Orbax's, safetensors) as an Orbax PyTree checkpoint.

What Orbax 0.12's ``StandardCheckpointer`` writes (see ``dispatch_io.formats.orbax`` for the layout):
one zarr3 array per leaf, named by its key names joined by ``.``, in an OCDBT database at the
item directory (written as ``ocdbt.process_0/`` and merged into the root by reference),
``_METADATA`` (the tree: key_metadata, value types), ``_sharding`` (each leaf's sharding, where
known: saved shardings, else the first device), ``array_metadatas/process_0`` (PRNG key
impls: keys are stored as their key_data and come back as key arrays), ``_strings.json``,
``_CHECKPOINT_METADATA`` with a commit time and ``commit_success.txt``.

``dst`` whose last name is a number (``<root>/100``) is written as a step of Orbax's
``CheckpointManager``: the item in ``<dst>/default/``, the step's metadata in ``<dst>``; any
other ``dst`` is a standalone item, as ``StandardCheckpointer.save`` writes it. A local directory is
written under a name holding ``.orbax-checkpoint-tmp`` (which Orbax never lists) and renamed into
place when complete. An ``s3://`` / ``gs://`` prefix has no rename: the arrays and the other files
are written where they belong, then ``_METADATA`` (what makes a folder an item, for Orbax and for
dispatch_io) and ``commit_success.txt`` (Orbax's own commit marker on object stores) last.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import time

import jax
import numpy as np

from dispatch_io.formats import exporting
from dispatch_io.formats import orbax
from dispatch_io import tree as tree_lib
from dispatch_io.formats.exporting import ExportStats, LocalOutput, ObjectOutput
from dispatch_io.manifest import SavedLeaf
from dispatch_io.plan.save_plan import storage_chunk_shape
from dispatch_io.storage import Location
from dispatch_io.storage.folders import Folder
from dispatch_io.workers import ArraySpec, Region, Session, finish_arrays, numpy_dtype, storage_dtype_name, write_regions
from dispatch_io.jax_compat import is_single_device_sharding

HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
WRITER = "ocdbt.process_0"
ITEM = "default"
_SCALAR_DTYPES = {bool: np.bool_, int: np.int64, float: np.float64}
_EMPTY_TYPES = {dict: "Dict", list: "List", tuple: "Tuple", type(None): "None"}


def refusal(saved: SavedLeaf) -> str | None:
    """Why ``saved`` cannot be an Orbax leaf, or None if it can."""
    if saved.kind == tree_lib.SCALAR:
        if isinstance(saved.value, str) or type(saved.value) in (bool, float):
            return None
        if type(saved.value) is int and -2**63 <= saved.value < 2**63:
            return None
        return f"the Python {type(saved.value).__name__} {str(saved.value)[:40]} has no Orbax scalar form"
    dtype = saved.stored.dtype if saved.stored is not None else np.dtype(saved.dtype).name
    if saved.kind != tree_lib.KEY and storage_dtype_name(dtype) != np.dtype(numpy_dtype(dtype)).name:
        return f"dtype {dtype} is not one zarr3 (and so Orbax) stores"
    return None


def _sharding_entry(saved: SavedLeaf) -> dict | None:
    """Orbax's description of the leaf's sharding: the saved one where known and usable here,
    else one on the first device (Orbax restores a jax.Array where its sharding says)."""
    sharding = saved.sharding
    described = saved.described_sharding or {}
    if sharding is None and described.get("type") == "NamedSharding":
        sizes = described["mesh"]
        if int(np.prod(list(sizes.values()))) == jax.device_count():
            spec = [tuple(p) if isinstance(p, list) else p for p in described["spec"]]
            try:
                mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes))
                sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
            except (ValueError, TypeError):  # not a mesh of these devices: the default below
                sharding = None
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        return {"sharding_type": "NamedSharding", "shape": list(mesh.devices.shape),
                "axis_names": list(mesh.axis_names), "axis_types": [str(t) for t in mesh.axis_types],
                "partition_spec": [list(p) if isinstance(p, tuple) else p for p in sharding.spec],
                "device_mesh": {"mesh": np.vectorize(lambda d: {"id": d.id}, otypes=[object])(mesh.devices).tolist()}}
    device = next(iter(sharding.device_set)) if is_single_device_sharding(sharding) else jax.devices()[0]
    return {"sharding_type": "SingleDeviceSharding", "device_str": str(device)}


def _key_metadata(path) -> list[dict]:
    return [{"key": name, "key_type": 1 if isinstance(entry, jax.tree_util.SequenceKey) else 2}
            for entry, name in zip(path, tree_lib.key_names(path))]


def _tree_entries(manifest, arrays: dict[str, ArraySpec]) -> dict:
    """_METADATA's tree_metadata: every leaf, empty container and None of the source tree."""
    tree = jax.tree_util.tree_unflatten(manifest.treedef, manifest.leaves)
    empty = lambda x: x is None or (type(x) in _EMPTY_TYPES and not x)  # noqa: E731
    entries = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=empty)[0]:
        names = tree_lib.key_names(path)
        if not isinstance(leaf, SavedLeaf):
            value = {"value_type": _EMPTY_TYPES[type(leaf)], "skip_deserialize": True}
        elif leaf.kind == tree_lib.SCALAR:
            value = {"value_type": "string" if isinstance(leaf.value, str) else "scalar", "skip_deserialize": False}
        else:
            value = {"value_type": "jax.Array" if leaf.origin == "jax" or leaf.kind == tree_lib.KEY else "np.ndarray",
                     "skip_deserialize": False, "write_shape": list(arrays[".".join(names)].chunk_shape)}
        entries[str(names)] = {"key_metadata": _key_metadata(path), "value_metadata": value}
    return entries


def _array(name: str, saved: SavedLeaf, chunk_limit: int) -> ArraySpec:
    """The zarr3 array a leaf is written as (keys: their key_data; scalars: 0-d)."""
    if saved.kind == tree_lib.SCALAR:
        return ArraySpec(name, (), np.dtype(_SCALAR_DTYPES[type(saved.value)]).name, ())
    if saved.stored is not None:
        shape, dtype = saved.stored.shape, saved.stored.dtype
    elif saved.kind == tree_lib.KEY:
        phys = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(saved.shape, saved.dtype))
        shape, dtype = tuple(phys.shape), np.dtype(phys.dtype).name
    else:
        shape, dtype = saved.shape, np.dtype(saved.dtype).name
    chunks = storage_chunk_shape(shape, numpy_dtype(dtype).itemsize, chunk_limit)
    return ArraySpec(name, tuple(shape), dtype, tuple(max(1, c) for c in chunks))


def _json(doc) -> bytes:
    return json.dumps(doc).encode()


def export(session, source, dst, *, overwrite: bool, chunk_limit: int, batch_limit: int, settings) -> ExportStats:
    """Write the tree of ``source`` (a ``formats.Opened``, its arrays read through ``session``) as
    an Orbax checkpoint at ``dst`` (a local path, or an ``s3://`` / ``gs://`` prefix); see the
    module docstring. ``settings``: the IOSettings to write with. Raises ValueError for a leaf
    Orbax cannot hold (naming its key path), for a ``dst`` that holds something other than an
    Orbax checkpoint; FileExistsError if ``dst`` exists and not ``overwrite``; WorkerError
    naming the key path for a source region that cannot be read. A failure leaves nothing at
    ``dst``. (``exporting.check_keywords`` refuses the safetensors-only keywords.)"""
    started = time.perf_counter()
    manifest = source.manifest
    location = Location.parse(dst)
    exported, _ = exporting.leaves(manifest, None, refusal, None)
    step = location.display.rstrip("/").rsplit("/", 1)[-1].isdigit()
    prefix = f"{ITEM}/" if step else ""
    replaceable = lambda folder: orbax.is_item(folder) or bool(orbax.items(folder))  # noqa: E731
    if exporting.is_local(dst):
        output = LocalOutput(location.path, overwrite, lambda p: replaceable(Folder.open(p)), orbax.TMP, is_dir=True)
        base = {"driver": "file", "path": os.path.join(output.tmp, prefix).rstrip("/") + "/"}
    else:   # committed by the files its readers look for, written last: _METADATA, then commit_success.txt
        output = ObjectOutput(dst, overwrite, replaceable, (orbax.COMMIT_SUCCESS, prefix + orbax.COMMIT_SUCCESS,
                                                            prefix + orbax.METADATA))
        base = output.kvstore(prefix)
    try:
        arrays = {leaf.name: _array(leaf.name, leaf.saved, chunk_limit) for leaf in exported
                  if not isinstance(leaf.saved.value, str)}
        writer = Session.writer(base, WRITER, dataclasses.replace(settings, layout="ocdbt", checksums=False))
        try:
            scalars = [(Region(arrays[leaf.name], (), leaf.saved.keypath),
                        np.asarray(leaf.saved.value, _SCALAR_DTYPES[type(leaf.saved.value)]))
                       for leaf in exported if leaf.saved.kind == tree_lib.SCALAR and leaf.name in arrays]
            if scalars:
                write_regions(writer, *zip(*scalars))
            work = [(arrays[leaf.name], region) for leaf in exported for region in exporting.pieces(leaf.saved, chunk_limit)]
            exporting.stream(session, work, batch_limit, lambda batch: write_regions(
                writer, [Region(spec, region.bounds, region.keypath) for spec, region, _ in batch],
                [array for _, _, array in batch]), source.display)
        finally:
            writer.close()
        finish_arrays(base, "ocdbt", list(arrays.values()), settings.compression)
        source.check_unchanged()
        files = _metadata_files(prefix, manifest, exported, arrays)
        now = time.time_ns()
        files.insert(-1, (orbax.STEP_METADATA, _json({
            "item_handlers": {ITEM: HANDLER} if step else HANDLER, "metrics": {}, "performance_metrics": {},
            "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now, "custom_metadata": {}})))
        done = f"Checkpoint commit was successful to {location.display}".encode()
        files += [(name, done) for name in dict.fromkeys([prefix + orbax.COMMIT_SUCCESS, orbax.COMMIT_SUCCESS])]
        if isinstance(output, LocalOutput):
            for name, data in files:
                os.makedirs(os.path.dirname(os.path.join(output.tmp, name)), exist_ok=True)
                with open(os.path.join(output.tmp, name), "wb") as f:
                    f.write(data)
            output.commit()
        else:
            last = [name for name, _ in files].index(prefix + orbax.METADATA)
            for name, data in files[:last]:
                output.write(name, data)
            output.commit(files[last:])
    except BaseException:
        output.abort()
        raise
    return ExportStats(os.fspath(dst), sum(exporting.nbytes(leaf.saved) for leaf in exported),
                       (ITEM,) if step else (), (), time.perf_counter() - started)


def _metadata_files(prefix: str, manifest, exported, arrays: dict[str, ArraySpec]) -> list[tuple[str, bytes]]:
    """The item's _sharding, _strings.json, array_metadatas/process_0 and, last, _METADATA (the
    file whose presence makes a folder an Orbax item): (name under the checkpoint, bytes) each."""
    shardings, strings, metadatas = {}, {}, []
    for leaf in exported:
        saved = leaf.saved
        if isinstance(saved.value, str):
            strings[leaf.name] = saved.value
            continue
        if saved.kind == tree_lib.SCALAR:
            continue
        spec = arrays[leaf.name]
        if saved.origin == "jax" or saved.kind == tree_lib.KEY:
            key = base64.urlsafe_b64encode(leaf.name.encode()).decode()
            shardings[key] = json.dumps(_sharding_entry(saved))
        metadatas.append({"array_metadata": {
            "param_name": leaf.name, "write_shape": list(spec.chunk_shape), "chunk_shape": list(spec.chunk_shape),
            "ext_metadata": {"random_key_impl": saved.key_impl} if saved.kind == tree_lib.KEY else None}})
    files = [(prefix + "_sharding", _json(shardings))]
    if strings:
        files.append((prefix + "_strings.json", _json(strings)))
    files.append((prefix + "array_metadatas/process_0", _json({"array_metadatas": metadatas})))
    files.append((prefix + orbax.METADATA, _json({
        "tree_metadata": _tree_entries(manifest, arrays), "use_ocdbt": True, "use_zarr3": True,
        "store_array_data_equal_to_fill_value": True, "custom_metadata": None})))
    return files
