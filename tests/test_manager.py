"""CheckpointManager: numbered steps under one root, retention, leftovers, ordering, donation, copies,
calls from inside a save.

Every check compares bytes (``assert_trees_bit_equal``) or exact directory listings; anything
that could hang waits with a timeout so a regression fails instead of blocking the suite.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from conftest import assert_trees_bit_equal, fail_batches_of, hooked_dispatcher
from dispatch_io.storage import COMMITTED, MANIFEST, Marker, WRITING
from dispatch_io.workers import aligned_empty


KiB = 1 << 10


TIMEOUT = 30
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def put(mesh, value, *spec):
    return jax.device_put(value, NamedSharding(mesh, P(*spec)))


def step_tree(mesh, step: int):
    """A small sharded tree whose every value depends on ``step``."""
    base = np.arange(64, dtype=np.float32).reshape(8, 8)
    return {
        "w": put(mesh, base * 1.5 + step, "data", "model"),
        "b": put(mesh, (np.arange(8, dtype=np.int32) - 3) * step, "model"),
        "h": np.full((3, 5), step, np.float64) + np.arange(5) / 7,   # a host numpy leaf
        "rng": jax.random.key(step),
        "step": step,
    }


def snapshot(tree):
    """A copy of ``tree`` independent of its buffers: what ``restore(target=None)`` returns
    (numpy arrays; PRNG keys as key arrays; scalars as is)."""
    def one(x):
        if dio.tree.is_prng_key(x):
            return jax.random.wrap_key_data(np.array(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        if isinstance(x, (jax.Array, np.ndarray)):
            return np.array(jax.device_get(x))
        return x
    return jax.tree.map(one, tree)


def aligned(array: np.ndarray) -> np.ndarray:
    """``array`` copied to a 64-byte-aligned buffer: the case where ``jax.device_put`` on CPU
    adopts host memory without a copy (so a reused host buffer would show in the checkpoint)."""
    out = aligned_empty(array.shape, array.dtype)
    out[...] = array
    return out


def listing(root) -> set[str]:
    return set(os.listdir(root))


def read_all(path) -> dict[str, bytes]:
    """{relative path: bytes} of every file under ``path`` (directories as None)."""
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), path) + "/"] = None
        for f in files:
            full = os.path.join(dirpath, f)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, path)] = fh.read()
    return out


def is_committed(path) -> bool:
    return os.path.isfile(os.path.join(path, COMMITTED)) and os.path.isfile(os.path.join(path, MANIFEST))


def write_marker_from_dead_process(marker_path):
    """A genuine ``WRITING`` marker (``Marker.new()``) written by a process that then exits."""
    code = ("import sys; from dispatch_io.storage import Marker; "
            "open(sys.argv[1], 'wb').write(Marker.new().encode())")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code, os.fspath(marker_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    marker = json.loads(open(marker_path, "rb").read())
    assert marker["pid"] != os.getpid() and marker["host"] == socket.gethostname()
    assert not os.path.exists(f"/proc/{marker['pid']}") or _proc_start(marker["pid"]) != marker["started"]


def _proc_start(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def expected_kept(steps, max_to_keep, every):
    """The retention policy, written out independently: the ``max_to_keep`` most recent plus
    every multiple of ``every``."""
    recent = sorted(steps)[-max_to_keep:]
    return sorted(set(recent) | {s for s in steps if every and s % every == 0})


def make_foreign_entries(root):
    """Things in the root that are not ours: (name -> content snapshot) to check they survive."""
    os.makedirs(root / "notes")
    (root / "notes" / "README.txt").write_bytes(b"my notes\n")
    os.makedirs(root / "7" / "arrays")                          # numeric, committed-looking, no manifest
    (root / "7" / COMMITTED).write_bytes(b"not ours")
    (root / "8").write_bytes(b"a file named 8")
    os.makedirs(root / ".9.dispatch_io-tmp-abc" / "arrays")     # our pattern, but no WRITING marker
    (root / ".9.dispatch_io-tmp-abc" / "data").write_bytes(b"x" * 10)
    os.makedirs(root / ".tmp_xyz")                               # someone else's temporary directory
    (root / ".tmp_xyz" / "partial").write_bytes(b"y" * 10)
    return {name: read_all(root / name) if (root / name).is_dir() else (root / name).read_bytes()
            for name in ["notes", "7", "8", ".9.dispatch_io-tmp-abc", ".tmp_xyz"]}


def assert_foreign_untouched(root, foreign):
    for name, content in foreign.items():
        now = read_all(root / name) if (root / name).is_dir() else (root / name).read_bytes()
        assert now == content, f"{name} was modified"


class _SpiedLock:
    """A lock that calls ``on_enter()`` before each ``with`` acquires it."""

    def __init__(self, lock, on_enter):
        self.lock, self.on_enter = lock, on_enter

    def __enter__(self):
        self.on_enter()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


REENTRANT_SAVE = r"""
import sys
import numpy as np
import dispatch_io as dio
mgr = dio.CheckpointManager(sys.argv[1])
def priority(keypath, spec):      # runs on the thread inside save(), as a signal handler would
    mgr.save(2, {"w": np.ones(2)})
    return dio.Priority.SYNC
