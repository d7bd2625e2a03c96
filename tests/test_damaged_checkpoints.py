"""A damaged checkpoint reads back as it was saved or fails with a CheckpointError; the damage is
drawn by hypothesis (derandomized: the same cases every run).

Each case copies a sound checkpoint, damages one of its files -- ``manifest.json``, a
``zarr.json``, the OCDBT manifest or a data file, a marker, Orbax's ``_METADATA`` -- by a JSON
edit (a value replaced by a hostile one, a key dropped) or a byte edit (a flip, a truncation,
garbage), and reads it: ``dispatch-io inspect``, metadata, then a restore that checks every chunk's CRC-32C. Each must
end within seconds in success with the stored values or a CheckpointError -- never another
exception, a hang, or memory beyond the bound.

``DISPATCH_IO_FUZZ_EXAMPLES=N`` runs N cases per checkpoint kind (default 150: about 5 s each here).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import threading

import jax
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import dispatch_io as dio  # noqa: E402
from dispatch_io.storage import sealed
from dispatch_io import cli  # noqa: E402

EXAMPLES = int(os.environ.get("DISPATCH_IO_FUZZ_EXAMPLES", "150"))
CASE_SECONDS = 20          # one case: far more than a sound read of these few KiB takes
RSS_GROWTH = 512 << 20     # what one case may add to the process's resident memory

TREE = {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32), "b": np.arange(8, dtype=np.int32),
        "c": np.linspace(0, 1, 5), "key": jax.random.key(3), "nested": [{"x": np.ones((3, 4), np.int16)}],
        "step": 7, "name": "run"}

HOSTILE = st.one_of(
    st.sampled_from([None, True, 0, -1, 1 << 28, 1 << 40, 1 << 62, 1 << 64, 2.5, float("nan"), "", "..",
                     "../../etc/passwd", "/tmp", "float99", "key<fry>", "packed.00000.b", [], {}, [1 << 28, 1 << 28],
                     [0], [-1, 2], ["a"], {"leaf": 0}, {"list": [{"list": []}]}, "a" * 5000]),
    st.integers(-(1 << 70), 1 << 70), st.text(max_size=20),
    st.lists(st.integers(-2, 1 << 30), max_size=4),
)


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) << 10


def files_of(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names)


@pytest.fixture(scope="module")
def sound(tmp_path_factory):
    """kind -> (a sound checkpoint, its files)."""
    root = tmp_path_factory.mktemp("fuzz")
    out = {}
    for layout in ("ocdbt", "files"):
        with dio.LocalDispatcher(host_memory_budget=1 << 20, layout=layout, checksums=True) as d:
            d.save(root / layout, TREE).wait(60)
        out[layout] = root / layout
    ocp = pytest.importorskip("orbax.checkpoint")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(root / "orbax", {k: TREE[k] for k in ("w", "b", "c", "key", "nested", "step")})
    out["orbax"] = root / "orbax"
    return {kind: (path, files_of(path)) for kind, path in out.items()}


@pytest.fixture(scope="module")
def dispatcher():
    with dio.LocalDispatcher(host_memory_budget=1 << 20) as d:
        yield d


def _json_paths(value, prefix=()):
    """Every path (tuple of keys / indices) into a JSON value, the root first."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _json_paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _json_paths(v, prefix + (i,))


def _edit_json(doc, path, value, delete):
    if not path:
        return value
    node = doc
    for key in path[:-1]:
        node = node[key]
    if delete and isinstance(node, dict):
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


@st.composite
def damage(draw, files):
    """(file, how): a JSON edit of a JSON file or a byte edit of any file."""
    name = draw(st.sampled_from(files))
    is_json = name.endswith((".json", "COMMITTED", "_METADATA", "_sharding", "_CHECKPOINT_METADATA"))
    if is_json and draw(st.booleans()):
        return name, ("json", draw(st.integers(0, 1 << 30)), draw(HOSTILE), draw(st.booleans()))
    how = draw(st.sampled_from(["flip", "truncate", "garbage", "delete", "empty"]))
    return name, (how, draw(st.integers(0, 1 << 30)), draw(st.integers(1, 255)))


