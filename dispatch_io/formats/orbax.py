"""Reading checkpoints that Orbax wrote: an Orbax PyTree item described as a dispatch_io Manifest.

Orbax (``orbax-checkpoint`` 0.12 and its v1 API) writes a PyTree item as a directory::

    <item>/_METADATA              tree_metadata: one entry per leaf, keyed by a tuple-string of
                                  its keys, with key_metadata (key_type 1: sequence, 2: dict)
                                  and value_metadata (value_type, skip_deserialize); use_ocdbt,
                                  use_zarr3, store_array_data_equal_to_fill_value
    <item>/_sharding              base64(param name) -> the saved sharding, as JSON
    <item>/_strings.json          param name -> value of string leaves
    <item>/array_metadatas/process_<i>   param name -> ext_metadata (random_key_impl of PRNG keys)
    <item>/manifest.ocdbt, d/, ocdbt.process_<i>/   OCDBT on: one database holding every array
    <item>/<param name>/          OCDBT off: one zarr (v2 or v3) array per leaf

An item is read where it lives, a local directory or an object-store prefix (``s3://``,
``gs://``), through a :class:`~dispatch_io.storage.folders.Folder`: every file with the same
bound (``MAX_MANIFEST_BYTES``), the arrays through TensorStore's kvstore of that folder.

The param name of a leaf is its keys joined by ``.``. Arrays and scalars (0-d arrays) are read
through TensorStore (zarr / zarr3 / OCDBT / zstd: whatever the stored metadata says); nothing
here parses chunk bytes. What comes out is an ordinary :class:`~dispatch_io.manifest.Manifest`,
so restore, verify, metadata and convert treat both formats alike.

Where Orbax's naming is ambiguous we restore what Orbax itself restores: dict keys come back as
strings (an int key ``1`` is saved as ``"1"``), sequences as lists (tuples too), and a dict key
holding a dot is kept whole (it is one entry of the key tuple).
"""

from __future__ import annotations

import base64
import json
import re

import jax
import numpy as np
import tensorstore as ts

from dispatch_io import tree as tree_lib
from dispatch_io.errors import CheckpointError, IncompleteCheckpointError
from dispatch_io.manifest import Manifest, SavedLeaf, key_dtype
from dispatch_io.storage import MAX_MANIFEST_BYTES
from dispatch_io.storage.folders import Folder
from dispatch_io.validate import check_name, describes_sharding, malformed
from dispatch_io.workers import ArraySpec, brief_error, layout_kvstore
from dispatch_io.jax_compat import single_device_sharding

FORMAT = "orbax"
METADATA = "_METADATA"                 # the PyTree item's description (its presence marks an item)
STEP_METADATA = "_CHECKPOINT_METADATA"  # a step's (and a standalone checkpoint's) description
COMMIT_SUCCESS = "commit_success.txt"
TMP = ".orbax-checkpoint-tmp"          # in the name of a directory Orbax has not finalized

_SEQUENCE, _DICT = 1, 2
_EMPTY = {"Dict": dict, "List": list, "Tuple": tuple, "None": lambda: None}  # skip_deserialize nodes


def read_json(folder: Folder, name: str):
    """The JSON document in file ``name`` of ``folder``; ValueError if larger than
    ``MAX_MANIFEST_BYTES`` (found before it is read) or not a regular file; OSError,
    FileNotFoundError, CheckpointError (an object store failing) if it cannot be read."""
    try:
        return json.loads(folder.read(name, MAX_MANIFEST_BYTES))
    except ValueError as exc:
        raise ValueError(f"{name} {exc}") from exc


def is_item(folder: Folder) -> bool:
    """Whether ``folder`` is an Orbax PyTree item (it holds ``_METADATA``)."""
    return folder.is_file(METADATA)


def items(step: Folder) -> list[str]:
    """The names of the Orbax items in the step folder ``step`` (sorted)."""
    return [n for n in step.names() if is_item(step.child(n))]


_STEP_NAME = re.compile(r"(?:.+_)?([0-9]+)")  # [<step_prefix>_]<step, zero-padded to a fixed length or not>


def step_directories(root: Folder) -> dict[int, list[str]]:
    """step -> the names (sorted) of the folders under ``root`` that hold an Orbax step of it,
    committed or not, under any of the namings of Orbax's CheckpointManager: ``100``,
    ``00000100`` (``step_format_fixed_length``), ``ckpt_100`` (``step_prefix``). A folder counts
    when it holds an Orbax item; an Orbax temporary directory never does."""
    steps: dict[int, list[str]] = {}
    for name in root.names():
        match = _STEP_NAME.fullmatch(name)
        if match and TMP not in name and items(root.child(name)):
            steps.setdefault(int(match.group(1)), []).append(name)
    return steps


