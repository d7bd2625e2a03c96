"""The OCDBT chunk layout (``Options.layout="ocdbt"``, the default).

Each writer (a process ``p<k>``, a colocated CPU device ``cpu<id>``) writes an OCDBT database of
its own under ``arrays/<writer>/``, one transaction per batch; the committing process merges them
into one database at ``arrays/`` (references to the writers' data files, no data copied). These
tests look inside with ``storage_helpers`` (``tensorstore.ocdbt.dump``) and compare bytes."""

import collections
import json
import os
import threading
import time
import uuid

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
import storage_helpers as stored
from dispatch_io import workers
from conftest import LAYOUTS, assert_trees_bit_equal, hooked_dispatcher, put
from dispatch_io.jax_compat import single_device_sharding

KiB, MiB = 1 << 10, 1 << 20
TIMEOUT = 60
WRITER_DIR = ("p", "cpu")   # arrays/p<k>/ (LocalDispatcher), arrays/cpu<id>/ (ColocatedDispatcher)


def values(seed, shape, dtype):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


def writer_of(path, file) -> str:
    """The writer directory (``p0``, ``cpu3``) of a data file under ``arrays/<writer>/d/``."""
    rel = os.path.relpath(file, os.path.join(path, "arrays")).split(os.sep)
    assert len(rel) == 3 and rel[1] == "d" and rel[0].startswith(WRITER_DIR), rel
    return rel[0]


# ---- the default, and what the manifest records --------------------------------------------------

def test_default_layout_is_ocdbt_and_recorded_in_the_manifest(tmp_path, mesh, dispatcher_cls):
    assert dio.Options().layout == "ocdbt"
    assert sorted(workers.LAYOUTS) == sorted(LAYOUTS)   # the `layout` fixture covers every layout
    with pytest.raises(ValueError, match="layout"):
        dispatcher_cls(host_memory_budget=MiB, layout="zip")
    tree = {"w": put(mesh, values(0, (64, 32), np.float32), "data", "model"), "step": 3}
    with dispatcher_cls(host_memory_budget=MiB, small_leaf_bytes=0) as d:   # a chunk per shard
        assert d.options.layout == "ocdbt"
        d.save(tmp_path / "ckpt", tree).wait(TIMEOUT)
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", tree), tree)
    assert stored.manifest(tmp_path / "ckpt")["layout"] == "ocdbt"
    arrays = tmp_path / "ckpt" / "arrays"
    assert (arrays / "manifest.ocdbt").is_file()
    # No zarr array directories: the zarr keys live inside the database.
    files = stored.all_files(arrays)
    assert not any(f.endswith("zarr.json") or f"{os.sep}c{os.sep}" in f for f in files), files
    name = stored.stored_name(tmp_path / "ckpt", "['w']")
    assert f"{name}/zarr.json" in stored.stored_values(tmp_path / "ckpt")
    assert sorted(stored.chunks(tmp_path / "ckpt", "['w']")) == [(i, j) for i in range(4) for j in range(2)]
    with dispatcher_cls(host_memory_budget=MiB, layout="files") as d:
        d.save(tmp_path / "files", tree).wait(TIMEOUT)
    assert stored.manifest(tmp_path / "files")["layout"] == "files"
    assert (tmp_path / "files" / "arrays" / name / "zarr.json").is_file()


# ---- a training state: few files, bit-exact --------------------------------------------------------

SMALL_DTYPES = (np.float32, ml_dtypes.bfloat16, np.int32)
SMALL_SPECS = (P(), P("data", None), P(None, "model"), P("data", "model"))
LARGE = [((1024, 1024), np.float32, P("data", "model")),      # 4 MiB
         ((1024, 2048), ml_dtypes.bfloat16, P("data", None)),  # 4 MiB
         ((1024, 1024), np.int8, P(None, "model")),            # 1 MiB
         ((2048, 512), np.float16, P()),                       # 2 MiB, replicated
         ((512, 256), np.bool_, P("data"))]                    # 128 KiB


