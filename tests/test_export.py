"""Exporting checkpoints: to safetensors (read back by the real ``safetensors`` package) and to
Orbax (restored by the real Orbax 0.12 StandardCheckpointer and CheckpointManager), bit-exact,
streamed under the budget, refusing what a format cannot hold, leaving nothing on failure."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file

import dispatch_io as dio
from conftest import assert_trees_bit_equal, crafted_safetensors, host_bytes
from dispatch_io import cli
from dispatch_io.formats import exporting
from dispatch_io.formats import safetensors as st_lib

MiB = 1 << 20
CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
         "int32": "I32", "int64": "I64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
         "complex64": "C64", "uint32": "U32", "int16": "I16"}


def arrays(mesh) -> dict:
    """A tree of every dtype safetensors and Orbax both hold: sharded, replicated, numpy."""
    rng = np.random.default_rng(7)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    return {
        "model": {
            "embed": put(f32(64, 32), P("data", "model")),
            "layers": [{"w": put(f32(32, 16).astype(jnp.bfloat16), P(None, "model")),
                        "norm": put(f32(16).astype(jnp.float16), P())} for _ in range(2)],
            "q": put(f32(8, 4).astype(ml_dtypes.float8_e4m3fn), P("data")),
            "s": put(f32(8, 4).astype(ml_dtypes.float8_e5m2), P()),
        },
        "ints": {"i8": put(rng.integers(-128, 127, (16, 2)).astype(np.int8), P("data")),
                 "u8": rng.integers(0, 255, (5, 3)).astype(np.uint8),
                 "i16": rng.integers(-9, 9, (4,)).astype(np.int16),
                 "i32": put(rng.integers(-2**31, 2**31 - 1, (8,)).astype(np.int32), P("data")),
                 "u32": rng.integers(0, 2**32 - 1, (3,)).astype(np.uint32),
                 "i64": rng.integers(-2**62, 2**62, (6,)).astype(np.int64)},
        "mask": put(rng.random((8, 2)) < 0.5, P("data", "model")),
        "c": (f32(3) + 1j * f32(3)).astype(np.complex64),
        "empty": np.zeros((0, 3), np.float32),
    }


def with_extras(mesh):
    """``arrays`` plus what safetensors cannot hold: PRNG keys, Python scalars, a string, int4."""
    tree = arrays(mesh)
    tree.update(rng=jax.random.key(3), rbg=jax.random.key(4, impl="rbg"), step=12, lr=0.25, done=True,
                name="run", nothing=None, opt={})
    return tree


@pytest.fixture
def source(tmp_path, mesh):
    tree = with_extras(mesh)
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        d.save(tmp_path / "ours", tree).wait()
    return tmp_path / "ours", tree


def flat_names(tree) -> dict:
    return {exporting.default_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_to_safetensors_is_what_safetensors_reads(source, tmp_path):
    """Every leaf safetensors can hold, in shards of at most 4 KiB with an index, read back by
    the real package bit-exactly (``load_file`` where numpy has the dtype, ``deserialize`` for all)."""
    path, tree = source
    with dio.LocalDispatcher(host_memory_budget=64 << 10, max_chunk_bytes=1 << 10) as d:
        with pytest.raises(ValueError, match=r"\['done'\]: a Python bool"):
            d.convert(path, tmp_path / "st", to="safetensors")
        assert not os.path.exists(tmp_path / "st")
        stats = d.convert(path, tmp_path / "st", to="safetensors", skip_unsupported=True, max_shard_size=4 << 10)
    assert sorted(stats.skipped) == ["['done']", "['lr']", "['name']", "['rbg']", "['rng']", "['step']"]
    expected = flat_names(arrays(jax.make_mesh((4, 2), ("data", "model"))))
    files = sorted(f for f in os.listdir(tmp_path / "st") if f.endswith(".safetensors"))
    assert len(files) > 2 and stats.files[-1] == "model.safetensors.index.json"
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(index) == sorted(expected) and sorted(set(index.values())) == files
    seen = {}
    for f in files:
        held = dict(safetensors.deserialize((tmp_path / "st" / f).read_bytes()))
        assert all(index[name] == f for name in held)
        data = sum(len(t["data"]) for t in held.values())
        assert data <= 4 << 10 or len(held) == 1, (f, data)
        seen.update(held)
        if not any(t["dtype"].startswith("F8") for t in held.values()):  # numpy has no float8 for load_file
            for name, value in load_file(tmp_path / "st" / f).items():
                assert value.dtype == np.dtype(expected[name].dtype) and value.tobytes() == host_bytes(expected[name])
    for name, value in expected.items():
        t = seen[name]
        assert t["dtype"] == CODES[np.dtype(value.dtype).name] and t["shape"] == list(value.shape), name
        assert bytes(t["data"]) == host_bytes(value), name


def test_to_safetensors_one_file_names_and_refusals(source, tmp_path, mesh):
    path, tree = source
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        one = tmp_path / "all.safetensors"
        d.convert(path, one, to="safetensors", skip_unsupported=True,
                  names=lambda p: "x." + exporting.default_name(p).upper())
        got = dict(safetensors.deserialize(one.read_bytes()))
        assert bytes(got["x.MODEL.EMBED"]["data"]) == host_bytes(tree["model"]["embed"])
        with pytest.raises(ValueError, match="would both be named"):
            d.convert(path, tmp_path / "dup", to="safetensors", skip_unsupported=True, names=lambda p: "same")
        with pytest.raises(FileExistsError):
            d.convert(path, one, to="safetensors", skip_unsupported=True)
        d.save(tmp_path / "int4", {"a": np.ones(2, np.float32), "w": np.zeros(4, ml_dtypes.int4)}).wait()
        with pytest.raises(ValueError, match=r"\['w'\]: dtype int4 has no safetensors code"):
            d.convert(tmp_path / "int4", tmp_path / "x", to="safetensors")
        keys = {k: v for k, v in d.restore(path).items() if k in ("rbg", "rng", "model")}
        d.save(tmp_path / "keys", keys).wait()
        with pytest.raises(ValueError, match=r"\['rbg'\]: a PRNG key array"):
            d.convert(tmp_path / "keys", tmp_path / "x", to="safetensors")
        assert sorted(os.listdir(tmp_path)) == ["all.safetensors", "int4", "keys", "ours"]  # nothing else left


def test_a_failed_export_leaves_nothing(source, tmp_path, monkeypatch):
    """A read failing mid-stream (after some shards were written): no DST, no temporary left."""
    path, _ = source
    real = exporting.read_regions
    calls = []

    def failing(session, regions, out=None):
        calls.append(len(regions))
        if len(calls) == 3:  # some batches written by then
            raise OSError("disk gone")
        return real(session, regions, out)

    monkeypatch.setattr(exporting, "read_regions", failing)
    for to, dst in [("safetensors", tmp_path / "st"), ("orbax", tmp_path / "ox")]:
        calls.clear()
        with dio.LocalDispatcher(host_memory_budget=4 << 10, max_chunk_bytes=1 << 10) as d:
            with pytest.raises(dio.WorkerError, match="disk gone"):  # named with its key path and source
                d.convert(path, dst, to=to, **({"skip_unsupported": True} if to == "safetensors" else {}))
            assert len(calls) in (3, 4)  # the failed read, and the one in flight beside it (reading.pipelined)
        assert sorted(os.listdir(tmp_path)) == ["ours"], os.listdir(tmp_path)


def test_safetensors_round_trip_through_cli(source, tmp_path, capsys):
    path, _ = source
    st = tmp_path / "st"
    assert cli.main(["convert", str(path), str(st), "--to", "safetensors", "--skip-unsupported",
                     "--max-shard-size", "2KB", "--budget-mib", "1"]) == 0
    assert "skipped 6" in capsys.readouterr().out
    assert cli.main(["convert", str(path), str(tmp_path / "x"), "--to", "safetensors"]) == 2
    assert "['done']" in capsys.readouterr().err
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        restored = d.restore(st, arrays(jax.make_mesh((4, 2), ("data", "model"))))
    assert_trees_bit_equal(restored, arrays(jax.make_mesh((4, 2), ("data", "model"))))


def test_to_orbax_restores_in_orbax_bit_exactly(source, tmp_path):
    """StandardCheckpointer restores the export (no target: the saved shardings) to our tree:
    every dtype, PRNG keys as key arrays with their impl, scalars, a string, None, {}."""
    path, tree = source
    with dio.LocalDispatcher(host_memory_budget=64 << 10, max_chunk_bytes=2 << 10) as d:
        d.convert(path, tmp_path / "ox", to="orbax")
        ours = d.restore(path)
        again = d.restore(tmp_path / "ox")  # and we read what we wrote
    restored = ocp.StandardCheckpointer().restore(tmp_path / "ox")
    assert jax.random.key_impl(restored["rbg"]) == jax.random.key_impl(tree["rbg"])
    assert restored["model"]["embed"].sharding.spec == P("data", "model")
    assert isinstance(restored["ints"]["u8"], np.ndarray)
    assert_trees_bit_equal(restored, ours)
    assert_trees_bit_equal(again, ours)


def test_to_orbax_step_is_listed_by_orbax_manager(source, tmp_path):
    path, _ = source
    root = tmp_path / "run"
    assert cli.main(["convert", str(path), str(root / "7"), "--to", "orbax", "--budget-mib", "1"]) == 0
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        ours = d.restore(path)
    with ocp.CheckpointManager(root) as manager:
        assert manager.all_steps() == [7]
        restored = manager.restore(7, args=ocp.args.StandardRestore())
    assert_trees_bit_equal(restored, ours)
    with dio.LocalDispatcher(host_memory_budget=MiB) as d, dio.CheckpointManager(root, d) as ours_manager:
        assert ours_manager.all_steps() == [7]


def test_exports_stay_within_the_budget(tmp_path):
    """A 256 MiB leaf exported under an 8 MiB budget, in a fresh process: peak RSS (VmHWM, reset
    before each export) grows by at most the budget + 64 MiB (the bound a save keeps), never by the
    leaf. (A small export of each kind first pays for imports; the first large one still grows the
    IO threads' allocator arenas: measured +22 MiB, then +7-18 MiB for the next ones; with a 64 MiB
    leaf, half the leaf was too close to that to tell a leak from a loaded machine.)"""
    import subprocess
    import sys
    import textwrap

    with dio.LocalDispatcher(host_memory_budget=8 << 20) as d:
        d.save(tmp_path / "big", {"w": np.arange(64 << 20, dtype=np.float32).reshape(8192, 8192)}).wait()
        d.save(tmp_path / "small", {"w": np.arange(16, dtype=np.float32)}).wait()
    script = textwrap.dedent(f"""
        import dispatch_io as dio
        status = lambda k: int(dict(l.split(":") for l in open("/proc/self/status").read().splitlines())[k].split()[0]) << 10
        peaks = []
        with dio.LocalDispatcher(host_memory_budget=8 << 20) as d:
            for to in ("safetensors", "orbax"):
                d.convert({str(tmp_path / 'small')!r}, {str(tmp_path)!r} + "/warm-" + to, to=to)
                open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
                before = status("VmRSS")
                d.convert({str(tmp_path / 'big')!r}, {str(tmp_path)!r} + "/out-" + to, to=to)
                peaks.append(status("VmHWM") - before)
        print(*peaks)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    peaks = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                           check=True).stdout.split()
    assert all(int(p) < (8 + 64) * MiB for p in peaks), [int(p) / MiB for p in peaks]  # budget + 64 MiB
    got = dict(safetensors.deserialize((tmp_path / "out-safetensors" / "model.safetensors").read_bytes()))
    assert bytes(got["w"]["data"]) == np.arange(64 << 20, dtype=np.float32).tobytes()
    assert np.array_equal(ocp.StandardCheckpointer().restore(tmp_path / "out-orbax")["w"],
                          np.arange(64 << 20, dtype=np.float32).reshape(8192, 8192))