def committed_steps(root: Folder) -> list[int]:
    """The steps under ``root`` (:func:`step_directories`) held by a committed Orbax checkpoint
    (one PyTree item, or several: a restore of the step then names its item)."""
    return sorted(step for step, names in step_directories(root).items()
                  if any(_restorable(root.child(name)) for name in names))


def _restorable(step: Folder) -> bool:
    """Whether the step folder ``step`` holds Orbax items and Orbax committed it."""
    if not items(step):
        return False
    try:
        check_committed(step, step.display)
    except IncompleteCheckpointError:
        return False
    return True


def check_committed(checkpoint: Folder, display: str):
    """IncompleteCheckpointError unless Orbax finished the checkpoint in ``checkpoint`` (an item
    or a step): a temporary name, or step metadata without a commit time and no
    ``commit_success.txt`` (in it or the folder holding it), mean it did not."""
    folders = [f for f in (checkpoint, checkpoint.parent()) if f is not None]
    for folder in folders:
        if TMP in folder.name:
            raise IncompleteCheckpointError(f"{display} is an Orbax checkpoint that was never committed "
                                            f"({folder.name!r} is a temporary directory)")
    for folder in folders:
        if folder.is_file(STEP_METADATA) and not folder.is_file(COMMIT_SUCCESS):
            try:
                committed = read_json(folder, STEP_METADATA).get("commit_timestamp_nsecs") is not None
            except (OSError, ValueError, AttributeError, RecursionError, CheckpointError):
                committed = False
            if not committed:
                raise IncompleteCheckpointError(f"{display} is an Orbax checkpoint that was never committed "
                                                f"({folder.display}/{STEP_METADATA} has no commit time)")


# ---- shardings --------------------------------------------------------------------------------

def _sharding(entry: dict | None, ndim: int):
    """The saved sharding of a leaf of rank ``ndim`` as a jax Sharding, if every device it names
    exists here and it can be read; else None (a saved sharding is a default, never required)."""
    try:
        return _parse_sharding(entry, ndim)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):
        return None


def _parse_sharding(entry: dict | None, ndim: int):
    if not entry:
        return None
    devices = {d.id: d for d in jax.devices()}
    if entry.get("sharding_type") == "NamedSharding":
        ids = np.asarray(jax.tree_util.tree_map(lambda d: d["id"], entry["device_mesh"]["mesh"],
                                                is_leaf=lambda d: isinstance(d, dict)))
        if ids.shape != tuple(entry["shape"]) or not all(int(i) in devices for i in ids.flat):
            return None
        types = entry.get("axis_types")  # e.g. "AxisType.Explicit"
        types = None if not types else tuple(getattr(jax.sharding.AxisType, t.rpartition(".")[2]) for t in types)
        # (a PRNG key's entry is its key_data's: trailing key dimensions are dropped)
        spec = [tuple(p) if isinstance(p, list) else p for p in entry["partition_spec"]][:ndim]
        try:
            mesh = jax.sharding.Mesh(np.vectorize(lambda i: devices[int(i)], otypes=[object])(ids),
                                     tuple(entry["axis_names"]), axis_types=types)
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        except Exception:  # noqa: BLE001 - jax's own kinds (DuplicateSpecError: an axis named twice): no default
            return None
    if entry.get("sharding_type") == "SingleDeviceSharding":
        named = [d for d in devices.values() if str(d) == entry.get("device_str")]
        return single_device_sharding(named[0]) if named else None
    return None


def _described(entry: dict | None) -> dict | None:
    """An Orbax sharding entry in ``manifest.describe_sharding``'s form (for inspect)."""
    if not entry:
        return None
    if entry.get("sharding_type") == "NamedSharding":
        return {"type": "NamedSharding", "mesh": dict(zip(entry["axis_names"], entry["shape"])),
                "spec": list(entry["partition_spec"])}
    if entry.get("sharding_type") == "SingleDeviceSharding":
        return {"type": "SingleDeviceSharding", "device": entry.get("device_str")}
    return {"type": entry.get("sharding_type", "?")}


def _shardings(item: Folder) -> dict:
    """param name -> saved sharding description (dict), from ``_sharding`` if present."""
    if not item.is_file("_sharding"):
        return {}
    out = {}
    for encoded, text in read_json(item, "_sharding").items():
        out[base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()] = json.loads(text)
    return out