try:
    mgr.save(1, {"w": np.ones(2)}, priority=priority).wait()
except Exception as exc:
    print("RAISED", type(exc).__name__, flush=True)
mgr.close()
"""

def test_lifecycle_async_saves_retention_and_foreign_entries(tmp_path, mesh, dispatcher_cls):
    root = tmp_path / "ckpts"
    os.makedirs(root)
    foreign = make_foreign_entries(root)
    dispatcher = dispatcher_cls(host_memory_budget=16 * KiB)
    saved, handles = {}, {}
    try:
        manager = dio.CheckpointManager(root, dispatcher, max_to_keep=2, keep_every_n_steps=4)
        assert manager.all_steps() == [] and manager.latest_step() is None   # 7/ is not a checkpoint
        assert_foreign_untouched(root, foreign)
        for step in range(1, 7):
            tree = step_tree(mesh, step)
            saved[step] = snapshot(tree)
            handles[step] = manager.save(step, tree)   # async; waits for the previous save first
        manager.wait()
        for step, handle in handles.items():
            assert handle.done()
            assert handle.wait(0).bytes_written > 0
        kept = expected_kept(range(1, 7), 2, 4)
        assert kept == [4, 5, 6]
        assert manager.all_steps() == kept
        assert manager.latest_step() == 6               # although 7/ exists
        assert listing(root) == {str(s) for s in kept} | set(foreign), sorted(listing(root))
        assert_foreign_untouched(root, foreign)
        for step in kept:
            assert_trees_bit_equal(manager.restore(step), saved[step])
        assert_trees_bit_equal(manager.restore(), saved[6])
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
            step_tree(mesh, 0))
        restored = manager.restore(5, abstract)
        assert restored["w"].sharding == abstract["w"].sharding
        assert_trees_bit_equal(restored, saved[5])
        manager.close()
        # The manager did not own the dispatcher: it still works, and a reopened manager sees
        # the same steps without touching anything.
        assert_trees_bit_equal(dispatcher.restore(root / "4"), saved[4])
        with dio.CheckpointManager(root, dispatcher, max_to_keep=2, keep_every_n_steps=4) as again:
            assert again.all_steps() == [4, 5, 6]
            assert_trees_bit_equal(again.restore(), saved[6])
        assert listing(root) == {"4", "5", "6"} | set(foreign)
        assert_foreign_untouched(root, foreign)
    finally:
        dispatcher.close()


def test_retention_policy_is_exactly_the_documented_one(tmp_path):
    with dio.CheckpointManager(tmp_path / "r", max_to_keep=3, keep_every_n_steps=10) as m:
        steps = [0, 5, 10, 15, 20, 25, 30, 35]
        assert m.steps_to_delete(steps) == [5, 15]           # 25, 30, 35 recent; 0, 10, 20 every 10
        assert [s for s in steps if s not in m.steps_to_delete(steps)] == expected_kept(steps, 3, 10)
        assert m.steps_to_delete([7]) == []                   # the newest is never deleted
        assert m.steps_to_delete([35, 5, 30, 0, 25, 15, 20, 10]) == [5, 15]   # any order
    with dio.CheckpointManager(tmp_path / "r", max_to_keep=1) as m:
        assert m.steps_to_delete([1, 2, 3]) == [1, 2]
    with dio.CheckpointManager(tmp_path / "r", keep_every_n_steps=4) as m:
        assert m.steps_to_delete([1, 2, 3, 4, 5]) == []        # no max_to_keep: keep everything


@pytest.mark.parametrize("reported_by", ["save", "wait"])
def test_failed_save_keeps_newest_and_reports_once(tmp_path, mesh, reported_by):
    root = tmp_path / "ckpts"
    dispatcher = hooked_dispatcher(dio.LocalDispatcher)
    manager = dio.CheckpointManager(root, dispatcher, max_to_keep=1)
    try:
        manager.save(1, step_tree(mesh, 1))
        two = step_tree(mesh, 2)
        expected_two = snapshot(two)
        manager.save(2, two)
        manager.wait()
        assert manager.all_steps() == [2] and listing(root) == {"2"}

        dispatcher.runner.write_hook = fail_batches_of(None)   # every write: ENOSPC
        # HIGH: save() returns at once (no SYNC leaf), so the failure surfaces from wait().
        handle = manager.save(3, step_tree(mesh, 3), priority=lambda k, s: dio.Priority.HIGH)
        assert listing(root) >= {"2"}                  # nothing deleted before a newer step committed
        with pytest.raises(dio.WorkerError, match="No space left on device") as info:
            handle.wait(TIMEOUT)
        assert isinstance(info.value, dio.CheckpointError)
        dispatcher.runner.write_hook = None
        # The manager's thread has seen the failure once its wait returns.
        if reported_by == "save":
            with pytest.raises(dio.WorkerError, match="No space left on device") as again:
                manager.save(4, step_tree(mesh, 4))
            assert listing(root) == {"2"}              # that save() started nothing
        else:
            with pytest.raises(dio.WorkerError, match="No space left on device") as again:
                manager.wait()
        assert again.value is info.value
        manager.wait()                                  # reported once only
        assert manager.all_steps() == [2] and listing(root) == {"2"}   # no step 3, no temporary dir
        assert_trees_bit_equal(manager.restore(), expected_two)

        four = step_tree(mesh, 4)
        expected_four = snapshot(four)
        manager.save(4, four).wait(TIMEOUT)
        manager.wait()                                  # retention ran after 4 committed
        assert manager.all_steps() == [4] and listing(root) == {"4"}
        assert_trees_bit_equal(manager.restore(4), expected_four)
    finally:
        manager.close()
        dispatcher.close()


def test_close_raises_an_unreported_failure(tmp_path, mesh):
    root = tmp_path / "ckpts"
    with hooked_dispatcher(dio.LocalDispatcher, fail_batches_of(None)) as dispatcher, pytest.raises(dio.WorkerError):
        with dio.CheckpointManager(root, dispatcher) as manager:
            manager.save(1, step_tree(mesh, 1), priority=lambda k, s: dio.Priority.LOW)
    assert listing(root) == set()
    with pytest.raises(RuntimeError):                    # closed anyway
        manager.save(2, step_tree(mesh, 2))


def test_existing_step_raises_and_overwrite_replaces(tmp_path, mesh):
    root = tmp_path / "ckpts"
    with dio.CheckpointManager(root, max_to_keep=3) as manager:
        first, second = step_tree(mesh, 1), step_tree(mesh, 11)
        expected_first, expected_second = snapshot(first), snapshot(second)
        manager.save(1, first).wait(TIMEOUT)
        before = read_all(root)
        with pytest.raises(FileExistsError):
            manager.save(1, second)
        assert read_all(root) == before                  # nothing written, not even a temporary dir
        manager.wait()                                   # the refusal is not a pending failure
        assert_trees_bit_equal(manager.restore(1), expected_first)

        manager.save(1, second, overwrite=True).wait(TIMEOUT)
        manager.wait()
        assert manager.all_steps() == [1] and listing(root) == {"1"}   # no -old- left over
        assert_trees_bit_equal(manager.restore(1), expected_second)


def test_a_step_older_than_the_latest_is_refused_before_anything_is_written(tmp_path, mesh):
    """After a rollback into the same root, retention ranks steps by number: the older step would
    be deleted right after it committed (and restore() would return the newer one). Refused."""
    root = tmp_path / "ckpts"
    with dio.CheckpointManager(root, max_to_keep=2) as manager:
        for step in (100, 200, 300):
            manager.save(step, {"x": np.full(4, step, np.int32)})
        manager.wait()
        before = read_all(root)
        for older in (210, 0):
            with pytest.raises(ValueError, match=rf"cannot save step {older} under .*step 300 is newer.*"
                                                 rf"remove the steps newer than {older} first"):
                manager.save(older, {"x": np.full(4, older, np.int32)})
        assert read_all(root) == before                  # nothing written
        manager.wait()                                   # the refusal is not a pending failure
        shutil.rmtree(root / "300")                      # the documented way on: remove the newer steps
        manager.save(210, {"x": np.full(4, 210, np.int32)})
        manager.wait()
        assert manager.all_steps() == [200, 210] and manager.latest_step() == 210
        assert_trees_bit_equal(manager.restore(), {"x": np.full(4, 210, np.int32)})
        with pytest.raises(FileExistsError):             # the latest step itself: as before
            manager.save(210, {"x": np.zeros(4, np.int32)})


def test_a_step_name_with_a_trailing_newline_is_not_a_step(tmp_path):
    """``"5\\n"`` is not ``5`` (whose path, <root>/5, does not exist): never listed nor deleted."""
    root = tmp_path / "ckpts"
    with dio.CheckpointManager(root, max_to_keep=1) as manager:
        manager.save(3, {"x": np.ones(4)})
        manager.wait()
        shutil.copytree(root / "3", root / "5\n")
        assert manager.all_steps() == [3] and manager.latest_step() == 3
        assert_trees_bit_equal(manager.restore(), {"x": np.ones(4)})
        manager.save(4, {"x": np.zeros(4)})
        manager.wait()
        assert listing(root) == {"4", "5\n"}             # retention left the foreign entry alone


def test_next_save_waits_for_the_save_in_flight(tmp_path, mesh):
    root = tmp_path / "ckpts"
    release = threading.Event()
    released_at = []
    events = []  # (time, what)

    def on_transfer_end(keypath):
        if keypath == "['w']":                           # hold the LOW leaf's save back
            release.wait(TIMEOUT)

    def let_go():
        released_at.append(time.monotonic())
        release.set()

    with dio.CheckpointManager(root) as manager:
        real_save = manager.dispatcher.save

        def recording_save(path, tree, **kw):
            events.append((time.monotonic(), os.path.basename(path), is_committed(root / "1")))
            return real_save(path, tree, **kw)

        manager.dispatcher.save = recording_save
        one, two = step_tree(mesh, 1), step_tree(mesh, 2)
        expected_one, expected_two = snapshot(one), snapshot(two)
        timer = threading.Timer(0.5, let_go)
        try:
            handle = manager.save(1, one, on_transfer_end=on_transfer_end,
                                  priority=lambda k, s: dio.Priority.LOW if k == "['w']" else dio.Priority.SYNC)
            assert not handle.done() and not is_committed(root / "1")
            timer.start()
            manager.save(2, two)
            returned = time.monotonic()
            assert handle.done() and is_committed(root / "1")   # step 1 committed before save(2) returned
            assert released_at and returned >= released_at[0]
        finally:
            release.set()
            timer.cancel()
        manager.wait()
        assert [(name, committed) for _, name, committed in events] == [("1", False), ("2", True)]
        assert events[1][0] >= released_at[0]           # save 2 started only after save 1 could finish
        assert manager.all_steps() == [1, 2]
        assert_trees_bit_equal(manager.restore(1), expected_one)
        assert_trees_bit_equal(manager.restore(2), expected_two)


def test_manager_calls_from_a_save_callback_raise_instead_of_deadlocking(tmp_path):
    """A callback runs on the dispatcher's IO threads, which the manager's save / wait / close
    wait for: each raises the dispatcher's RuntimeError there, and the save still commits."""
    raised = {}

    def on_write_end(keypath):
        for name, call in (("wait", lambda: manager.wait()), ("save", lambda: manager.save(2, {"x": np.ones(2)})),
                           ("restore", lambda: manager.restore(1)), ("close", lambda: manager.close())):
            try:
                call()
            except RuntimeError as exc:
                raised[name] = exc

    with dio.CheckpointManager(tmp_path / "ckpts") as manager:
        manager.save(1, {"x": np.arange(4)}, on_write_end=on_write_end).wait(TIMEOUT)
        manager.wait()
        assert sorted(raised) == ["close", "restore", "save", "wait"]
        for name, exc in raised.items():
            assert f"CheckpointManager.{name}() called from one of LocalDispatcher's own IO threads" in str(exc)
        assert manager.all_steps() == [1]                # not closed by the refused close()
        assert_trees_bit_equal(manager.restore(), {"x": np.arange(4)})


