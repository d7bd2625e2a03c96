"""Bit-exact round trips: save, wait, restore, and compare bytes (never just shapes).

Covers sharded training state, every dtype (NaN payloads and negative zero included), typed
PRNG keys, odd leaves and containers, restoring onto other topologies, multi-chunk leaves under
a small budget, the memory kvstore, and relative / pathlib paths.
"""

import collections
import dataclasses
import pathlib
import struct
import uuid
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from conftest import assert_trees_bit_equal, host_bytes
from dispatch_io.jax_compat import single_device_sharding


# ---- module-level pytree classes (must be importable for target=None) ----------------------------

class AdamState(NamedTuple):
    count: jax.Array
    mu: dict
    nu: dict


class Pair(NamedTuple):
    first: object
    second: object


class Box:
    """A custom node registered with keys; its static data is a Python literal."""

    def __init__(self, weights, extra, label):
        self.weights, self.extra, self.label = weights, extra, label


jax.tree_util.register_pytree_with_keys(
    Box,
    lambda b: (((jax.tree_util.GetAttrKey("weights"), b.weights),
                (jax.tree_util.GetAttrKey("extra"), b.extra)), b.label),
    lambda label, children: Box(children[0], children[1], label),
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    kernel: object
    bias: object
    name: str = dataclasses.field(default="layer", metadata=dict(static=True))


# ---- helpers ----------------------------------------------------------------------------------------

def ns(mesh, *spec):
    return NamedSharding(mesh, P(*spec))


def abstract(tree):
    """ShapeDtypeStruct targets carrying each jax leaf's sharding (numpy leaves stay numpy)."""
    def one(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x
    return jax.tree.map(one, tree)


def assert_same_shardings(restored, target):
    for (path, r), t in zip(jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(target)):
        key = jax.tree_util.keystr(path)
        sharding = getattr(t, "sharding", None)
        if isinstance(t, (jax.Array, jax.ShapeDtypeStruct)) and sharding is not None:
            assert isinstance(r, jax.Array), key
            # Key arrays come back with P('x') spelled P('x', None): equivalent, not equal.
            assert r.sharding.is_equivalent_to(sharding, r.ndim), f"{key}: {r.sharding} != {sharding}"
            if not dio.tree.is_prng_key(r):
                assert r.sharding == sharding, f"{key}: {r.sharding} != {sharding}"
            assert r.sharding.device_set == sharding.device_set, key
            assert r.sharding.memory_kind == sharding.memory_kind, key


def as_host(tree):
    """What ``restore(path)`` returns for ``tree``: jax arrays as numpy (PRNG keys stay keys)."""
    def one(x):
        if isinstance(x, jax.Array) and not dio.tree.is_prng_key(x):
            return np.asarray(jax.device_get(x))
        return x
    return jax.tree.map(one, tree)


def assert_numpy_leaves(tree):
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if dio.tree.is_prng_key(x) or isinstance(x, (bool, int, float, complex, str, np.generic)):
            continue
        assert type(x) is np.ndarray, f"{jax.tree_util.keystr(path)}: {type(x)}"


def roundtrip(dispatcher, path, tree, target="same"):
    dispatcher.save(path, tree).wait()
    return dispatcher.restore(path, tree if target == "same" else target)


# ---- 1. training state on the 4x2 mesh --------------------------------------------------------------

def training_state(mesh):
    rng = np.random.default_rng(1)

    def f32(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    put = jax.device_put
    return {
        "step": 1234,
        "params": {
            "embed": put(f32(32, 16), ns(mesh, "data", "model")),
            "dense": {"kernel": put(f32(16, 8).astype(jnp.bfloat16), ns(mesh, "data", None)),
                      "bias": put(f32(8), ns(mesh, "model"))},
            "head": put(f32(6, 8), ns(mesh, None, "model")),
            "scale": put(f32(5, 3), ns(mesh)),                                # replicated
            "pinned": put(f32(7, 3), single_device_sharding(jax.devices()[5])),
        },
        "opt_state": AdamState(
            count=put(np.int32(1234), ns(mesh)),
            mu={"embed": put(f32(32, 16), ns(mesh, "data", "model")),
                "head": put(f32(6, 8), ns(mesh, None, "model"))},
            nu={"embed": put(f32(32, 16), ns(mesh, "model", "data")),
                "head": put(f32(6, 8), ns(mesh, None, None))}),
        "rng": put(jax.random.split(jax.random.key(7), 8), ns(mesh, "data")),
        "host_ema": f32(4, 4),
        "lr": 3e-4,
        "name": "run-17",
    }


def test_training_state_original_target(dispatcher, mesh, tmp_path):
    state = training_state(mesh)
    stats = dispatcher.save(tmp_path / "ckpt", state).wait()
    assert stats.peak_host_bytes <= dispatcher.options.host_memory_budget
    restored = dispatcher.restore(tmp_path / "ckpt", state)
    assert_trees_bit_equal(state, restored)
    assert_same_shardings(restored, state)
    assert isinstance(restored["opt_state"], AdamState)
    assert type(restored["host_ema"]) is np.ndarray
    assert restored["params"]["pinned"].devices() == {jax.devices()[5]}


def test_training_state_abstract_target(dispatcher, mesh, tmp_path):
    state = training_state(mesh)
    dispatcher.save(tmp_path / "ckpt", state).wait()
    target = abstract(state)
    restored = dispatcher.restore(tmp_path / "ckpt", target)
    assert_trees_bit_equal(state, restored)
    assert_same_shardings(restored, target)


def test_training_state_as_saved(dispatcher, mesh, tmp_path):
    state = training_state(mesh)
    dispatcher.save(tmp_path / "ckpt", state).wait()
    restored = dispatcher.restore(tmp_path / "ckpt")
    assert_trees_bit_equal(as_host(state), restored)
    assert_numpy_leaves(restored)
    assert isinstance(restored["opt_state"], AdamState)
    # Restored arrays are usable: a jitted computation on them matches the original.
    again = dispatcher.restore(tmp_path / "ckpt", state)
    f = jax.jit(lambda x: (x * 2).astype(jnp.float32).sum())
    assert_trees_bit_equal(jax.tree.map(f, state["params"]), jax.tree.map(f, again["params"]))


def test_metadata_describes_training_state(dispatcher, mesh, tmp_path):
    state = training_state(mesh)
    dispatcher.save(tmp_path / "ckpt", state).wait()
    meta = dio.metadata(tmp_path / "ckpt")
    assert jax.tree.structure(meta) == jax.tree.structure(state)
    for (path, m), x in zip(jax.tree_util.tree_flatten_with_path(meta)[0], jax.tree.leaves(state)):
        key = jax.tree_util.keystr(path)
        if isinstance(x, (int, float, str)):
            assert type(m) is type(x) and m == x, key
            continue
        assert isinstance(m, jax.ShapeDtypeStruct), key
        assert m.shape == x.shape and m.dtype == x.dtype, key
        assert m.sharding is None, key


# ---- 2. every dtype ------------------------------------------------------------------------------------

SUB_BYTE = {"int2", "uint2", "int4", "uint4", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"}
# Kinds JAX cannot place on a device (tested as numpy leaves only).
HOST_ONLY = {"float6_e2m3fn", "float6_e3m2fn"}
DTYPE_NAMES = [
    "bool", "int2", "uint2", "int4", "uint4",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
    "float8_e3m4", "float8_e8m0fnu", "float8_e4m3", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn",
    "complex64", "complex128",
]
DTYPES = [n for n in DTYPE_NAMES if hasattr(jnp, n) or hasattr(ml_dtypes, n) or hasattr(np, n)]
DEVICE_DTYPES = [n for n in DTYPES if n not in HOST_ONLY and hasattr(jnp, n)]


def dtype_of(name: str) -> np.dtype:
    for module in (jnp, ml_dtypes, np):
        if hasattr(module, name):
            return np.dtype(getattr(module, name))
    raise AssertionError(name)


def random_bits(name: str, shape, seed: int = 0) -> np.ndarray:
    """Random contents of dtype ``name``: every bit pattern for full-width types (NaN payloads,
    negative zero, infinities), every valid encoding for sub-byte types, 0/1 for bool."""
    dtype = dtype_of(name)
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if name in SUB_BYTE and name.startswith(("int", "uint")):
        info = ml_dtypes.iinfo(dtype)
        return rng.integers(int(info.min), int(info.max) + 1, shape).astype(dtype)
    if name in SUB_BYTE:
        table = np.arange(2 ** ml_dtypes.finfo(dtype).bits, dtype=np.uint8).view(dtype)  # every encoding, -0 too
        return table[rng.integers(0, len(table), shape)]
    word = min(dtype.itemsize, 8)
    words = dtype.itemsize // word
    raw = rng.integers(0, 2 ** (8 * word), (*shape, words), dtype=np.dtype(f"uint{8 * word}"), endpoint=False)
    return np.ascontiguousarray(raw).view(dtype).reshape(shape)


def test_random_bits_hit_special_values():
    """The generator really exercises NaN payloads and negative zero."""
    x = random_bits("float16", (4096,))
    assert np.isnan(x).any() and len({v.tobytes() for v in x[np.isnan(x)]}) > 10
    assert any(v.tobytes() == ml_dtypes.float8_e4m3fn(-0.0).tobytes() for v in random_bits("float8_e4m3fn", (4096,)))
    assert any(v.tobytes() == ml_dtypes.float4_e2m1fn(-0.0).tobytes() for v in random_bits("float4_e2m1fn", (256,)))


@pytest.mark.parametrize("name", DTYPES)
def test_dtype_numpy_leaf(dispatcher, tmp_path, name):
    x = random_bits(name, (16, 6), seed=len(name))
    tree = {"x": x, "scalar": x[3, 1], "flat": x.reshape(-1)[:7].copy()}
    dispatcher.save(tmp_path / "ckpt", tree).wait()
    for target in (None, tree):
        restored = dispatcher.restore(tmp_path / "ckpt", target)
        assert_trees_bit_equal(tree, restored)
        assert type(restored["x"]) is np.ndarray
        assert type(restored["scalar"]) is type(x[3, 1])
    meta = dio.metadata(tmp_path / "ckpt")
    assert meta["x"].dtype == x.dtype and meta["x"].shape == (16, 6)


@pytest.mark.parametrize("name", DEVICE_DTYPES)
def test_dtype_sharded_jax_leaf(dispatcher, mesh, tmp_path, name):
    host = random_bits(name, (16, 6), seed=len(name) + 1)
    x64 = dtype_of(name).itemsize >= 8 and name != "complex64"
    with jax.enable_x64(x64):
        x = jax.device_put(host, ns(mesh, "data", "model"))
        y = jax.device_put(host[:5], single_device_sharding(jax.devices()[3]))
        assert np.dtype(x.dtype) == host.dtype and host_bytes(x) == host.tobytes()
        tree = {"sharded": x, "single": y, "replicated": jax.device_put(host[:2], ns(mesh))}
        dispatcher.save(tmp_path / "ckpt", tree).wait()
        restored = dispatcher.restore(tmp_path / "ckpt", tree)
        assert_trees_bit_equal(tree, restored)
        assert_same_shardings(restored, tree)
        as_numpy = dispatcher.restore(tmp_path / "ckpt")
    assert_trees_bit_equal({"sharded": host, "single": host[:5], "replicated": host[:2]}, as_numpy)
    assert_numpy_leaves(as_numpy)


NARROW_FLOATS = [n for n in DEVICE_DTYPES if jnp.issubdtype(dtype_of(n), jnp.floating) and jax.dtypes.itemsize_bits(dtype_of(n)) <= 8]


def every_bit_pattern(name: str, shape=(32, 16)) -> np.ndarray:
    """Every encoding of a narrow float (each NaN payload, both infinities, -0), tiled to ``shape``."""
    count = 1 << jax.dtypes.itemsize_bits(dtype_of(name))
    return np.resize(np.arange(count, dtype=np.uint8), shape).view(dtype_of(name))


@pytest.mark.parametrize("name", NARROW_FLOATS)
@pytest.mark.parametrize("how", ["local", "local-pinned", "colocated"])
def test_every_nan_and_inf_payload_of_narrow_floats_round_trips_through_device_cuts(mesh, tmp_path, how, name):
    """Every bit pattern of every float8 / float4 dtype comes back bit for bit where the save cuts a
    shard into chunks on the device (max_chunk_bytes below a shard), where a restore cuts a region
    read whole into device shards (onto a sharding the save did not have). XLA may quiet NaN payloads when it slices, pads or joins narrow floats
    (JAX 0.12's CPU backend does): each of those cuts must keep the bits."""
    host = every_bit_pattern(name)
    cls, options = {"local": (dio.LocalDispatcher, {}), "local-pinned": (dio.LocalDispatcher, {"host_transfer": "pinned"}),
                    "colocated": (dio.ColocatedDispatcher, {})}[how]
    x = jax.device_put(host, ns(mesh, "data", "model"))
    with cls(host_memory_budget=1 << 20, max_chunk_bytes=32, progress=False, **options) as d:
        d.save(tmp_path / "cut", {"x": x}).wait()
        for target in (x, jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=ns(mesh, "model", "data")),
                       jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=ns(mesh))):
            restored = d.restore(tmp_path / "cut", {"x": target})["x"]
            assert host_bytes(restored) == host.tobytes(), (how, name, target.sharding)
    with cls(host_memory_budget=1 << 20, progress=False, **options) as d:
        d.save(tmp_path / "one_chunk", {"x": x}).wait()
        restored = d.restore(tmp_path / "one_chunk", {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=ns(mesh, "model"))})
        assert host_bytes(restored["x"]) == host.tobytes(), (how, name)


def test_64_bit_leaves_onto_metadata_without_x64_come_back_exact_as_numpy(dispatcher, tmp_path):
    """With jax_enable_x64 off (the default) JAX holds no 64-bit arrays: a ShapeDtypeStruct target
    without a sharding asking for one (as ``dio.metadata`` gives) restores the stored values as
    numpy of that dtype, never truncated to 32 bits; other dtypes still go to the device."""
    tree = {"i64": np.array([2 ** 40 + 7, -(2 ** 62)], np.int64), "u64": np.array([2 ** 63 + 5], np.uint64),
            "f64": np.array([np.pi, 1e300]), "c128": np.array([complex(5e-324, np.pi)]),
            "tokens": 2 ** 40 + 7, "f32": np.arange(3, dtype=np.float32)}
    path = tmp_path / "ckpt"
    dispatcher.save(path, tree).wait()
    restored = dispatcher.restore(path, dio.metadata(path))
    assert_trees_bit_equal(restored, {**tree, "tokens": 2 ** 40 + 7})
    assert all(type(restored[k]) is np.ndarray for k in ("i64", "u64", "f64", "c128"))
    assert isinstance(restored["f32"], jax.Array)
    onto = dispatcher.restore(path, {"i64": jax.ShapeDtypeStruct((2,), np.int64),
                                     "tokens": jax.ShapeDtypeStruct((), np.int64)}, partial=True)
    assert_trees_bit_equal(onto, {"i64": tree["i64"], "tokens": np.array(2 ** 40 + 7, np.int64)})
    assert type(onto["tokens"]) is np.ndarray
    with jax.enable_x64(True):  # JAX can hold them: device arrays, as the target asks
        on_device = dispatcher.restore(path, dio.metadata(path))
        assert all(isinstance(on_device[k], jax.Array) for k in ("i64", "u64", "f64", "c128"))
        assert_trees_bit_equal(jax.device_get(on_device), {**tree, "tokens": 2 ** 40 + 7})


def test_big_endian_numpy_leaves_are_their_values_in_native_byte_order(dispatcher, tmp_path):
    """A ">f4" leaf is stored (little-endian) and recorded as float32: metadata, target=None and
    a metadata target agree on float32; a numpy target gets its own byte order. Values bit-exact
    (NaN payloads included) every way; byte order alone is not a dtype mismatch."""
    bits = np.array([0x7FC00123, 0xFF800000, 0x80000000, 0x3F800001], np.uint32)
    tree = {"f": bits.view(np.float32).astype(">f4"), "i": np.array([-2, 2 ** 30], ">i8")}
    native = {k: v.astype(v.dtype.newbyteorder("=")) for k, v in tree.items()}
    path = tmp_path / "ckpt"
    dispatcher.save(path, tree).wait()
    assert {k: v.dtype for k, v in dio.metadata(path).items()} == {"f": np.float32, "i": np.int64}
    assert_trees_bit_equal(dispatcher.restore(path), native)
    assert_trees_bit_equal(dispatcher.restore(path, tree), tree)               # ">f4" / ">i8" back
    assert_trees_bit_equal(dispatcher.restore(path, native), native)
    on_metadata = dispatcher.restore(path, dio.metadata(path))             # int64: numpy, x64 off
    assert isinstance(on_metadata["f"], jax.Array)
    assert_trees_bit_equal(jax.device_get(on_metadata), native)


# ---- 3. typed PRNG keys ------------------------------------------------------------------------------

IMPLS = {"threefry2x32": "key<fry>", "rbg": "key<rbg>", "unsafe_rbg": "key<urbg>"}


def every_dtype_tree(mesh, seed: int, single: int = 5, replicated: int = 2, device: int = 3) -> dict:
    """{dtype name: {"sharded": a (64, 6) leaf over ``mesh``'s data x model, "single": its first ``single``
    rows on device ``device``, "replicated": its first ``replicated`` rows on every device}} of every device
    dtype, and {impl: {"one": a key, "batch": (8, 2) keys sharded}} of every PRNG key impl, from random
    bits seeded by ``seed``. Build it under ``jax.enable_x64(True)`` (64-bit dtypes)."""
    sharded = NamedSharding(mesh, P("data", "model"))
    tree = {}
    for name in DEVICE_DTYPES:
        host = random_bits(name, (64, 6), seed=len(name) + seed)
        tree[name] = {"sharded": jax.device_put(host, sharded),
                      "single": jax.device_put(host[:single], single_device_sharding(jax.devices()[device])),
                      "replicated": jax.device_put(host[:replicated], NamedSharding(mesh, P()))}
    for impl in IMPLS:
        key = jax.random.key(seed + 5, impl=impl)
        tree[impl] = {"one": key, "batch": jax.device_put(jax.random.split(key, 16).reshape(8, 2), sharded)}
    return tree


def key_tree(mesh, impl):
    key = jax.random.key(42, impl=impl)
    batch = jax.random.split(key, 16).reshape(8, 2)
    return {"scalar": key, "batch": jax.device_put(batch, ns(mesh, "data", "model")),
            "row": jax.device_put(jax.random.split(key, 8), ns(mesh, "data"))}


def assert_keys_equal(original, restored):
    for name in original:
        a, b = original[name], restored[name]
        assert dio.tree.is_prng_key(b), name
        assert jax.random.key_impl(a) == jax.random.key_impl(b), name
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert host_bytes(jax.random.key_data(a)) == host_bytes(jax.random.key_data(b)), name
        # The keys draw the same numbers.
        assert host_bytes(draw(a)) == host_bytes(draw(b)), name


def draw(keys):
    """Random bits from every key (rebuilt on the default device from its host key data)."""
    data = np.asarray(jax.device_get(jax.random.key_data(keys)))
    flat = jax.random.wrap_key_data(data, impl=jax.random.key_impl(keys)).reshape(-1)
    return jax.vmap(jax.random.bits)(flat)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_prng_keys(dispatcher, mesh, tmp_path, impl):
    keys = key_tree(mesh, impl)
    dispatcher.save(tmp_path / "ckpt", keys).wait()
    default = single_device_sharding(jax.devices()[0])

    # (a) the original tree as target: same shardings.
    restored = dispatcher.restore(tmp_path / "ckpt", keys)
    assert_trees_bit_equal(keys, restored)
    assert_keys_equal(keys, restored)
    assert_same_shardings(restored, keys)

    # metadata: key dtype and logical shape.
    meta = dio.metadata(tmp_path / "ckpt")
    assert str(meta["batch"].dtype) == IMPLS[impl]
    assert meta["batch"].dtype == keys["batch"].dtype
    assert meta["batch"].shape == (8, 2) and meta["scalar"].shape == () and meta["row"].shape == (8,)

    # (b) metadata as target: on the default device, impl preserved.
    restored = dispatcher.restore(tmp_path / "ckpt", meta)
    assert_keys_equal(keys, restored)
    assert all(restored[k].sharding.device_set == default.device_set for k in restored)

    # (c) target=None: key arrays on the default device.
    restored = dispatcher.restore(tmp_path / "ckpt")
    assert_keys_equal(keys, restored)
    assert all(restored[k].sharding.device_set == default.device_set for k in restored)


def test_prng_keys_mixed_impls_in_one_tree(dispatcher, mesh, tmp_path):
    keys = {impl: key_tree(mesh, impl) for impl in IMPLS}
    keys["legacy"] = jax.random.PRNGKey(3)    # a raw uint32 key is a plain array
    restored = roundtrip(dispatcher, tmp_path / "ckpt", keys)
    assert_trees_bit_equal(keys, restored)
    as_saved = dispatcher.restore(tmp_path / "ckpt")
    for impl in IMPLS:
        assert_keys_equal(keys[impl], as_saved[impl])
    assert type(as_saved["legacy"]) is np.ndarray and as_saved["legacy"].dtype == np.uint32


# ---- 4. odd leaves and containers ---------------------------------------------------------------------

def float_from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


PY_SCALARS = {
    "int": 7, "zero": 0, "neg": -3, "big": 2 ** 80, "neg_big": -(2 ** 100) - 1,
    "float": 1.5, "nan": float("nan"), "neg_zero": -0.0, "inf": float("inf"), "neg_inf": float("-inf"),
    "denormal": 5e-324, "max": 1.7976931348623157e308, "third": 1 / 3,
    "neg_nan_payload": float_from_bits(0xFFF8_0000_0000_0123),
    "true": True, "false": False,
    "complex": 1 + 2j, "complex_odd": complex(float("nan"), -0.0), "complex_inf": complex(float("-inf"), 1e-310),
    "str": "héllo ✓ \"quoted\" \\ \n", "empty_str": "",
    "surrogates": "\ud83d\ude00", "lone_surrogate": "a\udc80b",   # two code units, not the emoji JSON reads
}


def py_bits(x):
    """An exact fingerprint of a Python scalar: its type and its bits."""
    if isinstance(x, float):
        return float, struct.pack("<d", x)
    if isinstance(x, complex):
        return complex, struct.pack("<dd", x.real, x.imag)
    return type(x), repr(x)


def test_python_scalars_keep_type_and_bits(dispatcher, tmp_path):
    restored = roundtrip(dispatcher, tmp_path / "ckpt", PY_SCALARS, target=None)
    assert_trees_bit_equal(PY_SCALARS, restored)
    for k, v in PY_SCALARS.items():
        assert py_bits(restored[k]) == py_bits(v), k
    again = dispatcher.restore(tmp_path / "ckpt", PY_SCALARS)
    assert {k: py_bits(v) for k, v in again.items()} == {k: py_bits(v) for k, v in PY_SCALARS.items()}
    meta = dio.metadata(tmp_path / "ckpt")
    assert {k: py_bits(v) for k, v in meta.items()} == {k: py_bits(v) for k, v in PY_SCALARS.items()}


def test_empty_containers_and_none(dispatcher, tmp_path):
    tree = {
        "none": None, "dict": {}, "tuple": (), "list": [],
        "nested": {"a": [(), {}, [[]]], "b": ({"c": []}, None), "d": [None, {"e": ()}]},
        "ordered": collections.OrderedDict([("z", 1), ("a", np.arange(3)), ("m", {})]),
        "int_keys": {3: np.float32(1.0), 1: "one"},
        "value": np.arange(4, dtype=np.int16),
    }
    restored = roundtrip(dispatcher, tmp_path / "ckpt", tree, target=None)
    assert_trees_bit_equal(tree, restored)
    assert type(restored["ordered"]) is collections.OrderedDict
    assert list(restored["ordered"]) == ["z", "a", "m"]
    assert_trees_bit_equal(tree, dispatcher.restore(tmp_path / "ckpt", tree))


@pytest.mark.parametrize("tree", [None, {}, (), [], {"a": {}, "b": [()]}], ids=repr)
def test_tree_without_leaves(dispatcher, tmp_path, tree):
    dispatcher.save(tmp_path / "ckpt", tree).wait()
    restored = dispatcher.restore(tmp_path / "ckpt")
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    assert restored == tree and type(restored) is type(tree)
    assert dio.metadata(tmp_path / "ckpt") == tree


def test_namedtuple_comes_back_as_its_class(dispatcher, mesh, tmp_path):
    tree = {"pair": Pair(jax.device_put(np.arange(8.0), ns(mesh, "data")), Pair(1, np.ones(2, np.uint8))),
            "adam": AdamState(np.int32(3), {"w": np.zeros(3)}, {"w": np.ones(3)})}
    dispatcher.save(tmp_path / "ckpt", tree).wait()
    restored = dispatcher.restore(tmp_path / "ckpt")
    assert type(restored["pair"]) is Pair and type(restored["pair"].second) is Pair
    assert type(restored["adam"]) is AdamState
    assert_trees_bit_equal(as_host(tree), restored)
    assert type(dio.metadata(tmp_path / "ckpt")["adam"]) is AdamState


def test_custom_nodes(dispatcher, mesh, tmp_path):
    tree = {
        "box": Box(jax.device_put(np.arange(16.0).reshape(8, 2), ns(mesh, "data", "model")),
                   {"n": 5, "v": np.arange(3, dtype=np.int8)}, label=("blue", 3)),
        "layer": Layer(kernel=jax.device_put(np.arange(8, dtype=np.float32).reshape(4, 2), ns(mesh, None, "model")),
                       bias=np.full(2, -0.0, np.float32), name="dense_1"),
    }
    restored = roundtrip(dispatcher, tmp_path / "ckpt", tree)
    assert type(restored["box"]) is Box and restored["box"].label == ("blue", 3)
    assert type(restored["layer"]) is Layer and restored["layer"].name == "dense_1"
    assert_trees_bit_equal(tree, restored)
    assert_same_shardings(restored, tree)
    # Without a target the classes are importable and their static data is a literal.
    as_saved = dispatcher.restore(tmp_path / "ckpt")
    assert type(as_saved["box"]) is Box and as_saved["box"].label == ("blue", 3)
    assert type(as_saved["layer"]) is Layer and as_saved["layer"].name == "dense_1"
    assert_trees_bit_equal(as_host(tree), as_saved)


@pytest.mark.parametrize("kind", ["jax_sharded", "jax_single", "numpy", "key"])
def test_bare_array_as_whole_tree(dispatcher, mesh, tmp_path, kind):
    host = random_bits("float32", (8, 4), seed=5)
    x = {"jax_sharded": lambda: jax.device_put(host, ns(mesh, "data", "model")),
         "jax_single": lambda: jax.device_put(host, jax.devices()[2]),
         "numpy": lambda: host,
         "key": lambda: jax.random.key(1, impl="rbg")}[kind]()
    restored = roundtrip(dispatcher, tmp_path / "ckpt", x)
    assert_trees_bit_equal(x, restored)
    assert_same_shardings([restored], [x])
    as_saved = dispatcher.restore(tmp_path / "ckpt")
    assert_trees_bit_equal(as_host(x), as_saved)
    meta = dio.metadata(tmp_path / "ckpt")
    assert isinstance(meta, jax.ShapeDtypeStruct) and meta.shape == x.shape and meta.dtype == x.dtype


def test_zero_size_and_zero_dim_arrays(dispatcher, mesh, tmp_path):
    tree = {
        "np_empty": np.zeros((0,), np.float32), "np_empty_2d": np.zeros((0, 3), ml_dtypes.bfloat16),
        "jax_empty": jnp.zeros((0,), jnp.int8), "jax_empty_2d": jnp.zeros((0, 3), jnp.float16),
        "jax_empty_sharded": jax.device_put(np.zeros((0, 4), np.float32), ns(mesh, "data", "model")),
        "key_empty": jax.random.split(jax.random.key(0), 0),
        "np_0d": np.array(-0.0, np.float32), "np_0d_int": np.array(-7, np.int64),
        "jax_0d": jax.device_put(np.frombuffer(struct.pack("<I", 0xFFC0_0123), np.float32).reshape(()),
                                 jax.devices()[7]),   # a negative NaN with a payload
        "jax_0d_sharded": jax.device_put(np.float32(2.5), ns(mesh)),
        "key_0d": jax.random.key(9),
    }
    restored = roundtrip(dispatcher, tmp_path / "ckpt", tree)
    assert_trees_bit_equal(tree, restored)
    assert_same_shardings(restored, tree)
    assert type(restored["np_empty"]) is np.ndarray and type(restored["np_0d"]) is np.ndarray
    as_saved = dispatcher.restore(tmp_path / "ckpt")
    assert_trees_bit_equal(as_host(tree), as_saved)
    assert_numpy_leaves(as_saved)
    assert as_saved["np_empty_2d"].shape == (0, 3) and as_saved["np_empty_2d"].dtype == ml_dtypes.bfloat16
    assert as_saved["key_empty"].shape == (0,)
    meta = dio.metadata(tmp_path / "ckpt")
    assert meta["jax_empty_2d"].shape == (0, 3) and meta["np_0d"].shape == ()


NUMPY_SCALARS = {
    "f32": np.float32(1.5), "f64": np.float64(-0.0), "f16": np.float16(np.nan),
    "bf16": ml_dtypes.bfloat16(1.25), "f8": ml_dtypes.float8_e4m3fn(-0.0),
    "i64": np.int64(-(2 ** 62)), "u8": np.uint8(255), "u64": np.uint64(2 ** 64 - 1),
    "bool": np.bool_(True), "c64": np.complex64(1 - 1j), "c128": np.complex128(complex(np.nan, -0.0)),
    "nan_payload": np.frombuffer(struct.pack("<Q", 0xFFF4_0000_0000_0042), np.float64)[0],
}


def test_numpy_scalars_keep_type_and_bits(dispatcher, tmp_path):
    dispatcher.save(tmp_path / "ckpt", NUMPY_SCALARS).wait()
    for target in (None, NUMPY_SCALARS):
        restored = dispatcher.restore(tmp_path / "ckpt", target)
        for k, v in NUMPY_SCALARS.items():
            assert type(restored[k]) is type(v), f"{k}: {type(restored[k])} is not {type(v)}"
            assert restored[k].dtype == v.dtype and restored[k].tobytes() == v.tobytes(), k
        assert_trees_bit_equal(NUMPY_SCALARS, restored)
    meta = dio.metadata(tmp_path / "ckpt")
    assert all(meta[k].shape == () and meta[k].dtype == v.dtype for k, v in NUMPY_SCALARS.items())


# ---- 5. another topology ------------------------------------------------------------------------------

def topology_state(mesh):
    rng = np.random.default_rng(3)
    return {
        "full": jax.device_put(random_bits("float32", (16, 8), seed=11), ns(mesh, "data", "model")),
        "rows": jax.device_put(random_bits("bfloat16", (8, 12), seed=12), ns(mesh, "data", None)),
        "cols": jax.device_put(random_bits("int8", (6, 8), seed=13), ns(mesh, None, "model")),
        "repl": jax.device_put(rng.integers(0, 100, (3, 5)).astype(np.int32), ns(mesh)),
        "single": jax.device_put(random_bits("float16", (6, 4), seed=14), jax.devices()[5]),
        "keys": jax.device_put(jax.random.split(jax.random.key(5, impl="rbg"), 16).reshape(8, 2),
                               ns(mesh, "data", "model")),
    }


def retarget(state, sharding_for):
    return {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_for(k, x)) for k, x in state.items()}


