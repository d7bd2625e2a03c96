"""Checkpoint save / restore benchmark: dispatch_io against Orbax, JAX's own array serialization
and the machine's limits, on the synthetic trees of benchmarks/tree.py, with the targets checked.

    python benchmarks/bench.py --sizes 256,1024,4096,10k --budget-mib 256 --budgets-mib 64,256,1024 \\
        --reps 3 --out bench_out/

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
import glob
import hashlib
import importlib.metadata
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

import dispatch_io as dio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
GiB = 1 << 30
RSS_SLACK = 64 * MiB
SAVE_MODES = ("save", "async", "async_sync")
MODES = ("save", "async", "restore", "restore_warm")
DISPATCH_IO_MODES = ("save", "async", "async_sync", "restore", "restore_warm")
LIMITS = (("write_fsync", "write+fsync"), ("read_cold", "read cold"), ("device_get", "jax.device_get"))


def only_step_sync(keypath, spec):
    """dispatch_io priority for the async mode: ``step`` before save() returns, the rest LOW."""
    return dio.Priority.SYNC if keypath == "['step']" else dio.Priority.LOW


# ---- adapters: one per system --------------------------------------------------------------------

class DispatchIO:
    """dispatch_io.LocalDispatcher with the given host memory budget; one dispatcher per process."""

    name = "dispatch_io"
    dispatcher_cls = dio.LocalDispatcher
    options: dict = {}
    has_budget = True
    modes = DISPATCH_IO_MODES

    def __init__(self, budget: int):
        self.dispatcher = self.dispatcher_cls(host_memory_budget=budget, **self.options)

    @classmethod
    def missing(cls) -> str | None:
        """Why this system cannot run here, or None: the dispatcher must take its options."""
        if not cls.options:
            return None
        try:
            cls(64 * MiB).close()
        except TypeError as exc:
            return f"{cls.dispatcher_cls.__name__}(**{cls.options}) raised TypeError: {exc}"
        return None

    def save(self, tree, path):
        return self.dispatcher.save(path, tree).wait()

    def save_async(self, tree, path):
        return self.dispatcher.save(path, tree, priority=only_step_sync).wait

    def save_async_sync(self, tree, path):
        return self.dispatcher.save(path, tree, priority=lambda keypath, spec: dio.Priority.SYNC).wait

    def restore(self, abstract, path):
        return self.dispatcher.restore(path, abstract)

    def close(self):
        self.dispatcher.close()


class DispatchIOFiles(DispatchIO):
    """dispatch_io.LocalDispatcher(layout="files"): one file per chunk instead of OCDBT data files."""

    name = "dispatch_io_files"
    options = {"layout": "files"}


class DispatchIOZstd(DispatchIO):
    """dispatch_io.LocalDispatcher(compression="zstd"): the same save, chunks zstd-compressed."""

    name = "dispatch_io_zstd"
    options = {"compression": "zstd"}


class DispatchIOFewFiles(DispatchIO):
    """dispatch_io.LocalDispatcher(data_file_bytes=None): one OCDBT data file per batch."""

    name = "dispatch_io_fewfiles"
    options = {"data_file_bytes": None}


class DispatchIOColocated(DispatchIO):
    """dispatch_io.ColocatedDispatcher (colocated_python, in-process on the CPU devices here)."""

    name = "dispatch_io_colocated"
    dispatcher_cls = dio.ColocatedDispatcher


class DispatchIOBaseline(DispatchIO):
    """dispatch_io.LocalDispatcher from another checkout (``--baseline PATH``, e.g. a
    ``git worktree`` of an older commit): before/after figures from one interleaved run. Its
    children import that checkout's ``dispatch_io`` and ``workers`` (PYTHONPATH)."""

    name = "dispatch_io_baseline"

    @classmethod
    def missing(cls) -> str | None:
        return None if os.environ.get(BASELINE_ENV) else "needs --baseline PATH (another checkout)"


BASELINE_ENV = "DISPATCH_IO_BENCH_BASELINE"


