"""What is specific to ColocatedDispatcher (jax.experimental.colocated_python; in-process here).

The behaviour both dispatchers share (round trips, errors, priorities, callbacks, budget,
concurrency) is tested against both through the ``dispatcher_cls`` fixture in conftest.py.
This file covers what only the colocated path can get wrong: every sharding JAX allows,
PRNG keys crossing the colocated_python boundary, a missing cloudpickle, checkpoints shared
with LocalDispatcher, copies that must not alias the caller's buffers, and colocated
functions that must not be re-specialized on every save.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax._src.util
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import colocated_python
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import dispatch_io as dio
import dispatch_io.workers.colocated
from dispatch_io import workers
from conftest import assert_trees_bit_equal, host_bytes
from dispatch_io.jax_compat import single_device_sharding

KiB, MiB = 1 << 10, 1 << 20
TIMEOUT = 60
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (16, 8)


@pytest.fixture
def colocated():
    d = dio.ColocatedDispatcher(host_memory_budget=MiB)
    yield d
    d.close()


def random_bits(seed, shape, dtype=np.float32):
    """Random bit patterns (NaN payloads, -0.0 and infinities included)."""
    dtype = np.dtype(dtype)
    raw = np.random.default_rng(seed).bytes(int(np.prod(shape)) * dtype.itemsize)
    return np.frombuffer(raw, dtype).reshape(shape).copy()


def numpy_copy(tree):
    """Host bytes of every array leaf (keys as key_data), taken before anything is saved."""
    return jax.tree.map(lambda x: host_bytes(x) if hasattr(x, "shape") else x, tree)


def region_shapes(sharding, shape) -> set:
    """The distinct shard shapes ``sharding`` gives an array of ``shape``."""
    return {tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))
            for index in sharding.devices_indices_map(shape).values()}


def mesh_of(devices, shape=(4, 2), names=("data", "model")):
    return Mesh(np.array(devices, dtype=object).reshape(shape), names)


# ---- (a) any sharding JAX allows -----------------------------------------------------------------

def _shardings():
    devs = jax.devices()
    mesh = mesh_of(devs)
    reversed_mesh = mesh_of(devs[::-1])
    subset = mesh_of([devs[i] for i in (6, 1, 3, 4)], (2, 2))
    out = {
        "named-data-model": NamedSharding(mesh, P("data", "model")),
        "named-model-data": NamedSharding(mesh, P("model", "data")),
        "named-both-on-rows": NamedSharding(mesh, P(("data", "model"))),
        "named-cols-partly-replicated": NamedSharding(mesh, P(None, "model")),
        "named-replicated": NamedSharding(mesh, P()),
        "named-reversed-devices": NamedSharding(reversed_mesh, P("data", "model")),
        "named-reversed-devices-rows": NamedSharding(reversed_mesh, P("data")),
        "named-device-subset": NamedSharding(subset, P("model", "data")),
        "single-device-5": single_device_sharding(devs[5]),
    }
    if hasattr(jax.sharding, "PositionalSharding"):   # removed from recent JAX
        out["positional"] = jax.sharding.PositionalSharding(devs).reshape(4, 2)
    # GSPMDSharding: no public constructor, but simple to build from a NamedSharding's HLO sharding.
    gspmd = getattr(jax._src.sharding_impls, "GSPMDSharding", None)
    if gspmd is not None:
        for name, named in [("gspmd", out["named-data-model"]), ("gspmd-reversed-devices", out["named-reversed-devices"])]:
            out[name] = gspmd(tuple(named.mesh.devices.flat), named._to_xla_hlo_sharding(len(SHAPE)))
    return out


SHARDINGS = _shardings()
NAMES = sorted(SHARDINGS)


@pytest.mark.parametrize("name", NAMES)
def test_any_sharding_round_trips_bit_exactly(colocated, tmp_path, name):
    sharding = SHARDINGS[name]
    tree = {"f32": jax.device_put(random_bits(1, SHAPE), sharding),
            "bf16": jax.device_put(random_bits(2, SHAPE, ml_dtypes.bfloat16), sharding),
            "int4": jax.device_put(np.random.default_rng(3).integers(-8, 8, SHAPE).astype(ml_dtypes.int4), sharding),
            "keys": jax.device_put(jax.random.split(jax.random.key(4), SHAPE[0] * SHAPE[1]).reshape(SHAPE), sharding)}
    assert type(tree["f32"].sharding) is type(sharding)
    colocated.save(tmp_path / "ckpt", tree).wait(TIMEOUT)
    for target in (tree, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)):
        restored = colocated.restore(tmp_path / "ckpt", target)
        assert_trees_bit_equal(tree, restored)
        for key, x in restored.items():
            assert x.sharding.is_equivalent_to(sharding, x.ndim), (key, x.sharding, sharding)
            assert x.sharding.device_set == sharding.device_set, key
            # Every shard holds exactly its slice of the original, on the device it belongs to.
            want = {s.device: host_bytes(s.data) for s in tree[key].addressable_shards}
            assert {s.device: host_bytes(s.data) for s in x.addressable_shards} == want, key


def test_restore_onto_a_different_sharding_than_saved(colocated, tmp_path):
    """Save once under every sharding, restore each onto every other (bytes and layout)."""
    names = NAMES
    tree = {name: jax.device_put(random_bits(10 + i, SHAPE), SHARDINGS[name]) for i, name in enumerate(names)}
    keys = {name: jax.device_put(jax.random.split(jax.random.key(i, impl="rbg"), SHAPE[0] * SHAPE[1]).reshape(SHAPE),
                                 SHARDINGS[name]) for i, name in enumerate(names)}
    colocated.save(tmp_path / "ckpt", {"arrays": tree, "keys": keys}).wait(TIMEOUT)
    for shift in (1, 3):
        other = {name: SHARDINGS[names[(i + shift) % len(names)]] for i, name in enumerate(names)}
        target = {"arrays": {k: jax.ShapeDtypeStruct(SHAPE, x.dtype, sharding=other[k]) for k, x in tree.items()},
                  "keys": {k: jax.ShapeDtypeStruct(SHAPE, x.dtype, sharding=other[k]) for k, x in keys.items()}}
        restored = colocated.restore(tmp_path / "ckpt", target)
        assert_trees_bit_equal({"arrays": tree, "keys": keys}, restored)
        for group in ("arrays", "keys"):
            for k, x in restored[group].items():
                assert x.sharding.is_equivalent_to(other[k], x.ndim), (group, k, x.sharding, other[k])
                assert x.sharding.device_set == other[k].device_set, (group, k)


# ---- (b) PRNG keys --------------------------------------------------------------------------------

@pytest.fixture
def reader_specs(monkeypatch):
    """Every result-spec tuple ColocatedDispatcher asks ``workers.colocated.reader`` for."""
    calls = []
    real = workers.colocated.reader

    def reader(out_specs):
        calls.append(out_specs)
        return real(out_specs)

    monkeypatch.setattr(workers.colocated, "reader", reader)
    return calls


def first_draw(keys):
    """Random bits from the first key of ``keys`` (rebuilt on the default device)."""
    data = np.asarray(jax.device_get(jax.random.key_data(keys)))
    return jax.random.bits(jax.random.wrap_key_data(data.reshape(-1, data.shape[-1])[0], impl=jax.random.key_impl(keys)))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_prng_keys_round_trip_and_are_read_with_key_specs(colocated, tmp_path, reader_specs, mesh, impl):
    base = jax.random.key(42, impl=impl)
    sharded, replicated = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P())
    keys = {"sharded": jax.device_put(jax.random.split(base, 16).reshape(8, 2), sharded),
            "rows": jax.device_put(jax.random.split(base, 8), NamedSharding(mesh, P("data"))),
            "replicated": jax.device_put(jax.random.split(base, 6).reshape(3, 2), replicated),
            "scalar": jax.device_put(base, replicated)}
    colocated.save(tmp_path / "ckpt", keys).wait(TIMEOUT)
    mesh2 = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[::-1])
    other = {"sharded": P("model"), "rows": P("model"), "replicated": P(None, "data"), "scalar": P()}
    targets = {
        "as saved": keys,
        "resharded": {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh2, other[k]))
                      for k, x in keys.items()},
        "default device": None,
    }
    cpus = set(colocated_python.colocated_cpu_devices(tuple(jax.devices())))
    for what, target in targets.items():
        reader_specs.clear()
        restored = colocated.restore(tmp_path / "ckpt", target)
        assert_trees_bit_equal(keys, restored)
        for k, x in restored.items():
            assert jax.random.key_impl(x) == jax.random.key_impl(keys[k]), (what, k)
            assert host_bytes(first_draw(x)) == host_bytes(first_draw(keys[k])), (what, k)   # same numbers
        # What the colocated read was asked for: key dtype, logical (region) shape, no trailing
        # key_data dimension, on a colocated CPU device.
        specs = [s for call in reader_specs for s in call]
        assert specs and all(jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key) for s in specs), (what, specs)
        assert all(s.dtype == base.dtype for s in specs), (what, specs)
        assert all(len(s.sharding.device_set) == 1 and s.sharding.device_set <= cpus for s in specs), (what, specs)
        expected = set()
        for k, x in keys.items():
            sharding = single_device_sharding(jax.devices()[0]) if target is None else target[k].sharding
            expected |= region_shapes(sharding, x.shape)
        assert {tuple(s.shape) for s in specs} == expected, what


# ---- (c) no cloudpickle ---------------------------------------------------------------------------

NO_CLOUDPICKLE = textwrap.dedent("""
    import sys, tempfile
    sys.modules["cloudpickle"] = None          # as if it were not installed
    import numpy as np
    import dispatch_io as dio                   # importing works without it
    try:
        dio.ColocatedDispatcher(host_memory_budget=1 << 20)
    except ImportError as exc:
        print("ImportError:", exc)
    else:
        raise AssertionError("ColocatedDispatcher() did not raise without cloudpickle")
    with dio.LocalDispatcher(host_memory_budget=1 << 20) as d, tempfile.TemporaryDirectory() as t:
        d.save(t + "/ckpt", {"x": np.arange(3)}).wait()   # LocalDispatcher does not need it
        assert np.array_equal(d.restore(t + "/ckpt")["x"], np.arange(3))
    print("local ok")