def test_close_from_another_thread_waits_for_a_save_that_has_begun(tmp_path):
    """close() (e.g. a preemption handler's thread) while save() copies its SYNC leaves: save()
    returns its handle, the step commits and retention runs; a save() after that is refused."""
    inside, release, close_progressed = threading.Event(), threading.Event(), threading.Event()
    outcome = {}

    def slow_transfer_end(keypath):           # stands in for a slow device-to-host copy
        inside.set()
        release.wait(TIMEOUT)

    def train():
        try:
            outcome["save"] = manager.save(2, {"x": np.full(4, 2.0)}, on_transfer_end=slow_transfer_end)
        except Exception as exc:  # noqa: BLE001 - recorded for the assertions
            outcome["save"] = exc

    def close():
        manager.close()
        close_progressed.set()

    with dio.LocalDispatcher(host_memory_budget=1 << 20) as dispatcher:
        manager = dio.CheckpointManager(tmp_path / "ckpts", dispatcher, max_to_keep=1)
        manager.save(1, {"x": np.ones(4)})
        manager.wait()
        trainer = threading.Thread(target=train)
        closer = threading.Thread(target=close)
        # close() waiting for the save, or done: either way it has progressed as far as it can.
        manager._save_lock = _SpiedLock(manager._save_lock,
                                        lambda: threading.current_thread() is closer and close_progressed.set())
        trainer.start()
        assert inside.wait(TIMEOUT)
        closer.start()
        assert close_progressed.wait(TIMEOUT)
        release.set()
        trainer.join(TIMEOUT)
        closer.join(TIMEOUT)
        assert not trainer.is_alive() and not closer.is_alive()
        assert isinstance(outcome["save"], dio.SaveHandle), outcome["save"]
        assert outcome["save"].done() and outcome["save"].wait(0).bytes_written > 0
        assert listing(tmp_path / "ckpts") == {"2"}      # committed, and retention ran before close() returned
        with pytest.raises(RuntimeError, match=r"CheckpointManager.save\(\) called after close\(\)"):
            manager.save(3, {"x": np.ones(4)})
        assert listing(tmp_path / "ckpts") == {"2"}


