"""Crashes and storage faults under a CheckpointManager: real processes, real files.

* A saving process SIGKILLed mid-save (mid-write, or in the commit window) or while retention
  deletes an old step: the step is never listed, the previous one restores bit-exact, and a new
  manager removes what the dead save left (only once its writer is provably gone) so that the
  step can be saved again -- also when killed in the commit window (a marker naming the
  writer is there until the rename) or mid-delete on a file system whose readdir lists
  COMMITTED first, such as tmpfs (retention deletes the marker last).
* The storage layer failing with ENOSPC for one leaf (the worker's write function raises):
  the save fails promptly, naming the worker and the leaf, commits nothing, and neither the
  manager nor the dispatcher is left unusable.
* A long run of saves through one manager: memory and file descriptors stay flat and
  retention leaves exactly ``max_to_keep`` steps.

Failures are injected by wrapping the worker's write function (or a commit step), never by
mocking the storage itself. Anything that could hang runs in a subprocess with a time limit.
"""

import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import pytest

import dispatch_io as dio
from conftest import assert_trees_bit_equal, hooked_dispatcher
from dispatch_io.storage import COMMITTED, MANIFEST, WRITING, Marker
from dispatch_io.storage.directory import TEMPORARY
from test_dispatcher_lifecycle import run_isolated

KiB, MiB = 1 << 10, 1 << 20
TIMEOUT = 60
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The saved trees, built the same way in the killed child and in this process (from a seed):
# 24 float32 leaves of 256 KiB (sharded: 32 KiB shards), a bfloat16 leaf, a float64 host leaf,
# a PRNG key and a scalar -- about 6.6 MiB, so ~14 batches of <= 512 KiB under a 1 MiB budget.
TREE_SOURCE = """
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

def make_tree(mesh, seed):
    rng = np.random.default_rng(seed)
    grid = NamedSharding(mesh, P("data", "model"))
    return {
        "params": {f"w{i:02d}": jax.device_put(rng.standard_normal((256, 256), dtype=np.float32), grid)
                   for i in range(24)},
        "emb": jax.device_put(rng.standard_normal((512, 256)).astype(jnp.bfloat16), NamedSharding(mesh, P("data"))),
        "host": rng.standard_normal((128, 256)),
        "rng": jax.random.key(seed),
        "step": seed,
    }
"""
_namespace = {"np": np, "jax": jax}
exec(TREE_SOURCE, _namespace)
make_tree = _namespace["make_tree"]

CHILD = """
import faulthandler, itertools, os, sys, threading, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
faulthandler.dump_traceback_later(240, exit=True)   # never outlive a test that forgot us
import jax, numpy as np
import dispatch_io as dio
import dispatch_io.dispatcher, dispatch_io.manager, dispatch_io.storage.directory
root, marker, where, kill_at = {root!r}, {marker!r}, {where!r}, {kill_at!r}
mesh = jax.make_mesh((4, 2), ("data", "model"))
{tree_source}

def stop_here(what):
    # Tell the parent where we are (atomically), then wait to be killed.
    with open(marker + ".part", "w") as f:
        f.write(what)
    os.rename(marker + ".part", marker)
    while True:
        time.sleep(60)

class KillingRunner(dio.LocalRunner):   # once armed: stops before its kill_at-th batch write
    calls, lock, armed = itertools.count(1), threading.Lock(), False

    def open_writer(self, target):
        writer = super().open_writer(target)
        real_write = writer.write
        def write(regions, buffers):
            with self.lock:
                n = next(self.calls) if KillingRunner.armed else 0
            if n == kill_at:
                stop_here(f"in batch {{n}}")
            return real_write(regions, buffers)
        writer.write = write
        return writer

options = dio.Options(host_memory_budget=1 << 20)
manager = dio.CheckpointManager(root, dio.Dispatcher(options, KillingRunner(options.io_settings())),
                                max_to_keep=1 if where == "retention" else None)
manager.save(1, make_tree(mesh, 1)).wait()
manager.wait()
tree = make_tree(mesh, 2)

if where == "write":               # the runner's kill_at-th batch write of step 2
    KillingRunner.armed = True
elif where == "commit":            # manifest written, COMMITTED not yet
    real_file = dispatch_io.storage.directory._write_file
    def _write_file(path, data, fsync):
        if os.path.basename(path) == dispatch_io.storage.COMMITTED:
            stop_here("committing: manifest written")
        return real_file(path, data, fsync)
    dispatch_io.storage.directory._write_file = _write_file
elif where == "rename":            # COMMITTED written in the temporary directory, not renamed yet
    real_rename = os.rename
    def rename(src, dst):
        if dispatch_io.storage.directory.TEMPORARY.parse(os.path.basename(src)) == "2":
            stop_here("committing: about to rename")
        return real_rename(src, dst)
    dispatch_io.storage.directory.os.rename = rename
elif where == "retention":         # step 2 committed; deleting step 1, at the kill_at-th file removed
    real_rmtree, real_unlink, unlinks = dispatch_io.storage.directory.shutil.rmtree, os.unlink, itertools.count(1)
    def unlink(path, *args, **kwargs):
        if next(unlinks) == kill_at:
            stop_here(f"deleting step 1: unlink {{kill_at}}")
        return real_unlink(path, *args, **kwargs)
    def rmtree(path, *args, **kwargs):
        os.unlink = unlink if "-deleting-" in os.fspath(path) else real_unlink
        try:
            return real_rmtree(path, *args, **kwargs)
        finally:
            os.unlink = real_unlink
    dispatch_io.storage.directory.shutil.rmtree = rmtree
print("saving step 2", flush=True)
manager.save(2, tree).wait()
manager.wait()
print("step 2 was not interrupted", flush=True)
"""