def apply(path, name, how):
    target = path / name
    data = target.read_bytes()
    kind = how[0]
    if kind == "json":
        _, pick, value, delete = how
        try:
            doc = sealed.loads(data)   # edited: written back unsealed, so what it says is what is checked
        except ValueError:
            doc = None
        if doc is not None:
            paths = list(_json_paths(doc))
            doc = _edit_json(doc, paths[pick % len(paths)], value, delete)
            target.write_text(json.dumps(doc))
            return
        kind = "garbage"
    _, at, byte = how[:3]
    if kind == "delete":
        target.unlink()
    elif kind == "empty":
        target.write_bytes(b"")
    elif kind == "truncate":
        target.write_bytes(data[:at % max(len(data), 1)])
    elif kind == "flip" and data:
        i = at % len(data)
        target.write_bytes(data[:i] + bytes([data[i] ^ byte]) + data[i + 1:])
    else:
        target.write_bytes(data + bytes([byte]) * (1 + at % 64))


def same_values(result) -> bool:
    """Every array of ``result`` is one of the saved arrays, bit for bit (keys: their data)."""
    saved = [np.asarray(jax.random.key_data(x)) if dio.tree.is_prng_key(x) else np.asarray(x)
             for x in jax.tree.leaves(TREE) if not isinstance(x, (int, str))]
    for leaf in jax.tree.leaves(result):
        if isinstance(leaf, (bool, int, float, complex, str)):
            continue
        leaf = np.asarray(jax.random.key_data(leaf)) if dio.tree.is_prng_key(leaf) else np.asarray(leaf)
        if not any(s.shape == leaf.shape and s.dtype == leaf.dtype and s.tobytes() == leaf.tobytes() for s in saved):
            return False
    return True


def read_damaged(dispatcher, path, verify: bool):
    """Run the reads in a daemon thread: ("ok", result) or ("error", exception); fails on a hang."""
    out = {}

    def body():
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                assert cli.main(["inspect", str(path)]) in (0, cli.EXIT_UNUSABLE)   # a bug would raise
            dio.metadata(path)
            out["ok"] = dispatcher.restore(path, verify=verify)
        except BaseException as exc:  # noqa: BLE001 - judged by the test
            out["error"] = exc

    before = rss()
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(CASE_SECONDS)
    assert not thread.is_alive(), f"reading {path} did not end within {CASE_SECONDS} s"
    assert rss() - before < RSS_GROWTH, f"reading {path} grew the process by {(rss() - before) >> 20} MiB"
    return out


def check_case(sound, dispatcher, tmp_path_factory, kind, case):
    original, _ = sound[kind]
    path = tmp_path_factory.mktemp("case") / kind
    shutil.copytree(original, path, symlinks=True)
    name, how = case
    apply(path, name, how)
    out = read_damaged(dispatcher, path, verify=kind != "orbax")
    if "error" in out:
        exc = out["error"]
        if not isinstance(exc, dio.CheckpointError):
            raise AssertionError(f"{name} {how}: {type(exc).__name__} is not a CheckpointError") from exc
        assert "tensorstore_spec" not in str(exc), str(exc)
    elif kind != "orbax" or "d/" not in name:   # Orbax saves no checksums: a damaged data file reads as it is
        assert same_values(out["ok"]), f"{name} {how}: restored values that were not saved"
    shutil.rmtree(path)


def fuzz(kind):
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def test(sound, dispatcher, tmp_path_factory, data):
        case = data.draw(damage(sound[kind][1]), label="damage")
        check_case(sound, dispatcher, tmp_path_factory, kind, case)
    return test


test_a_damaged_ocdbt_checkpoint_reads_as_saved_or_raises_checkpoint_error = fuzz("ocdbt")
test_a_damaged_files_checkpoint_reads_as_saved_or_raises_checkpoint_error = fuzz("files")
# Orbax saves no checksums: a damaged data file reads as it is (check_case), anything else as for ours.
test_a_damaged_orbax_checkpoint_reads_or_raises_checkpoint_error = fuzz("orbax")
