"""dispatch_io on one accelerator: save / restore beside Orbax and JAX's serialization, the
machine's limits, and a training step beside a save. One command, a few minutes on one GPU:

    python benchmarks/gpu.py --out gpu_out/                 # 8 GiB state, checkpoints on /dev/shm
    python benchmarks/gpu.py --size-mb 64 --reps 1          # a small run (also on CPU)
    python benchmarks/gpu.py --quick --out /tmp/q           # seconds on CPU: every code path, tiny

The state (``--size-mb``, default 8192) lives on this process's first device: leaves from 1 MiB
to 1 GiB (``gpu_targets.leaf_sizes``: one of each size that fits, the rest 1 GiB ones; float32
and bfloat16, random bits: NaN payloads included) -- those under a save batch are moved as whole
shards, larger ones split on the device -- 16 small leaves of 4 to 64 KiB (float32 / bfloat16 /
int32), an int32 ``step`` and a threefry PRNG key (stored as its key_data by the peers, which do
not all take typed keys). The same seed gives the same bytes, made on the device.

Systems (``--systems``), interleaved within each of ``--reps`` repetitions, each measurement in
a fresh subprocess (its peak RSS is its own):

  dispatch_io            LocalDispatcher() with its defaults
  dispatch_io_colocated  ColocatedDispatcher() (the Pathways path; colocated_python in-process)
  orbax                  orbax.checkpoint.StandardCheckpointer (its defaults: OCDBT, zarr2, zstd)
  orbax_raw              Orbax PyTreeCheckpointHandler with zarr3 and no compression
  jax_serialization      jax.experimental.array_serialization GlobalAsyncCheckpointManager

A child first saves and restores a warm-up state of the host budget's size (imports, threads,
compiles, and XLA's pinned host pool grown to what a save holds; its time is ``warm_s``), then
times, in order: ``save`` twice (the first after the warm-up: within 20 % of the second is a
target), ``async`` (every leaf but ``step`` LOW priority for dispatch_io; the peers'
async save: blocked = time in the call, wall = until durable), ``sync`` (dispatch_io: a default
save, every leaf SYNC: blocked = time in ``save()``), ``restore`` onto the original shardings,
checked bit for bit against the state on the device. GB/s = state bytes / 1e9 / seconds; "peak
RSS +" = VmHWM (reset before each call) minus the RSS before it, the worst call of a child.

Limits (a child of their own): device -> host into ``pinned_host`` memory (first call: it
allocates; then steady) and pageable (``copy_to_host_async`` + ``np.asarray``), host -> device
from pageable numpy and from pinned arrays, storage writes of ``--limit-mb`` through 1..N threads
(N: the CPUs this process may use), TensorStore's own write of the state's host copy (zarr3, one
array per leaf, all at once). Then the training step: a jitted step of 4 ``--step-n``-square
bfloat16 matmuls, its time alone and beside a LOW-priority save of each of dispatch_io and Orbax
(median, max, and how long the save call blocked). Rows that mean nothing on CPU devices (the
device <-> host link, the step) say "n/a on cpu".

Writes ``results.json`` and ``results.md`` (the tables and a one-line verdict against issue 43's
targets: ``gpu_targets.verdict``) to ``--out``. ``--quick`` (a tiny state, dispatch_io only,
pinned transfers forced, a 256-square step) runs on CPU in seconds; the suite runs it
(tests/test_gpu_benchmark.py) so this script cannot rot.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

MiB = 1 << 20
SYSTEMS = ("dispatch_io", "dispatch_io_colocated", "orbax", "orbax_raw", "jax_serialization")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_targets import leaf_sizes, verdict  # noqa: E402 - benchmarks/ is no package


# ---- measuring -------------------------------------------------------------------------------

def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise KeyError(field)


def timed(fn):
    """(result, seconds, peak RSS growth in bytes) of ``fn()``: VmHWM reset first (clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_bytes("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, status_bytes("VmHWM") - before


def host_cpus() -> int:
    return len(os.sched_getaffinity(0))


# ---- the state -------------------------------------------------------------------------------

def make_state(size_mb: int, seed: int = 0):
    """The benchmark state on this process's first device (module doc); deterministic."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    kinds = [(jnp.float32, jnp.uint32), (jnp.bfloat16, jnp.uint16)]

    def bits(index, shape, dtype, word):
        make = jax.jit(lambda k: jax.lax.bitcast_convert_type(jax.random.bits(k, shape, word), dtype),
                       out_shardings=jax.sharding.make_single_device_sharding(device))
        return make(jax.random.key(seed * 1000 + index))

    state = {"params": {}, "opt_state": {}}
    for i, size in enumerate(leaf_sizes(size_mb * MiB)):
        dtype, word = kinds[i % 2]
        cols = 4096 if size >= 4096 * 64 else 256
        rows = max(1, size // (cols * jnp.dtype(dtype).itemsize))
        state["params" if i % 2 == 0 else "opt_state"][f"w{i:02d}"] = bits(i, (rows, cols), dtype, word)
    small = [(jnp.float32, jnp.uint32), (jnp.bfloat16, jnp.uint16), (jnp.int32, jnp.uint32)]
    for i in range(16):
        dtype, word = small[i % 3]
        nbytes = 4096 << (i % 5)
        state["params"][f"s{i:02d}"] = bits(100 + i, (nbytes // jnp.dtype(dtype).itemsize,), dtype, word)
    state["step"] = jax.device_put(jnp.int32(1234), device)
    state["rng"] = jax.device_put(jax.random.key(seed), device)
    jax.block_until_ready(state)
    return state


def state_bytes(state) -> int:
    import jax
    return sum((jax.random.key_data(x) if is_key(x) else x).nbytes for x in jax.tree.leaves(state))


def is_key(x) -> bool:
    import jax
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def abstract_of(state):
    import jax
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def bit_equal_on_device(a, b) -> bool:
    """Whether two trees hold the same bits, compared on the device (no host copy of either)."""
    import jax
    import jax.numpy as jnp

    def same(x, y):
        if is_key(x) or is_key(y):
            x, y = (jax.random.key_data(v) if is_key(v) else v for v in (x, y))
        if x.shape != y.shape or x.dtype != y.dtype:
            return jnp.bool_(False)
        word = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(x.dtype).itemsize]
        return jnp.all(jax.lax.bitcast_convert_type(x, word) == jax.lax.bitcast_convert_type(y, word))

    fa, ta = jax.tree_util.tree_flatten(a)
    fb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(bool(same(x, y)) for x, y in zip(fa, fb))


def keys_as_data(tree):
    import jax
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def keys_back(tree, like):
    """``keys_as_data`` undone (the state's key has the default impl)."""
    import jax
    return jax.tree.map(lambda x, ref: jax.random.wrap_key_data(x) if is_key(ref) else x, tree, like)


# ---- the systems -------------------------------------------------------------------------------
# save(tree, path); save_async(tree, path) -> wait(); save_sync(tree, path) -> wait() (dispatch_io
# only); restore(abstract, path) -> tree.

def low_but_step(keypath, spec):
    import dispatch_io as dio
    return dio.Priority.SYNC if keypath == "['step']" else dio.Priority.LOW


class DispatchIO:
    def __init__(self, colocated: bool = False, host_transfer: str = "auto"):
        import dispatch_io as dio
        options = {} if colocated else {"host_transfer": host_transfer}
        self.d = (dio.ColocatedDispatcher if colocated else dio.LocalDispatcher)(progress=False, **options)

    def save(self, tree, path):
        self.d.save(path, tree).wait()

    def save_async(self, tree, path):
        return self.d.save(path, tree, priority=low_but_step).wait

    def save_sync(self, tree, path):
        return self.d.save(path, tree).wait

    def restore(self, abstract, path):
        return self.d.restore(path, abstract)

    def close(self):
        self.d.close()


class Orbax:
    def __init__(self, raw: bool = False):
        import orbax.checkpoint as ocp
        self.ocp, self.raw = ocp, raw
        self.c = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False)) \
            if raw else ocp.StandardCheckpointer()

    def save(self, tree, path):
        self.save_async(tree, path)()

    def save_async(self, tree, path):
        tree = keys_as_data(tree)
        if self.raw:
            self.c.save(path, args=self.ocp.args.PyTreeSave(tree))
        else:
            self.c.save(path, tree)
        return self.c.wait_until_finished

    def restore(self, abstract, path):
        target = keys_as_data_abstract(abstract)
        if self.raw:
            args = self.ocp.checkpoint_utils.construct_restore_args(target)
            out = self.c.restore(path, args=self.ocp.args.PyTreeRestore(target, restore_args=args))
        else:
            out = self.c.restore(path, target)
        return keys_back(out, abstract)

    def close(self):
        self.c.close()


def keys_as_data_abstract(abstract):
    import jax
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jax.eval_shape(jax.random.key_data, a).shape, "uint32",
                                                       sharding=a.sharding) if is_key(a) else a, abstract)