""")


def run_python(script, *args, env=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


def test_missing_cloudpickle_is_a_clear_import_error():
    out = run_python(NO_CLOUDPICKLE)
    message = next(line for line in out.splitlines() if line.startswith("ImportError:"))
    assert "cloudpickle" in message and "ColocatedDispatcher" in message, message
    assert "local ok" in out


# ---- (d) checkpoints are shared with LocalDispatcher ----------------------------------------------

def mixed_tree(mesh):
    return {
        "params": {"w": jax.device_put(random_bits(1, (32, 16)), NamedSharding(mesh, P("data", "model"))),
                   "b": jax.device_put(random_bits(2, (16,), ml_dtypes.bfloat16), NamedSharding(mesh, P("model"))),
                   "mask": jax.device_put(np.random.default_rng(3).integers(0, 2, (8, 4)).astype(bool),
                                          NamedSharding(mesh, P("data"))),
                   "pinned": jax.device_put(random_bits(4, (5, 3), np.int8), jax.devices()[6])},
        "keys": {"fry": jax.device_put(jax.random.split(jax.random.key(5), 8), NamedSharding(mesh, P("data"))),
                 "rbg": jax.random.key(6, impl="rbg")},
        # Host leaves of 64-bit dtypes travel as raw bytes through the colocated path.
        "host": {"f64": random_bits(7, (6, 5), np.float64), "i64": random_bits(8, (7,), np.int64),
                 "u64": random_bits(9, (3, 2), np.uint64), "c128": random_bits(10, (4,), np.complex128),
                 "u8": random_bits(11, (9, 2), np.uint8), "f64_scalar": np.float64(-0.0),
                 "i64_scalar": np.int64(-(2 ** 62) - 5), "f64_0d": np.array(np.nan, np.float64)},
        "step": 17, "lr": 3e-4, "name": "run",
    }


@pytest.mark.parametrize("writer, reader", [(dio.ColocatedDispatcher, dio.LocalDispatcher),
                                            (dio.LocalDispatcher, dio.ColocatedDispatcher)],
                         ids=["colocated-to-local", "local-to-colocated"])
def test_checkpoints_are_shared_with_local_dispatcher(tmp_path, mesh, writer, reader):
    tree = mixed_tree(mesh)
    with writer(host_memory_budget=64 * KiB) as w:   # several batches
        w.save(tmp_path / "ckpt", tree).wait(TIMEOUT)
    with reader(host_memory_budget=64 * KiB) as r:
        restored = r.restore(tmp_path / "ckpt", tree)
        assert_trees_bit_equal(tree, restored)
        as_saved = r.restore(tmp_path / "ckpt")
    assert_trees_bit_equal(jax.tree.map(lambda x: x if dio.tree.is_prng_key(x) or not isinstance(x, jax.Array)
                                        else np.asarray(x), tree), as_saved)
    for k, v in tree["host"].items():
        assert type(as_saved["host"][k]) is type(v) and as_saved["host"][k].dtype == v.dtype, k


X64_GLOBAL = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    jax.config.update("jax_enable_x64", True)   # globally: every thread sees it
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import dispatch_io as dio
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    tree = {name: jax.device_put(np.frombuffer(rng.bytes(16 * 6 * 8), name).reshape(16, 6),
                                 NamedSharding(mesh, P("data", "model")))
            for name in ("int64", "uint64", "float64")}
    tree["complex128"] = jax.device_put(np.frombuffer(rng.bytes(8 * 16), np.complex128), NamedSharding(mesh, P()))
    with dio.ColocatedDispatcher(host_memory_budget=1 << 20) as d:
        d.save(sys.argv[1], tree).wait()
        restored = d.restore(sys.argv[1], tree)
    for k, x in tree.items():
        assert restored[k].dtype == x.dtype, (k, restored[k].dtype)
        assert np.asarray(restored[k]).tobytes() == np.asarray(x).tobytes(), k
    print("ok")
""")


