"""Every error dispatch_io raises, each naming the key path it is about."""

import concurrent.futures
import errno
import json
import os
import re
import shutil
import threading

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io.storage import sealed
import dispatch_io.save.driver
import dispatch_io.workers.tensorstore_io
from dispatch_io import workers
import storage_helpers as stored
from conftest import assert_trees_bit_equal, fail_batches_of, hooked_dispatcher, put, random_array

KiB, MiB = 1 << 10, 1 << 20
TIMEOUT = 60


def assert_nothing_at(path):
    """No checkpoint, no partial directory and no temporary sibling left behind."""
    path = os.fspath(path)
    parent, name = os.path.split(path)
    assert not os.path.lexists(path), os.listdir(path) if os.path.isdir(path) else path
    leftovers = [n for n in os.listdir(parent) if name in n] if os.path.isdir(parent) else []
    assert leftovers == [], leftovers


def assert_not_committed(path):
    with dio.LocalDispatcher(host_memory_budget=MiB) as d, \
            pytest.raises((dio.IncompleteCheckpointError, FileNotFoundError)):
        d.restore(path)
    with pytest.raises((dio.IncompleteCheckpointError, FileNotFoundError)):
        dio.metadata(path)
    assert_nothing_at(path)


# ---- 1. budget ----------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [0, -1, -(1 << 20)])
def test_non_positive_budget_is_rejected(dispatcher_cls, budget):
    with pytest.raises(ValueError, match="host_memory_budget"):
        dispatcher_cls(host_memory_budget=budget)


@pytest.mark.parametrize("budget,compression", [(63, None), (255, "zstd")])
def test_a_budget_below_one_staging_slot_is_rejected_up_front(dispatcher_cls, budget, compression):
    """Each chunk takes at least one 64-byte staging slot (a quarter of the budget is staging
    with compression): a smaller budget could never save, so the dispatcher says so."""
    with pytest.raises(ValueError, match=f"host_memory_budget must be at least {budget + 1} bytes"):
        dispatcher_cls(host_memory_budget=budget, compression=compression)
    dispatcher_cls(host_memory_budget=budget + 1, compression=compression).close()


# ---- 2. unsupported leaves ---------------------------------------------------------------------------

def test_unsupported_leaf_names_its_key_path_and_creates_nothing(tmp_path, dispatcher):
    tree = {"a": {"ok": np.ones(3, np.float32), "bad": object()}, "b": 1}
    path = tmp_path / "ckpt"
    with pytest.raises(TypeError) as info:
        dispatcher.save(path, tree)
    assert "['a']['bad']" in str(info.value)
    assert os.listdir(tmp_path) == []
    # Nor does it create missing parent directories.
    with pytest.raises(TypeError, match=r"\['a'\]\['bad'\]"):
        dispatcher.save(tmp_path / "sub" / "ckpt", tree)
    assert os.listdir(tmp_path) == []
    # The dispatcher is still usable.
    good = {"a": {"ok": np.ones(3, np.float32)}, "b": 1}
    dispatcher.save(path, good).wait(TIMEOUT)
    assert_trees_bit_equal(dispatcher.restore(path), good)


