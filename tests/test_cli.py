"""The ``dispatch-io`` command line: inspect and verify, run as a separate process on a machine
with a single CPU device (the checkpoints are saved here, on the 8-device mesh)."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io.storage import sealed
import storage_helpers as sh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args):
    """Run ``dispatch-io ARGS`` with one CPU device; (exit status, stdout, stderr)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-m", "dispatch_io.cli", *map(str, args)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture
def saved(tmp_path, mesh):
    tree = {
        "params": {"w": jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
                                       NamedSharding(mesh, P("data", "model"))),
                   "b": np.arange(3.0)},
        "rng": jax.random.key(0),
        "step": 7,
    }
    path = tmp_path / "ckpt"
    with dio.LocalDispatcher(host_memory_budget=1 << 20, checksums=True) as d:
        d.save(path, tree).wait(60)
    return path


def test_inspect_lists_every_leaf_with_shape_dtype_sharding_and_bytes(saved):
    code, out, err = cli("inspect", saved)
    assert code == 0, err
    lines = out.splitlines()
    w = next(line for line in lines if line.startswith("['params']['w']"))
    assert "(64, 32)" in w and "float32" in w and "P(data, model) on mesh(data=4, model=2)" in w and "8.0 KiB" in w
    b = next(line for line in lines if line.startswith("['params']['b']"))
    assert "(3,)" in b and "float64" in b and "24 Bytes" in b
    rng = next(line for line in lines if line.startswith("['rng']"))
    assert "key<fry> (threefry2x32)" in rng
    assert any(line.startswith("['step']") and "scalar" in line for line in lines)
    assert "4 leaves (3 arrays, 2 of them packed into 1 stored array)" in out   # on device 0: one pack
    assert f"({64 * 32 * 4 + 24 + 8} bytes)" in out and "layout ocdbt" in out


def test_inspect_json_matches_the_library(saved):
    code, out, err = cli("inspect", "--json", saved)
    assert code == 0, err
    doc = json.loads(out)
    by_key = {leaf["keypath"]: leaf for leaf in doc["leaves"]}
    meta = dio.metadata(saved)
    assert by_key["['params']['w']"]["shape"] == list(meta["params"]["w"].shape) == [64, 32]
    assert by_key["['params']['w']"]["bytes"] == 64 * 32 * 4
    assert by_key["['rng']"]["dtype"] == "key<fry> (threefry2x32)"
    assert doc["total_bytes"] == 64 * 32 * 4 + 24 + 8 and doc["checksums"] is True and doc["layout"] == "ocdbt"


def test_verify_passes_a_sound_checkpoint_and_names_a_corrupt_chunk(saved):
    code, out, err = cli("verify", saved)
    assert code == 0, err
    assert "sound" in out and "CRC-32C checked" in out
    sh.flip_byte(next(iter(sh.chunks(saved, "['params']['w']").values())))
    code, out, err = cli("verify", saved)
    assert code == 1
    assert "NOT sound" in err and "['params']['w']" in err and "Traceback" not in err


