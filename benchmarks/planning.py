"""Planning cost for a tree of many small leaves (issue-6 target: <= 1 s first, <= 50 ms cached).

    .venv/bin/python benchmarks/planning.py [--leaves 10000] [--saves 4]

Saves the same 10 000-leaf tree (8x8 float32 leaves over four shardings of a 4x2 mesh: 37 500
chunks) several times to ``memory://`` and prints ``SaveStats.plan_seconds``: everything
``save()`` does before the first copy (plan lookup or build, priorities, batching). The first
save plans; the later ones reuse the cached plan and its batches.
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import dispatch_io as dio  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leaves", type=int, default=10_000)
    ap.add_argument("--saves", type=int, default=4)
    a = ap.parse_args()
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    specs = [P("data", "model"), P("data"), P(), P(None, "model")]
    tree = {f"layer{i:05d}": jax.device_put(jnp.full((8, 8), i, jnp.float32), NamedSharding(mesh, specs[i % 4]))
            for i in range(a.leaves)}
    with dio.LocalDispatcher(host_memory_budget=64 << 20) as d:
        for k in range(a.saves):
            stats = d.save(f"memory://planning-bench/{k}", tree).wait()
            print(f"save {k}: plan {stats.plan_seconds * 1e3:7.1f} ms  cached={stats.plan_cached}  "
                  f"(whole save {stats.total_seconds:.1f} s, {stats.batches} batches)", flush=True)


if __name__ == "__main__":
    main()
