"""Checkpoint save / restore benchmark: dispatch_io (and Orbax, when importable) against the
machine's own limits, on the synthetic training state of benchmarks/tree.py.

    python benchmarks/bench.py --size-mib 1024 --budget-mib 256 --reps 3 --out bench_out/

Every measurement runs in a fresh subprocess (this script with ``--child MODE``), so peak RSS
belongs to one mode. Modes are interleaved inside each repetition (save, async, restore,
restore_warm for each system, then the limits), because this VM's memory speed drifts: memory
freed a few seconds ago goes back to the host and is slow to touch again. ``--settle`` seconds
of idle before every timed call make each one start on cold memory (consistent, slower).

A child warms up on a small tree (imports, thread pools), builds the tree, then times two calls
with the same adapter: "1st call" (first-use costs) and the steady call, reported as wall, GB/s
and blocked. "peak RSS +" is VmHWM over both calls (reset with clear_refs) minus the RSS before
the first (the baseline harness's method); "steady peak +" is the same within the steady call.

  save          save + wait until durable and committed
  async         every leaf LOW priority except ``step``; blocked = time inside save()
  restore       page cache dropped first (cold), onto the original shardings, digest-checked
  restore_warm  the same with the checkpoint files in the page cache
  limits        one file of the same byte count: numpy tofile + fsync, then a cold read into a
                touched buffer; each after the settle time ("cold memory") and again right
                after the previous run freed memory ("warm memory")

GB/s = logical tree bytes (replicas once) / 1e9 / wall seconds.
"""

import tree as bt  # noqa: I001  (first: sets XLA_FLAGS for 8 CPU devices before jax is imported)

import argparse
import dataclasses
import gc
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

import dispatch_io as dio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30
MODES = ("save", "async", "restore", "restore_warm")


# ---- adapters: one per system --------------------------------------------------------------------

class DispatchIO:
    """dispatch_io.LocalDispatcher with the given host memory budget; one dispatcher per process."""

    name = "dispatch_io"
    dispatcher_cls = dio.LocalDispatcher

    def __init__(self, budget: int):
        self.dispatcher = self.dispatcher_cls(host_memory_budget=budget)

    def save(self, tree, path):
        return self.dispatcher.save(path, tree).wait()

    def save_async(self, tree, path):
        only_step_sync = lambda keypath, spec: dio.Priority.SYNC if keypath == "['step']" else dio.Priority.LOW
        return self.dispatcher.save(path, tree, priority=only_step_sync).wait

    def restore(self, abstract, path):
        return self.dispatcher.restore(path, abstract)

    def close(self):
        self.dispatcher.close()


class DispatchIOColocated(DispatchIO):
    """dispatch_io.ColocatedDispatcher (colocated_python, in-process on the CPU devices here)."""

    name = "dispatch_io_colocated"
    dispatcher_cls = dio.ColocatedDispatcher


class Orbax:
    """orbax.checkpoint.StandardCheckpointer with its defaults (optional: never a dependency)."""

    name = "orbax"

    def __init__(self, budget: int):
        import orbax.checkpoint as ocp
        self.checkpointer = ocp.StandardCheckpointer()

    def save(self, tree, path):
        self.checkpointer.save(os.path.abspath(path), tree)
        self.checkpointer.wait_until_finished()

    def save_async(self, tree, path):
        self.checkpointer.save(os.path.abspath(path), tree)
        return self.checkpointer.wait_until_finished

    def restore(self, abstract, path):
        return self.checkpointer.restore(os.path.abspath(path), abstract)

    def close(self):
        self.checkpointer.close()


SYSTEMS = {"dispatch_io": DispatchIO, "dispatch_io_colocated": DispatchIOColocated, "orbax": Orbax}


def available_systems() -> list[str]:
    out = ["dispatch_io", "dispatch_io_colocated"]
    try:
        importlib.metadata.version("orbax-checkpoint")
        import orbax.checkpoint  # noqa: F401
        out.append("orbax")
    except Exception as exc:  # noqa: BLE001
        print(f"note: orbax-checkpoint not importable ({type(exc).__name__}); skipping the Orbax rows")
    return out


# ---- process and page cache helpers ------------------------------------------------------------

def drop_caches() -> bool:
    """sync, then drop the page cache; False when the kernel refuses (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def disk_usage(path) -> tuple[int, int]:
    """(bytes, files) under path."""
    size = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            size += os.lstat(os.path.join(root, name)).st_size
            files += 1
    return size, files


def code_version() -> str:
    """git HEAD of the repository, and a digest of the library sources as they are now (they may be
    uncommitted): the run is flagged when it changes while the benchmark runs."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    sources = hashlib.sha256()
    for folder in ("dispatch_io", "workers"):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                with open(os.path.join(ROOT, folder, name), "rb") as f:
                    sources.update(name.encode() + f.read())
    return f"{head.stdout.strip() or '?'}, sources {sources.hexdigest()[:10]}"


