"""The JAX API as it differs between the versions we support (JAX 0.10.2 to 0.12), in one place.

* JAX 0.12 deprecates naming ``jax.sharding.SingleDeviceSharding``: shardings on one device are made
  with ``make_single_device_sharding`` (there since 0.10) and recognised with
  ``is_single_device_sharding`` (new in 0.12). Code of this package uses the two functions below.
* XLA may quiet NaN payloads when it slices narrow floats: JAX 0.12's CPU backend turns
  float8_e5m2's 0x7D into 0x7F, and float8_e4m3 / e3m4 likewise, where numpy and JAX 0.10 keep every
  bit. A checkpoint's promise is the bytes, so every cut of a device array in the save and restore
  paths goes through :func:`slice_exact`: floats of 16 bits or fewer are sliced as the unsigned integers
  of their width (a bitcast is a reinterpretation, never a conversion) and viewed back, by one jitted
  ``dynamic_slice`` whose offsets are traced: one compile per (shape, dtype, device, cut size), never
  one per offset.
"""

import functools

import jax
import ml_dtypes
import numpy as np

_UINT_OF_BITS = {4: ml_dtypes.uint4, 8: np.uint8, 16: np.uint16}


def single_device_sharding(device, memory_kind: str | None = None) -> jax.sharding.Sharding:
    """The sharding that puts a whole array on ``device`` (in ``memory_kind``, None: the default)."""
    return jax.sharding.make_single_device_sharding(device, memory_kind=memory_kind)


def is_single_device_sharding(sharding) -> bool:
    """Whether ``sharding`` is one made by :func:`single_device_sharding` (a NamedSharding over one
    device is not)."""
    check = getattr(jax.sharding, "is_single_device_sharding", None)
    if check is not None:
        return check(sharding)
    return isinstance(sharding, jax.sharding.SingleDeviceSharding)  # JAX < 0.12: the class, not deprecated


def slice_exact(array, index):
    """``array[index]`` with every bit kept.

    Args:
      array: a numpy array (sliced on the host, a view) or a ``jax.Array`` on one device (cut there
        by one compiled program per shape, dtype and cut size, whatever the offsets).
      index: a tuple of slices with steps of 1, one per leading axis (missing ones: whole).
    Returns:
      the part, of ``array``'s type and dtype.
    Raises:
      ValueError: a slice of ``index`` with a step other than 1 (on a ``jax.Array``).
    """
    if not isinstance(array, jax.Array):
        return array[index]
    index = tuple(index) + (slice(None),) * (array.ndim - len(index))
    bounds = [sl.indices(n) for sl, n in zip(index, array.shape)]
    if any(step != 1 for _, _, step in bounds):
        raise ValueError(f"slice_exact cuts with steps of 1 only, not {index}")
    starts = np.array([start for start, _, _ in bounds], np.int32)
    return _cut(array, starts, tuple(max(stop - start, 0) for start, stop, _ in bounds))


@functools.partial(jax.jit, static_argnums=2)
def _cut(data, starts, sizes):
    bits = exact_carrier(data.dtype)
    raw = data if bits is None else jax.lax.bitcast_convert_type(data, bits)
    part = jax.lax.dynamic_slice(raw, [starts[i] for i in range(len(sizes))], sizes)
    return part if bits is None else jax.lax.bitcast_convert_type(part, data.dtype)


def exact_carrier(dtype):
    """The unsigned integer dtype a device op (slice, concatenate, pad) must move ``dtype`` as to
    keep every bit: that of its width for floats of 16 bits or fewer, None for any other dtype
    (moved as it is). Use inside jitted code as ``bitcast_convert_type`` there and back."""
    if not jax.numpy.issubdtype(dtype, jax.numpy.floating) or ml_dtypes.finfo(dtype).bits > 16:
        return None   # XLA emulates only narrow floats; a float64 outside enable_x64 has no uint64 to travel as
    return _UINT_OF_BITS[ml_dtypes.finfo(dtype).bits]
