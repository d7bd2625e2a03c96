"""Untrusted checkpoints: a damaged or crafted description ends promptly in a one-line
CorruptCheckpointError ("malformed checkpoint") naming the key path, before anything is planned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import dispatch_io as dio
from dispatch_io import validate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_SECONDS = 5   # each refusal; the damage of the issue took > 100 s or GiBs before


def save(path, layout="ocdbt", **options):
    tree = {"w": np.arange(512 * 256, dtype=np.float32).reshape(512, 256), "b": np.arange(8, dtype=np.int32),
            "c": np.arange(4.0), "step": 3}   # b and c: one pack
    with dio.LocalDispatcher(host_memory_budget=4 << 20, layout=layout, **options) as d:
        d.save(path, tree).wait(60)
    return tree


def edit_manifest(path, change):
    doc = json.loads((path / "manifest.json").read_text())
    change(doc)
    (path / "manifest.json").write_text(json.dumps(doc))


def leaf(doc, keypath):
    return next(e for e in doc["leaves"] if e["keypath"] == keypath)


def refused(path, keypath, match):
    """Every reading operation ends promptly in CorruptCheckpointError naming ``keypath``."""
    with dio.LocalDispatcher(host_memory_budget=4 << 20) as d:
        for name, call in (("metadata", lambda: dio.metadata(path)), ("restore", lambda: d.restore(path)),
                           ("verify", lambda: d.verify(path)),
                           ("convert", lambda: d.convert(path, path.parent / "converted"))):
            started = time.perf_counter()
            with pytest.raises(dio.CorruptCheckpointError, match=match) as info:
                call()
            assert time.perf_counter() - started < PROMPT_SECONDS, name
            message = str(info.value)
            assert "malformed checkpoint" in message and str(path) in message, message
            assert len(message.splitlines()) == 1 and len(message) < 600, message
            assert info.value.keypath == keypath and info.value.path == str(path), (name, info.value.keypath)
    assert not (path.parent / "converted").exists()


def set_shape(doc, keypath, shape, chunk_shape=None):
    entry = leaf(doc, keypath)
    entry["shape"] = entry["stored"]["shape"] = shape
    if chunk_shape is not None:
        entry["stored"]["chunk_shape"] = chunk_shape
    doc["total_bytes"] += (np.prod(shape, dtype=object) - 512 * 256) * 4   # consistent: only zarr.json tells


def test_a_claimed_2_28_by_2_28_leaf_is_refused_before_planning(tmp_path):
    path = tmp_path / "ckpt"
    save(path)
    edit_manifest(path, lambda doc: set_shape(doc, "['w']", [1 << 28, 1 << 28]))
    refused(path, "['w']", r"more than \d+")   # its chunk grid alone is 2^39 chunks


@pytest.mark.parametrize("layout", ["ocdbt", "files"])
def test_a_claimed_4_tib_leaf_is_refused_by_its_zarr_json(tmp_path, layout):
    path = tmp_path / "ckpt"
    save(path, layout)
    # 2^20 x 2^20 float32 in its stored 512 x 256 chunks: 2^23 chunks, within bounds; only the
    # stored array's own metadata says it is 512 x 256.
    edit_manifest(path, lambda doc: set_shape(doc, "['w']", [1 << 20, 1 << 20]))
    refused(path, "['w']", r"zarr.json shape \[512, 256\], the manifest says \[1048576, 1048576\]")


def test_a_claimed_4_tib_restore_stays_small(tmp_path):
    """In a fresh process (VmHWM is the process's peak): the refusal allocates nothing of it."""
    path = tmp_path / "ckpt"
    save(path)
    edit_manifest(path, lambda doc: set_shape(doc, "['w']", [1 << 20, 1 << 20]))
    script = textwrap.dedent(f"""
        import os, time
        os.environ["JAX_PLATFORMS"] = "cpu"
        import dispatch_io as dio
        def peak():
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) << 10
        d = dio.LocalDispatcher(host_memory_budget=64 << 20)
        before, started = peak(), time.perf_counter()
        try:
            d.restore({str(path)!r})
        except dio.CorruptCheckpointError as exc:
            print(type(exc).__name__, time.perf_counter() - started, before, peak())
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                         check=True).stdout.split()
    assert out[0] == "CorruptCheckpointError", out
    seconds, before, after = float(out[1]), int(out[2]), int(out[3])
    assert seconds < PROMPT_SECONDS and after - before < 64 << 20, out   # was: 1.7 GiB, then MemoryError


@pytest.mark.parametrize("name", ["../../etc", "00000.w/../../x", "/tmp/x", "00000.w/x", ""])
def test_a_stored_name_outside_the_checkpoint_is_our_one_line_error(tmp_path, name):
    path = tmp_path / "ckpt"
    save(path, "files")
    edit_manifest(path, lambda doc: leaf(doc, "['w']")["stored"].update(name=name))
    refused(path, "['w']", "stored array name .* is not '<index>.<hint>'")


def test_a_logical_shape_that_is_not_the_stored_one(tmp_path):
    path = tmp_path / "ckpt"
    save(path)
    edit_manifest(path, lambda doc: leaf(doc, "['w']").update(shape=[1 << 28, 1 << 28]))
    refused(path, "['w']", r"stored shape \[512, 256\] is not the leaf's \[268435456, 268435456\]")


@pytest.mark.parametrize("field, value, match", [
    ("shape", [512, 128], r"zarr.json shape \[512, 128\]"),
    ("data_type", "int32", "zarr.json data_type 'int32'"),
    ("chunk_grid", {"name": "regular", "configuration": {"chunk_shape": [1, 1]}}, "zarr.json chunk_grid"),
    ("codecs", [{"name": "bytes", "configuration": {"endian": "big"}}], "zarr.json codecs"),
    ("storage_transformers", [{"name": "sharding_indexed"}], "zarr.json storage_transformers"),
    ("an_extension", {"name": "x"}, "zarr.json field 'an_extension'"),
    ("fill_value", "a fish", "zarr.json fill_value 'a fish'"),
])
def test_a_zarr_json_that_disagrees_with_the_manifest(tmp_path, field, value, match):
    path = tmp_path / "ckpt"
    save(path, "files")
    name = leaf(json.loads((path / "manifest.json").read_text()), "['w']")["stored"]["name"]
    zarr_json = path / "arrays" / name / "zarr.json"
    zarr_json.write_text(json.dumps({**json.loads(zarr_json.read_text()), field: value}))
    refused(path, "['w']", match)


def test_a_pack_offset_outside_its_pack(tmp_path):
    path = tmp_path / "ckpt"
    save(path)
    edit_manifest(path, lambda doc: leaf(doc, "['b']")["stored"].update(offset=1 << 40))
    with pytest.raises(dio.CorruptCheckpointError, match="does not fit in pack") as info:
        dio.metadata(path)
    assert "malformed checkpoint" in str(info.value)


@pytest.mark.parametrize("change, match", [
    (lambda doc: doc.update(structure=nested(validate.MAX_STRUCTURE_DEPTH + 1)), "nested deeper"),
    (lambda doc: doc.update(total_bytes=1 << 50), "total_bytes"),
    (lambda doc: doc.update(total_bytes="12"), "total_bytes must be an int"),
    (lambda doc: leaf(doc, "['w']")["stored"].update(chunk_shape=[512]), "chunk shape"),
    (lambda doc: leaf(doc, "['w']")["stored"].update(chunk_shape=[0, 256]), "chunk_shape must be"),
    (lambda doc: leaf(doc, "['w']").update(shape=[512.0, 256]), "shape must be a list"),
    (lambda doc: leaf(doc, "['w']").update(kind="pickle"), "kind"),
    (lambda doc: leaf(doc, "['w']")["stored"].update(dtype="int32"), "stored dtype int32"),
    (lambda doc: leaf(doc, "['w']").update(dtype="object") or leaf(doc, "['w']")["stored"].update(dtype="object"),
     "holds Python objects"),
    (lambda doc: leaf(doc, "['w']").update(key_impl=""), "key_impl is for key leaves"),
])
def test_malformed_manifest_fields(tmp_path, change, match):
    path = tmp_path / "ckpt"
    save(path)
    edit_manifest(path, change)
    with pytest.raises(dio.CorruptCheckpointError, match=match) as info:
        dio.metadata(path)
    assert "malformed checkpoint" in str(info.value) and len(str(info.value).splitlines()) == 1


def nested(depth):
    node = {"leaf": True}
    for _ in range(depth):
        node = {"list": [node]}
    return node


def test_a_sound_checkpoint_still_restores(tmp_path):
    path = tmp_path / "ckpt"
    tree = save(path, checksums=True)
    with dio.LocalDispatcher(host_memory_budget=4 << 20) as d:
        out = d.restore(path)
        assert d.verify(path).verified
    np.testing.assert_array_equal(out["w"], tree["w"])
    assert out["step"] == 3


def run_cli(capsys, *args):
    from dispatch_io import cli

    code = cli.main([*map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_cli_answers_a_malformed_checkpoint_with_exit_2_and_one_line(tmp_path, capsys):
    path = tmp_path / "ckpt"
    save(path)
    edit_manifest(path, lambda doc: set_shape(doc, "['w']", [1 << 20, 1 << 20]))
    for args in (("inspect", path), ("verify", path), ("convert", path, tmp_path / "out")):
        code, out, err = run_cli(capsys, *args)
        assert code == 2 and not out and "Traceback" not in err, (args, code, err)
        assert len(err.strip().splitlines()) == 1 and "malformed checkpoint: ['w']: " in err, err
    assert not (tmp_path / "out").exists()


def test_the_cli_answers_corrupt_data_with_exit_1_and_verbose_adds_the_causes(tmp_path, capsys):
    path = tmp_path / "ckpt"
    save(path, "files", checksums=True)
    name = leaf(json.loads((path / "manifest.json").read_text()), "['w']")["stored"]["name"]
    chunk = path / "arrays" / name / "c" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:100])   # truncated: TensorStore cannot decode it
    code, out, err = run_cli(capsys, "verify", path)
    assert code == 1 and "Traceback" not in err and "['w']" in err and "NOT sound" in err, err
    assert len(err.strip().splitlines()) == 1 and "tensorstore_spec" not in err, err
    code, _, verbose = run_cli(capsys, "verify", path, "--verbose")
    assert code == 1 and verbose.startswith(err.strip()) and "caused by" in verbose, verbose
    assert len(verbose.strip().splitlines()) >= 2   # the chained causes, in full


@pytest.mark.parametrize("structure", [
    {"dict": ["a", "b"], "children": [{"leaf": 0}]},                                   # fewer children than keys
    {"dict": ["a", "a"], "children": [{"leaf": 0}, {"leaf": 1}]},                      # a key twice
    {"ordereddict": ["a"], "children": [{"leaf": 0}, {"leaf": 1}]},
    {"namedtuple": "x:Y", "fields": ["a", "b"], "children": [{"leaf": 0}]},
    {"dict": [{"repr": "[1]"}], "children": [{"leaf": 0}]},                            # unhashable
    {"list": {"leaf": 0}},
], ids=["dict-count", "dict-repeated", "ordereddict-count", "namedtuple-count", "unhashable", "list-not-list"])
def test_a_malformed_structure_never_reaches_jax(tmp_path, structure):
    """Each of these made JAX's tree code raise RuntimeError / TypeError (one crashed the process)."""
    path = tmp_path / "ckpt"
    save(path)
    edit_manifest(path, lambda doc: doc.update(structure=structure))
    with pytest.raises(dio.CorruptCheckpointError, match="malformed checkpoint"):
        dio.metadata(path)


def test_a_structure_never_imports_a_module(tmp_path):
    import sys

    path = tmp_path / "ckpt"
    save(path)
    module = "antigravity"   # importing it opens a web browser
    assert module not in sys.modules
    edit_manifest(path, lambda doc: doc.update(structure={
        "custom": f"{module}:geohash", "aux": None, "children": [{"leaf": i} for i in range(4)]}))
    dio.metadata(path)   # read as a dict of its children
    assert module not in sys.modules


def test_a_symlink_leading_out_of_the_checkpoint_is_refused(tmp_path):
    """Decided: a reader reads nothing outside the checkpoint; a link inside it to inside it
    (or the checkpoint path itself a link) is fine."""
    path = tmp_path / "ckpt"
    tree = save(path, "files")
    outside = tmp_path / "secret"
    outside.write_bytes(b"\0" * (512 * 256 * 4))
    name = leaf(json.loads((path / "manifest.json").read_text()), "['w']")["stored"]["name"]
    chunk = path / "arrays" / name / "c" / "0" / "0"
    kept = path / "kept"
    chunk.rename(kept)
    chunk.symlink_to(kept)                      # inside: reads as before
    (tmp_path / "link").symlink_to(path)
    with dio.LocalDispatcher(host_memory_budget=4 << 20) as d:
        np.testing.assert_array_equal(d.restore(tmp_path / "link")["w"], tree["w"])
    chunk.unlink()
    chunk.symlink_to(outside)                   # outside: refused, naming the link
    with pytest.raises(dio.CorruptCheckpointError, match=r"1 symbolic link\(s\) in it lead outside it \(arrays/"):
        dio.metadata(path)


def test_a_marker_nested_too_deep_is_no_marker():
    from dispatch_io.storage.markers import Marker

    assert not Marker.parse(b"[" * 100_000).ours   # was a RecursionError out of a manager's listing
    assert not Marker.parse(b'{"host": [], "pid": "x", "id": 1}').ours


def test_what_is_checked_once_per_value_still_names_each_leaf(tmp_path):
    """check_manifest checks a (stored, leaf) dtype pair once, not per leaf: ['b'] (int32 in
    int32) passes, ['c'] (float64 stored as int32) in the same pack is still refused, by name."""
    path = tmp_path / "ckpt"
    save(path)
    edit_manifest(path, lambda doc: leaf(doc, "['c']")["stored"].update(dtype="int32"))
    with pytest.raises(dio.CorruptCheckpointError, match="stored dtype int32 is not the leaf's float64") as info:
        dio.metadata(path)
    assert info.value.keypath == "['c']"


@pytest.mark.parametrize("enabled", [True, False])
def test_opening_leaves_the_garbage_collector_as_it_was(tmp_path, enabled):
    """open_checkpoint pauses cyclic garbage collection while it parses the manifest: on again
    after an open and after a refusal, and never switched on by it when it was off."""
    import gc

    path = tmp_path / "ckpt"
    save(path)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        dio.metadata(path)
        assert gc.isenabled() == enabled
        edit_manifest(path, lambda doc: leaf(doc, "['w']").update(kind="pickle"))
        with pytest.raises(dio.CorruptCheckpointError, match="kind 'pickle'"):
            dio.metadata(path)
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


@pytest.fixture(scope="module")
def orbax_checkpoint(tmp_path_factory):
    ocp = pytest.importorskip("orbax.checkpoint")
    path = tmp_path_factory.mktemp("orbax") / "item"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, {"w": np.arange(512 * 256, dtype=np.float32).reshape(512, 256), "s": 3})
    return path


def orbax_entry(doc, key):
    return next(e for e in doc["tree_metadata"].values() if e["key_metadata"][0]["key"] == key)


@pytest.mark.parametrize("change, keypath, match", [
    (lambda doc: orbax_entry(doc, "w")["key_metadata"][0].update(key=".."), "['..']", "not a name inside"),
    (lambda doc: orbax_entry(doc, "w")["key_metadata"][0].update(key="a/../../b"), "['a/../../b']",
     "not a name inside"),
    (lambda doc: orbax_entry(doc, "w")["value_metadata"].update(value_type="scalar"), "['w']",
     r"an Orbax scalar stored as an array of shape \[512, 256\]"),
    (lambda doc: orbax_entry(doc, "w")["key_metadata"][0].update(key=None), None, "Orbax metadata"),
    (lambda doc: doc.update(tree_metadata=[]), None, "unreadable Orbax metadata"),
], ids=["dotdot", "slashes", "scalar-array", "key-null", "tree-list"])
def test_a_malformed_orbax_metadata(tmp_path, orbax_checkpoint, change, keypath, match):
    import shutil

    path = tmp_path / "item"
    shutil.copytree(orbax_checkpoint, path)
    doc = json.loads((path / "_METADATA").read_text())
    change(doc)
    (path / "_METADATA").write_text(json.dumps(doc))
    started = time.perf_counter()
    with pytest.raises(dio.CorruptCheckpointError, match=match) as info:
        dio.metadata(path)
    assert time.perf_counter() - started < PROMPT_SECONDS
    assert "malformed checkpoint" in str(info.value) and len(str(info.value).splitlines()) == 1
    assert info.value.keypath == keypath


def test_tensorstore_errors_are_condensed_and_the_chain_keeps_them(tmp_path):
    import shutil

    path = tmp_path / "ckpt"
    save(path, "files")
    name = leaf(json.loads((path / "manifest.json").read_text()), "['w']")["stored"]["name"]
    shutil.rmtree(path / "arrays" / name)   # lost: reading ['w'] fails in TensorStore
    with dio.LocalDispatcher(host_memory_budget=4 << 20) as d, pytest.raises(dio.WorkerError) as info:
        d.restore(path)
    message = str(info.value)
    assert "['w']" in message and "NOT_FOUND" in message and len(message.splitlines()) == 1, message
    assert "tensorstore_spec" not in message and len(message) < 800, message
    chain, cause = [], info.value.__cause__
    while cause is not None:
        chain.append(str(cause))
        cause = cause.__cause__
    assert any("tensorstore_spec" in text for text in chain)   # the detail, for --verbose and debuggers