def _saved_sharding(entry: dict | None, ndim: int) -> dict:
    """SavedLeaf's sharding fields for an Orbax sharding entry of a leaf of rank ``ndim``."""
    described = None
    try:
        described = _described(entry)
        if described and "spec" in described:
            described["spec"] = described["spec"][:ndim]
    except (KeyError, TypeError, ValueError, AttributeError):
        pass
    if not describes_sharding(described):  # only for people: one that cannot be shown is left out
        described = None
    return {"sharding": _sharding(entry, ndim), "described_sharding": described}


def _key_impls(item: Folder) -> dict[str, str]:
    """param name -> PRNG impl name, from every process's ``array_metadatas`` file."""
    impls = {}
    folder = item.child("array_metadatas")
    for name in (n for n in folder.names() if n.startswith("process_")):
        for entry in read_json(folder, name).get("array_metadatas", []):
            meta = entry.get("array_metadata", {})
            impl = (meta.get("ext_metadata") or {}).get("random_key_impl")
            if impl:
                impls[meta["param_name"]] = impl
    return impls


# ---- the tree -----------------------------------------------------------------------------------

class _Leaf:
    """A leaf of the tree being rebuilt: its param name and value metadata."""

    def __init__(self, keys: tuple, value: dict):
        self.name = ".".join(keys)
        self.value = value


def _tree(entries: dict, display: str):
    """The saved tree with :class:`_Leaf` leaves (empty containers and None as themselves)."""
    root: dict = {}
    kinds: dict[tuple, int] = {}   # path of a container -> key_type of its entries
    for text, entry in entries.items():
        keys = entry["key_metadata"]
        value = entry["value_metadata"]
        if not keys:  # the whole tree is one leaf (or an empty container)
            if value.get("skip_deserialize") and value.get("value_type") in _EMPTY:
                return _EMPTY[value["value_type"]]()
            return _Leaf((), value)
        node = root
        path = ()
        for depth, k in enumerate(keys):
            kind = k["key_type"]
            if type(k["key"]) not in (str, int):
                raise malformed(display, f"Orbax metadata: {text} has a key {k['key']!r}")
            if kinds.setdefault(path, kind) != kind:
                raise malformed(display, f"Orbax metadata: {text} mixes sequence and dict keys")
            path = path + (k["key"],)
            if depth == len(keys) - 1:
                if value.get("skip_deserialize") and value.get("value_type") in _EMPTY:
                    node[k["key"]] = _EMPTY[value["value_type"]]()
                else:
                    node[k["key"]] = _Leaf(tuple(str(x["key"]) for x in keys), value)
            else:
                node = node.setdefault(k["key"], {})

    def build(node, path):
        if isinstance(node, dict) and path in kinds:
            children = {k: build(v, path + (k,)) for k, v in node.items()}
            if kinds[path] == _SEQUENCE:
                return [children[k] for k in sorted(children, key=int)]
            sorted(children)  # TypeError (malformed) for keys JAX could not sort
            return children
        return node  # a leaf, or an empty container

    return build(root, ())


# ---- arrays -----------------------------------------------------------------------------------

def _open_arrays(kvstore: dict, names: list[str], driver: str, context: ts.Context, missing_is_fill: bool) -> dict:
    """name -> opened TensorStore, all opened concurrently (one metadata read each)."""
    futures = {n: ts.open({"driver": driver, "kvstore": {**kvstore, "path": kvstore.get("path", "") + n + "/"},
                           "fill_missing_data_reads": missing_is_fill}, open=True, read=True, context=context)
               for n in names}
    return {n: f.result() for n, f in futures.items()}


