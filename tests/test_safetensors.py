"""Loading Hugging Face safetensors: files written by the real ``safetensors`` package (numpy API),
restored onto meshes, devices and numpy bit-exactly; only the bytes of the regions read; memory
within the budget; crafted headers refused; the name mapping; object stores."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file, save_file

import dispatch_io as dio
from dispatch_io import cli
from conftest import crafted_safetensors, run_job
from dispatch_io.errors import CheckpointError, TreeMismatchError
from dispatch_io.jax_compat import single_device_sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def tensors() -> list[dict]:
    """Three files' tensors: every dtype family safetensors writes, odd shapes, an empty one."""
    rng = np.random.default_rng(29)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return [
        {"model.embed_tokens.weight": f32(64, 48),
         "model.layers.0.mlp.up_proj.weight": f32(48, 32).astype(ml_dtypes.bfloat16),
         "model.layers.0.input_layernorm.weight": f32(48).astype(np.float16)},
        {"model.layers.1.mlp.up_proj.weight": f32(48, 32).astype(ml_dtypes.bfloat16),
         "model.layers.1.quant": f32(16, 8).astype(ml_dtypes.float8_e4m3fn),
         "model.layers.1.scales": f32(16, 8).astype(ml_dtypes.float8_e5m2),
         "model.mask": rng.random((8, 6)) < 0.5,
         "model.empty": np.zeros((0, 4), np.float32)},
        {"lm_head.weight": f32(48, 64),
         "counts": rng.integers(-2**40, 2**40, (7, 3)).astype(np.int64),
         "ids": rng.integers(0, 255, (5,)).astype(np.uint8),
         "step": np.asarray(7, np.int32)},
    ]


def write_set(folder, parts, index: bool = True) -> dict:
    os.makedirs(folder, exist_ok=True)
    weight_map = {}
    for i, part in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file(part, os.path.join(folder, name), metadata={"format": "np"})
        weight_map.update({k: name for k in part})
    if index:
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return {k: v for part in parts for k, v in part.items()}


@pytest.fixture
def hf(tmp_path):
    expected = write_set(tmp_path / "hf", tensors())
    return tmp_path / "hf", expected


def host(x) -> np.ndarray:
    return np.array(jax.device_get(x), order="C")


def assert_same(got, want, name):
    got = host(got)
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert got.tobytes() == want.tobytes(), f"{name}: bytes differ"


def test_target_none_equals_load_file(hf):
    """Without a target: a flat dict of numpy arrays, as ``safetensors.numpy.load_file`` gives
    (for the dtypes it reads) -- the same bytes."""
    path, expected = hf
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        out = d.restore(path)
    assert sorted(out) == sorted(expected)
    for i in range(1, 4):
        file = path / f"model-0000{i}-of-00003.safetensors"
        if i == 2:
            continue  # load_file cannot make numpy float8 arrays (compared with the written ones below)
        for name, value in load_file(file).items():
            assert_same(out[name], value, name)
    for name, value in expected.items():
        assert isinstance(out[name], np.ndarray)
        assert_same(out[name], value, name)


def sharded_target(expected, sharding_of):
    """A nested target (default names: key names joined by '.'), with layers as a list."""
    target: dict = {}
    for name, value in expected.items():
        keys = name.split(".")
        node = target
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        # 64-bit dtypes as numpy (JAX holds them only with x64 on)
        node[keys[-1]] = np.zeros_like(value) if value.dtype.itemsize == 8 else \
            jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding_of(value))
    target["model"]["layers"] = [target["model"]["layers"]["0"], target["model"]["layers"]["1"]]
    return target


