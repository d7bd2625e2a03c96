"""Where a local tier's replicas go (pure): which processes keep copies of which regions.

A local step holds what each process's devices hold; a region held by fewer than
``replicas + 1`` processes is also sent to peers (``manager/replicas.py`` moves the bytes).
:func:`replica_orders` says where: one permutation of the processes per replica, each copy in
another failure domain (host) than the original while the domains allow. :func:`replica_variants`
gives alternatives to those orders that keep the same rule, and :func:`assign_variants` gives each leaf one
of them, balancing bytes, and :func:`by_place` splits each leaf's regions among them by device
place, so that what a process holds is copied to several peers, not one: a lost process's share
is then read back by several holders at once. :func:`replicas_needed` says how
many of a variant's orders a leaf needs (data-parallel replicas already count). A received region
is a :class:`Replica`; ``Dispatcher.save(own=True, copies=...)`` saves them with the process's own
regions (:func:`copies_by_leaf` checks them against the plan).
"""

from __future__ import annotations

import collections
from typing import Mapping, Sequence

SPREAD = 4   # the most variants: each is one more collective per group of leaves at a save


def _cycle(domains: Sequence) -> tuple[list[int], int]:
    """(the processes ordered domain by domain, in order of each domain's first process; the size
    of the largest domain)."""
    first: dict = {}
    for p, domain in enumerate(domains):
        first.setdefault(domain, p)
    return sorted(range(len(domains)), key=lambda p: (first[domains[p]], p)), max(collections.Counter(domains).values())


def _shifted(order: list[int], shift: int) -> tuple[int, ...]:
    """The permutation sending the process at place i of ``order`` to the one ``shift`` places on."""
    perm = [0] * len(order)
    for i, p in enumerate(order):
        perm[p] = order[(i + shift) % len(order)]
    return tuple(perm)


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
    order, m = _cycle(domains)
    return [_shifted(order, shift) for shift in _shifts(count, m, replicas)]


def _shifts(count: int, m: int, replicas: int) -> list[int]:
    """How many places on (:func:`_cycle`'s order) each replica goes: ``j * m``, then the nearest other places."""
    shifts = [j * m for j in range(1, count) if j * m < count]
    return (shifts + [k for k in range(1, count) if k not in shifts])[:replicas]


def _quality(domains: Sequence, orders: Sequence[tuple[int, ...]]) -> tuple[int, int] | None:
    """(the fewest failure domains any process's region and its replicas span, their sum over the
    processes) under ``orders``; None if some replica of a process lands on it or two on one process."""
    spans = []
    for p in range(len(domains)):
        places = [p] + [order[p] for order in orders]
        if len(set(places)) < len(places):
            return None
        spans.append(len({domains[q] for q in places}))
    return min(spans), sum(spans)


def replica_variants(domains: Sequence, replicas: int, most: int = SPREAD) -> list[tuple[tuple[int, ...], ...]]:
    """Alternative replica orders, each a tuple of ``replicas`` permutations like
    :func:`replica_orders` (the first variant: those orders), at most ``most``. Every variant keeps
    the rule: no replica of a process on itself, its replicas on distinct processes, spanning as
    many failure domains as :func:`replica_orders` does (the fewest over the processes, and in
    all). And each gives every process a first replica holder no other variant gives it, so
    leaves sent by different variants (:func:`assign_variants`) put a process's share on several peers.

    Candidates: the base orders shifted a further ``v`` places along the domain-by-domain order,
    each relabeled by rotating the processes within every domain ``r < most`` places (a relabeling that
    keeps domains keeps every domain property); those that keep the rule, in that order. For
    domains 0, 0, 1, 1 (two hosts of two): ``(2, 3, 0, 1)`` and ``(3, 2, 1, 0)``; for one
    process per domain, or one domain, shifts by 1, 2, 3, ... (up to ``most``).
    ValueError as :func:`replica_orders`."""
    base = tuple(replica_orders(domains, replicas))
    order, m = _cycle(domains)
    members = collections.defaultdict(list)
    for p in order:
        members[domains[p]].append(p)
    least, total = _quality(domains, base)
    found = [base]
    for v in range(len(order)):
        for r in range(min(m, most)):   # bounds the search: O(most * processes) candidates of O(processes) each
            if len(found) >= most:
                return found
            rotate = {p: group[(i + r) % len(group)] for group in members.values() for i, p in enumerate(group)}
            variant = tuple(tuple(rotate[q] for q in _shifted(order, shift + v))
                            for shift in _shifts(len(order), m, replicas))
            if any(variant[0][p] == other[0][p] for other in found for p in order):
                continue
            quality = _quality(domains, variant)
            if quality is not None and quality[0] >= least and quality[1] >= total:
                found.append(variant)
    return found


def assign_variants(shares: Sequence[Mapping[int, int]], allowed: Sequence[Sequence[int]]) -> list[int]:
    """Which variant (:func:`replica_variants`) each leaf is sent by: ``shares[i]`` {process:
    bytes of leaf ``i`` it holds}, ``allowed[i]`` the variants leaf ``i`` may take (those needing
    the fewest replicas for it). Largest leaf first, each onto the allowed variant under which its
    holders have sent the fewest bytes so far (the most any of them has; then in all; then the
    first): every process's share is split among its variants' peers within one leaf's share.
    Deterministic (every process computes the same plan: it orders collectives). A leaf's own
    regions are split further by device place (:func:`by_place`), so a state of one giant leaf
    spreads too where a process has several devices."""
    load: dict = collections.defaultdict(int)   # (variant, process) -> bytes sent so far
    chosen = [0] * len(shares)
    for i in sorted(range(len(shares)), key=lambda i: (-sum(shares[i].values()), i)):
        share = shares[i]
        chosen[i] = min(allowed[i], key=lambda v: (max((load[v, p] + n for p, n in share.items()), default=0),
                                                   sum(load[v, p] for p in share), v))
        for p, n in share.items():
            load[chosen[i], p] += n
    return chosen


def by_place(variant: int, allowed: Sequence[int], places: int) -> tuple[int, ...]:
    """The variant each device place (a device's index among its process's) sends a leaf by:
    place ``i`` takes the ``i``-th of ``allowed`` on from the leaf's ``variant``
    (:func:`assign_variants`), cyclically. A process's devices then send their regions of one
    leaf to as many peers as it has places (up to the variants allowed): a state of one giant
    leaf, sharded over every device, is read back by several holders after a lost process.
    Each region keeps the rule as long as all its holders are at one place (the caller checks:
    otherwise every place takes ``variant``). For allowed ``[0, 1]``, variant 1, 4 places:
    ``(1, 0, 1, 0)``."""
    start = list(allowed).index(variant)
    return tuple(allowed[(start + i) % len(allowed)] for i in range(places))


def leaf_plans(shares: Sequence[Mapping[int, int]], allowed: Sequence[Sequence[int]], splittable: Sequence[bool],
               places: int) -> list[tuple[int, ...]]:
    """The variant each device place sends each leaf by: :func:`assign_variants` gives each leaf
    one (``shares``, ``allowed`` as there), :func:`by_place` splits it among ``places`` places
    where ``splittable[i]`` (its regions may go by different variants); else every place takes
    the leaf's. What ``replicas.send`` moves, and what ``benchmarks/tier_scale.py`` plans for a
    thousand processes."""
    chosen = assign_variants(shares, allowed)
    return [by_place(v, options, places) if split else (v,) * places
            for v, options, split in zip(chosen, allowed, splittable)]


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
