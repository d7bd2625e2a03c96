"""Pytree structure <-> JSON, and what kind of thing each leaf is.

The manifest stores the tree structure as plain JSON (never pickle), so a checkpoint can be
read by a process that lacks the trainer's classes. Built-in containers (dict, list, tuple,
None, OrderedDict) come back exactly. NamedTuples and custom registered nodes come back as
their own class when its module is already imported (reading a checkpoint never imports one:
that would run code a file names) and its static data is a Python literal; otherwise as a dict
of their children, so the data is never unreachable.
"""

from __future__ import annotations

import ast
import collections
import struct
import sys
from typing import Any

import jax
import numpy as np

tu = jax.tree_util

# Leaf kinds.
ARRAY = "array"   # jax.Array, np.ndarray, np.generic
KEY = "key"       # typed PRNG key array (dtype key<impl>)
SCALAR = "scalar"  # Python bool / int / float / complex / str, stored in the manifest itself

PYTHON_SCALAR_TYPES = (bool, int, float, complex, str)


def flatten(tree) -> tuple[list[tuple[str, Any]], Any]:
    """[(keystr, leaf)] in tree order, and the treedef."""
    with_paths, treedef = tu.tree_flatten_with_path(tree)
    return [(tu.keystr(path), leaf) for path, leaf in with_paths], treedef


def check_distinct_keypaths(flat: list[tuple[str, Any]]):
    """TypeError naming the key path if two leaves of ``flat`` (:func:`flatten`) have the same
    key path text: checkpoints name leaves by it, so one would be restored from the other's data.
    Only custom nodes can do it, e.g. ``GetAttrKey("x[0]")`` beside ``GetAttrKey("x")`` of a list."""
    seen: set[str] = set()
    for keypath, _ in flat:
        if keypath in seen:
            raise TypeError(f"cannot checkpoint leaf {keypath}: another leaf of the tree has the same key path "
                            "(a custom node's keys print like another's), so the two could not be told apart")
        seen.add(keypath)


def key_names(path) -> tuple[str, ...]:
    """Orbax's names of the entries of the JAX key path ``path``, as Orbax stores them in
    ``_METADATA``: a sequence index, dict key, dataclass attribute or NamedTuple field, each as
    ``str``. So ``.opt_state[0].count`` and ``['opt_state'][0]['count']`` are both
    ``('opt_state', '0', 'count')``, and ``[1]`` and ``['1']`` both ``('1',)``."""
    return tuple(str(_key_name(entry)) for entry in path)


def dotted_name(path) -> str:
    """A leaf's name where a checkpoint format names tensors by a string (safetensors, Orbax's
    array names): its :func:`key_names` joined by ``.`` -- ``['model']['layers'][3]['w']`` is
    ``model.layers.3.w``. The default of every ``names=`` function."""
    return ".".join(key_names(path))