def test_restore_onto_2x4_mesh(dispatcher, mesh, tmp_path):
    state = topology_state(mesh)
    dispatcher.save(tmp_path / "ckpt", state).wait()
    mesh2 = jax.make_mesh((2, 4), ("data", "model"))
    specs = {"full": P("data", "model"), "rows": P("data", "model"), "cols": P("data", "model"),
             "repl": P(), "single": P("data", "model"), "keys": P("model", "data")}
    target = retarget(state, lambda k, x: NamedSharding(mesh2, specs[k]))
    restored = dispatcher.restore(tmp_path / "ckpt", target)
    assert_trees_bit_equal(state, restored)
    assert_same_shardings(restored, target)
    # Same mesh shape, leaves resharded differently (jax.Array targets: their sharding is used).
    other = {k: jax.device_put(jnp.zeros_like(x), NamedSharding(mesh2, P())) if not dio.tree.is_prng_key(x)
             else jax.device_put(x, NamedSharding(mesh2, P())) for k, x in state.items()}
    restored = dispatcher.restore(tmp_path / "ckpt", other)
    assert_trees_bit_equal(state, restored)
    assert_same_shardings(restored, other)


@pytest.mark.parametrize("spec", [P("model"), P(None, "data"), P(), P("data"), P(("model", "data"))],
                         ids=str)
