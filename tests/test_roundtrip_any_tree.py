"""Any tree round-trips bit-exact onto any layout: trees, meshes, dtypes, priorities and budgets
drawn at random, seeded.

Every case ``seed-K`` draws, with ``np.random.default_rng(K)`` only (so a failure replays
exactly), a save layout and a different restore layout (1-D / 2-D meshes, a subset of the
devices, shuffled devices, one device), a tree of 1-12 leaves (jax arrays of random rank,
dtype, PartitionSpec and random-bit contents, zero-size and 0-d ones, numpy arrays and
scalars, Python scalars, typed PRNG keys of every impl) in random nested containers with
None and empty containers, a random budget / chunk limit and random per-leaf priorities.
It saves, then restores onto (a) the original tree, (b) ShapeDtypeStructs on the other
layout, (c) target=None, (d) ``dio.metadata``, and checks bytes, shardings, callbacks,
priority order, ``bytes_written`` and ``peak_host_bytes``.
"""

import collections
import math
import os
import struct
import threading

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import dispatch_io as dio
from conftest import assert_trees_bit_equal
from dispatch_io.jax_compat import single_device_sharding

N_CASES = int(os.environ.get("DISPATCH_IO_RANDOM_CASES", 80))
COLOCATED_EVERY = int(os.environ.get("DISPATCH_IO_COLOCATED_EVERY", 4))   # ColocatedDispatcher: every 4th case
KiB = 1 << 10
MAX_LEAF_BYTES = 256 * KiB
TIMEOUT = 60

DTYPES = ["bool", "int4", "int8", "uint8", "int16", "int32", "uint32", "float16", "bfloat16", "float32",
          "float8_e4m3fn", "complex64"]
IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]
LAYOUTS = ["1d8", "2x4", "4x2", "8x1", "1x8", "subset", "shuffled", "single"]
PRIORITIES = [dio.Priority.SYNC, dio.Priority.HIGH, dio.Priority.LOW]


def dtype_of(name):
    return np.dtype(getattr(ml_dtypes, name) if hasattr(ml_dtypes, name) else name)


# ---- layouts --------------------------------------------------------------------------------------

class Layout:
    """A mesh (or one device) and how a PartitionSpec becomes a sharding on it."""

    def __init__(self, name, mesh=None, device=None):
        self.name, self.mesh, self.device = name, mesh, device

    @property
    def axis_sizes(self) -> dict:
        return {} if self.mesh is None else dict(self.mesh.shape)

    def factor(self, entry) -> int:
        """How many ways a dim is split by one PartitionSpec entry (0: names an unknown axis)."""
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        sizes = self.axis_sizes
        return math.prod(sizes[n] if n in sizes else 0 for n in names)

    def valid(self, spec: P, shape) -> bool:
        if self.mesh is None:
            return True
        if len(spec) > len(shape):
            return False
        for entry, n in zip(spec, shape):
            f = self.factor(entry)
            if f == 0 or n % f:
                return False
        return True

    def sharding(self, spec: P):
        if self.mesh is None:
            return single_device_sharding(self.device)
        return NamedSharding(self.mesh, spec)

    def __repr__(self):
        if self.mesh is None:
            return f"single({self.device.id})"
        return f"{self.name}{dict(self.mesh.shape)}[{','.join(str(d.id) for d in self.mesh.devices.flat)}]"


def make_layout(name, rng) -> Layout:
    devs = jax.devices()
    if name == "single":
        return Layout(name, device=devs[int(rng.integers(8))])
    if name == "1d8":
        return Layout(name, Mesh(np.array(devs), (str(rng.choice(["data", "model"])),)))
    if name == "subset":
        picked = [devs[int(i)] for i in rng.choice(8, size=4, replace=False)]
        shape = [(2, 2), (4, 1), (1, 4), (4,)][int(rng.integers(4))]
        names = ("data", "model")[:len(shape)]
        return Layout(name, Mesh(np.array(picked, dtype=object).reshape(shape), names))
    if name == "shuffled":
        order = [devs[int(i)] for i in rng.permutation(8)]
        shape = [(2, 4), (4, 2)][int(rng.integers(2))]
        return Layout(name, Mesh(np.array(order, dtype=object).reshape(shape), ("data", "model")))
    shape = tuple(int(s) for s in name.split("x"))
    return Layout(name, Mesh(np.array(devs, dtype=object).reshape(shape), ("data", "model")))