def training_state(mesh, seed=0):
    """Like the benchmark's training state, smaller: 32 leaves of 4 KiB .. 1 MiB (dtypes cycling
    f32 / bf16 / i32, shardings cycling replicated | rows | columns | both), 5 larger ones of mixed
    dtypes and shardings, a PRNG key and a step scalar: 39 leaves, about 17 MiB."""
    tree = {"params": {}, "opt_state": {}}
    for i in range(32):
        dtype = np.dtype(SMALL_DTYPES[i % 3])
        rows = (4096 << (i % 9)) // dtype.itemsize // 128
        tree["params" if i % 2 == 0 else "opt_state"][f"small_{i:02d}"] = jax.device_put(
            values((seed, i), (rows, 128), dtype), NamedSharding(mesh, SMALL_SPECS[i % 4]))
    for i, (shape, dtype, spec) in enumerate(LARGE):
        tree["params" if i % 2 == 0 else "opt_state"][f"big_{i:02d}"] = jax.device_put(
            values((seed, 100 + i), shape, dtype), NamedSharding(mesh, spec))
    tree["step"] = jax.device_put(np.int32(1000 + seed), NamedSharding(mesh, P()))
    tree["rng"] = jax.random.key(seed)
    return tree


def test_training_state_is_a_few_files_and_round_trips_bit_exact(tmp_path, mesh):
    tree = training_state(mesh)
    assert len(jax.tree.leaves(tree)) == 39
    path = tmp_path / "ckpt"
    # below the tree's size: several batches; a chunk per shard, so many more chunks than files
    with dio.LocalDispatcher(host_memory_budget=16 * MiB, small_leaf_bytes=0) as d:
        stats = d.save(path, tree).wait(TIMEOUT)
        assert stats.batches >= 2
        assert_trees_bit_equal(d.restore(path, tree), tree)
        assert_trees_bit_equal(d.restore(path), jax.device_get(tree))
    assert dio.metadata(path) == jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    files = stored.all_files(path)
    assert len(files) <= 20, files   # the "files" layout: one per chunk (the keys below) + one per leaf
    keys = stored.stored_values(path)
    arrays = [leaf["stored"]["name"] for leaf in stored.manifest(path)["leaves"] if leaf.get("stored")]
    assert len(arrays) == 39
    assert sorted(k for k in keys if k.endswith("/zarr.json")) == sorted(f"{a}/zarr.json" for a in arrays)
    chunk_keys = [k for k in keys if not k.endswith("/zarr.json")]
    assert len(chunk_keys) > 100, len(chunk_keys)
    # The merged database references the writer's data files: its own files are only the
    # manifest and B-tree nodes, a few KiB for ~17 MiB of data.
    assert {writer_of(path, v.file) for v in keys.values() if v.file is not None} == {"p0"}
    own = [f for f in files if f == os.path.join("arrays", "manifest.ocdbt") or f.startswith(os.path.join("arrays", "d", ""))]
    assert own and sum(os.path.getsize(path / f) for f in own) < 64 * KiB, own
    data = sum(os.path.getsize(path / f) for f in files if f.startswith(os.path.join("arrays", "p0", "d", "")))
    assert data >= stats.bytes_written >= 16 * MiB



def _data_files(path) -> dict[str, list]:
    """{data file: [stored values in it]} of the writer databases' data files (chunks only)."""
    out = collections.defaultdict(list)
    for key, value in stored.stored_values(path).items():
        if value.file is not None and not key.endswith("zarr.json"):
            out[value.file].append(value)
    return out