def test_keys_onto_2x4_mesh(dispatcher, mesh, tmp_path, spec):
    """Key arrays, partly or fully replicated on a mesh whose device order differs."""
    keys = {impl: jax.device_put(jax.random.split(jax.random.key(1, impl=impl), 16).reshape(8, 2),
                                 ns(mesh, "data", "model")) for impl in IMPLS}
    dispatcher.save(tmp_path / "ckpt", keys).wait()
    mesh2 = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[::-1])
    target = retarget(keys, lambda k, x: NamedSharding(mesh2, spec))
    restored = dispatcher.restore(tmp_path / "ckpt", target)
    assert_trees_bit_equal(keys, restored)
    assert_same_shardings(restored, target)
    assert_keys_equal(keys, restored)


def test_restore_onto_one_device(dispatcher, mesh, tmp_path):
    state = topology_state(mesh)
    dispatcher.save(tmp_path / "ckpt", state).wait()
    for device in (jax.devices()[0], jax.devices()[6]):
        target = retarget(state, lambda k, x: single_device_sharding(device))
        restored = dispatcher.restore(tmp_path / "ckpt", target)
        assert_trees_bit_equal(state, restored)
        assert_same_shardings(restored, target)
        assert all(x.devices() == {device} for x in restored.values())


def test_restore_as_numpy(dispatcher, mesh, tmp_path):
    state = topology_state(mesh)
    dispatcher.save(tmp_path / "ckpt", state).wait()
    as_saved = dispatcher.restore(tmp_path / "ckpt")
    assert_trees_bit_equal(as_host(state), as_saved)
    assert_numpy_leaves(as_saved)
    arrays = {k: v for k, v in state.items() if k != "keys"}
    dispatcher.save(tmp_path / "arrays", arrays).wait()
    numpy_target = {k: np.zeros(x.shape, x.dtype) for k, x in arrays.items()}
    restored = dispatcher.restore(tmp_path / "arrays", numpy_target)
    assert_trees_bit_equal(as_host(arrays), restored)
    assert_numpy_leaves(restored)
    # Keys have no numpy form: named alone (partial), they come back as keys.
    partial = dispatcher.restore(tmp_path / "ckpt", {"keys": state["keys"]}, partial=True)
    assert_trees_bit_equal({"keys": state["keys"]}, partial)


