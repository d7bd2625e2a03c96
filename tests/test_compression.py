"""Optional zstd compression (``Options(compression=...)``): bit-exact round trips with both
layouts, fewer bytes on disk, the manifest and ``inspect`` record it, and checksums, verify and
the restore budget work as without it."""

import json
import os
import subprocess
import sys

import google_crc32c
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from conftest import assert_trees_bit_equal
from dispatch_io import manifest as manifest_lib
from dispatch_io.errors import CheckpointError
from dispatch_io.formats.detect import open_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_tree(mesh, rows: int = 64):
    """Every kind of leaf, with data that compresses (repeating, mostly small values)."""
    rng = np.random.default_rng(0)
    sharded = NamedSharding(mesh, P("data", "model"))
    weights = (rng.standard_normal((rows, 64)) * 0.02).astype(np.float32)
    return {
        "f32": jax.device_put(weights, sharded),
        "bf16": jax.device_put(weights.astype(ml_dtypes.bfloat16), NamedSharding(mesh, P("data", None))),
        "i32": jax.device_put(np.arange(rows * 16, dtype=np.int32).reshape(rows, 16) % 7, NamedSharding(mesh, P())),
        "bool": jax.device_put(np.arange(rows * 8).reshape(rows, 8) % 3 == 0, NamedSharding(mesh, P(None, "model"))),
        "key": jax.random.key(7),
        "rbg_keys": jax.random.split(jax.random.key(1, impl="rbg"), 4),
        "host": np.linspace(0, 1, 100),
        "empty": np.zeros((0, 3), np.float32),
        "scalar": jnp.float32(2.5),
        "step": 11,
    }


def disk_bytes(path) -> int:
    return sum(os.lstat(os.path.join(root, name)).st_size for root, _, names in os.walk(path) for name in names)


def stored_codecs(path, layout: str, name: str) -> list[dict]:
    """The codecs of one stored array, as TensorStore reads its zarr.json."""
    arrays = str(path / "arrays") + "/"
    if layout == "ocdbt":
        kvstore = {"driver": "ocdbt", "base": {"driver": "file", "path": arrays}, "path": name + "/"}
    else:
        kvstore = {"driver": "file", "path": arrays + name + "/"}
    store = ts.open({"driver": "zarr3", "kvstore": kvstore}, open=True).result()
    return store.spec().to_json()["metadata"]["codecs"]


@pytest.mark.parametrize("compression", ["zstd", ("zstd", 9), ("zstd", -5)])
def test_round_trip_is_bit_exact(tmp_path, mesh, dispatcher_cls, layout, compression):
    tree = make_tree(mesh)
    with dispatcher_cls(host_memory_budget=64 << 10, layout=layout, compression=compression) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", tree), tree)
        on_host = d.restore(tmp_path / "ckpt")
    assert on_host["bf16"].tobytes() == np.asarray(tree["bf16"]).tobytes()
    assert on_host["host"].tobytes() == tree["host"].tobytes()
    level = 3 if compression == "zstd" else compression[1]
    name = next(leaf.stored.name for leaf in open_checkpoint(tmp_path / "ckpt").manifest.leaves
                if leaf.keypath == "['f32']")
    assert stored_codecs(tmp_path / "ckpt", layout, name)[1] == {"name": "zstd",
                                                                 "configuration": {"level": level, "checksum": False}}


def test_compressed_checkpoints_are_smaller_on_disk(tmp_path, mesh, layout):
    tree = make_tree(mesh, rows=4096)
    sizes = {}
    for compression in (None, "zstd"):
        path = tmp_path / str(compression)
        with dio.LocalDispatcher(host_memory_budget=1 << 20, layout=layout, compression=compression) as d:
            d.save(path, tree).wait()
            assert_trees_bit_equal(d.restore(path, tree), tree)
        sizes[compression] = disk_bytes(path)
    assert sizes["zstd"] < 0.8 * sizes[None], sizes


def test_either_dispatcher_reads_the_other_ones_checkpoints(tmp_path, mesh, layout):
    """Reads take the stored codecs, whatever the reading dispatcher would write."""
    tree = make_tree(mesh)
    with dio.LocalDispatcher(host_memory_budget=1 << 20, layout=layout, compression="zstd") as zstd, \
            dio.LocalDispatcher(host_memory_budget=1 << 20, layout=layout) as raw:
        zstd.save(tmp_path / "zstd", tree).wait()
        raw.save(tmp_path / "raw", tree).wait()
        assert_trees_bit_equal(raw.restore(tmp_path / "zstd", tree), tree)
        assert_trees_bit_equal(zstd.restore(tmp_path / "raw", tree), tree)
        zstd.convert(tmp_path / "raw", tmp_path / "converted")
        assert_trees_bit_equal(raw.restore(tmp_path / "converted", tree), tree)
    assert open_checkpoint(tmp_path / "converted").manifest.compression == ("zstd", 3)