def test_data_file_bytes_splits_a_batch_into_files_and_round_trips(tmp_path, mesh, dispatcher_cls):
    """``data_file_bytes``: a writer starts a new data file once one holds that many bytes (the
    files of a batch are written concurrently); None: about one data file per batch and writer.
    A chunk is never split across files."""
    tree = {f"w{i}": put(mesh, values(20 + i, (256, 256), np.float32), "data") for i in range(6)}  # 6 x 256 KiB
    tree["step"] = 7
    counts = {}
    for data_file_bytes in (256 * KiB, None):
        path = tmp_path / f"ckpt-{data_file_bytes}"
        with dispatcher_cls(host_memory_budget=4 * MiB, data_file_bytes=data_file_bytes, small_leaf_bytes=0) as d:
            d.save(path, tree).wait(TIMEOUT)
            assert_trees_bit_equal(d.restore(path, tree), tree)
        files = _data_files(path)
        chunk_bytes = max(v.length for in_file in files.values() for v in in_file)
        for file, in_file in files.items():
            size = os.path.getsize(file)
            assert sum(v.length for v in in_file) <= size   # every value lies whole inside its file
            if data_file_bytes is not None:
                assert size < data_file_bytes + chunk_bytes + 64 * KiB, (file, size)
        counts[data_file_bytes] = len(files)
    # 1.5 MiB of chunks: in files of ~256 KiB, or in a file per batch (one batch here)
    assert counts[256 * KiB] >= 1536 * KiB // (256 * KiB + 64 * KiB), counts
    if dispatcher_cls is dio.LocalDispatcher:   # one writer
        assert counts[None] <= 2 < counts[256 * KiB], counts


def test_data_file_bytes_must_be_positive_or_none():
    assert dio.Options().data_file_bytes == 16 * MiB
    for bad in (0, -1, 1.5, True, "16M", 1 << 63):
        with pytest.raises(ValueError, match="data_file_bytes"):
            dio.Options(data_file_bytes=bad)
        with pytest.raises(ValueError, match="data_file_bytes"):
            workers.IOSettings(data_file_bytes=bad)
    assert dio.Options(data_file_bytes=(1 << 63) - 1).io_settings().data_file_bytes == (1 << 63) - 1

# ---- either layout reads the other ------------------------------------------------------------------

