"""Checkpoint save / restore benchmark: dispatch_io against Orbax, JAX's own array serialization
and the machine's limits, on the synthetic trees of benchmarks/tree.py, with the targets checked.

    python benchmarks/compare.py --sizes 256,1024,4096,10k --budget-mib 256 --budgets-mib 64,256,1024 \\
        --reps 3 --out bench_out/
    python benchmarks/compare.py --quick          # a minute: that it runs end to end

Sizes (``--sizes``): the training state of benchmarks/tree.py at each logical size in MiB,
``10k``, a tree of 10 000 leaves of 1 to 8 KiB (about 31 MiB), and ``tf1g`` / ``tf4g``, a
transformer's params + Adam mu / nu (465 / 519 float32 leaves, 1 / 4 GiB).

Systems, in this order inside each repetition of each size:

  dispatch_io            LocalDispatcher(host_memory_budget=--budget-mib)
  dispatch_io_files      the same with layout="files", one file per chunk (skipped with a
                         note where the library does not take that option)
  dispatch_io_colocated  ColocatedDispatcher (colocated_python, in-process on the CPU devices)
  dispatch_io_zstd       LocalDispatcher(compression="zstd"): zstd level 3 chunks (compare its
                         "disk GB" column with dispatch_io's)
  dispatch_io_fewfiles   LocalDispatcher(data_file_bytes=None): one OCDBT data file per batch
                         (the fewest files) instead of files of 16 MiB written in parallel
  orbax                  orbax.checkpoint.StandardCheckpointer with its defaults
  orbax_limited          Orbax with its device->host and restore limits set to --budget-mib
                         (see OrbaxLimited for the knobs)
  dispatch_io_on_orbax   dispatch_io restoring a checkpoint Orbax wrote (its save row is Orbax's)
  jax_serialization      jax.experimental.array_serialization GlobalAsyncCheckpointManager
  dispatch_io@<B>MiB     extra dispatch_io save rows at each of --budgets-mib (a budget equal to
                         --budget-mib is the plain dispatch_io save row)

Orbax rows are skipped with a note when orbax-checkpoint is not importable. Every measurement
runs in a fresh subprocess (this script with ``--child MODE``), so peak RSS belongs to one mode,
and a child that runs past ``--timeout`` seconds is killed and reported as a timeout. Modes are
interleaved inside each repetition, because this VM's memory speed drifts: memory freed a few
seconds ago goes back to the host and is slow to touch again. ``--settle`` seconds of idle
before every timed call make each one start on cold memory (consistent, slower).

A child warms up on a small tree (imports, thread pools), builds the tree, then times two calls
with the same adapter: "1st call" (first-use costs) and the steady call, reported as wall, GB/s
and blocked. "peak RSS +" is VmHWM over both calls (reset with clear_refs) minus the RSS before
the first (the baseline harness's method); "steady peak +" is the same within the steady call.

  save          save + wait until durable and committed
  async         every leaf LOW priority except ``step``; blocked = time inside save()
  async_sync    dispatch_io systems only: every leaf SYNC; blocked = time inside save()
  restore       page cache dropped first (cold), onto the original shardings, digest-checked
  restore_warm  the same with the checkpoint files in the page cache
  limits        one file of the tree's byte count: numpy tofile + fsync, then a cold read into a
                touched buffer; and jax.device_get of the whole tree into host memory. Each after
                the settle time ("cold memory") and again right after the previous run freed
                memory ("warm memory")

GB/s = logical tree bytes (replicas once) / 1e9 / wall seconds. Systems with a host memory
budget get an RSS target: budget + 64 MiB for saves, restored bytes (every device replica) +
budget + 64 MiB for restores, met when the worst run's "peak RSS +" is within it.

Targets (the second table, from the medians of the same run, for each dispatch_io system):
save GB/s >= 3x Orbax's and >= 80% of write+fsync; cold restore GB/s >= 2.5x Orbax's and >= 70%
of the cold read; async blocked <= 20 ms; async_sync blocked <= one jax.device_get of the tree;
<= 20 files at 1 GiB besides one per data_file_bytes stored; 4 GiB wall / 1 GiB wall <= 4.4x for save and restore (tf4g / tf1g too);
a transformer-shaped tree saves at >= 90% of the GB/s of the training state of the same size
(1024 / 4096, when in --sizes); 10k saves and restores in <= 1.5 s. Limits are the cold-memory
ones, taken like the timed calls, after the settle time.
"""

