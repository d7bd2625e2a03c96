"""Incremental steps: only changed chunks are written, every step restores bit for bit (also
after retention removed the steps it references), retention keeps referenced bytes and reclaims
the rest, and crafted references are refused."""

import contextlib
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io.storage import sealed
from conftest import assert_trees_bit_equal
from dispatch_io.errors import CorruptCheckpointError

CHUNK = 64 << 10


def _state(mesh, seed=0):
    rng = np.random.default_rng(seed)
    sharded = NamedSharding(mesh, P("data", "model"))
    return {"base": jax.device_put(rng.standard_normal((256, 256), dtype=np.float32), sharded),
            "emb": jax.device_put(jnp.asarray(rng.standard_normal((512, 64)), jnp.bfloat16), NamedSharding(mesh, P("data"))),
            "table": rng.integers(0, 1 << 30, (256, 128), dtype=np.int64),
            "adapter": jax.device_put(rng.standard_normal((128, 256), dtype=np.float32), sharded),
            "key": jax.random.key(3), "step": 0}


def _train(state, step):
    """One step: the adapter changes everywhere, one row of the table, nothing else."""
    table = state["table"].copy()
    table[step * 7 % 256, 5] += 1
    return {**state, "adapter": state["adapter"] + 1, "table": table, "step": step}


_STACKS: list[contextlib.ExitStack] = []   # the running test's: what it opened, closed after it


@pytest.fixture(autouse=True)
def _close_dispatchers():
    """Every dispatcher a test here makes is closed after it (its IO threads end with it)."""
    with contextlib.ExitStack() as stack:
        _STACKS.append(stack)
        try:
            yield
        finally:
            _STACKS.pop()


def _dispatcher(**kw):
    d = dio.LocalDispatcher(64 << 20, max_chunk_bytes=CHUNK, small_leaf_bytes=1024, progress=False, **kw)
    return _STACKS[-1].enter_context(d)


def _host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.random.key_data(x) if dio.tree.is_prng_key(x) else x), tree)


def _run(root, mesh, steps, keep=2, **kw):
    state, saved, written = _state(mesh), {}, {}
    with dio.CheckpointManager(root, _dispatcher(checksums=True), keep_policy=dio.policies.LatestN(keep),
                               incremental=True) as mgr:
        for step in range(steps):
            state = _train(state, step)
            written[step] = mgr.save(step, state).wait().bytes_written
            saved[step] = _host(state)
            mgr.wait()
        for step in mgr.all_steps():
            assert_trees_bit_equal(_host(mgr.restore(step)), saved[step])
            mgr.dispatcher.verify(mgr.step_path(step))
        return mgr.all_steps(), saved, written


def test_later_saves_write_only_changed_chunks_and_every_step_restores(tmp_path, mesh):
    root = str(tmp_path / "root")
    steps, saved, written = _run(root, mesh, 6)
    assert steps == [4, 5]
    full = written[0]
    adapter, table_chunk = 128 * 256 * 4, CHUNK
    for step in range(1, 6):  # the adapter, one table chunk (the row that changed), small leaves
        assert adapter <= written[step] <= adapter + table_chunk + 4096, (step, written[step], full)
    # Step 0 stores the frozen bytes every kept step references: retired (unlisted), not deleted.
    assert sorted(os.listdir(root)) == ["0", "4", "5"]
    assert os.path.exists(os.path.join(root, "0", "RETAINED")) and not os.path.exists(os.path.join(root, "0", "COMMITTED"))
    refs = json.load(open(os.path.join(root, "5", "manifest.json")))["references"]
    assert {r["step"] for r in refs} <= {"0", "1", "2", "3", "4"} and "0" in {r["step"] for r in refs}


def test_a_retired_step_is_deleted_once_nothing_kept_references_it(tmp_path, mesh):
    root = str(tmp_path / "root")
    state = _state(mesh)
    with dio.CheckpointManager(root, _dispatcher(), keep_policy=dio.policies.LatestN(1), incremental=True) as mgr:
        mgr.save(0, state).wait()
        mgr.save(1, _train(state, 1)).wait()
        mgr.wait()
        assert sorted(os.listdir(root)) == ["0", "1"] and mgr.all_steps() == [1]
        changed = jax.tree.map(lambda x: x + 2 if isinstance(x, (jax.Array, np.ndarray)) and not
                               dio.tree.is_prng_key(x) else x, state)
        changed["key"] = jax.random.key(4)
        mgr.save(2, changed).wait()  # nothing unchanged since step 1 (whose references go with it)
        mgr.wait()
        assert sorted(os.listdir(root)) == ["2"]
        assert_trees_bit_equal(_host(mgr.restore(2)), _host(changed))


def test_incremental_steps_on_an_object_store(s3_prefix, mesh):
    steps, _, written = _run(s3_prefix, mesh, 4)
    assert steps == [2, 3] and written[3] < written[0] / 3


def _saved_pair(tmp_path, mesh):
    root = tmp_path / "root"
    d = _dispatcher()
    state = _state(mesh)
    d.save(str(root / "0"), state, incremental=True).wait()
    d.save(str(root / "1"), _train(state, 1), incremental=True).wait()
    return d, root