def test_64_bit_device_arrays_with_global_x64(tmp_path):
    """64-bit jax arrays round-trip when x64 is enabled globally (test_roundtrip's
    test_dtype_sharded_jax_leaf covers the thread-local ``jax.enable_x64`` context)."""
    assert run_python(X64_GLOBAL, str(tmp_path / "ckpt")).strip().endswith("ok")


# ---- (e) the caller's buffers are free once on_transfer_end fired -----------------------------------

def test_deleting_leaves_in_on_transfer_end_does_not_touch_the_save(tmp_path, mesh):
    """on_transfer_end deletes the leaf at once, before its write is even submitted: the
    colocated copy must be its own (may_alias=False), also for a leaf already on the colocated
    CPU device (device 0 here) and for whole and sliced shards."""
    cpu = colocated_python.colocated_cpu_devices(jax.devices()[:1])[0]
    tree = {
        "on_colocated_cpu": jax.device_put(random_bits(1, (64, 64)), cpu),             # whole shard, same device
        "sharded": jax.device_put(random_bits(2, (64, 32)), NamedSharding(mesh, P("data", "model"))),
        "split": jax.device_put(random_bits(3, (256, 256)), NamedSharding(mesh, P("data"))),  # 64 KiB shards
        "replicated": jax.device_put(random_bits(4, (32, 32)), NamedSharding(mesh, P())),
        "keys": jax.device_put(jax.random.split(jax.random.key(5), 64), NamedSharding(mesh, P("data"))),
        "host": random_bits(6, (16, 16), np.float64),
    }
    before = numpy_copy(tree)
    leaf_of = {jax.tree_util.keystr((jax.tree_util.DictKey(k),)): x for k, x in tree.items()}
    prio = {k: [dio.Priority.SYNC, dio.Priority.HIGH, dio.Priority.LOW][i % 3] for i, k in enumerate(leaf_of)}
    deleted, written = [], []

    def on_transfer_end(keypath):
        leaf = leaf_of[keypath]
        if isinstance(leaf, jax.Array):
            leaf.delete()
            deleted.append(keypath)

    with dio.ColocatedDispatcher(host_memory_budget=64 * KiB) as d:   # 16 KiB chunks: shards are split
        stats = d.save(tmp_path / "ckpt", tree, priority=lambda k, s: prio[k],
                       on_transfer_end=on_transfer_end, on_write_end=written.append).wait(TIMEOUT)
        assert stats.batches > len(tree) and stats.peak_host_bytes <= 64 * KiB
        assert sorted(deleted) == sorted(k for k, x in leaf_of.items() if isinstance(x, jax.Array))
        assert all(x.is_deleted() for x in leaf_of.values() if isinstance(x, jax.Array))
        assert sorted(written) == sorted(leaf_of)
        restored = d.restore(tmp_path / "ckpt")
    assert numpy_copy(restored) == before


