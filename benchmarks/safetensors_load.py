"""Loading a Hugging Face safetensors set onto a 4x2 mesh: dispatch_io vs load_file + device_put.

    python benchmarks/safetensors_load.py [--gib 1] [--files 3] [--budget-mib 256] [--reps 1]

Writes a set of ``--files`` shards (float32 / bfloat16 matrices, about ``--gib`` GiB in all, with
``model.safetensors.index.json``) with the real ``safetensors.numpy.save_file``, then, in a fresh
child process per measurement (8 simulated CPU devices, page cache of the files dropped first; the systems
interleaved), restores it onto the (4, 2) mesh, every matrix sharded ``P("data", "model")``:

* ``dispatch_io``: ``LocalDispatcher(host_memory_budget=budget).restore(folder, target)``
* ``load_file``: ``safetensors.numpy.load_file`` of each file, then ``jax.device_put`` onto the
  same shardings (what users do today)

Prints one row per system: wall seconds (median over reps) and peak RSS growth (VmHWM over the RSS
before the load, first rep).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import harness
from harness import ROOT, MiB, interleaved, median_range


def child(system: str, folder: str, budget: int):
    """One load (a fresh process: 8 CPU devices, the files' page cache dropped first): its
    seconds, the peak RSS over the RSS before it, and the bytes loaded, as a RESULT line."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    jax.block_until_ready(jax.device_put(np.zeros((8, 8), np.float32), sharding))
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)["weight_map"]
    for name in sorted(set(index.values())):   # drop the files' page cache: a cold read
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    before = harness.status_bytes("VmRSS")
    started = time.perf_counter()
    if system == "dispatch_io":
        import dispatch_io as dio
        meta = dio.metadata(folder)
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in meta.items()}
        with dio.LocalDispatcher(host_memory_budget=budget, progress=False) as d:
            out = d.restore(folder, target)
    else:
        from safetensors.numpy import load_file
        out = {}
        for name in sorted(set(index.values())):
            host = load_file(os.path.join(folder, name))
            out.update(jax.device_put(host, {k: sharding for k in host}))
            del host
    jax.block_until_ready(out)
    harness.emit(seconds=time.perf_counter() - started, peak_rss=harness.status_bytes("VmHWM") - before,
                 bytes=sum(x.nbytes for x in out.values()))


def write_set(folder: str, gib: float, files: int):
    """``gib`` GiB of 64 MiB matrices (float32 4096x4096, bfloat16 8192x4096, alternating) in
    ``files`` shards, and the index."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    count = max(1, round(gib * 16))
    weight_map = {}
    for f in range(files):
        name = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        tensors = {}
        for i in range(f, count, files):
            dtype = np.float32 if i % 2 == 0 else ml_dtypes.bfloat16
            rows = 4096 if dtype == np.float32 else 8192
            tensors[f"model.layers.{i}.w"] = rng.standard_normal((rows, 4096), np.float32).astype(dtype)
        save_file(tensors, os.path.join(folder, name))
        weight_map.update({k: name for k in tensors})
        del tensors
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as out:
        json.dump({"metadata": {}, "weight_map": weight_map}, out)


def measure(system: str, folder: str, budget: int) -> dict:
    """One :func:`child` run of ``system`` (raises if it fails)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT}
    result = harness.run_child([sys.executable, __file__, "--child", system, folder, str(budget)], 1800, system, env)
    if "error" in result:
        raise SystemExit(f"{system} failed: {result['error']}")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--files", type=int, default=3)
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--root", default=tempfile.gettempdir())
    parser.add_argument("--quick", action="store_true", help="that it runs: 1/8 GiB in 2 files, 1 rep")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], int(args.child[2]))
    if args.quick:
        args.gib, args.files, args.reps = 0.125, 2, 1
    with tempfile.TemporaryDirectory(dir=args.root, prefix="safetensors_bench_") as folder:
        write_set(folder, args.gib, args.files)
        results = {s: [] for s in ("dispatch_io", "load_file")}
        for _, system in interleaved(args.reps, results):
            results[system].append(measure(system, folder, args.budget_mib * MiB))
    print(f"| system | load s (median [min-max] of {args.reps}) | GB/s (median) | peak RSS + (first rep) |")
    print("|---|---|---|---|")
    for system, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        label = f"dispatch_io (budget {args.budget_mib} MiB)" if system == "dispatch_io" else \
            "safetensors.numpy.load_file + jax.device_put"
        print(f"| {label} | {median_range([r['seconds'] for r in runs])} | {runs[0]['bytes'] / seconds / 1e9:.2f} | "
              f"{runs[0]['peak_rss'] / MiB:.0f} MiB (data {runs[0]['bytes'] / MiB:.0f} MiB) |")


if __name__ == "__main__":
    main()