class Orbax:
    """orbax.checkpoint.StandardCheckpointer with its defaults (optional: never a dependency)."""

    name = "orbax"
    has_budget = False
    modes = MODES

    def __init__(self, budget: int):
        import orbax.checkpoint as ocp
        self.checkpointer = ocp.StandardCheckpointer()

    @classmethod
    def missing(cls) -> str | None:
        try:
            importlib.metadata.version("orbax-checkpoint")
            import orbax.checkpoint  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            return f"orbax-checkpoint not importable ({type(exc).__name__}: {exc})"
        return None

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


class OrbaxLimited(Orbax):
    """Orbax (0.12.8) holding at most the dispatch_io budget of host memory.

    StandardCheckpointHandler's ``save_concurrent_gb`` limits only the bytes being written,
    "NOT device-to-host transfer", and it does not expose the knob that does. So this is a
    ``PyTreeCheckpointHandler`` (the handler StandardCheckpointHandler wraps, same defaults: OCDBT,
    zarr2, zstd) with ``save_device_host_concurrent_gb`` = budget (device->host copies in flight,
    in batches of arrays: a batch is written before the next one is copied) and
    ``restore_concurrent_gb`` = budget (bytes read in flight). Both count GB of 10^9 bytes, so
    budget / 1e9 is passed. The device->host limit applies only to leaves the ArrayHandler's
    SerializationStatusCallback marks ASYNCHRONOUS_*; the default callback marks every leaf
    SYNCHRONOUS (all copied at once, limit ignored). So jax.Array leaves get an ArrayHandler (in
    a registry of this handler only) whose callback makes every leaf but ``step``
    ASYNCHRONOUS_DEPRIORITIZED, as our async mode does: save() returns before the big copies.
    TransferPriority is only in orbax.checkpoint._src (its docstring's own example imports it so).

    Semantics to keep in mind when reading the rows: the save limit packs whole arrays, so an
    array larger than the budget is still copied to host in one piece (RSS above the budget);
    the restore limit is per shard read and raises ValueError for a shard of the budget or more.
    """

    name = "orbax_limited"
    has_budget = True

    def __init__(self, budget: int):
        import orbax.checkpoint as ocp
        from orbax.checkpoint._src.metadata.array_metadata_store import Store
        from orbax.checkpoint._src.serialization.types import DefaultSerializationStatusCallback, TransferPriority

        class OnlyStepSync(DefaultSerializationStatusCallback):
            """``step`` copied before save() returns, every other leaf later, within the limit."""

            def key_priority(self, keypath):
                is_step = jax.tree_util.keystr(tuple(keypath)) == "['step']"
                return TransferPriority.SYNCHRONOUS if is_step else TransferPriority.ASYNCHRONOUS_DEPRIORITIZED

        handler = ocp.type_handlers.ArrayHandler(array_metadata_store=Store(), callback=OnlyStepSync())
        self.ocp = ocp
        self.checkpointer = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(
            save_device_host_concurrent_gb=budget / 1e9, restore_concurrent_gb=budget / 1e9,
            type_handler_registry=ocp.type_handlers.create_type_handler_registry((jax.Array, handler))))

    def save(self, tree, path):
        self.save_async(tree, path)()

    def save_async(self, tree, path):
        self.checkpointer.save(os.path.abspath(path), args=self.ocp.args.PyTreeSave(tree))
        return self.checkpointer.wait_until_finished

    def restore(self, abstract, path):
        restore_args = self.ocp.checkpoint_utils.construct_restore_args(abstract)
        return self.checkpointer.restore(os.path.abspath(path),
                                         args=self.ocp.args.PyTreeRestore(abstract, restore_args=restore_args))


class DispatchIOOnOrbax(Orbax):
    """dispatch_io restoring a checkpoint that Orbax wrote: the save is Orbax's own
    (StandardCheckpointer with its defaults: OCDBT, zarr2, zstd; the same as the ``orbax`` row's),
    the restores are ``LocalDispatcher(host_memory_budget=--budget-mib)`` reading that Orbax
    checkpoint. Compare its restore rows with the ``orbax`` rows: the same tree, the same format,
    each system restoring it."""

    name = "dispatch_io_on_orbax"
    has_budget = True
    budgeted_saves = False  # its save is Orbax's
    modes = ("save", "restore", "restore_warm")

    def __init__(self, budget: int):
        super().__init__(budget)
        self.dispatcher = dio.LocalDispatcher(host_memory_budget=budget)

    def restore(self, abstract, path):
        return self.dispatcher.restore(os.path.abspath(path), abstract)

    def close(self):
        super().close()
        self.dispatcher.close()


