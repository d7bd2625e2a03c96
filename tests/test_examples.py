"""The examples are documentation: run them as a user would, so they keep working."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name: str, *args, cwd) -> str:
    """Run examples/<name> as a user would (it sets its own XLA_FLAGS); its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_save_restore_example(tmp_path):
    out = run_example("save_restore.py", str(tmp_path / "step_100"), cwd=tmp_path)
    assert "restored onto the same 4x2 mesh: bit-exact" in out and "restored onto a 2x4 mesh: bit-exact" in out, out
    assert out.rstrip().endswith("OK"), out
    assert os.path.isfile(tmp_path / "step_100" / "COMMITTED")


def test_multiprocess_save_example(tmp_path):
    out = run_example("multiprocess_save.py", str(tmp_path / "ckpt"), cwd=tmp_path)
    for i in (0, 1):
        assert f"process {i} of 2: 4 local devices of 8" in out, out
        assert f"process {i}: restored 12 leaves; every local shard is bit-exact" in out, out
    assert out.rstrip().endswith("OK"), out
    assert os.path.isfile(tmp_path / "ckpt" / "COMMITTED")