def test_restore_reads_the_layout_the_manifest_records(tmp_path, mesh, dispatcher_cls):
    tree = {"w": put(mesh, values(1, (128, 64), ml_dtypes.bfloat16), "data", "model"),
            "rep": put(mesh, values(2, (16, 16), np.int32)),
            "key": jax.random.split(jax.random.key(4, impl="rbg"), 4),
            "host": values(3, (5, 7), np.float64), "step": 9}
    with dispatcher_cls(host_memory_budget=256 * KiB, layout="files") as files, \
            dispatcher_cls(host_memory_budget=256 * KiB) as ocdbt:
        files.save(tmp_path / "by_files", tree).wait(TIMEOUT)
        ocdbt.save(tmp_path / "by_ocdbt", tree).wait(TIMEOUT)
        assert stored.layout(tmp_path / "by_files") == "files" and stored.layout(tmp_path / "by_ocdbt") == "ocdbt"
        for d in (files, ocdbt):
            for path in ("by_files", "by_ocdbt"):
                assert_trees_bit_equal(d.restore(tmp_path / path, tree), tree)
                assert_trees_bit_equal(d.restore(tmp_path / path), jax.device_get(tree))
        assert dio.metadata(tmp_path / "by_files") == dio.metadata(tmp_path / "by_ocdbt")
        # A manifest written before layouts existed (no "layout") is a "files" checkpoint.
        manifest = stored.manifest(tmp_path / "by_files")
        del manifest["layout"]
        (tmp_path / "by_files" / "manifest.json").write_text(json.dumps(manifest))
        assert_trees_bit_equal(ocdbt.restore(tmp_path / "by_files", tree), tree)
        # One this dispatch_io does not know is refused, not guessed.
        manifest["layout"] = "zip"
        (tmp_path / "by_files" / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(dio.CheckpointError, match="zip"):
            ocdbt.restore(tmp_path / "by_files", tree)


# ---- many batches, concurrent transactions --------------------------------------------------------

def hold_until_concurrent(hold_seconds=5.0):
    """A write hook holding the first batch write (up to ``hold_seconds``) until a second one is
    handed out, so that two transactions really overlap. Returns (hook, most): most[0] is the
    most batch writes handed out while the first was held."""
    lock = threading.Lock()
    entered, most = [0], [0]

    def hook(regions):
        with lock:
            entered[0] += 1
            first = entered[0] == 1
        if first:
            deadline = time.monotonic() + hold_seconds
            while entered[0] < 2 and time.monotonic() < deadline:
                time.sleep(0.002)
            most[0] = entered[0]
    return hook, most


def test_small_budget_many_batches_and_concurrent_transactions(tmp_path, mesh, dispatcher_cls):
    """Leaves split over many batches, written by two threads. LocalDispatcher: two batches'
    transactions into the one database of this process at once. ColocatedDispatcher: each
    colocated host commits into a database of its own, several hosts at once."""
    tree = {
        "a": put(mesh, values(10, (256, 256), np.float32), "data", "model"),   # 256 KiB
        "b": put(mesh, values(11, (512, 128), ml_dtypes.bfloat16), "data"),    # 128 KiB
        "c": put(mesh, values(12, (128, 512), np.int8), None, "model"),        # 64 KiB
        "r": put(mesh, values(13, (96, 96), np.float32)),                       # replicated, 36 KiB
        "h": values(14, (64, 100), np.uint16),                                  # numpy, 12.5 KiB
        "k": jax.random.key(5), "step": 41,
    }
    hook, most = hold_until_concurrent()
    path = tmp_path / "ckpt"
    with hooked_dispatcher(dispatcher_cls, hook, host_memory_budget=64 * KiB, write_threads=2) as d:
        stats = d.save(path, tree).wait(TIMEOUT)
        assert stats.batches >= 16 and stats.peak_host_bytes <= 64 * KiB, stats
        assert most[0] >= 2, most    # two batches' transactions at once
        databases = sorted(n for n in os.listdir(path / "arrays") if (path / "arrays" / n).is_dir())
        if dispatcher_cls is dio.LocalDispatcher:   # one writer database: both transactions into it
            assert databases == ["d", "p0"], databases
        else:                                       # a database per colocated CPU device and lane
            assert {"d"} | {f"cpu{i}{lane}" for i in range(8) for lane in ("", ".1")} >= set(databases), databases
            # Lanes are handed out first in, first out, so with two or more batches both are used;
            # which hosts each lane reached depends on which batch took it.
            assert {n.endswith(".1") for n in databases if n != "d"} == {False, True}, databases
        assert_trees_bit_equal(d.restore(path, tree), tree)
    with dispatcher_cls(host_memory_budget=MiB) as other:   # a fresh reader, another budget
        assert_trees_bit_equal(other.restore(path), jax.device_get(tree))
    # Every chunk of every leaf made it into the merged database, from some writer.
    manifest = stored.manifest(path)
    assert manifest["layout"] == "ocdbt"
    for leaf in manifest["leaves"]:
        if leaf.get("stored"):
            grid = [-(-n // c) for n, c in zip(leaf["stored"]["shape"], leaf["stored"]["chunk_shape"])]
            assert len(stored.chunks(path, leaf["keypath"])) == int(np.prod(grid)), leaf["keypath"]


def test_leaf_split_over_many_batches_is_one_array_after_the_merge(tmp_path, mesh, dispatcher_cls):
    x = put(mesh, values(20, (512, 256), np.float32), "data", "model")   # 512 KiB: 32 chunks of 16 KiB
    path = tmp_path / "ckpt"
    with dispatcher_cls(host_memory_budget=64 * KiB) as d:
        stats = d.save(path, {"x": x}).wait(TIMEOUT)
        assert stats.batches >= 16, stats
        chunks = stored.chunks(path, "['x']")
        stored_spec = stored.manifest(path)["leaves"][0]["stored"]
        grid = [n // c for n, c in zip(stored_spec["shape"], stored_spec["chunk_shape"])]
        assert sorted(chunks) == [(i, j) for i in range(grid[0]) for j in range(grid[1])] and len(chunks) == 32
        # The chunks come from many transactions (data files), all now under one zarr array.
        assert len({v.file for v in chunks.values()}) >= 8
        name = stored.stored_name(path, "['x']")
        assert [k for k in stored.stored_values(path) if not k.startswith(f"{name}/c/")] == [f"{name}/zarr.json"]
        # Any zarr v3 reader with OCDBT support sees one array: TensorStore on its own.
        array = ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{path}/arrays/",
                                                        "path": f"{name}/"}}, open=True).result()
        assert array.shape == (512, 256) and array.dtype == ts.float32
        assert array.read().result().tobytes() == np.asarray(x).tobytes()
        # And dispatch_io reads it onto other layouts: regions across chunk boundaries, one device.
        for target in (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P(None, "data"))),
                       jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=single_device_sharding(jax.devices()[3]))):
            restored = d.restore(path, {"x": target})["x"]
            assert restored.sharding == target.sharding
            assert np.asarray(restored).tobytes() == np.asarray(x).tobytes()