class Aliased:
    """A custom node whose two keys print alike: ``.x[0]`` (a key named "x[0]") and ``.x[0]``
    (item 0 of the list under key "x")."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_with_keys(
    Aliased, lambda n: (((jax.tree_util.GetAttrKey("x[0]"), n.a), (jax.tree_util.GetAttrKey("x"), n.b)), None),
    lambda _, children: Aliased(*children))


def test_two_leaves_with_one_key_path_are_refused_before_anything_is_written(tmp_path, dispatcher):
    # Restores match leaves by key path: they once got each other's data.
    tree = {"n": Aliased(np.full(2, 1.0), [np.full(2, 2.0)])}
    with pytest.raises(TypeError, match=re.escape("['n'].x[0]")):
        dispatcher.save(tmp_path / "ckpt", tree)
    assert os.listdir(tmp_path) == []


# ---- 3. overwrite guard --------------------------------------------------------------------------

def test_overwrite_guard(tmp_path, mesh, dispatcher):
    path = tmp_path / "ckpt"
    first = {"w": put(mesh, random_array(0, (16, 8)), "data"), "step": 1}
    second = {"w": put(mesh, random_array(1, (16, 8)), "data"), "step": 2}
    dispatcher.save(path, first).wait(TIMEOUT)
    with pytest.raises(FileExistsError):
        dispatcher.save(path, second)
    assert_trees_bit_equal(dispatcher.restore(path), jax.device_get(first))   # untouched
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    dispatcher.save(path, second, overwrite=True).wait(TIMEOUT)
    assert_trees_bit_equal(dispatcher.restore(path), jax.device_get(second))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]                            # no old copy left


def test_refuses_to_replace_a_foreign_directory(tmp_path, dispatcher):
    path = tmp_path / "mine"
    path.mkdir()
    (path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        dispatcher.save(path, {"x": np.ones(2)})
    assert (path / "notes.txt").read_text() == "keep me"


# ---- 4. restore strictness --------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path, mesh, dispatcher):
    tree = {
        "a": put(mesh, random_array(0, (8, 4)), "data"),
        "b": np.arange(6, dtype=np.int32),
        "c": {"d": put(mesh, random_array(1, (4,)), None), "e": random_array(2, (3, 3))},
        "k": jax.random.key(7),
        "step": 12,
    }
    path = tmp_path / "ckpt"
    dispatcher.save(path, tree).wait(TIMEOUT)
    return path, tree


def test_every_mismatch_reported_at_once(saved, dispatcher):
    path, tree = saved
    meta = dio.metadata(path)
    target = {
        "a": jax.ShapeDtypeStruct((8, 5), np.float32),        # wrong shape
        "b": jax.ShapeDtypeStruct((6,), np.int16),            # wrong dtype (no cast)
        "c": {"e": meta["c"]["e"]},                           # ['c']['d'] missing
        "k": meta["k"],
        "step": 12,
        "z": jax.ShapeDtypeStruct((2,), np.float32),          # not in the checkpoint
    }
    with pytest.raises(dio.TreeMismatchError) as info:
        dispatcher.restore(path, target)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, dio.CheckpointError)
    expected = {"['a']", "['b']", "['c']['d']", "['z']"}
    for keypath in expected:
        assert keypath in str(err), keypath
    assert {k for k, _ in err.problems} == expected
    assert len(err.problems) == 4
    assert "['c']['e']" not in str(err) and "['k']" not in str(err)


def test_partial_restore(saved, dispatcher):
    path, tree = saved
    meta = dio.metadata(path)
    subset = {"c": {"e": np.zeros((3, 3), np.float32)}, "k": meta["k"]}
    out = dispatcher.restore(path, subset, partial=True)
    assert_trees_bit_equal(out, {"c": {"e": tree["c"]["e"]}, "k": tree["k"]})
    with pytest.raises(dio.TreeMismatchError) as info:                     # without partial=True
        dispatcher.restore(path, subset)
    assert {k for k, _ in info.value.problems} == {"['a']", "['b']", "['c']['d']", "['step']"}
    # A target leaf that is not in the checkpoint is an error even with partial=True.
    with pytest.raises(dio.TreeMismatchError) as info:
        dispatcher.restore(path, {**subset, "nope": jax.ShapeDtypeStruct((1,), np.float32)}, partial=True)
    assert [k for k, _ in info.value.problems] == ["['nope']"]
    assert "['nope']" in str(info.value)


def test_dtype_change_needs_cast(saved, dispatcher):
    path, tree = saved
    target = {"b": jax.ShapeDtypeStruct((6,), np.float32)}
    with pytest.raises(dio.TreeMismatchError, match=r"\['b'\]") as info:
        dispatcher.restore(path, target, partial=True)
    assert [k for k, _ in info.value.problems] == ["['b']"]
    out = dispatcher.restore(path, target, partial=True, cast=True)
    assert out["b"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(out["b"]), np.arange(6, dtype=np.float32))
    host = dispatcher.restore(path, {"b": np.zeros(6, np.float64)}, partial=True, cast=True)
    assert isinstance(host["b"], np.ndarray) and host["b"].dtype == np.float64
    np.testing.assert_array_equal(host["b"], np.arange(6, dtype=np.float64))


def test_a_64_bit_device_target_without_x64_is_refused(saved, dispatcher, mesh):
    """A target asking for int64 on devices while jax_enable_x64 is off would come back truncated
    to int32: refused, naming the key path, even with cast=True (a numpy target gets it exact)."""
    path, tree = saved
    on_mesh = NamedSharding(mesh, P())
    target = {"b": jax.ShapeDtypeStruct((6,), np.int64, sharding=on_mesh),
              "step": jax.ShapeDtypeStruct((), np.int64, sharding=on_mesh)}
    with pytest.raises(dio.TreeMismatchError) as info:
        dispatcher.restore(path, target, partial=True, cast=True)
    assert {k for k, _ in info.value.problems} == {"['b']", "['step']"}
    assert "['b']" in str(info.value) and "['step']" in str(info.value)
    host = dispatcher.restore(path, {"b": np.zeros(6, np.int64)}, partial=True, cast=True)
    assert_trees_bit_equal(host, {"b": np.arange(6, dtype=np.int64)})


def test_python_scalars_onto_array_targets_are_checked_like_arrays(tmp_path, dispatcher):
    """A Python scalar onto a 0-d array target: another kind of number (bool, integer, floating,
    complex) needs cast=True; a str, a value out of the dtype's range, NaN as an integer or a
    dropped imaginary part are refused even with it; each problem names its key path."""
    tree = {"name": "llama", "big": 2 ** 40, "lr": 0.7, "flag": True, "z": 1 + 2j, "nan": float("nan"),
            "huge": 1e300, "step": 12, "neg": -3}
    path = tmp_path / "ckpt"
    dispatcher.save(path, tree).wait(TIMEOUT)
    i32, f32, bf16 = (jax.ShapeDtypeStruct((), t) for t in (np.int32, np.float32, jax.numpy.bfloat16))
    target = {"name": i32, "big": np.int32(0), "lr": i32, "flag": i32, "z": f32, "nan": i32, "huge": bf16,
              "step": jax.ShapeDtypeStruct((), np.int16), "neg": jax.ShapeDtypeStruct((), np.uint8)}
    with pytest.raises(dio.TreeMismatchError) as info:
        dispatcher.restore(path, target)
    refused = {"['name']", "['big']", "['lr']", "['flag']", "['z']", "['nan']", "['huge']", "['neg']"}
    assert {k for k, _ in info.value.problems} == refused
    assert all(k in str(info.value) for k in refused)
    with pytest.raises(dio.TreeMismatchError) as info:
        dispatcher.restore(path, target, cast=True)
    assert {k for k, _ in info.value.problems} == {"['name']", "['big']", "['z']", "['nan']", "['huge']", "['neg']"}
    fits = {"lr": i32, "flag": i32, "step": np.int32(0), "neg": jax.ShapeDtypeStruct((), np.int8)}
    out = dispatcher.restore(path, fits, partial=True, cast=True)
    assert_trees_bit_equal(jax.device_get({k: out[k] for k in ("lr", "flag", "neg")}),
                           {"lr": np.array(0, np.int32), "flag": np.array(1, np.int32), "neg": np.array(-3, np.int8)})
    assert type(out["step"]) is np.int32 and out["step"] == 12


def test_python_floats_beyond_narrow_float_dtypes_are_refused(tmp_path, dispatcher):
    """Narrow float dtypes end differently past their largest value (float4/float6 saturate,
    float8_e4m3fn has no inf): none of that passes for a conversion, with or without cast; a
    huge int onto an ml_dtypes float converts, or is refused, never a raw TypeError."""
    tree = {"scale": 1e6, "inf": float("inf"), "nan": float("nan"), "n": 2 ** 64, "tiny_n": 2 ** 64 - 1,
            "real": complex(3, 0), "ok": 6.0}
    path = tmp_path / "ckpt"
    dispatcher.save(path, tree).wait(TIMEOUT)
    of = lambda name: jax.ShapeDtypeStruct((), getattr(ml_dtypes, name))  # noqa: E731
    target = {"scale": of("float4_e2m1fn"), "inf": of("float8_e4m3fn"), "nan": of("float6_e3m2fn"),
              "n": of("bfloat16"), "tiny_n": of("float4_e2m1fn"), "real": jax.ShapeDtypeStruct((), np.float32),
              "ok": of("float4_e2m1fn")}
    for cast in (False, True):
        with pytest.raises(dio.TreeMismatchError) as info:
            dispatcher.restore(path, target, cast=cast)
        refused = {"['scale']", "['inf']", "['nan']", "['tiny_n']"} | (set() if cast else {"['n']", "['real']"})
        assert {k for k, _ in info.value.problems} == refused, info.value.problems
    fits = {k: target[k] for k in ("n", "real", "ok")}
    out = jax.device_get(dispatcher.restore(path, fits, partial=True, cast=True))
    assert_trees_bit_equal(out, {"n": np.array(2.0 ** 64, ml_dtypes.bfloat16), "real": np.array(3, np.float32),
                                 "ok": np.array(6, ml_dtypes.float4_e2m1fn)})


def test_python_numbers_a_narrow_float_turns_into_nan_are_refused(tmp_path, dispatcher):
    """float8_e8m0fnu holds only powers of two, none of them zero or negative: 0.0, -0.0, -1.0 and
    -2 become its NaN -- not the value rounded, so refused (with or without cast), as a value
    beyond the dtype's largest is; a power of two converts."""
    tree = {"zero": 0.0, "minus_zero": -0.0, "neg": -1.0, "neg_int": -2, "ok": 4.0}
    path = tmp_path / "ckpt"
    dispatcher.save(path, tree).wait(TIMEOUT)
    target = {k: jax.ShapeDtypeStruct((), ml_dtypes.float8_e8m0fnu) for k in tree}
    for cast in (False, True):
        with pytest.raises(dio.TreeMismatchError) as info:
            dispatcher.restore(path, target, cast=cast)
        assert {k for k, _ in info.value.problems} == {"['zero']", "['minus_zero']", "['neg']", "['neg_int']"}
    out = jax.device_get(dispatcher.restore(path, {"ok": target["ok"]}, partial=True))
    assert_trees_bit_equal(out, {"ok": np.array(4, ml_dtypes.float8_e8m0fnu)})