# ---- random leaves ----------------------------------------------------------------------------------

def random_contents(rng, name, shape) -> np.ndarray:
    """Random bits of dtype ``name`` (NaN payloads, -0, inf included); valid values for sub-byte
    and bool."""
    dtype = dtype_of(name)
    n = math.prod(shape)
    if name == "bool":
        return rng.integers(0, 2, shape).astype(np.bool_)
    if name == "int4":
        return rng.integers(-8, 8, shape).astype(dtype)
    return np.frombuffer(rng.bytes(n * dtype.itemsize), dtype=dtype).reshape(shape).copy()


def numpy_layout(rng, host: np.ndarray) -> np.ndarray:
    """The same values, sometimes as a non-contiguous, Fortran-ordered or read-only array."""
    r = rng.random()
    if r < 0.15 and host.ndim:
        axis = int(rng.integers(host.ndim))
        padded = np.repeat(host, 2, axis=axis)        # every other element: a strided view
        return padded[(slice(None),) * axis + (slice(None, None, 2),)]
    if r < 0.25 and host.ndim:
        return host[(slice(None, None, -1),) * host.ndim].copy()[(slice(None, None, -1),) * host.ndim]
    if r < 0.35:
        return np.asfortranarray(host)
    if r < 0.45:
        host.flags.writeable = False
    return host


def random_spec(rng, rank, axis_names) -> P:
    """Per dim: None, one axis, or a tuple of axes; each axis used at most once."""
    free = list(axis_names)
    entries = []
    for _ in range(rank):
        r = rng.random()
        if r < 0.4 or not free:
            entries.append(None)
        elif r < 0.8 or len(free) < 2:
            entries.append(free.pop(int(rng.integers(len(free)))))
        else:
            pair = [free.pop(int(rng.integers(len(free)))) for _ in range(2)]
            entries.append(tuple(pair))
    while entries and entries[-1] is None and rng.random() < 0.5:  # P('x') as well as P('x', None)
        entries.pop()
    return P(*entries)