# ---- lost data files, stale caches ---------------------------------------------------------------

def test_lost_writer_data_file_names_the_key_path(tmp_path, mesh, dispatcher_cls):
    tree = {"a": put(mesh, values(30, (64, 64), np.float32), "data", "model"),
            "victim": put(mesh, values(31, (128, 64), np.float32), "data"),
            "c": values(32, (32, 32), np.int32), "step": 3}
    victim = "['victim']"
    path = tmp_path / "ckpt"
    isolate = lambda keypath, spec: dio.Priority.HIGH if keypath == victim else dio.Priority.SYNC  # noqa: E731
    # One writer thread: batches commit one after the other, so no data file mixes two batches.
    with dispatcher_cls(host_memory_budget=MiB, write_threads=1) as d:
        d.save(path, tree, priority=isolate).wait(TIMEOUT)
        # The writers' own manifests are not needed once merged: restore reads the merged database.
        for writer in os.listdir(path / "arrays"):
            if writer.startswith(WRITER_DIR):
                os.remove(path / "arrays" / writer / "manifest.ocdbt")
        assert_trees_bit_equal(d.restore(path, tree), tree)
        lost = stored.files_holding(path, victim)   # data files holding the victim's chunks, and nothing else
        assert all(writer_of(path, f) for f in lost)
        for f in lost:
            os.remove(f)
        with pytest.raises(dio.WorkerError) as info:
            d.restore(path, tree)
        assert info.value.keypath == victim and victim in str(info.value), info.value
        others = {k: v for k, v in tree.items() if k != "victim"}
        assert_trees_bit_equal(d.restore(path, others, partial=True), others)


def test_overwriting_a_memory_checkpoint_again_and_again_reads_the_latest(mesh, dispatcher_cls):
    """memory:// keeps one kvstore for the whole process: the same keys are written again by
    every overwrite. Each restore (by the saving dispatcher, and by a new one) sees the latest
    save, never a cached OCDBT manifest, B-tree node or chunk of an earlier one."""
    url = f"memory://ocdbt_overwrite_{uuid.uuid4().hex[:8]}/ckpt"
    shapes = [(64, 32), (64, 32), (128, 16), (64, 32), (32, 8)]
    with dispatcher_cls(host_memory_budget=64 * KiB) as d:
        for i, shape in enumerate(shapes):
            tree = {"w": put(mesh, values(40 + i, shape, np.float32 if i % 2 else np.int32), "data"),
                    "h": values(50 + i, (i + 1, 3), np.float64), "step": i}
            if i % 2:
                tree[f"only_{i}"] = put(mesh, values(60 + i, (16,), np.uint8))
            d.save(url, tree, overwrite=True).wait(TIMEOUT)
            assert_trees_bit_equal(d.restore(url, tree), tree)
            assert_trees_bit_equal(d.restore(url), jax.device_get(tree))
            with dispatcher_cls(host_memory_budget=MiB) as fresh:
                assert_trees_bit_equal(fresh.restore(url, tree), tree)
            assert dio.metadata(url)["w"] == jax.ShapeDtypeStruct(shape, tree["w"].dtype)