def _edit(path, fn):
    doc = sealed.loads(path.read_text())   # edited: unsealed, as by hand
    fn(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("crafted, says", [
    (lambda doc: doc["references"].__setitem__(0, {"step": "../../etc", "commit": "ab"}), "references must be"),
    (lambda doc: doc["references"].__setitem__(0, {"step": "1", "commit": doc["references"][0]["commit"]}),
     "itself (a cycle)"),
    (lambda doc: doc["references"].__setitem__(0, {"step": "7", "commit": "ab"}), "which is missing"),
    (lambda doc: doc["references"].__setitem__(0, {**doc["references"][0], "commit": "ab"}), "another save is there"),
    (lambda doc: next(leaf for leaf in doc["leaves"] if leaf["keypath"] == "['base']")["stored"]["refs"].__setitem__(
        "0", ["9,0"]), "outside the chunk grid"),
])
def test_crafted_references_are_refused(tmp_path, mesh, crafted, says):
    d, root = _saved_pair(tmp_path, mesh)
    _edit(root / "1" / "manifest.json", crafted)
    with pytest.raises(CorruptCheckpointError, match="malformed checkpoint") as err:
        d.restore(str(root / "1"))
    assert says in str(err.value)


def test_a_reference_to_a_chunk_the_step_does_not_store_is_refused(tmp_path, mesh):
    """A chain (or cycle) of references: step 2 names step 1 for a chunk step 1 only references."""
    d, root = _saved_pair(tmp_path, mesh)
    shutil.copytree(root / "1", root / "2")
    commit = json.loads((root / "1" / "COMMITTED").read_text())["id"]

    def chain(doc):
        doc["references"] = [{"step": "1", "commit": commit}]
        for leaf in doc["leaves"]:
            if leaf.get("stored") and leaf["stored"].get("refs"):
                leaf["stored"]["refs"] = {"0": [g for gs in leaf["stored"]["refs"].values() for g in gs]}
    _edit(root / "2" / "manifest.json", chain)
    with pytest.raises(CorruptCheckpointError, match="chain or a cycle"):
        d.restore(str(root / "2"))


def test_a_missing_referenced_step_is_a_clear_error(tmp_path, mesh):
    d, root = _saved_pair(tmp_path, mesh)
    shutil.rmtree(root / "0")
    with pytest.raises(CorruptCheckpointError, match="references step 0 .*missing"):
        d.restore(str(root / "1"))


def test_convert_of_an_incremental_step_is_self_contained(tmp_path, mesh):
    d, root = _saved_pair(tmp_path, mesh)
    expected = _host(d.restore(str(root / "1")))
    d.convert(str(root / "1"), str(tmp_path / "copy"))
    shutil.rmtree(root)
    assert "references" not in json.loads((tmp_path / "copy" / "manifest.json").read_text())
    assert_trees_bit_equal(_host(d.restore(str(tmp_path / "copy"))), expected)


def test_inspect_shows_stored_and_referenced_bytes(tmp_path, mesh, capsys):
    from dispatch_io import cli
    d, root = _saved_pair(tmp_path, mesh)
    assert cli.main(["inspect", str(root / "1"), "--json"]) == 0
    rows = {r["keypath"]: r for r in json.loads(capsys.readouterr().out)["leaves"]}
    assert rows["['base']"]["referenced"] == {"0": 256 * 256 * 4}      # unchanged: all in step 0
    assert rows["['adapter']"]["referenced"] == {}                     # changed: stored here
    assert cli.main(["inspect", str(root / "1")]) == 0
    assert "referenced" in capsys.readouterr().out


def test_a_base_whose_references_are_broken_is_passed_over(tmp_path, mesh):
    d, root = _saved_pair(tmp_path, mesh)
    shutil.rmtree(root / "0")                     # step 1 references it: no base for step 2
    state = _train(_state(mesh), 2)
    stats = d.save(str(root / "2"), state, incremental=True).wait()
    assert stats.bytes_written == sum(v.nbytes for k, v in _host(state).items() if k != "step")   # everything
    assert "references" not in json.loads((root / "2" / "manifest.json").read_text())
    assert_trees_bit_equal(_host(d.restore(str(root / "2"))), _host(state))


def test_incremental_needs_a_step_path_and_a_persistent_save(tmp_path):
    d = _dispatcher()
    with pytest.raises(ValueError, match="step of a root"):
        d.save(str(tmp_path / "ckpt"), {"x": np.ones(4)}, incremental=True)
    assert not os.path.exists(tmp_path / "ckpt")   # (own=True saves are incremental too: test_tier_incremental.py)


def test_an_incremental_step_restores_onto_another_mesh(tmp_path, mesh):
    """Regions that cut across chunks stored here and chunks another step stores."""
    d, root = _saved_pair(tmp_path, mesh)
    other = jax.make_mesh((2, 4), ("a", "b"))
    state = _train(_state(mesh), 1)
    base = np.asarray(state["base"]).copy()
    base[70] += 1                                            # one chunk of ['base'] stored here, the rest in step 0
    state["base"] = jax.device_put(base, state["base"].sharding)
    d.save(str(root / "2"), state, incremental=True).wait()
    refs = next(e for e in json.loads((root / "2" / "manifest.json").read_text())["leaves"]
                if e["keypath"] == "['base']")["stored"]["refs"]
    assert 0 < sum(map(len, refs.values())) < len(
        next(e for e in json.loads((root / "2" / "manifest.json").read_text())["leaves"]
             if e["keypath"] == "['base']")["stored"]["digests"])
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(other, P("b", "a")))
              for k, v in state.items() if k in ("base", "adapter", "emb")}
    back = d.restore(str(root / "2"), target=target, partial=True)
    for k in target:
        assert back[k].sharding == target[k].sharding
        assert np.asarray(back[k]).tobytes() == np.asarray(state[k]).tobytes(), k
