"""Restore targets: check the whole target against the manifest (every problem at once), say
where and how each result leaf is built (:class:`Output`), and build it from the host
buffers the reads filled (:func:`finish`). The reading itself is ``read.loop``'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from dispatch_io import manifest as manifest_lib
from dispatch_io import tree as tree_lib
from dispatch_io.jax_compat import slice_exact
from dispatch_io.errors import TreeMismatchError
from dispatch_io.manifest import Manifest, SavedLeaf
from dispatch_io.plan.save_plan import device_regions, index_region, native_order, whole_on_one_device
from dispatch_io.jax_compat import single_device_sharding

HOST, DEVICE = "host", "device"


@dataclasses.dataclass
class Output:
    """One leaf of the result and how to build it."""

    saved: SavedLeaf
    where: str                         # HOST (numpy) or DEVICE (jax.Array)
    dtype: np.dtype | None             # element dtype of the result (stored dtype for keys)
    sharding: Any = None               # DEVICE only
    whole: bool = False                # read whole, once (small; all its devices are this process's)
    as_scalar: bool = False            # numpy scalar (np.generic) rather than a 0-d array
    regions: dict = dataclasses.field(default_factory=dict)  # region -> [devices] (DEVICE) / [None]
    buffers: dict = dataclasses.field(default_factory=dict)  # region -> host array
    result: Any = None                 # the finished leaf, where built early (see finish)

    def stored_bounds(self, region) -> tuple:
        """``region`` (over the logical shape) as bounds over the stored array: PRNG keys'
        trailing ``key_data`` dimensions are read whole."""
        extra = self.saved.stored.shape[len(region):]
        return region + tuple((0, n) for n in extra) if extra else region

    def buffer_shape(self, region) -> tuple[int, ...]:
        """Shape of the host buffer holding ``region`` as stored."""
        return tuple(hi - lo for lo, hi in self.stored_bounds(region))

    @property
    def saved_dtype(self) -> np.dtype:
        """Element dtype of what is stored (``key_data``'s for keys)."""
        return manifest_lib.numpy_dtype(self.saved.stored.dtype)


def _describe(x) -> str:
    if tree_lib.is_python_scalar(x):
        return f"a Python {type(x).__name__}"
    return f"shape {tuple(x.shape)} dtype {x.dtype}"


def _needs_x64(dtype) -> bool:
    """Whether JAX cannot hold ``dtype`` on devices now: int64, uint64, float64 and complex128
    need ``jax_enable_x64`` (off by default), without which device values lose their upper bits."""
    dtype = native_order(np.dtype(dtype))  # JAX keeps ">f8" as it is, but holds only native dtypes
    return jax.dtypes.canonicalize_dtype(dtype) != dtype


def _on_host(leaf) -> bool:
    """Whether the result for the non-None target ``leaf`` is numpy: numpy targets, and
    ShapeDtypeStructs without a sharding that ask for a 64-bit dtype JAX cannot hold now (the
    exact stored values, as Orbax returns them, rather than a truncated device array)."""
    if isinstance(leaf, (np.ndarray, np.generic)):
        return True
    return getattr(leaf, "sharding", None) is None and not tree_lib.is_prng_key(leaf) and _needs_x64(leaf.dtype)


def _x64_problem(leaf) -> str | None:
    """Why the device result ``leaf`` asks for cannot be had exact now (None: it can). Only a
    target with a sharding can ask for one (without, :func:`_on_host` says numpy)."""
    if isinstance(leaf, (np.ndarray, np.generic)) or getattr(leaf, "sharding", None) is None \
            or tree_lib.is_prng_key(leaf) or not _needs_x64(leaf.dtype):
        return None
    return (f"target asks for dtype {leaf.dtype} on devices, which JAX holds only with jax_enable_x64 "
            f"(off: it would truncate to {jax.dtypes.canonicalize_dtype(leaf.dtype)}); enable it, or leave "
            "out the sharding (or use a numpy target) to restore it exact as numpy")


_SCALAR_KINDS = ((bool, np.bool_), (int, np.integer), (float, np.floating), (complex, np.complexfloating))


def _scalar_problem(value, leaf, cast: bool) -> str | None:
    """Why the checkpoint's Python scalar ``value`` cannot become the 0-d array ``leaf`` asks for.
    As for array leaves, another kind of number (bool, integer, floating, complex) needs ``cast``;
    a value the dtype cannot hold (:func:`_scalar_array`) is refused even with it."""
    if getattr(leaf, "shape", None) != () or tree_lib.is_prng_key(leaf):
        return f"checkpoint has a Python {type(value).__name__}, target asks for {_describe(leaf)}"
    if isinstance(value, str):
        return f"checkpoint has a Python str, target asks for dtype {leaf.dtype} (a string is not a number)"
    kind = next(k for t, k in _SCALAR_KINDS if isinstance(value, t))
    if not jax.dtypes.issubdtype(leaf.dtype, kind) and not cast:
        return (f"dtype mismatch: checkpoint has a Python {type(value).__name__}, target dtype {leaf.dtype} "
                "(pass cast=True to convert)")
    if _scalar_array(value, np.dtype(leaf.dtype)) is None:
        return f"the Python {type(value).__name__} {value!r} does not fit target dtype {leaf.dtype}"
    return None


def _scalar_array(value, dtype: np.dtype) -> np.ndarray | None:
    """The Python bool / int / float / complex ``value`` as a 0-d array of ``dtype``, rounded as
    numpy rounds (floats toward zero into integers); None where the result would not be the value
    rounded: an integer out of range, NaN or inf as an integer, a finite value beyond the dtype's
    largest (which becomes inf, NaN or that largest value, by dtype) or one the dtype turns into NaN
    (zero or a negative as float8_e8m0fnu), inf or NaN where the dtype has none, a nonzero imaginary
    part a real dtype would drop."""
    if isinstance(value, complex) and not jax.dtypes.issubdtype(dtype, np.complexfloating):
        if value.imag:
            return None
        value = value.real
    if jax.dtypes.issubdtype(dtype, np.bool_):
        return np.asarray(bool(value))
    if jax.dtypes.issubdtype(dtype, np.integer):
        if not (isinstance(value, int) or math.isfinite(value)):
            return None
        info = jax.numpy.iinfo(dtype)  # numpy's iinfo does not know int4 and friends
        return np.asarray(int(value), dtype) if info.min <= int(value) <= info.max else None
    largest = float(jax.numpy.finfo(dtype).max)
    parts = (value.real, value.imag) if isinstance(value, complex) else (value,)
    # ints compared exactly (a huge one overflows float()); finite floats by magnitude
    if any(abs(p) > largest if isinstance(p, int) or math.isfinite(p) else False for p in parts):
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        array = np.asarray(value if isinstance(value, complex) else float(value)).astype(dtype)
    got = (array.real, array.imag) if isinstance(value, complex) else (array,)
    for p, g in zip(parts, got):  # inf and NaN stay themselves only in dtypes that have them
        # compared as Python floats: numpy >= 2 casts a Python float to a narrow array's dtype first
        # (NEP 50), where NaN may become -0 and then equal the -0 it was converted to
        g = float(g)
        if isinstance(p, float) and not math.isfinite(p) and not (p == g or (math.isnan(p) and math.isnan(g))):
            return None
        if (isinstance(p, int) or math.isfinite(p)) and not math.isfinite(g):   # e.g. 0 or -1 as float8_e8m0fnu
            return None   # a finite value became NaN or inf: not the value rounded
    return array


def _python_scalar(value, leaf, cast: bool) -> tuple[Any, str | None]:
    """(the result, None) for the checkpoint's Python scalar ``value`` onto the Python scalar
    target ``leaf``, or (None, why it cannot be). The same type (bool, int, float, complex, str)
    gives ``value``; another kind of number needs ``cast`` and converts as Python does, where the
    value survives it (no imaginary part dropped, no inf or NaN as an int, no overflow); a str
    never becomes a number nor a number a str."""
    kind, want = (next(t for t in tree_lib.PYTHON_SCALAR_TYPES if isinstance(x, t)) for x in (value, leaf))
    if kind is want:
        return value, None
    if str in (kind, want):
        return None, f"checkpoint has a Python {kind.__name__}, target a {want.__name__} (a string is not a number)"
    if not cast:
        return None, (f"type mismatch: checkpoint has a Python {kind.__name__}, target a {want.__name__} "
                      "(pass cast=True to convert)")
    real = value.real if isinstance(value, complex) and want is not complex and not value.imag else value
    try:
        converted = None if isinstance(real, complex) and want is not complex else want(real)
    except (OverflowError, ValueError):  # a huge int as a float; inf or NaN as an int
        converted = None
    if converted is None:
        return None, f"the Python {kind.__name__} {value!r} does not fit a Python {want.__name__}"
    return converted, None


def _target_problem(saved: SavedLeaf, leaf, cast: bool) -> str | None:
    if saved.kind == tree_lib.SCALAR:
        if tree_lib.is_python_scalar(leaf):
            return _python_scalar(saved.value, leaf, cast)[1]
        return _scalar_problem(saved.value, leaf, cast) or _x64_problem(leaf)
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        return (f"checkpoint has shape {saved.shape} dtype {saved.dtype}, target leaf is "
                f"{type(leaf).__name__} (use jax.ShapeDtypeStruct, jax.Array or np.ndarray)")
    if tuple(leaf.shape) != saved.shape:
        return f"shape mismatch: checkpoint {saved.shape}, target {tuple(leaf.shape)}"
    target_is_key = tree_lib.is_prng_key(leaf)
    if (saved.kind == tree_lib.KEY) != target_is_key:
        return f"checkpoint has {'a PRNG key' if saved.kind == tree_lib.KEY else 'a plain array'} of dtype {saved.dtype}, target dtype is {leaf.dtype}"
    if target_is_key and leaf.dtype != saved.dtype:
        return f"PRNG key impl mismatch: checkpoint {saved.dtype} ({saved.key_impl}), target {leaf.dtype}"
    # Byte order is not a dtype difference: the result has the target's, values bit-exact.
    if not target_is_key and native_order(np.dtype(leaf.dtype)) != saved.dtype and not cast:
        return f"dtype mismatch: checkpoint {saved.dtype}, target {leaf.dtype} (pass cast=True to convert)"
    return _x64_problem(leaf)


def _output_for(saved: SavedLeaf, leaf) -> Output:
    """Where and how a leaf is restored, given its target leaf (None: as saved, on host)."""
    key = saved.kind == tree_lib.KEY
    stored_dtype = None if saved.stored is None else manifest_lib.numpy_dtype(saved.stored.dtype)
    if leaf is None or _on_host(leaf):
        if key:  # keys have no numpy form: as key arrays on the default device
            return Output(saved, DEVICE, stored_dtype, single_device_sharding(jax.local_devices()[0]))
        as_scalar = isinstance(leaf, np.generic) or (leaf is None and saved.origin == "numpy_scalar")
        dtype = saved.dtype if leaf is None else np.dtype(leaf.dtype)
        return Output(saved, HOST, dtype, as_scalar=as_scalar)
    sharding = getattr(leaf, "sharding", None) or saved.sharding  # the saved one, where the format has it
    if sharding is None:
        sharding = single_device_sharding(jax.local_devices()[0])
    dtype = stored_dtype if key else native_order(np.dtype(leaf.dtype))  # device arrays are native
    return Output(saved, DEVICE, dtype, sharding)


def plan_outputs(manifest: Manifest, target, partial: bool, cast: bool, small_leaf_bytes: int = 0):
    """(treedef, [Output or scalar value]) for the result; TreeMismatchError lists every problem.
    ValueError for ``partial`` / ``cast`` without a ``target``: they would mean nothing.
    Sharded results of at most ``small_leaf_bytes`` whose devices are all this process's are
    read whole (``Output.whole``)."""
    if target is None:
        if partial or cast:
            raise ValueError(f"{'partial' if partial else 'cast'}=True needs a target: it says which leaves "
                             f"{'to restore' if partial else 'to convert to which dtype'} (target=None restores "
                             "every leaf as saved)")
        return manifest.treedef, [_output_for(s, None) if s.kind != tree_lib.SCALAR else s.value
                                  for s in manifest.leaves]
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    problems = []
    outputs = []
    named = set()  # the saved key paths the target reads
    for path, leaf in flat:
        keypath = jax.tree_util.keystr(path)
        saved = manifest.saved_leaf(path, keypath)
        if saved is None:
            name = manifest.tensor_name(path)
            looked_for = "" if name is None else f" (no leaf is named {name!r})"
            problems.append((keypath, "not in the checkpoint" + looked_for))
            continue
        named.add(saved.keypath)
        problem = _target_problem(saved, leaf, cast)
        if problem:
            problems.append((keypath, problem))
        elif saved.kind == tree_lib.SCALAR:
            outputs.append(_scalar_output(saved.value, leaf, cast))
        else:
            outputs.append(_read_whole(_output_for(saved, leaf), small_leaf_bytes))
    if not partial:
        problems += [(s.keypath, "in the checkpoint but not in the target (pass partial=True to skip it)")
                     for s in manifest.leaves if s.keypath not in named]
    if problems:
        raise TreeMismatchError(problems)
    return treedef, outputs


def _read_whole(out: Output, limit: int) -> Output:
    if (out.where == DEVICE and out.saved.kind != tree_lib.KEY and len(out.sharding.device_set) > 1
            and out.sharding.is_fully_addressable and 0 < math.prod(out.saved.shape) * out.dtype.itemsize <= limit):
        out.whole = True
    return out


def _scalar_output(value, leaf, cast: bool):
    """The result for a Python scalar ``value`` whose target ``leaf`` passed :func:`_target_problem`."""
    if tree_lib.is_python_scalar(leaf):
        return _python_scalar(value, leaf, cast)[0]
    array = _scalar_array(value, np.dtype(leaf.dtype))
    if isinstance(leaf, np.generic):
        return array[()]
    if _on_host(leaf):
        return array
    return jax.device_put(array, getattr(leaf, "sharding", None))


def output_regions(out: Output) -> dict:
    """{region: [devices]} of the result leaf ``out`` that this process holds (host: one region).

    A ``whole`` result is read once (``{whole array: [its first device]}``): for a small array a
    read per device would cost more than its bytes."""
    if out.where == HOST:
        return device_regions(None, out.saved.shape)
    if out.whole:
        return whole_on_one_device(out.sharding, out.saved.shape)
    return device_regions(out.sharding, out.saved.shape, addressable_only=True)


def finish(out) -> Any:
    """The result leaf for an Output whose buffers are full. Readers call it for a ``whole``
    output as soon as it is read, so its host buffer goes at once (its devices' copies are not
    the host buffer itself, as a region's are on CPU); later calls return that result."""
    if not isinstance(out, Output):
        return out
    if out.result is not None:
        return out.result
    saved = out.saved
    if saved.stored is None:  # zero-size: nothing was stored
        phys = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(saved.shape, saved.dtype)) \
            if saved.kind == tree_lib.KEY else jax.ShapeDtypeStruct(saved.shape, out.dtype)
        out.regions = output_regions(out)
        out.buffers = {r: np.zeros(tuple(hi - lo for lo, hi in r) + phys.shape[len(r):], phys.dtype)
                       for r in out.regions}
    if out.where == HOST:
        array = next(iter(out.buffers.values()))
        if array.dtype != out.dtype:  # read in this host's byte order; a target asked for the other
            array = array.astype(out.dtype)
        return array[()] if out.as_scalar else array
    out.result = _keys_from_regions(out) if saved.kind == tree_lib.KEY else _from_regions(out)
    return out.result


