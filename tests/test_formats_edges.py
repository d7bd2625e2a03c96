"""safetensors in, safetensors and Orbax out: edge cases from an adversarial review (each failed
before its fix) and the behaviour each expects."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

import dispatch_io as dio
from dispatch_io import cli
from dispatch_io.formats import exporting
from dispatch_io.formats import safetensors as st_lib
from dispatch_io.errors import CheckpointError

MiB = 1 << 20


def crafted(folder, header: dict, data: bytes = b"", name: str = "model.safetensors"):
    """A safetensors file holding ``header`` (as given, unchecked) and ``data``."""
    os.makedirs(folder, exist_ok=True)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + data)
    return folder


@pytest.mark.parametrize("entry", [
    {"dtype": "U8", "shape": [2**63], "data_offsets": [0, 2**63]},            # end past int64
    {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 2**82]},    # far past int64
])
def test_offsets_past_int64_are_a_checkpoint_error(tmp_path, entry, capsys):
    """A crafted header whose data_offsets exceed 2**63 must be refused as malformed
    (CheckpointError, inspect exit 2 with one line). Now: a TensorStore TypeError dumping the
    kvstore spec escapes metadata/restore/verify, and ``dispatch-io inspect`` tracebacks."""
    folder = crafted(tmp_path / "bad", {"a": entry}, bytes(8))
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
    folder = crafted(tmp_path / "bad", {"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, nbytes]}},
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
    crafted(folder, {"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, a.tobytes(),
            name="model-00001-of-00001.safetensors")
    crafted(folder, {"w": {"dtype": "F16", "shape": [8], "data_offsets": [0, 16]}}, a.astype(np.float16).tobytes(),
            name="model.fp16-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    (folder / "model.fp16.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model.fp16-00001-of-00001.safetensors"}}))
    with pytest.raises(CheckpointError, match="model.fp16.safetensors.index.json"):
        dio.metadata(folder)


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
    folder = crafted(tmp_path / "llama", {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        d.save(tmp_path / "src", {"x": np.ones(2, np.float32)}).wait()
        try:
            d.convert(tmp_path / "src", folder, to="safetensors", overwrite=True)
        except ValueError:
            pass
    assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists(), os.listdir(folder)


def test_a_failing_names_function_is_named_with_the_key_path(tmp_path):
    """An exception from the user's ``names`` function should say which target leaf it was
    called for (as a non-str result does: "names(['p']) must return..."). Now: a bare
    ``KeyError('p')`` from restore and ``KeyError((DictKey(key='x'),))`` from convert."""
    folder = crafted(tmp_path / "hf", {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    mapping = {"q": "w"}
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        with pytest.raises(Exception) as info:
            d.restore(folder, {"p": np.zeros(2, np.float32)}, names=lambda p: mapping[p[0].key])
        assert "['p']" in str(info.value), repr(info.value)
        d.save(tmp_path / "src", {"x": np.ones(2, np.float32)}).wait()
        with pytest.raises(Exception) as info:
            d.convert(tmp_path / "src", tmp_path / "out", to="safetensors", names=lambda p: mapping[p[0].key])
        assert "['x']" in str(info.value), repr(info.value)


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


def test_names_that_match_two_saved_leaves_are_refused(tmp_path):
    """``restore(..., names=fn)`` on a dispatch_io checkpoint holding both ``{"a.b": x}`` and
    ``{"a": {"b": y}}``: the name ``"a.b"`` matches two leaves, which must be an error naming
    both. Now one of them is returned silently (whichever flattens last)."""
    x, y = np.arange(4, dtype=np.float32), -np.arange(4, dtype=np.float32)
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        d.save(tmp_path / "amb", {"a.b": x, "a": {"b": y}}).wait()
        with pytest.raises((ValueError, CheckpointError, dio.TreeMismatchError)):
            d.restore(tmp_path / "amb", {"p": np.zeros(4, np.float32)}, names=lambda p: "a.b", partial=True)


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
        crafted(folder, {f"t{i}": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8),
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


COLUMNS_WORKER = """
import os, sys
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
print("RESULT", read, exact)
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
    import subprocess
    import sys

    from safetensors.numpy import save_file

    from s3_server import free_port

    save_file({"w": np.arange(16 << 20, dtype=np.float32).reshape(4096, 4096)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "worker.py").write_text(COLUMNS_WORKER)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": root}

    def run(spec) -> list[int]:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(pid), str(port),
                                   str(tmp_path / "model.safetensors"), spec], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for pid in range(2)]
        try:
            outputs = [p.communicate(timeout=180) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        reads = []
        for p, (out, err) in zip(procs, outputs):
            assert p.returncode == 0, err[-3000:]
            read, exact = out.split("RESULT ", 1)[1].split()
            assert exact == "True"
            reads.append(int(read))
        return reads

    rows, cols = run("rows"), run("cols")  # rows: each process's half is one contiguous range
    # both need 32 MiB per process; what rows read besides (libraries paged in again) is the noise
    assert sum(cols) < sum(rows) + 16 * MiB, ([r / MiB for r in rows], [c / MiB for c in cols])


def test_a_huge_index_file_is_refused_without_reading_it_whole(tmp_path):
    """Headers are bounded (100 MB), the index JSON is not: a damaged or crafted
    ``model.safetensors.index.json`` of 1 GiB (sparse here) is read whole into memory, then
    decoded (another copy), before being refused. It must be refused by its size (a real index is
    a few hundred KB; the same bound as a header will do), without a GiB-sized allocation."""
    import subprocess
    import sys
    import textwrap

    folder = crafted(tmp_path / "hf", {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    grew = subprocess.run([sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, check=True).stdout.split()[-1]
    assert int(grew) < 256 * MiB, int(grew) / MiB


def test_a_target_leaf_not_found_says_which_tensor_name_was_looked_for(tmp_path):
    """With a name mapping, "['p']: not in the checkpoint" hides what was looked up: the message
    must name the tensor name the leaf asked for (here the typo ``model.layer.0.w``), or the
    user cannot tell a wrong mapping from a missing tensor. Now only the key path is named."""
    folder = crafted(tmp_path / "hf", {"model.layers.0.w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                     bytes(8))
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        with pytest.raises(dio.TreeMismatchError) as info:
            d.restore(folder, {"p": np.zeros(2, np.float32)}, names=lambda p: "model.layer.0.w", partial=True)
        assert "model.layer.0.w" in str(info.value), str(info.value)
        with pytest.raises(dio.TreeMismatchError) as info:  # the default mapping too
            d.restore(folder, {"model": {"layer": [{"w": np.zeros(2, np.float32)}]}}, partial=True)
        assert "model.layer.0.w" in str(info.value), str(info.value)
