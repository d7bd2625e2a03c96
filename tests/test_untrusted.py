"""Untrusted checkpoints: a damaged or crafted description ends promptly in a one-line
CorruptCheckpointError ("malformed checkpoint") naming the key path, before anything is planned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dispatch_io as dio
from dispatch_io import validate
from dispatch_io.storage import sealed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_SECONDS = 5   # each refusal; the damage of the issue took > 100 s or GiBs before


def save(path, layout="ocdbt", **options):
    tree = {"w": np.arange(512 * 256, dtype=np.float32).reshape(512, 256), "b": np.arange(8, dtype=np.int32),
            "c": np.arange(4.0), "step": 3}   # b and c: one pack
    with dio.LocalDispatcher(host_memory_budget=4 << 20, layout=layout, **options) as d:
        d.save(path, tree).wait(60)
    return tree


def edit_manifest(path, change):
    doc = sealed.loads((path / "manifest.json").read_text())
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


# ---- crafted files: special files, huge claims, sparse metadata, shared names ----------------------

def _orbax_sharded(path, mesh):
    tree = {"w": jax.device_put(np.arange(64.0, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("data", "model")))}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        ckptr.save(path, args=ocp.args.PyTreeSave(tree))
    return path


def test_an_orbax_sharding_with_a_duplicated_mesh_axis_is_a_checkpoint_error(tmp_path, mesh):
    """_sharding naming one mesh axis twice: jax raises DuplicateSpecError (an Exception, not a
    ValueError), which orbax._sharding does not catch -> metadata() and restore() crash with it."""
    path = _orbax_sharded(tmp_path / "orbax", mesh)
    shardings = json.loads((path / "_sharding").read_text())
    for name, text in shardings.items():
        entry = json.loads(text)
        entry["partition_spec"] = ["data", "data"]
        shardings[name] = json.dumps(entry)
    (path / "_sharding").write_text(json.dumps(shardings))
    for call in (lambda: dio.metadata(path), lambda: dio.LocalDispatcher().restore(path)):
        try:
            call()   # a saved sharding is only a default: ignoring it is right too
        except dio.CheckpointError:
            pass


_SPECIAL_FILE = r"""
import os, resource, sys, pathlib, numpy as np
import dispatch_io as dio
p, which, kind = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
with dio.LocalDispatcher() as d:
    d.save(p, {"w": np.arange(8.0)}).wait(60)
os.remove(p / which)
os.symlink("/dev/zero", p / which) if kind == "zero" else os.mkfifo(p / which)
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
try:
    dio.metadata(p)
except dio.CheckpointError as e:
    print("CheckpointError")
except BaseException as e:
    print("OTHER", type(e).__name__)
"""


@pytest.mark.parametrize("which", ["manifest.json", "COMMITTED"])
@pytest.mark.parametrize("kind", ["zero", "fifo"])
def test_a_manifest_or_marker_that_is_dev_zero_or_a_fifo_is_refused_promptly(tmp_path, which, kind):
    """read_manifest / commit_marker open and read() the file before _check_links runs and with
    only an st_size bound: a symlink to /dev/zero (st_size 0) is read until memory runs out
    (MemoryError under a 3 GiB limit, the OOM killer without one); a FIFO (tar keeps them) blocks
    open() forever. Right: refuse links out before reading anything, open with O_NONBLOCK / check
    S_ISREG, read at most MAX_MANIFEST_BYTES + 1."""
    try:
        proc = subprocess.run([sys.executable, "-c", _SPECIAL_FILE, str(tmp_path / "c"), which, kind],
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{which} as {kind}: metadata() hangs")
    assert proc.stdout.strip() == "CheckpointError", proc.stdout + proc.stderr[-2000:]




_CLAIM = r"""
import glob, json, pathlib, sys
import numpy as np
import dispatch_io as dio
from dispatch_io.storage import sealed
p = pathlib.Path(sys.argv[1])
with dio.LocalDispatcher(host_memory_budget=1 << 20, layout="files") as d:
    d.save(p, {"w": np.arange(512 * 256, dtype=np.float32).reshape(512, 256)}).wait(60)
shape = [1 << 19, 1 << 19]      # in the stored 512 x 256 chunks: 2^21 chunks (MAX_CHUNKS is 2^24), 1 TiB
doc = sealed.loads((p / "manifest.json").read_text())
doc["leaves"][0]["shape"] = doc["leaves"][0]["stored"]["shape"] = shape
doc["total_bytes"] = shape[0] * shape[1] * 4
(p / "manifest.json").write_text(json.dumps(doc))
z = glob.glob(str(p / "**/zarr.json"), recursive=True)[0]
meta = json.loads(open(z).read()); meta["shape"] = shape; open(z, "w").write(json.dumps(meta))
"""

# A process of its own for the verify alone: its VmHWM is JAX's start-up plus what verify holds.
# (Not ru_maxrss: Linux carries the parent's resident size at fork over the exec, so under pytest
# it reads as large as the test process.)
_VERIFY = r"""
import json, pathlib, re, sys, time
import dispatch_io as dio
started = time.perf_counter()
try:
    with dio.LocalDispatcher(host_memory_budget=64 << 20) as d:
        d.verify(pathlib.Path(sys.argv[1]))
    kind = "ok"