def remove(path):
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        os.remove(path)


# ---- children -------------------------------------------------------------------------------------

def child_digest(a):
    state = bt.build(a.size_mib)
    return {"digest": bt.digest(state), "nbytes": bt.nbytes(state)}


def child_system(a):
    system = SYSTEMS[a.system](a.budget_mib << 20)
    warm = a.path.rstrip("/") + ".warmup"  # imports, thread pools, first calls on a ~6 MiB tree
    remove(warm)
    system.save(bt.build(0, seed=1), warm)
    jax.block_until_ready(system.restore(bt.abstract(0), warm))
    remove(warm)

    abstract = bt.abstract(a.size_mib)
    state = bt.build(a.size_mib) if a.child in ("save", "async") else None
    calls = []
    for call in range(2):  # call 0 pays first-use costs; call 1 is the steady state reported
        if a.child in ("save", "async"):
            remove(a.path)
        elif a.child == "restore":
            drop_caches()
        gc.collect()
        time.sleep(a.settle)
        rss = status_bytes("VmRSS")
        reset_peak_rss()
        out = stats = blocked = None
        t0 = time.perf_counter()
        if a.child == "save":
            stats = system.save(state, a.path)
        elif a.child == "async":
            wait = system.save_async(state, a.path)
            blocked = time.perf_counter() - t0
            stats = wait()
        else:
            out = jax.block_until_ready(system.restore(abstract, a.path))
        calls.append({"wall": time.perf_counter() - t0, "blocked": blocked, "rss_before": rss,
                      "peak_rss": status_bytes("VmHWM"),
                      "stats": dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else None})
        if call == 0:
            del out
    system.close()
    first, steady = calls
    res = {"first_wall": first["wall"], "wall": steady["wall"], "first_blocked": first["blocked"],
           "blocked": steady["blocked"], "calls": calls, "nbytes": bt.nbytes(abstract),
           # over both calls, as the baseline harness measures it, and within the steady call
           "peak_over_before": max(c["peak_rss"] for c in calls) - first["rss_before"],
           "steady_peak_over_before": steady["peak_rss"] - steady["rss_before"]}
    if a.child in ("save", "async"):
        res["disk_bytes"], res["files"] = disk_usage(a.path)
    else:
        res["digest"] = bt.digest(out)
    return res


def child_limits(a):
    """tofile + fsync and a cold read of one file holding the tree's byte count."""
    n = bt.nbytes(bt.abstract(a.size_mib))
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
    return res


def child_main(a):
    if a.child == "digest":
        res = child_digest(a)
    elif a.child == "limits":
        res = child_limits(a)
    else:
        res = child_system(a)
    print("RESULT " + json.dumps(res), flush=True)


# ---- driver ---------------------------------------------------------------------------------------

def run_child(a, mode, system="-", path="-"):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--system", system, "--path", path,
           "--size-mib", str(a.size_mib), "--budget-mib", str(a.budget_mib), "--settle", str(a.settle)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        tail = p.stderr.strip().splitlines()[-15:]
        print(f"  FAILED {system} {mode} (rc={p.returncode}):\n    " + "\n    ".join(tail), flush=True)
        return {"error": "\n".join(tail)}
    res = json.loads(lines[-1][len("RESULT "):])
    res["process_seconds"] = time.perf_counter() - t0
    return res


def stat(values, fmt="{:.2f}") -> str:
    """'median [min-max]' of the values that are not None; '-' if there are none."""
    v = [x for x in values if x is not None]
    if not v:
        return "-"
    if len(v) == 1:
        return fmt.format(v[0])
    return f"{fmt.format(statistics.median(v))} [{fmt.format(min(v))}-{fmt.format(max(v))}]"


