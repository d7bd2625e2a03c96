"""Where the bytes of a save's chunks are: the shards of the leaves being saved, found by chunk."""

from __future__ import annotations

import jax
import numpy as np

from dispatch_io import tree as tree_lib
from dispatch_io.plan import Plan, index_region


class Sources:
    """The device (or host) data of the leaves being saved, found by (leaf, device id).

    References are dropped as soon as a leaf is fully copied, so the trainer's memory is
    not held longer than the copy needs."""

    def __init__(self, plan: Plan, leaves: list):
        self._plan = plan
        self._leaves = list(leaves)
        self._shards: dict[int, dict] = {}

    def parts(self, chunk) -> list[tuple]:
        """[(data, index in data, index in the chunk)]: where the chunk's bytes are -- one shard
        (a jax.Array or np.ndarray) and the slices of it that are the chunk's region, or, for a
        whole-copied leaf (``LeafSpec.whole``), each distinct shard and where it goes. Never
        through the whole array (``np.asarray`` of a sharded array would leave a host copy
        cached on the trainer's array)."""
        spec = self._plan.leaves[chunk.leaf]
        if not spec.whole:
            start, data = self._shard(chunk.leaf, chunk.device)
            return [(data, tuple(slice(lo - s, hi - s) for (lo, hi), s in zip(chunk.region, start)), ())]
        value = self._leaves[chunk.leaf]
        if spec.kind == tree_lib.KEY:
            value = jax.random.key_data(value)
        indices = value.sharding.addressable_devices_indices_map(value.shape)
        parts, seen = [], set()
        for i in range(len(indices)):
            data = value.addressable_data(i)
            index = indices[next(iter(data.devices()))]
            region = index_region(index, value.shape)
            if region not in seen:  # replicas: copied once
                seen.add(region)
                parts.append((data, (), index))
        return parts

    def locate(self, chunk) -> tuple:
        """(data, index): an array holding ``chunk`` and the slices of it that are the chunk's
        region (a whole-copied leaf: assembled on the host from its shards)."""
        parts = self.parts(chunk)
        if len(parts) == 1 and not parts[0][2]:
            return parts[0][:2]
        spec = self._plan.leaves[chunk.leaf]
        whole = np.empty(spec.shape, spec.dtype)
        for data, local, within in parts:
            whole[within] = np.asarray(data)[local]
        return whole, ()

    def _shard(self, leaf: int, device: int | None):
        """(start offsets, data) of the shard on ``device``."""
        shards = self._shards.get(leaf)
        if shards is None:
            value, spec = self._leaves[leaf], self._plan.leaves[leaf]
            if spec.origin != "jax":
                shards = {None: ((0,) * len(spec.shape), np.asarray(value))}
            else:
                if spec.kind == tree_lib.KEY:
                    value = jax.random.key_data(value)
                shards = {s.device.id: (tuple(i.start or 0 for i in s.index), s.data)
                          for s in value.addressable_shards}
            self._shards[leaf] = shards
        return shards[device]

    def drop(self, leaf: int):
        self._shards.pop(leaf, None)
        self._leaves[leaf] = None