def test_python_scalar_targets_are_checked_like_arrays(tmp_path, dispatcher):
    """A Python scalar target of another type: a str never stands for a number nor a number for
    a str; another kind of number needs cast=True and then converts as Python does, where the
    value survives it. Each problem names its key path."""
    tree = {"name": "run-7", "step": 7, "lr": 0.5, "flag": True, "z": 2 + 0j, "w": 1 + 1j, "inf": float("inf"),
            "big": 2 ** 2000}
    path = tmp_path / "ckpt"
    dispatcher.save(path, tree).wait(TIMEOUT)
    same = {"name": "", "step": 0, "lr": 0.0, "flag": False, "z": 0j, "w": 0j, "inf": 0.0, "big": 0}
    assert dispatcher.restore(path, same) == tree                     # same types: the saved values
    target = {"name": 0, "step": "x", "lr": 0, "flag": 2.5, "z": 0.0, "w": 0.0, "inf": 0, "big": 0.0}
    with pytest.raises(dio.TreeMismatchError) as info:
        dispatcher.restore(path, target)
    assert {k for k, _ in info.value.problems} == {f"['{k}']" for k in target}
    with pytest.raises(dio.TreeMismatchError) as info:
        dispatcher.restore(path, target, cast=True)
    assert {k for k, _ in info.value.problems} == {"['name']", "['step']", "['w']", "['inf']", "['big']"}
    fits = {k: target[k] for k in ("lr", "flag", "z")}
    out = dispatcher.restore(path, fits, partial=True, cast=True)
    assert out == {"lr": 0, "flag": 1.0, "z": 2.0}
    assert [type(out[k]) for k in ("lr", "flag", "z")] == [int, float, float]
    # np.float64 subclasses float but is a numpy scalar target: numpy comes back, as for np.float32
    out = dispatcher.restore(path, {"step": np.float64(0), "lr": np.float64(0)}, partial=True, cast=True)
    assert {k: (type(v), v) for k, v in out.items()} == {"step": (np.float64, 7.0), "lr": (np.float64, 0.5)}
    with pytest.raises(dio.TreeMismatchError, match=r"\['step'\].*dtype float64") as info:
        dispatcher.restore(path, {"step": np.float64(0), "lr": np.float64(0)}, partial=True)
    assert [k for k, _ in info.value.problems] == ["['step']"]


