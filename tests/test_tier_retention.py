"""Local retention: which local steps the keep policy keeps -- by their commit times, by the metrics
local steps carry, and alike on every process of a real 2-process job (tests/job_local_retention.py)."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from conftest import finish_job, one_leaf, start_job
from dispatch_io import policies


def _full(mesh, value):
    return {"w": jax.device_put(np.full((64, 16), value, np.float32), NamedSharding(mesh, P("data", "model")))}

def test_local_retention_by_time_reads_the_local_steps_commit_times(tmp_path, mesh):
    """LocalTier(keep_policy=EveryNSeconds(3600)): one local step per hour. Local retention builds
    StepRecord(step) without the commit time its info.json records, so EveryNSeconds keeps none
    of them and every local step but the latest is deleted (a save killed next leaves nothing)."""
    _, state = one_leaf(mesh)
    now = [0.0]
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2),
                         keep_policy=policies.EveryNSeconds(3600))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier,
                               clock=lambda: now[0]) as mgr:
        for step in range(1, 7):
            now[0] = step * 4000.0          # local saves at 8000, 16000, 24000 s: three windows
            if mgr.should_save(step):
                mgr.save(step, state(step))
                mgr.wait()
        assert mgr.local.steps() == [2, 4, 6], mgr.local.steps()


@pytest.mark.parametrize("keep_without_metric", [True, False])
def test_a_local_best_n_keep_policy_sees_the_metrics_local_steps_carry(tmp_path, mesh, keep_without_metric):
    """Finding: local steps carry the step's metrics (``save(..., metrics=)``, in each local step's
    info: docs/manager.md "Items in local steps"), and ``LocalTier(keep_policy=...)`` takes any keep
    policy, ``BestN`` included -- but the local retention (``LocalTiers._finish``) builds its
    ``StepRecord``s without the metrics. So ``BestN(1, metric="loss")`` on the local tier sees no
    step scored: with ``keep_without_metric=True`` (the default) it never deletes anything (the RAM
    disk fills up), with ``False`` it deletes the best step at once, keeping only the latest.

    Why it matters: a local keep policy bounds RAM-disk use; BestN is accepted silently and does
    the opposite of what it says.

    A fix should pass each local step's recorded metrics to the keep policy (as the persistent
    retention does from the step info), or refuse a metric-reading keep policy for the local tier."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}",
                         keep_policy=policies.BestN(1, metric="loss", keep_without_metric=keep_without_metric))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        for step, loss in ((2, 0.1), (4, 0.9), (6, 0.5)):
            mgr.save(step, _full(mesh, step), metrics={"loss": loss}, local=True)
        mgr.wait()
        assert mgr.local.infos()[0][6]["metrics"] == {"loss": 0.5}   # the metrics are recorded...
        assert mgr.local.steps() == [2, 6]                          # ...the best and the latest kept


def test_local_retention_keeps_the_same_steps_on_every_process(tmp_path):
    """Finding: each process applies the local keep policy to its own local steps' commit times
    (``LocalTiers._finish``: ``StepRecord(step, info["committed"])`` of its own info), with no
    agreement. A time-reading keep policy (``EveryNSeconds``: the first step committed in each
    window) then keeps different steps on different processes wherever one step's commits straddle
    a window boundary -- here commit times 2 s apart (one process's save a little slower, or clocks
    a little off): process 0 keeps steps [0, 2, 12], process 1 [0, 10, 12]. Steps 2 and 10 are not
    whole in the job any more (each process deleted its part of the other's), so the older restore
    points the policy was meant to keep are lost, while each process still spends RAM disk on a step
    nobody can restore. (Local *save* decisions are agreed -- process 0 decides for a clock-reading
    policy with replicas --; local retention is not.)

    Why it matters: a local step is only useful whole; the keep policy's promise ("one step per
    window") holds per process, not per job.

    A fix should make local retention decide alike on every process: e.g. use one commit time per
    step for the whole job (process 0's, shared as save decisions are, or the step's ``started``
    time, identical everywhere), or let process 0 decide which local steps everyone keeps."""
    procs = start_job("job_local_retention.py", [tmp_path / "root", tmp_path / "local" / "{process}"], processes=2,
                      devices=1)
    outs = finish_job(procs)
    kept = [re.search(r"^local steps (\[.*\])$", out, re.M)[1] for out in outs]
    assert kept[0] == kept[1], f"local steps kept by process 0: {kept[0]}, by process 1: {kept[1]}"
    # Fixed (issue 35): each step's one time is process 0's clock at its save (1000 + 10 step - 1), shared:
    # the first step of each 100 s window (999 -> 0, 1019 -> 2, 1119 -> 12), and the newest, on both.
    assert kept[0] == "[0, 2, 12]", kept
