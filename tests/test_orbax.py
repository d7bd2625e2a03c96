"""Checkpoints written by real Orbax (orbax-checkpoint, a test dependency only): restore, metadata,
inspect, convert and a CheckpointManager taking over an Orbax-managed run."""

import collections
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import orbax.checkpoint as ocp  # a test dependency only (the test extra): it writes the checkpoints we read

import dispatch_io as dio
from conftest import assert_trees_bit_equal, host_bytes
import storage_helpers as stored
from dispatch_io.jax_compat import single_device_sharding


# Orbax's own restore without shardings warns that it reads them from the checkpoint: expected here.
pytestmark = pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def make_state(mesh):
    """Every kind of leaf Orbax saves, sharded 4x2 where it can be."""
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    return {
        "params": {"w": put(jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16) / 7, "data", "model"),
                   "b": put(jnp.linspace(-1, 1, 16, dtype=jnp.bfloat16), None),
                   "emb": put(jnp.arange(8 * 6, dtype=jnp.int8).reshape(8, 6), "data")},
        "layers": [put(jnp.full((4, 2), 3, jnp.int32), None, "model"), np.arange(5, dtype=np.int16)],
        "pair": (jnp.ones((3,), jnp.float16), jnp.uint8(7)),
        "rng": jax.random.key(1),
        "rbg": jax.random.key(2, impl="rbg"),
        "raw_key": jax.random.PRNGKey(3),
        "step": 1200, "lr": 0.25, "done": False, "name": "llama",
        "empty": {}, "nothing": None, "no_list": [], "no_tuple": (),
        "a.b": jnp.zeros((3,), jnp.float32),   # a dot inside a dict key
        "by_int": {1: jnp.ones((2, 2)), 2: jnp.zeros((2,))},
    }


VARIANTS = {  # name -> PyTreeCheckpointHandler options
    "ocdbt-zarr2": dict(use_ocdbt=True, use_zarr3=False),   # the v0 API's defaults
    "ocdbt-zarr3": dict(use_ocdbt=True, use_zarr3=True),    # the v1 API's defaults
    "files-zarr2": dict(use_ocdbt=False, use_zarr3=False),
    "files-zarr3": dict(use_ocdbt=False, use_zarr3=True),
}


@pytest.fixture(scope="session")
def orbax_ckpts(tmp_path_factory, mesh):
    """{variant: path} of the same state saved by Orbax in every format variant."""
    root = tmp_path_factory.mktemp("orbax")
    state = make_state(mesh)
    out = {}
    for name, kwargs in VARIANTS.items():
        path = root / name
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**kwargs)) as ckptr:
            ckptr.save(path, args=ocp.args.PyTreeSave(state))
        out[name] = str(path)
    return state, out


@pytest.fixture(params=list(VARIANTS))
def variant(request):
    return request.param


def orbax_restore(path):
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        return ckptr.restore(path)


def test_restore_without_target_is_what_orbax_restores(orbax_ckpts, variant, dispatcher):
    """The tree Orbax itself restores (structure, int dict keys as strings, sequences as lists,
    Python scalar types, key impls) with the same bytes; arrays as numpy."""
    _, paths = orbax_ckpts
    ours = dispatcher.restore(paths[variant])
    theirs = jax.tree_util.tree_map(lambda x: np.asarray(x) if isinstance(x, jax.Array) and
                                    not dio.tree.is_prng_key(x) else x, orbax_restore(paths[variant]))
    assert_trees_bit_equal(ours, theirs)
    assert isinstance(ours["params"]["w"], np.ndarray) and ours["step"] == 1200 and type(ours["done"]) is bool
    assert set(ours["by_int"]) == {"1", "2"} and isinstance(ours["pair"], list)


