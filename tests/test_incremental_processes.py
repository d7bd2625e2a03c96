"""A real 2-process jax.distributed job saving incremental steps: each process decides for its
own chunks (process 0 writes nothing of a leaf only process 1's rows of which changed), the
commit records both processes' references, and every kept step restores bit for bit on both."""

import json
import os
import subprocess
import sys

from conftest import JOBS, free_port
from test_manager_multiprocess import LIMIT

JOB = os.path.join(JOBS, "incremental_job.py")


def test_two_processes_each_decide_for_their_chunks(tmp_path):
    root = tmp_path / "root"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, JOB, str(i), "2", str(port), str(root)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=LIMIT)
            outs.append(out)
            assert p.returncode == 0, out + err[-3000:]
    finally:
        for p in procs:
            p.kill()
    wrote = [{int(s): int(b) for s, b in (line.split()[1:] for line in out.splitlines() if line.startswith("wrote"))}
             for out in outs]
    rows, moving, half = 64, 64 * 128 * 4, 64 * 256 * 4        # each process's share of each leaf
    assert wrote[0][0] == wrote[1][0] == 2 * half + moving      # the first save writes everything
    for step in (1, 3):                                         # odd steps: process 1's half rows changed too
        assert (wrote[0][step], wrote[1][step]) == (moving, moving + half), step
    # Step 2: process 1's rows of ['half'] are as at step 1, but every chunk of its part changed at
    # step 1, so it only sampled them then (design.md, "Samples first"): written once more, digested.
    assert (wrote[0][2], wrote[1][2]) == (moving, moving + half)
    for out in outs:
        assert "exact 2 True" in out and "exact 3 True" in out, out
    doc = json.loads((root / "3" / "manifest.json").read_text())
    half_refs = next(leaf for leaf in doc["leaves"] if leaf["keypath"] == "['half']")["stored"]["refs"]
    frozen_refs = next(leaf for leaf in doc["leaves"] if leaf["keypath"] == "['frozen']")["stored"]["refs"]
    steps = {str(i): r["step"] for i, r in enumerate(doc["references"])}
    assert {steps[k] for k in frozen_refs} == {"0"}             # both processes' halves, from step 0
    assert sum(len(v) for v in frozen_refs.values()) == 2 * rows * 256 * 4 // (16 << 10)
    assert {steps[k] for k in half_refs} == {"0"}               # process 0's rows never changed
    # Step 0 retired, not deleted: the kept steps reference its bytes; step 1 deleted.
    assert sorted(os.listdir(root)) == ["0", "2", "3"]
    assert sorted(os.listdir(root / "0")) == ["RETAINED", "arrays", "info.json", "manifest.json"]