def test_an_int_too_long_to_write_fails_the_save_before_anything_is_written(tmp_path, dispatcher):
    """Python writes ints of at most sys.get_int_max_str_digits() digits: a longer one is a
    ValueError naming its key path when save() is called (was: after every array was written)."""
    with pytest.raises(ValueError, match=r"^\['n'\]: this Python int cannot be saved") as info:
        dispatcher.save(tmp_path / "ckpt", {"w": np.ones(4), "n": 10 ** 5000})
    assert not isinstance(info.value, dio.CheckpointError)
    assert os.listdir(tmp_path) == []


def test_key_impl_mismatch(saved, dispatcher):
    path, tree = saved
    rbg = jax.random.key(0, impl="rbg")
    for target in ({"k": rbg}, {"k": jax.ShapeDtypeStruct(rbg.shape, rbg.dtype)}):
        with pytest.raises(dio.TreeMismatchError, match=r"\['k'\]") as info:
            dispatcher.restore(path, target, partial=True)
        assert [k for k, _ in info.value.problems] == ["['k']"]
    # A plain array target for a key leaf (and the other way round) is a mismatch too.
    with pytest.raises(dio.TreeMismatchError, match=r"\['k'\]"):
        dispatcher.restore(path, {"k": jax.ShapeDtypeStruct((), np.uint32)}, partial=True)
    with pytest.raises(dio.TreeMismatchError, match=r"\['a'\]"):
        dispatcher.restore(path, {"a": jax.ShapeDtypeStruct((8, 4), jax.random.key(0).dtype)}, partial=True)
    out = dispatcher.restore(path, {"k": jax.random.key(99)}, partial=True)   # same impl: fine
    assert_trees_bit_equal(out, {"k": tree["k"]})


# ---- 5. incomplete and missing checkpoints --------------------------------------------------------

