"""The JAX API as it differs between the versions we support (JAX 0.10.2 to 0.12), in one place.

JAX 0.12 deprecates naming ``jax.sharding.SingleDeviceSharding``: shardings on one device are made
with ``make_single_device_sharding`` (there since 0.10) and recognised with
``is_single_device_sharding`` (new in 0.12). Code of this package uses these two functions only.
"""

import jax


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