class JaxSerialization:
    def __init__(self):
        from jax.experimental.array_serialization import serialization
        self.ser, self.m = serialization, serialization.GlobalAsyncCheckpointManager()

    def _specs(self, tree, path):
        import jax
        names = [".".join(str(getattr(k, "key", k)) for k in kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        return [self.ser.get_tensorstore_spec(os.path.join(path, n)) for n in names]

    def save(self, tree, path):
        self.save_async(tree, path)()

    def save_async(self, tree, path):
        import jax
        self.m.serialize(jax.tree.leaves(keys_as_data(tree)), self._specs(tree, path), on_commit_callback=lambda: None)
        return self.m.wait_until_finished

    def restore(self, abstract, path):
        import jax
        flat, treedef = jax.tree.flatten(keys_as_data_abstract(abstract))
        out = self.m.deserialize([a.sharding for a in flat], self._specs(abstract, path),
                                 [a.shape for a in flat], [a.dtype for a in flat])
        return keys_back(jax.tree.unflatten(treedef, out), abstract)

    def close(self):
        self.m.wait_until_finished()


def make_system(name: str, host_transfer: str = "auto"):
    return {"dispatch_io": lambda: DispatchIO(host_transfer=host_transfer),
            "dispatch_io_colocated": lambda: DispatchIO(colocated=True),
            "orbax": lambda: Orbax(), "orbax_raw": lambda: Orbax(raw=True),
            "jax_serialization": JaxSerialization}[name]()


# ---- children ----------------------------------------------------------------------------------

def child_system(a) -> dict:
    """Every timed call of one system on the state (module doc)."""
    import jax
    state = make_state(a.size_mb)
    nbytes = state_bytes(state)
    system = make_system(a.system, a.host_transfer)
    root = os.path.join(a.root, a.system)
    fresh = lambda name: (shutil.rmtree(os.path.join(root, name), ignore_errors=True), os.path.join(root, name))[1]  # noqa: E731
    out = {"system": a.system, "bytes": nbytes, "platform": jax.devices()[0].platform}
    budget = system.d.options.host_memory_budget if isinstance(system, DispatchIO) else 1 << 30
    out["budget"] = budget
    # The warm-up: a state of the budget's size (at most the state's), so XLA's pinned host pool
    # has grown to what a save holds before anything is timed.
    warm = make_state(max(1, min(a.size_mb, budget // MiB)), seed=1)
    _, out["warm_s"], _ = timed(lambda: system.save(warm, fresh("warm")))
    jax.block_until_ready(system.restore(abstract_of(warm), os.path.join(root, "warm")))
    del warm
    shutil.rmtree(os.path.join(root, "warm"), ignore_errors=True)
    rss = []
    for n in (1, 2):
        _, seconds, peak = timed(lambda: system.save(state, fresh("ckpt")))
        out[f"save{n}_s"] = seconds
        rss.append(peak)
    path = fresh("async")
    (wait, blocked, peak) = timed(lambda: system.save_async(state, path))
    _, rest, peak2 = timed(wait)
    out["async_blocked_s"], out["async_wall_s"] = blocked, blocked + rest
    rss += [peak, peak2]
    if hasattr(system, "save_sync"):
        path = fresh("sync")
        wait, blocked, peak = timed(lambda: system.save_sync(state, path))
        wait()
        out["sync_blocked_s"] = blocked
        rss.append(peak)
    restored, seconds, peak = timed(lambda: jax.block_until_ready(system.restore(abstract_of(state),
                                                                                 os.path.join(root, "ckpt"))))
    out["restore_s"], out["restore_rss"] = seconds, peak
    out["bit_exact"] = bit_equal_on_device(state, restored)
    out["save_rss"] = max(rss)
    system.close()
    shutil.rmtree(root, ignore_errors=True)
    return out


def child_limits(a) -> dict:
    """The machine's limits (module doc)."""
    import jax
    import numpy as np
    import tensorstore as ts

    state = make_state(a.size_mb)
    big = [x for x in jax.tree.leaves(state) if not is_key(x) and x.nbytes >= MiB]
    nbytes = sum(x.nbytes for x in big)
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    out = {"platform": device.platform, "device": str(device.device_kind), "cpus": host_cpus(), "bytes": nbytes}

    def gbs(seconds, n=nbytes):
        return n / 1e9 / seconds

    if on_cpu:
        for key in ("d2h_pinned_first", "d2h_pinned", "d2h_pageable", "h2d_pageable", "h2d_pinned"):
            out[key] = "n/a on cpu"
    else:
        def to_pinned():
            return jax.block_until_ready([jax.device_put(x, x.sharding.with_memory_kind("pinned_host")) for x in big])
        _, s, _ = timed(to_pinned)
        out["d2h_pinned_first"] = gbs(s)
        pinned, s, _ = timed(to_pinned)
        out["d2h_pinned"] = gbs(s)
        copies = jax.block_until_ready([x + 0 for x in big])  # fresh arrays: nothing cached on the state

        def pageable():
            for c in copies:
                c.copy_to_host_async()
            return [np.asarray(c) for c in copies]
        host, s, _ = timed(pageable)
        out["d2h_pageable"] = gbs(s)
        del copies
        _, s, _ = timed(lambda: jax.block_until_ready([jax.device_put(h, device) for h in host]))
        out["h2d_pageable"] = gbs(s)
        _, s, _ = timed(lambda: jax.block_until_ready([jax.device_put(p, p.sharding.with_memory_kind("device"))
                                                       for p in pinned]))
        out["h2d_pinned"] = gbs(s)
        del pinned, host
    # storage writes: --limit-mb of bytes in files, through k threads
    total = min(a.limit_mb * MiB, nbytes)
    buffer = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    folder = os.path.join(a.root, "limits")
    threads = sorted({1, 2, 4, 8, 16, host_cpus()} & set(range(1, host_cpus() + 1))) or [1]
    for k in threads:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        parts = np.array_split(buffer, k)

        def write(i):
            with open(os.path.join(folder, f"f{i}"), "wb") as f:
                f.write(parts[i].data)
                os.fsync(f.fileno())
        with concurrent.futures.ThreadPoolExecutor(k) as pool:
            _, s, _ = timed(lambda: list(pool.map(write, range(k))))
        out[f"write_{k}_threads"] = gbs(s, total)
    # TensorStore's own write: zarr3, one array per leaf, all at once
    hosts = [np.asarray(jax.device_get(x)) for x in big]
    shutil.rmtree(folder, ignore_errors=True)
    context = ts.Context({"file_io_concurrency": {"limit": 2 * host_cpus()}})

    def ts_write():
        stores = [ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(folder, f"a{i}")},
                           "metadata": {"shape": h.shape, "data_type": str(h.dtype) if h.dtype.name != "bfloat16"
                                        else "bfloat16"}}, create=True, context=context).result()
                  for i, h in enumerate(hosts)]
        for f in [s.write(h) for s, h in zip(stores, hosts)]:
            f.result()
    _, s, _ = timed(ts_write)
    out["tensorstore_write"] = gbs(s)
    shutil.rmtree(folder, ignore_errors=True)
    return out


def child_step(a) -> dict:
    """A training step alone and beside a LOW-priority save of dispatch_io and of Orbax."""
    import jax
    import jax.numpy as jnp

    state = make_state(a.size_mb)
    n = a.step_n
    keys = jax.random.split(jax.random.key(5), 5)
    ws = [jax.random.normal(k, (n, n), jnp.bfloat16) / n ** 0.5 for k in keys[:4]]
    x = jax.random.normal(keys[4], (n, n), jnp.bfloat16)
    step = jax.jit(lambda ws, x: (x @ ws[0] @ ws[1] @ ws[2] @ ws[3]).astype(jnp.bfloat16))

    def steps(until=None, count=50):
        times, y = [], x
        while len(times) < count or (until is not None and not until.is_set()):
            t0 = time.perf_counter()
            y = step(ws, y)
            y.block_until_ready()
            times.append(time.perf_counter() - t0)
        return times

    steps(count=10)
    out = {"alone": summary(steps())}
    for name in [s for s in ("dispatch_io", "orbax") if s in a.systems.split(",")]:
        system = make_system(name, a.host_transfer)
        path = os.path.join(a.root, "step", name)
        shutil.rmtree(path, ignore_errors=True)
        system.save(make_state(max(1, min(a.size_mb, 1024)), seed=1), path + "-warm")   # grows the pinned pool
        done = threading.Event()
        t0 = time.perf_counter()
        wait = system.save_async(state, path)
        blocked = time.perf_counter() - t0
        waiter = threading.Thread(target=lambda: (wait(), done.set()))
        waiter.start()
        times = steps(until=done, count=10)
        waiter.join()
        out[name] = {**summary(times), "save_blocked_s": blocked, "save_wall_s": time.perf_counter() - t0}
        system.close()
        shutil.rmtree(os.path.join(a.root, "step"), ignore_errors=True)
    out["platform"] = jax.devices()[0].platform
    return out


def summary(times) -> dict:
    return {"median_ms": 1e3 * statistics.median(times), "max_ms": 1e3 * max(times), "steps": len(times)}


# ---- the parent --------------------------------------------------------------------------------

def run_child(a, kind: str, system: str = "-") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--system", system,
           "--size-mb", str(a.size_mb), "--root", a.root, "--limit-mb", str(a.limit_mb), "--step-n", str(a.step_n),
           "--systems", a.systems, "--host-transfer", a.host_transfer]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"system": system, "error": f"timed out after {a.timeout} s"}
    if done.returncode != 0:
        return {"system": system, "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else
                f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def cell(values, fmt="{:.2f}") -> str:
    values = [v for v in values if isinstance(v, (int, float))]
    return " / ".join(fmt.format(v) for v in values) if values else "-"


def system_table(runs: dict) -> str:
    lines = ["| system | save GB/s (1st, steady; per rep) | restore GB/s | async blocked / wall (s) | SYNC blocked (s) "
             "| peak RSS + save / restore (MiB) | bit-exact on device |", "|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            lines.append(f"| {name} | {rs[0]['error']} | | | | | |")
            continue
        gb = ok[0]["bytes"] / 1e9
        save = " ; ".join(f"{gb / r['save1_s']:.2f}, {gb / r['save2_s']:.2f}" for r in ok)
        lines.append(
            f"| {name} | {save} | {cell([gb / r['restore_s'] for r in ok])} "
            f"| {cell([r['async_blocked_s'] for r in ok], '{:.3f}')} / {cell([r['async_wall_s'] for r in ok])} "
            f"| {cell([r.get('sync_blocked_s') for r in ok], '{:.3f}')} "
            f"| {cell([r['save_rss'] / MiB for r in ok], '{:.0f}')} / {cell([r['restore_rss'] / MiB for r in ok], '{:.0f}')} "
            f"| {all(r['bit_exact'] for r in ok)} |")
    return "\n".join(lines)


def value_table(title: str, values: dict, unit: str) -> str:
    lines = [f"| {title} | {unit} |", "|---|---|"]
    lines += [f"| {k} | {v if isinstance(v, str) else f'{v:.2f}'} |" for k, v in values.items()]
    return "\n".join(lines)


def step_table(step: dict) -> str:
    step = {k: v for k, v in step.items() if k != "platform"}
    lines = ["| training step | median ms | max ms | steps | save blocked (ms) | save wall (s) |", "|---|---|---|---|---|---|"]
    for name, s in step.items():
        if "error" in s:
            lines.append(f"| {name} | {s['error']} | | | | |")
            continue
        extra = f"{1e3 * s['save_blocked_s']:.1f} | {s['save_wall_s']:.2f}" if "save_blocked_s" in s else " | "
        lines.append(f"| {name if name == 'alone' else 'beside ' + name} | {s['median_ms']:.2f} | {s['max_ms']:.2f} "
                     f"| {s['steps']} | {extra} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=8192, help="state size in MiB")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--root", default="/dev/shm/dispatch_io_gpu", help="where checkpoints are written (tmpfs)")
    ap.add_argument("--out", default="gpu_out")
    ap.add_argument("--limit-mb", type=int, default=4096, help="bytes of the storage-write limit runs")
    ap.add_argument("--step-n", type=int, default=8192, help="matrix size of the training step")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one child may run")
    ap.add_argument("--skip", default="", help="comma list of: limits, step")
    ap.add_argument("--host-transfer", default="auto", choices=("auto", "pinned", "pageable"),
                    help="dispatch_io's Options.host_transfer (auto: pinned on accelerators)")
    ap.add_argument("--quick", action="store_true",
                    help="seconds on CPU: a 24 MiB state, dispatch_io only, pinned forced, 256-square step")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--system", default="-", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick and not a.child:
        a.size_mb, a.reps, a.systems, a.limit_mb, a.step_n = 24, 1, "dispatch_io", 8, 256
        a.host_transfer, a.timeout = "pinned", 300.0
    a.root = os.path.abspath(a.root)   # Orbax takes absolute paths only
    if a.child:
        child = {"system": child_system, "limits": child_limits, "step": child_step}[a.child]
        print(json.dumps(child(a)))
        return
    skip = set(filter(None, a.skip.split(",")))
    systems = [s for s in a.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; known: {SYSTEMS}")
    os.makedirs(a.out, exist_ok=True)
    runs: dict = {s: [] for s in systems}
    for rep in range(a.reps):
        for s in systems:   # interleaved: drift of the machine hits every system alike
            r = run_child(a, "system", s)
            runs[s].append(r)
            print(f"rep {rep} {s}: {r}", file=sys.stderr, flush=True)
    limits = {} if "limits" in skip else run_child(a, "limits")
    step = {} if "step" in skip else run_child(a, "step")
    budget = next((r["budget"] for r in runs.get("dispatch_io", []) if "budget" in r), 1 << 30)
    line, checks = verdict(runs, step if "error" not in step else {}, budget)
    if step.get("platform", limits.get("platform")) == "cpu":
        line = line.replace("verdict:", "verdict (on cpu: the targets are one H200's):", 1)
    results = {"args": vars(a), "runs": runs, "limits": limits, "step": step, "verdict": line,
               "checks": {k: list(v) for k, v in checks.items()}}
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    platform = next((r["platform"] for rs in runs.values() for r in rs if "platform" in r), "?")
    parts = [f"# dispatch_io on {limits.get('device', platform)} ({platform}, {limits.get('cpus', host_cpus())} CPUs), "
             f"state {a.size_mb} MiB, "
             f"{a.reps} interleaved reps, checkpoints in {a.root}", system_table(runs)]
    if limits:
        parts.append(value_table("limit", {k: v for k, v in limits.items() if k not in ("platform", "device", "bytes", "cpus")},
                                 "GB/s"))
    if step:
        parts.append(step_table(step) if "error" not in step else f"training step: {step['error']}")
    parts.append(line)
    text = "\n\n".join(parts) + "\n"
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
