"""Optional per-chunk CRC-32C: stored in the manifest, checked by ``restore(verify=True)``.

Every test that corrupts stored bytes runs with both chunk layouts: ``storage_helpers`` finds a
chunk's bytes (its own file, or its byte range in an OCDBT data file) and flips one of them."""

import json
import os
import shutil

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
import storage_helpers as sh
from conftest import assert_trees_bit_equal
from dispatch_io.jax_compat import single_device_sharding


def make_tree(mesh):
    rng = np.random.default_rng(0)
    return {
        "w": jax.device_put(rng.standard_normal((64, 64), dtype=np.float32), NamedSharding(mesh, P("data", "model"))),
        "rep": jax.device_put(rng.integers(0, 255, (32, 8), dtype=np.uint8), NamedSharding(mesh, P())),
        "key": jax.random.key(3),
        "host": rng.standard_normal(10),
        "scalar": jnp.float32(2.5),
        "step": 7,
    }


def test_manifest_holds_the_crc32c_of_every_stored_chunk(tmp_path, mesh, dispatcher_cls, layout):
    tree = make_tree(mesh)   # an array per leaf (packed leaves: test_packs.py)
    with dispatcher_cls(host_memory_budget=64 << 10, checksums=True, layout=layout, small_leaf_bytes=0) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", tree, verify=True), tree)
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    stored = {leaf["keypath"]: leaf["stored"] for leaf in manifest["leaves"] if leaf.get("stored")}
    assert set(stored) == {"['w']", "['rep']", "['key']", "['host']", "['scalar']"}
    assert manifest["layout"] == layout
    for keypath, entry in stored.items():
        chunks = sh.chunks(tmp_path / "ckpt", keypath)
        assert len(entry["crc32c"]) == len(chunks), keypath   # one checksum per stored chunk, replicas once
        for grid, value in chunks.items():  # zarr3 raw chunks: the stored value is exactly the chunk's bytes
            data = value.read()
            assert entry["crc32c"][",".join(map(str, grid))] == f"{google_crc32c.value(data):08x}", (keypath, grid)


def test_flipped_byte_is_reported_with_key_path_and_chunk(tmp_path, mesh, dispatcher_cls, layout):
    tree = make_tree(mesh)
    with dispatcher_cls(host_memory_budget=64 << 10, checksums=True, layout=layout, small_leaf_bytes=0) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        chunks = sh.chunks(tmp_path / "ckpt", "['w']")
        assert sorted(chunks) == [(i, j) for i in range(4) for j in range(2)]
        chunk = (1, 0)
        sh.flip_byte(chunks[chunk])
        with pytest.raises(dio.CorruptCheckpointError) as info:
            d.restore(tmp_path / "ckpt", tree, verify=True)
        assert info.value.keypath == "['w']" and info.value.chunk == chunk, (info.value, chunk)
        assert "['w']" in str(info.value) and f"chunk {list(chunk)}" in str(info.value)
        assert "1 chunk(s)" in str(info.value)
        # Without verify the bytes are read as stored: the flip shows up in the result.
        restored = d.restore(tmp_path / "ckpt", tree)
        assert np.asarray(restored["w"]).tobytes() != np.asarray(tree["w"]).tobytes()
        # Verifying a subset that does not read the bad chunk passes.
        subset = {"rep": tree["rep"]}
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", subset, partial=True, verify=True), subset)


def test_verify_covers_only_what_this_restore_reads_and_every_bad_chunk(tmp_path, mesh, layout):
    tree = make_tree(mesh)
    with dio.LocalDispatcher(host_memory_budget=64 << 10, checksums=True, layout=layout, small_leaf_bytes=0) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        chunks = sh.chunks(tmp_path / "ckpt", "['w']")
        sh.flip_byte(chunks[(0, 0)])
        sh.flip_byte(chunks[(3, 1)], offset=100)
        one_device = single_device_sharding(jax.devices()[1])
        target = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=one_device)}
        with pytest.raises(dio.CorruptCheckpointError, match=r"2 chunk\(s\)") as info:
            d.restore(tmp_path / "ckpt", target, partial=True, verify=True)
        assert "chunk [0, 0]" in str(info.value) and "chunk [3, 1]" in str(info.value)