# ---- (f) colocated functions are specialized once, not per save --------------------------------------

def _identity(x):
    return x

def test_repeated_saves_do_not_add_specializations(colocated, tmp_path, mesh, monkeypatch):
    """colocated_python keeps every specialization it makes; one per save would grow without
    bound over a training run. After a first save + restore, saving and restoring the same
    structure again (new values, new paths) must make none: no new reader
    (``workers.colocated.reader`` cache) and no new colocated_python specialization (counted
    through JAX's test-event hook, ``colocated_python_func._get_specialized_func``)."""
    specialized = []
    monkeypatch.setattr(jax._src.util, "test_event_listener",
                        lambda name, *args: specialized.append(name) if "colocated_python" in name else None)
    cpu = colocated_python.colocated_cpu_devices(jax.devices()[:1])[0]
    probe = colocated_python.colocated_python(_identity)
    jax.block_until_ready(probe(jax.device_put(np.zeros(3, np.float32), cpu)))
    assert specialized == ["colocated_python_func._get_specialized_func"], specialized   # the hook sees them
    specialized.clear()

    def make(seed):
        return {"w": jax.device_put(random_bits(seed, (64, 32)), NamedSharding(mesh, P("data", "model"))),
                "b": jax.device_put(random_bits(seed + 1, (32,), ml_dtypes.bfloat16), NamedSharding(mesh, P())),
                "k": jax.random.key(seed), "h": random_bits(seed + 2, (5, 3), np.float64), "step": seed}

    def save_and_restore(step):
        tree = make(step)
        path = tmp_path / f"step_{step}"   # same length: the same request size class
        colocated.save(path, tree).wait(TIMEOUT)
        assert_trees_bit_equal(tree, colocated.restore(path, tree))
        assert_trees_bit_equal(jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array)
                                            and not dio.tree.is_prng_key(x) else x, tree), colocated.restore(path))

    save_and_restore(1)
    readers, made = workers.colocated.reader.cache_info(), len(specialized)
    writers = workers.colocated._write_arrays.cache_info()
    for step in (2, 3, 4):
        save_and_restore(step)
    assert workers.colocated.reader.cache_info().currsize == readers.currsize, (readers, workers.colocated.reader.cache_info())
    assert workers.colocated.reader.cache_info().misses == readers.misses
    assert workers.colocated._write_arrays.cache_info().currsize == writers.currsize == 1
    assert len(specialized) == made, specialized[made:]


