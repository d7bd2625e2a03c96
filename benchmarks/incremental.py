"""Incremental saves: bytes and time of later saves against a full save, dense overhead, disk use.

    python benchmarks/incremental.py --reps 5 --out bench_out/incremental.json

Three measurements, each on jax arrays on the CPU devices of this process:

* ``lora``: a LoRA-shaped ~1 GiB state: a frozen base of 16 float32 matrices 4096 x 4096 (the
  same jax arrays at every step), rank-32 adapters A / B on each (1.6 % of the parameters) and
  Adam's mu / nu on them (new arrays every step). A full save (``incremental=False``) is timed
  against the second and later incremental saves of a run, interleaved.
* ``dense``: ~1 GiB of float32 leaves that all change every step: ``incremental=False`` against
  ``incremental=True`` (every chunk digested, none referenced), interleaved.
* ``retention``: 50 steps of a ~256 MiB LoRA-shaped state through
  ``CheckpointManager(keep_policy=LatestN(3), incremental=True)``: the root's disk use after
  each step against three steps' changed bytes plus one full copy.

Reported per row: median seconds and bytes written, and the ratios the targets are stated in.
The machine is shared: rows are interleaved inside each repetition and medians reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import dispatch_io as dio


def lora_state(layers: int, dim: int, rank: int, seed: int = 0):
    """(frozen base, a function of the step giving the trained part)."""
    key = jax.random.key(seed)
    base = {f"layer{i}": jax.random.normal(jax.random.fold_in(key, i), (dim, dim), jnp.float32) for i in range(layers)}

    def trained(step: int):
        k = jax.random.fold_in(key, 1000 + step)
        adapters = {f"layer{i}": {"a": jax.random.normal(jax.random.fold_in(k, 2 * i), (dim, rank)),
                                  "b": jax.random.normal(jax.random.fold_in(k, 2 * i + 1), (rank, dim))}
                    for i in range(layers)}
        return {"adapters": adapters, "mu": jax.tree.map(lambda x: x * 0.1, adapters),
                "nu": jax.tree.map(lambda x: x * x, adapters), "step": step}
    return base, trained


def dense_state(step: int, leaves: int = 16, dim: int = 4096):
    key = jax.random.fold_in(jax.random.key(1), step)
    return {f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (dim, dim), jnp.float32) for i in range(leaves)}


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def du(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    return total


def timed_save(d, path, tree, incremental):
    """(seconds, bytes written, plan seconds: planning, and with ``incremental`` the sampling,
    digests and decisions, before anything is copied)."""
    jax.block_until_ready(tree)
    t0 = time.perf_counter()
    stats = d.save(path, tree, incremental=incremental).wait()
    return time.perf_counter() - t0, stats.bytes_written, stats.plan_seconds


def bench_lora_and_dense(d, work: str, reps: int) -> dict:
    base, trained = lora_state(16, 4096, 32)
    rows = {k: [] for k in ("lora_full", "lora_incremental", "dense_plain", "dense_incremental")}
    lora_root, dense_root = os.path.join(work, "lora"), os.path.join(work, "dense")
    timed_save(d, os.path.join(lora_root, "0"), {"base": base, **trained(0)}, True)  # the run's first save
    timed_save(d, os.path.join(dense_root, "0"), dense_state(0), True)
    for rep in range(1, reps + 1):
        full = os.path.join(work, "full")
        rows["lora_full"].append(timed_save(d, full, {"base": base, **trained(rep)}, False))
        shutil.rmtree(full)
        rows["lora_incremental"].append(timed_save(d, os.path.join(lora_root, str(rep)),
                                                   {"base": base, **trained(rep)}, True))
        plain = os.path.join(work, "plain")
        rows["dense_plain"].append(timed_save(d, plain, dense_state(rep), False))
        shutil.rmtree(plain)
        rows["dense_incremental"].append(timed_save(d, os.path.join(dense_root, str(rep)), dense_state(rep), True))
        for root in (lora_root, dense_root):  # keep the newest two steps only: the disk is shared
            for old in sorted(map(int, os.listdir(root)))[:-2]:
                if old != 0 or root == dense_root:
                    shutil.rmtree(os.path.join(root, str(old)))
    out = {name: {"seconds": statistics.median(t for t, _, _ in r), "bytes_written": statistics.median(b for _, b, _ in r),
                  "plan_seconds": statistics.median(p for _, _, p in r), "all_seconds": [t for t, _, _ in r]}
           for name, r in rows.items()}
    out["lora_state_bytes"] = nbytes({"base": base, **trained(0)})
    out["lora_changed_bytes"] = nbytes(trained(0))
    out["lora_bytes_ratio"] = out["lora_incremental"]["bytes_written"] / out["lora_full"]["bytes_written"]
    out["lora_time_ratio"] = out["lora_incremental"]["seconds"] / out["lora_full"]["seconds"]
    out["dense_slowdown"] = out["dense_incremental"]["seconds"] / out["dense_plain"]["seconds"] - 1
    # The work incremental adds, all before the copies: less noisy than the difference of two totals.
    out["dense_added_seconds"] = out["dense_incremental"]["plan_seconds"] - out["dense_plain"]["plan_seconds"]
    out["dense_added_share"] = out["dense_added_seconds"] / out["dense_plain"]["seconds"]
    return out


def bench_retention(d, work: str, steps: int = 50) -> dict:
    base, trained = lora_state(4, 4096, 32, seed=2)
    root = os.path.join(work, "retention")
    full = nbytes({"base": base, **trained(0)})
    changed = nbytes(trained(0))
    usage = []
    with dio.CheckpointManager(root, d, keep_policy=dio.policies.LatestN(3), incremental=True) as mgr:
        for step in range(steps):
            mgr.save(step, {"base": base, **trained(step)})
            mgr.wait()
            usage.append(du(root))
        kept = mgr.all_steps()
    bound = 3 * changed + full
    return {"steps": steps, "kept": kept, "full_bytes": full, "changed_bytes_per_step": changed,
            "bound_bytes": bound, "final_bytes": usage[-1], "max_bytes": max(usage),
            "final_over_bound": usage[-1] / bound, "max_over_bound": max(usage) / bound}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--retention-steps", type=int, default=50)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="incremental-", dir=args.dir)
    try:
        with dio.LocalDispatcher(args.budget_mib << 20, progress=False) as d:
            result = {"saves": bench_lora_and_dense(d, work, args.reps),
                      "retention": bench_retention(d, work, args.retention_steps)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
