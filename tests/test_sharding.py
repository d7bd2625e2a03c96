"""dio.sharding: tactics, rule matching, conflicts, and restores onto meshes built from rules."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dispatch_io as dio
from conftest import assert_trees_bit_equal
from dispatch_io.sharding import fsdp, infer, replicate, shard
from test_examples import run_example

F32 = jnp.float32


def abstract(*shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def spec_of(leaf, mesh, rules):
    """The PartitionSpec ``infer`` picks for a tree holding just ``leaf`` under the key 'x'."""
    return infer({"x": leaf}, mesh, rules)["x"].sharding.spec


def assert_refused(tree, mesh, rules, *fragments):
    with pytest.raises(ValueError) as info:
        infer(tree, mesh, rules)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


# ---- matching -------------------------------------------------------------------------------

def test_unmatched_leaves_are_replicated_and_non_arrays_kept(mesh):
    tree = {"w": abstract(8, 4), "n": np.zeros((2, 3), np.int32), "a": jnp.ones(4), "g": np.float32(1),
            "k": jax.random.key(0), "step": 7, "lr": 0.5, "name": "adam", "none": None, "empty": {}, "t": (1, abstract(2))}
    out = infer(tree, mesh)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for key in ("step", "lr", "name", "none", "empty"):
        assert out[key] == tree[key]
    assert out["t"][0] == 1
    for leaf, original in [(out["w"], tree["w"]), (out["n"], tree["n"]), (out["a"], tree["a"]), (out["g"], tree["g"]),
                           (out["k"], tree["k"]), (out["t"][1], tree["t"][1])]:
        assert isinstance(leaf, jax.ShapeDtypeStruct)
        assert (leaf.shape, leaf.dtype) == (original.shape, original.dtype)
        assert leaf.sharding == NamedSharding(mesh, P())


def test_patterns_search_the_slash_path_and_the_first_match_wins(mesh):
    tree = {"params": {"layer0": {"w": abstract(8, 4), "b": abstract(4)}, "embed": abstract(16, 6)},
            "opt": [abstract(8, 4), abstract(8)]}
    rules = [(r"^params/layer\d+/w$", shard("data", "model")),
             (r"embed", shard("data")),
             (r"^opt/1$", shard("model")),
             (r"w$", replicate()),       # never reached for params/layer0/w
             (r"^nothing$", shard("x"))]  # matches no leaf: not an error, never run
    out = infer(tree, mesh, rules)
    assert out["params"]["layer0"]["w"].sharding.spec == P("data", "model")
    assert out["params"]["layer0"]["b"].sharding.spec == P()
    assert out["params"]["embed"].sharding.spec == P("data")
    assert out["opt"][0].sharding.spec == P()
    assert out["opt"][1].sharding.spec == P("model")


def test_rules_may_be_a_dict_and_shardings_of_the_input_are_ignored(mesh):
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", "model")))
    out = infer({"x": x}, mesh, {"y": shard("data"), "x": shard(None, "model")})
    assert out["x"].sharding.spec == P(None, "model")


# ---- tactics --------------------------------------------------------------------------------

def test_fsdp_shards_the_largest_divisible_free_dimension(mesh):
    small = dict(min_bytes=0)
    assert spec_of(abstract(6, 16, 8), mesh, [("x", fsdp("data", **small))]) == P(None, "data")
    assert spec_of(abstract(8, 8), mesh, [("x", fsdp("data", **small))]) == P("data")         # ties: first
    assert spec_of(abstract(6, 3), mesh, [("x", fsdp("data", **small))]) == P()              # none divisible
    assert spec_of(abstract(6, 24), mesh, [("x", fsdp(("data", "model"), **small))]) == P(None, ("data", "model"))
    assert spec_of(abstract(12, 8), mesh, [("x", fsdp(("data", "model"), **small))]) == P(None, ("data", "model"))
    assert spec_of(abstract(), mesh, [("x", fsdp("data", **small))]) == P()                   # 0-d


def test_fsdp_leaves_small_leaves_replicated(mesh):
    assert spec_of(abstract(512, 512), mesh, [("x", fsdp("data"))]) == P()                    # 1 MiB < 4 MiB default
    assert spec_of(abstract(1024, 1024), mesh, [("x", fsdp("data"))]) == P("data")            # exactly 4 MiB
    assert spec_of(abstract(256, 2, dtype=jnp.bfloat16), mesh, [("x", fsdp("data", min_bytes=1024))]) == P("data")
    assert spec_of(abstract(255, 2, dtype=jnp.bfloat16), mesh, [("x", fsdp("data", min_bytes=1024))]) == P()


def test_a_sequence_of_tactics_composes_in_order(mesh):
    both = [fsdp("data", min_bytes=0), fsdp("model", min_bytes=0)]
    assert spec_of(abstract(16, 8), mesh, [("x", both)]) == P("data", "model")
    assert spec_of(abstract(8, 16), mesh, [("x", both)]) == P("model", "data")
    assert spec_of(abstract(16, 3), mesh, [("x", both)]) == P("data")                         # model: nothing left
    assert spec_of(abstract(6, 8), mesh, [("x", [shard(None, "data"), fsdp("model", min_bytes=0)])]) == P("model", "data")
    assert spec_of(abstract(8, 6), mesh, [("x", [shard("data"), shard("data", "model")])]) == P("data", "model")


def test_shard_takes_entries_or_a_partition_spec(mesh):
    assert spec_of(abstract(8, 4, 2), mesh, [("x", shard("data"))]) == P("data")
    assert spec_of(abstract(8, 4, 2), mesh, [("x", shard(P(None, None, "model")))]) == P(None, None, "model")
    assert spec_of(abstract(8, 4), mesh, [("x", shard(("data", "model")))]) == P(("data", "model"))
    assert spec_of(abstract(8, 4), mesh, [("x", replicate())]) == P()


def test_prng_keys_shard_by_their_logical_shape(mesh):
    keys = jax.random.split(jax.random.key(0), 8)
    out = infer({"keys": keys, "rng": jax.random.key(1)}, mesh,
                [("keys", shard("data")), ("rng", fsdp("data", min_bytes=0))])
    assert out["keys"].shape == (8,) and jax.dtypes.issubdtype(out["keys"].dtype, jax.dtypes.prng_key)
    assert out["keys"].sharding.spec == P("data")
    assert out["rng"].sharding.spec == P()
    # min_bytes counts the key data: 8 threefry keys are 64 bytes.
    assert spec_of(keys, mesh, [("x", fsdp("data", min_bytes=64))]) == P("data")
    assert spec_of(keys, mesh, [("x", fsdp("data", min_bytes=65))]) == P()


# ---- conflicts ------------------------------------------------------------------------------

def test_one_dimension_sharded_twice_is_refused(mesh):
    assert_refused({"p": {"w": abstract(8, 4)}}, mesh, [("w", [shard("data"), shard("model")])],
                   "['p']['w']", "dimension 0", "'data'", "'model'", "rule 'w'")


def test_a_mesh_axis_used_twice_is_refused(mesh):
    assert_refused({"p": {"w": abstract(8, 8)}}, mesh, [("w", [fsdp("data", min_bytes=0), fsdp("data", min_bytes=0)])],
                   "['p']['w']", "mesh axis 'data'", "dimension 0 and dimension 1")
    assert_refused({"w": abstract(8, 8)}, mesh, [("w", shard("data", ("model", "data")))], "['w']", "mesh axis 'data'")


def test_an_indivisible_dimension_is_refused(mesh):
    assert_refused({"layers": [abstract(6, 4)]}, mesh, [("layers", shard("data"))],
                   "['layers'][0]", "dimension 0 (size 6)", "'data' (size 4)", "shape (6, 4)")
    assert_refused({"b": abstract(12)}, mesh, [("b", shard(("data", "model")))], "['b']", "(size 8)")


def test_replicate_after_sharding_is_refused(mesh):
    assert_refused({"w": abstract(8)}, mesh, [("w", [shard("data"), replicate()])], "['w']", "replicate()")


def test_unknown_mesh_axes_are_refused_even_for_small_leaves(mesh):
    assert_refused({"a": {"w": abstract(8)}}, mesh, [("w", shard("batch"))], "['a']['w']", "'batch'", "('data', 'model')")
    assert_refused({"a": {"w": abstract(2)}}, mesh, [("w", fsdp("dta"))], "['a']['w']", "fsdp('dta')", "'dta'")


def test_too_many_entries_and_bad_tactic_results_are_refused(mesh):
    assert_refused({"rng": jax.random.key(0)}, mesh, [("rng", shard("data"))], "['rng']", "1 entries for 0 dimensions")
    assert_refused({"w": abstract(8)}, mesh, [("w", lambda spec, leaf, mesh, keypath: ("data", None))],
                   "['w']", "one entry per dimension")


def test_every_failing_leaf_is_listed_at_once(mesh):
    tree = {"a": abstract(6), "b": abstract(8), "c": abstract(10)}
    assert_refused(tree, mesh, [(".*", shard("data"))], "2 leaf(s)", "['a']", "['c']")


def test_malformed_rules_name_the_pattern(mesh):
    with pytest.raises(ValueError, match=r"'w\[' is not a valid regular expression"):
        infer({"w": abstract(8)}, mesh, [("w[", replicate())])
    for bad in ["fsdp", [], None, [replicate(), "x"]]:
        with pytest.raises(TypeError, match="sharding rule 'w'"):
            infer({"w": abstract(8)}, mesh, [("w", bad)])


# ---- restores onto meshes built from rules --------------------------------------------------

RULES = [
    (r"^rng$", replicate()),
    (r"^keys$", shard("data")),
    (r"^params/.*/w$", [fsdp("data", min_bytes=1 << 10), fsdp("model", min_bytes=1 << 10)]),
    (r"^opt/", fsdp(("data", "model"), min_bytes=1 << 10)),
]

# The spec of each leaf on every target mesh, and those that depend on the mesh: fsdp adapts.
EXPECTED = {"params/l0/w": P("data", "model"), "params/l1/w": P("model", "data"), "params/l0/b": P(),
            "opt/mu/l0/w": P(("data", "model")), "opt/mu/l1/w": P(None, ("data", "model")),
            "opt/count": P(), "keys": P("data"), "rng": P()}
BY_MESH = {(4, 2): {"params/l2/w": P("model", "data")},   # data=4 takes the 64, model=2 the 6
           (2, 4): {"params/l2/w": P(None, "data")},      # model=4 does not divide 6
           (1, 1): {"params/l2/w": P("model", "data")}}


@pytest.fixture(scope="module")
def saved(mesh, tmp_path_factory):
    """A small training state saved from the 4x2 mesh: (path, state)."""
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    k = jax.random.split(jax.random.key(0), 2)
    params = {"l0": {"w": put(jax.random.normal(k[0], (64, 32)), "data", "model"), "b": put(jnp.arange(32, dtype=jnp.bfloat16), "model")},
              "l1": {"w": put(jax.random.normal(k[1], (32, 128)), None, "data"), "b": put(jnp.ones(128, jnp.bfloat16))},
              "l2": {"w": put(jnp.arange(384, dtype=F32).reshape(6, 64), None, "data")}}
    state = {"params": params, "opt": {"mu": jax.tree.map(lambda p: p * 0.5, params), "count": put(jnp.int32(3))},
             "keys": put(jax.random.split(jax.random.key(1), 8), "model"), "rng": jax.random.key(2), "step": 10, "lr": 1e-3}
    path = str(tmp_path_factory.mktemp("sharding") / "ckpt")
    with dio.LocalDispatcher(host_memory_budget=1 << 20) as dispatcher:
        dispatcher.save(path, state).wait()
    return path, state


@pytest.mark.parametrize("shape", list(BY_MESH), ids=lambda s: "x".join(map(str, s)))
def test_restore_onto_meshes_from_rules_is_bit_exact(saved, shape):
    path, state = saved
    target_mesh = jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[:shape[0] * shape[1]])
    target = infer(dio.metadata(path), target_mesh, RULES)
    with dio.LocalDispatcher(host_memory_budget=1 << 20) as dispatcher:
        restored = dispatcher.restore(path, target)
    assert_trees_bit_equal(state, restored)
    by_path = {jax.tree_util.keystr(p, simple=True, separator="/"): x
               for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]}
    for name, spec in {**EXPECTED, **BY_MESH[shape]}.items():
        assert by_path[name].sharding.spec == spec, name
        assert by_path[name].sharding.mesh.shape == target_mesh.shape, name
    assert all(isinstance(x, jax.Array) and x.sharding.mesh == target_mesh
               for name, x in by_path.items() if name not in ("step", "lr"))
    assert by_path["step"] == 10 and by_path["lr"] == 1e-3


def test_reshard_restore_example(tmp_path):
    out = run_example("reshard_restore.py", str(tmp_path / "ckpt"), cwd=tmp_path)
    assert "restored onto a 2x4 mesh: bit-exact" in out and "restored onto one device: bit-exact" in out, out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("params/", "opt_state/", "rng"))}
    assert "P('data', 'model')" in rows["params/layer1/w"] and "(256, 128)" in rows["params/layer1/w"], out
    assert "P()" in rows["params/layer0/b"] and "P()" in rows["rng"], out
    assert "refused:" in out and "['params']['layer0']['w']: mesh axis 'data'" in out, out
    assert out.rstrip().endswith("OK"), out
    assert os.path.isfile(tmp_path / "ckpt" / "COMMITTED")