def test_checksums_cover_the_uncompressed_bytes_and_verify_passes(tmp_path, mesh, dispatcher_cls, layout):
    tree = make_tree(mesh)
    with dispatcher_cls(host_memory_budget=64 << 10, layout=layout, compression="zstd", checksums=True,
                        small_leaf_bytes=0) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", tree, verify=True), tree)
        assert d.verify(tmp_path / "ckpt").verified
    manifest = open_checkpoint(tmp_path / "ckpt").manifest
    leaf = manifest.by_keypath["['f32']"]
    assert manifest.has_checksums and len(leaf.checksums) == 8  # one per stored chunk
    data = np.asarray(tree["f32"])
    chunk = leaf.stored.chunk_shape
    assert leaf.checksums[(1, 0)] == google_crc32c.value(
        np.ascontiguousarray(data[chunk[0]:2 * chunk[0], :chunk[1]]).tobytes())


def test_restore_within_a_budget_smaller_than_the_tree(tmp_path, mesh, layout):
    tree = make_tree(mesh, rows=2048)  # about 1 MiB of arrays
    with dio.LocalDispatcher(host_memory_budget=128 << 10, layout=layout, compression=("zstd", 1)) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", tree), tree)
        assert d.last_restore_stats.batches > 4


def test_object_store_round_trip(mesh):
    tree = make_tree(mesh)
    with dio.LocalDispatcher(host_memory_budget=64 << 10, compression="zstd") as d:
        d.save("memory://compressed/ckpt", tree).wait()
        assert_trees_bit_equal(d.restore("memory://compressed/ckpt", tree), tree)


@pytest.mark.parametrize("bad", ["gzip", "ZSTD", ("zstd",), ("zstd", 23), ("zstd", -131073), ("zstd", "3"),
                                 ("zstd", True), ("zstd", 3.0), ["zstd", 3], ("lz4", 1), 3, True])
def test_invalid_compression_is_a_value_error_naming_the_option(bad):
    with pytest.raises(ValueError, match="compression"):
        dio.Options(compression=bad)
    with pytest.raises(ValueError, match="compression"):
        dio.LocalDispatcher(compression=bad)


def test_the_manifest_records_it(tmp_path, mesh):
    tree = make_tree(mesh)
    for compression, recorded in ((None, None), ("zstd", {"codec": "zstd", "level": 3}),
                                  (("zstd", 12), {"codec": "zstd", "level": 12})):
        path = tmp_path / str(compression)
        with dio.LocalDispatcher(host_memory_budget=1 << 20, compression=compression) as d:
            d.save(path, tree).wait()
        doc = json.loads((path / "manifest.json").read_text())
        assert doc["compression"] == recorded
        manifest = manifest_lib.parse(doc, str(path))
        expected = None if recorded is None else (recorded["codec"], recorded["level"])
        assert manifest.compression == expected
        stored = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/arrays/"}).result()
        names = {leaf.stored.stored.name for leaf in manifest.leaves if leaf.stored is not None}
        for name in names:   # each array's metadata says the same as the manifest
            extra = json.loads(stored.read(f"{name}/zarr.json").result().value)["codecs"][1:]
            assert extra == ([] if expected is None else
                             [{"name": "zstd", "configuration": {"checksum": False, "level": expected[1]}}]), extra
        assert len(names) >= 2
    del doc["compression"]  # manifests written before the option read as uncompressed
    assert manifest_lib.parse(doc, "old").compression is None
    for bad in ({"codec": "gzip", "level": 1}, {"codec": "zstd"}, "zstd", {"codec": "zstd", "level": 99}):
        with pytest.raises(CheckpointError, match="malformed checkpoint"):
            manifest_lib.parse({**doc, "compression": bad}, "bad")


def test_inspect_shows_it(tmp_path, mesh):
    with dio.LocalDispatcher(host_memory_budget=1 << 20, compression=("zstd", 5)) as d:
        d.save(tmp_path / "ckpt", make_tree(mesh)).wait()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    for args, expected in ((["inspect"], "compression zstd level 5"), (["inspect", "--json"], '"codec": "zstd"')):
        proc = subprocess.run([sys.executable, "-m", "dispatch_io.cli", *args, str(tmp_path / "ckpt")], env=env,
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert expected in proc.stdout
    doc = json.loads(proc.stdout)
    assert doc["compression"] == {"codec": "zstd", "level": 5}
