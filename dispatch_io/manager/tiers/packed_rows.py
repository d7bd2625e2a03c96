"""Rows: how the local tier moves the shards of many leaves between processes in one collective.

Replicas (``replicas.py``) and parity (``parity.py``) both pack, on each device, its shards of a
group of leaves into one **row**: each shard flattened (PRNG keys as their key data) and padded
to its leaf's largest shard, so every leaf sits at one fixed offset in every device's row
whatever the leaves' shardings. The rows of all the job's devices make one array (one row per
device, sorted by id: :func:`sharding`); ``jax.device_put`` of it onto the same devices permuted
is one collective (:func:`permute`). Replicas pack leaves of one dtype as they are; parity packs their bytes
(``as_bytes``), so leaves of every dtype share one row. Rows are at most about ``ROW_BYTES``
(:func:`groups`), which bounds the transient device memory.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dispatch_io.jax_compat import exact_carrier
from dispatch_io.plan.save_plan import index_region

ROW_BYTES = 64 << 20   # the most one device sends in one collective: bounds the transient device memory


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A leaf to pack in rows: its values as stored (PRNG keys as key data), each device's region
    of it (stored shape), its largest shard in elements, how many of the replica orders it needs
    (replicas; 1 for parity), its (logical) dimensions: a PRNG key's data has more."""

    keypath: str
    data: jax.Array
    places: dict
    width: int
    needed: int
    ndim: int

    @property
    def nbytes(self) -> int:
        """Its width in bytes (what it takes of a row of bytes)."""
        return self.width * self.data.dtype.itemsize


def leaf(keypath: str, array: jax.Array, needed: int = 1) -> Leaf:
    """The :class:`Leaf` of ``array`` (a jax.Array; PRNG keys are packed as their key data)."""
    data = jax.random.key_data(array) if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key) else array
    places = {d: index_region(i, data.shape) for d, i in data.sharding.devices_indices_map(data.shape).items()}
    width = max(math.prod(hi - lo for lo, hi in region) for region in places.values())
    return Leaf(keypath, data, places, width, needed, array.ndim)


def groups(leaves: list[Leaf], row_bytes: int, by_dtype: bool = True) -> list[list[Leaf]]:
    """``leaves`` in runs whose rows (their widths together, in bytes) fit ``row_bytes`` (a larger
    leaf goes alone), one dtype per run with ``by_dtype`` (rows of values), else any (rows of bytes)."""
    found: list[list[Leaf]] = []
    kinds = dict.fromkeys(leaf.data.dtype for leaf in leaves) if by_dtype else [None]
    for kind in kinds:
        size = row_bytes
        for leaf in (leaf for leaf in leaves if kind is None or leaf.data.dtype == kind):
            if size + leaf.nbytes > row_bytes:
                found.append([])
                size = 0
            found[-1].append(leaf)
            size += leaf.nbytes
    return found


def _flat(shard, dtype):
    """``shard`` flattened, as ``dtype`` (its bytes, for a row of uint8, as numpy holds them: a byte
    per element of a sub-byte dtype such as int4, its bits low; a complex number's real, then
    imaginary part -- neither has a bitcast to bytes)."""
    flat = shard.reshape(-1)
    if flat.dtype == dtype:
        return flat
    if flat.dtype == jnp.bool_:
        return flat.astype(dtype)
    bits = jax.dtypes.itemsize_bits(flat.dtype)
    if bits < 8:
        return jax.lax.bitcast_convert_type(flat, jnp.dtype(f"uint{bits}")).astype(dtype)
    if jnp.issubdtype(flat.dtype, jnp.complexfloating):
        flat = jnp.stack([flat.real, flat.imag], axis=-1)
    return jax.lax.bitcast_convert_type(flat, dtype).reshape(-1)


@functools.partial(jax.jit, static_argnames=("widths", "present", "dtype", "pad"))
def pack(shards, *, widths, present, dtype, pad=0):
    """One device's row, (1, sum(widths) + pad): its shards flattened (as ``dtype``: their bytes
    for uint8), each padded to its leaf's width (zeros for leaves it holds no shard of)."""
    carrier = exact_carrier(dtype)   # JAX 0.12 quiets float8 NaN payloads it pads or joins as floats
    as_bits = (lambda a: a) if carrier is None else (lambda a: jax.lax.bitcast_convert_type(a, carrier))
    shards, parts = iter(shards), []
    for width, held in zip(widths, present):
        if held:
            flat = as_bits(_flat(next(shards), dtype))
            parts.append(jnp.pad(flat, (0, width - flat.size)))
        else:
            parts.append(jnp.zeros(width, carrier or dtype))
    joined = jnp.concatenate(parts + [jnp.zeros(pad, carrier or dtype)])[None]
    return joined if carrier is None else jax.lax.bitcast_convert_type(joined, dtype)


def row(group: list[Leaf], device, shards: list[dict], by_bytes: bool = False, pad: int = 0):
    """The row of ``device`` for ``group`` (``shards[i]``: {device: shard} of leaf i), on that
    device: values of the group's dtype, or bytes (``by_bytes``) padded by ``pad``."""
    present = tuple(device in held for held in shards)
    dtype = np.dtype(np.uint8) if by_bytes else group[0].data.dtype
    widths = tuple(leaf.nbytes if by_bytes else leaf.width for leaf in group)
    if not any(present):
        return jax.device_put(np.zeros((1, sum(widths) + pad), dtype), device)
    return pack([held[device] for held in shards if device in held], widths=widths, present=present, dtype=dtype,
                pad=pad)


@functools.partial(jax.jit, static_argnames=("spans",))
def unpack(row, *, spans):
    """The regions ``spans`` ((offset, shape), ...) cut out of one received row."""
    carrier = exact_carrier(row.dtype)   # cut as bits: see pack
    bits = row if carrier is None else jax.lax.bitcast_convert_type(row, carrier)
    cut = tuple(bits[0, offset:offset + math.prod(shape)].reshape(shape) for offset, shape in spans)
    return cut if carrier is None else tuple(jax.lax.bitcast_convert_type(part, row.dtype) for part in cut)


def sharding(devices: list) -> NamedSharding:
    """One row per device of ``devices``, in that order."""
    return NamedSharding(Mesh(np.array(devices), ("rows",)), PartitionSpec("rows"))


def by_process(devices: list) -> dict[int, list]:
    """{process: its devices of ``devices``, in their order}: a device's place is its index there."""
    found = collections.defaultdict(list)
    for d in devices:
        found[d.process_index].append(d)
    return found


def permute(mine: list, devices: list, to: list) -> jax.Array:
    """The rows of all ``devices`` (sorted by id; ``mine``: this process's, one (1, width) array per
    device of it, in that order) moved, each to the device in the same place on another process:
    ``to[i][p]`` for the device at place ``i`` of process ``p`` (one order of the processes per
    place: the places of one process may send to different peers). One ``jax.device_put`` onto the
    devices permuted, a collective every process calls together. Returns the rows as they land: each
    device's shard is the row it received, from the device ``devices[shard.index[0].start]``."""
    places = by_process(devices)
    rows = jax.make_array_from_single_device_arrays((len(devices), mine[0].shape[1]), sharding(devices), mine)
    landing = []
    for d in devices:
        i = places[d.process_index].index(d)
        landing.append(places[to[i][d.process_index]][i])
    return jax.device_put(rows, sharding(landing))
