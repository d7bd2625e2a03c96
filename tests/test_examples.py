"""The examples are documentation: run them as a user would, so they keep working."""

import os
import re
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


def _losses(out: str) -> dict[int, str]:
    """{step: the loss exactly as printed} from the example's ``step N loss X`` lines."""
    return {int(m[1]): m[2] for m in re.finditer(r"^step (\d+) loss (\S+)$", out, re.M)}


def _digest(out: str) -> str:
    return re.search(r"^params sha256 ([0-9a-f]{64})$", out, re.M)[1]


def test_train_and_checkpoint_example(tmp_path):
    """Stopped after step 25 and restarted, training resumes from step 20 and gives the same
    loss curve, bit for bit, and the same final params as an uninterrupted run."""
    args = ("--steps", "30", "--every", "10", "--keep", "2")
    full = run_example("train_and_checkpoint.py", "--root", str(tmp_path / "full"), *args, cwd=tmp_path)
    assert sorted(_losses(full)) == list(range(1, 31)), full
    for step in (10, 20):  # params SYNC, opt_state LOW: the next step waits before donating it
        waited = rf"^  step {step + 1} waited [0-9.]+ ms for the LOW optimizer state of step {step} "
        assert re.search(waited, full, re.M), full
    assert sorted(os.listdir(tmp_path / "full")) == ["20", "30"], full  # max_to_keep=2
    assert full.rstrip().endswith("OK"), full

    root = tmp_path / "resumed"
    stopped = run_example("train_and_checkpoint.py", "--root", str(root), *args, "--stop-after", "25", cwd=tmp_path)
    assert "no checkpoint under" in stopped and "stopping after step 25" in stopped, stopped
    assert _losses(stopped) == {s: loss for s, loss in _losses(full).items() if s <= 25}, stopped
    assert sorted(os.listdir(root)) == ["10", "20"], stopped

    resumed = run_example("train_and_checkpoint.py", "--root", str(root), *args, cwd=tmp_path)
    assert re.search(r"^restored step 20 in .* held as \(32, 256\) shards on 8 devices$", resumed, re.M), resumed
    assert _losses(resumed) == {s: loss for s, loss in _losses(full).items() if s > 20}, resumed
    assert _digest(resumed) == _digest(full), resumed
    assert sorted(os.listdir(root)) == ["20", "30"], resumed
    assert resumed.rstrip().endswith("OK"), resumed