def test_failing_merge_commits_nothing_and_keeps_the_previous_checkpoint(tmp_path, mesh, dispatcher_cls,
                                                                         monkeypatch):
    """The merge (with the arrays' metadata) is the last step before the manifest: if it fails,
    the save raises, its temporary directory goes, and the checkpoint it was replacing is still there, intact."""
    import errno

    import dispatch_io.save.finish

    old = {"w": put(mesh, values(70, (64, 64), np.float32), "data", "model"), "step": 1}
    new = {"w": put(mesh, values(71, (64, 64), np.float32), "data", "model"), "step": 2}
    path = tmp_path / "ckpt"
    with dispatcher_cls(host_memory_budget=MiB) as d:
        d.save(path, old).wait(TIMEOUT)
        before = (path / "COMMITTED").read_bytes()
        real = dispatch_io.save.finish.finish_arrays
        merges = []

        def failing_merge(*args, **kwargs):
            merges.append(args)
            raise OSError(errno.EIO, "merge failed")

        monkeypatch.setattr(dispatch_io.save.finish, "finish_arrays", failing_merge)
        with pytest.raises(dio.CheckpointError, match="merge failed"):
            d.save(path, new, overwrite=True).wait(TIMEOUT)
        assert len(merges) == 1
        assert sorted(os.listdir(tmp_path)) == ["ckpt"]
        assert (path / "COMMITTED").read_bytes() == before
        assert_trees_bit_equal(d.restore(path, old), old)
        monkeypatch.setattr(dispatch_io.save.finish, "finish_arrays", real)
        d.save(path, new, overwrite=True).wait(TIMEOUT)
        assert_trees_bit_equal(d.restore(path, new), new)


# ---- array metadata: written once, by the commit -------------------------------------------------

DTYPES = ["bool", "int4", "int8", "int16", "int32", "int64", "uint4", "uint8", "uint16", "uint32", "uint64",
          "float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "float32", "float64", "complex64", "complex128",
          "float4_e2m1fn"]


@pytest.mark.parametrize("compression", [None, ("zstd", 3), ("zstd", -5)])
def test_the_metadata_a_save_stores_is_what_tensorstore_creates(compression):
    """Writers write chunks only and the commit stores each array's zarr.json from
    ``ArraySpec.zarr_metadata``: for every dtype it is the metadata TensorStore itself writes
    when it creates that array."""
    import json

    import tensorstore as ts
    from dispatch_io.workers import ArraySpec

    for dtype in DTYPES:
        spec = ArraySpec(f"a_{dtype}", (5, 0, 3), dtype, (2, 1, 3))
        ours = spec.zarr_metadata(compression)
        tspec = {**spec.tensorstore_spec({"driver": "memory", "path": f"{compression}/"}), "metadata": ours}
        created = ts.open(tspec, create=True).result()
        theirs = json.loads(created.kvstore.read("zarr.json").result().value)
        assert ours == theirs, (dtype, ours, theirs)


def test_writers_store_chunks_only_and_the_merge_stores_the_metadata_inline(tmp_path, mesh, dispatcher_cls):
    """No writer database holds an array's metadata (no metadata IO while writing); the merged
    database holds each array's zarr.json once, in its B-tree (no data file)."""
    import tensorstore as ts

    tree = {"w": put(mesh, values(80, (64, 32), np.float32), "data", "model"),
            "b": put(mesh, values(81, (64,), "bfloat16"), "data"), "z": np.zeros((0, 4), np.int8)}
    path = tmp_path / "ckpt"
    with dispatcher_cls(host_memory_budget=16 * KiB, small_leaf_bytes=0) as d:
        d.save(path, tree).wait(TIMEOUT)
        assert_trees_bit_equal(d.restore(path, tree), tree)
    writers = [name for name in os.listdir(path / "arrays") if name.startswith(WRITER_DIR)]
    assert writers
    for writer in writers:
        db = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/arrays/{writer}/"}).result()
        keys = [k.decode() for k in db.list().result()]
        assert keys and not [k for k in keys if k.endswith("zarr.json")], (writer, keys)
    keys = stored.stored_values(path)
    metadata = {k: v for k, v in keys.items() if k.endswith("/zarr.json")}
    with_chunks = {k.split("/")[0] for k in keys if not k.endswith("/zarr.json")}
    assert sorted(metadata) == sorted(f"{name}/zarr.json" for name in with_chunks) and len(with_chunks) == 2
    assert all(v.file is None for v in metadata.values()), metadata
