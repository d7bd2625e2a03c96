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
from typing import Sequence


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