@pytest.mark.parametrize("mesh_shape", [(4, 2), (2, 4), None])
def test_restore_onto_meshes_and_one_device_bit_exact(hf, mesh_shape):
    path, expected = hf
    if mesh_shape is None:
        sharding_of = lambda value: single_device_sharding(jax.devices()[3])  # noqa: E731
    else:
        mesh = jax.make_mesh(mesh_shape, ("a", "b"))

        def sharding_of(value):
            specs = {0: P(), 1: P("a"), 2: P("b", "a")}
            spec = specs[value.ndim]
            if any(n and n % mesh.shape[axis] for n, axis in zip(value.shape, spec)):
                spec = P()
            return NamedSharding(mesh, spec)
    target = sharded_target(expected, sharding_of)
    with dio.LocalDispatcher(host_memory_budget=64 << 10, max_chunk_bytes=4 << 10) as d:
        out = d.restore(path, target)
        assert d.last_restore_stats.bytes_read == sum(v.nbytes for v in expected.values())
    for p, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        name = ".".join(dio.tree.key_names(p))
        if expected[name].dtype.itemsize < 8:
            assert isinstance(leaf, jax.Array) and leaf.sharding == sharding_of(expected[name])
        assert_same(leaf, expected[name], name)


def test_metadata_and_inspect(hf, capsys):
    path, expected = hf
    meta = dio.metadata(path)
    assert {k: (v.shape, np.dtype(v.dtype)) for k, v in meta.items()} == \
        {k: (v.shape, v.dtype) for k, v in expected.items()}
    assert cli.main(["inspect", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "safetensors"
    assert doc["total_bytes"] == sum(v.nbytes for v in expected.values())
    assert {r["keypath"]: r["dtype"] for r in doc["leaves"]}["['model.layers.1.quant']"] == "float8_e4m3fn"
    one = path / "model-00003-of-00003.safetensors"  # one file alone
    assert sorted(dio.metadata(one)) == sorted(tensors()[2])
    assert cli.main(["inspect", str(one)]) == 0
    assert "written by Safetensors" in capsys.readouterr().out


def test_names_strict_checks_partial_and_cast(hf):
    path, expected = hf
    w = expected["lm_head.weight"]
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        # a name mapping: the target's key paths are not the tensor names
        names = {"head": "lm_head.weight", "emb": "model.embed_tokens.weight"}
        target = {"head": np.zeros_like(w), "emb": np.zeros((64, 48), np.float32)}
        out = d.restore(path, target, partial=True, names=lambda p: names[p[0].key])
        assert_same(out["head"], w, "head")
        # strict: what the target lacks and what the checkpoint lacks are both named
        with pytest.raises(TreeMismatchError) as info:
            d.restore(path, {"lm_head": {"weight": np.zeros_like(w)}, "nope": np.zeros(3)})
        text = str(info.value)
        assert "['nope']: not in the checkpoint" in text and "['model.embed_tokens.weight']" in text
        # a dtype change needs cast=True
        target = {"lm_head": {"weight": jax.ShapeDtypeStruct(w.shape, ml_dtypes.bfloat16)}}
        with pytest.raises(TreeMismatchError, match="cast=True"):
            d.restore(path, target, partial=True)
        out = d.restore(path, target, partial=True, cast=True)
        assert_same(out["lm_head"]["weight"], w.astype(ml_dtypes.bfloat16), "cast")
        with pytest.raises(TypeError, match="tensor name"):
            d.restore(path, {"x": np.zeros(3)}, names=lambda p: 3)


def test_verify_convert_and_the_colocated_dispatcher(hf, tmp_path):
    """verify reads every tensor; convert makes a dispatch_io checkpoint of the same bytes; the
    colocated dispatcher restores safetensors as the local one does."""
    path, expected = hf
    with dio.ColocatedDispatcher(host_memory_budget=64 << 10, max_chunk_bytes=4 << 10) as d:
        assert d.verify(path).bytes_read == sum(v.nbytes for v in expected.values())
        out = d.restore(path)
        d.convert(path, tmp_path / "ours")
        again = d.restore(tmp_path / "ours")
    for name, value in expected.items():
        assert_same(out[name], value, name)
        assert_same(again[name], value, name)


@pytest.mark.parametrize("case", ["huge_header", "not_json", "unknown_dtype", "shape_mismatch", "past_end",
                                  "overlap", "negative", "index_escape", "index_missing_tensor"])
def test_crafted_headers_are_refused_promptly(tmp_path, case):
    """Untrusted headers end in a CheckpointError before any tensor is read."""
    folder = tmp_path / "bad"
    folder.mkdir()
    ok = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    if case == "huge_header":
        crafted_safetensors(folder, ok, bytes(16), size=1 << 62)
    elif case == "not_json":
        (folder / "model.safetensors").write_bytes((5).to_bytes(8, "little") + b"{oops" + bytes(16))
    elif case == "unknown_dtype":
        crafted_safetensors(folder, {"a": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, bytes(2))
    elif case == "shape_mismatch":
        crafted_safetensors(folder, {"a": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 16]}}, bytes(16))
    elif case == "past_end":
        crafted_safetensors(folder, {"a": {"dtype": "F32", "shape": [1 << 20], "data_offsets": [0, 4 << 20]}}, bytes(16))
    elif case == "overlap":
        crafted_safetensors(folder, {**ok, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16))
    elif case == "negative":
        crafted_safetensors(folder, {"a": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}}, bytes(16))
    elif case == "index_escape":
        crafted_safetensors(folder, ok, bytes(16))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    elif case == "index_missing_tensor":
        crafted_safetensors(folder, ok, bytes(16))
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"a": "model.safetensors", "b": "model.safetensors"}}))
    with pytest.raises(CheckpointError) as info:
        dio.metadata(folder)
    assert str(folder) in str(info.value) and "{\"driver\"" not in str(info.value)


