"""Deterministic synthetic training states on 8 forced CPU devices (a 4x2 ('data', 'model') mesh).

Import this module before jax (it sets XLA_FLAGS for 8 host devices). A tree is named by its
``size``: a number of logical MiB (what a checkpoint has to write, replicas counted once) for
the training state, ``"10k"`` for the many-small-leaves tree, or ``"tf1g"`` / ``"tf4g"`` for the
transformer-shaped states. Training state layout:

* 32 small leaves of 4 KiB .. 1 MiB (about 6 MiB together), dtypes cycling f32 / bf16 / i32,
  shardings cycling P() | P('data', None) | P(None, 'model') | P('data', 'model');
* large leaves of 256, 128, 64, 192, 256, 128 MiB (cycling) until ``total_mib`` is reached,
  the last one taking the remainder; dtypes cycling f32, bf16, f32, bf16, f32, i32; shardings
  cycling P('data', 'model') | P('data', None) | P(None, 'model'); 4096 columns;
* ``step``: a replicated int32 scalar, ``rng``: a replicated ``jax.random.key``.

Even leaves live under ``params``, odd ones under ``opt_state``. The ``"10k"`` tree has 10 000
leaves of 1 to 8 KiB (32 columns, 8 to 64 rows; about 31 MiB together) nested as
``params|opt_state / layer_NNN / w_NNNNN``, dtypes and shardings cycling as for the small
leaves above, plus the same ``step`` and ``rng``. Floats look like weights (random sign and
mantissa, |x| in [2^-7, 2^-3)); int32 leaves are random bits. The same (size, seed) always
gives the same bytes; :func:`digest` checks a restore bit for bit.

The transformer-shaped trees (``"tf1g"``, ``"tf4g"``) are a decoder's training state with Adam:
``params``, ``opt_state / mu`` and ``opt_state / nu``, each holding ``embed`` (vocab x d_model),
``final_norm`` (d_model) and ``layer_NN / {attn_norm, mlp_norm, q, k, v, o, up, gate, down}``
(q/k/v/o d_model x d_model, up/gate d_model x 4 d_model, down 4 d_model x d_model), all float32.
Matrices are sharded fsdp on ``'data'`` and tensor-parallel on ``'model'`` (q/k/v/up/gate
``P('data', 'model')``, o/down/embed ``P('model', 'data')``); norm scales are replicated ``P()``.
``tf1g``: d_model 512, 17 layers, 465 leaves (105 of them 2 KiB norm scales), 0.98 GiB;
``tf4g``: d_model 1024, 19 layers, 519 leaves (4 KiB norm scales), 3.9 GiB. Plus ``step`` and ``rng``.

    python benchmarks/tree.py [SIZE]    # prints the leaf inventory (MiB, 10k, tf1g or tf4g)
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import zlib  # noqa: E402

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

MiB = 1 << 20
COLS = 4096
SMALL_COUNT = 32
SMALL_DTYPES = (np.float32, ml_dtypes.bfloat16, np.int32)
SMALL_SPECS = (P(), P("data", None), P(None, "model"), P("data", "model"))
LARGE_MIB = (256, 128, 64, 192, 256, 128)
LARGE_DTYPES = (np.float32, ml_dtypes.bfloat16, np.float32, ml_dtypes.bfloat16, np.float32, np.int32)
LARGE_SPECS = (P("data", "model"), P("data", None), P(None, "model"))
MANY = "10k"           # size name of the many-small-leaves tree
MANY_COUNT = 10_000
MANY_COLS = 32
MANY_PER_LAYER = 50


@dataclasses.dataclass(frozen=True)
class Transformer:
    """The shape of a transformer-shaped training state (see the module docstring)."""

    d_model: int
    layers: int
    vocab: int = 32_768

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model


TRANSFORMERS = {"tf1g": Transformer(d_model=512, layers=17), "tf4g": Transformer(d_model=1024, layers=19)}
# Where a size's bench targets compare it: the 40-leaf tree of about the same bytes, and the
# smaller tree of the same family for the 4x-the-bytes scaling target.
SAME_BYTES = {"tf1g": 1024, "tf4g": 4096}
SCALES_FROM = {4096: 1024, "tf4g": "tf1g"}


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    spec: P

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


def mesh() -> jax.sharding.Mesh:
    if jax.device_count() != 8:
        raise RuntimeError(f"need 8 devices, got {jax.device_count()}: import benchmarks/tree.py before jax")
    return jax.make_mesh((4, 2), ("data", "model"))


def parse_size(text: str) -> int | str:
    """A tree size from the command line: logical MiB, ``10k``, or a transformer name (``tf1g``)."""
    name = text.lower()
    if name == MANY or name in TRANSFORMERS:
        return name
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"unknown tree size {text!r}: MiB, {MANY!r} or one of {sorted(TRANSFORMERS)}") from None


def layout(size: int | str) -> list[Leaf]:
    """The array leaves (without step and rng) of the tree named ``size``."""
    if size == MANY:
        return many_layout()
    if size in TRANSFORMERS:
        return transformer_layout(TRANSFORMERS[size])
    return training_layout(size)


def transformer_layout(shape: Transformer) -> list[Leaf]:
    """A decoder's params and Adam mu / nu (same shapes and shardings), float32 throughout."""
    d, ff = shape.d_model, shape.d_ff
    column, row, replicated = P("data", "model"), P("model", "data"), P()
    per_layer = (("attn_norm", (d,), replicated), ("q", (d, d), column), ("k", (d, d), column),
                 ("v", (d, d), column), ("o", (d, d), row), ("mlp_norm", (d,), replicated),
                 ("up", (d, ff), column), ("gate", (d, ff), column), ("down", (ff, d), row))
    params = [(("embed",), (shape.vocab, d), row)]
    for layer in range(shape.layers):
        params += [((f"layer_{layer:02d}", name), dims, spec) for name, dims, spec in per_layer]
    params.append((("final_norm",), (d,), replicated))
    f32 = np.dtype(np.float32)
    return [Leaf(prefix + path, dims, f32, spec)
            for prefix in (("params",), ("opt_state", "mu"), ("opt_state", "nu"))
            for path, dims, spec in params]


