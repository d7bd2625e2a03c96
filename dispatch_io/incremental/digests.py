"""Chunk digests: what an incremental save compares to tell an unchanged chunk from a changed one.

A digest is text ``"<algorithm>:<hex>"`` (a *sample* of a chunk, :func:`sample`, is one too, only
to tell changed chunks without reading them whole); two digests are compared only as whole strings, so
digests of different algorithms never match (a chunk saved from the host and later from an
accelerator is simply written again). Two algorithms (docs/design.md, "Incremental saves", has
the arithmetic):

* ``xxh3-128`` -- host data (numpy leaves, and jax arrays on CPU devices, whose buffers are host
  memory): XXH3's 128-bit hash of the chunk's bytes (C order) after a header naming its dtype
  (byte order included) and shape. ~6 GB/s on one core, so a chunk is read once more than a
  plain save reads it.
* ``ml8-65537`` -- data on an accelerator (sub-byte dtypes such as int4: on the host): computed there by one jitted function per chunk shape
  and dtype, so only the digest (8 numbers) crosses the link, never the chunk. The chunk's bytes,
  as 16-bit limbs ``m_j`` (< 2**16 < p = 65537), are hashed by 8 independent multilinear lanes
  ``h_l = sum_j m_j * k_{l,j} mod p`` with keys ``k_{l,j}`` in ``[1, 2**16)`` from a 32-bit
  integer mixer of ``(l, j)``; uint32 arithmetic only (JAX's x64 is off by default): each product
  fits 32 bits and is reduced mod p before partial sums of 2**14 terms.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import xxhash

HOST = "xxh3-128"
DEVICE = "ml8-65537"
PRIME = 65537
LANES = 8
_BLOCK = 1 << 14        # terms summed before a reduction: 2**14 * (p - 1) < 2**32


def host_digest(data: np.ndarray) -> str:
    """``xxh3-128`` digest of the host array ``data`` (its dtype, byte order and shape included)."""
    data = np.ascontiguousarray(data)
    h = xxhash.xxh3_128()
    h.update(f"{data.dtype.str}{data.shape}".encode())
    h.update(data.reshape(-1).view(np.uint8))
    return f"{HOST}:{h.hexdigest()}"


def _mix(x):
    """A 32-bit integer mixer (lowbias32): consecutive inputs give unrelated keys."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _reduce(terms):
    """``sum(terms) mod p`` of uint32 terms each < p, without overflow: blocks of 2**14 summed,
    reduced, and again, until one value is left."""
    while terms.shape[0] > 1:
        pad = -terms.shape[0] % _BLOCK
        terms = jnp.pad(terms, (0, pad)).reshape(-1, _BLOCK)
        terms = jnp.sum(terms, axis=1, dtype=jnp.uint32) % jnp.uint32(PRIME)
    return terms[0]


@functools.partial(jax.jit, static_argnames=())
def _lanes(words):
    """The 8 lane values of the multilinear hash of ``words`` (uint32, flat), as uint32[8]."""
    limbs = jnp.stack([words & jnp.uint32(0xFFFF), words >> 16], axis=-1).reshape(-1)
    index = jnp.arange(limbs.shape[0], dtype=jnp.uint32)
    out = []
    for lane in range(LANES):
        keys = _mix(index * jnp.uint32(LANES) + jnp.uint32(lane) + jnp.uint32(0x9E3779B9)) % jnp.uint32(0xFFFF) + 1
        out.append(_reduce((limbs * keys) % jnp.uint32(PRIME)))
    return jnp.stack(out)