def test_a_leaf_named___metadata___is_refused(tmp_path):
    """``__metadata__`` is the header's metadata key: a leaf given that name must be refused
    (ValueError naming its key path). Now: the export "succeeds" and writes a file that neither
    ``safetensors`` (invalid JSON in header) nor dispatch_io ("tensor data has a gap") reads."""
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        d.save(tmp_path / "src", {"__metadata__": a, "b": a + 1}).wait()
        try:
            d.convert(tmp_path / "src", tmp_path / "out", to="safetensors")
        except ValueError as exc:
            assert "['__metadata__']" in str(exc)
            assert not os.path.exists(tmp_path / "out")
            return
    out = load_file(tmp_path / "out" / "model.safetensors")  # if written, it must be readable
    assert sorted(out) == ["__metadata__", "b"]


def test_overwrite_does_not_delete_a_model_folders_other_files(tmp_path):
    """Exporting over a Hugging Face model folder (``config.json``, ``tokenizer.json`` beside
    the weights) with ``overwrite=True``: either the weights are replaced and the other files
    kept, or the export is refused (ValueError) because DST holds files it did not write. Now:
    the whole folder is replaced -- config and tokenizer deleted. (Any directory holding one
    ``*.safetensors`` counts as "a checkpoint this export writes", e.g. a Downloads folder.)"""
    folder = crafted_safetensors(tmp_path / "llama", {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        d.save(tmp_path / "src", {"x": np.ones(2, np.float32)}).wait()
        try:
            d.convert(tmp_path / "src", folder, to="safetensors", overwrite=True)
        except ValueError:
            pass
    assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists(), os.listdir(folder)


def test_refusal_hints_name_what_the_caller_can_pass(tmp_path, capsys):
    """Hints must name a remedy that exists where the call came from: the CLI has
    ``--skip-unsupported`` (not ``skip_unsupported=True``); an Orbax export refuses ``names=``,
    so a name collision there must not say "pass names=". Now both say what cannot be done."""
    a = np.ones(2, np.float32)
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        d.save(tmp_path / "scalar", {"w": a, "step": 3}).wait()
        d.save(tmp_path / "clash", {"a.b": a, "a": {"b": a + 1}}).wait()
        with pytest.raises(ValueError) as info:
            d.convert(tmp_path / "clash", tmp_path / "ox", to="orbax")
        assert "names=" not in str(info.value), str(info.value)
    assert cli.main(["convert", str(tmp_path / "scalar"), str(tmp_path / "st"), "--to", "safetensors"]) == 2
    err = capsys.readouterr().err
    assert "--skip-unsupported" in err, err


def test_one_definition_of_a_leafs_dotted_name():
    """"Key names joined by '.'" is one rule (restore's default safetensors name and the
    export's default name must not drift apart): one definition. Now two identical functions,
    ``safetensors.tensor_name`` and ``exporting.default_name``."""
    assert st_lib.tensor_name is exporting.default_name


@pytest.mark.parametrize("keyword", [{"names": lambda p: "renamed"}, {"max_shard_size": 1},
                                     {"skip_unsupported": True}])
def test_export_keywords_are_refused_for_a_dispatch_io_convert(tmp_path, keyword):
    """``convert(src, dst, names=...)`` forgetting ``to="safetensors"`` writes a dispatch_io
    checkpoint: the export-only keywords must raise ValueError (as ``to="orbax"`` does for
    ``names`` / ``max_shard_size``), not be ignored. Now they are silently ignored."""
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        d.save(tmp_path / "src", {"w": np.ones(2, np.float32)}).wait()
        with pytest.raises(ValueError):
            d.convert(tmp_path / "src", tmp_path / "out", **keyword)


@pytest.mark.parametrize("size", [0, -5])
def test_max_shard_size_must_be_positive(tmp_path, size):
    """``max_shard_size=0`` silently means the 5 GB default (``or``), a negative one a file per
    tensor; the CLI refuses both. The API must raise ValueError too."""
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        d.save(tmp_path / "src", {"w": np.ones(2, np.float32), "v": np.ones(2, np.float32)}).wait()
        with pytest.raises(ValueError):
            d.convert(tmp_path / "src", tmp_path / "out", to="safetensors", max_shard_size=size)


@pytest.mark.parametrize("to", ["safetensors", "orbax"])
def test_an_export_from_a_damaged_source_fails_as_a_checkpoint_error(tmp_path, capsys, to):
    """A source chunk that cannot be read (here: truncated files): the export must raise a
    ``WorkerError`` naming the key path and the source, as ``to="dispatch_io"`` does, and
    ``dispatch-io convert --to ...`` answer one line and exit 2. Now the workers' internal
    ``ChunkError`` (not a CheckpointError) escapes, and the CLI tracebacks. (``exporting.stream``
    is a second copy of ``reading.pipelined``'s two-in-flight loop without its ``failure``
    mapping: one loop would fix both.)"""
    with dio.LocalDispatcher(host_memory_budget=MiB, layout="files") as d:
        d.save(tmp_path / "src", {"w": np.arange(1 << 16, dtype=np.float32)}).wait()
    for root, _, files in os.walk(tmp_path / "src" / "arrays"):
        for name in files:  # the chunks (a truncated zarr.json is refused at open, before any read)
            if name != "zarr.json":
                os.truncate(os.path.join(root, name), 10)
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        with pytest.raises(dio.WorkerError, match=r"\['w'\]"):
            d.convert(tmp_path / "src", tmp_path / "out", to=to)
    assert cli.main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", to]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_an_export_of_many_shards_keeps_few_files_open(tmp_path):
    """The stream writes the shards in order, yet every shard file is opened up front: with
    ``--max-shard-size 100MB`` on a 400 GB model (4000 shards) the export fails with EMFILE
    under the usual 1024-descriptor limit. Here: 400 shards with 200 descriptors to spare. The
    right behaviour: one shard file open at a time."""
    import resource

    tree = {f"w{i:04d}": np.full(16, i, np.float32) for i in range(400)}
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        d.save(tmp_path / "src", tree).wait()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 200, hard))
        try:
            stats = d.convert(tmp_path / "src", tmp_path / "out", to="safetensors", max_shard_size=64)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(stats.files) == 401