def test_restore_onto_the_saved_mesh_another_mesh_one_device_and_numpy(orbax_ckpts, dispatcher_cls, mesh):
    state, paths = orbax_ckpts
    path = paths["ocdbt-zarr2"]
    arrays = {"params": state["params"], "rng": state["rng"], "rbg": state["rbg"]}
    with dispatcher_cls(host_memory_budget=1 * MiB, progress=False) as d:
        # metadata carries the saved shardings: restoring onto it restores where Orbax saved
        saved = d.restore(path, dio.metadata(path), partial=False)
        assert saved["params"]["w"].sharding == state["params"]["w"].sharding
        assert_trees_bit_equal({k: saved[k] for k in arrays}, arrays)
        other = jax.make_mesh((2, 4), ("data", "model"))
        target = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
                other, P(*(["model", "data"][:x.ndim])) if x.ndim and not dio.tree.is_prng_key(x) else P())),
            arrays)
        moved = d.restore(path, target, partial=True)
        assert moved["params"]["w"].sharding.mesh.shape == {"data": 2, "model": 4}
        assert_trees_bit_equal(moved, arrays)
        one = single_device_sharding(jax.devices()[5])
        single = d.restore(path, jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), arrays), partial=True)
        assert single["params"]["w"].sharding == one
        assert_trees_bit_equal(single, arrays)
        host = d.restore(path, {"params": jax.tree_util.tree_map(
            lambda x: np.zeros(x.shape, x.dtype), state["params"])}, partial=True)
        assert isinstance(host["params"]["w"], np.ndarray)
        assert_trees_bit_equal(host, {"params": state["params"]})


def test_metadata_describes_the_orbax_tree(orbax_ckpts, mesh):
    state, paths = orbax_ckpts
    meta = dio.metadata(paths["files-zarr3"])
    w = meta["params"]["w"]
    assert (w.shape, w.dtype, w.sharding) == ((64, 16), jnp.float32, state["params"]["w"].sharding)
    assert meta["rng"].dtype == state["rng"].dtype and meta["rng"].shape == ()
    assert meta["rbg"].dtype == state["rbg"].dtype
    assert meta["raw_key"].dtype == jnp.uint32 and meta["raw_key"].shape == (2,)
    assert (meta["step"], meta["lr"], meta["done"], meta["name"]) == (1200, 0.25, False, "llama")
    assert meta["empty"] == {} and meta["nothing"] is None and meta["no_list"] == [] and meta["no_tuple"] == ()
    assert meta["a.b"].shape == (3,)


def test_strict_validation_names_every_key_path_and_partial_cast_work(orbax_ckpts, dispatcher):
    path = orbax_ckpts[1]["ocdbt-zarr3"]
    meta = dio.metadata(path)
    bad = dict(meta)
    bad["params"] = dict(meta["params"], w=jax.ShapeDtypeStruct((64, 17), jnp.float32), extra=jax.ShapeDtypeStruct((1,), jnp.float32))
    bad["lr"] = jax.ShapeDtypeStruct((2,), jnp.float32)
    del bad["rng"]
    with pytest.raises(dio.TreeMismatchError) as err:
        dispatcher.restore(path, bad)
    found = {k for k, _ in err.value.problems}
    assert found == {"['params']['w']", "['params']['extra']", "['lr']", "['rng']"}
    cast = dispatcher.restore(path, {"params": {"w": jax.ShapeDtypeStruct((64, 16), jnp.bfloat16)}},
                              partial=True, cast=True)
    expect = np.asarray(orbax_ckpts[0]["params"]["w"]).astype(jnp.bfloat16)
    assert host_bytes(cast["params"]["w"]) == expect.tobytes()


def test_a_step_directory_with_one_item_and_errors_for_the_rest(tmp_path, orbax_ckpts, dispatcher):
    state, paths = orbax_ckpts
    step = tmp_path / "1200"
    shutil.copytree(paths["ocdbt-zarr2"], step / "default")
    assert dispatcher.restore(step)["step"] == 1200                  # the one item
    shutil.copytree(paths["files-zarr2"], step / "ema")
    with pytest.raises(dio.CheckpointError, match="2 items .default, ema."):
        dispatcher.restore(step)
    assert dispatcher.restore(step / "ema")["step"] == 1200
    tmp = tmp_path / "1300.orbax-checkpoint-tmp-1234"                 # never finalized by Orbax
    shutil.copytree(paths["ocdbt-zarr2"], tmp / "default")
    for target in (tmp, tmp / "default"):
        with pytest.raises(dio.IncompleteCheckpointError, match="never committed"):
            dio.metadata(target)
    unfinished = tmp_path / "1400"                                    # step metadata without a commit time
    shutil.copytree(paths["ocdbt-zarr2"], unfinished / "default")
    (unfinished / "_CHECKPOINT_METADATA").write_text(json.dumps({"commit_timestamp_nsecs": None}))
    with pytest.raises(dio.IncompleteCheckpointError):
        dispatcher.restore(unfinished)
    (tmp_path / "neither").mkdir()
    with pytest.raises(dio.IncompleteCheckpointError, match="no COMMITTED marker"):
        dispatcher.restore(tmp_path / "neither")