def many_layout(count: int = MANY_COUNT) -> list[Leaf]:
    """``count`` leaves of 1 to 8 KiB in nested layers (the "10k" tree)."""
    leaves = []
    for i in range(count):
        top = "params" if i % 2 == 0 else "opt_state"
        path = (top, f"layer_{i // MANY_PER_LAYER:03d}", f"w_{i:05d}")
        rows = 8 << (i // 4 % 4)  # 8..64, not in step with the 4 shardings
        leaves.append(Leaf(path, (rows, MANY_COLS), np.dtype(SMALL_DTYPES[i % 3]), SMALL_SPECS[i % 4]))
    return leaves


def training_layout(total_mib: int) -> list[Leaf]:
    """The array leaves for a training state of ``total_mib`` logical MiB."""
    leaves = []
    for i in range(SMALL_COUNT):
        dtype = np.dtype(SMALL_DTYPES[i % 3])
        rows = (4096 << (i % 9)) // dtype.itemsize // 128
        leaves.append(Leaf(_path("small", i), (rows, 128), dtype, SMALL_SPECS[i % 4]))
    left = total_mib * MiB - sum(leaf.nbytes for leaf in leaves)
    i = 0
    while left >= MiB:
        dtype = np.dtype(LARGE_DTYPES[i % len(LARGE_DTYPES)])
        want = LARGE_MIB[i % len(LARGE_MIB)] * MiB
        if left - want < 64 * MiB:  # the last large leaf takes the remainder
            want = left
        rows = max(8, want // dtype.itemsize // COLS // 8 * 8)
        leaves.append(Leaf(_path("big", i), (rows, COLS), dtype, LARGE_SPECS[i % len(LARGE_SPECS)]))
        left -= leaves[-1].nbytes
        i += 1
    return leaves


def _path(kind: str, i: int) -> tuple[str, str]:
    return ("params" if i % 2 == 0 else "opt_state", f"{kind}_{i:02d}")


def _nest(items) -> dict:
    tree: dict = {}
    for path, value in items:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def host_values(leaf: Leaf, seed) -> np.ndarray:
    """Deterministic weight-like data for one leaf, generated in place."""
    n = int(np.prod(leaf.shape))
    bits = np.random.default_rng(seed).bit_generator.random_raw(-(-leaf.nbytes // 8))
    if leaf.dtype.itemsize == 4:
        u = bits.view(np.uint32)[:n]
        if leaf.dtype == np.float32:  # sign | exponent 120..123 | mantissa
            u &= np.uint32(0x81FF_FFFF)
            u |= np.uint32(120 << 23)
    else:
        u = bits.view(np.uint16)[:n]
        if leaf.dtype == ml_dtypes.bfloat16:
            u &= np.uint16(0x81FF)
            u |= np.uint16(120 << 7)
    return u.view(leaf.dtype).reshape(leaf.shape)


def build(size: int | str = 1024, seed: int = 0) -> dict:
    """The concrete sharded tree (blocks until every array is on its devices)."""
    m = mesh()
    items = []
    for k, leaf in enumerate(layout(size)):
        host = host_values(leaf, (seed, k))
        items.append((leaf.path, jax.make_array_from_callback(leaf.shape, NamedSharding(m, leaf.spec),
                                                              lambda index, host=host: host[index])))
        del host
    replicated = NamedSharding(m, P())
    items.append((("step",), jax.device_put(np.int32(1000 + seed), replicated)))
    items.append((("rng",), jax.device_put(jax.random.key(seed), replicated)))
    return jax.block_until_ready(_nest(items))


def abstract(size: int | str = 1024) -> dict:
    """The same tree as ``jax.ShapeDtypeStruct`` leaves carrying the shardings."""
    m = mesh()
    items = [(leaf.path, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(m, leaf.spec)))
             for leaf in layout(size)]
    replicated = NamedSharding(m, P())
    key_dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype
    items.append((("step",), jax.ShapeDtypeStruct((), np.int32, sharding=replicated)))
    items.append((("rng",), jax.ShapeDtypeStruct((), key_dtype, sharding=replicated)))
    return _nest(items)


def is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _data_shape(x):
    """x itself, or the shape and dtype of its key data when x holds PRNG keys."""
    return jax.eval_shape(jax.random.key_data, x) if is_key(x) else x


def nbytes(tree) -> int:
    """Logical bytes (replicas once; a key counts its key data)."""
    total = 0
    for x in map(_data_shape, jax.tree.leaves(tree)):
        total += int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    return total


def device_bytes(tree) -> int:
    """Bytes held on the devices: every replica counted (arrays or abstract arrays with shardings)."""
    total = 0
    for x in jax.tree.leaves(tree):
        data = _data_shape(x)
        shard = x.sharding.shard_shape(data.shape[:len(x.shape)]) + data.shape[len(x.shape):]
        total += len(x.sharding.device_set) * int(np.prod(shard)) * np.dtype(data.dtype).itemsize
    return total


def leaf_digests(tree) -> dict[str, str]:
    """{keypath: 'dtype(shape):crc32'} of each leaf's global bytes (keys: of their key data)."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        label = f"{x.dtype}{tuple(x.shape)}"
        data = np.ascontiguousarray(jax.device_get(jax.random.key_data(x) if is_key(x) else x))
        out[jax.tree_util.keystr(path)] = f"{label}:{zlib.crc32(data.reshape(-1).view(np.uint8)):08x}"
    return out


def digest(tree) -> str:
    """One hex string for the whole tree: structure, dtypes, shapes and bytes."""
    text = "\n".join(f"{k}={v}" for k, v in leaf_digests(tree).items())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Print the leaf inventory of one of the benchmarks' trees.")
    ap.add_argument("size", nargs="?", type=parse_size, default=1024, help="MiB, 10k, tf1g or tf4g")
    state = build(ap.parse_args().size)
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        print(f"{jax.tree_util.keystr(path):42s} {str(x.shape):>14s} {str(x.dtype):>10s} "
              f"{str(x.sharding.spec):>22s}")
    print(f"{len(jax.tree.leaves(state))} leaves, {nbytes(state) / MiB:.1f} MiB logical, digest {digest(state)}")