def test_uncommitted_directories(saved, tmp_path, dispatcher):
    path, tree = saved
    os.remove(path / "COMMITTED")
    with pytest.raises(dio.IncompleteCheckpointError):
        dispatcher.restore(path)
    with pytest.raises(dio.IncompleteCheckpointError):
        dio.metadata(path)

    only_manifest = tmp_path / "only_manifest"
    only_manifest.mkdir()
    shutil.copy(path / "manifest.json", only_manifest / "manifest.json")
    with pytest.raises(dio.IncompleteCheckpointError):
        dispatcher.restore(only_manifest)
    with pytest.raises(dio.IncompleteCheckpointError):
        dio.metadata(only_manifest)

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(dio.IncompleteCheckpointError):
        dispatcher.restore(a_file)

    assert issubclass(dio.IncompleteCheckpointError, dio.CheckpointError)


def test_missing_path(tmp_path, dispatcher):
    with pytest.raises(FileNotFoundError):
        dispatcher.restore(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError):
        dio.metadata(tmp_path / "nothing")


def test_unknown_manifest_version(saved, dispatcher):
    path, _ = saved
    doc = sealed.loads((path / "manifest.json").read_text())   # edited: unsealed
    doc["format_version"] = 99
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(dio.CheckpointError, match="version 99"):
        dispatcher.restore(path)


# ---- 6. a failing write ---------------------------------------------------------------------------

def failing_tree(mesh):
    return {
        "a": put(mesh, random_array(0, (64, 64)), "data", "model"),
        "victim": put(mesh, random_array(1, (128, 64)), "data"),
        "c": random_array(2, (32, 32)),
        "step": 3,
    }


def priority_isolating(victim):
    # A batch never mixes priorities: the victim's batches hold only the victim.
    return lambda keypath, spec: dio.Priority.HIGH if keypath == victim else dio.Priority.SYNC


@pytest.mark.parametrize("layer", ["worker_function", "tensorstore"])
def test_failing_write_names_worker_and_key_path(tmp_path, mesh, monkeypatch, layer, dispatcher_cls):
    victim = "['victim']"
    path = tmp_path / "ckpt"
    hook = None
    if layer == "worker_function":   # the runner's write fails, as a remote worker might
        hook = fail_batches_of(victim)
    else:                            # TensorStore fails inside the real worker function
        real_open = workers.tensorstore_io.Session.open_arrays

        def open_arrays(self, specs, *, write):
            futures = real_open(self, specs, write=write)
            for spec in specs:
                if write and spec.name.endswith(".victim"):
                    futures[spec.name] = failed = concurrent.futures.Future()
                    failed.set_exception(OSError(errno.ENOSPC, "No space left on device"))
            return futures

        monkeypatch.setattr(workers.tensorstore_io.Session, "open_arrays", open_arrays)

    tree = failing_tree(mesh)
    with hooked_dispatcher(dispatcher_cls, hook, host_memory_budget=64 * KiB) as d:
        handle = d.save(path, tree, priority=priority_isolating(victim))
        with pytest.raises(dio.WorkerError) as info:
            handle.wait(TIMEOUT)
        err = info.value
        assert victim in str(err) and "worker 0" in str(err), str(err)
        assert "No space left on device" in str(err)
        assert err.keypath == victim and err.worker == 0
        assert isinstance(err, dio.CheckpointError)
        cause = err
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__
        assert cause is not None and cause.errno == errno.ENOSPC
        assert handle.done()
        with pytest.raises(dio.WorkerError):       # the same error on every wait
            handle.wait(0)
        assert_not_committed(path)

        monkeypatch.undo()
        d.runner.write_hook = None
        d.save(path, tree).wait(TIMEOUT)             # the same dispatcher, the same path
        assert_trees_bit_equal(d.restore(path), jax.device_get(tree))


def test_failing_write_of_a_mixed_batch_names_its_leaves(tmp_path, monkeypatch, dispatcher_cls):
    """A worker failure that names no leaf is attributed to the leaves of the batch it wrote."""
    tree = {"a": np.ones(4, np.float32), "b": np.zeros(4, np.float32)}   # one batch
    with hooked_dispatcher(dispatcher_cls, fail_batches_of("['b']"), host_memory_budget=MiB) as d:
        with pytest.raises(dio.WorkerError) as info:
            d.save(tmp_path / "ckpt", tree, priority=lambda k, s: dio.Priority.LOW).wait(TIMEOUT)
    assert "['a']" in str(info.value) and "['b']" in str(info.value), str(info.value)
    assert info.value.worker == 0
    assert_not_committed(tmp_path / "ckpt")