def test_open_ours_reads_our_checkpoint_without_detection_and_refuses_an_orbax_one(tmp_path, orbax_ckpts, mesh,
                                                                                    dispatcher, monkeypatch):
    """``open_ours`` (a caller that knows it wrote the step): the same manifest as ``open_checkpoint``
    for a checkpoint of ours, with the Orbax and safetensors detection never run; an Orbax
    checkpoint is not read as one but refused for lacking our commit marker."""
    from dispatch_io.formats import detect, safetensors

    state = {"params": make_state(mesh)["params"], "step": 3}
    dispatcher.save(tmp_path / "ours", state).wait()
    detected = detect.open_checkpoint(tmp_path / "ours")

    def never(*args):
        raise AssertionError("detection ran")

    monkeypatch.setattr(detect, "orbax_item", never)
    monkeypatch.setattr(safetensors, "find", never)
    opened = detect.open_ours(tmp_path / "ours")
    assert opened.manifest == detected.manifest and opened.arrays == detected.arrays
    opened.check_unchanged()
    with pytest.raises(dio.IncompleteCheckpointError, match="no COMMITTED marker"):
        detect.open_ours(orbax_ckpts[1]["ocdbt-zarr2"])


def test_a_checkpoint_of_orbax_v1_api(tmp_path, mesh, dispatcher):
    """orbax.checkpoint's v1 API (experimental in 0.12) writes a step directory with one item, ``state``."""
    from orbax.checkpoint.experimental import v1 as ocp_v1

    state = {"params": make_state(mesh)["params"], "rng": jax.random.key(4), "step": 9}
    ocp_v1.save(tmp_path / "v1", state)
    restored = dispatcher.restore(tmp_path / "v1", dio.metadata(tmp_path / "v1"))
    assert restored["params"]["w"].sharding == state["params"]["w"].sharding
    assert_trees_bit_equal(restored, state)


def test_a_lost_orbax_chunk_is_an_error_naming_the_leaf(tmp_path, orbax_ckpts, dispatcher):
    path = tmp_path / "ckpt"
    shutil.copytree(orbax_ckpts[1]["files-zarr2"], path)
    os.remove(path / "params.w" / "1.0")
    with pytest.raises(dio.WorkerError, match=r"\['params'\]\['w'\]"):
        dispatcher.restore(path)


