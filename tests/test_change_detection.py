"""Chunk digests call every accidental change changed: single-bit flips at the first, middle and
last byte of chunks of every dtype, and changes that keep the sum or the XOR of the words, with
the host algorithm and the device one (run here on CPU devices), and end to end in a save."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dispatch_io as dio
from dispatch_io.incremental import digests

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.float16, jnp.bfloat16, np.int32, np.uint32,
          np.float32, np.complex64, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]
ALGORITHMS = {"host": digests.host_digest, "device": lambda a: digests.device_digest(jnp.asarray(a))}


def _chunk(dtype, n=3001):
    raw = np.random.default_rng(0).integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8)
    if np.dtype(dtype) == np.bool_:
        raw &= 1
    return raw.view(dtype)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_a_single_bit_flip_anywhere_is_a_change(algorithm, dtype):
    digest = ALGORITHMS[algorithm]
    chunk = _chunk(dtype)
    before = digest(chunk)
    assert digest(chunk.copy()) == before
    nbytes = chunk.nbytes
    bits = [0] if np.dtype(dtype) == np.bool_ else range(8)
    for where in (0, nbytes // 2, nbytes - 1):
        for bit in bits:
            changed = chunk.copy()
            changed.view(np.uint8)[where] ^= np.uint8(1 << bit)
            assert digest(changed) != before, (where, bit)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_changes_that_keep_the_sum_or_the_xor_are_changes(algorithm):
    digest = ALGORITHMS[algorithm]
    words = _chunk(np.uint32, 4096)
    before = digest(words)
    swapped = words.copy()
    swapped[[10, 3000]] = swapped[[3000, 10]]          # same sum, same XOR: only the order differs
    same_sum = words.copy()
    same_sum[5] += np.uint32(7)
    same_sum[6] -= np.uint32(7)
    same_xor = words.copy()
    same_xor[100] ^= np.uint32(0x80000001)
    same_xor[200] ^= np.uint32(0x80000001)
    limbs = words.copy()                                # the device limbs' sum is kept too
    limbs.view(np.uint16)[0] += np.uint16(1)
    limbs.view(np.uint16)[1] -= np.uint16(1)
    for changed in (swapped, same_sum, same_xor, limbs):
        assert not np.array_equal(changed, words)
        assert digest(changed) != before


def test_a_one_bit_change_is_saved_and_restored(tmp_path):
    x = _chunk(np.float32, 8192)
    y = x.copy()
    y.view(np.uint8)[5000 * 4 + 2] ^= np.uint8(4)
    with dio.LocalDispatcher(16 << 20, max_chunk_bytes=4096, small_leaf_bytes=0, progress=False) as d:
        d.save(str(tmp_path / "0"), {"x": x}, incremental=True).wait()
        stats = d.save(str(tmp_path / "1"), {"x": y}, incremental=True).wait()
        assert stats.bytes_written == 4096                  # the one chunk holding the changed bit
        assert d.restore(str(tmp_path / "1"))["x"].tobytes() == y.tobytes()
        assert d.restore(str(tmp_path / "0"))["x"].tobytes() == x.tobytes()


def test_chunks_whose_sample_changed_are_not_digested_whole(tmp_path):
    """A state that changes everywhere costs a sample per chunk: only chunks whose sample is the
    base's are read whole (manifest digests ``"<sample>|<digest>"``), the others are just written."""
    import json
    x = np.random.default_rng(1).standard_normal(8192, dtype=np.float32)
    with dio.LocalDispatcher(16 << 20, max_chunk_bytes=4096, small_leaf_bytes=0, progress=False) as d:
        d.save(str(tmp_path / "0"), {"x": x, "frozen": x * 2}, incremental=True).wait()
        d.save(str(tmp_path / "1"), {"x": x + 1, "frozen": x * 2}, incremental=True).wait()
        restored = d.restore(str(tmp_path / "1"))["x"]
    leaves = {e["keypath"]: e["stored"] for e in json.loads((tmp_path / "1" / "manifest.json").read_text())["leaves"]}
    assert all("|" not in v for v in leaves["['x']"]["digests"].values())          # changed: sampled only
    assert all("|" in v for v in leaves["['frozen']"]["digests"].values())         # unchanged: digested whole
    assert sum(map(len, leaves["['frozen']"]["refs"].values())) == 8
    assert "refs" not in leaves["['x']"]
    assert restored.tobytes() == (x + 1).tobytes()


@pytest.mark.parametrize("algorithm", ["host", "device"])
def test_a_sample_is_the_same_for_the_same_bytes(algorithm):
    force = algorithm == "device"
    chunk = np.random.default_rng(1).standard_normal(100_000, dtype=np.float32)
    assert digests.sample(chunk, force) == digests.sample(chunk.copy(), force)
    assert digests.sample(chunk + 1, force) != digests.sample(chunk, force)


def test_a_changed_nan_payload_of_a_narrow_float_on_a_device_is_a_change(tmp_path, monkeypatch):
    """On an accelerator a chunk is cut out of its shard on the device and digested there: a
    chunk whose only change is one float8_e5m2 NaN payload (0x7D -> 0x7E) is saved, and the
    increment restores the new bits. Forced on CPU devices (their arrays taken as device
    arrays); JAX 0.12 quiets both payloads to 0x7F in a plain slice of the floats."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    monkeypatch.setattr(digests, "on_device", lambda data: isinstance(data, jax.Array))
    raw = np.zeros((64, 64), np.uint8)
    raw[40, 3] = 0x7D
    changed = raw.copy()
    changed[40, 3] = 0x7E
    sharding = NamedSharding(jax.make_mesh((8,), ("d",)), P("d"))
    with dio.LocalDispatcher(16 << 20, max_chunk_bytes=128, small_leaf_bytes=0, progress=False) as d:
        for step, bits in enumerate((raw, changed)):
            x = jax.device_put(bits.view(ml_dtypes.float8_e5m2), sharding)
            d.save(str(tmp_path / str(step)), {"x": x}, incremental=True).wait()
        assert np.asarray(d.restore(str(tmp_path / "1"))["x"]).view(np.uint8).tobytes() == changed.tobytes()