class JaxSerialization:
    """jax.experimental.array_serialization.serialization.GlobalAsyncCheckpointManager with the
    defaults of that module's get_tensorstore_spec: every leaf one zarr (v2) array directory under
    ``path``, named by its key path, one file per shard, no OCDBT. save = serialize (returns once
    the device data is copied to host) + wait_until_finished; restore = deserialize onto the
    target shardings (its default limit of 32 GB read in flight). It writes no tree
    metadata and rejects key<fry> arrays, so PRNG keys are stored as their key_data (and come back
    with the default implementation, the one benchmarks/tree.py uses)."""

    name = "jax_serialization"
    has_budget = False
    modes = MODES

    def __init__(self, budget: int):
        from jax.experimental.array_serialization import serialization
        self.ser = serialization
        self.manager = serialization.GlobalAsyncCheckpointManager()

    @classmethod
    def missing(cls) -> str | None:
        return None

    def _specs(self, tree, path):
        """One TensorStore spec per leaf: a zarr directory under path named by the leaf's key path."""
        root = os.path.abspath(path)
        names = [".".join(str(getattr(k, "key", k)) for k in keypath)
                 for keypath, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        return [self.ser.get_tensorstore_spec(os.path.join(root, name)) for name in names]

    def save(self, tree, path):
        self.save_async(tree, path)()

    def save_async(self, tree, path):
        data = [jax.random.key_data(x) if bt.is_key(x) else x for x in jax.tree.leaves(tree)]
        self.manager.serialize(data, self._specs(tree, path), on_commit_callback=None)
        return self.manager.wait_until_finished

    def restore(self, abstract, path):
        flat, treedef = jax.tree.flatten(abstract)
        stored = [jax.eval_shape(jax.random.key_data, a) if bt.is_key(a) else a for a in flat]
        out = self.manager.deserialize([a.sharding for a in flat], self._specs(abstract, path),
                                       [s.shape for s in stored], [s.dtype for s in stored])
        out = [jax.random.wrap_key_data(x) if bt.is_key(a) else x for x, a in zip(out, flat)]
        return jax.tree.unflatten(treedef, out)

    def close(self):
        self.manager.wait_until_finished()


SYSTEMS = {cls.name: cls for cls in (DispatchIO, DispatchIOFiles, DispatchIOColocated, DispatchIOZstd,
                                     DispatchIOFewFiles, DispatchIOBaseline, Orbax, OrbaxLimited, DispatchIOOnOrbax, JaxSerialization)}
DISPATCH_IO_SYSTEMS = tuple(name for name, cls in SYSTEMS.items() if issubclass(cls, DispatchIO))


def available_systems(wanted) -> tuple[list[str], list[str]]:
    """(the wanted systems that can run here, notes on the ones that cannot)."""
    systems, notes = [], []
    for name in wanted:
        why = SYSTEMS[name].missing()
        if why:
            notes.append(f"NOTE: {name} skipped: {why}")
            print(notes[-1], flush=True)
        else:
            systems.append(name)
    return systems, notes


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


def remove_checkpoint(path):
    """path and the temporary siblings a killed save may leave: ``path.*`` (Orbax, our warm-up) and
    ``.name.*`` (dispatch_io)."""
    folder, name = map(glob.escape, os.path.split(path))
    for other in [path] + glob.glob(os.path.join(folder, name + ".*")) + glob.glob(os.path.join(folder, f".{name}.*")):
        remove(other)


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
        rss = status_bytes("VmRSS")
        reset_peak_rss()
        out, timing = timed_call(system, a.child, state, abstract, a.path)
        calls.append({**timing, "rss_before": rss, "peak_rss": status_bytes("VmHWM")})
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
        res["disk_bytes"], res["files"] = disk_usage(a.path)
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
    print("RESULT " + json.dumps(res), flush=True)


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
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env=env)
    try:
        stdout, stderr = p.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        print(f"  TIMEOUT {system} {mode} {size}: killed after {a.timeout:g} s", flush=True)
        return {"error": f"timeout after {a.timeout:g} s", "timeout": True}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        tail = stderr.strip().splitlines()[-15:]
        print(f"  FAILED {system} {mode} {size} (rc={p.returncode}):\n    " + "\n    ".join(tail), flush=True)
        return {"error": "\n".join(tail)}
    res = json.loads(lines[-1][len("RESULT "):])
    res["process_seconds"] = time.perf_counter() - t0
    return res


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