def test_manager_takes_over_an_orbax_run(tmp_path, mesh):
    """Orbax steps are listed and restored; new steps are ours; retention never deletes Orbax's."""
    root = tmp_path / "run"
    state = {"params": make_state(mesh)["params"], "step": 0}
    with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=5)) as orbax_mgr:
        for step in (10, 20):
            orbax_mgr.save(step, args=ocp.args.StandardSave(dict(state, step=step)))
        orbax_mgr.wait_until_finished()
    leftover = root / "30.orbax-checkpoint-tmp-99"    # an Orbax save killed mid-way
    shutil.copytree(root / "20", leftover)
    with dio.CheckpointManager(root, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [10, 20] and mgr.latest_step() == 20
        restored = mgr.restore(target=mgr.metadata())
        assert restored["step"] == 20
        assert_trees_bit_equal(restored["params"], state["params"])
        with pytest.raises(FileExistsError):
            mgr.save(20, restored)                     # never over an Orbax step
        for step in (21, 22, 23):
            mgr.save(step, dict(restored, step=step)).wait()
        mgr.wait()
        assert mgr.all_steps() == [10, 20, 22, 23]   # 21 (ours) dropped; Orbax's 10 and 20 kept
        assert mgr.restore(22)["step"] == 22
    assert leftover.is_dir() and (root / "10" / "default").is_dir()


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "dispatch_io.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env=env)


def test_cli_inspect_convert_verify(tmp_path, orbax_ckpts):
    state, paths = orbax_ckpts
    src = paths["ocdbt-zarr3"]
    shown = cli("inspect", src)
    assert shown.returncode == 0, shown.stderr
    assert "written by Orbax" in shown.stdout and "['params']['w']" in shown.stdout
    assert "P(data, model) on mesh(data=4, model=2)" in shown.stdout
    doc = json.loads(cli("inspect", src, "--json").stdout)
    assert doc["format"] == "orbax" and len(doc["leaves"]) == len(jax.tree_util.tree_leaves(dio.metadata(src)))
    dst = tmp_path / "converted"
    done = cli("convert", src, dst, "--budget-mib", "1", "--layout", "files")
    assert done.returncode == 0, done.stderr
    assert cli("verify", dst).returncode == 0
    again = cli("convert", src, dst)
    assert again.returncode == 2 and "already committed" in again.stderr
    missing = cli("convert", tmp_path / "nope", tmp_path / "out")
    assert missing.returncode == 2 and not (tmp_path / "out").exists()


def test_convert_keeps_everything_and_a_failure_commits_nothing(tmp_path, orbax_ckpts, variant, layout):
    state, paths = orbax_ckpts
    dst = tmp_path / "ours"
    with dio.LocalDispatcher(host_memory_budget=4 << 10, layout=layout, progress=False) as d:
        stats = d.convert(paths[variant], dst)
        assert stats.batches > 1 and dio.metadata(dst).keys() == dio.metadata(paths[variant]).keys()
        assert_trees_bit_equal(d.restore(dst), d.restore(paths[variant]))
        assert d.verify(dst).bytes_read == stats.bytes_written
        shown = json.loads(cli("inspect", dst, "--json").stdout)
        sharding = next(r["sharding"] for r in shown["leaves"] if r["keypath"] == "['params']['w']")
        assert sharding == {"type": "NamedSharding", "mesh": {"data": 4, "model": 2}, "spec": ["data", "model"]}
        broken = tmp_path / "broken"
        shutil.copytree(paths["files-zarr2"], broken)
        os.remove(broken / "params.emb" / "2.0")
        with pytest.raises(dio.CheckpointError, match=r"\['params'\]\['emb'\]"):
            d.convert(broken, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    assert not [n for n in os.listdir(tmp_path) if "never" in n]  # no temporary directory left either


RSS_SCRIPT = """
import json, sys
import jax, numpy as np
import dispatch_io as dio
jax.devices()
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
with dio.LocalDispatcher(host_memory_budget=8 << 20, progress=False) as d:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    if sys.argv[1] == "restore":
        out = d.restore(sys.argv[2])
        assert out["big"].shape == (32 << 20,)
    else:
        d.convert(sys.argv[2], sys.argv[3])
    print(json.dumps({"growth": status("VmHWM") - before}))
"""


def test_restore_and_convert_of_a_large_orbax_leaf_stay_within_the_budget(tmp_path, mesh):
    """A 128 MiB leaf (Orbax chunks of at most 4 MiB, its ``chunk_byte_size``) through an 8 MiB
    budget, peak RSS from the OS: restore holds the result + budget + 64 MiB, convert the
    budget + 64 MiB (the bound of a save)."""
    big = jax.device_put(jnp.arange(32 * MiB, dtype=jnp.float32), NamedSharding(mesh, P(("data", "model"))))
    src = tmp_path / "orbax_big"
    tree = {"big": big, "step": 1}
    save_args = jax.tree_util.tree_map(lambda _: ocp.SaveArgs(chunk_byte_size=4 * MiB), tree)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        ckptr.save(src, args=ocp.args.PyTreeSave(tree, save_args=save_args))
    assert dio.metadata(src)["big"].shape == (32 * MiB,)
    del big
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    growth = {}
    for mode, args in (("restore", [src]), ("convert", [src, tmp_path / "converted"])):
        proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, mode, *map(str, args)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        growth[mode] = json.loads(proc.stdout.strip().splitlines()[-1])["growth"]
    assert growth["restore"] < 128 * MiB + 8 * MiB + 64 * MiB, growth
    assert growth["convert"] < 8 * MiB + 64 * MiB, growth


def orbax_save(path, tree, **kwargs):
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**kwargs)) as ckptr:
        ckptr.save(path, args=ocp.args.PyTreeSave(tree))
    return path


