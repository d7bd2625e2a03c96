"""Small leaves packed into shared byte arrays (``Options.small_leaf_bytes``, ``workers.packs``).

A tree of many small leaves is stored as a few pack arrays instead of one array per leaf; every
path that reads stored leaves (restore in any target form, verify, convert, inspect, either
dispatcher, either layout) reads packed ones, bit-exactly."""

import json

import google_crc32c
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io.storage import sealed
import storage_helpers as sh
from conftest import assert_trees_bit_equal
from dispatch_io import cli
from dispatch_io.plan.batches import Priority, make_batches
from dispatch_io.plan.save_plan import plan_tree, with_packs
from dispatch_io.workers import ArraySpec, Region, pack_spec, packed_leaf
from dispatch_io.workers import packs
from dispatch_io.jax_compat import single_device_sharding


def small_tree(mesh, n=40):
    """``n`` small leaves of mixed dtypes, shapes and shardings, a PRNG key, host data, scalars
    and one leaf too large to pack."""
    rng = np.random.default_rng(0)
    shardings = [NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P()), NamedSharding(mesh, P("data")),
                 single_device_sharding(jax.devices()[3])]
    dtypes = [np.float32, ml_dtypes.bfloat16, np.int32, np.uint8, np.float16]
    tree = {"layers": {}}
    for i in range(n):
        shape = (8 * (1 + i % 3), 4 * (1 + i % 2))
        dtype = dtypes[i % len(dtypes)]
        value = rng.standard_normal(shape).astype(dtype) if np.dtype(dtype).kind == "f" else \
            rng.integers(0, 100, shape).astype(dtype)
        tree["layers"][f"w{i:02d}"] = jax.device_put(value, shardings[i % len(shardings)])
    tree["key"] = jax.random.key(7)
    tree["keys"] = jax.device_put(jax.random.split(jax.random.key(1), 8), NamedSharding(mesh, P("data")))
    tree["host"] = rng.standard_normal((3, 5))
    tree["scalar"] = np.float32(1.5)
    tree["zero_d"] = jnp.int32(4)
    tree["big"] = jax.device_put(rng.standard_normal((512, 256), dtype=np.float32), shardings[0])  # 512 KiB
    tree["step"] = 12
    return tree


def packed_leaves(path) -> dict[str, dict]:
    return {leaf["keypath"]: leaf["stored"] for leaf in sh.manifest(path)["leaves"]
            if leaf.get("stored") and "pack" in leaf["stored"]}


def test_small_leaves_are_stored_in_a_few_packs_and_restore_bit_exactly(tmp_path, mesh, dispatcher_cls, layout):
    tree = small_tree(mesh)
    with dispatcher_cls(host_memory_budget=8 << 20, layout=layout) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        manifest = sh.manifest(tmp_path / "ckpt")
        packed = packed_leaves(tmp_path / "ckpt")
        assert manifest["format_version"] == 2 and manifest["packs"]
        assert "['big']" not in packed and "['step']" not in packed
        assert len(packed) >= 40 and set(manifest["packs"]) == {s["pack"] for s in packed.values()}
        names = sh.array_names(tmp_path / "ckpt")
        assert set(manifest["packs"]) <= names
        assert len(names) < 10, names  # a few packs and the big leaf, not one array per leaf
        for entry in packed.values():
            assert entry["offset"] % 64 == 0
        # every form of target: as saved (numpy / keys), the tree itself, abstract leaves
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", tree), tree)
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                          if isinstance(x, jax.Array) else x, tree)
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", abstract), tree)
        as_saved = d.restore(tmp_path / "ckpt")
        for k, v in tree["layers"].items():
            assert np.asarray(as_saved["layers"][k]).tobytes() == np.asarray(v).tobytes(), k


