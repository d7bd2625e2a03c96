"""The many-leaves case: what a tree of 10 000 small leaves costs before any byte moves.

    python benchmarks/many_leaves.py plan [--leaves 10000] [--saves 4]
    python benchmarks/many_leaves.py open [--reps 15] [--root /tmp/dispatch_io_open] [--keep] [--profile]
    python benchmarks/many_leaves.py plan --quick      # (or open --quick): seconds, that it runs

(Its save and restore walls are rows of ``benchmarks/compare.py --sizes 10k``.)

``plan``: saves a tree of ``--leaves`` 8x8 float32 leaves over four shardings of a 4x2 mesh
(37 500 chunks at 10 000) ``--saves`` times to ``memory://`` and prints
``SaveStats.plan_seconds``: everything ``save()`` does before the first copy (plan lookup or
build, priorities, batching). The first save plans; the later ones reuse the cached plan and
its batches (targets: <= 1 s first, <= 50 ms cached).

``open``: saves the ``"10k"`` tree of ``benchmarks/tree.py`` once, then times
``formats.open_checkpoint`` of it ``--reps`` times after one warm-up open: the median and range
of the wall time and the median CPU time of the process (all threads: steadier on a busy
machine). An open reads ``manifest.json``, parses and checks it (``dispatch_io.validate``) and
checks each stored array's ``zarr.json``: what ``restore``, ``verify`` and ``metadata`` do
before they plan. ``--keep`` leaves the checkpoint under ``--root`` and opens one already there
instead of saving (to compare checkouts on the same bytes: ``PYTHONPATH=<checkout>``, one run
after the other); ``--profile`` prints the top of a cProfile of one more open.
"""

import tree as bt  # noqa: I001  (first: sets XLA_FLAGS for 8 CPU devices before jax is imported)

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio

try:
    from dispatch_io.formats.detect import open_checkpoint as open_it
except ImportError:   # a checkout before formats/ was a package (35c4b1c): compared with --keep
    from dispatch_io.formats import open_checkpoint as open_it
from harness import median_range


def plan(a):
    """The planning cost of the first save of a many-leaves tree and of the cached ones."""
    mesh = bt.mesh()
    specs = [P("data", "model"), P("data"), P(), P(None, "model")]
    tree = {f"layer{i:05d}": jax.device_put(jnp.full((8, 8), i, jnp.float32), NamedSharding(mesh, specs[i % 4]))
            for i in range(a.leaves)}
    with dio.LocalDispatcher(host_memory_budget=64 << 20) as d:
        for k in range(a.saves):
            stats = d.save(f"memory://planning-bench/{k}", tree).wait()
            print(f"save {k}: plan {stats.plan_seconds * 1e3:7.1f} ms  cached={stats.plan_cached}  "
                  f"(whole save {stats.total_seconds:.1f} s, {stats.batches} batches)", flush=True)


def open_checkpoint(a):
    """The wall and CPU time of opening the saved 10k tree."""
    path = os.path.join(a.root, "10k")
    if not (a.keep and os.path.exists(path)):
        shutil.rmtree(a.root, ignore_errors=True)
        with dio.LocalDispatcher(host_memory_budget=256 << 20) as d:
            d.save(path, bt.build(bt.MANY)).wait()
    open_it(path)  # warm: imports, the PRNG impl's key data shape, thread pools
    times, cpu = [], []
    for _ in range(a.reps):
        start, start_cpu = time.perf_counter(), time.process_time()
        opened = open_it(path)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    stored = {leaf.stored.stored.name for leaf in opened.manifest.leaves if leaf.stored is not None}
    ms = lambda values: [v * 1e3 for v in values]  # noqa: E731
    print(f"open_checkpoint of {len(opened.manifest.leaves)} leaves ({len(stored)} stored arrays): "
          f"median [min-max] {median_range(ms(times), '{:.0f}')} ms over {a.reps}; "
          f"CPU median {statistics.median(ms(cpu)):.0f} ms")
    if a.profile:
        profile = cProfile.Profile()
        profile.runcall(open_it, path)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
    if not a.keep:
        shutil.rmtree(a.root, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("job", choices=("plan", "open"))
    ap.add_argument("--leaves", type=int, default=10_000, help="plan: leaves of the tree")
    ap.add_argument("--saves", type=int, default=4, help="plan: saves (the first plans)")
    ap.add_argument("--reps", type=int, default=15, help="open: timed opens")
    ap.add_argument("--root", default="/tmp/dispatch_io_open", help="open: where the checkpoint is")
    ap.add_argument("--keep", action="store_true", help="open: keep the checkpoint, or open the one there")
    ap.add_argument("--profile", action="store_true", help="open: a cProfile of one more open")
    ap.add_argument("--quick", action="store_true", help="plan: 500 leaves, 2 saves; open: 3 reps")
    a = ap.parse_args()
    if a.quick:
        a.leaves, a.saves, a.reps = 500, 2, 3
    plan(a) if a.job == "plan" else open_checkpoint(a)


if __name__ == "__main__":
    main()
