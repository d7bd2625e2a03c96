"""Where a local tier's replicas go (pure): which processes keep copies of which regions.

A local step holds what each process's devices hold; a region held by fewer than
``replicas + 1`` processes is also sent to peers (``manager/replicas.py`` moves the bytes).
:func:`replica_orders` says where: one permutation of the processes per replica, each copy in
another failure domain (host) than the original while the domains allow. :func:`replicas_needed`
says how many of them a leaf needs (data-parallel replicas already count). A received region is
a :class:`Replica`; ``Dispatcher.save(own=True, copies=...)`` saves them with the process's own
regions (:func:`copies_by_leaf` checks them against the plan).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Mapping, Sequence

from dispatch_io.plan import device_regions


@dataclasses.dataclass(frozen=True)
class Replica:
    """A region of a leaf that another process holds, received on one of this process's devices:
    ``region`` ((start, stop), ...) over the leaf's logical shape, ``data`` its values there (a
    jax.Array of the region's shape; PRNG keys as their key data)."""

    device: Any
    region: tuple
    data: Any


def replica_orders(domains: Sequence, replicas: int) -> list[tuple[int, ...]]:
    """Where each process's state is copied, one permutation per replica: ``orders[j][p]`` is the
    process that holds replica ``j`` of what process ``p`` holds (``domains[p]``: its failure
    domain, e.g. its host). Processes are ordered domain by domain; replica ``j`` goes ``j * m``
    places on in that order (``m``: the largest domain's size), so, while no domain has more than
    half the processes, every copy lands in another domain than the original (further replicas,
    when ``j * m`` wraps, on the nearest other places). ValueError if there are too few processes."""
    count = len(domains)
    if not 0 < replicas < count:
        raise ValueError(f"replicas={replicas}: every region held by {replicas + 1} processes needs as many "
                         f"processes; the job has {count}")
    first: dict = {}
    for p, domain in enumerate(domains):
        first.setdefault(domain, p)
    order = sorted(range(count), key=lambda p: (first[domains[p]], p))
    m = max(collections.Counter(domains).values())
    shifts = [j * m for j in range(1, count) if j * m < count]
    shifts += [k for k in range(1, count) if k not in shifts]
    orders = []
    for shift in shifts[:replicas]:
        perm = [0] * count
        for i, p in enumerate(order):
            perm[p] = order[(i + shift) % count]
        orders.append(tuple(perm))
    return orders


def replicas_needed(holders: Sequence[set], orders: Sequence[tuple[int, ...]], replicas: int,
                    domains: Sequence | None = None) -> int:
    """How many of ``orders`` (:func:`replica_orders`), taken in turn, a leaf whose regions are
    held by the process sets ``holders`` needs for every region to be held by ``replicas + 1``
    processes in ``replicas + 1`` failure domains (``domains[process]``; as many as there are,
    if fewer; None: one per process) -- all of them if that is never reached. Data-parallel
    replicas count, in as many domains as they span (two processes of one host are one)."""
    domains = range(max((p for h in holders for p in h), default=0) + 1) if domains is None else domains
    spread = min(replicas + 1, len(set(domains)))
    held = [set(h) for h in holders]
    for k, perm in enumerate([None, *orders]):
        if perm is not None:
            held = [h | {perm[p] for p in base} for h, base in zip(held, holders)]
        if all(len(h) > replicas and len({domains[p] for p in h}) >= spread for h in held):
            return k
    return len(orders)


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