def test_close_from_inside_save_on_the_same_thread_raises(tmp_path):
    """The thread inside save() (its signal handler; here its priority callback) cannot wait for
    that save: close() there raises instead of blocking forever; the manager stays open."""
    with dio.CheckpointManager(tmp_path / "ckpts") as manager:
        def priority(keypath, spec):
            manager.close()

        with pytest.raises(RuntimeError) as info:
            manager.save(1, {"x": np.ones(4)}, priority=priority)
        errors = [info.value, info.value.__cause__]
        assert any("CheckpointManager.close() called by the thread inside its save()" in str(e) for e in errors)
        manager.save(1, {"x": np.ones(4)}).wait(TIMEOUT)
        assert manager.all_steps() == [1]


def test_leftovers_are_cleaned_only_when_provably_ours_and_dead(tmp_path, mesh):
    root = tmp_path / "ckpts"
    saved = {}
    with dio.CheckpointManager(root) as manager:
        for step in (3, 5, 6, 8):
            tree = step_tree(mesh, step)
            saved[step] = snapshot(tree)
            manager.save(step, tree)
    assert listing(root) == {"3", "5", "6", "8"}

    def interrupted(name, marker: bytes | None):
        """A temporary directory as a killed save leaves it: arrays written, no commit."""
        path = root / name
        shutil.copytree(root / "3" / "arrays", path / "arrays")
        if marker is not None:
            (path / WRITING).write_bytes(marker)
        return path

    dead = interrupted(".3.dispatch_io-tmp-0123456789ab", None)
    write_marker_from_dead_process(dead / WRITING)
    interrupted(".4.dispatch_io-tmp-abcdef012345", Marker.new().encode())  # this live process
    other = json.loads(Marker.new().encode())
    other["host"] = socket.gethostname() + "-elsewhere"
    other["pid"] = 999_999_999
    interrupted(".4.dispatch_io-tmp-0000000000ff", json.dumps(other).encode())   # another host
    unnamed = interrupted(".4.dispatch_io-tmp-nothex", None)               # not our name pattern
    write_marker_from_dead_process(unnamed / WRITING)

    os.rename(root / "5", root / "5.dispatch_io-old-1234abcd")               # killed between renames
    shutil.copytree(root / "6", root / "6.dispatch_io-old-0badcafe")         # killed before rmtree
    os.makedirs(root / "7.dispatch_io-old-abcd")                             # not a checkpoint
    (root / "7.dispatch_io-old-abcd" / "x").write_bytes(b"x")
    os.rename(root / "8", root / ".8.dispatch_io-deleting-feedbeef")         # killed mid-retention
    os.makedirs(root / ".9.dispatch_io-deleting-abcd")                       # not a checkpoint
    (root / ".9.dispatch_io-deleting-abcd" / "y").write_bytes(b"y")
    kept_as_is = {name: read_all(root / name) for name in [
        ".4.dispatch_io-tmp-abcdef012345", ".4.dispatch_io-tmp-0000000000ff", ".4.dispatch_io-tmp-nothex",
        "7.dispatch_io-old-abcd", ".9.dispatch_io-deleting-abcd"]}
    six = read_all(root / "6")

    with dio.CheckpointManager(root) as manager:
        assert listing(root) == {"3", "5", "6"} | set(kept_as_is), sorted(listing(root))
        for name, content in kept_as_is.items():
            assert read_all(root / name) == content, name
        assert read_all(root / "6") == six
        assert manager.all_steps() == [3, 5, 6]
        for step in (3, 5, 6):
            assert_trees_bit_equal(manager.restore(step), saved[step])


