"""Exports to object stores (S3 and GCS, real servers on loopback): ``convert --to safetensors``
and ``--to orbax`` with an ``s3://`` / ``gs://`` destination, read back bit-exact (by dispatch_io
and, downloaded byte for byte, by the real safetensors package and Orbax), committed by a file
written last so that no reader sees half an export, and leaving nothing when they fail."""

import os
import threading

import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from safetensors.numpy import load_file

import dispatch_io as dio
from conftest import assert_trees_bit_equal
from dispatch_io import cli
from dispatch_io.formats import exporting
from dispatch_io.storage import kvstore_spec

KiB, MiB = 1 << 10, 1 << 20


def weights() -> dict:
    """Eight float32 matrices of 32 KiB and a few small leaves: several shards under a small budget."""
    rng = np.random.default_rng(5)
    return {"layers": [{"w": rng.standard_normal((64, 128)).astype(np.float32),
                        "b": rng.standard_normal(128).astype(np.float16)} for _ in range(8)],
            "embed": rng.integers(-100, 100, (16, 8)).astype(np.int8)}


def by_name(tree: dict) -> dict:
    """The leaves of ``weights()`` by their safetensors names (key names joined by ``.``)."""
    out = {f"layers.{i}.{k}": v for i, layer in enumerate(tree["layers"]) for k, v in layer.items()}
    return {**out, "embed": tree["embed"]}


def keys(url: str) -> list[str]:
    return sorted(k.decode() for k in ts.KvStore.open(kvstore_spec(url)).result().list().result())


def download(url: str, local) -> list[str]:
    """Every object under ``url`` copied byte for byte into the local directory ``local``."""
    kv = ts.KvStore.open(kvstore_spec(url)).result()
    names = keys(url)
    for name in names:
        os.makedirs(os.path.dirname(os.path.join(local, name)), exist_ok=True)
        with open(os.path.join(local, name), "wb") as f:
            f.write(bytes(kv.read(name).result().value))
    return names


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "ckpt"
    with dio.LocalDispatcher() as d:
        d.save(path, weights()).wait()
    return path


def test_safetensors_export_to_an_object_store_is_sharded_within_the_budget_and_reads_back(source, store_prefix,
                                                                                          tmp_path):
    """Under a 256 KiB budget each shard is built in memory within a quarter of it (64 KiB: here
    one matrix and its bias); the index is the commit. Read back by dispatch_io from the
    prefix and by the safetensors package from a byte-for-byte download, bit for bit."""
    url = f"{store_prefix}/hf"
    with dio.LocalDispatcher(host_memory_budget=256 * KiB) as d:
        stats = d.convert(source, url, to="safetensors")
        assert len(stats.files) == 9 and stats.files[-1] == "model.safetensors.index.json", stats.files
        assert keys(url) == sorted(stats.files)
        expected = d.restore(source)
        assert_trees_bit_equal(d.restore(url), by_name(expected))
        download(url, tmp_path / "hf")
        tensors = {}
        for name in stats.files[:-1]:
            tensors.update(load_file(tmp_path / "hf" / name))
        assert tensors["layers.3.w"].tobytes() == expected["layers"][3]["w"].tobytes()
        assert tensors["embed"].tobytes() == expected["embed"].tobytes() and len(tensors) == 17

        with pytest.raises(FileExistsError, match="exists"):
            d.convert(source, url, to="safetensors")
        d.convert(source, url, to="safetensors", max_shard_size=1 << 30, overwrite=True)
        assert keys(url) == sorted(stats.files)   # the budget caps the shards, whatever max_shard_size says

    with dio.LocalDispatcher(host_memory_budget=64 * MiB) as d:   # everything fits: one object, whole or absent
        d.convert(source, url, to="safetensors", overwrite=True)
        assert keys(url) == ["model.safetensors"]
        assert_trees_bit_equal(d.restore(url), by_name(expected))
    with dio.LocalDispatcher(host_memory_budget=64 * KiB) as d:   # a 32 KiB matrix is more than a quarter
        with pytest.raises(ValueError, match=r"\['layers'\]\[0\]\['w'\]: 32768 bytes, more than an object-store"):
            d.convert(source, f"{store_prefix}/small", to="safetensors")
        with pytest.raises(ValueError, match="writes a folder prefix"):
            d.convert(source, f"{store_prefix}/one.safetensors", to="safetensors")
    assert keys(f"{store_prefix}/small") == []