@pytest.mark.parametrize("make", ["missing", "uncommitted", "foreign", "file"])
def test_bad_paths_are_one_line_and_a_nonzero_exit(tmp_path, make):
    path = tmp_path / "thing"
    if make == "uncommitted":
        os.makedirs(path / "arrays")
    elif make == "foreign":
        os.makedirs(path)
        (path / "COMMITTED").write_text("{}")
        (path / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    elif make == "file":
        path.write_text("not a checkpoint")
    for command in ("inspect", "verify"):
        code, out, err = cli(command, path)
        assert code == 2, (command, make, out, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert str(path) in err or "not a dispatch_io manifest" in err, err


def test_a_manager_root_names_its_steps(tmp_path):
    root = tmp_path / "run"
    with dio.CheckpointManager(root) as manager:
        for step in (10, 20):
            manager.save(step, {"x": np.arange(4)})
    code, out, err = cli("verify", root)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"CheckpointManager root with committed steps 10, 20: try {root / '20'}" in err, err
    code, out, err = cli("inspect", root)               # a root: its steps' info
    assert code == 0 and re.findall(r"^(\d+)  ", out, re.M) == ["10", "20"] and "2 committed steps" in out, out
    assert cli("inspect", root / "20")[0] == 0
    code, out, err = cli("inspect", tmp_path / "missing")
    assert code == 2 and "CheckpointManager" not in err and not (tmp_path / "missing").exists(), err


def test_bench_runs_the_benchmark_of_the_checkout():
    code, out, err = cli("bench", "--help")
    assert code == 0, err
    assert "--sizes" in out and "--budgets-mib" in out and "--systems" in out


def test_verify_without_checksums_still_reads_every_byte(tmp_path, mesh):
    path = tmp_path / "plain"
    with dio.LocalDispatcher(host_memory_budget=1 << 20) as d:
        d.save(path, {"w": jax.device_put(np.ones((64, 32), np.float32), NamedSharding(mesh, P("data")))}).wait(60)
    code, out, err = cli("verify", path)
    assert code == 0, err
    assert out.strip() == f"{path}: sound (every stored byte read (saved without checksums: Options(checksums=True) adds them))"


# Runs ``dispatch-io ARGS`` in-process after JAX is up, and prints how much its run grew the
# process's peak memory (VmHWM, reset first) over the resident set before it.
VMHWM_SCRIPT = r"""
import json, sys

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

import jax
import dispatch_io.cli as cli
jax.devices()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
code = cli.main(sys.argv[1:])
print(json.dumps({"code": code, "growth": status("VmHWM") - before}))
"""


def test_verify_holds_about_its_budget_not_the_checkpoint(tmp_path):
    """One 128 MiB leaf, verified with an 8 MiB budget: memory grows by far less than the leaf
    (restoring it to host, as verify once did, grows it by more than the leaf)."""
    MiB = 1 << 20
    path = tmp_path / "big"
    with dio.LocalDispatcher(host_memory_budget=16 * MiB, checksums=True) as d:
        d.save(path, {"big": np.arange(32 * MiB, dtype=np.float32), "step": 1}).wait(120)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", VMHWM_SCRIPT, "verify", "--budget-mib", "8", str(path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith(f"{path}: sound (every stored byte read and its CRC-32C checked)")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["code"] == 0 and r["growth"] < 64 * MiB, f"verify grew the peak RSS by {r['growth'] / MiB:.1f} MiB"


def test_verify_shows_its_progress_on_a_terminal(tmp_path, capsys, monkeypatch):
    import io

    from dispatch_io import cli as cli_lib
    from dispatch_io import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    path = tmp_path / "ckpt"
    with dio.LocalDispatcher(host_memory_budget=1 << 20, checksums=True) as d:   # 256 KiB chunks
        d.save(path, {"v": np.arange(3 << 18, dtype=np.float32)}).wait(60)       # 3 MiB
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(progress, "TTY_AFTER_SECS", 0.0)   # draw even this short verify
    monkeypatch.setattr(progress, "TTY_EVERY_SECS", 0.0)
    assert cli_lib.main(["verify", "--budget-mib", "1", str(path)]) == 0   # 512 KiB batches: 6
    assert capsys.readouterr().out == f"{path}: sound (every stored byte read and its CRC-32C checked)\n"
    *lines, last = terminal.getvalue().split("\r")[1:]
    assert len(lines) == 5   # one per batch but the last, whose line is the summary
    for k, line in enumerate(lines, 1):
        head, rate = line.rstrip().split("%), ")
        assert head == f"dispatch_io: verify {path}: batch {k}/6, {progress.size(k << 19)} / 3.0 MiB ({k * 100 // 6}"
        assert rate.endswith(" MiB/s") or rate.endswith(" GiB/s") or rate.endswith(" KiB/s"), line
    assert last.endswith("\n") and last.rstrip().startswith(f"dispatch_io: verified {path}: 3.0 MiB read in 6 batches, ")
    assert last.rstrip().endswith("CRC-32C checked")


@pytest.mark.parametrize("edit", [
    lambda d: [d],                                                      # not an object
    lambda d: {**d, "leaves": None},
    lambda d: {**d, "leaves": [{**e, "dtype": "float99"} if e["kind"] == "array" else e for e in d["leaves"]]},
    lambda d: {**d, "leaves": d["leaves"][:-1]},                        # fewer leaves than the structure
], ids=["list", "leaves-null", "unknown-dtype", "leaf-missing"])
def test_a_malformed_manifest_is_one_line_and_exit_2_everywhere(tmp_path, edit):
    path = tmp_path / "ckpt"
    with dio.LocalDispatcher(host_memory_budget=1 << 20) as d:
        d.save(path, {"w": np.arange(8.0), "v": np.arange(4.0), "s": 1}).wait(60)
        doc = sealed.loads((path / "manifest.json").read_text())   # edited: unsealed, then checked
        (path / "manifest.json").write_text(json.dumps(edit(doc)))
        for call in (lambda: dio.metadata(path), lambda: d.restore(path), lambda: d.verify(path)):
            with pytest.raises(dio.CheckpointError, match="manifest"):
                call()
    for command in ("inspect", "verify"):
        code, out, err = cli(command, path)
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (command, err)


def test_an_empty_path_is_one_line_and_exit_2(tmp_path, capsys):
    from dispatch_io import cli as cli_lib

    assert cli("inspect", "")[0] == 2                    # as a command
    for args in (["inspect", ""], ["verify", ""], ["convert", "", str(tmp_path / "out")],
                 ["convert", str(tmp_path), ""]):
        assert cli_lib.main(args) == 2
        out, err = capsys.readouterr()
        assert err == f"dispatch-io {args[0]}: a checkpoint path must not be empty\n" and not out, (args, err)
    assert os.listdir(tmp_path) == []


def test_convert_overwrite_flag_and_a_destination_within_the_source(saved, tmp_path):
    other = tmp_path / "other"
    with dio.LocalDispatcher(host_memory_budget=1 << 20) as d:
        d.save(other, {"x": np.arange(4)}).wait(60)
    code, out, err = cli("convert", saved, other)
    assert code == 2 and err.strip() == f"dispatch-io convert: a checkpoint is already committed at {other}; " \
                                        "pass --overwrite to replace it", err
    code, out, err = cli("convert", saved, other, "--overwrite")
    assert code == 0, err
    assert jax.tree.structure(dio.metadata(other)) == jax.tree.structure(dio.metadata(saved))   # replaced
    before = sorted(os.listdir(saved))
    code, out, err = cli("convert", saved, saved / "inner")
    assert code == 2 and err.strip() == f"dispatch-io convert: cannot convert {saved} into {saved / 'inner'}: " \
                                        "the destination is inside the source; choose a destination outside it", err
    with dio.LocalDispatcher(host_memory_budget=1 << 20) as d:   # the library refuses it too, and the reverse
        os.symlink(saved, tmp_path / "link")   # a symlink to the source is the source
        for dst, where in ((saved / "inner", "is inside"), (saved, "is"), (tmp_path, "holds"),
                           (tmp_path / "link" / "inner", "is inside")):
            with pytest.raises(ValueError, match=f"the destination {where} the source"):
                d.convert(saved, dst, overwrite=True)
    assert sorted(os.listdir(saved)) == before


def test_version_is_one_line_whatever_the_terminal_width(monkeypatch, capsys):
    """``dispatch-io --version`` names the package and its stack on one line (what a bug report
    pastes, what a script greps), also in a narrow terminal: argparse's own version action
    wraps its text to the terminal's width."""
    from dispatch_io import cli
    monkeypatch.setenv("COLUMNS", "40")
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    assert out.count("\n") == 1 and re.fullmatch(
        r"dispatch-io \S+ \(Python \S+, jax \S+, jaxlib \S+, tensorstore \S+, numpy \S+\)\n", out), out
