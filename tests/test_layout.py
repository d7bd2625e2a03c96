"""On-disk layout: key paths never become raw file paths; checkpoints are readable by a process
with a single CPU device (tools, converters, a laptop)."""

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import storage_helpers as stored
from conftest import assert_trees_bit_equal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTILE_KEYS = ["../../escape", "/etc/passwd", "a/b", "..", ".", "", " spaces and\ttabs ", "ünïcödé", "x" * 300,
                "COMMITTED", "manifest.json"]


# What an OCDBT checkpoint's arrays/ holds: the merged database (manifest and its B-tree data
# files) and each writer's database (a process p<k> or colocated CPU device cpu<id>), whose data
# files the merged one references. Data files are named by TensorStore (hex), never by a key path.
OCDBT_FILE = re.compile(r"^arrays/(?:(?:p\d+|cpu\d+(?:\.\d+)?)/)?(?:manifest\.ocdbt|d/[0-9a-f]{32})$")  # cpu<id>.<lane>


@pytest.mark.parametrize("small_leaf_bytes", [0, 256 << 10], ids=["array-per-leaf", "packed"])
def test_hostile_key_paths_stay_inside_the_checkpoint(tmp_path, mesh, dispatcher_cls, layout, small_leaf_bytes):
    tree = {k: jax.device_put(np.full((8, 4), i, np.int32), NamedSharding(mesh, P("data")))
            for i, k in enumerate(HOSTILE_KEYS)}
    path = tmp_path / "inner" / "ckpt"
    with dispatcher_cls(host_memory_budget=1 << 20, layout=layout, small_leaf_bytes=small_leaf_bytes) as dispatcher:
        dispatcher.save(path, tree).wait(60)
        assert sorted(os.listdir(tmp_path)) == ["inner"]
        assert sorted(os.listdir(tmp_path / "inner")) == ["ckpt"]
        assert sorted(os.listdir(path)) == ["COMMITTED", "arrays", "manifest.json"]
        names = stored.array_names(path)   # files: directories under arrays/; OCDBT: keys' first component
        assert len(names) == (len(HOSTILE_KEYS) if small_leaf_bytes == 0 else 1)   # or one pack
        for name in names:
            assert name == os.path.basename(name) and not name.startswith(".") and len(name) <= 100, name
            assert all(c.isalnum() or c in "._-" for c in name), name
        for rel in stored.all_files(path / "arrays"):
            rel = "arrays/" + rel.replace(os.sep, "/")
            if layout == "files":
                assert rel.split("/")[1] in names, rel
            else:
                assert OCDBT_FILE.match(rel), rel
        with open(path / "manifest.json") as f:
            keypaths = [leaf["keypath"] for leaf in json.load(f)["leaves"]]
        assert sorted(keypaths) == sorted(jax.tree_util.keystr((jax.tree_util.DictKey(k),)) for k in HOSTILE_KEYS)
        assert_trees_bit_equal(dispatcher.restore(path, tree), tree)


ONE_DEVICE_READER = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    import dispatch_io as dio
    assert jax.device_count() == 1, jax.devices()
    abstract = dio.metadata(sys.argv[1])
    with getattr(dio, sys.argv[2])(host_memory_budget=1 << 20) as d:
        on_host = d.restore(sys.argv[1])
        on_device = d.restore(sys.argv[1], abstract)
    print(json.dumps({
        "w": [str(abstract["w"].dtype), list(abstract["w"].shape)],
        "key": str(abstract["key"].dtype),
        "w_bytes": np.asarray(on_host["w"]).tobytes().hex(),
        "w_device": np.asarray(on_device["w"]).tobytes().hex(),
        "key_data": np.asarray(jax.random.key_data(on_device["key"])).tobytes().hex(),
        "step": on_host["step"]}))
""")


def test_a_one_device_process_reads_an_eight_device_checkpoint(tmp_path, mesh, dispatcher):
    w = jax.device_put(np.arange(64 * 16, dtype=np.float32).reshape(64, 16), NamedSharding(mesh, P("data", "model")))
    key = jax.device_put(jax.random.split(jax.random.key(7, impl="rbg"), 8), NamedSharding(mesh, P("data")))
    dispatcher.save(tmp_path / "ckpt", {"w": w, "key": key, "step": 12}).wait(60)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", ONE_DEVICE_READER, str(tmp_path / "ckpt"),
                           type(dispatcher).__name__], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["w"] == ["float32", [64, 16]] and r["key"] == "key<rbg>" and r["step"] == 12
    assert r["w_bytes"] == r["w_device"] == np.asarray(w).tobytes().hex()
    assert r["key_data"] == np.asarray(jax.random.key_data(key)).tobytes().hex()
