"""Save and restore of one training-state-shaped tree to a local directory, to S3 (moto) and to GCS
(fake-gcs-server behind the tests' precondition layer), all on loopback.

    python benchmarks/object_stores.py --size-mib 1024 --budget-mib 256 --reps 2

The emulators are not a cloud: they keep objects in memory on this machine, so the figures show
dispatch_io's overhead per request and per byte over HTTP (and the emulators' own), not a cloud's
bandwidth. The servers are the tests' (tests/servers/s3_server.py, tests/servers/gcs_server.py), started once;
each repetition saves over the last one (``overwrite=True``: its delete is timed too, as a
training job's retention would pay it), then restores onto the tree's shardings (timed, bytes
compared with the saved tree once). GCS is measured twice: through the precondition layer the
tests need (every byte passes through its Python HTTP server) and against the emulator alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "servers"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import dispatch_io as dio  # noqa: E402
from gcs_server import FakeGcsServer, GcsPreconditions, gcs_environment  # noqa: E402
from s3_server import MotoServer, s3_environment  # noqa: E402

MiB = 1 << 20


def make_tree(size_mib: int):
    """``size_mib`` of float32 in 64 leaves of 4 x 2 shards each, on 8 CPU devices."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    rows = size_mib * MiB // 64 // 4 // 1024
    rng = np.random.default_rng(0)
    return {f"w{i:02d}": jax.device_put(rng.standard_normal((rows, 1024), dtype=np.float32), sharding)
            for i in range(64)}


def run(where: str, tree, budget: int, reps: int) -> list[tuple[float, float]]:
    """(save s, restore s) of each repetition of a save + restore of ``tree`` under ``where``."""
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    times = []
    with dio.LocalDispatcher(host_memory_budget=budget) as d:
        for rep in range(reps):
            path = f"{where}/ckpt"   # replaced each time: the servers hold one copy
            started = time.perf_counter()
            d.save(path, tree, overwrite=True).wait()
            saved = time.perf_counter()
            restored = d.restore(path, target)
            jax.block_until_ready(restored)
            done = time.perf_counter()
            if rep == 0:
                assert all(np.array_equal(np.asarray(restored[k]), np.asarray(tree[k])) for k in tree)
            times.append((saved - started, done - saved))
            del restored
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    tree = make_tree(args.size_mib)
    moto = MotoServer()
    emulator = FakeGcsServer()
    layer = GcsPreconditions(emulator.port)
    try:
        os.environ.update(s3_environment(moto.endpoint))
        os.environ.update(gcs_environment(layer.endpoint))
        moto.create_bucket("bench")
        emulator.create_bucket("bench")
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as local:
            budget = args.budget_mib * MiB
            rows = {"local directory": run(local, tree, budget, args.reps),
                    "S3 (moto)": run("s3://bench/run", tree, budget, args.reps),
                    "GCS (fake-gcs-server + layer)": run("gs://bench/run", tree, budget, args.reps)}
            os.environ.update(gcs_environment(emulator.endpoint))
            rows["GCS (fake-gcs-server alone)"] = run("gs://bench/alone", tree, budget, args.reps)
    finally:
        layer.stop()
        emulator.stop()
        moto.stop()
    gib = args.size_mib / 1024
    print(f"{args.size_mib} MiB, budget {args.budget_mib} MiB, best of {args.reps}")
    print("| where | save s | save GB/s | restore s | restore GB/s |")
    print("|---|---|---|---|---|")
    for name, times in rows.items():
        save, restore = min(t[0] for t in times), min(t[1] for t in times)
        print(f"| {name} | {save:.2f} | {gib * 1.0737 / save:.2f} | {restore:.2f} | {gib * 1.0737 / restore:.2f} |")


if __name__ == "__main__":
    main()