def _keys_from_regions(out: Output):
    """The PRNG key result ``out`` from its host buffers (``key_data``), wrapped per device."""
    saved = out.saved
    by_device = {}
    for region, devices in out.regions.items():
        host = out.buffers.pop(region)   # numpy, or an array on a colocated CPU device
        for device in devices:
            shard = jax.device_put(host, device)
            if not tree_lib.is_prng_key(shard):
                shard = jax.random.wrap_key_data(shard, impl=saved.key_impl)
            by_device[device] = shard
    # In the sharding's device order: JAX does not reorder the shards of key arrays.
    shards = [by_device[d] for d in out.sharding.addressable_devices_indices_map(saved.shape)]
    # dtype: JAX cannot infer it when this process holds no shard of the array.
    return jax.make_array_from_single_device_arrays(saved.shape, out.sharding, shards, dtype=saved.dtype)


def _from_regions(out: Output):
    """The device result ``out`` from its host buffers (one per region, or the whole array),
    put on all its devices in one call."""
    buffers = out.buffers
    if not buffers:  # no device of this process holds a shard of it
        return jax.make_array_from_single_device_arrays(out.saved.shape, out.sharding, [], dtype=out.dtype)
    whole = tuple((0, n) for n in out.saved.shape)
    kind = out.sharding.memory_kind

    def shard(index):
        region = index_region(index, out.saved.shape)
        buffer = buffers[region] if region in buffers else slice_exact(buffers[whole], index)
        if isinstance(buffer, jax.Array) and kind is not None and buffer.sharding.memory_kind != kind:
            # A colocated read's result, on a CPU device that may be the target's own (no Pathways):
            # JAX adopts such a buffer only in the memory kind the target names.
            buffer = jax.device_put(buffer, buffer.sharding.with_memory_kind(kind))
        return buffer

    try:
        return jax.make_array_from_callback(out.saved.shape, out.sharding, shard, dtype=out.dtype)
    finally:
        buffers.clear()
