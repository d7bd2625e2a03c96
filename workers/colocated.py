"""The worker functions :class:`dispatch_io.ColocatedDispatcher` runs through
``jax.experimental.colocated_python``, on the CPU host next to the accelerators.

colocated_python moves only ``jax.Array`` arguments and results, so each call's plain-data
request (kvstore spec, regions) travels as a small ``uint8`` array, pickled, on the CPU device
the call runs on. The functions are defined once, at module level: colocated_python
specializes a function per distinct argument signature and keeps every specialization, so
a closure per call would grow without bound over a long training run, while a saved tree's
batches repeat the same few signatures.

* :func:`write_arrays` ``(request, arrays) -> uint32[n]`` (CRC-32C per array, 0 without checksums) writes the arrays (already on
  this host: moving them here was the device-to-host step) into their regions; host (numpy)
  data arrives as raw bytes, since a jax.Array without x64 cannot hold 64-bit dtypes.
* :func:`reader` ``(out_specs)`` gives a function ``(request) -> [arrays]`` that reads regions
  into new arrays on this host's CPU device, PRNG keys as key arrays (colocated_python converts
  keys to ``key_data`` at its boundary and back).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import pickle
from typing import Sequence

import jax
import numpy as np

from .contract import IOSettings, ReadItem, Region, numpy_dtype
from .session import Session
from .tensorstore_io import checksum_regions, read_items, write_regions

_HEADER = 8  # request length, little-endian uint64
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


@functools.cache
def release_large_buffers_at_once(threshold: int = 1 << 20) -> bool:
    """Make glibc serve every allocation above ``threshold`` with its own mapping, returned to the
    OS when freed (glibc only; True if applied; once per process).

    The host copies on a colocated worker are fresh XLA buffers, allocated and freed by many
    threads. By default glibc raises its mmap threshold after such frees (up to 32 MiB) and then
    keeps freed chunks in per-thread arenas: RSS grows to ~1.7x the budget. With a fixed threshold
    it stays within the budget, at the same speed (measured on the 1 GiB benchmark tree)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def colocated_python_module():
    """``jax.experimental.colocated_python``, with a clear error if its pickler is missing."""
    try:
        import cloudpickle  # noqa: F401 - colocated_python ships functions with it
    except ImportError as exc:
        raise ImportError("ColocatedDispatcher needs cloudpickle, which jax.experimental.colocated_python uses "
                          "to ship functions to workers: pip install cloudpickle (a dispatch_io dependency)") from exc
    from jax.experimental import colocated_python
    return colocated_python


def encode_request(request, device) -> jax.Array:
    """``request`` pickled into a uint8 array on ``device``; its length is rounded up to a
    power of two so that repeated calls share one colocated_python specialization."""
    raw = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
    size = max(1024, 1 << (len(raw) + _HEADER - 1).bit_length())
    buf = np.zeros(size, np.uint8)
    buf[:_HEADER] = np.frombuffer(len(raw).to_bytes(_HEADER, "little"), np.uint8)
    buf[_HEADER:_HEADER + len(raw)] = np.frombuffer(raw, np.uint8)
    return jax.device_put(buf, device)


def decode_request(request: jax.Array):
    buf = np.asarray(request)
    size = int.from_bytes(buf[:_HEADER].tobytes(), "little")
    return pickle.loads(buf[_HEADER:_HEADER + size].tobytes())


@dataclasses.dataclass(frozen=True)
class WriteRequest:
    """Write ``regions`` (one per array argument) as writer ``writer`` of the save whose
    arrays folder is the kvstore ``arrays``."""

    arrays: dict
    writer: str
    settings: IOSettings
    regions: tuple[Region, ...]


@dataclasses.dataclass(frozen=True)
class ReadRequest:
    """Read ``items`` (one result array each) from the arrays kvstore ``kvstore``."""

    kvstore: dict
    settings: IOSettings
    items: tuple[ReadItem, ...]


def _write(request: jax.Array, arrays: Sequence[jax.Array]) -> jax.Array:
    release_large_buffers_at_once()  # for the batches after this one, on a remote worker host
    req: WriteRequest = decode_request(request)
    session = Session.writer(req.arrays, req.writer, req.settings)
    buffers = []
    for region, array in zip(req.regions, arrays):
        host = np.asarray(array)
        dtype = numpy_dtype(region.array.dtype)
        buffers.append(host.view(dtype).reshape(region.shape))  # host data arrives as raw uint8 bytes
    try:
        sums = write_regions(session, req.regions, buffers)
    finally:
        session.close()
    return jax.device_put(np.array([s or 0 for s in sums], np.uint32), request.sharding)


def _write_out_spec(request, arrays):
    return jax.ShapeDtypeStruct((len(arrays),), np.uint32, sharding=request.sharding)


def _read(request: jax.Array) -> list[jax.Array]:
    req: ReadRequest = decode_request(request)
    session = Session(req.kvstore, req.settings)
    try:
        buffers = read_items(session, req.items)
    finally:
        session.close()
    out = []
    for item, buf in zip(req.items, buffers):
        if item.on_host:
            buf = buf.reshape(-1).view(np.uint8)
        array = jax.device_put(buf, request.sharding)
        out.append(jax.random.wrap_key_data(array, impl=item.key_impl) if item.key_impl else array)
    return out


def read_out_specs(items: Sequence[ReadItem], sharding) -> tuple[jax.ShapeDtypeStruct, ...]:
    """What ``_read`` returns for ``items`` on the CPU device of ``sharding``: PRNG keys in their
    logical shape with their key dtype (colocated_python converts keys at its boundary), host
    results as raw bytes, the rest as read."""
    specs = []
    for item in items:
        if item.key_impl:
            key = jax.eval_shape(lambda impl=item.key_impl: jax.random.key(0, impl=impl))  # one key
            logical = item.shape[:len(item.shape) - len(jax.eval_shape(jax.random.key_data, key).shape)]
            specs.append(jax.ShapeDtypeStruct(logical, key.dtype, sharding=sharding))
        elif item.on_host:
            nbytes = math.prod(item.shape) * numpy_dtype(item.dtype).itemsize
            specs.append(jax.ShapeDtypeStruct((nbytes,), np.uint8, sharding=sharding))
        else:
            specs.append(jax.ShapeDtypeStruct(item.shape, numpy_dtype(item.dtype), sharding=sharding))
    return tuple(specs)


@functools.cache
def _write_arrays():
    return colocated_python_module().colocated_python(_write).specialize(out_specs_fn=_write_out_spec)


def write_arrays(request: jax.Array, arrays: Sequence[jax.Array]) -> jax.Array:
    return _write_arrays()(request, list(arrays))


@functools.cache
def reader(out_specs: tuple[jax.ShapeDtypeStruct, ...]):
    """The colocated read function for one result signature (cached: one per signature)."""
    specs = list(out_specs)
    return colocated_python_module().colocated_python(_read).specialize(out_specs_fn=lambda request: specs)


def _checksum(request: jax.Array) -> jax.Array:
    kvstore, settings, regions = decode_request(request)
    session = Session(kvstore, settings)
    try:
        sums = checksum_regions(session, regions)
    finally:
        session.close()
    return jax.device_put(np.array(sums, np.uint32), request.sharding)


@functools.cache
def checksummer(count: int, sharding):
    """The colocated function returning the CRC-32C of ``count`` stored regions."""
    spec = jax.ShapeDtypeStruct((count,), np.uint32, sharding=sharding)
    return colocated_python_module().colocated_python(_checksum).specialize(out_specs_fn=lambda request: spec)