def _as_words(data):
    """The bytes of the jax array ``data`` as flat uint32 words (zero padded to a multiple of 4
    bytes), on its device."""
    flat = data.reshape(-1)
    if jnp.issubdtype(flat.dtype, jnp.complexfloating):  # its real and imaginary parts, bit for bit
        flat = jnp.stack([flat.real, flat.imag], axis=-1).reshape(-1)
    itemsize = np.dtype(flat.dtype).itemsize
    if flat.dtype == jnp.bool_:
        flat = flat.astype(jnp.uint8)
    if itemsize == 8:  # (x64 on) two words per element
        return jax.lax.bitcast_convert_type(flat, jnp.uint32).reshape(-1)
    if itemsize == 4:
        return jax.lax.bitcast_convert_type(flat, jnp.uint32)
    unsigned = jnp.uint16 if itemsize == 2 else jnp.uint8
    per_word = 4 // itemsize
    flat = jax.lax.bitcast_convert_type(flat, unsigned) if flat.dtype != unsigned else flat
    flat = jnp.pad(flat, (0, -flat.shape[0] % per_word)).reshape(-1, per_word)
    return jax.lax.bitcast_convert_type(flat, jnp.uint32)


@jax.jit
def _device_lanes(data):
    return _lanes(_as_words(data))


def device_digest(data) -> str:
    """``ml8-65537`` digest of the jax array ``data``, computed on its device: only 8 numbers
    come back. Its dtype and shape are part of the digest."""
    lanes = np.asarray(_device_lanes(data))
    return f"{DEVICE}:{np.dtype(data.dtype).name}{tuple(data.shape)}:" + "".join(f"{int(v):05x}" for v in lanes)


def on_device(data) -> bool:
    """Whether ``data`` is a jax array on an accelerator (not host memory)."""
    return isinstance(data, jax.Array) and next(iter(data.sharding.device_set)).platform != "cpu"


SAMPLE_BYTES = 4096     # a sample: about this many bytes spread over the chunk, and its ends


def host_sample(data: np.ndarray) -> str:
    """A digest of a sample of ``data``'s bytes (its first and last 64, and ~4 KiB spread evenly
    between): ~0.01-0.1 % of a large chunk, enough to tell a chunk training changed from one it
    did not without reading it all (never enough to call it unchanged: see :func:`digest`)."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    stride = max(1, flat.size // SAMPLE_BYTES)
    h = xxhash.xxh3_64()
    h.update(f"{data.dtype.str}{data.shape}".encode())
    for part in (flat[:64], flat[::stride], flat[-64:]):
        h.update(np.ascontiguousarray(part))
    return f"s{HOST}:{h.hexdigest()}"


@functools.partial(jax.jit, static_argnames=("stride",))
def _device_sample(data, stride: int):
    words = _as_words(data)
    return jnp.concatenate([words[:16], words[::stride], words[-16:]])


def sample(data, force_device: bool = False) -> str:
    """:func:`host_sample`, or on an accelerator (``force_device``: also here) the same of the
    chunk's words sampled on the device (only the sample crosses the link)."""
    if (force_device or on_device(data)) and not _sub_byte(data.dtype):
        data = jnp.asarray(data)
        words = math.prod(data.shape) * np.dtype(data.dtype).itemsize // 4 + 1
        picked = np.asarray(_device_sample(data, max(1, words // (SAMPLE_BYTES // 4))))
        return f"s{DEVICE}:{np.dtype(data.dtype).name}{tuple(data.shape)}:{xxhash.xxh3_64_hexdigest(picked)}"
    return host_sample(np.asarray(data))


def _sub_byte(dtype) -> bool:
    """int4, float4, ...: no bitcast to bytes on devices, digested on the host (small, rare)."""
    try:
        return ml_dtypes.finfo(dtype).bits < 8
    except ValueError:
        try:
            return ml_dtypes.iinfo(dtype).bits < 8
        except ValueError:
            return False


def digest(data, force_device: bool = False) -> str:
    """The digest of one chunk's data: ``device_digest`` on an accelerator (or with
    ``force_device``, which tests use to run the device algorithm on CPU), else ``host_digest``."""
    if (force_device or on_device(data)) and not _sub_byte(data.dtype):
        return device_digest(jnp.asarray(data))
    return host_digest(np.asarray(data))