def test_partial_restore_reads_only_its_bytes(tmp_path):
    """The OS's count (/proc/self/io read_bytes, page cache dropped first): restoring one tensor
    of 4 MiB from a 3-file set of 48 MiB reads about that tensor, not the files. (The tensor is
    the last of its file: the kernel's readahead, up to 8 MiB here, stops at the end of the file.)"""
    parts = [{f"t{i}": np.full((1024, 1024), i, np.float32) * np.arange(1024, dtype=np.float32)
              for i in range(4 * k, 4 * k + 4)} for k in range(3)]
    expected = write_set(tmp_path / "big", parts)
    script = textwrap.dedent(f"""
        import os, numpy as np, dispatch_io as dio, jax
        for name in os.listdir({str(tmp_path / 'big')!r}):
            fd = os.open(os.path.join({str(tmp_path / 'big')!r}, name), os.O_RDONLY)
            os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
        io = lambda: int(dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())["read_bytes"])
        mesh = jax.make_mesh((4, 2), ("a", "b"))
        jax.device_put(np.zeros(8), jax.devices()[0]).block_until_ready()
        before = io()
        target = {{"t9": jax.ShapeDtypeStruct((1024, 1024), np.float32,
                   sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b")))}}
        with dio.LocalDispatcher(host_memory_budget=4 << 20) as d:
            out = d.restore({str(tmp_path / 'big')!r}, target, partial=True)
        print(io() - before, np.asarray(out["t9"]).tobytes() == np.load({str(tmp_path / 't9.npy')!r}).tobytes())
    """)
    np.save(tmp_path / "t9.npy", expected["t9"])
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT}
    read, same = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                check=True).stdout.split()
    assert same == "True"
    assert 4 * MiB <= int(read) < 6 * MiB, read  # the tensor and the headers, not the 48 MiB of the files


