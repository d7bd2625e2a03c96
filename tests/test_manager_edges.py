"""CheckpointManager edge cases from an adversarial review of the manager package (each failed before its fix)."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import dispatch_io as dio
from conftest import FakeClock
from dispatch_io import policies as P

TIMEOUT = 120


def tree(step):
    return {"w": np.arange(6, dtype=np.float32) + step}


# ---- preemption -------------------------------------------------------------------------------

def test_sigterm_between_should_save_and_reached_preemption_never_stops_without_saving(tmp_path):
    """The loop of the issue: ``if should_save(s): save`` then ``if reached_preemption(s): wait;
    break``. A SIGTERM landing between the two calls (single process) must not make the loop
    stop at a step it did not save: the answers for one step must agree (JAX's sync point
    latches per step; the manager's own handler does not)."""
    program = signal.signal(signal.SIGTERM, lambda signum, frame: None)   # never lets SIGTERM end pytest
    mgr = dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(100) | P.Preemption())
    try:
        assert not mgr.should_save(5)
        os.kill(os.getpid(), signal.SIGTERM)          # arrives during the step's bookkeeping
        stops_here = mgr.reached_preemption(5)
        saved_here = mgr.should_save(5)
        assert not stops_here or saved_here, "the loop breaks at step 5, which it did not save"
    finally:
        mgr.close()
        signal.signal(signal.SIGTERM, program)


AFTER_CLOSE = r"""
import os, signal, sys, threading, time
import dispatch_io as dio
root = sys.argv[1]
if sys.argv[2] == "out-of-order":            # two managers (model and EMA, say), closed a then b
    a = dio.CheckpointManager(root + "/a")
    b = dio.CheckpointManager(root + "/b")
    a.close()
    b.close()
else:                                        # made on the main thread, closed by a teardown thread
    mgr = dio.CheckpointManager(root + "/a")
    closer = threading.Thread(target=mgr.close)
    closer.start()
    closer.join()
os.kill(os.getpid(), signal.SIGTERM)         # no manager is open: SIGTERM must end the program again
time.sleep(2)
print("SURVIVED SIGTERM", flush=True)
"""