def test_corner_cases_of_the_orbax_tree(tmp_path, mesh, dispatcher):
    """Sharded PRNG keys (Orbax records their key_data's sharding), a bare array or scalar as the
    whole tree, a lost scalar chunk, and two leaves whose joined names collide."""
    keys = {"rng": jax.device_put(jax.random.key(0), NamedSharding(mesh, P())),
            "split": jax.device_put(jax.random.split(jax.random.key(1), 4), NamedSharding(mesh, P("data")))}
    path = orbax_save(tmp_path / "keys", keys)
    meta = dio.metadata(path)
    assert meta["split"].sharding == keys["split"].sharding and meta["rng"].sharding == keys["rng"].sharding
    assert_trees_bit_equal(dispatcher.restore(path, meta), keys)
    dispatcher.convert(path, tmp_path / "keys_converted")
    assert_trees_bit_equal(dispatcher.restore(tmp_path / "keys_converted", keys), keys)

    bare = orbax_save(tmp_path / "bare", jnp.arange(3.0))
    assert host_bytes(dispatcher.restore(bare)) == np.arange(3, dtype=np.float32).tobytes()

    lost = orbax_save(tmp_path / "lost", {"s": 7, "x": jnp.ones(2)}, use_ocdbt=False)
    assert dispatcher.restore(lost)["s"] == 7
    os.remove(lost / "s" / "0")
    with pytest.raises(dio.CheckpointError, match=r"\['s'\]"):
        dispatcher.restore(lost)

    clash = orbax_save(tmp_path / "clash", {"a.b": {"c": jnp.ones(2)}, "a": {"b.c": jnp.zeros(2)}}, use_ocdbt=False)
    with pytest.raises(dio.CheckpointError, match="both stored as 'a.b.c'"):
        dio.metadata(clash)


AdamState = collections.namedtuple("AdamState", ["count", "mu", "nu"])   # as optax's ScaleByAdamState


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:   # as flax.struct / a registered dataclass
    step: jax.Array
    params: dict
    opt_state: tuple


def test_a_target_of_namedtuples_dataclasses_and_int_keys_restores_as_orbax_does(tmp_path, mesh, dispatcher):
    """Orbax stores attributes, NamedTuple fields and int dict keys by name (``['opt_state'][0]
    ['count']``, ``['1']``); a target holding them matches by those names, as Orbax's restore
    does, and comes back in the target's structure with Orbax's bytes."""
    w = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("data", "model")))
    state = TrainState(step=jnp.int32(3), params={"w": w, "layers": {0: jnp.ones(2), 1: jnp.zeros(2)}},
                       opt_state=(AdamState(jnp.int32(1), {"w": w * 2}, {"w": w + 1}),))
    path = tmp_path / "state"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, state)
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
    with ocp.StandardCheckpointer() as ckptr:
        theirs = ckptr.restore(path, abstract)
    ours = dispatcher.restore(path, abstract)
    assert isinstance(ours, TrainState) and isinstance(ours.opt_state[0], AdamState)
    assert set(ours.params["layers"]) == {0, 1}
    assert ours.params["w"].sharding == w.sharding
    assert_trees_bit_equal(ours, theirs)
    assert_trees_bit_equal(dispatcher.restore(path, state), theirs)   # concrete arrays as target too

    # Problems name the target's key paths; the checkpoint's own names only for leaves the target lacks.
    bad = dataclasses.replace(abstract, opt_state=(abstract.opt_state[0]._replace(
        count=jax.ShapeDtypeStruct((2,), jnp.int32)),), params={"w": abstract.params["w"]})
    with pytest.raises(dio.TreeMismatchError) as err:
        dispatcher.restore(path, bad)
    assert dict(err.value.problems).keys() == {".opt_state[0].count", "['params']['layers']['0']",
                                                "['params']['layers']['1']"}
    assert "shape mismatch" in dict(err.value.problems)[".opt_state[0].count"]

    # Converted into our format, it still takes the targets the Orbax checkpoint took (its
    # manifest says its keys match by name); a second conversion keeps that.
    dispatcher.convert(path, tmp_path / "converted")
    dispatcher.convert(tmp_path / "converted", tmp_path / "again")
    assert stored.manifest(tmp_path / "again")["keys"] == "names"
    for converted in ("converted", "again"):
        restored = dispatcher.restore(tmp_path / converted, abstract)
        assert isinstance(restored, TrainState) and set(restored.params["layers"]) == {0, 1}
        assert_trees_bit_equal(restored, theirs)


