"""The training state of the 4-process x 2-CPU-device local-tier jobs (``job_local_tier.py``,
``job_fsdp_replicas.py``): a deterministic function of the step, so a restored state is checked
bit for bit against the step it claims, on whatever mesh it was restored onto.

Leaves (sharded over the mesh's ``fsdp`` axis): ``w`` by rows, ``m`` by columns, ``b``
replicated, ``s`` held by process 0 alone (on its two devices: no peer has a copy of it) and,
with ``keys``, ``k``: eight threefry PRNG keys, one per device (stored as their uint32 data).
"""

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

_LEAVES = {"w": ((64, 16), np.float32, P("fsdp", None)), "m": ((16, 64), np.int32, P(None, "fsdp")),
           "b": ((32,), np.float32, P()), "s": ((8, 4), np.float32, None)}
_KEYS = ((8, 2), np.uint32, P("fsdp"))
_BIG = ((4096, 256), np.float32, P("fsdp", None))   # 4 MiB: the bytes a process reads are measurable
_IMPL = "threefry2x32"


@dataclasses.dataclass(frozen=True)
class JobState:
    """The leaves of the state: ``solo`` keeps ``s`` (process 0's alone), ``keys`` adds ``k``,
    ``big`` a 4 MiB ``big`` (sharded by rows)."""

    solo: bool = True
    keys: bool = False
    big: bool = False

    @property
    def specs(self) -> dict:
        """{name: (shape, dtype, partition spec; None: process 0's devices)} of the stored leaves."""
        specs = {n: v for n, v in _LEAVES.items() if self.solo or n != "s"}
        return {**specs, **({"k": _KEYS} if self.keys else {}), **({"big": _BIG} if self.big else {})}

    def value(self, name: str, step: int) -> np.ndarray:
        """Leaf ``name`` (for ``k``: its key data) at ``step``, on the host."""
        shape, dtype, _ = self.specs[name]
        return (np.arange(np.prod(shape)).reshape(shape) * 7 + step * 1000 + len(name)).astype(dtype)

    def state_at(self, mesh, step: int) -> dict:
        """The state at ``step`` as global arrays on ``mesh``."""
        state = {name: jax.make_array_from_callback(shape, sharding(mesh, spec), lambda i, n=name: self.value(n, step)[i],
                                                    dtype=dtype) for name, (shape, dtype, spec) in self.specs.items()}
        if self.keys:
            state["k"] = jax.random.wrap_key_data(state["k"], impl=_IMPL)
        return state

    def target(self, mesh) -> dict:
        """The restore target of the state on ``mesh``."""
        target = {name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding(mesh, spec))
                  for name, (shape, dtype, spec) in self.specs.items()}
        if self.keys:
            target["k"] = jax.ShapeDtypeStruct((8,), jax.random.key(0, impl=_IMPL).dtype,
                                               sharding=sharding(mesh, _KEYS[2]))
        return target

    def exact(self, restored: dict, step: int, cast: dict | None = None) -> bool:
        """Whether every shard this process holds of ``restored`` has the bytes of ``step``'s state
        (``cast``: {name: dtype} of leaves restored as another dtype, compared with the values cast)."""
        return matches(restored, {name: self.value(name, step).astype((cast or {}).get(name, self.specs[name][1]))
                                  for name in self.specs})

    def promoted(self, mgr, step: int, target) -> tuple[int, bool]:
        """Promote ``step`` (from the local copies that survive, each chunk by one holder) to
        ``mgr``'s root and restore it from there onto ``target``: (bytes this process wrote,
        whether what it restored is exact)."""
        written = mgr.promote(step).wait().bytes_written
        return written, self.exact(mgr.restore(step, target), step)


def sharding(mesh, spec):
    """``spec`` over ``mesh``; None: process 0's devices alone."""
    if spec is None:
        return NamedSharding(Mesh(np.array([d for d in jax.devices() if d.process_index == 0]), ("x",)), P("x"))
    return NamedSharding(mesh, spec)


def matches(restored: dict, expected: dict) -> bool:
    """Whether every shard this process holds of ``restored`` has the bytes of ``expected``'s
    (host arrays; a PRNG key leaf is compared by its key data)."""
    def data(array):
        return jax.random.key_data(array) if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key) else array
    return all(np.asarray(shard.data).tobytes() == expected[name][shard.index].tobytes()
               for name, array in restored.items() for shard in data(array).addressable_shards)