def table(results, systems) -> str:
    head = ["system", "mode", "runs", "1st call s", "wall s", "GB/s", "blocked s", "peak RSS +GiB", "steady peak +GiB",
            "files", "verified"]
    rows = []
    for system in systems:
        for mode in MODES:
            rs = [r for r in results if (r["system"], r["mode"]) == (system, mode)]
            ok = [r for r in rs if "error" not in r]
            col = lambda key, scale=1.0: [r[key] / scale if r.get(key) is not None else None for r in ok]
            verified = "-" if not any("verified" in r for r in ok) else (
                "yes" if all(r.get("verified") for r in ok) else "NO")
            rows.append([system, mode, f"{len(ok)}/{len(rs)}", stat(col("first_wall")), stat(col("wall")),
                         stat([r["nbytes"] / 1e9 / r["wall"] for r in ok]), stat(col("blocked"), "{:.3f}"),
                         stat(col("peak_over_before", GiB)), stat(col("steady_peak_over_before", GiB)),
                         stat(col("files"), "{:.0f}"), verified])
    runs = sum(r["mode"] == "limits" for r in results)
    limits = [r for r in results if r["mode"] == "limits" and "error" not in r]
    read_ok = "yes" if all(r["read_ok"] for r in limits) else "NO"
    for key, label in (("write_fsync", "write+fsync"), ("read_cold", "read cold")):
        for memory in ("cold", "warm"):
            ts = [r[f"{key}_{memory}"] for r in limits]
            rows.append(["limit", f"{label} ({memory} memory)", f"{len(limits)}/{runs}", "-", stat(ts),
                         stat([r["nbytes"] / 1e9 / t for r, t in zip(limits, ts)]), "-", "-", "-", "1",
                         read_ok if key == "read_cold" else "-"])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def main(a):
    systems = available_systems()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.root, exist_ok=True)
    versions = {p: importlib.metadata.version(p) for p in ("jax", "jaxlib", "tensorstore", "numpy")}
    can_drop = drop_caches()
    version = code_version()
    header = (f"dispatch_io {version}; {a.size_mib} MiB tree, dispatch_io budget {a.budget_mib} MiB, {a.reps} rep(s), settle {a.settle:g} s, "
              f"cpus={os.cpu_count()}, drop_caches={'works' if can_drop else 'NOT available (restore is warm)'}, "
              f"python {sys.version.split()[0]}, {versions}")
    print(header, flush=True)
    ref = run_child(a, "digest")
    results = []
    for rep in range(a.reps):
        for system in systems:
            ckpt = os.path.join(a.root, f"{system}-{a.size_mib}")
            for mode in MODES:
                path = ckpt + "-async" if mode == "async" else ckpt
                if mode in ("save", "async"):
                    remove(path)
                drop_caches() if mode != "restore_warm" else os.sync()
                r = run_child(a, mode, system, path)
                if "digest" in r:
                    r["verified"] = r.pop("digest") == ref.get("digest")
                if mode == "async":
                    remove(path)
                r.update(system=system, mode=mode, rep=rep)
                results.append(r)
                print(f"  rep {rep} {system} {mode}: " + ", ".join(
                    f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                    if k in ("first_wall", "wall", "blocked", "peak_over_before", "steady_peak_over_before", "files",
                              "verified", "error")),
                    flush=True)
            remove(ckpt)
        drop_caches()
        r = run_child(a, "limits", path=os.path.join(a.root, "limits"))
        r.update(system="limit", mode="limits", rep=rep)
        results.append(r)
        print(f"  rep {rep} limits: " + ", ".join(f"{k}={v:.3g}" for k, v in r.items() if isinstance(v, float)),
              flush=True)

    if code_version().split("sources ")[1] != version.split("sources ")[1]:  # commits of other files are fine
        header += f"\n\nWARNING: dispatch_io changed during the run (now {code_version()}); rows mix versions"
    md = (f"{header}\n\n{table(results, systems)}\n\nmedian [min-max] over reps; GB/s = logical bytes "
          f"({ref.get('nbytes', 0) / 1e9:.3f} GB) / 1e9 / wall s; peak RSS +GiB = VmHWM over both calls - RSS "
          f"before them (baseline method); steady peak = VmHWM during the steady call - RSS just before it\n")
    print("\n" + md)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = os.path.join(a.out, f"bench-{a.size_mib}MiB-{stamp}")
    with open(base + ".json", "w") as f:
        json.dump({"args": vars(a), "header": header, "reference": ref, "results": results, "table": md}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(md)
    print(f"wrote {base}.json and {base}.md")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="logical size of the tree")
    ap.add_argument("--budget-mib", type=int, default=256, help="dispatch_io host memory budget")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--settle", type=float, default=10.0, help="idle seconds before each timed call")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--root", default="/tmp/dispatch_io_bench", help="where checkpoints are written")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--system", default="-", help=argparse.SUPPRESS)
    ap.add_argument("--path", default="-", help=argparse.SUPPRESS)
    return ap.parse_args()


if __name__ == "__main__":
    args = parse_args()
    child_main(args) if args.child else main(args)