def test_a_reader_never_sees_half_an_export_and_a_failed_one_leaves_nothing(source, store_prefix, monkeypatch):
    url = f"{store_prefix}/hf"
    written, release = threading.Event(), threading.Event()
    write = exporting.ObjectOutput.write

    def held(self, name, data):   # the third shard written: hold the export there
        write(self, name, data)
        if name.startswith("model-00003"):
            written.set()
            release.wait(60)
    monkeypatch.setattr(exporting.ObjectOutput, "write", held)
    errors = []

    def run():
        try:
            with dio.LocalDispatcher(host_memory_budget=256 * KiB) as d:
                d.convert(source, url, to="safetensors")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert written.wait(60)
        assert "model-00003-of-00008.safetensors" in keys(url) and "model.safetensors.index.json" not in keys(url)
        with pytest.raises(dio.IncompleteCheckpointError, match="holds 3 of the 8 shards of model and no index"):
            dio.metadata(url)
    finally:
        release.set()
        thread.join(60)
    assert not errors and len(dio.metadata(url)) == 17

    def failing(self, name, data):
        if name.startswith("model-00004"):
            raise dio.CheckpointError("injected: the store refused a write")
        write(self, name, data)
    monkeypatch.setattr(exporting.ObjectOutput, "write", failing)
    with dio.LocalDispatcher(host_memory_budget=256 * KiB) as d:
        with pytest.raises(dio.CheckpointError, match="injected"):
            d.convert(source, f"{store_prefix}/failed", to="safetensors")
    assert keys(f"{store_prefix}/failed") == []


@pytest.mark.parametrize("step", [False, True], ids=["item", "step"])
def test_orbax_export_to_an_object_store_restores_in_orbax_and_commits_last(source, store_prefix, tmp_path,
                                                                            monkeypatch, step):
    """An item, or a step of Orbax's CheckpointManager (``<root>/100``): dispatch_io reads it from
    the prefix, a manager lists the step, and Orbax restores a byte-for-byte download
    bit-exactly. ``_METADATA`` and ``commit_success.txt`` are written last."""
    url = f"{store_prefix}/run/100" if step else f"{store_prefix}/item"
    order = []
    write = exporting.ObjectOutput.write
    monkeypatch.setattr(exporting.ObjectOutput, "write", lambda self, name, data: (order.append(name),
                                                                                   write(self, name, data))[1])
    with dio.LocalDispatcher(host_memory_budget=256 * KiB) as d:
        d.convert(source, url, to="orbax")
        expected = d.restore(source)
        assert_trees_bit_equal(d.restore(url), expected)
    last = ["default/_METADATA", "default/commit_success.txt", "commit_success.txt"] if step else \
        ["_METADATA", "commit_success.txt"]
    assert order[-len(last):] == last, order
    if step:
        with dio.CheckpointManager(f"{store_prefix}/run") as mgr:
            assert mgr.all_steps() == [100]
            assert_trees_bit_equal(mgr.restore(100), expected)
    local = tmp_path / "downloaded"
    download(url, local)
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(local / "default" if step else local)
    assert_trees_bit_equal(restored, expected)


def test_the_command_line_exports_to_an_object_store(source, store_prefix):
    assert cli.main(["convert", str(source), f"{store_prefix}/hf", "--to", "safetensors", "--budget-mib", "1"]) == 0
    assert cli.main(["convert", str(source), f"{store_prefix}/hf", "--to", "safetensors"]) == 2   # exists
    assert cli.main(["convert", str(source), f"{store_prefix}/orbax", "--to", "orbax"]) == 0
    assert cli.main(["verify", f"{store_prefix}/orbax"]) == 0


def test_an_orbax_export_killed_before_its_commit_is_replaced_by_the_next(source, store_prefix, monkeypatch):
    """A killed export (simulated: the write of _METADATA fails and nothing is cleaned up, as after a
    SIGKILL) leaves the arrays' files at the prefix and no commit file: no reader sees a checkpoint
    there, and an export again with overwrite=True must replace them (its marker, written first,
    says they are an export's). A prefix of foreign objects is still refused and left as it was."""
    url = f"{store_prefix}/item"
    write, abort = exporting.ObjectOutput.write, exporting.ObjectOutput.abort

    def killed(self, name, data):
        if name.endswith("_METADATA"):
            raise dio.CheckpointError("injected: killed before the commit")
        write(self, name, data)
    monkeypatch.setattr(exporting.ObjectOutput, "write", killed)
    monkeypatch.setattr(exporting.ObjectOutput, "abort", lambda self: None)
    with dio.LocalDispatcher(host_memory_budget=256 * KiB) as d:
        with pytest.raises(dio.CheckpointError, match="injected"):
            d.convert(source, url, to="orbax")
        assert exporting.IN_PROGRESS in keys(url) and "_METADATA" not in keys(url)
        monkeypatch.setattr(exporting.ObjectOutput, "write", write)
        monkeypatch.setattr(exporting.ObjectOutput, "abort", abort)
        d.convert(source, url, to="orbax", overwrite=True)
        assert_trees_bit_equal(d.restore(url), d.restore(source))
        assert exporting.IN_PROGRESS not in keys(url) and "commit_success.txt" in keys(url)

        foreign = f"{store_prefix}/foreign"
        ts.KvStore.open(kvstore_spec(foreign)).result().write("notes.txt", b"mine").result()
        with pytest.raises(ValueError, match="not a checkpoint this export writes"):
            d.convert(source, foreign, to="orbax", overwrite=True)
        assert keys(foreign) == ["notes.txt"]