def test_copied_checkpoint_verifies_and_a_corrupted_copy_is_caught(tmp_path, mesh, layout):
    tree = make_tree(mesh)
    with dio.LocalDispatcher(host_memory_budget=64 << 10, checksums=True, layout=layout, small_leaf_bytes=0) as d:
        d.save(tmp_path / "a" / "ckpt", tree).wait()
        shutil.copytree(tmp_path / "a" / "ckpt", tmp_path / "b" / "ckpt")   # cp -r
        assert_trees_bit_equal(d.restore(tmp_path / "b" / "ckpt", tree, verify=True), tree)
        (rep,) = sh.chunks(tmp_path / "b" / "ckpt", "['rep']").values()
        assert rep.file.startswith(str(tmp_path / "b" / "ckpt")), rep   # the copy references its own files
        sh.flip_byte(rep)
        with pytest.raises(dio.CorruptCheckpointError, match=r"\['rep'\]"):
            d.restore(tmp_path / "b" / "ckpt", tree, verify=True)
        assert_trees_bit_equal(d.restore(tmp_path / "a" / "ckpt", tree, verify=True), tree)  # original intact


def test_verify_without_saved_checksums_is_a_clear_error(tmp_path, mesh, dispatcher):
    tree = make_tree(mesh)
    dispatcher.save(tmp_path / "ckpt", tree).wait()
    with pytest.raises(dio.CheckpointError, match="saved without checksums"):
        dispatcher.restore(tmp_path / "ckpt", tree, verify=True)
    assert_trees_bit_equal(dispatcher.restore(tmp_path / "ckpt", tree), tree)


def test_chunks_split_under_a_small_budget_each_get_a_checksum(tmp_path, mesh, layout):
    big = {"x": jax.device_put(np.arange(256 * 256, dtype=np.float32).reshape(256, 256), NamedSharding(mesh, P("data")))}
    with dio.LocalDispatcher(host_memory_budget=64 << 10, checksums=True, layout=layout) as d:
        d.save(tmp_path / "ckpt", big).wait()
        manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
        (entry,) = [leaf["stored"] for leaf in manifest["leaves"]]
        assert len(entry["crc32c"]) == len(sh.chunks(tmp_path / "ckpt", "['x']")) > 8
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", big, verify=True), big)


def test_directory_checkpoint_copied_into_a_kvstore_restores_and_verifies(tmp_path, mesh, dispatcher_cls, layout):
    """An object store has no rename: copying a committed checkpoint key by key (commit marker
    first, the rest in reverse order) into a kvstore still restores bit-exact, with verify."""
    import tensorstore as ts

    from dispatch_io.workers import shared_context

    tree = make_tree(mesh)
    with dispatcher_cls(host_memory_budget=64 << 10, checksums=True, layout=layout) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        files = sorted((os.path.relpath(os.path.join(root, n), tmp_path / "ckpt")
                        for root, _, names in os.walk(tmp_path / "ckpt") for n in names),
                       key=lambda rel: (rel != "COMMITTED", [-ord(c) for c in rel]))
        assert files[0] == "COMMITTED"
        url = f"memory://copied_from_disk_{layout}/"
        kv = ts.KvStore.open(url, context=shared_context({"driver": "memory"})).result()
        for rel in files:
            kv.write(rel.replace(os.sep, "/"), (tmp_path / "ckpt" / rel).read_bytes()).result()
        assert_trees_bit_equal(d.restore(url, tree, verify=True), tree)
        assert dio.metadata(url) == dio.metadata(tmp_path / "ckpt")
