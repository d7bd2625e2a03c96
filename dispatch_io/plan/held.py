"""A save of what one process holds (pure): the plan a local-tier save writes.

A job-wide save writes each distinct region once, from the least loaded holder. A **held save**
(``Dispatcher.save(own=True)``) writes instead, into this process's own directory, every distinct
region its devices hold (once, however many of its devices hold a replica) and every host leaf
whole, plus regions of other processes it received as :class:`Replica` objects. The local tier
(``dispatch_io.manager.tiers``) decides which processes keep which copies; this module only
turns a job-wide :class:`~dispatch_io.plan.save_plan.Plan` into the held one and checks received copies.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from dispatch_io.plan.save_plan import Plan, device_regions, plan_chunks


@dataclasses.dataclass(frozen=True)
class Replica:
    """A region of a leaf that another process holds, received on one of this process's devices:
    ``region`` ((start, stop), ...) over the leaf's logical shape, ``data`` its values there (a
    jax.Array of the region's shape; PRNG keys as their key data)."""

    device: Any
    region: tuple
    data: Any



def _held_by(devices, process: int) -> list:
    """The devices of ``devices`` that are ``process``'s (host data, device None: every process's)."""
    return [d for d in devices if d is None or d.process_index == process]


def own_plan(plan: Plan, process: int, copies: Mapping[int, Sequence[Replica]] | None = None) -> Plan:
    """``plan`` (a job-wide save plan, unpacked) made a local save's: each region ``process``'s
    devices hold (and every host leaf), one chunk grid each, all written by ``process``. Leaves
    copied whole keep one chunk (their regions are all on one process). ``copies``: leaf index ->
    the :class:`~dispatch_io.plan.held.Replica` objects of other processes' regions on this
    process's devices: those regions are saved too (from the replicas: ``sources.Sources``)."""
    copies = copies or {}

    def regions_of(spec):
        held = device_regions(spec.spec.sharding, spec.spec.shape)
        if spec.whole:
            devices = _held_by(spec.spec.sharding.device_set, process) or [r.device for r in copies.get(spec.index, ())]
            return {tuple((0, n) for n in spec.spec.shape): [min(devices, key=lambda d: d.id)]} if devices else {}
        regions = {region: _held_by(devices, process) for region, devices in held.items()}
        regions = {region: devices for region, devices in regions.items() if devices}
        own = set(regions)
        for replica in copies.get(spec.index, ()):  # a region it holds itself is saved from its own shard
            if replica.region not in own:
                regions.setdefault(replica.region, []).append(replica.device)
        return regions

    chunks = tuple(dataclasses.replace(c, worker=process) for c in plan_chunks(plan.leaves, regions_of))
    return dataclasses.replace(plan, chunks=chunks)



def copies_by_leaf(plan, copies: Mapping[str, Sequence[Replica]] | None, own: bool) -> dict[int, tuple]:
    """``Dispatcher.save``'s ``copies`` (key path -> :class:`Replica` objects received) by leaf index.
    ValueError without ``own`` (a job-wide save writes each region once anyway), for a key path
    that is not an array leaf of ``plan``, a replica whose region is not one of the leaf's
    sharding, or whose data is not its region's shape and the stored dtype."""
    if not copies:
        return {}
    if not own:
        raise ValueError("copies= (replicas of other processes' regions) is for a local-tier save (own=True)")
    leaves = {leaf.keypath: leaf for leaf in plan.leaves if leaf.origin == "jax" and leaf.storage is not None}
    by_leaf = {}
    for keypath, replicas in copies.items():
        if keypath not in leaves:
            raise ValueError(f"copies: {keypath} is not a stored array leaf of the tree being saved")
        spec = leaves[keypath]
        key_dims = spec.shape[len(spec.spec.shape):]
        regions = device_regions(spec.spec.sharding, spec.spec.shape)
        for r in replicas:
            if r.region not in regions:  # another region would be written over the leaf's own
                raise ValueError(f"copies: a replica of {keypath} holds {list(r.region)}, not a region of the "
                                 f"leaf's sharding")
            shape = tuple(hi - lo for lo, hi in r.region) + tuple(key_dims)
            if tuple(r.data.shape) != shape or r.data.dtype != spec.dtype or not math.prod(shape):
                raise ValueError(f"copies: a replica of {keypath} {list(r.region)} is {r.data.dtype}"
                                 f"{list(r.data.shape)}, not {spec.dtype}{list(shape)}")
        by_leaf[spec.index] = tuple(replicas)
    return by_leaf