import tree as bt  # noqa: I001  (first: sets XLA_FLAGS for 8 CPU devices before jax is imported)

import argparse
import dataclasses
import gc
import importlib.metadata
import os
import sys
import time

import jax
import numpy as np

import harness
from compare_report import report
from compare_systems import BASELINE_ENV, SAVE_MODES, SYSTEMS, DispatchIOBaseline, available_systems
from harness import MiB, drop_caches, remove, remove_checkpoint


# ---- children -------------------------------------------------------------------------------------

def child_digest(a):
    state = bt.build(a.size)
    return {"digest": bt.digest(state), "nbytes": bt.nbytes(state)}


def timed_call(system, mode, state, abstract, path) -> tuple[object, dict]:
    """One call of ``mode``: (the restored tree or None, its wall / blocked seconds and SaveStats)."""
    out = stats = blocked = None
    t0 = time.perf_counter()
    if mode == "save":
        stats = system.save(state, path)
    elif mode in ("async", "async_sync"):
        wait = system.save_async(state, path) if mode == "async" else system.save_async_sync(state, path)
        blocked = time.perf_counter() - t0
        stats = wait()
    else:
        out = jax.block_until_ready(system.restore(abstract, path))
    return out, {"wall": time.perf_counter() - t0, "blocked": blocked,
                 "stats": dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else None}


def warm_up(system, path):
    """Imports, thread pools and first calls, on a ~6 MiB tree."""
    warm = path.rstrip("/") + ".warmup"
    remove_checkpoint(warm)
    system.save(bt.build(0, seed=1), warm)
    jax.block_until_ready(system.restore(bt.abstract(0), warm))
    remove_checkpoint(warm)


def child_system(a):
    system = SYSTEMS[a.system](a.budget_mib * MiB)
    warm_up(system, a.path)
    abstract = bt.abstract(a.size)
    state = bt.build(a.size) if a.child in SAVE_MODES else None
    calls = []
    for call in range(2):  # call 0 pays first-use costs; call 1 is the steady state reported
        if a.child in SAVE_MODES:
            remove_checkpoint(a.path)
        elif a.child == "restore":
            drop_caches()
        gc.collect()
        time.sleep(a.settle)
        rss = harness.status_bytes("VmRSS")
        harness.reset_peak_rss()
        out, timing = timed_call(system, a.child, state, abstract, a.path)
        calls.append({**timing, "rss_before": rss, "peak_rss": harness.status_bytes("VmHWM")})
        if call == 0:
            del out
    system.close()
    first, steady = calls
    res = {"first_wall": first["wall"], "wall": steady["wall"], "first_blocked": first["blocked"],
           "blocked": steady["blocked"], "calls": calls, "nbytes": bt.nbytes(abstract),
           "device_bytes": bt.device_bytes(abstract),
           # over both calls, as the baseline harness measures it, and within the steady call
           "peak_over_before": max(c["peak_rss"] for c in calls) - first["rss_before"],
           "steady_peak_over_before": steady["peak_rss"] - steady["rss_before"]}
    if a.child in SAVE_MODES:
        res["disk_bytes"], res["files"] = harness.disk_usage(a.path)
    else:
        res["digest"] = bt.digest(out)
    return res


def uncached(tree):
    """The same device buffers in new jax.Array objects: jax.device_get caches its host copy on the
    array, so a second device_get of the same objects would copy nothing."""
    def fresh(x):
        if bt.is_key(x):
            return jax.random.wrap_key_data(jax.random.key_data(x), impl=jax.random.key_impl(x))
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, [s.data for s in x.addressable_shards])
    return jax.tree.map(fresh, tree)