# ---- tables ---------------------------------------------------------------------------------------

def stat(values, fmt="{:.2f}") -> str:
    """'median [min-max]' of the values that are not None; '-' if there are none."""
    v = [x for x in values if x is not None]
    if not v:
        return "-"
    if len(v) == 1:
        return fmt.format(v[0])
    return f"{fmt.format(statistics.median(v))} [{fmt.format(min(v))}-{fmt.format(max(v))}]"


def markdown(head, rows) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def rss_target(r) -> int | None:
    """Bytes of peak RSS over the pre-call RSS allowed to a run of a system with a budget."""
    cls = SYSTEMS[r["system"].split("@")[0]]
    if not cls.has_budget or (r["mode"] in SAVE_MODES and not getattr(cls, "budgeted_saves", True)):
        return None
    restored = r["device_bytes"] if r["mode"].startswith("restore") else 0
    return restored + r["budget_mib"] * MiB + RSS_SLACK


def runs_cell(rs, ok) -> str:
    """'ok/all', with what went wrong with the others."""
    counts = {why: sum(bool(r.get(why)) for r in rs) for why in ("timeout", "skipped")}
    counts["FAILED"] = len(rs) - len(ok) - sum(counts.values())
    return f"{len(ok)}/{len(rs)}" + "".join(f" {why} {n}" for why, n in counts.items() if n)


def rss_cell(ok) -> str:
    """RSS target in GiB and whether the worst run meets it."""
    targets = [rss_target(r) for r in ok]
    if not ok or targets[0] is None:
        return "-"
    met = all(r["peak_over_before"] <= t for r, t in zip(ok, targets))
    return f"{max(targets) / GiB:.2f} {'yes' if met else 'NO'}"


def system_row(label, mode, rs) -> list:
    ok = [r for r in rs if "error" not in r]
    col = lambda key, scale=1.0: [r[key] / scale if r.get(key) is not None else None for r in ok]
    verified = "-" if not any("verified" in r for r in ok) else ("yes" if all(r.get("verified") for r in ok) else "NO")
    return [label, mode, runs_cell(rs, ok), stat(col("first_wall")), stat(col("wall")),
            stat([r["nbytes"] / 1e9 / r["wall"] for r in ok], "{:.3g}"), stat(col("blocked"), "{:.3f}"),
            stat(col("peak_over_before", GiB)), stat(col("steady_peak_over_before", GiB)), rss_cell(ok),
            stat(col("files"), "{:.0f}"), stat(col("disk_bytes", 1e9), "{:.3f}"), verified]


def limit_rows(limits) -> list[list]:
    ok = [r for r in limits if "error" not in r]
    read_ok = "yes" if all(r["read_ok"] for r in ok) else "NO"
    rows = []
    for key, label in LIMITS:
        for memory in ("cold", "warm"):
            ts = [r[f"{key}_{memory}"] for r in ok]
            rows.append(["limit", f"{label} ({memory} memory)", runs_cell(limits, ok), "-", stat(ts),
                         stat([r["nbytes"] / 1e9 / t for r, t in zip(ok, ts)], "{:.3g}"), "-", "-", "-", "-",
                         "1" if key != "device_get" else "-", "-", read_ok if key == "read_cold" else "-"])
    return rows


def size_table(results, size) -> str:
    head = ["system", "mode", "runs", "1st call s", "wall s", "GB/s", "blocked s", "peak RSS +GiB",
            "steady peak +GiB", "RSS target GiB, met", "files", "disk GB", "verified"]
    mine = [r for r in results if r["size"] == str(size)]
    rows = []
    for label in dict.fromkeys(r["system"] for r in mine if r["system"] != "limit"):
        for mode in dict.fromkeys(r["mode"] for r in mine if r["system"] == label):
            rows.append(system_row(label, mode, [r for r in mine if (r["system"], r["mode"]) == (label, mode)]))
    return markdown(head, rows + limit_rows([r for r in mine if r["system"] == "limit"]))


