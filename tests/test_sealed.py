"""A checkpoint's manifest.json and info.json carry their own CRC-32C (``storage/sealed.py``).

Before, a flipped byte in a manifest restored a wrong Python scalar (kept inline there) with no
error, and one in a local step's info.json changed the regions the step says it holds, which
``Dispatcher.verify`` and ``dispatch-io verify`` could not see while a restore could trip on it.
Now every verify and every restore read the documents through one check, and give one answer.
"""

import json
import os

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.sharding import NamedSharding, PartitionSpec

import dispatch_io as dio
from dispatch_io import cli
from dispatch_io import policies as P
from dispatch_io.storage import sealed

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
documents = st.dictionaries(st.text(max_size=6).filter(lambda k: k != sealed.SEAL), json_values, max_size=6)


@settings(max_examples=200, deadline=None)
@given(documents)
def test_a_sealed_document_reads_back_as_written(doc):
    assert sealed.loads(sealed.dumps(doc)) == doc
    assert json.loads(sealed.dumps(doc))[sealed.SEAL]   # plain JSON to any other reader


@settings(max_examples=60, deadline=None)
@given(documents, st.data())
def test_no_flipped_bit_reads_back_as_another_document(doc, data):
    """Every single-bit flip either fails (the seal, or JSON itself) or leaves what the document
    says unchanged: never a different document read as sound."""
    raw = bytearray(sealed.dumps(doc))
    offset = data.draw(st.integers(0, len(raw) - 1))
    raw[offset] ^= 1 << data.draw(st.integers(0, 7))
    try:
        back = sealed.loads(bytes(raw))
    except (ValueError, RecursionError):
        return
    assert back == doc


def test_unsealed_documents_are_read_as_they_are_but_not_a_damaged_seal():
    assert sealed.loads(b'{"format": "dispatch_io", "leaves": []}') == {"format": "dispatch_io", "leaves": []}
    raw = sealed.dumps({"format": "dispatch_io", "n": 1})
    damaged = raw.replace(b'"crc32c"', b'"crc32b"')    # one bit of the seal's own key
    with pytest.raises(sealed.BrokenSeal, match="damaged checksum"):
        sealed.loads(damaged)
    with pytest.raises(sealed.BrokenSeal, match="does not match"):
        sealed.loads(raw.replace(b'"n":1', b'"n":3'))
    with pytest.raises(ValueError, match="must not have"):
        sealed.dumps({sealed.SEAL: "x"})


def flip(path, needle: bytes, at: int = 0):
    data = bytearray(open(path, "rb").read())
    data[data.index(needle) + at] ^= 1
    open(path, "wb").write(bytes(data))


def test_a_flipped_byte_in_the_manifest_is_never_restored(tmp_path, capsys):
    """A Python string kept inline in the manifest: one flipped bit in it fails the restore, the
    dispatcher's verify and ``dispatch-io verify`` alike, naming the checkpoint -- not "sound" and
    a restored "hdllo"."""
    path = str(tmp_path / "ckpt")
    state = {"w": jnp.arange(64, dtype=jnp.float32), "name": "hello", "lr": 0.25}
    with dio.LocalDispatcher(checksums=True) as d:
        d.save(path, state).wait()
        restored = d.restore(path)
        assert restored["name"] == "hello" and np.asarray(restored["w"]).tobytes() == np.asarray(state["w"]).tobytes()
        assert d.verify(path) is not None and cli.main(["verify", path]) == 0
        flip(os.path.join(path, "manifest.json"), b'"hello"', 2)   # "hdllo": valid JSON, wrong value
        message = r"ckpt: malformed checkpoint: its manifest.json does not match its own CRC-32C"
        with pytest.raises(dio.CorruptCheckpointError, match=message):
            d.restore(path)
        with pytest.raises(dio.CorruptCheckpointError, match=message):
            d.verify(path)
    capsys.readouterr()
    assert cli.main(["verify", path]) == 1
    assert "does not match its own CRC-32C" in capsys.readouterr().err
    flip(os.path.join(path, "manifest.json"), b'"hdllo"', 2)    # mended; now a flip that breaks the JSON itself
    flip(os.path.join(path, "manifest.json"), b'"total_bytes":', len(b'"total_bytes":') - 1)   # ':' -> ';'
    with pytest.raises(dio.CorruptCheckpointError, match="manifest.json is no longer JSON"):
        dio.metadata(path)
    assert cli.main(["verify", path]) == 1                      # damaged, not "unusable" (exit 2)
    assert "is NOT sound" in capsys.readouterr().err