def test_packed_leaves_restore_onto_other_shardings_and_dtypes(tmp_path, mesh):
    tree = small_tree(mesh)
    with dio.LocalDispatcher(host_memory_budget=8 << 20) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        other = NamedSharding(mesh, P(None, "model"))
        target = {"layers": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=other) for k, v in tree["layers"].items()}}
        restored = d.restore(tmp_path / "ckpt", target, partial=True)
        for k, v in tree["layers"].items():
            assert restored["layers"][k].sharding == other
            assert np.asarray(restored["layers"][k]).tobytes() == np.asarray(v).tobytes(), k
        to_host = {"layers": {k: np.zeros(v.shape, v.dtype) for k, v in tree["layers"].items()}}
        restored = d.restore(tmp_path / "ckpt", to_host, partial=True)
        for k, v in tree["layers"].items():
            assert isinstance(restored["layers"][k], np.ndarray)
            assert restored["layers"][k].tobytes() == np.asarray(v).tobytes(), k
        cast = {"layers": {"w00": jax.ShapeDtypeStruct((8, 4), np.float64)}}
        with jax.enable_x64(True):
            restored = d.restore(tmp_path / "ckpt", cast, partial=True, cast=True)
            np.testing.assert_array_equal(np.asarray(restored["layers"]["w00"]),
                                          np.asarray(tree["layers"]["w00"]).astype(np.float64))


def test_checksums_are_per_leaf_and_a_flipped_byte_names_its_leaf(tmp_path, mesh, dispatcher_cls):
    tree = small_tree(mesh)
    with dispatcher_cls(host_memory_budget=8 << 20, layout="files", checksums=True) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        packed = packed_leaves(tmp_path / "ckpt")
        victim = "['layers']['w05']"
        entry = packed[victim]
        values = sh.stored_values(tmp_path / "ckpt")
        chunk_bytes = min(sh.manifest(tmp_path / "ckpt")["packs"][entry["pack"]]["nbytes"], 1 << 20)
        flat = dict(dio.tree.flatten(tree)[0])
        for keypath, stored in packed.items():  # each leaf's CRC-32C is of its bytes in the pack
            leaf = flat[keypath]
            nbytes = np.asarray(jax.random.key_data(leaf) if dio.tree.is_prng_key(leaf) else leaf).nbytes
            start = stored["offset"]
            assert start + nbytes <= chunk_bytes  # one chunk holds this small tree's packs
            data = values[f"{stored['pack']}/c/0"].read()[start:start + nbytes]
            assert list(stored["crc32c"].values()) == [f"{google_crc32c.value(data):08x}"], keypath
        assert d.verify(tmp_path / "ckpt").verified
        sh.flip_byte(values[f"{entry['pack']}/c/{entry['offset'] // chunk_bytes}"],
                     offset=entry["offset"] % chunk_bytes + 3)
        with pytest.raises(dio.CorruptCheckpointError) as info:
            d.restore(tmp_path / "ckpt", tree, verify=True)
        assert info.value.keypath == victim and "1 chunk(s)" in str(info.value), info.value
        # the leaves beside it in the same pack still verify and restore
        others = {"layers": {k: v for k, v in tree["layers"].items() if k != "w05"}}
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", others, partial=True, verify=True), others)


def test_without_small_leaf_bytes_nothing_is_packed_and_the_format_is_version_1(tmp_path, mesh):
    tree = small_tree(mesh, n=6)
    with dio.LocalDispatcher(host_memory_budget=8 << 20, small_leaf_bytes=0) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        assert sh.manifest(tmp_path / "ckpt")["format_version"] == 1 and not packed_leaves(tmp_path / "ckpt")
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", tree), tree)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_convert_repacks_and_compression_applies_to_packs(tmp_path, mesh, compression):
    tree = small_tree(mesh)
    with dio.LocalDispatcher(host_memory_budget=8 << 20, compression=compression) as d:
        d.save(tmp_path / "a", tree).wait()
        d.convert(tmp_path / "a", tmp_path / "b")
        assert packed_leaves(tmp_path / "b")
        assert_trees_bit_equal(d.restore(tmp_path / "b", tree), tree)
    with dio.LocalDispatcher(host_memory_budget=8 << 20, small_leaf_bytes=0) as d:
        d.convert(tmp_path / "a", tmp_path / "c")  # unpacked again
        assert not packed_leaves(tmp_path / "c")
        assert_trees_bit_equal(d.restore(tmp_path / "c", tree), tree)