def test_failure_after_sync_copies_surfaces_from_wait_only(tmp_path, mesh, monkeypatch, dispatcher_cls):
    """Once every SYNC leaf is copied, save() returns a handle even if the save has failed by the
    time the caller's thread wakes up; the error comes from wait()."""
    real_wait = dispatch_io.save.driver.SaveRun.wait_until_sync_copied

    def late_wakeup(run):   # the caller is descheduled until the save has already failed
        run.future.exception(TIMEOUT)
        return real_wait(run)

    monkeypatch.setattr(dispatch_io.save.driver.SaveRun, "wait_until_sync_copied", late_wakeup)
    victim = "['victim']"
    with hooked_dispatcher(dispatcher_cls, fail_batches_of(victim), host_memory_budget=64 * KiB) as d:
        handle = d.save(tmp_path / "ckpt", failing_tree(mesh), priority=priority_isolating(victim))
        assert handle.done()
        with pytest.raises(dio.WorkerError, match=r"\['victim'\]"):
            handle.wait(0)
    assert_not_committed(tmp_path / "ckpt")


def test_failing_read_names_key_path(tmp_path, mesh, dispatcher_cls, layout):
    """The files holding one leaf's chunks are lost (files: its array directory; OCDBT: the data
    files its chunks are packed in, which hold nothing else: it is saved in batches of its own)."""
    tree = {
        "a": put(mesh, random_array(0, (64, 4)), "data"),
        "b": np.arange(60, dtype=np.int32),
        "c": {"d": put(mesh, random_array(1, (64,)), None), "e": random_array(2, (32, 32))},
        "k": jax.random.key(7),
        "step": 12,
    }
    path = tmp_path / "ckpt"
    # One writer thread: batches commit one after the other, so no OCDBT data file mixes two.
    with dispatcher_cls(host_memory_budget=MiB, layout=layout, write_threads=1) as d:
        d.save(path, tree, priority=priority_isolating("['c']['e']")).wait(TIMEOUT)
        assert_trees_bit_equal(d.restore(path), jax.device_get(tree))
        if layout == "files":
            shutil.rmtree(path / "arrays" / stored.stored_name(path, "['c']['e']"))
        else:
            for file in stored.files_holding(path, "['c']['e']"):
                os.remove(file)
        with pytest.raises(dio.WorkerError) as info:
            d.restore(path)
        assert "['c']['e']" in str(info.value) and info.value.keypath == "['c']['e']"
        assert info.value.worker == 0
        # The other leaves still read.
        others = {"a": tree["a"], "c": {"d": tree["c"]["d"]}}
        assert_trees_bit_equal(d.restore(path, others, partial=True), others)


# ---- 7. a failing device -> host copy -----------------------------------------------------------------

def test_deleted_low_leaf_fails_the_copy(tmp_path, mesh, dispatcher_cls):
    tree = {
        "sync": put(mesh, random_array(0, (128, 128)), "data", "model"),
        "high": put(mesh, random_array(1, (128, 128)), "data"),
        "low": put(mesh, random_array(2, (64, 64)), "data"),
    }
    prio = {"['sync']": dio.Priority.SYNC, "['high']": dio.Priority.HIGH, "['low']": dio.Priority.LOW}
    transferred, written = [], []
    deleted = threading.Event()
    waited = []

    def on_transfer_end(keypath):
        transferred.append(keypath)
        if keypath == "['high']":      # hold the pipeline before any LOW batch until the test deleted it
            waited.append(deleted.wait(TIMEOUT))

    path = tmp_path / "ckpt"
    with dispatcher_cls(host_memory_budget=64 * KiB) as d:
        handle = d.save(path, tree, priority=lambda k, s: prio[k],
                        on_transfer_end=on_transfer_end, on_write_end=written.append)
        try:
            assert "['low']" not in transferred
            tree["low"].delete()
        finally:
            deleted.set()
        with pytest.raises(dio.WorkerError) as info:
            handle.wait(TIMEOUT)
        err = info.value
        assert waited == [True]
        assert "['low']" in str(err) and "worker 0" in str(err) and "copying" in str(err), str(err)
        assert err.keypath == "['low']" and err.worker == 0
        # Released once the save failed (a trainer waiting for it to donate must not hang); never written.
        assert sorted(transferred) == ["['high']", "['low']", "['sync']"] and "['low']" not in written
        assert_not_committed(path)
        # Still usable.
        tree["low"] = put(mesh, random_array(2, (64, 64)), "data")
        d.save(path, tree).wait(TIMEOUT)
        assert_trees_bit_equal(d.restore(path), jax.device_get(tree))