def test_requests_of_similar_size_share_one_signature():
    """A request travels as a uint8 array whose length is a power of two (at least 1 KiB), so
    that requests differing by a few bytes (paths, key paths) hit the same specialization."""
    cpu = colocated_python.colocated_cpu_devices(jax.devices()[:1])[0]
    small = [{"path": "/ckpt/step_" + "9" * n, "n": n} for n in range(1, 900, 37)]
    encoded = [workers.colocated.encode_request(r, cpu) for r in small]
    assert {(e.shape, np.dtype(e.dtype)) for e in encoded} == {((1024,), np.dtype(np.uint8))}
    assert [workers.colocated.decode_request(e) for e in encoded] == small
    big = {"path": "x" * 1500}
    assert workers.colocated.encode_request(big, cpu).shape == (2048,)
    assert workers.colocated.decode_request(workers.colocated.encode_request(big, cpu)) == big


@pytest.mark.parametrize("fail_at", [0, 5])
def test_a_failed_array_open_fails_the_save_in_any_lane_naming_its_leaf(tmp_path, mesh, monkeypatch, fail_at):
    """A host that cannot open an array to write it -- in the first batch (0) or once several
    lanes write -- fails the save naming that leaf, and leaves nothing; no batch waits for a lane."""
    import dispatch_io.workers.tensorstore_io
    from dispatch_io import workers

    opened, real_open = [], workers.tensorstore_io.ts.open

    def open_(spec, *args, **kwargs):
        if kwargs.get("assume_metadata"):
            opened.append(spec["kvstore"]["path"].split("/")[-2])
            if len(opened) - 1 == fail_at:
                raise OSError(f"cannot open {opened[-1]}")
        return real_open(spec, *args, **kwargs)

    monkeypatch.setattr(workers.tensorstore_io.ts, "open", open_)
    rng = np.random.default_rng(3)
    tree = {f"w{i}": jax.device_put(rng.standard_normal((64, 8), dtype=np.float32), NamedSharding(mesh, P("data")))
            for i in range(3)}
    with dio.ColocatedDispatcher(host_memory_budget=16 << 10, small_leaf_bytes=0, progress=False) as d:
        with pytest.raises(dio.WorkerError, match="cannot open") as info:
            d.save(tmp_path / "ckpt", tree).wait(60)
    failed = opened[fail_at].split(".")[-1]   # the array's name ends with its key's hint
    assert info.value.keypath == f"['{failed}']", (info.value.keypath, opened)
    assert not (tmp_path / "ckpt").exists()


def test_four_write_threads_write_in_four_lanes_and_round_trip(tmp_path, mesh):
    """Batches in flight write separate databases per host (lanes); with four write threads a
    save of many small batches finishes (no lane is waited for in vain) and restores bit for bit."""
    rng = np.random.default_rng(4)
    tree = {f"w{i}": jax.device_put(rng.standard_normal((128, 16), dtype=np.float32),
                                    NamedSharding(mesh, P("data", "model"))) for i in range(12)}
    with dio.ColocatedDispatcher(host_memory_budget=32 << 10, write_threads=4, small_leaf_bytes=0,
                                 progress=False) as d:
        stats = d.save(tmp_path / "ckpt", tree).wait(60)
        assert stats.batches >= 4
        assert_trees_bit_equal(d.restore(tmp_path / "ckpt", tree), tree)
    lanes = {name.partition(".")[2] for name in os.listdir(tmp_path / "ckpt" / "arrays") if name.startswith("cpu")}
    assert lanes == {"", "1", "2", "3"}, lanes   # the first four batches take the four lanes