except dio.CheckpointError:
    kind = "CheckpointError"
except BaseException as e:
    kind = type(e).__name__
hwm = int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) << 10
print(json.dumps({"kind": kind, "seconds": time.perf_counter() - started, "maxrss": hwm}))
"""


def test_verify_of_a_consistently_claimed_huge_leaf_stays_within_the_budget(tmp_path):
    """manifest.json and zarr.json both edited to claim 2^19 x 2^19 float32 (2^21 chunks, within
    MAX_CHUNKS): verify with a 64 MiB budget grows to 1.7 GiB RSS and takes 12 s before its first
    read fails (it makes an object per chunk up front); at the 4 TiB claim of the issue (2^23
    chunks) it reaches 4.9 GiB and ends in a bare MemoryError under a 6 GiB limit (the OOM killer
    without). Right: verify iterates chunks lazily in budgeted batches (and/or MAX_CHUNKS bounded
    by what a plan can hold), so memory stays at budget + a constant and the first read fails fast."""
    subprocess.run([sys.executable, "-c", _CLAIM, str(tmp_path / "c")], check=True, timeout=120)
    proc = subprocess.run([sys.executable, "-c", _VERIFY, str(tmp_path / "c")], capture_output=True, text=True,
                          timeout=120)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kind"] == "CheckpointError", result
    assert result["maxrss"] < 800 << 20 and result["seconds"] < 5, result


_SPARSE = r"""
import glob, json, pathlib, re, sys
import numpy as np
import dispatch_io as dio
root, which = pathlib.Path(sys.argv[1]), sys.argv[2]
if which == "orbax":
    import orbax.checkpoint as ocp
    path = root / "o"
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as c:
        c.save(path, args=ocp.args.PyTreeSave({"w": np.arange(4.0)}))
    big = path / "_METADATA"
else:
    path = root / "f"
    with dio.LocalDispatcher(layout="files") as d:
        d.save(path, {"w": np.arange(4.0)}).wait(60)
    big = pathlib.Path(glob.glob(str(path / "**/zarr.json"), recursive=True)[0])
with open(big, "r+b") as f:
    f.truncate(1 << 30)   # sparse: a 1 GiB file that takes no disk (a 20 GiB one: the same download)