def test_a_manager_restores_an_orbax_step_onto_a_dataclass_target(tmp_path):
    root = tmp_path / "run"
    state = TrainState(step=jnp.int32(7), params={"w": jnp.arange(4.0)},
                       opt_state=(AdamState(jnp.int32(2), {"w": jnp.ones(4)}, {"w": jnp.zeros(4)}),))
    with ocp.CheckpointManager(root) as orbax_mgr:
        orbax_mgr.save(7, args=ocp.args.StandardSave(state))
        orbax_mgr.wait_until_finished()
    with dio.CheckpointManager(root) as mgr:
        restored = mgr.restore(target=jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state))
    assert isinstance(restored, TrainState)
    assert_trees_bit_equal(restored, state)


def test_our_own_checkpoints_still_match_key_paths_exactly(tmp_path, dispatcher):
    """Orbax's naming is for Orbax checkpoints only: ours keep int keys and attributes apart."""
    state = {"layers": {0: np.ones(2, np.float32)}}
    dispatcher.save(tmp_path / "ours", state).wait()
    with pytest.raises(dio.TreeMismatchError) as err:
        dispatcher.restore(tmp_path / "ours", {"layers": {"0": np.ones(2, np.float32)}})
    assert dict(err.value.problems) == {"['layers']['0']": "not in the checkpoint",
                                        "['layers'][0]": "in the checkpoint but not in the target "
                                                         "(pass partial=True to skip it)"}


@pytest.mark.parametrize("naming", [dict(step_prefix="ckpt"), dict(step_format_fixed_length=8),
                                    dict(step_prefix="run_a", step_format_fixed_length=4)],
                         ids=["prefix", "fixed_length", "both"])
def test_a_manager_over_orbax_steps_of_other_names(tmp_path, naming):
    """``ckpt_100``, ``00000100``, ``run_a_0100``: listed and restored as Orbax restores them; a
    step Orbax holds is never saved a second time under our name; two holders are an error."""
    root = tmp_path / "run"
    options = ocp.CheckpointManagerOptions(**naming)
    with ocp.CheckpointManager(root, options=options) as orbax_mgr:
        for step in (100, 200):
            orbax_mgr.save(step, args=ocp.args.StandardSave({"w": jnp.arange(4.0) * step, "step": step}))
        orbax_mgr.wait_until_finished()
        theirs = orbax_mgr.restore(200, args=ocp.args.StandardRestore())
    names = sorted(os.listdir(root))
    with dio.CheckpointManager(root, max_to_keep=1) as mgr:
        assert mgr.all_steps() == [100, 200] and mgr.latest_step() == 200
        assert mgr.step_path(200) == str(root / names[1])
        assert_trees_bit_equal(mgr.restore(target=mgr.metadata()), theirs)
        for overwrite in (False, True):
            with pytest.raises(FileExistsError, match=names[1]):
                mgr.save(200, theirs, overwrite=overwrite)
        assert sorted(os.listdir(root)) == names                  # no second step 200
        mgr.save(300, dict(theirs, step=300)).wait()
        mgr.wait()
        assert mgr.all_steps() == [100, 200, 300] and mgr.restore()["step"] == 300
        shutil.copytree(root / names[1], root / "200")           # e.g. left by an older dispatch_io
        for call in (mgr.restore, lambda step: mgr.save(step, theirs)):
            with pytest.raises(dio.CheckpointError, match=f"step 200 is held by 2 directories .*200, {names[1]}"):
                call(200)


def test_a_manager_lists_orbax_steps_of_several_items_and_restores_them_by_name(tmp_path, mesh):
    root = tmp_path / "run"
    state = {"w": jnp.ones((4,))}
    with ocp.CheckpointManager(root, item_names=("params", "opt")) as orbax_mgr:
        orbax_mgr.save(5, args=ocp.args.Composite(params=ocp.args.StandardSave(state),
                                                  opt=ocp.args.StandardSave(state)))
        orbax_mgr.wait_until_finished()
    with dio.CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [5]
        with pytest.raises(dio.CheckpointError, match=r"Orbax step with 2 items \(opt, params\)"):
            mgr.restore(5, state)       # two PyTree items: name one
        assert_trees_bit_equal(mgr.restore(5, state, item="params"), state)
        assert_trees_bit_equal(mgr.dispatcher.restore(root / "5" / "params", state), state)