def child_limits(a):
    """tofile + fsync and a cold read of one file holding the tree's byte count, and
    jax.device_get of the whole tree; each on cold memory, then on warm memory."""
    n = bt.nbytes(bt.abstract(a.size))
    data = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    into = np.ones(n, np.uint8)  # read target, touched
    path = a.path + ".bin"
    res = {"nbytes": n}

    def write():
        with open(path, "wb") as f:
            data.tofile(f)
            f.flush()
            os.fsync(f.fileno())

    def read():
        with open(path, "rb", buffering=0) as f:
            view, got = memoryview(into), 0
            while got < n:
                got += f.readinto(view[got:])

    for name, fn in (("write_fsync", write), ("read_cold", read)):
        for memory, idle in (("cold", a.settle), ("warm", 0)):
            drop_caches()
            time.sleep(idle)
            t0 = time.perf_counter()
            fn()
            res[f"{name}_{memory}"] = time.perf_counter() - t0
    res["read_ok"] = bool(np.array_equal(data, into))
    remove(path)
    del data, into

    state = bt.build(a.size)
    for memory, idle in (("cold", a.settle), ("warm", 0)):
        state = uncached(state)
        gc.collect()
        time.sleep(idle)
        t0 = time.perf_counter()
        host = jax.device_get(state)
        res[f"device_get_{memory}"] = time.perf_counter() - t0
        del host
    return res


def child_main(a):
    if a.child == "digest":
        res = child_digest(a)
    elif a.child == "limits":
        res = child_limits(a)
    else:
        res = child_system(a)
    harness.emit(**res)


# ---- driver ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Job:
    """One child run: ``label`` names its row (``system`` itself, or ``dispatch_io@64MiB``)."""

    system: str
    mode: str
    budget_mib: int
    label: str


def jobs_of(system: str, a) -> list[Job]:
    """A system's modes at --budget-mib, then for dispatch_io a save at each other --budgets-mib."""
    jobs = [Job(system, mode, a.budget_mib, system) for mode in SYSTEMS[system].modes
            if a.modes is None or mode in a.modes]
    if system == "dispatch_io":
        jobs += [Job(system, "save", b, f"{system}@{b}MiB") for b in a.budgets_mib if b != a.budget_mib]
    return jobs


def run_child(a, mode, size, system="-", path="-", budget_mib=None):
    """This script with --child in a new session; killed with its whole group after --timeout."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--system", system, "--path", path,
           "--size", str(size), "--budget-mib", str(budget_mib or a.budget_mib), "--settle", str(a.settle)]
    env = dict(os.environ)
    if system == DispatchIOBaseline.name:  # that checkout's packages first
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env[BASELINE_ENV], env.get("PYTHONPATH")]))
    return harness.run_child(cmd, a.timeout, f"{system} {mode} {size}", env)


def checkpoint_path(a, label: str, size) -> str:
    """Where a row's save writes and its restores read."""
    return os.path.join(a.root, f"{label}-{size}")


def run_job(a, job: Job, size, ref: dict, rep: int) -> dict:
    """One child for ``job``; async saves write beside the checkpoint the restores read, and are removed."""
    ckpt = checkpoint_path(a, job.label, size)
    path = f"{ckpt}-{job.mode}" if job.mode in ("async", "async_sync") else ckpt
    if job.mode in SAVE_MODES:
        remove_checkpoint(path)
    drop_caches() if job.mode != "restore_warm" else os.sync()
    r = run_child(a, job.mode, size, job.system, path, job.budget_mib)
    if "digest" in r:
        r["verified"] = r.pop("digest") == ref.get("digest")
    if path != ckpt:
        remove_checkpoint(path)
    return r


def run_system(a, system: str, size, ref: dict, rep: int) -> list[dict]:
    """One system's jobs at one size; its restores are skipped when the save they would read failed."""
    results, saved = [], True
    for job in jobs_of(system, a):
        if job.mode.startswith("restore") and not saved:
            r = {"error": "skipped: no checkpoint (its save failed)", "skipped": True}
        else:
            r = run_job(a, job, size, ref, rep)
        if (job.label, job.mode) == (system, "save"):
            saved = "error" not in r
        r.update(size=str(size), system=job.label, mode=job.mode, rep=rep, budget_mib=job.budget_mib)
        results.append(r)
        print(f"  {size} rep {rep} {job.label} {job.mode}: " + ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={str(v).splitlines()[-1]}" for k, v in r.items()
            if k in ("first_wall", "wall", "blocked", "peak_over_before", "steady_peak_over_before", "files",
                     "verified", "error")), flush=True)
    for label in {job.label for job in jobs_of(system, a)}:
        remove_checkpoint(checkpoint_path(a, label, size))
    return results


