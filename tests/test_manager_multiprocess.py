"""A real 2-process jax.distributed job under CheckpointManager: one save decision for every
process although their clocks disagree, and a preemption (SIGTERM to one process) that every
process stops at, having saved the same step; the restarted job resumes after it."""

import os
import re
import signal
import subprocess
import sys
import time

from conftest import JOBS, finish_job, free_port


JOB = os.path.join(JOBS, "job_preemption.py")
LIMIT = 120


def _start(root, steps, skews):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    port = free_port()
    return [subprocess.Popen([sys.executable, JOB, str(i), str(len(skews)), str(port), str(root), str(steps), str(skew)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i, skew in enumerate(skews)]


def _saved(out):
    return [int(s) for s in re.findall(r"^saved (\d+)$", out, re.M)]

def test_preemption_stops_every_process_at_one_saved_step_and_skewed_clocks_agree(tmp_path):
    root = tmp_path / "root"
    procs = _start(root, 400, skews=[0.0, 3600.0])      # process 1's clock is an hour ahead
    try:
        lines = []
        deadline = time.monotonic() + LIMIT
        while not any(line.startswith("step 12") for line in lines):   # past the first time-based saves
            assert time.monotonic() < deadline
            line = procs[0].stdout.readline()
            assert line, "".join(lines) + procs[0].stderr.read()[-3000:]
            lines.append(line)
        procs[1].send_signal(signal.SIGTERM)             # the preemption notice reaches one process
        outs = finish_job(procs)
    finally:
        for p in procs:
            p.kill()
    outs[0] = "".join(lines) + outs[0]
    stopped = [re.search(r"^preempted (\d+)$", out, re.M) for out in outs]
    assert all(stopped), outs
    step = int(stopped[0][1])
    assert int(stopped[1][1]) == step and 12 <= step < 400, outs
    assert _saved(outs[0]) == _saved(outs[1]) and _saved(outs[0])[-1] == step, outs   # one decision each time
    assert len(_saved(outs[0])) >= 2, outs                                           # time-based ones too
    resumed = finish_job(_start(root, step + 3, skews=[0.0, 0.0]))
    for i, out in enumerate(resumed):
        assert f"resumed {step} item p{i}-s{step} exact True" in out, out
        assert re.findall(r"^step (\d+)$", out, re.M) == [str(s) for s in range(step + 1, step + 3)], out