# ---- 6. leaves several times the budget ------------------------------------------------------------

BUDGET = 64 << 10


@pytest.fixture
def small_dispatcher(dispatcher_cls):
    d = dispatcher_cls(host_memory_budget=BUDGET)
    yield d
    d.close()


def big_state(mesh):
    return {
        "sharded": jax.device_put(random_bits("float32", (256, 256), seed=21), ns(mesh, "data", "model")),  # 256 KiB
        "single": jax.device_put(random_bits("bfloat16", (97, 1031), seed=22), jax.devices()[4]),       # ~196 KiB
        "wide_rows": jax.device_put(random_bits("float32", (4, 40000), seed=23), ns(mesh, "data")),     # 160 KiB rows
        "replicated": jax.device_put(random_bits("uint8", (300, 700), seed=24), ns(mesh)),
        "host": random_bits("complex64", (64, 97), seed=25),
        "keys": jax.device_put(jax.random.split(jax.random.key(0, impl="unsafe_rbg"), 8 * 2048).reshape(8, 2048),
                               ns(mesh, "data", None)),
        "small": np.arange(5, dtype=np.int16),
    }


def test_leaves_larger_than_budget(small_dispatcher, mesh, tmp_path):
    state = big_state(mesh)
    sizes = {k: (jax.random.key_data(x) if dio.tree.is_prng_key(x) else x).nbytes for k, x in state.items()}
    assert max(sizes.values()) > 3 * BUDGET
    stats = small_dispatcher.save(tmp_path / "ckpt", state).wait()
    assert 0 < stats.peak_host_bytes <= BUDGET
    assert stats.bytes_written == sum(sizes.values())   # replicas written once
    assert stats.batches > len(state)
    restored = small_dispatcher.restore(tmp_path / "ckpt", state)
    assert_trees_bit_equal(state, restored)
    assert_same_shardings(restored, state)
    assert_trees_bit_equal(as_host(state), small_dispatcher.restore(tmp_path / "ckpt"))
    # Read under the small budget onto another layout.
    mesh2 = jax.make_mesh((2, 4), ("data", "model"))
    target = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh2, P("model")))
              if k in ("sharded", "replicated", "keys") else x for k, x in state.items()}
    assert_trees_bit_equal(state, small_dispatcher.restore(tmp_path / "ckpt", target))