class Medians:
    """Medians over the successful runs of one benchmark, by (size, system, mode)."""

    def __init__(self, results):
        self.results = [r for r in results if "error" not in r]

    def get(self, size, system, mode, key):
        v = [r[key] for r in self.results
             if (r["size"], r["system"], r["mode"]) == (str(size), system, mode) and r.get(key) is not None]
        return statistics.median(v) if v else None

    def gbs(self, size, system, mode):
        wall = self.get(size, system, mode, "wall")
        return wall and self.get(size, system, mode, "nbytes") / 1e9 / wall

    def limit(self, size, key):
        """Median seconds of a cold-memory limit."""
        return self.get(size, "limit", "limits", f"{key}_cold")

    def limit_gbs(self, size, key):
        t = self.limit(size, key)
        return t and self.get(size, "limit", "limits", "nbytes") / 1e9 / t


def verdict(text, met) -> str:
    return f"{text} {'met' if met else 'NOT met'}"


def ratio_cell(value, reference, minimum, percent=False) -> str:
    if not value or not reference:
        return "-"
    ratio = value / reference
    return verdict(f"{ratio * 100:.3g}%" if percent else f"{ratio:.3g}x", ratio >= minimum)


def scaling_cell(m, size, system, mode) -> str:
    """4 GiB wall / 1 GiB wall, shown in the 4 GiB column (4096, tf4g)."""
    if size not in bt.SCALES_FROM:
        return "-"
    big, small = m.get(size, system, mode, "wall"), m.get(bt.SCALES_FROM[size], system, mode, "wall")
    return verdict(f"{big / small:.2f}x", big / small <= 4.4) if big and small else "-"


def same_bytes_cell(m, size, system) -> str:
    """A transformer-shaped tree's save GB/s over the training state's of the same size."""
    if size not in bt.SAME_BYTES:
        return "-"
    return ratio_cell(m.gbs(size, system, "save"), m.gbs(bt.SAME_BYTES[size], system, "save"), 0.9, percent=True)


def many_wall_cell(m, size, system, mode) -> str:
    wall = m.get(size, system, mode, "wall") if size == bt.MANY else None
    return "-" if wall is None else verdict(f"{wall:.2f} s", wall <= 1.5)


def async_blocked_cell(m, size, system) -> str:
    blocked = m.get(size, system, "async", "blocked")
    return "-" if blocked is None else verdict(f"{blocked * 1e3:.1f} ms", blocked <= 0.020)


def blocked_vs_device_get(m, size, system) -> str:
    blocked, device_get = m.get(size, system, "async_sync", "blocked"), m.limit(size, "device_get")
    if blocked is None or not device_get:
        return "-"
    return verdict(f"{blocked:.3f} s / {device_get:.3f} s = {blocked / device_get:.2f}x", blocked <= device_get)


def files_cell(m, size, system) -> str:
    """Files of a 1 GiB save: at most 20 besides the OCDBT data files the system asks for (one
    per ``data_file_bytes`` stored; ``dispatch_io_fewfiles``: none), so never a file per chunk."""
    files = m.get(size, system, "save", "files")
    if files is None:
        return "-"
    if size not in (1024, "tf1g") or system == DispatchIOBaseline.name:  # another checkout's options
        return f"{files:.0f}"
    options = dio.Options(**SYSTEMS[system].options)
    data_files = 0
    if options.layout == "ocdbt" and options.data_file_bytes:
        data_files = math.ceil(m.get(size, system, "save", "disk_bytes") / options.data_file_bytes)
    return verdict(f"{files:.0f} (limit {20 + data_files})", files <= 20 + data_files)


