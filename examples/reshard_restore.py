"""Save a training state on a 4x2 mesh; restore it on a 2x4 mesh and on one device from rules.

    python examples/reshard_restore.py [CHECKPOINT_DIR]      # default: ./demo_ckpt/reshard

Runs on 8 simulated CPU devices, so it needs no accelerator. The restore targets are never
written by hand: ``dio.sharding.infer`` reads the saved shapes and dtypes (``dio.metadata``)
and a few ordered rules, matched against slash key paths such as ``params/layer0/w``, pick
each leaf's PartitionSpec on whatever mesh the restore runs on. Every restore is checked bit
for bit, and the chosen specs are printed.
"""

import os
import sys

# Before jax is imported: expose 8 CPU devices.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import dispatch_io as dio  # noqa: E402
from dispatch_io.sharding import fsdp, replicate, shard  # noqa: E402

# First match wins; leaves no rule matches (the biases, 'step') stay replicated.
RULES = [
    (r"^rng$", replicate()),
    (r"^params/.*/w$", [fsdp("data", min_bytes=64 << 10), fsdp("model", min_bytes=64 << 10)]),
    (r"^opt_state/.*/w$", fsdp(("data", "model"), min_bytes=64 << 10)),   # moments over every device
    (r"^dropout_keys$", shard("data")),                                      # PRNG keys: logical dims
]


def make_state(mesh):
    """An MLP whose weights are split over both mesh axes, Adam-like moments, PRNG keys, a step."""
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    sizes, keys = [256, 512, 512, 128], jax.random.split(jax.random.key(0), 3)
    params = {f"layer{i}": {"w": put(jax.random.normal(k, (n, m)) / np.sqrt(n), "data", "model"),
                            "b": put(jnp.zeros(m, jnp.bfloat16), "model")}
              for i, (k, n, m) in enumerate(zip(keys, sizes, sizes[1:]))}
    opt_state = {"mu": jax.tree.map(lambda p: 0.1 * p, params), "nu": jax.tree.map(jnp.square, params)}
    return {"params": params, "opt_state": opt_state, "rng": put(jax.random.key(1)),
            "dropout_keys": put(jax.random.split(jax.random.key(2), 8), "data"), "step": 100}


def same_bits(a, b) -> bool:
    if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    if isinstance(a, jax.Array):
        return a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    return type(a) is type(b) and a == b


def main(path):
    state = make_state(jax.make_mesh((4, 2), ("data", "model")))
    meshes = {"a 2x4 mesh": jax.make_mesh((2, 4), ("data", "model")),
              "one device": jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])}
    with dio.LocalDispatcher(host_memory_budget=4 << 20) as dispatcher:
        dispatcher.save(path, state, overwrite=True).wait()
        print(f"saved {len(jax.tree.leaves(state))} leaves on a 4x2 ('data', 'model') mesh to {path}")

        abstract = dio.metadata(path)
        restored = {}
        for name, mesh in meshes.items():
            restored[name] = dispatcher.restore(path, dio.sharding.infer(abstract, mesh, RULES))
            if not all(jax.tree.leaves(jax.tree.map(same_bits, state, restored[name]))):
                sys.exit(f"restore onto {name} is not bit-exact")
            print(f"restored onto {name}: bit-exact")

    print(f"\n{'key path (opt_state/nu as mu)':30s} {'shape':11s} {'spec':27s} {'shard on 2x4':13s} on one device")
    flat = {name: jax.tree_util.tree_flatten_with_path(tree)[0] for name, tree in restored.items()}
    for (keypath, x), (_, y) in zip(*flat.values()):
        name = jax.tree_util.keystr(keypath, simple=True, separator="/")
        if isinstance(x, jax.Array) and not name.startswith("opt_state/nu/"):
            print(f"{name:30s} {str(x.shape):11s} {str(x.sharding.spec):27s} "
                  f"{str(x.sharding.shard_shape(x.shape)):13s} {y.sharding.shard_shape(y.shape)}")

    try:  # a rule that cannot hold is refused before anything is read, naming each leaf
        dio.sharding.infer(abstract, meshes["a 2x4 mesh"], [(r"^params/.*/w$", [shard("data"), fsdp("data", min_bytes=0)])])
    except ValueError as e:
        print(f"\nrefused: {e}")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "./demo_ckpt/reshard")