def test_saved_small_restored_with_large_budget_and_back(small_dispatcher, dispatcher, mesh, tmp_path):
    state = big_state(mesh)
    small_dispatcher.save(tmp_path / "small", state).wait()
    dispatcher.save(tmp_path / "large", state).wait()
    assert_trees_bit_equal(state, dispatcher.restore(tmp_path / "small", state))
    assert_trees_bit_equal(state, small_dispatcher.restore(tmp_path / "large", state))


# ---- 7. memory kvstore -----------------------------------------------------------------------------

def test_memory_kvstore(dispatcher, mesh, tmp_path):
    path = f"memory://some/prefix/{uuid.uuid4().hex}"
    state = training_state(mesh)
    dispatcher.save(path, state).wait()
    restored = dispatcher.restore(path, state)
    assert_trees_bit_equal(state, restored)
    assert_same_shardings(restored, state)
    assert_trees_bit_equal(as_host(state), dispatcher.restore(path))
    assert jax.tree.structure(dio.metadata(path)) == jax.tree.structure(state)
    # With a trailing slash it is the same prefix.
    assert_trees_bit_equal(state, dispatcher.restore(path + "/", state))


def test_memory_kvstore_saves_do_not_alias_staging(dispatcher, mesh):
    """A later save reuses the staging buffer; an earlier checkpoint in memory must not change."""
    first, second = (f"memory://some/prefix/{uuid.uuid4().hex}" for _ in range(2))
    state = topology_state(mesh)
    other = jax.tree.map(lambda x: x if dio.tree.is_prng_key(x) else x + 1, state)
    dispatcher.save(first, state).wait()
    for _ in range(3):
        dispatcher.save(second, other, overwrite=True).wait()
    assert_trees_bit_equal(state, dispatcher.restore(first, state))
    assert_trees_bit_equal(other, dispatcher.restore(second, other))
    # Restored host arrays are the caller's: changing them changes nothing stored.
    host = dispatcher.restore(first)
    for x in host.values():
        if isinstance(x, np.ndarray):
            x.view(np.uint8)[...] = 0xAB
    assert_trees_bit_equal(state, dispatcher.restore(first, state))


