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

Then one slow request (``--slow-reps``, 0: skipped), on GCS through the tests' fault proxy
(tests/servers/fault_proxy.py): save and restore with nothing slow, with one data upload or read accepted
and never answered, and with one read answered at 2 KiB/s (``--request-timeout``: the deadline
that abandons them, process-wide; hedged reads on); and the bytes a restore reads with hedged
reads on and off on a healthy store (the hedges' cost).
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
from dispatch_io.workers import deadlines  # noqa: E402
from gcs_server import FakeGcsServer, GcsPreconditions, gcs_environment  # noqa: E402
from fault_proxy import Fault, SlowProxy  # noqa: E402
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


def run_slow(tree, budget: int, reps: int, upstream_port: int) -> list[str]:
    """The lines of the slow-request cases' table (see the module's docstring), best of ``reps``."""
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    proxy = SlowProxy(upstream_port)
    os.environ.update(gcs_environment(proxy.endpoint))
    data = "/d/"   # OCDBT data files
    cases = {"save, nothing slow": (None, "save"), "save, 1 upload never answered": (("stall", "POST", 0), "save"),
             "restore, nothing slow": (None, "restore"),
             "restore, 1 read never answered": (("stall", "GET", 64 << 10), "restore"),
             "restore, 1 read at 2 KiB/s": (("trickle", "GET", 64 << 10), "restore")}
    times: dict[str, list[float]] = {name: [] for name in cases}
    read_bytes = {}
    try:
        with dio.LocalDispatcher(host_memory_budget=budget) as d:
            path = "gs://bench/slow/ckpt"
            d.save(path, tree, overwrite=True).wait()
            for _ in range(reps):
                for name, (fault, kind) in cases.items():
                    if fault is not None:
                        proxy.add(Fault(fault[0], fault[1], data, min_bytes=fault[2]))
                    started = time.perf_counter()
                    if kind == "save":
                        d.save(path, tree, overwrite=True).wait()
                    else:
                        jax.block_until_ready(d.restore(path, target))
                    times[name].append(time.perf_counter() - started)
                    with proxy.lock:
                        proxy.faults.clear()
            for hedging in (False, True):
                with dio.LocalDispatcher(host_memory_budget=budget, hedge_reads=hedging) as plain:
                    proxy.reset_counts()
                    jax.block_until_ready(plain.restore(path, target))
                    read_bytes[hedging] = proxy.bytes_sent.get("GET", 0)
    finally:
        proxy.stop()
    extra = read_bytes[True] / max(read_bytes[False], 1) - 1
    return [f"\nOne slow request, GCS through the fault proxy, best of {reps}", "| case | seconds |", "|---|---|",
            *(f"| {name} | {min(values):.2f} |" for name, values in times.items()),
            f"\nhealthy restore: {read_bytes[False]} bytes read without hedged reads, {read_bytes[True]} with "
            f"({100 * extra:+.2f} %)"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--slow-reps", type=int, default=1)
    parser.add_argument("--request-timeout", type=float, default=20.0)
    args = parser.parse_args()
    deadlines.configure(args.request_timeout)   # before the first request of this process
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
            slow = run_slow(tree, budget, args.slow_reps, layer.port) if args.slow_reps else []
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
    print("\n".join(slow))


if __name__ == "__main__":
    main()
