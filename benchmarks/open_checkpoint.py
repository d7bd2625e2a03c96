"""What opening a checkpoint costs: ``formats.open_checkpoint`` of the 10 000-leaf tree, in-process.

    .venv/bin/python benchmarks/open_checkpoint.py [--reps 15] [--root /tmp/dispatch_io_open] [--keep] [--profile]

Saves the ``"10k"`` tree of ``benchmarks/tree.py`` once (8 forced CPU devices), then opens it
``--reps`` times (after one warm-up open) and prints the median and range of the wall time
(and the median CPU time of the process, all threads: steadier on a busy machine). An
open reads ``manifest.json``, parses and checks it (``dispatch_io.validate``) and checks each
stored array's ``zarr.json``: what ``restore``, ``verify`` and ``metadata`` do before they plan.
``--keep`` leaves the checkpoint under ``--root`` and opens one already there instead of saving
(to compare checkouts on the same bytes: ``PYTHONPATH=<checkout>``, one run after the other).
``--profile`` prints the top of a cProfile of one more open. The machine running it may be
shared: compare runs made one after the other.
"""

import tree as bt  # noqa: I001  (first: sets XLA_FLAGS for 8 CPU devices before jax is imported)

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import time

import dispatch_io as dio
from dispatch_io.formats import detect as formats


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--root", default="/tmp/dispatch_io_open")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    path = os.path.join(a.root, "10k")
    if not (a.keep and os.path.exists(path)):
        shutil.rmtree(a.root, ignore_errors=True)
        with dio.LocalDispatcher(host_memory_budget=256 << 20) as d:
            d.save(path, bt.build(bt.MANY)).wait()
    formats.open_checkpoint(path)  # warm: imports, the PRNG impl's key data shape, thread pools
    times, cpu = [], []
    for _ in range(a.reps):
        start, start_cpu = time.perf_counter(), time.process_time()
        opened = formats.open_checkpoint(path)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    stored = {leaf.stored.stored.name for leaf in opened.manifest.leaves if leaf.stored is not None}
    print(f"open_checkpoint of {len(opened.manifest.leaves)} leaves ({len(stored)} stored arrays): "
          f"median {statistics.median(times) * 1e3:.0f} ms [{min(times) * 1e3:.0f}-{max(times) * 1e3:.0f}] "
          f"over {a.reps}; CPU median {statistics.median(cpu) * 1e3:.0f} ms")
    if a.profile:
        profile = cProfile.Profile()
        profile.runcall(formats.open_checkpoint, path)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
    if not a.keep:
        shutil.rmtree(a.root, ignore_errors=True)


if __name__ == "__main__":
    main()