def test_memory_kvstore_overwrite(dispatcher, mesh):
    path = f"memory://some/prefix/{uuid.uuid4().hex}"
    state = topology_state(mesh)
    dispatcher.save(path, {"old": np.arange(10)}).wait()
    dispatcher.save(path, state, overwrite=True).wait()
    assert_trees_bit_equal(state, dispatcher.restore(path, state))
    assert jax.tree.structure(dio.metadata(path)) == jax.tree.structure(state)


def test_memory_kvstore_multi_chunk(small_dispatcher, mesh):
    path = f"memory://some/prefix/{uuid.uuid4().hex}"
    state = big_state(mesh)
    stats = small_dispatcher.save(path, state).wait()
    assert stats.peak_host_bytes <= BUDGET
    assert_trees_bit_equal(state, small_dispatcher.restore(path, state))


# ---- 8. path forms -------------------------------------------------------------------------------

def test_relative_path(dispatcher, mesh, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = training_state(mesh)
    dispatcher.save("ckpts/step_1", state).wait()
    assert (tmp_path / "ckpts" / "step_1" / "COMMITTED").is_file()
    assert_trees_bit_equal(state, dispatcher.restore("ckpts/step_1", state))
    assert_trees_bit_equal(state, dispatcher.restore(str(tmp_path / "ckpts" / "step_1"), state))
    assert_trees_bit_equal(state, dispatcher.restore("./ckpts/../ckpts/step_1", state))
    assert jax.tree.structure(dio.metadata("ckpts/step_1")) == jax.tree.structure(state)


def test_pathlib_paths(dispatcher, mesh, tmp_path, monkeypatch):
    state = training_state(mesh)
    dispatcher.save(tmp_path / "abs", state).wait()
    assert_trees_bit_equal(state, dispatcher.restore(tmp_path / "abs", state))
    assert_trees_bit_equal(state, dispatcher.restore(f"file://{tmp_path / 'abs'}", state))
    monkeypatch.chdir(tmp_path)
    dispatcher.save(pathlib.Path("rel") / "ckpt", state).wait()
    assert (tmp_path / "rel" / "ckpt" / "manifest.json").is_file()
    assert_trees_bit_equal(state, dispatcher.restore(pathlib.Path("rel/ckpt"), state))
    assert_trees_bit_equal(state, dispatcher.restore(tmp_path / "rel" / "ckpt", state))
    assert dio.metadata(pathlib.Path("rel/ckpt"))["name"] == "run-17"



@pytest.mark.parametrize("name", NARROW_FLOATS)
def test_narrow_floats_keep_their_bits_through_the_pageable_paths_device_cuts(mesh, tmp_path, monkeypatch, name):
    """On an accelerator the pageable path cuts each chunk out of its shard on the device
    (``transfer.copy_chunks_to_host``), then copies it to the host: every bit pattern survives
    that cut. Forced on CPU devices by taking their memory for device memory (they are read on
    the host otherwise)."""
    from dispatch_io.save import transfer
    monkeypatch.setattr(transfer, "in_host_memory", lambda array: False)
    host = every_bit_pattern(name)
    x = jax.device_put(host, ns(mesh, "data", "model"))
    with dio.LocalDispatcher(host_memory_budget=1 << 20, max_chunk_bytes=32, progress=False) as d:
        d.save(tmp_path / "cut", {"x": x}).wait()
        monkeypatch.undo()
        assert host_bytes(d.restore(tmp_path / "cut", {"x": x})["x"]) == host.tobytes(), name
