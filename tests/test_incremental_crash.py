"""SIGKILL during incremental saves and during their retention (real processes): every committed
step still restores bit for bit, nothing committed is lost, and the next run's retention leaves
only kept steps and the retired steps they reference (no leak)."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import dispatch_io as dio
from dispatch_io import policies

from conftest import JOBS, ROOT
from incremental_crash_job import state   # tests/jobs/, on the path through conftest

JOB = os.path.join(JOBS, "incremental_crash_job.py")


def _run(root, steps, point="none", call=1):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, JOB, str(root), str(steps), point, str(call)], env=env,
                       capture_output=True, text=True, timeout=120)
    return p.returncode, [int(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("saved")], p.stderr


def _check_root(root, retention_ran=True):
    """Every committed step restores exactly; every directory is a committed step or a retired one
    (``retention_ran``: one a committed step references: nothing else is left)."""
    with dio.CheckpointManager(root, keep_policy=policies.LatestN(2), incremental=True) as mgr:
        steps = mgr.all_steps()
        for step in steps:
            back = mgr.restore(step)
            for key, value in state(step).items():
                assert np.array_equal(np.asarray(back[key]), value), (step, key)
        referenced = {int(r["step"]) for s in steps
                      for r in json.loads((root / str(s) / "manifest.json").read_text()).get("references", [])}
    on_disk = {int(name) for name in os.listdir(root)}
    assert on_disk >= set(steps) | referenced, (on_disk, steps, referenced)
    if retention_ran:
        assert on_disk == set(steps) | referenced, (on_disk, steps, referenced)
    for step in on_disk - set(steps):
        assert (root / str(step) / "RETAINED").exists()
    return steps


@pytest.mark.parametrize("point, call", [("retire-marked", 1), ("retired", 1), ("deleting", 1), ("commit", 3),
                                         ("retire-marked", 3)])
def test_sigkill_during_saves_and_retention_loses_nothing_and_leaks_nothing(tmp_path, point, call):
    root = tmp_path / "root"
    code, saved, err = _run(root, 8, point, call)
    assert code == -signal.SIGKILL, err[-3000:]
    listed = _check_root(root, retention_ran=False)   # a killed retention's leftovers wait for the next
    assert saved and saved[-1] in listed or point == "commit"   # the newest committed step is never lost
    code, saved_after, err = _run(root, max(listed, default=-1) + 4)   # the job resumes; retention runs again
    assert code == 0, err[-3000:]
    assert saved_after
    _check_root(root)