def test_deleted_sync_leaf_fails_save_itself(tmp_path, mesh, dispatcher):
    x = put(mesh, random_array(0, (16, 16)), "data")
    x.delete()
    with pytest.raises(dio.WorkerError, match=r"\['params'\]\['x'\]"):
        dispatcher.save(tmp_path / "ckpt", {"params": {"x": x}})
    assert_not_committed(tmp_path / "ckpt")


# ---- 8. a priority callback returning garbage ------------------------------------------------------

@pytest.mark.parametrize("garbage", ["urgent", None, 7, -1, 2.5, object(), 1.0, True, np.bool_(True)])
def test_priority_callback_garbage(tmp_path, dispatcher, garbage):
    tree = {"fine": np.ones(2), "layer": {"w": np.zeros((2, 2), np.float32)}, "step": 1}

    def priority(keypath, spec):
        return garbage if keypath == "['layer']['w']" else dio.Priority.LOW

    with pytest.raises(TypeError, match=r"\['layer'\]\['w'\]"):
        dispatcher.save(tmp_path / "ckpt", tree, priority=priority)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("value", [0, 1, 2, np.int64(2)])
def test_priority_callback_may_return_the_int_of_a_priority(tmp_path, dispatcher, value):
    """Priority is an IntEnum: a plain int equal to one of its values stands for it."""
    tree = {"w": np.arange(4.0), "step": 1}
    dispatcher.save(tmp_path / "ckpt", tree, priority=lambda keypath, spec: value).wait(TIMEOUT)
    assert_trees_bit_equal(dispatcher.restore(tmp_path / "ckpt"), tree)


def test_priority_callback_raising_names_the_key_path(tmp_path, dispatcher):
    tree = {"params": {"w": np.ones(8)}, "opt": np.ones(8)}

    def priority(keypath, spec):
        return {"['params']['w']": dio.Priority.SYNC}[keypath]   # forgot ['opt']

    with pytest.raises(RuntimeError, match=r"the priority callback raised for \['opt'\]: KeyError") as info:
        dispatcher.save(tmp_path / "ckpt", tree, priority=priority)
    assert isinstance(info.value.__cause__, KeyError)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argument", ["priority", "on_transfer_end", "on_write_end"])
@pytest.mark.parametrize("garbage", ["log_it", 42])
def test_non_callable_callbacks_are_refused_up_front(tmp_path, dispatcher, argument, garbage):
    with pytest.raises(TypeError, match=rf"^{argument} must be callable or None, got {garbage!r}$"):
        dispatcher.save(tmp_path / "ckpt", {"x": np.ones(4)}, **{argument: garbage})
    assert os.listdir(tmp_path) == []


# ---- overlapping saves and lost files --------------------------------------------------------

def test_overlapping_saves_to_one_path_never_mix(tmp_path, mesh, dispatcher_cls):
    """A second save to a path whose first save is still writing waits for it, then replaces it."""
    path = tmp_path / "latest"
    first = {"w": put(mesh, random_array(1, (256, 256)), "data", "model")}
    second = {"w": put(mesh, random_array(2, (256, 256)), "data", "model")}
    low = lambda keypath, spec: dio.Priority.LOW  # noqa: E731
    release = threading.Event()
    with dispatcher_cls(host_memory_budget=64 * KiB) as d:
        h1 = d.save(path, first, priority=low, on_transfer_end=lambda k: release.wait(TIMEOUT))
        assert not h1.done()
        threading.Timer(0.2, release.set).start()
        h2 = d.save(path, second, priority=low, overwrite=True)
        h1.wait(TIMEOUT)
        h2.wait(TIMEOUT)
        assert_trees_bit_equal(d.restore(path, second), second)
    leftovers = [n for n in os.listdir(tmp_path) if n != "latest"]
    assert leftovers == [], leftovers