def call_names(names, path) -> str:
    """``names(path)``, the name a user's ``names=`` function gives the leaf at the JAX key path
    ``path``. ValueError naming the key path if it raises (chained to its error) or returns an
    empty str, TypeError if it returns no str."""
    keypath = tu.keystr(path)
    try:
        name = names(path)
    except Exception as exc:  # the user's function: its error is kept as the cause, named by key path
        raise ValueError(f"names({keypath}) raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(name, str):
        raise TypeError(f"names({keypath}) must return a tensor name (a non-empty str), got {name!r}")
    if not name:
        raise ValueError(f"names({keypath}) must return a tensor name (a non-empty str), got ''")
    return name


def _key_name(entry):
    if isinstance(entry, tu.SequenceKey):
        return entry.idx
    if isinstance(entry, tu.GetAttrKey):
        return entry.name
    return entry.key  # DictKey, FlattenedIndexKey


def is_prng_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def is_python_scalar(x) -> bool:
    """Whether ``x`` is a Python bool / int / float / complex / str (np.float64 and np.complex128
    subclass float and complex, but are numpy scalars: they stay numpy)."""
    return isinstance(x, PYTHON_SCALAR_TYPES) and not isinstance(x, (np.number, np.bool_))


def leaf_kind(keypath: str, leaf) -> str:
    """ARRAY, KEY or SCALAR; a TypeError naming the key path for anything else."""
    if is_python_scalar(leaf):
        return SCALAR
    if isinstance(leaf, (np.ndarray, np.generic)) and _unsupported_numpy_dtype(leaf.dtype):
        raise TypeError(f"cannot checkpoint leaf {keypath}: numpy dtype {leaf.dtype} is not supported "
                        "(object, str, bytes and structured/void dtypes cannot be stored)")
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return KEY if is_prng_key(leaf) else ARRAY
    raise TypeError(
        f"cannot checkpoint leaf {keypath} of type {type(leaf).__module__}.{type(leaf).__qualname__}: "
        "leaves must be jax.Array, numpy arrays/scalars, or Python bool/int/float/complex/str")


def _unsupported_numpy_dtype(dtype: np.dtype) -> bool:
    """Object / str / bytes / structured or raw void dtypes (ml_dtypes' kind "V" types are fine)."""
    return dtype.kind in "OSU" or issubclass(dtype.type, np.void)


# ---- Python scalars, bit-exact in JSON -------------------------------------------------------

def _float_text(x: float) -> str:
    """``float.hex``, except that a NaN keeps its sign and payload: ``nan:<its 64 bits>``."""
    if x != x:
        return "nan:" + struct.pack(">d", x).hex()
    return x.hex()


def _float_value(text: str) -> float:
    if text.startswith("nan:"):
        return struct.unpack(">d", bytes.fromhex(text[4:]))[0]
    return float.fromhex(text)


def encode_scalar(value) -> dict:
    if isinstance(value, bool):
        return {"type": "bool", "value": value}
    if isinstance(value, int):
        return {"type": "int", "value": str(value)}  # str: JSON readers may truncate big ints
    if isinstance(value, float):
        return {"type": "float", "value": _float_text(value)}
    if isinstance(value, complex):
        return {"type": "complex", "value": [_float_text(value.real), _float_text(value.imag)]}
    if any("\ud800" <= c <= "\udfff" for c in value):
        # JSON reads two escaped surrogates back as the one character they pair to: not the string saved
        return {"type": "utf32", "value": value.encode("utf-32-le", "surrogatepass").hex()}
    return {"type": "str", "value": value}


def decode_scalar(entry: dict):
    kind, value = entry["type"], entry["value"]
    if kind == "bool":
        return bool(value)
    if kind == "int":
        return int(value)
    if kind == "float":
        return _float_value(value)
    if kind == "complex":
        return complex(_float_value(value[0]), _float_value(value[1]))
    if kind == "utf32":
        return bytes.fromhex(value).decode("utf-32-le", "surrogatepass")
    return str(value)


# ---- structure ------------------------------------------------------------------------------

def _class_name(cls) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _import_class(name: str):
    """The class ``module:qualname`` names if its module is already imported, else None. A
    checkpoint is untrusted input: reading one never imports a module (importing runs code)."""
    module, _, qualname = name.partition(":")
    obj = sys.modules.get(module)
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj if isinstance(obj, type) else None
    except AttributeError:  # not here: the caller falls back to a dict
        return None


def _literal(value):
    """repr(value) if it round-trips through ast.literal_eval, else None."""
    try:
        text = repr(value)
        if ast.literal_eval(text) == value:
            return text
    except Exception:
        pass
    return None


def _is_namedtuple(cls) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


def _encode_key(k):
    if isinstance(k, bool) or not isinstance(k, (str, int)):
        return {"repr": repr(k)}
    return k


def _listed(children) -> list:
    """``children`` of a structure node, which must be a JSON list (ValueError otherwise)."""
    if not isinstance(children, list):
        raise ValueError(f"structure children must be a list, got {type(children).__name__}")
    return children


def _keys(keys, children: list, names: bool = False) -> list:
    """The decoded keys of a dict-like node (``names``: a NamedTuple's field names), one per child
    and each once: ValueError otherwise (JAX's tree code must never see a malformed node)."""
    decoded = [_decode_key(k) for k in _listed(keys)]
    if len(decoded) != len(children):
        raise ValueError(f"a structure node with {len(decoded)} keys for {len(children)} children")
    if names and not all(isinstance(k, str) and k.isidentifier() for k in decoded):
        raise ValueError(f"NamedTuple fields must be identifiers, got {decoded[:5]!r}")
    try:
        if len(set(decoded)) != len(decoded):
            raise ValueError(f"a structure node with a repeated key among {decoded[:5]!r}...")
        sorted(decoded)  # JAX sorts a dict's keys whenever it flattens one
    except TypeError:  # an unhashable key, or keys that do not compare
        raise ValueError(f"a structure node with keys that are unhashable or do not compare: {decoded[:5]!r}") \
            from None
    return decoded


def _decode_key(k):
    if isinstance(k, dict):
        try:
            return ast.literal_eval(k["repr"])
        except Exception:
            return k["repr"]
    return k


def encode_structure(treedef) -> dict:
    """A JSON description of ``treedef``; leaves appear as {"leaf": index}."""
    counter = iter(range(treedef.num_leaves))

    def walk(td):
        if td.num_nodes == 1 and td.num_leaves == 1:
            return {"leaf": next(counter)}
        cls, aux = td.node_data()
        if cls is type(None):
            return {"none": True}
        children = [walk(c) for c in td.children()]
        if cls is dict:
            return {"dict": [_encode_key(k) for k in aux], "children": children}
        if cls is collections.OrderedDict:
            return {"ordereddict": [_encode_key(k) for k in aux], "children": children}
        if cls is collections.defaultdict:
            return {"dict": [_encode_key(k) for k in aux[1]], "children": children}
        if cls is list:
            return {"list": children}
        if cls is tuple:
            return {"tuple": children}
        if _is_namedtuple(cls):
            return {"namedtuple": _class_name(cls), "fields": list(cls._fields), "children": children}
        return {"custom": _class_name(cls), "aux": _literal(aux), "children": children}

    return walk(treedef)


def decode_structure(node: dict) -> Any:
    """The treedef encoded by :func:`encode_structure` (custom nodes best effort, see module doc)."""
    registry = tu.default_registry
    none_def = tu.tree_structure(None)
    leaf_def = tu.tree_structure(0)

    def make(cls, aux, children):
        return tu.PyTreeDef.from_node_data_and_children(registry, (cls, aux), children)

    def walk(n):
        if "leaf" in n:
            return leaf_def
        if "none" in n:
            return none_def
        if "list" in n:
            return make(list, None, [walk(c) for c in _listed(n["list"])])
        if "tuple" in n:
            return make(tuple, None, [walk(c) for c in _listed(n["tuple"])])
        children = [walk(c) for c in _listed(n["children"])]
        if "dict" in n:
            return make(dict, _keys(n["dict"], children), children)
        if "ordereddict" in n:
            return make(collections.OrderedDict, tuple(_keys(n["ordereddict"], children)), children)
        if "namedtuple" in n:
            _keys(n["fields"], children, names=True)
            cls = _import_class(n["namedtuple"])
            if cls is None or not _is_namedtuple(cls) or list(cls._fields) != n["fields"]:
                name = n["namedtuple"].rpartition(":")[2].rpartition(".")[2]
                cls = collections.namedtuple(name, n["fields"])
            return make(cls, None, children)
        cls = _import_class(n["custom"])
        if cls is not None and n["aux"] is not None:
            try:
                return make(cls, ast.literal_eval(n["aux"]), children)
            except Exception:
                pass
        # Zero-padded names sort in the saved order, so leaves keep their positions.
        return make(dict, [f"{i:04d}" for i in range(len(children))], children)

    return walk(node)