@pytest.mark.parametrize("mode", ["out-of-order", "closed-from-a-thread"])
def test_once_every_manager_is_closed_sigterm_ends_the_program_again(tmp_path, mode):
    """close() puts the program's handler back only if its own is the one installed and it
    runs on the main thread: closing managers in another order than made (a, b; close a, then
    b puts a's back), or closing from another thread, leaves a closed manager's handler
    installed, and SIGTERM is swallowed for the rest of the program."""
    out = subprocess.run([sys.executable, "-c", AFTER_CLOSE, str(tmp_path), mode],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert "SURVIVED SIGTERM" not in out.stdout and out.returncode == -signal.SIGTERM, (out.returncode, out.stdout)


SIGTERM_WITHOUT_PREEMPTION = r"""
import os, signal, sys, time
import numpy as np
import dispatch_io as dio
with dio.CheckpointManager(sys.argv[1], max_to_keep=2) as mgr:   # a loop written before issue 25
    for step in range(3):
        mgr.save(step, {"w": np.zeros(4)})
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(2)
print("SURVIVED SIGTERM", flush=True)
"""


def test_a_manager_that_never_watches_preemption_does_not_swallow_sigterm(tmp_path):
    """A loop that never asks reached_preemption (every loop written for the old manager)
    used to be stopped by SIGTERM; now the manager's handler swallows it and the job runs on
    until the SIGKILL that follows the grace period, possibly mid-save. Installing the
    handler when the loop first asks (reached_preemption / should_save) keeps old loops as
    they were."""
    out = subprocess.run([sys.executable, "-c", SIGTERM_WITHOUT_PREEMPTION, str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert "SURVIVED SIGTERM" not in out.stdout and out.returncode == -signal.SIGTERM, (out.returncode, out.stdout)


# ---- untrusted step info ------------------------------------------------------------------------

def _edit_info(step_dir, **changes):
    path = step_dir / "info.json"
    info = json.loads(path.read_bytes())
    for key, value in changes.items():
        if key == "items":
            info["items"].update(value)
        else:
            info[key] = value
    path.write_text(json.dumps(info))


def test_an_item_name_in_info_json_cannot_read_outside_the_checkpoint(tmp_path):
    root = tmp_path / "root"
    with dio.CheckpointManager(root) as mgr:
        mgr.save(2, tree(2), items={"data": dio.Json(1)}).wait()
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "value.json").write_text('{"json": "read from outside the step"}')
    name = "../../../../secret"                  # root/2/arrays/items/<name>/value.json -> tmp_path/secret
    _edit_info(root / "2", items={name: {"kind": "json"}})
    with dio.CheckpointManager(root) as mgr:
        with pytest.raises((dio.CheckpointError, KeyError)):
            mgr.item(2, name)


def _inf_commit_time(info):
    info["committed"] = float("inf")
    return json.dumps(info)


def _huge_commit_time(info):
    info["committed"] = 1e300
    return json.dumps(info)


def _huge_int_metric(info):
    info["metrics"] = {"loss": 10 ** 400}        # a JSON integer: Python reads it, float() cannot
    return json.dumps(info)


def _deeply_nested_metadata(info):
    text = json.dumps(info)
    return text[:-1] + ', "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"


UNTRUSTED_INFO = [_inf_commit_time, _huge_commit_time, _huge_int_metric, _deeply_nested_metadata]
UNTRUSTED_IDS = ["inf-time", "huge-time", "huge-int-metric", "deep-nesting"]


def _root_with_info(root, craft):
    with dio.CheckpointManager(root) as mgr:
        mgr.save(1, tree(1)).wait()
    path = root / "1" / "info.json"
    path.write_text(craft(json.loads(path.read_bytes())))


@pytest.mark.parametrize("craft", [_inf_commit_time, _huge_int_metric, _deeply_nested_metadata],
                         ids=["inf-time", "huge-int-metric", "deep-nesting"])
def test_crafted_step_info_is_a_checkpoint_error_not_a_library_error(tmp_path, craft):
    """step_info / best_step / the policies on a step whose info.json is out of range must
    raise CheckpointError (or ignore the bad value), never OverflowError / RecursionError
    (which also kill every later retention: EveryNSeconds.keep floors the commit time, BestN
    calls isfinite on the metric)."""
    _root_with_info(tmp_path, craft)
    with dio.CheckpointManager(tmp_path) as mgr:
        try:
            info = mgr.step_info(1)
            mgr.best_step("loss")
            record = P.StepRecord(1, info.committed, info.metrics)
            P.EveryNSeconds(60).keep([record], 0.0)
            P.BestN(1, "loss").keep([record], 0.0)
        except dio.CheckpointError:
            pass


@pytest.mark.parametrize("craft", UNTRUSTED_INFO, ids=UNTRUSTED_IDS)
def test_inspect_of_a_root_with_crafted_step_info_is_one_line_exit_2(tmp_path, craft):
    _root_with_info(tmp_path / "root", craft)
    out = subprocess.run([sys.executable, "-m", "dispatch_io.cli", "inspect", str(tmp_path / "root")],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode in (0, 2) and "Traceback" not in out.stderr, (out.returncode, out.stderr[-600:])


def test_a_deeply_nested_item_file_is_a_checkpoint_error(tmp_path):
    with dio.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, tree(1), items={"cfg": dio.Json(1)}).wait()
    (tmp_path / "1" / "arrays" / "items" / "cfg" / "value.json").write_text(
        '{"json": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with dio.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(dio.CheckpointError):
            mgr.item(1, "cfg")


def test_one_malformed_step_info_does_not_stop_retention_of_the_whole_root(tmp_path):
    """Retention reads every step's info; one unreadable info.json (hand-edited, truncated by a
    tool, written by a newer version) makes every later retention raise (logged only), so
    LatestN never deletes anything again and the disk fills. The step with the bad info can be
    kept, but the others must still be retained as the policy says."""
    with dio.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, tree(1)).wait()
    (tmp_path / "1" / "info.json").write_text("{truncated")
    with dio.CheckpointManager(tmp_path, keep_policy=P.LatestN(1)) as mgr:
        for step in (2, 3, 4):
            mgr.save(step, tree(step)).wait()
            mgr.wait()
        assert 2 not in mgr.all_steps() and 3 not in mgr.all_steps(), mgr.all_steps()


# ---- policies ---------------------------------------------------------------------------------

def test_on_steps_of_a_generator_keeps_its_steps():
    policy = P.OnSteps(s for s in (10, 20))
    assert policy.should_save(P.SaveState(10, 0.0, 0.0))


def test_policies_import_as_a_module():
    """``from dispatch_io import policies as P`` works, but the module paths a user also writes
    (``import dispatch_io.policies as P``, ``from dispatch_io.policies import LatestN``) do not:
    ``policies`` is only an attribute of the package (the manager's own error message even
    says "a dispatch_io.policies policy")."""
    import importlib
    assert importlib.import_module("dispatch_io.policies").LatestN is P.LatestN


# ---- one decision for every process -------------------------------------------------------------

class _FakeCoordination:
    """The key-value part of JAX's coordination client, in memory (blocking get waits)."""

    def __init__(self):
        import threading
        self.values, self.cond = {}, threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.cond:
            assert allow_overwrite or key not in self.values
            self.values[key] = value
            self.cond.notify_all()

    def key_value_delete(self, key):
        with self.cond:
            self.values.pop(key, None)

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]


def test_a_step_decided_again_is_not_answered_from_the_previous_decision():
    """Decisions were keyed by step number alone. A job that asks about a step a second time
    (it rolled back to its latest step after a NaN and trains steps 101.. again) got process
    0's *old* answer on the other processes, while process 0 decided afresh: with
    EveryNSeconds the processes disagreed and the save waited for the ones that skipped it."""
    import threading
    from dispatch_io.multihost.coordination import Room
    from dispatch_io.manager.decisions import SharedDecisions
    client = _FakeCoordination()
    leader, other = (SharedDecisions(Room(client, p, 2, 5.0, "manager", "s3://b/run", "the manager")) for p in (0, 1))
    assert leader.decide(101, lambda: True) and other.decide(101, lambda: None)   # first pass: save
    answers = {}
    late = threading.Thread(target=lambda: answers.setdefault(1, other.decide(101, lambda: None)))
    late.start()                        # after the rollback, process 1 reaches step 101 first ...
    late.join(0.5)
    answers[0] = leader.decide(101, lambda: False)   # ... process 0's clock says: no save this time
    late.join(10)
    assert answers[1] == answers[0], answers
    with pytest.raises(dio.CheckpointError, match=r"process 0 asked whether to save step 102 where this process "
                                                  r"asked about step 103"):
        leader.decide(102, lambda: True)
        other.decide(103, lambda: None)


def test_every_n_seconds_after_a_restart_counts_from_the_last_committed_save(tmp_path):
    """EveryNSeconds(900) measures from when the manager opened, not from the last save: a job
    that crashes (OOM, a lost host: no SIGTERM, so no preemption save) more often than every
    15 minutes never saves by time again, and each restart loses everything since the last
    step-based save. The last committed step's info has its start time: count from it."""
    clock = FakeClock()
    with dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(10_000) | P.EveryNSeconds(900), clock=clock) as mgr:
        mgr.save(100, tree(100), force=True).wait()
    clock.now += 1000                                  # the job died and restarts 1000 s after that save
    with dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(10_000) | P.EveryNSeconds(900), clock=clock) as mgr:
        assert mgr.should_save(101)