def test_donating_each_leaf_after_its_transfer_end(tmp_path, mesh, dispatcher_cls):
    rng = np.random.default_rng(0)
    priorities = {"sync_a": dio.Priority.SYNC, "sync_np": dio.Priority.SYNC, "high_b": dio.Priority.HIGH,
                  "high_np": dio.Priority.HIGH, "low_c": dio.Priority.LOW, "low_d": dio.Priority.LOW,
                  "low_np": dio.Priority.LOW}
    tree = {
        "sync_a": put(mesh, rng.standard_normal((16, 8)).astype(np.float32), "data", "model"),
        "sync_np": aligned(rng.integers(-9, 9, (9, 7)).astype(np.int16)),
        "high_b": put(mesh, rng.standard_normal((32, 4)).astype(np.float32), "data"),
        "high_np": aligned(rng.standard_normal((32, 4))),     # several chunks, 64-byte aligned
        "low_c": put(mesh, rng.integers(0, 1 << 30, (8, 16)).astype(np.int32), None, "model"),
        "low_d": put(mesh, rng.standard_normal((64,)).astype(np.float32), ("data", "model")),
        "low_np": aligned(rng.standard_normal((5, 11)).astype(np.float32)),
        "count": 17,
    }
    expected = snapshot(tree)
    by_keypath = {f"['{k}']": k for k in priorities}
    transfer_ends, write_ends, errors = [], [], []
    lock = threading.Lock()

    def on_transfer_end(keypath):
        try:
            with lock:
                transfer_ends.append(keypath)
            leaf = tree[by_keypath[keypath]]
            if isinstance(leaf, jax.Array):
                leaf.delete()                              # donate: the device buffer is gone
            else:
                leaf[...] = -1 if leaf.dtype.kind in "iu" else np.nan   # reuse the host buffer
        except BaseException as exc:  # noqa: BLE001 - reported below, not swallowed by the dispatcher
            errors.append(exc)

    def on_write_end(keypath):
        with lock:
            write_ends.append(keypath)

    root = tmp_path / "ckpts"
    dispatcher = dispatcher_cls(host_memory_budget=KiB, max_chunk_bytes=256)
    try:
        with dio.CheckpointManager(root, dispatcher) as manager:
            handle = manager.save(5, tree, priority=lambda k, s: priorities[by_keypath[k]],
                                  on_transfer_end=on_transfer_end, on_write_end=on_write_end)
            # SYNC leaves are off the device when save() returns: already donated.
            assert tree["sync_a"].is_deleted()
            assert np.all(tree["sync_np"] == -1)
            stats = handle.wait(TIMEOUT)
            assert stats.batches > 6 and stats.peak_host_bytes <= KiB
            assert not errors, errors
            assert sorted(transfer_ends) == sorted(by_keypath) and sorted(write_ends) == sorted(by_keypath)
            assert all(tree[k].is_deleted() for k in ("high_b", "low_c", "low_d"))
            assert np.isnan(tree["high_np"]).all() and np.isnan(tree["low_np"]).all()
            restored = manager.restore()
            assert_trees_bit_equal(restored, expected)
            # And onto devices (float64 stays on the host: x64 is off), replicated.
            target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P()))
                      if isinstance(v, np.ndarray) and v.dtype != np.float64 else v for k, v in expected.items()}
            assert_trees_bit_equal(manager.restore(5, target), expected)
    finally:
        dispatcher.close()