TARGETS = (
    ("save GB/s vs orbax >= 3x", lambda m, s, d: ratio_cell(m.gbs(s, d, "save"), m.gbs(s, "orbax", "save"), 3)),
    ("save GB/s vs write+fsync >= 80%",
     lambda m, s, d: ratio_cell(m.gbs(s, d, "save"), m.limit_gbs(s, "write_fsync"), 0.8, percent=True)),
    ("cold restore GB/s vs orbax >= 2.5x",
     lambda m, s, d: ratio_cell(m.gbs(s, d, "restore"), m.gbs(s, "orbax", "restore"), 2.5)),
    ("cold restore GB/s vs cold read >= 70%",
     lambda m, s, d: ratio_cell(m.gbs(s, d, "restore"), m.limit_gbs(s, "read_cold"), 0.7, percent=True)),
    ("async blocked <= 20 ms", lambda m, s, d: async_blocked_cell(m, s, d)),
    ("async_sync blocked <= device_get", lambda m, s, d: blocked_vs_device_get(m, s, d)),
    ("files <= 20 + data files at 1 GiB", lambda m, s, d: files_cell(m, s, d)),
    ("save wall 4 GiB / 1 GiB <= 4.4x", lambda m, s, d: scaling_cell(m, s, d, "save")),
    ("restore wall 4 GiB / 1 GiB <= 4.4x", lambda m, s, d: scaling_cell(m, s, d, "restore")),
    ("save GB/s vs training state of the same size >= 90%", lambda m, s, d: same_bytes_cell(m, s, d)),
    ("10k save wall <= 1.5 s", lambda m, s, d: many_wall_cell(m, s, d, "save")),
    ("10k cold restore wall <= 1.5 s", lambda m, s, d: many_wall_cell(m, s, d, "restore")),
)


def targets_table(results, sizes, systems) -> str:
    m = Medians(results)
    rows = [[name, system] + [cell(m, size, system) for size in sizes]
            for system in systems if system in DISPATCH_IO_SYSTEMS for name, cell in TARGETS]
    return markdown(["target", "system"] + [f"{s} MiB" if isinstance(s, int) else str(s) for s in sizes], rows)


def command_line() -> str:
    """The command as typed, relative to this directory where it can be, with PYTHONPATH if set."""
    env = f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} " if os.environ.get("PYTHONPATH") else ""
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    return env + shlex.join([python] + sys.argv)


def report(a, header, notes, refs, results, systems) -> str:
    parts = [f"{time.strftime('%Y-%m-%d %H:%M %Z')}, in {os.getcwd()}:\n\n    {command_line()}", header]
    parts += notes
    for size in a.sizes:
        ref = refs[size]
        parts.append(f"### {size}{' MiB' if isinstance(size, int) else ''} tree: "
                     f"{ref.get('nbytes', 0) / 1e9:.3f} GB logical\n\n{size_table(results, size)}")
    parts.append("median [min-max] over reps; GB/s = logical bytes / 1e9 / wall s; peak RSS +GiB = VmHWM over "
                 "both calls - RSS before them (baseline method); steady peak = VmHWM during the steady call - RSS "
                 "just before it; RSS target = budget + 64 MiB (+ restored bytes, every device replica, for "
                 "restores), met when the worst run's peak RSS + is within it")
    parts.append("### Targets (medians of this run; limits on cold memory)\n\n"
                 + targets_table(results, a.sizes, systems))
    return "\n\n".join(parts) + "\n"


def main(a):
    systems, notes = available_systems(a.systems)
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.root, exist_ok=True)
    versions = {p: importlib.metadata.version(p) for p in ("jax", "jaxlib", "tensorstore", "numpy")}
    can_drop = drop_caches()
    version = code_version()
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
    if code_version().split("sources ")[1] != version.split("sources ")[1]:  # commits of other files are fine
        notes.append(f"WARNING: dispatch_io changed during the run (now {code_version()}); rows mix versions")
    md = report(a, header, notes, refs, results, systems)
    print("\n" + md)
    base = os.path.join(a.out, f"bench-{time.strftime('%Y%m%d-%H%M%S')}")
    with open(base + ".json", "w") as f:
        json.dump({"command": command_line(), "args": vars(a), "header": header, "notes": notes,
                   "references": {str(k): v for k, v in refs.items()}, "results": results, "report": md}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(md)
    print(f"wrote {base}.json and {base}.md")


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
    a = ap.parse_args()
    unknown = set(a.systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; known: {','.join(SYSTEMS)}")
    if a.baseline:  # read by DispatchIOBaseline here and in every child
        os.environ[BASELINE_ENV] = os.path.abspath(a.baseline)
    return a


if __name__ == "__main__":
    args = parse_args()
    child_main(args) if args.child else main(args)