def status(field):
    return int(re.search(field + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) << 10
open("/proc/self/clear_refs", "w").write("5")   # VmHWM := the RSS now (ru_maxrss would carry the parent's)
before = status("VmRSS")
try:
    dio.metadata(path) if which == "orbax" else dio.LocalDispatcher().restore(path)
    kind = "ok"
except dio.CheckpointError:
    kind = "CheckpointError"
except BaseException as e:
    kind = type(e).__name__
print(json.dumps({"kind": kind, "growth": status("VmHWM") - before}))
"""


@pytest.mark.parametrize("which", ["orbax", "zarr_json"])
def test_a_huge_sparse_metadata_file_is_refused_before_it_is_read(tmp_path, which):
    """Orbax's _METADATA (also _sharding, array_metadatas, _strings.json: orbax._json reads any
    size) and our zarr.json (MAX_ZARR_JSON_BYTES is checked on the bytes TensorStore already
    read) are read whole: a 1 GiB sparse file costs 2.0 / 3.0 GiB RSS before the refusal; 20 GiB
    exhausts the machine. Right: stat (or read at most bound + 1 bytes) before reading, as
    read_manifest does with MAX_MANIFEST_BYTES; for zarr.json, a byte-range read of bound + 1."""
    proc = subprocess.run([sys.executable, "-c", _SPARSE, str(tmp_path), which], capture_output=True, text=True,
                          timeout=120)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kind"] == "CheckpointError" and result["growth"] < 256 << 20, result


def test_a_leaf_naming_another_leafs_stored_array_is_malformed_at_open(tmp_path):
    """check_stored keys the arrays it compares by name (setdefault: the first leaf's spec wins),
    so a later leaf claiming another's stored array with a 1 TiB shape is never compared with that
    zarr.json: metadata() accepts it, restore fails late as a WorkerError ("stored array 00000.v
    is [512, 256] ..."), verify spends 12 s and 1.7 GiB before a raw "Propagated bounds" error.
    Right: two unpacked leaves naming one stored array is malformed (or every leaf's spec is
    compared with its array's zarr.json)."""
    path = tmp_path / "ckpt"
    with dio.LocalDispatcher() as d:
        d.save(path, {"v": np.ones((512, 256), np.float32),
                      "w": np.arange(512 * 256, dtype=np.float32).reshape(512, 256)}).wait(60)
    doc = sealed.loads((path / "manifest.json").read_text())
    v, w = (next(e for e in doc["leaves"] if e["keypath"] == k) for k in ("['v']", "['w']"))
    w["stored"]["name"] = v["stored"]["name"]
    w["shape"] = w["stored"]["shape"] = [1 << 19, 1 << 19]
    doc["total_bytes"] += (1 << 38) * 4 - 512 * 256 * 4
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(dio.CorruptCheckpointError, match="malformed checkpoint"):
        dio.metadata(path)
    with dio.LocalDispatcher(host_memory_budget=64 << 20) as d:
        with pytest.raises(dio.CorruptCheckpointError, match="malformed checkpoint"):
            d.restore(path)


def test_a_zero_size_leaf_with_huge_other_dims_is_malformed(tmp_path):
    """A zero-size leaf (nothing stored) whose shape is claimed [0, 2^62, 2^62]: each dim within
    MAX_DIM and the product 0, so validation passes and metadata() reports it; restore() then
    fails in numpy with a bare ValueError ("array is too big"), not a CheckpointError. Right:
    bound the product of the non-zero dims too (as numpy / XLA can represent), malformed otherwise."""
    path = tmp_path / "ckpt"
    with dio.LocalDispatcher() as d:
        d.save(path, {"n": np.zeros((0, 4)), "w": np.arange(4.0)}).wait(60)
    doc = sealed.loads((path / "manifest.json").read_text())
    entry = next(e for e in doc["leaves"] if e["keypath"] == "['n']")
    entry["shape"] = [0, 1 << 62, 1 << 62]
    (path / "manifest.json").write_text(json.dumps(doc))
    with dio.LocalDispatcher() as d:
        with pytest.raises(dio.CheckpointError):
            d.restore(path)


@pytest.mark.parametrize("value", ["Infinity", "-Infinity"])
def test_an_int_scalar_of_infinity_or_nan_is_malformed(tmp_path, value):
    """json.loads accepts the non-standard Infinity / NaN; an int scalar whose value is one of
    them ends in int(float('inf')) -> a bare OverflowError (NaN: ValueError, which parse does
    catch) out of metadata() and restore(). Right: check_document requires a scalar's value to be
    {"type": <known>, "value": <str | number | [re, im]>} with finite numbers (or parse_constant
    refusing them), malformed otherwise."""
    path = tmp_path / "ckpt"
    with dio.LocalDispatcher() as d:
        d.save(path, {"s": 3, "w": np.arange(3.0)}).wait(60)
    doc = sealed.loads((path / "manifest.json").read_text())
    next(e for e in doc["leaves"] if e["keypath"] == "['s']")["value"] = {"type": "int", "value": "@@"}
    (path / "manifest.json").write_text(json.dumps(doc).replace('"@@"', value))
    with pytest.raises(dio.CorruptCheckpointError, match="malformed checkpoint"):
        dio.metadata(path)


@pytest.mark.parametrize("held", ["x", [1, 2], {"['w']": [[["a", 1]]]}, {"['w']": [[[0]]]}])
def test_a_local_steps_crafted_held_regions_are_our_one_line_error(tmp_path, held):
    """A local tier's step info whose ``held`` is not what a local save records: verify of that
    step (which checks only the regions the step holds) refuses it naming the path, before any read;
    a local step that records no regions is verified whole, as any checkpoint."""
    from dispatch_io.storage import step_files

    path = str(tmp_path / "ckpt")
    save(path)
    info = tmp_path / "ckpt" / "info.json"
    info.write_text(json.dumps({"tier": "local", "process": 0, "held": held}))
    with pytest.raises(dio.CorruptCheckpointError, match="held regions are not what a local save records"):
        step_files.local_share(path)
    with dio.LocalDispatcher() as d, pytest.raises(dio.CorruptCheckpointError, match="malformed checkpoint"):
        d.verify(path)
    info.write_text(json.dumps({"tier": "local", "process": 0}))
    assert step_files.local_share(path) == (None, None)


def test_the_link_check_passes_over_a_folder_a_commit_removes_while_it_walks(tmp_path, monkeypatch):
    """A local step's parity rows are written, in a temporary folder renamed when they commit,
    while its promotion opens the step and walks it for links: a folder gone by the time the walk
    reaches it is passed over (a job's promotion failed on one process, the others timing out at
    its barrier); a link leading out is still found, and a checkpoint that is itself gone still
    raises."""
    from dispatch_io.storage import directory

    step = tmp_path / "4"
    (step / ".parity.dispatch_io-tmp-0123456789ab" / "rows").mkdir(parents=True)
    (step / "arrays").mkdir()
    (step / "arrays" / "out").symlink_to(tmp_path)
    scandir = os.scandir

    def committing(path):   # the rows commit between the step's listing and the walk into their folder
        if os.path.basename(path).startswith(".parity."):
            os.rename(path, step / "parity")
        return scandir(path)
    monkeypatch.setattr(directory.os, "scandir", committing)
    assert directory.links_outside(str(step)) == ["arrays/out"]
    with pytest.raises(FileNotFoundError):
        directory.links_outside(str(tmp_path / "gone"))