def test_copied_steps_restore_bit_exact(tmp_path, mesh):
    root = tmp_path / "ckpts"
    tree = step_tree(mesh, 3)
    expected = snapshot(tree)
    with dio.CheckpointManager(root) as manager:
        manager.save(3, tree).wait(TIMEOUT)

    # cp -r of one step into a new root
    copy_root = tmp_path / "copy"
    shutil.copytree(root / "3", copy_root / "3")
    with dio.CheckpointManager(copy_root) as manager:
        assert manager.all_steps() == [3]
        assert_trees_bit_equal(manager.restore(), expected)
    with dio.LocalDispatcher(host_memory_budget=64 * KiB) as d:
        assert_trees_bit_equal(d.restore(copy_root / "3"), expected)

    # file by file into a fresh directory, COMMITTED first, then the manifest, arrays last-to-first
    files = [rel for rel, data in read_all(root / "3").items() if data is not None]
    order = sorted(files, key=lambda rel: (rel != COMMITTED, rel != MANIFEST, [-ord(c) for c in rel]))
    assert order[0] == COMMITTED and order[1] == MANIFEST and len(order) > 4
    scrambled = tmp_path / "scrambled" / "3"
    for rel in order:
        os.makedirs((scrambled / rel).parent, exist_ok=True)
        shutil.copyfile(root / "3" / rel, scrambled / rel)
    assert read_all(scrambled) == read_all(root / "3")
    with dio.CheckpointManager(scrambled.parent) as manager:
        assert manager.all_steps() == [3]
        assert_trees_bit_equal(manager.restore(3), expected)
        meta = manager.metadata()
        assert meta["w"].shape == (8, 8) and meta["w"].dtype == np.float32