def run_size(a, size, systems) -> tuple[dict, list[dict]]:
    """(reference digest, runs) for one tree size: every system's jobs, then the limits, per rep."""
    ref = run_child(a, "digest", size)
    results = []
    for rep in range(a.reps):
        for system in systems:
            results += run_system(a, system, size, ref, rep)
        drop_caches()
        r = run_child(a, "limits", size, path=os.path.join(a.root, "limits"))
        r.update(size=str(size), system="limit", mode="limits", rep=rep)
        results.append(r)
        print(f"  {size} rep {rep} limits: " + ", ".join(f"{k}={v:.3g}" for k, v in r.items() if isinstance(v, float)),
              flush=True)
    return ref, results


def main(a):
    systems, notes = available_systems(a.systems)
    os.makedirs(a.root, exist_ok=True)
    versions = {p: importlib.metadata.version(p) for p in ("jax", "jaxlib", "tensorstore", "numpy")}
    can_drop = drop_caches()
    version = harness.code_version()
    header = (f"dispatch_io {version}; sizes {','.join(map(str, a.sizes))}, dispatch_io budget {a.budget_mib} MiB "
              f"(save rows also at {','.join(str(b) for b in a.budgets_mib if b != a.budget_mib) or 'no other'} MiB), {a.reps} rep(s), settle {a.settle:g} s, "
              f"child timeout {a.timeout:g} s, cpus={os.cpu_count()}, "
              f"drop_caches={'works' if can_drop else 'NOT available (restore is warm)'}, "
              f"python {sys.version.split()[0]}, {versions}")
    print(header, flush=True)
    refs, results = {}, []
    for size in a.sizes:
        refs[size], runs = run_size(a, size, systems)
        results += runs
    if harness.code_version().split("sources ")[1] != version.split("sources ")[1]:  # commits of other files are fine
        notes.append(f"WARNING: dispatch_io changed during the run (now {harness.code_version()}); rows mix versions")
    md = report(a, header, notes, refs, results, systems)
    print("\n" + md)
    harness.write_results(a.out, "compare", {"args": vars(a), "header": header, "notes": notes, "references": {str(k): v for k, v in refs.items()}, "results": results, "report": md}, md)


def comma_list(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sizes", type=comma_list(bt.parse_size), default="256,1024,4096,10k",
                    help="tree sizes: logical MiB of the training state, 10k (10 000 small leaves), "
                         "tf1g or tf4g (transformer-shaped)")
    ap.add_argument("--budget-mib", type=int, default=256, help="host memory budget of dispatch_io and orbax_limited")
    ap.add_argument("--budgets-mib", type=comma_list(int), default="64,256,1024",
                    help="extra dispatch_io save rows at these budgets")
    ap.add_argument("--systems", type=comma_list(str), default=",".join(SYSTEMS),
                    help=f"systems to run, of {','.join(SYSTEMS)}")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", type=comma_list(str), default=None,
                    help="only these modes of each system (default: all); the limits always run")
    ap.add_argument("--settle", type=float, default=10.0, help="idle seconds before each timed call")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds one child may run before it is killed")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--root", default="/tmp/dispatch_io_bench", help="where checkpoints are written")
    ap.add_argument("--baseline", help="another checkout of dispatch_io, run as the dispatch_io_baseline system")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--system", default="-", help=argparse.SUPPRESS)
    ap.add_argument("--path", default="-", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=bt.parse_size, default=1024, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true",
                    help="a check that it runs, not figures: a 64 MiB tree, 1 rep, no settle time, no extra budgets, "
                         "and (unless --systems) dispatch_io, orbax and jax_serialization")
    a = ap.parse_args()
    if a.quick:
        a.sizes, a.reps, a.settle, a.budgets_mib = [64], 1, 0.0, [a.budget_mib]
        if "--systems" not in sys.argv:
            a.systems = ["dispatch_io", "orbax", "jax_serialization"]
    unknown = set(a.systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; known: {','.join(SYSTEMS)}")
    if a.baseline:  # read by DispatchIOBaseline here and in every child
        os.environ[BASELINE_ENV] = os.path.abspath(a.baseline)
    return a


if __name__ == "__main__":
    args = parse_args()
    child_main(args) if args.child else main(args)
