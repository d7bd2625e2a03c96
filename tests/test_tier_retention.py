"""Local retention: which local steps the keep policy keeps -- by their commit times, by the metrics
local steps carry, and alike on every process of a real 2-process job (tests/jobs/job_local_retention.py)."""

import re

import pytest

import dispatch_io as dio
from conftest import filled, finish_job, one_leaf, start_job
from dispatch_io import policies


def test_local_retention_by_time_reads_the_local_steps_commit_times(tmp_path, mesh):
    """LocalTier(keep_policy=EveryNSeconds(3600)): one local step per hour. Local retention reads the
    commit time each local step's info.json records, so with saves 4000 s apart every local step is
    kept (each the first of its window) -- not only the latest (a save killed next would leave
    nothing)."""
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
    """Local steps carry the step's metrics (``save(..., metrics=)``, in each local step's info:
    docs/manager.md "Items in local steps"), and local retention passes them to the keep policy, as the
    persistent retention does from the step info: ``LocalTier(keep_policy=BestN(1, metric="loss"))``
    keeps the best step and the latest, whether ``keep_without_metric`` is True (else it would never
    delete anything: the RAM disk fills up) or False (else it would delete the best step at once)."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}",
                         keep_policy=policies.BestN(1, metric="loss", keep_without_metric=keep_without_metric))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        for step, loss in ((2, 0.1), (4, 0.9), (6, 0.5)):
            mgr.save(step, filled(mesh, step), metrics={"loss": loss}, local=True)
        mgr.wait()
        assert mgr.local.infos()[0][6]["metrics"] == {"loss": 0.5}   # the metrics are recorded...
        assert mgr.local.steps() == [2, 6]                          # ...the best and the latest kept


def test_local_retention_keeps_the_same_steps_on_every_process(tmp_path):
    """Local retention decides alike on every process of a job: a time-reading keep policy
    (``EveryNSeconds``: the first step committed in each window) reads one commit time per step, process
    0's clock at its save, shared. Here each process's commit times are 2 s apart (one process's save a
    little slower, or clocks a little off); by their own times process 0 would keep [0, 2, 12] and process
    1 [0, 10, 12], so steps 2 and 10 would no longer be whole in the job (each process deleting its part
    of the other's) while each spent RAM disk on a step nobody can restore.

    Why it matters: a local step is only useful whole; the keep policy's promise ("one step per window")
    must hold per job, not per process."""
    procs = start_job("job_local_retention.py", [tmp_path / "root", tmp_path / "local" / "{process}"], processes=2,
                      devices=1)
    outs = finish_job(procs)
    kept = [re.search(r"^local steps (\[.*\])$", out, re.M)[1] for out in outs]
    assert kept[0] == kept[1], f"local steps kept by process 0: {kept[0]}, by process 1: {kept[1]}"
    # Each step's one time is process 0's clock at its save (1000 + 10 step - 1), shared:
    # the first step of each 100 s window (999 -> 0, 1019 -> 2, 1119 -> 12), and the newest, on both.
    assert kept[0] == "[0, 2, 12]", kept