def test_inspect_names_the_pack(tmp_path, mesh, capsys):
    tree = small_tree(mesh, n=4)
    with dio.LocalDispatcher(host_memory_budget=8 << 20) as d:
        d.save(tmp_path / "ckpt", tree).wait()
    assert cli.main(["inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "packed" in out and "['layers']['w00']" in out


def test_packs_never_mix_priorities_and_are_one_unit_of_batching_counted_twice(mesh):
    """A pack holds leaves of one priority, shares one batch, and that batch's staging bytes
    count the pack twice (the writer copies its leaves into it); budgets hold."""
    tree = small_tree(mesh)
    plan = plan_tree(tree, chunk_limit=1 << 20, small_leaf_bytes=256 << 10)
    assert not any(spec.packed for spec in plan.leaves)   # packing waits for the priorities
    priorities = [(Priority.SYNC, Priority.HIGH, Priority.LOW)[i % 3] for i in range(len(plan.leaves))]
    plan = with_packs(plan, 256 << 10, 1 << 19, priorities)
    by_pack: dict = {}
    for spec in plan.leaves:
        if spec.packed:
            by_pack.setdefault(spec.packed[0], []).append(spec.index)
    assert len(by_pack) >= 3
    batches = make_batches(plan, priorities, limit=1 << 20)
    assert [b.priority for b in batches] == sorted(b.priority for b in batches)
    for name, leaves in by_pack.items():
        assert len({priorities[i] for i in leaves}) == 1, name
        holding = [b for b in batches if any(plan.chunks[i].leaf in leaves for i in b.chunks)]
        assert len(holding) == 1, name
        assert {plan.chunks[i].leaf for i in holding[0].chunks} >= set(leaves)
    for b in batches:
        copied = sum(-(-plan.chunks[i].nbytes // 64) * 64 for i in b.chunks)
        packed = {plan.leaves[plan.chunks[i].leaf].packed[:2] for i in b.chunks if plan.leaves[plan.chunks[i].leaf].packed}
        assert b.nbytes >= copied + sum(size for _, size in packed)
        assert b.nbytes <= 1 << 20 or len(b.chunks) == 1


def test_priorities_order_the_copies_and_fire_every_callback_once(tmp_path, mesh):
    tree = small_tree(mesh, n=12)
    seen_transfer, seen_write = [], []
    urgency = {"w03": Priority.SYNC, "w04": Priority.SYNC, "w07": Priority.HIGH}

    def prio(keypath, spec):
        return next((p for name, p in urgency.items() if name in keypath), Priority.LOW)
    with dio.LocalDispatcher(host_memory_budget=8 << 20) as d:
        d.save(tmp_path / "ckpt", tree, priority=prio, on_transfer_end=seen_transfer.append,
               on_write_end=seen_write.append).wait()
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", tree), tree)
    arrays = [k for k, v in dio.tree.flatten(tree)[0] if not isinstance(v, int)]
    assert sorted(seen_transfer) == sorted(seen_write) == sorted(arrays)
    order = [prio(k, None) for k in seen_transfer]
    assert order == sorted(order), list(zip(seen_transfer, order))
    assert len(packed_leaves(tmp_path / "ckpt")) >= 8


@pytest.mark.parametrize("small_leaf_bytes", [0, 256 << 10], ids=["array-per-leaf", "packed"])
def test_big_endian_host_leaves_keep_their_values(tmp_path, dispatcher_cls, small_leaf_bytes):
    """Stored little-endian (the copy converts); restored as saved: the same values."""
    tree = {"be": np.arange(1, 7, dtype=">f4").reshape(2, 3), "be_i": np.arange(5, dtype=">i8"),
            "le": np.arange(4, dtype="<f4")}
    with dispatcher_cls(host_memory_budget=8 << 20, small_leaf_bytes=small_leaf_bytes) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        restored = d.restore(tmp_path / "ckpt")
    for k, v in tree.items():
        np.testing.assert_array_equal(restored[k], v)
        assert restored[k].dtype == v.dtype.newbyteorder("=")


def test_a_lost_pack_chunk_is_blamed_on_a_leaf_stored_in_it(tmp_path, dispatcher_cls):
    """A pack spanning several 1 MiB chunks loses one: restore and verify name a leaf whose
    bytes are in that chunk, and the leaves elsewhere still restore."""
    rng = np.random.default_rng(5)
    tree = {f"w{i:02d}": rng.standard_normal(50_000 + 16 * i).astype(np.float32) for i in range(30)}  # ~200 KiB each
    with dispatcher_cls(host_memory_budget=64 << 20, layout="files", checksums=True) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        packed = packed_leaves(tmp_path / "ckpt")
        name = packed["['w00']"]["pack"]
        in_chunk_1 = {k for k, s in packed.items() if s["pack"] == name and s["offset"] < 2 << 20
                      and s["offset"] + tree[k[2:-2]].nbytes > 1 << 20}
        assert in_chunk_1
        (tmp_path / "ckpt" / "arrays" / name / "c" / "1").unlink()
        with pytest.raises(dio.WorkerError) as info:
            d.restore(tmp_path / "ckpt")
        assert info.value.keypath in in_chunk_1, (info.value.keypath, in_chunk_1)
        with pytest.raises(dio.CorruptCheckpointError) as info:
            d.verify(tmp_path / "ckpt")
        assert info.value.keypath in in_chunk_1, (info.value.keypath, in_chunk_1)
        first = {"w00": tree["w00"]}
        assert "['w00']" not in in_chunk_1
        np.testing.assert_array_equal(d.restore(tmp_path / "ckpt", first, partial=True)["w00"], tree["w00"])


# ---- the worker side ---------------------------------------------------------------------------

def test_assemble_writes_each_pack_whole_and_refuses_part_of_one():
    pack = pack_spec("p", 64 + 12)
    a = packed_leaf(pack, 0, (4,), "float32")
    b = packed_leaf(pack, 64, (3,), "int32")
    plain = ArraySpec("x", (2,), "float32", (2,))
    regions = [Region(a, ((0, 4),), "a"), Region(plain, ((0, 2),), "x"), Region(b, ((0, 3),), "b")]
    buffers = [np.arange(4, dtype=np.float32), np.ones(2, np.float32), np.array([7, 8, 9], np.int32)]
    written, data = packs.assemble(regions, buffers)
    assert [r.array.name for r in written] == ["x", "p"] and written[1].bounds == ((0, 76),)
    assert data[1][:16].tobytes() == buffers[0].tobytes() and data[1][64:].tobytes() == buffers[2].tobytes()
    assert not data[1][16:64].any()  # the gap is zeros, never stale staging bytes
    with pytest.raises(ValueError, match="written together"):
        packs.assemble(regions[:2], buffers[:2])  # b missing: the pack would be written short
    c_pack = pack_spec("q", 64 * 2 + 4)
    ends = [Region(packed_leaf(c_pack, offset, (1,), "float32"), ((0, 1),), f"l{offset}") for offset in (0, 128)]
    with pytest.raises(ValueError, match="written together"):
        packs.assemble(ends, [np.ones(1, np.float32)] * 2)  # the middle leaf (offset 64) missing
    with pytest.raises(ValueError, match="written whole"):
        packs.assemble([Region(a, ((0, 2),), "a")], [buffers[0][:2]])
    with pytest.raises(ValueError, match="does not fit"):
        packed_leaf(pack, 70, (3,), "int32")


def test_assemble_uses_the_staging_slice_its_leaves_already_sit_in():
    """Leaves laid out at their pack offsets in one buffer (how a batch's staging slice holds
    them): the pack is that memory, gaps zeroed, no copy; any other layout is copied."""
    pack = pack_spec("p", 64 + 64 + 8)
    specs = [packed_leaf(pack, 0, (5,), "float32"), packed_leaf(pack, 64, (3,), "int16"),
             packed_leaf(pack, 128, (2,), "float32")]
    staging = np.full(512, 0xAB, np.uint8)   # stale bytes everywhere
    at = 64                                  # the batch's slice starts here
    views = [staging[at + o:at + o + s.nbytes].view(np.dtype(s.dtype)) for s, o in zip(specs, (0, 64, 128))]
    for i, view in enumerate(views):
        view[...] = np.arange(view.size) + 10 * i
    expected = [v.copy() for v in views]
    regions = [Region(s, ((0, s.shape[0]),), f"l{i}") for i, s in enumerate(specs)]
    before = staging.copy()
    _, (copy,) = packs.assemble(regions, views)   # not the caller's staging: copied, nothing written
    assert not np.shares_memory(copy, staging) and (staging == before).all()
    _, (data,) = packs.assemble(regions[::-1], views[::-1], staging=True)   # any order of the regions
    assert np.shares_memory(data, staging) and data.__array_interface__["data"][0] == staging.ctypes.data + at
    assert data.size == 136
    for spec, offset, want in zip(specs, (0, 64, 128), expected):
        assert data[offset:offset + spec.nbytes].tobytes() == want.tobytes()
    assert not data[20:64].any() and not data[70:128].any()          # the gaps zeroed
    assert (staging[:at] == 0xAB).all() and (staging[at + 136:] == 0xAB).all()   # nothing outside
    # A leaf one byte off its offset, or leaves in separate buffers: copied, the staging untouched.
    shifted = [staging[at + o:at + o + s.nbytes].view(np.uint8) for s, o in zip(specs, (0, 65, 128))]
    before = staging.copy()
    _, (copy,) = packs.assemble(regions, shifted, staging=True)
    assert not np.shares_memory(copy, staging) and (staging == before).all()
    _, (copy,) = packs.assemble(regions, expected, staging=True)
    assert not np.shares_memory(copy, expected[0]) and copy[:20].tobytes() == expected[0].tobytes()
    frozen = [v.copy() for v in views]   # read-only views: never written to
    for v in views:
        v.flags.writeable = False
    _, (copy,) = packs.assemble(regions, views, staging=True)
    assert not np.shares_memory(copy, staging) and all((v == f).all() for v, f in zip(views, frozen))


def test_local_saves_write_packs_from_staging_without_a_copy(tmp_path, mesh, monkeypatch):
    """LocalDispatcher copies a pack's leaves into the batch's staging slice at their pack
    offsets, so the pack is written from there: no buffer of its own, host memory stays the
    staging ring's."""
    copies = []
    copied = packs._copied
    monkeypatch.setattr(packs, "_copied", lambda members, nbytes: copies.append(nbytes) or copied(members, nbytes))
    tree = small_tree(mesh)
    with dio.LocalDispatcher(host_memory_budget=8 << 20) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        assert len({s["pack"] for s in packed_leaves(tmp_path / "ckpt").values()}) >= 2
        assert copies == []
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", tree), tree)


def test_spans_read_each_pack_chunk_once_and_skip_far_gaps():
    pack = pack_spec("p", 4 << 20)   # 1 MiB chunks
    leaves = [packed_leaf(pack, offset, (16,), "uint8") for offset in (0, 64, 100 << 10, 3 << 20)]
    regions = [Region(leaf, ((0, 16),), f"l{i}") for i, leaf in enumerate(leaves)]
    regions.append(Region(leaves[1], ((0, 8),), "l1"))  # a second region of one leaf: read once
    assert [(s, e) for _, s, e, _ in packs.spans(regions)] == [(0, (100 << 10) + 16), (3 << 20, (3 << 20) + 16)]
    read = {"p": [(0, np.arange((100 << 10) + 16, dtype=np.uint64).astype(np.uint8))]}
    np.testing.assert_array_equal(packs.extract(regions[1], read), np.arange(64, 80, dtype=np.uint8))
    with pytest.raises(KeyError, match="were not read"):
        packs.extract(regions[3], read)


def test_a_manifest_whose_leaf_names_an_unknown_pack_is_malformed(tmp_path, mesh):
    tree = small_tree(mesh, n=4)
    with dio.LocalDispatcher(host_memory_budget=8 << 20) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        path = tmp_path / "ckpt" / "manifest.json"
        doc = sealed.loads(path.read_text())
        doc["packs"] = {}
        path.write_text(json.dumps(doc))
        with pytest.raises(dio.CorruptCheckpointError, match="malformed checkpoint"):
            d.restore(tmp_path / "ckpt", tree)