def test_two_dispatchers_saving_one_path_keep_separate_temporaries(tmp_path, mesh, dispatcher_cls):
    """Without overwrite, the save that commits second fails cleanly; the first stays intact."""
    path = tmp_path / "ckpt"
    a = {"w": put(mesh, random_array(3, (256, 256)), "data", "model")}
    b = {"w": put(mesh, random_array(4, (256, 256)), "data", "model")}
    low = lambda keypath, spec: dio.Priority.LOW  # noqa: E731
    gate = threading.Event()
    with dispatcher_cls(host_memory_budget=64 * KiB) as d1, dispatcher_cls(host_memory_budget=64 * KiB) as d2:
        h1 = d1.save(path, a, priority=low, on_transfer_end=lambda k: gate.wait(TIMEOUT))
        h2 = d2.save(path, b, priority=low)
        h2.wait(TIMEOUT)       # commits first
        gate.set()
        with pytest.raises(FileExistsError):
            h1.wait(TIMEOUT)   # finds a committed checkpoint at commit time and backs out
        assert_trees_bit_equal(d1.restore(path, b), b)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_missing_chunk_file_is_an_error_not_zeros(tmp_path, mesh, dispatcher_cls, layout):
    """Every chunk is stored, all-zero ones too, so a chunk missing from storage (files: its file;
    OCDBT: its key in the database) is lost data and reads fail instead of returning zeros."""
    tree = {"w": put(mesh, random_array(5, (64, 64)), "data", "model"),
            "z": put(mesh, np.zeros((64, 64), np.float32), "data", "model")}
    with dispatcher_cls(host_memory_budget=MiB, layout=layout, small_leaf_bytes=0) as d:
        d.save(tmp_path / "ckpt", tree).wait(TIMEOUT)
        assert len(stored.chunks(tmp_path / "ckpt", "['w']")) == 8
        assert len(stored.chunks(tmp_path / "ckpt", "['z']")) == 8   # all-zero chunks are stored too
        if layout == "files":
            chunk_files = [os.path.join(root, n) for root, _, names in os.walk(tmp_path / "ckpt" / "arrays")
                           for n in names if n != "zarr.json"]
            assert len(chunk_files) == 16
        stored.remove_chunk(tmp_path / "ckpt", "['w']", (1, 1))
        stored.remove_chunk(tmp_path / "ckpt", "['z']", (2, 0))
        with pytest.raises(dio.WorkerError, match=r"\['w'\]"):
            d.restore(tmp_path / "ckpt", {"w": tree["w"]}, partial=True)
        with pytest.raises(dio.WorkerError, match=r"\['z'\]"):
            d.restore(tmp_path / "ckpt", {"z": tree["z"]}, partial=True)


def test_saves_to_one_path_from_two_threads_are_serialized(tmp_path, mesh, dispatcher_cls):
    trees = [{"w": put(mesh, random_array(10 + i, (128, 128)), "data", "model")} for i in range(4)]
    low = lambda keypath, spec: dio.Priority.LOW  # noqa: E731
    path = tmp_path / "latest"
    with dispatcher_cls(host_memory_budget=64 * KiB) as d:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            handles = list(pool.map(lambda t: d.save(path, t, priority=low, overwrite=True), trees))
        for h in handles:
            h.wait(TIMEOUT)
        restored = d.restore(path, trees[0])
    assert any(np.asarray(restored["w"]).tobytes() == np.asarray(t["w"]).tobytes() for t in trees)
    assert sorted(os.listdir(tmp_path)) == ["latest"]


@pytest.mark.parametrize("flag", ["partial", "cast"])
def test_partial_or_cast_without_a_target_is_refused(tmp_path, dispatcher, flag):
    """They would mean nothing with target=None (every leaf as saved): never silently ignored."""
    dispatcher.save(tmp_path / "ckpt", {"a": np.ones(4, np.float32)}).wait(TIMEOUT)
    with pytest.raises(ValueError, match=f"{flag}=True needs a target"):
        dispatcher.restore(tmp_path / "ckpt", **{flag: True})


@pytest.mark.parametrize("small_leaf_bytes", [256 << 10, 0], ids=["whole", "per-shard"])
def test_a_deleted_small_leaf_is_named_by_its_key_path(tmp_path, mesh, dispatcher_cls, small_leaf_bytes):
    """A donated / deleted leaf among small sharded ones (copied whole, or per shard): the save
    fails naming that leaf alone."""
    sharding = NamedSharding(mesh, P("data", "model"))
    tree = {f"l{i}": jax.device_put(np.full((8, 8), i, np.float32), sharding) for i in range(5)}
    tree["l3"].delete()
    with dispatcher_cls(host_memory_budget=8 << 20, small_leaf_bytes=small_leaf_bytes) as d:
        with pytest.raises(dio.WorkerError) as info:
            d.save(tmp_path / "ckpt", tree).wait()
    assert info.value.keypath == "['l3']" and "deleted" in str(info.value), info.value
    assert not (tmp_path / "ckpt").exists()


def test_compression_keeps_chunks_within_its_staging_space():
    """With compression a quarter of the budget stages chunks: a chunk limit over half of that
    is refused, naming the option (a chunk must fit in a batch)."""
    assert dio.Options(host_memory_budget=16 << 20, compression="zstd").chunk_bytes <= (16 << 20) // 8
    with pytest.raises(ValueError, match="max_chunk_bytes must be in"):
        dio.Options(host_memory_budget=16 << 20, compression="zstd", max_chunk_bytes=8 << 20)
    dio.Options(host_memory_budget=16 << 20, max_chunk_bytes=8 << 20)   # fine without compression
    with pytest.raises(ValueError, match="small_leaf_bytes"):
        dio.Options(small_leaf_bytes=True)