def test_a_tensor_8x_the_budget_stays_within_it(tmp_path):
    """A 64 MiB tensor restored onto the 4x2 mesh under an 8 MiB budget: peak RSS (VmHWM) grows
    by the result plus at most the budget, not by a copy of the file."""
    big = np.arange(16 << 20, dtype=np.float32).reshape(4096, 4096)
    save_file({"w": big}, str(tmp_path / "model.safetensors"))
    del big
    script = textwrap.dedent(f"""
        import numpy as np, dispatch_io as dio, jax
        hwm = lambda: int(dict(l.split(":") for l in open("/proc/self/status").read().splitlines())["VmHWM"].split()[0]) << 10
        mesh = jax.make_mesh((4, 2), ("a", "b"))
        target = {{"w": jax.ShapeDtypeStruct((4096, 4096), np.float32,
                  sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b")))}}
        jax.device_put(np.zeros(8), jax.devices()[0]).block_until_ready()
        with dio.LocalDispatcher(host_memory_budget=8 << 20) as d:
            dio.metadata({str(tmp_path)!r})
            before = hwm()
            out = d.restore({str(tmp_path)!r}, target)
            jax.block_until_ready(out)
            peak = hwm() - before
        ok = all((np.asarray(s.data) == np.arange(16 << 20, dtype=np.float32).reshape(4096, 4096)[s.index]).all()
                 for s in out["w"].addressable_shards)
        print(peak, ok)
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT}
    peak, ok = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              check=True).stdout.split()
    assert ok == "True"
    assert int(peak) < 64 * MiB + 8 * MiB + 8 * MiB, int(peak) / MiB  # result + budget + slack


def upload(folder, url):
    import tensorstore as ts
    from dispatch_io.storage import kvstore_spec

    dst = ts.KvStore.open(kvstore_spec(url)).result()
    for name in os.listdir(folder):
        dst.write(name, (folder / name).read_bytes()).result()


def test_restore_from_s3_reads_its_bytes(s3_server, s3_prefix, tmp_path, monkeypatch):
    """On the moto S3 server, through a counting proxy: the whole set restores bit-exactly, and a
    partial restore of one tensor fetches about its bytes (plus the headers)."""
    from s3_server import FaultyProxy

    expected = write_set(tmp_path / "hf", tensors())
    upload(tmp_path / "hf", f"{s3_prefix}/hf")
    proxy = FaultyProxy(s3_server.port)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        mesh = jax.make_mesh((4, 2), ("a", "b"))
        with dio.LocalDispatcher(host_memory_budget=MiB) as d:
            out = d.restore(f"{s3_prefix}/hf")
            for name, value in expected.items():
                assert_same(out[name], value, name)
            proxy.bytes_sent.clear()
            w = expected["lm_head.weight"]
            target = {"lm_head.weight": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P("a")))}
            out = d.restore(f"{s3_prefix}/hf", target, partial=True)
            assert_same(out["lm_head.weight"], w, "lm_head.weight")
            got = proxy.bytes_sent.get("GET", 0)
            assert w.nbytes <= got < w.nbytes + 8 << 10, (got, w.nbytes)
            one = f"{s3_prefix}/hf/model-00003-of-00003.safetensors"
            assert sorted(d.restore(one)) == sorted(tensors()[2])
    finally:
        proxy.stop()


WORKER = textwrap.dedent("""
    import json, os, sys
    import jax, numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P
    import dispatch_io as dio

    pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    meta = dio.metadata(path)
    target = {"a": jax.ShapeDtypeStruct(meta["a"].shape, meta["a"].dtype, sharding=NamedSharding(mesh, P("data"))),
              "b": jax.ShapeDtypeStruct(meta["b"].shape, meta["b"].dtype, sharding=NamedSharding(mesh, P()))}
    multihost_utils.sync_global_devices("start")
    with dio.LocalDispatcher(host_memory_budget=4 << 20) as d:
        out = d.restore(path, target)
        stats = d.last_restore_stats
    want = {k: np.load(os.path.join(os.environ["EXPECTED"], k + ".npy")) for k in "ab"}
    exact = all(np.asarray(s.data).tobytes() == want[k][s.index].tobytes()
                for k in "ab" for s in out[k].addressable_shards)
    multihost_utils.sync_global_devices("done")
    print("RESULT " + json.dumps({"bytes_read": stats.bytes_read, "received": stats.bytes_broadcast, "exact": exact}))
""")


def test_each_process_reads_its_share_from_s3(s3_server, s3_prefix, tmp_path):
    """Two processes of a jax.distributed job restore a set from the moto S3 server, each through
    a proxy of its own that counts the bytes it was sent: a tensor sharded over the processes and
    a replicated one (read once per job, shared) cost each process about half the data."""
    from s3_server import FaultyProxy

    rng = np.random.default_rng(3)
    parts = [{"a": rng.standard_normal((1024, 512)).astype(np.float32)},
             {"b": rng.standard_normal((512, 1024)).astype(np.float32)}]
    write_set(tmp_path / "hf", parts)
    os.makedirs(tmp_path / "expected")
    for part in parts:
        for k, v in part.items():
            np.save(tmp_path / "expected" / f"{k}.npy", v)
    upload(tmp_path / "hf", f"{s3_prefix}/hf")
    total = sum(v.nbytes for part in parts for v in part.values())
    (tmp_path / "worker.py").write_text(WORKER)
    proxies = [FaultyProxy(s3_server.port) for _ in range(2)]
    try:
        results = run_job(lambda pid, port: [sys.executable, str(tmp_path / "worker.py"), str(pid), str(port),
                                              f"{s3_prefix}/hf"], 2, 4,
                          lambda pid: {"AWS_ENDPOINT_URL_S3": proxies[pid].endpoint,
                                       "EXPECTED": str(tmp_path / "expected")}, timeout=120)
    finally:
        for proxy in proxies:
            proxy.stop()
    assert all(r["exact"] for r in results), results
    assert sum(r["bytes_read"] for r in results) == total, results
    for r, proxy in zip(results, proxies):
        got = proxy.bytes_sent.get("GET", 0)
        assert 0.4 * total < r["bytes_read"] < 0.6 * total, results
        assert r["bytes_read"] <= got < r["bytes_read"] + (16 << 10), (got, r)  # its regions and the headers


@pytest.mark.parametrize("entry", [
    {"dtype": "U8", "shape": [2**63], "data_offsets": [0, 2**63]},            # end past int64
    {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 2**82]},    # far past int64
])
def test_offsets_past_int64_are_a_checkpoint_error(tmp_path, entry, capsys):
    """A crafted header whose data_offsets exceed 2**63 must be refused as malformed
    (CheckpointError, inspect exit 2 with one line). Now: a TensorStore TypeError dumping the
    kvstore spec escapes metadata/restore/verify, and ``dispatch-io inspect`` tracebacks."""
    folder = crafted_safetensors(tmp_path / "bad", {"a": entry}, bytes(8))
    with pytest.raises(CheckpointError) as info:
        dio.metadata(folder)
    assert '"driver"' not in str(info.value) and "'driver'" not in str(info.value)
    assert cli.main(["inspect", str(folder)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("shape", [[1] * 65, [0, 10**30]])
def test_shapes_numpy_cannot_hold_are_refused_at_open(tmp_path, shape):
    """A header shape with more than 64 axes (numpy's limit) or an axis past int64 is a
    malformed file: metadata must refuse it (CheckpointError), and ``verify`` answer exit 2
    (unusable), not 1 ("NOT sound"). Now: metadata accepts it; restore fails later with a bare
    ValueError ("Maximum allowed dimension exceeded") or a WorkerError; verify says unsound."""
    nbytes = 4 if all(shape) else 0
    folder = crafted_safetensors(tmp_path / "bad", {"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, nbytes]}},
                     bytes(nbytes))
    with pytest.raises(CheckpointError):
        dio.metadata(folder)
    assert cli.main(["verify", str(folder)]) == 2


def test_several_index_files_are_refused_not_one_picked(tmp_path):
    """A folder with two index files (Hugging Face variants: ``model.safetensors.index.json``
    and ``model.fp16.safetensors.index.json``) is ambiguous: it must be refused naming both
    (as a step with several Orbax items is). Now: the first by name is used silently -- here the
    fp16 variant, so ``restore(path)`` quietly returns half-precision weights."""
    folder = tmp_path / "hf"
    a = np.arange(8, dtype=np.float32)
    crafted_safetensors(folder, {"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, a.tobytes(),
            name="model-00001-of-00001.safetensors")
    crafted_safetensors(folder, {"w": {"dtype": "F16", "shape": [8], "data_offsets": [0, 16]}}, a.astype(np.float16).tobytes(),
            name="model.fp16-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    (folder / "model.fp16.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model.fp16-00001-of-00001.safetensors"}}))
    with pytest.raises(CheckpointError, match="model.fp16.safetensors.index.json"):
        dio.metadata(folder)


def test_a_failing_names_function_is_named_with_the_key_path(tmp_path):
    """An exception from the user's ``names`` function should say which target leaf it was
    called for (as a non-str result does: "names(['p']) must return..."). Now: a bare
    ``KeyError('p')`` from restore and ``KeyError((DictKey(key='x'),))`` from convert."""
    folder = crafted_safetensors(tmp_path / "hf", {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    mapping = {"q": "w"}
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        with pytest.raises(Exception) as info:
            d.restore(folder, {"p": np.zeros(2, np.float32)}, names=lambda p: mapping[p[0].key])
        assert "['p']" in str(info.value), repr(info.value)
        d.save(tmp_path / "src", {"x": np.ones(2, np.float32)}).wait()
        with pytest.raises(Exception) as info:
            d.convert(tmp_path / "src", tmp_path / "out", to="safetensors", names=lambda p: mapping[p[0].key])
        assert "['x']" in str(info.value), repr(info.value)


def test_names_that_match_two_saved_leaves_are_refused(tmp_path):
    """``restore(..., names=fn)`` on a dispatch_io checkpoint holding both ``{"a.b": x}`` and
    ``{"a": {"b": y}}``: the name ``"a.b"`` matches two leaves, which must be an error naming
    both. Now one of them is returned silently (whichever flattens last)."""
    x, y = np.arange(4, dtype=np.float32), -np.arange(4, dtype=np.float32)
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        d.save(tmp_path / "amb", {"a.b": x, "a": {"b": y}}).wait()
        with pytest.raises((ValueError, CheckpointError, dio.TreeMismatchError)):
            d.restore(tmp_path / "amb", {"p": np.zeros(4, np.float32)}, names=lambda p: "a.b", partial=True)


def test_headers_of_a_sharded_set_on_s3_are_read_concurrently(s3_server, s3_prefix, tmp_path, monkeypatch):
    """Opening a 16-file set on an object store with 100 ms per request: the headers must be
    fetched concurrently (a few round trips in all), not 3 sequential requests per file (8-byte
    length, header, last data byte) -- ~5 s here, and ~30 s on every host of a job for a
    191-shard model at 50 ms. Every process opens the set before reading."""
    import time

    import tensorstore as ts
    from s3_server import FaultyProxy

    from dispatch_io.storage import kvstore_spec

    folder = tmp_path / "hf"
    for i in range(16):
        crafted_safetensors(folder, {f"t{i}": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8),
                name=f"model-{i + 1:05d}-of-00016.safetensors")
    dst = ts.KvStore.open(kvstore_spec(f"{s3_prefix}/hf")).result()
    for name in os.listdir(folder):
        dst.write(name, (folder / name).read_bytes()).result()
    proxy = FaultyProxy(s3_server.port)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        proxy.slow(".safetensors", 0.1)
        started = time.perf_counter()
        assert len(dio.metadata(f"{s3_prefix}/hf")) == 16
        seconds = time.perf_counter() - started
    finally:
        proxy.stop()
    assert seconds < 1.5, seconds


COLUMNS_WORKER = """
import json, os, sys
import jax, numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
import dispatch_io as dio

pid, port, path, spec = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
mesh = jax.make_mesh((4, 2), ("data", "model"))
layout = P(None, "data") if spec == "cols" else P("data")
target = {"w": jax.ShapeDtypeStruct((4096, 4096), np.float32, sharding=NamedSharding(mesh, layout))}
io = lambda: int(dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())["read_bytes"])
with dio.LocalDispatcher(host_memory_budget=4 << 20) as d:
    d.restore(path, target)  # warm: imports, threads
    multihost_utils.sync_global_devices("warm")
    if pid == 0:
        os.system("sync")
        open("/proc/sys/vm/drop_caches", "w").write("3")
    multihost_utils.sync_global_devices("dropped")
    before = io()
    out = d.restore(path, target)
    read = io() - before
full = np.arange(16 << 20, dtype=np.float32).reshape(4096, 4096)
exact = all(np.asarray(s.data).tobytes() == full[s.index].tobytes() for s in out["w"].addressable_shards)
multihost_utils.sync_global_devices("done")
print("RESULT " + json.dumps({"read": read, "exact": exact}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="drops the page cache (root)")
def test_column_sharded_tensor_each_process_reads_about_its_half_from_disk(tmp_path):
    """Two processes restore a 64 MiB local tensor sharded over its columns (tensor
    parallelism: ``P(None, "data")``, each process holding 2 of 4 column blocks): each needs
    32 MiB, as 4096 runs of 8 KiB with 8 KiB gaps. Measured (MiB per process): rows 33-51,
    cols 72-127 -- together 2.7x the file. Two causes: the kernel's readahead (8 MiB here,
    128 KiB by default; either far above the gaps) reads the gaps too, and after every batch
    each process drops the *whole* safetensors file from the page cache
    (``release_page_cache``: ``POSIX_FADV_DONTNEED`` over (0, 0)), evicting what the other
    process read ahead, so it is read from disk again. (With ``keep_page_cache=True``: rows
    32 + 32, cols 43 + 21, the file once.) "Each process reads only the byte ranges of its
    regions" must hold at the disk: e.g. read local raw arrays with ``os.pread`` on a
    descriptor advised ``POSIX_FADV_RANDOM``, and drop only the ranges read."""
    save_file({"w": np.arange(16 << 20, dtype=np.float32).reshape(4096, 4096)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "worker.py").write_text(COLUMNS_WORKER)

    def run(spec) -> list[int]:
        results = run_job(lambda pid, port: [sys.executable, str(tmp_path / "worker.py"), str(pid), str(port),
                                             str(tmp_path / "model.safetensors"), spec], 2, 4)
        assert all(r["exact"] for r in results), results
        return [r["read"] for r in results]

    rows, cols = run("rows"), run("cols")  # rows: each process's half is one contiguous range
    # both need 32 MiB per process; what rows read besides (libraries paged in again) is the noise
    assert sum(cols) < sum(rows) + 16 * MiB, ([r / MiB for r in rows], [c / MiB for c in cols])


def test_a_huge_index_file_is_refused_without_reading_it_whole(tmp_path):
    """Headers are bounded (100 MB), the index JSON is not: a damaged or crafted
    ``model.safetensors.index.json`` of 1 GiB (sparse here) is read whole into memory, then
    decoded (another copy), before being refused. It must be refused by its size (a real index is
    a few hundred KB; the same bound as a header will do), without a GiB-sized allocation."""
    folder = crafted_safetensors(tmp_path / "hf", {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    with open(folder / "model.safetensors.index.json", "wb") as f:
        f.truncate(1 << 30)
    script = textwrap.dedent(f"""
        import dispatch_io as dio
        from dispatch_io.errors import CheckpointError
        def hwm():
            status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
            return int(status["VmHWM"].split()[0]) << 10
        open("/proc/self/clear_refs", "w").write("5")
        before = hwm()
        try:
            dio.metadata({str(folder)!r})
        except CheckpointError:
            pass
        print(hwm() - before)
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    grew = subprocess.run([sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, check=True).stdout.split()[-1]
    assert int(grew) < 256 * MiB, int(grew) / MiB


def test_a_target_leaf_not_found_says_which_tensor_name_was_looked_for(tmp_path):
    """With a name mapping, "['p']: not in the checkpoint" hides what was looked up: the message
    must name the tensor name the leaf asked for (here the typo ``model.layer.0.w``), or the
    user cannot tell a wrong mapping from a missing tensor. Now only the key path is named."""
    folder = crafted_safetensors(tmp_path / "hf", {"model.layers.0.w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                     bytes(8))
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        with pytest.raises(dio.TreeMismatchError) as info:
            d.restore(folder, {"p": np.zeros(2, np.float32)}, names=lambda p: "model.layer.0.w", partial=True)
        assert "model.layer.0.w" in str(info.value), str(info.value)
        with pytest.raises(dio.TreeMismatchError) as info:  # the default mapping too
            d.restore(folder, {"model": {"layer": [{"w": np.zeros(2, np.float32)}]}}, partial=True)
        assert "model.layer.0.w" in str(info.value), str(info.value)