def test_every_verify_and_the_restore_agree_on_a_flipped_byte_in_a_local_steps_info(tmp_path, capsys):
    """A local step's info says which regions the step holds: a flipped digit there fails
    ``Dispatcher.verify`` and ``dispatch-io verify`` of the step, and the restore never uses the
    step (it reads the root's step instead). Before, both verifies said "sound"."""
    state = {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64)}
    tier = dio.LocalTier(str(tmp_path / "local"), save_policy=P.EveryNSteps(1))
    with dio.LocalDispatcher(checksums=True) as d, \
            dio.CheckpointManager(tmp_path / "root", d, save_policy=P.EveryNSteps(2), local=tier) as mgr:
        mgr.save(2, state).wait()
        mgr.wait()
        step = str(tmp_path / "local" / "2")
        assert d.verify(step) is not None and cli.main(["verify", step]) == 0
        info = os.path.join(step, "info.json")
        flip(info, b'"held":{"[\'w\']":[[[0,64]', len(b'"held":{"[\'w\']":[[[0,6'))   # [0, 64] -> [0, 65]
        with pytest.raises(dio.CorruptCheckpointError, match=r"2: malformed checkpoint: its info.json does not match"):
            d.verify(step)
        restored = mgr.restore(None, state, verify=True)
        assert np.asarray(restored["w"]).tobytes() == np.asarray(state["w"]).tobytes()
        assert mgr.last_tier_restore.bytes_read_local == 0   # the corrupt local step was not used
    capsys.readouterr()
    assert cli.main(["verify", step]) == 1
    assert "info.json does not match its own CRC-32C" in capsys.readouterr().err


def test_a_flipped_byte_in_a_root_steps_info_names_the_step(tmp_path):
    with dio.CheckpointManager(tmp_path) as mgr:
        mgr.save(3, {"w": jnp.ones(8)}, metrics={"loss": 0.5}).wait()
        assert mgr.step_info(3).metrics == {"loss": 0.5}
    flip(tmp_path / "3" / "info.json", b'"loss":0.5', len(b'"loss":0.'))   # 0.5 -> 0.4
    with dio.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(dio.CorruptCheckpointError, match=r"3: malformed checkpoint: its info.json does not match"):
            mgr.step_info(3)


def test_retention_keeps_what_a_step_with_a_broken_seal_may_reference(tmp_path, capsys):
    """An incremental step whose manifest fails its seal may still reference any older step: retention
    keeps them aside (retired) instead of deleting them, so the step can be mended (here: its flipped
    bit set back and the seal dropped) and restored. Before, its references counted as none and the
    step it stored its unchanged chunks in was deleted. ``dispatch-io verify`` of the referencing step
    says NOT sound (exit 1), not "unusable", while the seal is broken."""
    n = 1 << 16
    a = np.arange(n, dtype=np.float64)
    with dio.CheckpointManager(tmp_path, incremental=True, keep_policy=P.LatestN(2)) as mgr:
        mgr.save(1, {"a": a, "b": np.ones(n)}).wait()
        mgr.save(2, {"a": a, "b": np.zeros(n)}).wait()            # "a" unchanged: referenced from step 1
        manifest = tmp_path / "2" / "manifest.json"
        flip(manifest, b'"jax_version":"', len(b'"jax_version":"'))
        capsys.readouterr()
        assert cli.main(["verify", str(tmp_path / "2")]) == 1
        mgr.save(3, {"a": -a, "b": np.full(n, 7.0)}).wait()       # drops step 1 from the kept two
        mgr.wait()
    assert os.path.isdir(tmp_path / "1"), sorted(os.listdir(tmp_path))
    flip(manifest, b'"jax_version":"', len(b'"jax_version":"'))   # mended by hand
    doc = sealed.loads(manifest.read_bytes())
    manifest.write_text(json.dumps(doc))
    with dio.CheckpointManager(tmp_path) as mgr:
        assert np.asarray(mgr.restore(2)["a"]).tobytes() == a.tobytes()


def test_keys_alike_as_json_strings_are_refused_at_save_not_sealed_unreadable(tmp_path):
    """``{1: ..., "1": ...}`` is written by JSON as two members of one name and read back as one: a
    sealed document holding it could never be read. The save refuses such metadata up front."""
    with dio.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ValueError, match="alike as JSON strings"):
            mgr.save(1, {"w": np.ones(4)}, metadata={1: "one", "1": "uno"})
        mgr.save(2, {"w": np.ones(4)}, metadata={1: "one"}).wait()
        assert mgr.step_info(2).metadata == {"1": "one"}
    with pytest.raises(ValueError, match="alike as JSON strings"):
        sealed.exact({"m": {1: 2, "1": 3}})
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), (1, "1"))   # axis names alike as text
    path = str(tmp_path / "ckpt")
    with dio.LocalDispatcher() as d:
        w = np.arange(64, dtype=np.float32).reshape(8, 8)
        d.save(path, {"w": jax.device_put(w, NamedSharding(mesh, PartitionSpec(1, "1")))}).wait()
        assert np.asarray(d.restore(path)["w"]).tobytes() == w.tobytes()
