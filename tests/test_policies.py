"""Save and keep policies: pure decisions from plain data, with an injected clock (no IO, no sleeps)."""

import math

import numpy as np
import pytest

from dispatch_io import policies as P
from dispatch_io.manager.step_policies import SaveState, StepRecord, check, keep_policy
from dispatch_io.manager.retention import steps_to_delete


def state(step, now=0.0, last_save=0.0, last_saved_step=None, preempted=False):
    return SaveState(step, now, last_save, last_saved_step, preempted)


def records(*steps, metrics=None, committed=None):
    metrics = metrics or {}
    committed = committed or {}
    return [StepRecord(s, committed.get(s), metrics.get(s, {})) for s in steps]


def test_save_policies_decide_from_the_step_and_the_clock():
    every = P.EveryNSteps(100)
    assert [s for s in range(0, 401, 50) if every.should_save(state(s))] == [0, 100, 200, 300, 400]
    on = P.OnSteps([3, 7, np.int64(9)])
    assert [s for s in range(12) if on.should_save(state(s))] == [3, 7, 9]
    timed = P.EveryNSeconds(900)
    assert not timed.should_save(state(5, now=1899.9, last_save=1000.0))
    assert timed.should_save(state(5, now=1900.0, last_save=1000.0))
    assert P.Initial().should_save(state(0, last_saved_step=None))
    assert not P.Initial().should_save(state(10, last_saved_step=9))
    assert P.Preemption().should_save(state(17, preempted=True))
    assert not P.Preemption().should_save(state(17))


def test_any_of_flattens_and_answers_any():
    policy = P.EveryNSteps(1000) | P.EveryNSeconds(60) | P.Preemption()
    assert isinstance(policy, P.AnyOf) and len(policy.policies) == 3
    assert policy.saves and not policy.keeps and policy.uses_clock
    assert not policy.should_save(state(7, now=59, last_save=0))
    assert policy.should_save(state(7, now=60, last_save=0))          # the clock
    assert policy.should_save(state(2000, now=1, last_save=0))        # the step
    assert policy.should_save(state(7, now=1, last_save=0, preempted=True))
    assert not (P.EveryNSteps(10) | P.OnSteps([5])).uses_clock


def test_keep_policies():
    steps = records(0, 100, 200, 300, 400, 500)
    assert P.LatestN(2).keep(steps, 0) == {400, 500}
    assert P.EveryNSteps(200).keep(steps, 0) == {0, 200, 400}
    assert P.OnSteps([100, 999]).keep(steps, 0) == {100}
    loss = {0: {"loss": 5.0}, 100: {"loss": 1.0}, 200: {"loss": 3.0}, 300: {"loss": 1.0}, 400: {}, 500: {"loss": float("nan")}}
    scored = records(0, 100, 200, 300, 400, 500, metrics=loss)
    assert P.BestN(2, "loss").keep(scored, 0) == {100, 300, 400, 500}              # no metric (or NaN): kept
    assert P.BestN(2, "loss", keep_without_metric=False).keep(scored, 0) == {100, 300}
    assert P.BestN(1, "loss", keep_without_metric=False).keep(scored, 0) == {300}   # a tie: the newer
    assert P.BestN(1, "loss", mode="max", keep_without_metric=False).keep(scored, 0) == {0}


def test_best_n_with_latest_n_never_loses_the_latest_step():
    """Orbax #526: best_fn + max_to_keep evicted the step a run needed to resume from."""
    metrics = {s: {"loss": float(s)} for s in range(0, 1000, 100)}   # getting worse: newest is worst
    steps = records(*range(0, 1000, 100), metrics=metrics)
    assert steps_to_delete(steps, P.BestN(2, "loss", keep_without_metric=False), 0) == list(range(200, 900, 100))
    assert steps_to_delete(steps, P.BestN(2, "loss") | P.LatestN(1), 0) == list(range(200, 900, 100))
    assert steps_to_delete(steps, P.LatestN(2) | P.BestN(3, "loss"), 0) == [300, 400, 500, 600, 700]
    assert steps_to_delete(steps, None, 0) == []
    assert steps_to_delete([], P.LatestN(1), 0) == []


def test_temporary_time_based_steps_go_once_a_newer_one_commits():
    """Levanter / big_vision: permanent steps every N, temporary ones by time, kept only while newest."""
    save = P.EveryNSteps(1000) | P.EveryNSeconds(900)
    keep = P.EveryNSteps(1000) | P.LatestN(1)
    now, last_save, saved = 0.0, 0.0, []
    for step in range(1, 3001):
        now += 1.0                      # a step takes a second
        if save.should_save(state(step, now, last_save)):
            saved.append(step)
            last_save = now
    assert saved == [900, 1000, 1900, 2000, 2900, 3000]
    assert steps_to_delete(records(*saved[:-1]), keep, now) == [900, 1900]     # 2900 is the newest then
    assert steps_to_delete(records(*saved), keep, now) == [900, 1900, 2900]


def test_every_n_seconds_keeps_one_step_per_window():
    committed = {1: 10.0, 2: 50.0, 3: 130.0, 4: 170.0, 5: 250.0, 6: None}
    steps = records(*committed, committed=committed)
    assert P.EveryNSeconds(100).keep(steps, 300) == {1, 3, 5}     # the first of each 100 s window
    assert steps_to_delete(steps, P.EveryNSeconds(100), 300) == [2, 4]   # 6: the newest, always kept


@pytest.mark.parametrize("make, message", [
    (lambda: P.EveryNSteps(0), r"EveryNSteps\(n\) must be a positive integer, got 0"),
    (lambda: P.EveryNSteps(True), r"positive integer, got True"),
    (lambda: P.EveryNSteps(2.0), r"positive integer, got 2.0"),
    (lambda: P.LatestN(-1), r"LatestN\(n\)"),
    (lambda: P.EveryNSeconds(0), r"positive number of seconds"),
    (lambda: P.EveryNSeconds(math.inf), r"positive number of seconds"),
    (lambda: P.OnSteps([1, -2]), r"non-negative integers, got -2"),
    (lambda: P.BestN(2, ""), r"metric's name"),
    (lambda: P.BestN(2, "loss", mode="lowest"), r"'min' or 'max'"),
])
def test_bad_arguments_are_value_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_policy_in_the_wrong_role_is_a_type_error():
    with pytest.raises(TypeError, match=r"LatestN\(n=2\) cannot be part of a save_policy"):
        check(P.EveryNSteps(10) | P.LatestN(2), "save")
    with pytest.raises(TypeError, match=r"Preemption\(\) cannot be part of a keep_policy"):
        check(P.LatestN(2) | P.Preemption(), "keep")
    with pytest.raises(TypeError, match=r"save_policy must be a dispatch_io.policies policy"):
        check(100, "save")
    with pytest.raises(TypeError, match="is not a keep policy"):
        P.Initial().keep([], 0)
    assert check(None, "keep") is None


def test_shorthands_mean_latest_n_or_every_n_steps():
    policy, m, k = keep_policy(None, np.int64(3), 1000)
    assert (m, k) == (3, 1000) and policy == P.LatestN(3) | P.EveryNSteps(1000)
    assert keep_policy(None, None, 1000)[0] is None          # keep_every_n_steps alone keeps everything
    with pytest.raises(ValueError, match="not both"):
        keep_policy(P.LatestN(2), 3, None)