ITEMS_DIFFER_JOB = r"""
import sys
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
import dispatch_io as dio
process, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", 2, process)
sharding = NamedSharding(jax.make_mesh((2,), ("data",)), PartitionSpec("data"))
state = jax.make_array_from_callback((8,), sharding, lambda index: np.arange(8, dtype=np.float32)[index])
with dio.CheckpointManager(root, barrier_timeout=30) as mgr:
    # process 1's loader is not set up yet (or it forgot the item): only process 0 passes it
    items = {"data": dio.PerProcess(b"p0-state")} if process == 0 else {}
    try:
        mgr.save(1, state, items=items).wait()
        mgr.wait()
        print("SAVED", flush=True)
    except Exception as exc:
        print("SAVE FAILED", type(exc).__name__, flush=True)
    if 1 in mgr.all_steps():
        try:
            print("ITEM", mgr.item(1, "data"), flush=True)
        except Exception as exc:
            print("ITEM FAILED", type(exc).__name__, str(exc)[:200], flush=True)
jax.distributed.shutdown()
"""


def test_a_step_whose_processes_passed_different_items_is_never_committed_half_there(tmp_path):
    """Items commit "atomically together", but the step info is process 0's alone: when the
    processes pass different item names, the step commits listing a PerProcess item that
    process 1 never wrote, and process 1 finds it "listed but its file is missing (malformed
    checkpoint)" on resume. The processes should agree on the item names (as they agree on
    checksums before the commit) and fail the save otherwise, naming the item and processes."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", ITEMS_DIFFER_JOB, str(i), str(port), str(tmp_path / "root")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT)[0])
    finally:
        for p in procs:
            p.kill()
    for out in outs:
        assert "ITEM FAILED" not in out, outs


def test_should_save_is_false_for_a_step_already_saved(tmp_path):
    """After a restart a loop that resumes *at* the latest step (Orbax's should_save answers
    False for any step <= its latest, so ported loops rely on it) is told to save it again, and
    save() then raises FileExistsError (or ValueError for an older one) in the middle of
    training. With a save policy, should_save of a step <= the latest committed one is False."""
    with dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(10)) as mgr:
        mgr.save(10, tree(10)).wait()
    with dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(10)) as mgr:
        assert not mgr.should_save(10)
        assert mgr.save(10, tree(10)) is None          # skipped like any step the policy does not save


def test_step_info_of_a_step_not_yet_committed_on_an_object_store_is_file_not_found(s3_prefix):
    """On an object store info.json is written just before COMMITTED (and is left behind by a
    save killed between the two, until a manager on that host cleans up). step_info reads
    info.json first and only checks the commit when there is none, so a step that is not
    committed (and may never be) reports info: "a step has its info exactly when committed"
    (docs/format.md) does not hold for readers."""
    import tensorstore as ts
    from dispatch_io.storage import kvstore_spec
    with dio.CheckpointManager(s3_prefix) as mgr:
        mgr.save(1, tree(1), metrics={"loss": 1.0}).wait()
        kv = ts.KvStore.open(kvstore_spec(s3_prefix + "/")).result()
        kv.write("2/info.json", kv.read("1/info.json").result().value).result()   # step 2 mid-commit
        assert mgr.all_steps() == [1]
        with pytest.raises(FileNotFoundError):
            mgr.step_info(2)


def test_an_orbax_steps_nan_metric_reads_as_none_and_inspect_json_stays_json(tmp_path, capsys):
    """StepInfo.metrics is documented "None where it was NaN" (ours are); an Orbax step's NaN
    metric (Orbax's metrics item holds {"loss": NaN}) comes back as NaN, and
    ``dispatch-io inspect --json`` prints a bare NaN, which is not JSON (jq, JSON.parse fail)."""
    import orbax.checkpoint as ocp
    from dispatch_io import cli
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    orbax_mgr = ocp.CheckpointManager(str(tmp_path), options=options)
    orbax_mgr.save(7, args=ocp.args.StandardSave({"w": np.arange(3.0)}), metrics={"loss": float("nan")})
    orbax_mgr.wait_until_finished()
    orbax_mgr.close()
    with dio.CheckpointManager(tmp_path) as mgr:
        assert mgr.step_info(7).metrics == {"loss": None}
    assert cli.main(["inspect", str(tmp_path), "--json"]) == 0

    def strict(constant):
        raise ValueError(f"not JSON: {constant}")
    json.loads(capsys.readouterr().out, parse_constant=strict)


def test_step_info_read_while_an_overwrite_is_in_flight_is_not_kept_after_it_commits(tmp_path):
    """save(step, overwrite=True) drops the cached info of the step right after handing the save
    to the dispatcher, not when it commits: reading the step's info meanwhile (the loop, or
    retention of the previous save, which reads every step's info on its own thread) caches
    the *replaced* step's info for good (directory roots keep the old step listed until the
    commit), so its metrics feed BestN / best_step stale and inspect-by-manager disagrees with
    the disk."""
    import threading
    with dio.CheckpointManager(tmp_path) as mgr:
        mgr.save(5, tree(5), items={"data": dio.PerProcess(b"old")}, metrics={"loss": 1.0}).wait()
        release = threading.Event()
        handle = mgr.save(5, tree(6), items={"data": dio.PerProcess(b"new")}, metrics={"loss": 2.0},
                          overwrite=True, on_write_end=lambda keypath: release.wait(TIMEOUT))
        try:
            mgr.step_info(5)                   # while the overwrite is being written
        finally:
            release.set()
        handle.wait()
        mgr.wait()
        assert mgr.step_info(5).metrics == {"loss": 2.0}


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


def test_save_from_the_thread_inside_save_raises_instead_of_deadlocking(tmp_path):
    """close() raises RuntimeError when called by the thread inside save() (a signal handler, a
    priority callback); save() itself does not check and blocks forever on its own lock. With
    the manager now chaining the program's SIGTERM handler -- which in pre-manager loops is
    often an emergency save -- a SIGTERM during a save hangs the job until SIGKILL."""
    try:
        out = subprocess.run([sys.executable, "-c", REENTRANT_SAVE, str(tmp_path / "root")],
                             capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("save() called from inside save() deadlocked")
    assert "RAISED" in out.stdout, out.stdout + out.stderr[-2000:]


def test_an_orbax_root_on_an_object_store_is_not_silently_empty(tmp_path, s3_prefix):
    """MaxText keeps its Orbax checkpoints on an object store (gs://). A manager on the same root
    as an object-store URL once reported no step at all -- latest_step() None, the ported loop
    starting again from step 0. It lists them (tests/test_orbax_object_stores.py reads them)."""
    import orbax.checkpoint as ocp
    import tensorstore as ts
    from dispatch_io.storage import kvstore_spec
    local = tmp_path / "orbax"
    orbax_mgr = ocp.CheckpointManager(str(local))
    orbax_mgr.save(7, args=ocp.args.StandardSave({"w": np.arange(6.0)}))
    orbax_mgr.wait_until_finished()
    orbax_mgr.close()
    kv = ts.KvStore.open(kvstore_spec(s3_prefix + "/")).result()
    for folder, _, names in os.walk(local):            # the same root, as gsutil cp -r would put it
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                kv.write(os.path.relpath(path, local), f.read()).result()
    with dio.CheckpointManager(s3_prefix) as mgr:
        assert mgr.all_steps() == [7] and mgr.latest_step() == 7
