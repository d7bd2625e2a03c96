"""Where the bytes of a save's chunks are: the shards of the leaves being saved, found by chunk."""

from __future__ import annotations

import jax
import numpy as np

from dispatch_io import tree as tree_lib
from dispatch_io.plan.save_plan import Plan


class Sources:
    """The device (or host) data of the leaves being saved, found by chunk: the piece on the
    chunk's device that holds its region -- a shard of the leaf, or a region of it another
    process holds, received here (``copies``: a local tier's replicas, ``held.own_plan``).

    References are dropped as soon as a leaf is fully copied, so the trainer's memory is
    not held longer than the copy needs."""

    def __init__(self, plan: Plan, leaves: list, copies: dict[int, tuple] | None = None):
        self._plan = plan
        self._leaves = list(leaves)
        self._copies = dict(copies or {})  # leaf index -> held.Replica's received (a local tier's)
        self._shards: dict[int, dict] = {}

    def parts(self, chunk) -> list[tuple]:
        """[(data, index in data, index in the chunk)]: where the chunk's bytes are -- one shard
        (a jax.Array or np.ndarray) and the slices of it that are the chunk's region, or, for a
        whole-copied leaf (``LeafSpec.whole``), each distinct shard and where it goes. Never
        through the whole array (``np.asarray`` of a sharded array would leave a host copy
        cached on the trainer's array)."""
        spec = self._plan.leaves[chunk.leaf]
        if not spec.whole:
            start, data = self._shard(chunk)
            return [(data, tuple(slice(lo - s, hi - s) for (lo, hi), s in zip(chunk.region, start)), ())]
        parts = {}
        for pieces in self._pieces(chunk.leaf).values():
            for start, data in pieces:  # replicas of a region on several devices: copied once
                where = tuple(slice(s, s + n) for s, n in zip(start, data.shape))
                parts.setdefault(start + data.shape, (data, (), where))
        return list(parts.values())

    def _pieces(self, leaf: int) -> dict:
        """{device id: [(start offsets, data), ...]} of the leaf's shards here (stored shape: PRNG
        keys as their key data) and of the replicas it received (``copies``)."""
        pieces = self._shards.get(leaf)
        if pieces is None:
            value, spec, pieces = self._leaves[leaf], self._plan.leaves[leaf], {}
            if spec.origin != "jax":
                pieces[None] = [((0,) * len(spec.shape), np.asarray(value))]
            else:
                if spec.kind == tree_lib.KEY:
                    value = jax.random.key_data(value)
                for s in value.addressable_shards:
                    pieces.setdefault(s.device.id, []).append((tuple(i.start or 0 for i in s.index), s.data))
                key_dims = (0,) * (len(spec.shape) - len(spec.spec.shape))
                for replica in self._copies.get(leaf, ()):
                    start = tuple(lo for lo, _ in replica.region) + key_dims
                    pieces.setdefault(replica.device.id, []).append((start, replica.data))
            self._shards[leaf] = pieces
        return pieces

    def _shard(self, chunk) -> tuple:
        """(start offsets, data) of the piece on the chunk's device that holds its region."""
        return next((start, data) for start, data in self._pieces(chunk.leaf)[chunk.device]
                    if all(s <= lo and hi <= s + n for (lo, hi), s, n in zip(chunk.region, start, data.shape)))

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

    def drop(self, leaf: int):
        self._shards.pop(leaf, None)
        self._copies.pop(leaf, None)
        self._leaves[leaf] = None