def test_api_edge_cases(tmp_path, mesh):
    root = tmp_path / "a" / "b" / "c"
    for bad in (dict(max_to_keep=0), dict(max_to_keep=-1), dict(max_to_keep=1.5), dict(max_to_keep=True),
                dict(max_to_keep=np.bool_(True)), dict(max_to_keep=2.0), dict(max_to_keep="2"),
                dict(keep_every_n_steps=0), dict(keep_every_n_steps=-4), dict(keep_every_n_steps=True),
                dict(keep_every_n_steps=np.int32(0))):
        with pytest.raises(ValueError, match=r"must be a positive integer or None"):
            dio.CheckpointManager(root, **bad)
    assert not os.path.exists(root)
    with dio.CheckpointManager(tmp_path / "np", max_to_keep=np.int64(2), keep_every_n_steps=jnp.int32(4)) as m:
        assert (m.max_to_keep, m.keep_every_n_steps) == (2, 4)        # integer scalars, as for steps
        assert type(m.max_to_keep) is int and type(m.keep_every_n_steps) is int
        assert m.steps_to_delete([1, 2, 3, 4, 5, 6]) == [1, 2, 3]
    with pytest.raises(ValueError, match="unsupported checkpoint URL 'nosuch://somewhere/'"):
        dio.CheckpointManager("nosuch://somewhere")
    with dio.CheckpointManager(f"file://{tmp_path}/url") as by_url:       # file:// is a directory
        assert by_url.root == os.fspath(tmp_path / "url") and os.path.isdir(tmp_path / "url")
        by_url.save(0, {"z": np.zeros(3, np.int8)})
    assert listing(tmp_path / "url") == {"0"}

    manager = dio.CheckpointManager(root)
    assert os.path.isdir(root) and listing(root) == set()       # a fresh root is created
    assert manager.all_steps() == [] and manager.latest_step() is None
    with pytest.raises(FileNotFoundError):
        manager.restore()
    with pytest.raises(FileNotFoundError):
        manager.metadata()
    tree = step_tree(mesh, 1)
    for bad_step in (-1, "3", 1.0, True, np.bool_(True), None, np.int32(-2)):
        with pytest.raises(ValueError):
            manager.save(bad_step, tree)
    assert listing(root) == set()
    manager.wait()                                               # nothing in flight: returns

    small = {"x": np.arange(6, dtype=np.uint8).reshape(2, 3), "s": "text"}
    manager.save(1, tree)
    manager.save(2, small)
    manager.wait()
    meta = manager.metadata()                                    # the latest step's
    assert isinstance(meta["x"], jax.ShapeDtypeStruct)
    assert (meta["x"].shape, meta["x"].dtype, meta["s"]) == ((2, 3), np.uint8, "text")
    manager.save(np.int64(3), small)                             # numpy / jax integer steps are steps
    manager.save(jnp.int32(4), small)
    manager.wait()
    assert manager.all_steps() == [1, 2, 3, 4]
    assert_trees_bit_equal(manager.restore(np.int64(3)), small)
    meta1 = manager.metadata(1)
    assert jax.tree.structure(meta1) == jax.tree.structure(tree)
    assert (meta1["w"].shape, meta1["w"].dtype) == ((8, 8), np.float32)
    assert (meta1["b"].shape, meta1["b"].dtype) == ((8,), np.int32)
    assert meta1["step"] == 1
    assert_trees_bit_equal(manager.restore(), small)

    manager.close()
    manager.close()                                              # twice is fine
    with pytest.raises(RuntimeError):
        manager.save(5, small)
    with pytest.raises(RuntimeError):
        manager.restore()
    with pytest.raises(RuntimeError):                            # the owned dispatcher is closed too
        manager.dispatcher.save(root / "9", small)
    assert listing(root) == {"1", "2", "3", "4"}