def read(item: Folder, display: str) -> tuple[Manifest, dict]:
    """The Orbax PyTree item in ``item`` (a local directory or an object-store prefix) as
    (Manifest, kvstore its arrays are read from).

    Raises IncompleteCheckpointError for an Orbax checkpoint that was not committed and
    CheckpointError (naming the key path where there is one) for metadata this reader does not
    understand or arrays that cannot be opened."""
    check_committed(item, display)
    try:
        meta = read_json(item, METADATA)
        entries = meta["tree_metadata"]
        ocdbt = bool(meta.get("use_ocdbt", True))
        driver = "zarr3" if meta.get("use_zarr3", False) else "zarr"
        missing_is_fill = not meta.get("store_array_data_equal_to_fill_value", False)
        strings = read_json(item, "_strings.json") if item.is_file("_strings.json") else {}
        shardings = _shardings(item)
        impls = _key_impls(item)
        tree = _tree(entries, display)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise malformed(display, f"unreadable Orbax metadata ({type(exc).__name__}: {brief_error(exc)})") from exc
    flat, treedef = tree_lib.flatten(tree)
    owners: dict[str, str] = {}
    for keypath, leaf in flat:
        if leaf.value.get("value_type") != "string":  # an array: checked before TensorStore opens it by name
            check_name(leaf.name, None, display, keypath)
        other = owners.setdefault(leaf.name, keypath)
        if other != keypath:
            raise CheckpointError(f"{display}: {other} and {keypath} are both stored as {leaf.name!r} in this Orbax "
                                  "checkpoint (their keys joined by '.'): which is which cannot be told")
    layout = "ocdbt" if ocdbt else "files"
    arrays = layout_kvstore(item.kvstore(), layout)
    stored = [leaf.name for _, leaf in flat if leaf.value.get("value_type") != "string"]
    context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 32 << 20}})
    try:
        opened = _open_arrays(arrays, stored, driver, context, missing_is_fill)
    except Exception as exc:  # noqa: BLE001 - TensorStore raises ValueError / RuntimeError kinds
        bad = _first_unopenable(arrays, stored, driver, context, missing_is_fill)
        keypath = next((k for k, leaf in flat if leaf.name == bad), bad)
        raise CheckpointError(f"{display}: cannot open the Orbax array of {keypath}: {brief_error(exc)}") from exc
    leaves = []
    total = 0
    for keypath, leaf in flat:
        kind = leaf.value.get("value_type")
        if kind == "string":
            if leaf.name not in strings:
                raise CheckpointError(f"{display}: string leaf {keypath} is missing from _strings.json")
            leaves.append(SavedLeaf(keypath, tree_lib.SCALAR, "python", value=str(strings[leaf.name])))
            continue
        store = opened[leaf.name]
        if kind == "scalar":
            if store.size != 1:  # else reading it would read a whole array
                raise malformed(display, f"an Orbax scalar stored as an array of shape {list(store.shape)}", keypath)
            try:
                value = store.read().result().item()  # as Orbax: bool, int, float
            except Exception as exc:  # noqa: BLE001 - TensorStore's errors, named by the key path
                raise CheckpointError(f"{display}: cannot read the Orbax scalar {keypath}: {brief_error(exc)}") from exc
            leaves.append(SavedLeaf(keypath, tree_lib.SCALAR, "python", value=value))
            continue
        if kind not in ("jax.Array", "np.ndarray"):
            raise CheckpointError(f"{display}: {keypath} has Orbax value type {kind!r}, which dispatch_io "
                                  "cannot read (arrays, scalars, strings, empty containers and None only)")
        dtype = np.dtype(store.dtype.numpy_dtype)
        shape = tuple(int(n) for n in store.shape)
        spec = ArraySpec(leaf.name, shape, dtype.name, tuple(int(n) for n in store.chunk_layout.write_chunk.shape or ()),
                         driver=driver, missing_is_fill=missing_is_fill)
        total += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        stored_spec = spec if all(shape) else None
        impl = impls.get(leaf.name)
        if impl is not None:
            try:
                key_dims, dtype = len(jax.eval_shape(jax.random.key_data, jax.random.key(0, impl=impl)).shape), \
                    key_dtype(impl)
            except (ValueError, TypeError) as exc:  # not a PRNG impl JAX knows
                raise malformed(display, f"PRNG key impl {impl!r}: {brief_error(exc)}", keypath) from exc
            leaves.append(SavedLeaf(keypath, tree_lib.KEY, "jax", shape[:len(shape) - key_dims], dtype,
                                    impl, stored_spec, **_saved_sharding(shardings.get(leaf.name), len(shape) - key_dims)))
        else:
            origin = "jax" if kind == "jax.Array" else "numpy"
            leaves.append(SavedLeaf(keypath, tree_lib.ARRAY, origin, shape, dtype, None, stored_spec,
                                    **_saved_sharding(shardings.get(leaf.name), len(shape))))
    return Manifest(treedef, tuple(leaves), total, layout, arrays="", format=FORMAT, keys_by_name=True), arrays


def _first_unopenable(kvstore: dict, names: list[str], driver: str, context, missing_is_fill: bool) -> str | None:
    """The first array of ``names`` that cannot be opened (to name it in an error)."""
    for name in names:
        try:
            _open_arrays(kvstore, [name], driver, context, missing_is_fill)
        except Exception:  # noqa: BLE001 - this is the one
            return name
    return None
