"""``benchmarks/gpu.py --quick`` runs on CPU devices, end to end, so the GPU benchmark cannot rot:
its children save, restore (bit for bit), time a training step beside a LOW save, and the
parent writes its tables and a verdict against issue 43's targets. The verdict logic itself is
checked on made-up figures."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from gpu_targets import MiB, SIZES, leaf_sizes, verdict  # noqa: E402


def test_leaf_sizes_span_1_mib_to_1_gib():
    sizes = leaf_sizes(8192 * MiB)   # one of each, six more of 1 GiB, the rest filled largest first
    assert sizes[:6] == list(SIZES) and sizes[6:12] == [1024 * MiB] * 6 and min(sizes) == MiB
    assert sum(leaf_sizes(8192 * MiB)) == 8192 * MiB
    assert leaf_sizes(24 * MiB) == [MiB, 4 * MiB, 16 * MiB, MiB, MiB, MiB]


def test_the_verdict_names_each_missed_target():
    run = {"bytes": 8 << 30, "save1_s": 0.65, "save2_s": 0.6, "restore_s": 0.7, "async_blocked_s": 0.002,
           "sync_blocked_s": 0.04, "save_rss": 900 * MiB, "bit_exact": True}
    peer = {"bytes": 8 << 30, "save2_s": 1.5, "restore_s": 1.2}
    step = {"alone": {"median_ms": 6.0, "max_ms": 7.0}, "dispatch_io": {"median_ms": 6.1, "max_ms": 45.0}}
    line, checks = verdict({"dispatch_io": [run], "orbax": [peer]}, step, 1 << 30)
    assert line.startswith("verdict: 2 of 11 targets missed")
    missed = {name for name, (_, ok) in checks.items() if not ok}
    assert missed == {"restore >= 1.8x best peer", "step max beside LOW save <= 1.5x"}, missed
    assert verdict({}, {}, 1 << 30)[0] == "verdict: nothing measured"


def test_quick_runs_on_cpu(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)   # one device, as the GPU run has
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--quick",
                          "--out", str(tmp_path / "out"), "--root", str(tmp_path / "root")],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    (run,) = results["runs"]["dispatch_io"]
    assert "error" not in run, run
    assert run["bit_exact"] and run["bytes"] >= 24 * MiB
    assert {"alone", "dispatch_io"} <= set(results["step"]), results["step"]
    assert results["verdict"].startswith("verdict (on cpu")
    assert results["verdict"] in (tmp_path / "out" / "results.md").read_text()