def test_barrier_timeout_with_a_dispatcher_of_ones_own_is_refused(tmp_path):
    """The manager cannot change a given dispatcher's options: barrier_timeout there would be
    silently ignored, so it is a ValueError naming the dispatcher option to set instead."""
    with dio.LocalDispatcher(host_memory_budget=1 << 20, barrier_timeout=30) as d:
        with pytest.raises(ValueError, match=r"barrier_timeout=10.*its Options.barrier_timeout is 30 s"):
            dio.CheckpointManager(tmp_path / "root", d, barrier_timeout=10)
        assert not (tmp_path / "root").exists()          # refused before anything was created
    with dio.CheckpointManager(tmp_path / "own", barrier_timeout=10) as manager:   # the manager's own: applied
        assert manager.dispatcher.options.barrier_timeout == 10


def test_save_from_the_thread_inside_save_raises_instead_of_deadlocking(tmp_path):
    """save() called by the thread inside save() (a signal handler, a priority callback) raises, as
    close() does, instead of blocking forever on its own lock: with the manager chaining the program's
    SIGTERM handler -- which in pre-manager loops is often an emergency save -- a SIGTERM during a save
    must not hang the job until SIGKILL."""
    try:
        out = subprocess.run([sys.executable, "-c", REENTRANT_SAVE, str(tmp_path / "root")],
                             capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("save() called from inside save() deadlocked")
    assert "RAISED" in out.stdout, out.stdout + out.stderr[-2000:]