def start_child(root, marker, where, kill_at=5):
    script = CHILD.format(root=os.fspath(root), marker=os.fspath(marker), where=where, kill_at=kill_at,
                          tree_source=TREE_SOURCE)
    pythonpath = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": pythonpath})


def wait_for_marker(child, marker, timeout=TIMEOUT) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(marker):
        if child.poll() is not None:
            out, err = child.communicate()
            pytest.fail(f"the child exited ({child.returncode}) before reaching the kill point:\n{out}\n{err[-6000:]}")
        if time.monotonic() > deadline:
            child.kill()
            out, err = child.communicate()
            pytest.fail(f"the child did not reach the kill point within {timeout} s:\n{out}\n{err[-6000:]}")
        time.sleep(0.02)
    with open(marker) as f:
        return f.read()


def temporaries(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if TEMPORARY.parse(n))


def kill_mid_save(root, marker, where):
    """Run the child until ``where``, SIGKILL it; returns the temporary directory it left."""
    child = start_child(root, marker, where)
    try:
        reached = wait_for_marker(child, marker)
        assert reached == {"write": "in batch 5", "commit": "committing: manifest written",
                           "rename": "committing: about to rename"}[where]
        (tmp,) = temporaries(root)
        assert TEMPORARY.parse(tmp) == "2", tmp
        tmp = root / tmp
        if where == "write":
            assert os.path.isfile(tmp / WRITING) and not os.path.exists(tmp / MANIFEST)
            # A manager opened while the writer still runs must leave its directory alone.
            assert not Marker.read(tmp / WRITING).process_gone
            with dio.LocalDispatcher(host_memory_budget=MiB) as d, dio.CheckpointManager(root, d) as alive:
                assert alive.all_steps() == [1]
            assert os.path.isdir(tmp) and os.path.isfile(tmp / WRITING)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(TIMEOUT)
        assert child.returncode == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate()
    assert os.path.isdir(tmp)
    assert sorted(os.listdir(root)) == sorted(["1", tmp.name])   # step 2 never reached its name
    return tmp


@pytest.mark.parametrize("where", ["write", "commit", "rename"])
def test_sigkill_mid_save_never_lists_the_step_and_the_next_manager_recovers(tmp_path, mesh, where):
    """A process saving step 2 through a CheckpointManager is SIGKILLed: in the 5th call (of
    14) of the worker's write function ("write"), after the manifest but before COMMITTED
    ("commit"), or with COMMITTED written but the directory not renamed into place ("rename").
    Step 2 is never listed, step 1 restores bit-exact, step 2 can be saved again; the dead
    save's directory is removed by the next manager (see the next test for the commit window)."""
    root = tmp_path / "root"
    tmp = kill_mid_save(root, tmp_path / "marker", where)
    if where == "write":
        assert Marker.read(tmp / WRITING).process_gone            # the killed process is provably gone
    else:  # in the commit window: the manifest is written
        assert os.path.isfile(tmp / MANIFEST)
        assert os.path.isfile(tmp / COMMITTED) == (where == "rename")

    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        manager = dio.CheckpointManager(root, d, max_to_keep=3)
        left = temporaries(root)
        if where == "write":
            assert left == [], "the dead save's temporary directory was not removed"
        assert manager.all_steps() == [1] and manager.latest_step() == 1
        step1 = make_tree(mesh, 1)
        assert_trees_bit_equal(manager.restore(target=step1), step1)
        assert_trees_bit_equal(manager.restore(1, target=step1), step1)
        with pytest.raises((dio.IncompleteCheckpointError, FileNotFoundError)):
            manager.restore(2)

        step2 = make_tree(mesh, 2)
        manager.save(2, step2).wait(TIMEOUT)
        manager.wait()
        assert manager.all_steps() == [1, 2] and manager.latest_step() == 2
        assert_trees_bit_equal(manager.restore(target=step2), step2)
        assert_trees_bit_equal(manager.restore(1, target=step1), step1)
        manager.close()
    assert sorted(os.listdir(root)) == sorted(["1", "2"] + left)


