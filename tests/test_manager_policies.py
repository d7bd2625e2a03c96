"""CheckpointManager save and keep decisions: save policies with an injected clock, force, the
initial policy, decisions after a restart or for a step decided again, metric retention on disk,
retention off the save path and past a malformed step."""

import os
import threading

import numpy as np
import pytest

import dispatch_io as dio
from conftest import FakeClock
from dispatch_io import policies as P


TIMEOUT = 60


def tree(step):
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4) + step, "step": step}


def small_tree(step):
    return {"w": np.arange(6, dtype=np.float32) + step}


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

def test_save_policy_decides_and_force_overrides(tmp_path):
    clock = FakeClock()
    with dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(10) | P.EveryNSeconds(60), clock=clock) as mgr:
        decided = []
        for step in range(1, 31):
            clock.now += 7                          # 7 s a step: time-based saves every 9 steps
            if mgr.should_save(step):
                decided.append(step)
                assert mgr.save(step, tree(step)) is not None
            else:
                assert mgr.save(step, tree(step)) is None     # the policy says no: skipped
        assert mgr.save(31, tree(31), force=True) is not None  # a forced final save
        mgr.wait()
        assert decided == [9, 10, 19, 20, 29, 30]
        assert mgr.all_steps() == decided + [31]


def test_initial_policy_saves_only_into_an_empty_root(tmp_path):
    with dio.CheckpointManager(tmp_path, save_policy=P.Initial()) as mgr:
        assert mgr.should_save(0) and not mgr.should_save(0) is False   # one answer per step
        mgr.save(0, tree(0))
        assert not mgr.should_save(1)
    with dio.CheckpointManager(tmp_path, save_policy=P.Initial()) as mgr:
        assert not mgr.should_save(5)                                    # step 0 is committed


def test_best_n_on_disk_keeps_the_best_and_the_latest(tmp_path):
    losses = {1: 3.0, 2: 1.0, 3: 2.0, 4: 0.5, 5: 4.0, 6: 5.0}
    with dio.CheckpointManager(tmp_path, keep_policy=P.BestN(2, "eval_loss")) as mgr:
        for step, loss in losses.items():
            mgr.save(step, tree(step), metrics={"eval_loss": loss})
        mgr.wait()
        assert mgr.all_steps() == [2, 4, 6]           # the two best, and the newest (the worst)
        assert mgr.best_step() == 4 and mgr.best_step("eval_loss", "max") == 6
    assert sorted(os.listdir(tmp_path)) == ["2", "4", "6"]


def test_retention_never_delays_a_save(tmp_path, monkeypatch):
    """Deleting old steps (slow on object stores) runs on its own thread: the next save starts at once."""
    release = threading.Event()
    with dio.CheckpointManager(tmp_path, keep_policy=P.LatestN(1)) as mgr:
        real_delete = mgr._root.delete
        deleting = threading.Event()

        def slow_delete(step):
            deleting.set()
            assert release.wait(TIMEOUT)
            real_delete(step)

        monkeypatch.setattr(mgr._root, "delete", slow_delete)
        mgr.save(1, tree(1)).wait()
        mgr.save(2, tree(2)).wait()                    # commits; retention of step 1 starts
        assert deleting.wait(TIMEOUT)
        handle = mgr.save(3, tree(3))                  # not held up by the stuck delete
        handle.wait(TIMEOUT)
        assert 3 in mgr.all_steps() and 1 in mgr.all_steps()
        release.set()
        mgr.wait()                                     # waits for the retention too
        assert mgr.all_steps() == [3]


def test_on_steps_of_a_generator_keeps_its_steps():
    policy = P.OnSteps(s for s in (10, 20))
    assert policy.should_save(P.SaveState(10, 0.0, 0.0))


def test_policies_import_as_a_module():
    """``dispatch_io.policies`` is a module: besides ``from dispatch_io import policies as P``, the paths a
    user also writes (``import dispatch_io.policies as P``, ``from dispatch_io.policies import LatestN``)
    work -- the manager's own error message says "a dispatch_io.policies policy"."""
    import importlib
    assert importlib.import_module("dispatch_io.policies").LatestN is P.LatestN


def test_a_step_decided_again_is_not_answered_from_the_previous_decision():
    """A job that asks about a step a second time (it rolled back to its latest step after a NaN and
    trains steps 101.. again) gets process 0's new decision on every process, not its old answer kept by
    step number: with EveryNSeconds the processes would disagree and the save wait for the ones that
    skipped it."""
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
    """EveryNSeconds(900) after a restart counts from the last committed step's start time (in its info),
    not from when the manager opened: a job that crashes (OOM, a lost host: no SIGTERM, so no preemption
    save) more often than every 15 minutes must still save by time, not lose everything since the last
    step-based save at each restart."""
    clock = FakeClock()
    with dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(10_000) | P.EveryNSeconds(900), clock=clock) as mgr:
        mgr.save(100, small_tree(100), force=True).wait()
    clock.now += 1000                                  # the job died and restarts 1000 s after that save
    with dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(10_000) | P.EveryNSeconds(900), clock=clock) as mgr:
        assert mgr.should_save(101)


def test_should_save_is_false_for_a_step_already_saved(tmp_path):
    """With a save policy, should_save of a step <= the latest committed one is False: after a restart a
    loop that resumes *at* the latest step (Orbax's should_save answers False for any step <= its
    latest, so ported loops rely on it) is not told to save it again, where save() would raise
    FileExistsError (or ValueError for an older one) in the middle of training."""
    with dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(10)) as mgr:
        mgr.save(10, small_tree(10)).wait()
    with dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(10)) as mgr:
        assert not mgr.should_save(10)
        assert mgr.save(10, small_tree(10)) is None          # skipped like any step the policy does not save


def test_one_malformed_step_info_does_not_stop_retention_of_the_whole_root(tmp_path):
    """Retention reads every step's info; one unreadable info.json (hand-edited, truncated by a tool,
    written by a newer version) does not stop it: the step with the bad info may be kept, but the others
    are still retained as the policy says (else LatestN would never delete anything again and the disk
    fill)."""
    with dio.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, small_tree(1)).wait()
    (tmp_path / "1" / "info.json").write_text("{truncated")
    with dio.CheckpointManager(tmp_path, keep_policy=P.LatestN(1)) as mgr:
        for step in (2, 3, 4):
            mgr.save(step, small_tree(step)).wait()
            mgr.wait()
        assert 2 not in mgr.all_steps() and 3 not in mgr.all_steps(), mgr.all_steps()
