"""Plan a save: pure controller-side work, no device data touched, cached across saves.

A :class:`Plan` says, for every leaf, what is stored (logical spec, physical shape/dtype,
storage name, on-disk chunk shape) and, for every distinct shard region, which chunks are
copied from which device by which worker. Replicas are written exactly once; the replica to
copy each chunk from is chosen so replicated bytes spread evenly over workers (processes) and
devices.
Shards larger than the chunk limit are split along their leading axes, so the host memory
budget holds even for one array many times its size. Small leaves written whole by one
device's host are packed into shared byte arrays, per save (:func:`with_packs`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import math
import re
import threading
from typing import Any, Sequence

import jax
import numpy as np

from dispatch_io import tree as tree_lib
from dispatch_io.plan.balance import LeastLoaded
from dispatch_io.workers import ArraySpec, pack_spec, packed_leaf
from dispatch_io.workers.packs import pack_offsets


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """What is stored for one leaf. ``spec`` is the logical ShapeDtypeStruct (with sharding);
    ``shape``/``dtype`` are what is on disk (``key_data`` for PRNG keys)."""

    index: int
    keypath: str
    kind: str                       # tree.ARRAY / tree.KEY / tree.SCALAR
    origin: str                     # "jax" | "numpy" | "numpy_scalar" | "python"
    spec: jax.ShapeDtypeStruct | None = None
    shape: tuple[int, ...] = ()
    dtype: np.dtype | None = None
    key_impl: str | None = None
    storage: str | None = None      # array name under arrays/; None: nothing stored (scalars, size 0)
    chunk_shape: tuple[int, ...] = ()
    whole: bool = False             # a small sharded leaf: one chunk, copied whole (small_leaf_bytes)
    packed: tuple[str, int, int] | None = None   # (pack name, pack bytes, offset): stored in a pack

    @property
    def nbytes(self) -> int:
        return 0 if self.dtype is None else math.prod(self.shape) * self.dtype.itemsize

    @functools.cached_property
    def array(self) -> ArraySpec:
        """What a worker needs to open this leaf's stored array (or its place in a pack)."""
        if self.packed is not None:
            name, size, offset = self.packed
            return packed_leaf(pack_spec(name, size), offset, self.shape, self.dtype.name)
        return ArraySpec(self.storage, self.shape, self.dtype.name, self.chunk_shape)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One region of one leaf, copied to host and written as a unit. ``region`` is
    ((start, stop), ...) over the stored (physical) shape."""

    leaf: int
    region: tuple[tuple[int, int], ...]
    nbytes: int
    device: int | None   # device id to copy from; None for host (numpy) leaves
    worker: int          # JAX process index that copies and writes it


@dataclasses.dataclass(frozen=True)
class Plan:
    treedef: Any
    leaves: tuple[LeafSpec, ...]
    chunks: tuple[Chunk, ...]
    # A conversion of an Orbax checkpoint: restores match its leaves as Orbax's do, by key
    # names (the manifest's "keys"), so the targets the Orbax checkpoint took still fit.
    keys_by_name: bool = False

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @functools.cached_property
    def arrays(self) -> tuple[ArraySpec, ...]:
        """Every stored array a save of this plan writes chunks of, each once (a pack stands
        for its packed leaves), in order of first chunk."""
        return tuple(dict.fromkeys(self.leaves[c.leaf].array.stored for c in self.chunks))

    @functools.cached_property
    def leaf_digests(self) -> tuple[str, ...]:
        """Per leaf, a short hash of what is stored and who writes which chunk: the processes
        of a job compare these to check they planned the same save."""
        chunks: list[list] = [[] for _ in self.leaves]
        for c in self.chunks:
            chunks[c.leaf].append((c.region, c.device, c.worker))
        return tuple(hashlib.sha256(repr((spec.keypath, spec.kind, spec.shape, str(spec.dtype), spec.storage,
                                          spec.chunk_shape, spec.packed, chunks[spec.index])).encode()).hexdigest()[:16]
                     for spec in self.leaves)

    @functools.cached_property
    def digest(self) -> str:
        return hashlib.sha256(repr((str(self.treedef), self.leaf_digests)).encode()).hexdigest()


# ---- per-leaf specs ----------------------------------------------------------------------------

def _storage_name(index: int, keypath: str) -> str:
    """A safe file name: index first (unique), then a readable hint from the key path."""
    hint = re.sub(r"[^A-Za-z0-9_-]+", ".", keypath).strip(".")[:80]
    return f"{index:05d}.{hint}" if hint else f"{index:05d}"


def key_physical(key) -> tuple[tuple[int, ...], np.dtype, str]:
    """Physical (``key_data``) shape and dtype of a typed key array, and its impl name.
    Derived by JAX (``eval_shape``), never hard-coded: impls differ in trailing dims."""
    phys = jax.eval_shape(jax.random.key_data, key)
    return tuple(phys.shape), np.dtype(phys.dtype), str(jax.random.key_impl(key))


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def storage_chunk_shape(shard_shape: tuple[int, ...], itemsize: int, limit: int) -> tuple[int, ...]:
    """Largest chunk shape that tiles ``shard_shape`` exactly and holds at most ``limit`` bytes
    (or one element). Axes are cut from the front, so chunks stay contiguous in memory."""
    shape = list(shard_shape)
    for axis in range(len(shape)):
        if math.prod(shape[axis:]) * itemsize <= limit:
            break
        inner = math.prod(shape[axis + 1:]) * itemsize
        if inner >= limit:
            shape[axis] = 1
            continue
        shape[axis] = max(d for d in _divisors(shape[axis]) if d * inner <= limit)
        break
    return tuple(shape)


def device_regions(sharding, shape, *, addressable_only: bool = False) -> dict:
    """{region ((start, stop), ...) of ``shape``: [devices holding it]}, in the sharding's device
    order; ``sharding=None`` (host data) is one region held by device None."""
    shape = tuple(shape)
    if sharding is None:
        return {tuple((0, n) for n in shape): [None]}
    indices = sharding.addressable_devices_indices_map(shape) if addressable_only else \
        sharding.devices_indices_map(shape)
    regions: dict[tuple, list] = {}
    for device, index in indices.items():
        region = index_region(index, shape)
        regions.setdefault(region, []).append(device)
    return regions


def index_region(index, shape) -> tuple:
    """``index`` (a device's slices, as ``devices_indices_map`` gives them) as a region
    ``((start, stop), ...)`` of ``shape``."""
    return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape))


def whole_on_one_device(sharding, shape) -> dict:
    """``{the whole array: [the sharding's first device]}``: how a small leaf is copied (saves)
    or read (restores) whole, once."""
    return {tuple((0, n) for n in shape): [min(sharding.device_set, key=lambda d: d.id)]}


def native_order(dtype: np.dtype) -> np.dtype:
    """``dtype`` in this host's byte order: how a numpy leaf is stored (little-endian)."""
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def _copied_whole(spec: jax.ShapeDtypeStruct, nbytes: int, limit: int) -> bool:
    """A sharded leaf of at most ``limit`` bytes on the devices of one process is stored as one
    chunk and copied whole (``Options.small_leaf_bytes``)."""
    devices = getattr(spec.sharding, "device_set", ())
    return 0 < nbytes <= limit and len(devices) > 1 and len({d.process_index for d in devices}) == 1


def leaf_spec(index: int, keypath: str, leaf, chunk_limit: int, small_leaf_bytes: int = 0) -> LeafSpec:
    kind = tree_lib.leaf_kind(keypath, leaf)
    if kind == tree_lib.SCALAR:
        return LeafSpec(index, keypath, kind, origin="python")
    origin = "jax" if isinstance(leaf, jax.Array) else ("numpy_scalar" if isinstance(leaf, np.generic) else "numpy")
    if origin == "jax":
        spec = jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=leaf.sharding)
    else:  # stored in this host's byte order whatever the leaf's (the copy to staging converts),
        # and recorded so: the values are what is saved, not their byte order (">f4" is float32)
        spec = jax.ShapeDtypeStruct(tuple(leaf.shape), native_order(np.dtype(leaf.dtype)))
    if kind == tree_lib.KEY:
        shape, dtype, impl = key_physical(leaf)
    else:
        shape, dtype, impl = tuple(leaf.shape), np.dtype(spec.dtype), None
    if _copied_whole(spec, math.prod(shape) * dtype.itemsize, min(small_leaf_bytes, chunk_limit)):
        return LeafSpec(index, keypath, kind, origin, spec, shape, dtype, impl, _storage_name(index, keypath),
                        shape, whole=True)
    return stored_leaf_spec(index, keypath, kind, origin, spec, shape, dtype, impl, chunk_limit)


def stored_leaf_spec(index: int, keypath: str, kind: str, origin: str, spec: jax.ShapeDtypeStruct,
                     shape: tuple[int, ...], dtype: np.dtype, key_impl: str | None, chunk_limit: int) -> LeafSpec:
    """The LeafSpec of an array leaf with logical ``spec`` stored as ``shape`` / ``dtype``: its
    storage name (None when empty) and a chunk shape that tiles each shard of ``spec.sharding``."""
    storage = _storage_name(index, keypath) if math.prod(shape) else None
    shard_shape = tuple(spec.shape)
    if spec.sharding is not None and storage:
        shard_shape = tuple(spec.sharding.shard_shape(tuple(spec.shape)))
    shard_shape = shard_shape + shape[len(spec.shape):]  # key dims are never split across devices
    chunk_shape = storage_chunk_shape(shard_shape, dtype.itemsize, chunk_limit) if storage else ()
    return LeafSpec(index, keypath, kind, origin, spec, shape, dtype, key_impl, storage, chunk_shape)


# ---- chunks -----------------------------------------------------------------------------------

def _split_region(region, chunk_shape):
    """The chunk-grid cells covering ``region`` (which is aligned to the grid)."""
    axes = [range(lo, hi, step) for (lo, hi), step in zip(region, chunk_shape)]
    for starts in itertools.product(*axes):
        yield tuple((s, min(s + step, hi)) for s, step, (_, hi) in zip(starts, chunk_shape, region))


def plan_tree(tree, chunk_limit: int, small_leaf_bytes: int = 0) -> Plan:
    """Build the plan for ``tree`` (TypeError naming the key path for unsupported leaves, or
    for two leaves with one key path); sharded leaves of at most ``small_leaf_bytes`` on one
    process's devices are one chunk.
    Nothing is packed yet: that depends on the save's priorities (:func:`with_packs`)."""
    flat, treedef = tree_lib.flatten(tree)
    tree_lib.check_distinct_keypaths(flat)
    specs = tuple(leaf_spec(i, path, leaf, chunk_limit, small_leaf_bytes) for i, (path, leaf) in enumerate(flat))
    return Plan(treedef, specs, plan_chunks(specs, _regions))


def with_packs(plan: Plan, limit: int, pack_limit: int, priorities: Sequence = ()) -> Plan:
    """``plan`` with its leaves of at most ``limit`` bytes that are one chunk packed together:
    per (priority, worker, device copying them), in tree order, into packs of at most
    ``pack_limit`` bytes, each leaf at a 64-byte aligned offset (``LeafSpec.packed``).

    One device's host writes each pack, whole, in one batch (``batches.make_batches``), and a
    pack never mixes priorities (``priorities[leaf]``; none: all alike), so it is copied when
    each of its leaves asked to be. A pack that would hold one leaf is not made."""
    specs = plan.leaves
    per_leaf = collections.Counter(c.leaf for c in plan.chunks)
    groups: dict[tuple, tuple[list, int]] = {}   # (priority, worker, device) -> its open pack, its bytes
    packs: list[list] = []
    for c in plan.chunks:
        spec = specs[c.leaf]
        if per_leaf[c.leaf] != 1 or not 0 < spec.nbytes <= limit or spec.nbytes > pack_limit:
            continue
        group = (priorities[c.leaf] if priorities else None, c.worker, c.device)
        members, end = groups.get(group, (None, 0))
        end = pack_offsets([end, spec.nbytes])[1]   # this leaf after what the pack holds
        if members is None or end > pack_limit:
            members, end = [], spec.nbytes
            packs.append(members)
        members.append(c.leaf)
        groups[group] = (members, end)
    out = list(specs)
    for members in (m for m in packs if len(m) > 1):
        name = f"packed.{specs[members[0]].storage}"
        offsets, size = pack_offsets([specs[leaf].nbytes for leaf in members])
        for leaf, offset in zip(members, offsets):
            out[leaf] = dataclasses.replace(specs[leaf], storage=name, packed=(name, size, offset))
    return dataclasses.replace(plan, leaves=tuple(out))


def _regions(spec: LeafSpec) -> dict:
    """Which devices hold which region of a leaf being saved (a whole leaf: its first device)."""
    if spec.whole:
        return whole_on_one_device(spec.spec.sharding, spec.spec.shape)
    return device_regions(spec.spec.sharding, spec.spec.shape)


def plan_chunks(specs, regions_of) -> tuple[Chunk, ...]:
    """The chunks of every stored leaf of ``specs``; ``regions_of(spec)`` says which devices hold
    which region of it (``device_regions``; device None: host data, written by process 0)."""
    worker_load: dict[int, int] = {}
    device_load: dict[int, int] = {}
    least = LeastLoaded(lambda d: (worker_load.get(_process(d), 0), device_load.get(_id(d), 0), _id(d) or 0))
    chunks = []
    for spec in specs:
        if spec.storage is None:
            continue
        key_dims = tuple((0, n) for n in spec.shape[len(spec.spec.shape):])
        for region, devices in sorted(regions_of(spec).items(), key=_stacked_order):
            region = region + key_dims
            for cell in _split_region(region, spec.chunk_shape):
                nbytes = math.prod(hi - lo for lo, hi in cell) * spec.dtype.itemsize
                # Each distinct chunk is written once, by the least loaded worker (then device)
                # holding it: replicated arrays are spread over every process that has a copy.
                device = least.pick(devices)
                worker = _process(device)
                worker_load[worker] = worker_load.get(worker, 0) + nbytes
                device_load[_id(device)] = device_load.get(_id(device), 0) + nbytes
                chunks.append(Chunk(spec.index, cell, nbytes, _id(device), worker))
    return tuple(chunks)


def _stacked_order(item) -> tuple:
    # Regions stacked along axis 0 (alike on the other axes) next to each other, top to bottom:
    # a batch then holds their chunks back to back, and a writer writes each such run with one
    # call (workers.runs).
    region = item[0]
    return region[1:], region[:1]


def _process(device) -> int:
    # Host (numpy) data: every process has a copy; process 0's is the one saved.
    return 0 if device is None else device.process_index


def _id(device) -> int | None:
    return None if device is None else device.id


def plan_key(leaves: list, treedef) -> tuple:
    """What the plan of the tree ``jax.tree_util.tree_flatten`` made ``(leaves, treedef)`` of
    depends on: its structure with its key paths, and per leaf its type, shape, dtype and sharding.

    The structure is there twice. Treedefs compare dict keys by ``==``, so ``{0: x}``,
    ``{np.int64(0): x}`` and ``{False: x}`` have equal treedefs but the key paths ``[0]``,
    ``[np.int64(0)]`` and ``[False]``; the treedef's text shows every key by its ``repr``, as key
    paths do, so it tells them apart (for a fraction of the cost of the key paths themselves). It
    comes first: treedefs are then compared only when their texts are equal (comparing
    ``np.int64(1)`` with ``(1, "a")`` raises). The treedef itself tells apart node classes of
    the same name. A custom node's key names are taken to follow from its class and aux data.
    Python scalar *values* are not part of it (a step counter changes every save)."""
    sig = []
    for leaf in leaves:
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            sig.append((type(leaf), tuple(leaf.shape), leaf.dtype, getattr(leaf, "sharding", None)))
        else:
            sig.append(type(leaf))
    return str(treedef), tuple(sig), treedef


class PlanCache:
    """A small LRU of plans keyed by :func:`plan_key`, with what was derived from each (e.g. the
    batches of a priority assignment). A training loop saving the same state structure every N
    steps plans and batches once. Safe to use from several threads."""

    def __init__(self, chunk_limit: int, small_leaf_bytes: int = 0, size: int = 8):
        self._chunk_limit = chunk_limit
        self._small_leaf_bytes = small_leaf_bytes
        self._size = size
        self._plans: dict[tuple, tuple[Plan, dict]] = {}   # key -> (plan, derived values)
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, tree) -> tuple[Plan, list, bool]:
        """(the plan of ``tree``, its leaves, whether the plan came from the cache)."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        try:
            key = plan_key(leaves, treedef)
            hash(key)
        except TypeError:  # unhashable sharding: plan without caching
            return plan_tree(tree, self._chunk_limit, self._small_leaf_bytes), leaves, False
        with self._lock:
            entry = self._plans.pop(key, None)
            if entry is not None:
                self.hits += 1
                self._plans[key] = entry
                return entry[0], leaves, True
        plan = plan_tree(tree, self._chunk_limit, self._small_leaf_bytes)  # outside the lock: it may take a while
        with self._lock:
            self._plans[key] = self._plans.pop(key, None) or (plan, {})
            while len(self._plans) > self._size:
                self._plans.pop(next(iter(self._plans)))
            return self._plans[key][0], leaves, False

    def derive(self, plan: Plan, key, make):
        """``make()``, computed once per ``key`` while ``plan`` is cached (up to 8 keys a plan)."""
        with self._lock:
            derived = next((d for p, d in self._plans.values() if p is plan), None)
            if derived is not None and key in derived:
                return derived[key]
        value = make()
        with self._lock:
            if derived is not None:
                if len(derived) >= 8:
                    derived.clear()
                derived[key] = value
        return value