@pytest.mark.parametrize("where", ["commit", "rename"])
def test_sigkill_in_the_commit_window_leftover_is_removed(tmp_path, where):
    root = tmp_path / "root"
    tmp = kill_mid_save(root, tmp_path / "marker", where)
    with dio.LocalDispatcher(host_memory_budget=MiB) as d, dio.CheckpointManager(root, d) as manager:
        assert manager.all_steps() == [1]
    assert not os.path.exists(tmp), sorted(os.listdir(tmp))


def tmpfs_root():
    """A fresh directory on a tmpfs (readdir lists newest first there), or skip."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    return tempfile.mkdtemp(prefix="dispatch_io-crash-", dir="/dev/shm")


@pytest.mark.parametrize("filesystem", [
    "tmp_path",
    "tmpfs",   # readdir lists newest first there: COMMITTED would go first without care
])
def test_sigkill_mid_retention_never_leaves_a_broken_step(tmp_path, mesh, filesystem):
    """With max_to_keep=1, the process is SIGKILLed while retention deletes step 1 (after step 2
    committed), at the 10th file removed: step 1 is already renamed away, so it is never listed
    half-deleted; step 2 restores bit-exact; the next manager removes the leftover."""
    base = tmp_path if filesystem == "tmp_path" else tmpfs_root()
    try:
        root = os.path.join(base, "root")
        child = start_child(root, tmp_path / "marker", "retention", kill_at=10)
        try:
            assert wait_for_marker(child, tmp_path / "marker") == "deleting step 1: unlink 10"
            os.kill(child.pid, signal.SIGKILL)
            child.wait(TIMEOUT)
        finally:
            if child.poll() is None:
                child.kill()
            child.communicate()
        names = sorted(os.listdir(root))
        assert names[-1] == "2" and len(names) == 2 and names[0].startswith(".1.dispatch_io-deleting-"), names
        with dio.LocalDispatcher(host_memory_budget=MiB) as d, \
                dio.CheckpointManager(root, d, max_to_keep=1) as manager:
            assert manager.all_steps() == [2] and manager.latest_step() == 2
            step2 = make_tree(mesh, 2)
            assert_trees_bit_equal(manager.restore(target=step2), step2)
            assert sorted(os.listdir(root)) == ["2"], (sorted(os.listdir(os.path.join(root, names[0]))))
    finally:
        if filesystem == "tmpfs":
            shutil.rmtree(base, ignore_errors=True)


# ---- storage faults -----------------------------------------------------------------------------

def fault_tree(mesh, seed):
    """['w'] (1 MiB, its own batches: HIGH priority) among SYNC leaves and a host leaf."""
    rng = np.random.default_rng(seed)
    grid = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
    return {"a": jax.device_put(rng.standard_normal((256, 256), dtype=np.float32), grid),
            "w": jax.device_put(rng.standard_normal((512, 512), dtype=np.float32), grid),
            "z": rng.standard_normal((64, 64)),
            "step": seed}


W = "['w']"
ISOLATE_W = dict(priority=lambda keypath, spec: dio.Priority.HIGH if keypath == W else dio.Priority.SYNC)


def no_space_for(victim):
    """A write hook raising ENOSPC for any batch holding ``victim``; counts its failures."""
    calls = {"failed": 0}

    def hook(regions):
        if any(r.keypath == victim for r in regions):
            calls["failed"] += 1
            raise OSError(errno.ENOSPC, "No space left on device")
    return hook, calls


@pytest.mark.parametrize("surfaces", ["wait", "save"])
def test_no_space_left_fails_the_step_and_the_manager_goes_on(tmp_path, mesh, dispatcher_cls, surfaces):
    """ENOSPC for ['w'] while saving step 2: the handle raises WorkerError promptly, naming the
    worker and the leaf; the manager raises it once more (from wait(), or from the next save(),
    which then saves nothing), then works; nothing of step 2 is left; step 1 is intact."""
    root = tmp_path / "root"
    step1, step2 = fault_tree(mesh, 1), fault_tree(mesh, 2)
    with hooked_dispatcher(dispatcher_cls, host_memory_budget=MiB) as d, \
            dio.CheckpointManager(root, d, max_to_keep=2) as manager:
        manager.save(1, step1, **ISOLATE_W).wait(TIMEOUT)
        manager.wait()

        d.runner.write_hook, calls = no_space_for(W)
        start = time.monotonic()
        handle = manager.save(2, step2, **ISOLATE_W)
        with pytest.raises(dio.WorkerError) as info:
            handle.wait(TIMEOUT)
        elapsed = time.monotonic() - start
        assert elapsed < 10, elapsed
        assert calls["failed"] >= 1
        err = info.value
        message = str(err)
        assert "worker 0" in message and W in message, message
        assert "No space left on device" in message, message
        assert err.worker == 0 and err.keypath == W, (err.worker, err.keypath)
        cause = err
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__
        # (colocated_python runs in-process here, so its worker's OSError is chained as well)
        assert cause is not None and cause.errno == errno.ENOSPC, repr(err.__cause__)
        assert "[Errno 28]" in message, message

        assert manager.all_steps() == [1] and manager.latest_step() == 1
        assert sorted(os.listdir(root)) == ["1"]   # no step 2, no temporary directory
        d.runner.write_hook = None
        if surfaces == "wait":
            with pytest.raises(dio.WorkerError) as again:
                manager.wait()
            assert again.value is err
            manager.wait()                           # raised once only
        else:
            with pytest.raises(dio.WorkerError) as again:
                manager.save(3, step2, **ISOLATE_W)
            assert again.value is err
            assert sorted(os.listdir(root)) == ["1"]   # the refused save started nothing
        assert_trees_bit_equal(manager.restore(target=step1), step1)

        stats = manager.save(2, step2, **ISOLATE_W).wait(TIMEOUT)   # the same step, no fault
        manager.wait()
        assert stats.bytes_written > 0
        assert manager.all_steps() == [1, 2]
        assert_trees_bit_equal(manager.restore(target=step2), step2)
        assert_trees_bit_equal(manager.restore(1, target=step1), step1)
    assert sorted(os.listdir(root)) == ["1", "2"]


# ---- a long run -------------------------------------------------------------------------------

def test_soak_25_saves_of_256_mib_keep_memory_and_fds_flat(tmp_path):
    """25 saves of a 256 MiB tree (16 float32 arrays of 4 Mi elements over the 8-device mesh)
    through one CheckpointManager (max_to_keep=2, 64 MiB budget): RSS after the last save is
    within 5% of RSS after the third, open file descriptors end where they started, and the
    root holds exactly the last two steps. No allocator settings: LocalDispatcher copies into
    its one warm staging buffer, so there is nothing for glibc arenas to accumulate."""
    out = run_isolated(tmp_path, """
        def fds(): return len(os.listdir("/proc/self/fd"))
        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) << 10

        rng = np.random.default_rng(0)
        grid = NamedSharding(mesh, P("data", "model"))
        tree = {f"w{i:02d}": jax.device_put(rng.standard_normal((2048, 2048), dtype=np.float32), grid)
                for i in range(16)}
        tree.update(rng=jax.random.key(0), step=0)
        assert sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")) >= 256 << 20
        base_fds = fds()
        d = Dispatcher(host_memory_budget=64 << 20)
        manager = dio.CheckpointManager(root, d, max_to_keep=2)
        seen, start = {}, time.monotonic()
        for step in range(25):
            manager.save(step, tree).wait(TIMEOUT)
            manager.wait()
            seen[step + 1] = (fds(), rss())
        elapsed = time.monotonic() - start
        print("SOAK", elapsed, base_fds, {k: (f, r >> 20) for k, (f, r) in seen.items()})
        assert seen[25][0] == seen[1][0] == base_fds, (base_fds, seen)
        assert seen[25][1] <= seen[3][1] * 1.05, {k: r >> 20 for k, (_, r) in seen.items()}
        assert manager.all_steps() == [23, 24]
        assert sorted(os.listdir(root)) == ["23", "24"]
        restored = manager.restore(target=tree)
        assert all(np.array_equal(np.asarray(restored[k]), np.asarray(tree[k])) for k in tree if k.startswith("w"))
        manager.close()
        d.close()
        assert fds() == base_fds
    """, timeout=120)
    print(out)
