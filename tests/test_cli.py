"""The ``dispatch-io`` command line: inspect and verify, run as a separate process on a machine
with a single CPU device (the checkpoints are saved here, on the 8-device mesh)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
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
    assert "4 leaves (3 arrays)" in out and f"({64 * 32 * 4 + 24 + 8} bytes)" in out and "layout ocdbt" in out


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


def test_bench_runs_the_benchmark_of_the_checkout():
    code, out, err = cli("bench", "--help")
    assert code == 0, err
    assert "--sizes" in out and "--budgets-mib" in out and "--systems" in out
