"""Save a small sharded training state with dispatch_io, look at it, restore it twice.

    python examples/save_restore.py [CHECKPOINT_DIR]      # default: ./demo_ckpt/step_100
    scripts/demo [CHECKPOINT_DIR]

Runs on 8 simulated CPU devices, so it needs no accelerator. The state is a 3-layer MLP
(weights split over a 4x2 ('data', 'model') mesh), Adam-like moments, a PRNG key and a step.
It is restored onto the same shardings and onto a 2x4 mesh, and checked bit for bit.
"""

import os
import sys

# Before jax is imported: expose 8 CPU devices.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import humanize  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import dispatch_io as dio  # noqa: E402


def make_state(mesh):
    """Weights sharded over both mesh axes, biases over 'model', Adam-like moments, a replicated key."""
    shard = lambda *spec: NamedSharding(mesh, P(*spec))
    sizes, keys = [512, 1024, 1024, 256], jax.random.split(jax.random.key(0), 3)
    params = {f"layer{i}": {"w": jax.device_put(jax.random.normal(k, (n, m)) / np.sqrt(n), shard("data", "model")),
                            "b": jax.device_put(jnp.zeros(m, jnp.bfloat16), shard("model"))}
              for i, (k, n, m) in enumerate(zip(keys, sizes, sizes[1:]))}
    opt_state = {"mu": jax.tree.map(lambda p: 0.1 * p, params), "nu": jax.tree.map(jnp.square, params)}
    return {"params": params, "opt_state": opt_state, "rng": jax.device_put(jax.random.key(1), shard()), "step": 100}


def like(state, mesh):
    """A restore target: every array's shape and dtype, with its PartitionSpec laid on ``mesh``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec))
                        if isinstance(x, jax.Array) else x, state)


def same_bits(a, b) -> bool:
    if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    if isinstance(a, jax.Array):
        return a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    return type(a) is type(b) and a == b


def main(path):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    state = make_state(mesh)
    size = lambda n: humanize.naturalsize(n, binary=True)
    ms = lambda s: humanize.precisedelta(s, minimum_unit="milliseconds", format="%0.0f")

    with dio.LocalDispatcher(host_memory_budget=16 << 20) as dispatcher:
        handle = dispatcher.save(path, state, overwrite=True)  # returns once the data is off the devices
        stats = handle.wait()                                  # durable and committed
        print(f"saved {len(jax.tree.leaves(state))} leaves, {size(stats.bytes_written)} to {path} "
              f"in {ms(stats.total_seconds)} ({stats.batches} batches through a {size(16 << 20)} budget)\n"
              f"  save() blocked {ms(stats.blocked_seconds)}; transfer {ms(stats.transfer_seconds)}, "
              f"write {ms(stats.write_seconds)}, commit {ms(stats.commit_seconds)}; "
              f"peak host memory {size(stats.peak_host_bytes)}")

        print("dio.metadata (reads only the manifest):")
        for keypath, leaf in jax.tree_util.tree_flatten_with_path(dio.metadata(path))[0]:
            print(f"  {jax.tree_util.keystr(keypath):34s} {leaf.dtype}{list(leaf.shape)}"
                  if isinstance(leaf, jax.ShapeDtypeStruct) else f"  {jax.tree_util.keystr(keypath):34s} {leaf!r}")

        for name, target_mesh in [("the same 4x2 mesh", mesh), ("a 2x4 mesh", jax.make_mesh((2, 4), ("data", "model")))]:
            restored = dispatcher.restore(path, like(state, target_mesh))
            if not all(jax.tree.leaves(jax.tree.map(same_bits, state, restored))):
                sys.exit(f"restore onto {name} is not bit-exact")
            w = restored["params"]["layer0"]["w"]
            print(f"restored onto {name}: bit-exact; params.layer0.w {w.shape} is held as "
                  f"{w.sharding.shard_shape(w.shape)} shards on mesh {dict(w.sharding.mesh.shape)}")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "./demo_ckpt/step_100")
