"""The examples are documentation: run them as a user would, so they keep working."""

import os
import re
import signal
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
    """{step: the loss and the batch's digest exactly as printed} from the example's
    ``step N loss X batch D`` lines."""
    return {int(m[1]): m[2] for m in re.finditer(r"^step (\d+) loss (\S+ batch [0-9a-f]{12})$", out, re.M)}


def _digest(out: str) -> str:
    return re.search(r"^params sha256 ([0-9a-f]{64})$", out, re.M)[1]


def test_train_and_checkpoint_example(tmp_path):
    """Stopped after step 25 and restarted, training resumes from step 20 with the data loader
    where step 20 left it: the same batches and loss curve, bit for bit, and the same final
    params as an uninterrupted run."""
    args = ("--steps", "30", "--every", "10", "--keep", "2")
    full = run_example("train_and_checkpoint.py", "--root", str(tmp_path / "full"), *args, cwd=tmp_path)
    assert sorted(_losses(full)) == list(range(1, 31)), full
    for step in (10, 20):  # params SYNC, opt_state LOW: the next step waits before donating it
        waited = rf"^  step {step + 1} waited [0-9.]+ ms for the LOW optimizer state of step {step} "
        assert re.search(waited, full, re.M), full
    losses = {s: float(v.split()[0]) for s, v in _losses(full).items()}
    best = min((10, 20, 30), key=lambda s: (losses[s], -s))
    kept = sorted({"20", "30", str(best)}, key=int)               # LatestN(2) | BestN(1, "loss")
    assert sorted(os.listdir(tmp_path / "full"), key=int) == kept, full
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
    assert sorted(os.listdir(root), key=int) == kept, resumed
    assert resumed.rstrip().endswith("OK"), resumed


def test_train_and_checkpoint_example_saves_and_stops_on_sigterm(tmp_path):
    """A preemption: SIGTERM mid-run -> the next step is saved (with the loader's position), the
    program exits 0; the resumed run continues from that step exactly as an uninterrupted one."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    args = ("--steps", "40", "--every", "100", "--keep", "3")
    full = run_example("train_and_checkpoint.py", "--root", str(tmp_path / "full"), *args, cwd=tmp_path)
    root = tmp_path / "preempted"
    child = subprocess.Popen([sys.executable, os.path.join(ROOT, "examples", "train_and_checkpoint.py"),
                              "--root", str(root), *args, "--step-seconds", "0.2"],
                             env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not any(line.startswith("step 5 ") for line in lines):
            line = child.stdout.readline()
            assert line, "".join(lines) + child.stderr.read()
            lines.append(line)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    out = "".join(lines) + out
    assert child.returncode == 0, out + err
    stopped = re.search(r"^preempted: saved step (\d+), stopping$", out, re.M)
    assert stopped, out
    step = int(stopped[1])
    assert 5 <= step < 40 and max(_losses(out)) == step, out
    assert os.listdir(root) == [str(step)], out             # only the preemption's save (every=100)
    resumed = run_example("train_and_checkpoint.py", "--root", str(root), *args, cwd=tmp_path)
    assert _losses(resumed) == {s: v for s, v in _losses(full).items() if s > step}, resumed
    assert _digest(resumed) == _digest(full), resumed