def random_shape(rng, spec: P, rank, layout: Layout, itemsize, trailing=1):
    """Dims divisible by the layout's split of each dim (sometimes by 8, so that the spec stays
    valid on any layout), about a log-uniform number of bytes up to MAX_LEAF_BYTES; sometimes
    a zero-size dim."""
    entries = list(spec) + [None] * (rank - len(spec))
    factors = [max(layout.factor(e), 1) if e is not None else 1 for e in entries]
    factors = [8 if e is not None and rng.random() < 0.5 else f for e, f in zip(entries, factors)]
    target = np.exp(rng.uniform(0, np.log(MAX_LEAF_BYTES))) / (itemsize * trailing)
    per_dim = max(target / math.prod(factors), 1) ** (1 / max(rank, 1))
    dims = [f * max(1, int(per_dim * np.exp(rng.uniform(-0.7, 0.7)))) for f in factors]
    while dims and math.prod(dims) * itemsize * trailing > MAX_LEAF_BYTES:
        k = int(np.argmax([d // f for d, f in zip(dims, factors)]))
        if dims[k] // factors[k] <= 1:
            break
        dims[k] = factors[k] * (dims[k] // factors[k] // 2)
    if dims and rng.random() < 0.1:
        dims[int(rng.integers(len(dims)))] = 0
    return tuple(dims)


def random_python_scalar(rng):
    kind = int(rng.integers(5))
    if kind == 0:
        return bool(rng.integers(2))
    if kind == 1:
        return int(rng.integers(-(2 ** 62), 2 ** 62)) * (2 ** 70 if rng.random() < 0.3 else 1)
    if kind == 2:
        return struct.unpack("<d", rng.bytes(8))[0]          # any bits: NaN payloads, -0.0, inf
    if kind == 3:
        return complex(*struct.unpack("<2d", rng.bytes(16)))
    return "".join(rng.choice(list("abc xyz/.\\'\"é✓\n")) for _ in range(int(rng.integers(0, 12))))


class Leaf:
    """One drawn leaf: its value, kind, and the PartitionSpec it asks for on a mesh."""

    def __init__(self, value, kind, spec=P(), desc=""):
        self.value, self.kind, self.spec, self.desc = value, kind, spec, desc


def random_leaf(rng, save: Layout, names) -> Leaf:
    r = rng.random()
    if r < 0.1:
        return Leaf(random_python_scalar(rng), "python", desc="py")
    if r < 0.25:  # typed PRNG key
        impl = str(rng.choice(IMPLS))
        trailing = jax.eval_shape(jax.random.key_data, jax.random.key(0, impl=impl)).shape[-1]
        rank = int(rng.integers(0, 4))
        spec = random_spec(rng, rank, names)
        shape = random_shape(rng, spec, rank, save, 4, trailing)
        data = np.frombuffer(rng.bytes(math.prod(shape) * trailing * 4), np.uint32).reshape(shape + (trailing,))
        key = jax.random.wrap_key_data(data, impl=impl)
        assert save.valid(spec, shape), (spec, shape, save)
        return Leaf(jax.device_put(key, save.sharding(spec)), "key", spec, f"key<{impl}>{shape} {spec}")
    name = str(rng.choice(DTYPES))
    dtype = dtype_of(name)
    rank = int(rng.integers(0, 5))
    spec = random_spec(rng, rank, names)
    shape = random_shape(rng, spec, rank, save, dtype.itemsize)
    if r < 0.3:
        return Leaf(random_contents(rng, name, ())[()], "numpy_scalar", P(), f"np-scalar {name}")
    host = random_contents(rng, name, shape)
    if r < 0.45:
        return Leaf(numpy_layout(rng, host), "numpy", spec, f"np {name}{shape} {spec}")
    u = rng.random()
    if u < 0.08:  # a leaf pinned to one device, whatever the save layout
        device = jax.devices()[int(rng.integers(8))]
        return Leaf(jax.device_put(host, device), "jax", spec, f"jax {name}{shape} on {device.id}")
    if u < 0.12:  # uncommitted, on the default device
        return Leaf(jax.numpy.asarray(host), "jax", spec, f"jax {name}{shape} uncommitted")
    sharding = save.sharding(spec)
    assert save.valid(spec, shape), (spec, shape, save)
    return Leaf(jax.device_put(host, sharding), "jax", spec, f"jax {name}{shape} {spec}")


# ---- random containers ------------------------------------------------------------------------------

FILLERS = [lambda: None, dict, list, tuple]


def random_tree(rng, leaves: list, depth=0):
    """Spread ``leaves`` (in order) over nested dict/list/tuple nodes with None and empty
    containers in between."""
    if len(leaves) == 1 and (depth > 0 and rng.random() < 0.6 or depth == 0 and rng.random() < 0.05):
        return leaves[0]
    if depth >= 3 and len(leaves) == 1:
        return leaves[0]
    groups = []
    rest = list(leaves)
    while rest:
        k = int(rng.integers(1, len(rest) + 1)) if depth < 3 else 1
        groups.append(rest[:k])
        rest = rest[k:]
    children = [random_tree(rng, g, depth + 1) for g in groups]
    for _ in range(int(rng.integers(0, 3))):
        children.insert(int(rng.integers(len(children) + 1)), FILLERS[int(rng.integers(4))]())
    kind = int(rng.integers(3))
    if kind == 0:
        # Dict keys are sorted by JAX: number them so the leaves keep their drawn order.
        return {f"{i:02d}{rng.choice(['', '_w', '.b', ' x', '/y'])}": c for i, c in enumerate(children)}
    return list(children) if kind == 1 else tuple(children)


# ---- one case ----------------------------------------------------------------------------------------

class Case:
    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        self.seed = seed
        save_name, restore_name = rng.choice(LAYOUTS, size=2, replace=False)
        self.save = make_layout(str(save_name), rng)
        self.other = make_layout(str(restore_name), rng)
        names = list(self.save.axis_sizes) or ["data", "model"]
        drawn = [random_leaf(rng, self.save, names) for _ in range(int(rng.integers(1, 13)))]
        self.tree = random_tree(rng, [leaf.value for leaf in drawn])
        flat, _ = jax.tree_util.tree_flatten_with_path(self.tree)
        assert len(flat) == len(drawn) and all(x is leaf.value for (_, x), leaf in zip(flat, drawn))
        self.leaves = {jax.tree_util.keystr(p): leaf for (p, _), leaf in zip(flat, drawn)}
        self.priority = {k: PRIORITIES[int(rng.integers(3))] for k in self.leaves}
        self.budget = int(np.exp(rng.uniform(np.log(16 * KiB), np.log(4096 * KiB))))
        self.max_chunk = (int(np.exp(rng.uniform(np.log(512), np.log(self.budget // 2))))
                          if rng.random() < 0.4 else None)
        self.restore_budget = int(np.exp(rng.uniform(np.log(16 * KiB), np.log(4096 * KiB))))
        self.write_threads = int(rng.integers(1, 4))
        self.fsync = bool(rng.random() < 0.7)
        self.memory = bool(rng.random() < 0.25)    # memory:// kvstore instead of a directory

    def __repr__(self):
        leaves = "\n  ".join(f"{k}: {leaf.desc} {self.priority[k].name}" for k, leaf in self.leaves.items())
        return (f"seed {self.seed}: save {self.save!r}, restore {self.other!r}, budget {self.budget}, "
                f"max_chunk_bytes {self.max_chunk}, restore budget {self.restore_budget}, "
                f"write_threads {self.write_threads}, fsync {self.fsync}, memory {self.memory}\n  {leaves}")

    def other_target(self):
        """ShapeDtypeStructs on the other layout, same PartitionSpecs where valid there."""
        def one(path, x):
            leaf = self.leaves[jax.tree_util.keystr(path)]
            if leaf.kind == "python":
                return x
            spec = leaf.spec if self.other.valid(leaf.spec, x.shape) else P()
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.other.sharding(spec))
        return jax.tree_util.tree_map_with_path(one, self.tree)


def stored_bytes(leaf: Leaf) -> int:
    x = leaf.value
    if leaf.kind == "python":
        return 0
    if leaf.kind == "key":
        x = jax.eval_shape(jax.random.key_data, x)
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize   # 0-d: one element; zero-size: 0


def assert_bit_equal(expected, restored):
    assert_trees_bit_equal(expected, restored)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(restored)):
        if isinstance(a, (float, complex)):  # -0.0 == 0.0 and NaN payloads: compare the bits
            assert struct.pack("<2d", a.real, a.imag) == struct.pack("<2d", b.real, b.imag), \
                jax.tree_util.keystr(path)


def assert_shardings(restored, target):
    for (path, r), t in zip(jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(target)):
        key = jax.tree_util.keystr(path)
        if isinstance(t, (jax.Array, jax.ShapeDtypeStruct)):
            assert isinstance(r, jax.Array), key
            assert r.sharding.is_equivalent_to(t.sharding, r.ndim), f"{key}: {r.sharding} vs {t.sharding}"
            assert r.sharding.device_set == t.sharding.device_set, key
        elif isinstance(t, (np.ndarray, np.generic)):
            assert type(r) is type(t), f"{key}: {type(r)} is not {type(t)}"


class Recorder:
    def __init__(self):
        self.log, self._lock = [], threading.Lock()

    def transfer(self, keypath):
        with self._lock:
            self.log.append(("transfer", keypath))

    def write(self, keypath):
        with self._lock:
            self.log.append(("write", keypath))

    def of(self, kind):
        with self._lock:
            return [k for e, k in self.log if e == kind]


CASES = [pytest.param(seed, dio.LocalDispatcher, id=f"seed-{seed}") for seed in range(N_CASES)] + [
    pytest.param(seed, dio.ColocatedDispatcher, id=f"seed-{seed}-colocated")
    for seed in range(0, N_CASES, COLOCATED_EVERY)]


@pytest.mark.parametrize("seed, dispatcher_cls", CASES)
def test_any_tree_round_trips_bit_exact_onto_every_target(seed, dispatcher_cls, tmp_path):
    case = Case(seed)
    # memory:// data lives as long as the process: a fresh prefix per case and run.
    path = f"memory://{tmp_path.name}/ckpt" if case.memory else tmp_path / "ckpt"
    try:
        run_case(case, path, dispatcher_cls)
    except Exception as exc:
        exc.add_note(f"random round trip case {case!r}")
        raise


def run_case(case: Case, path, dispatcher_cls):
    arrays = {k for k, leaf in case.leaves.items() if leaf.kind != "python"}
    asked = []

    def priority(keypath, spec):
        asked.append(keypath)
        leaf = case.leaves[keypath]
        assert isinstance(spec, jax.ShapeDtypeStruct) and spec.shape == leaf.value.shape, keypath
        return case.priority[keypath]

    rec = Recorder()
    options = {} if case.max_chunk is None else {"max_chunk_bytes": case.max_chunk}
    with dispatcher_cls(case.budget, write_threads=case.write_threads, fsync=case.fsync, **options) as d:
        handle = d.save(path, case.tree, priority=priority, on_transfer_end=rec.transfer,
                        on_write_end=rec.write)
        transferred_at_return = set(rec.of("transfer"))
        stats = handle.wait(TIMEOUT)

        # Callbacks: once per array leaf, transfer before write, SYNC ones before save() returned.
        assert sorted(asked) == sorted(arrays)
        transfers, writes = rec.of("transfer"), rec.of("write")
        assert collections.Counter(transfers) == collections.Counter(arrays), transfers
        assert collections.Counter(writes) == collections.Counter(arrays), writes
        position = {event: i for i, event in enumerate(rec.log)}
        for k in arrays:
            assert position[("transfer", k)] < position[("write", k)], k
        sync = {k for k in arrays if case.priority[k] == dio.Priority.SYNC}
        assert sync <= transferred_at_return, sync - transferred_at_return
        # Leaves with bytes to copy are transferred SYNC, then HIGH, then LOW.
        copied = [case.priority[k] for k in transfers if stored_bytes(case.leaves[k])]
        assert copied == sorted(copied), [(k, case.priority[k].name) for k in transfers]

        # Stats.
        assert stats.peak_host_bytes <= case.budget, (stats.peak_host_bytes, case.budget)
        assert stats.bytes_written == sum(stored_bytes(leaf) for leaf in case.leaves.values())

        # (a) the original tree as target.
        restored = d.restore(path, case.tree)
        assert_bit_equal(case.tree, restored)
        assert_shardings(restored, case.tree)

        # (c) target=None: numpy arrays (keys as keys), numpy scalars stay numpy scalars.
        restored = d.restore(path)
        assert_bit_equal(case.tree, restored)
        for (p, r), leaf in zip(jax.tree_util.tree_flatten_with_path(restored)[0], case.leaves.values()):
            if leaf.kind in ("jax", "numpy"):
                assert type(r) is np.ndarray, jax.tree_util.keystr(p)
            elif leaf.kind == "numpy_scalar":
                assert type(r) is type(leaf.value), jax.tree_util.keystr(p)
            elif leaf.kind == "key":
                assert dio.tree.is_prng_key(r), jax.tree_util.keystr(p)

    with dispatcher_cls(case.restore_budget) as d:
        # (b) the other layout, same PartitionSpecs where valid there (else replicated).
        target = case.other_target()
        restored = d.restore(path, target)
        assert_bit_equal(case.tree, restored)
        assert_shardings(restored, target)

        # (d) metadata as target.
        meta = dio.metadata(path)
        assert jax.tree.structure(meta) == jax.tree.structure(case.tree)
        for m, leaf in zip(jax.tree.leaves(meta), case.leaves.values()):
            if leaf.kind == "python":
                assert type(m) is type(leaf.value)
            else:
                assert m.shape == leaf.value.shape and m.dtype == leaf.value.dtype, (m, leaf.desc)
        restored = d.restore(path, meta)
        assert_bit_equal(case.tree, restored)
