"""Parity in the local tier (pure): which process keeps the XOR of which pieces, and what a lost
process's regions can be rebuilt from.

With ``LocalTier(parity=k)``, the regions one process alone holds survive one lost process per
parity group at (1 + 1/k)x local storage (``replicas=1``: 2x). The processes stand in a **ring**
(:func:`ring`: failure domains interleaved, so neighbours are on other hosts while the domains
allow), positions ``t = 0..n-1``. Each device's protected bytes form a **row** (``rows.py``;
per device position ``i``: the index of the device among its process's devices sorted by id):
the bytes of every protected leaf's shard there, each padded to the leaf's largest shard, the row
padded to a multiple of ``k`` and cut into ``k`` pieces of ``W / k`` bytes. The process at
position ``t`` holds the **parity row** ``P_t = XOR_j piece j of the row of position t + j + 1``
(:func:`members`). So each piece of each process is covered once, by a holder that is not in the
group it covers (``k <= n - 1``); a lost process at ``p`` has its piece ``j`` back as ``P_{p-j-1}``
XOR the pieces of the ``k - 1`` other members of that group (:func:`sources`).

What a step records (its info's ``"parity"`` section, ``parity.record``): ``k``, the ``ring``,
the row ``groups`` (each: the leaves, their byte ``offsets`` and ``widths`` in the row, their
``itemsize`` and key-data ``trail`` dimensions, ``W``), and the ``layouts`` -- per process (itself
and the ``k`` members it covers), per group and device position, the region of each leaf that
device holds (JSON, None where it holds none) -- so a lost process's layout survives on its holders.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from dispatch_io.manager.tiers import placement


def check(k, count: int | None, replicas: int = 0) -> int:
    """``k`` if a job of ``count`` processes (None: not known yet) can keep parity of groups of
    ``k`` (an integer >= 2, ``k + 1 <= count``, no replicas too); ValueError naming what to choose
    otherwise."""
    if type(k) is not int or k < 2:
        raise ValueError(f"LocalTier(parity={k!r}): an integer >= 2, the processes a parity row covers "
                         "(0 or None: no parity; for a full copy of each region, parity=1 would be replicas=1: use that)")
    if replicas:
        raise ValueError(f"LocalTier(parity={k}, replicas={replicas}): choose one -- replicas (full copies: "
                         "survive any `replicas` lost processes) or parity (one lost process per group, at 1/k "
                         "the storage)")
    if count is not None and count < k + 1:
        raise ValueError(f"LocalTier(parity={k}) needs at least {k + 1} processes (each parity row covers {k} "
                         f"others); the job has {count}: use a smaller parity, or replicas=1")
    return k


def ring(domains: Sequence) -> tuple[int, ...]:
    """The processes in ring order: round-robin over the failure domains (``domains[process]``),
    in the order each first appears, so consecutive positions are in other domains while every
    domain has processes left."""
    by_domain: dict = {}
    for p, domain in enumerate(domains):
        by_domain.setdefault(domain, []).append(p)
    queues, order = list(by_domain.values()), []
    while any(queues):
        for queue in queues:
            if queue:
                order.append(queue.pop(0))
    return tuple(order)


def members(order: Sequence[int], k: int) -> dict[int, tuple[int, ...]]:
    """{holder: the ``k`` processes whose pieces its parity row covers}: ``members[h][j]`` is the
    process at position ``pos(h) + j + 1`` (its piece ``j`` is in ``h``'s row)."""
    n = len(order)
    return {h: tuple(order[(t + j + 1) % n] for j in range(k)) for t, h in enumerate(order)}


def sources(order: Sequence[int], k: int, lost: int) -> list[tuple[int, int, tuple]]:
    """How ``lost``'s pieces come back: for each piece ``j``, (j, its holder, ((member, the piece
    of that member's row in the holder's parity), ...) of the ``k - 1`` other members)."""
    covered = members(order, k)
    n, t = len(order), list(order).index(lost)
    found = []
    for j in range(k):
        holder = order[(t - j - 1) % n]
        found.append((j, holder, tuple((m, i) for i, m in enumerate(covered[holder]) if i != j)))
    return found


def transfers(order: Sequence[int], k: int, lost) -> tuple[list, list]:
    """The rounds that bring the ``lost`` processes' pieces back (at most one lost per group): (early,
    late), each a list of rounds, a round a tuple of transfers (sender, receiver, lost process, its
    piece ``j``, the piece of the sender's row it XORs in -- None for the holder's parity row) in
    which a process sends at most once and receives at most once (one collective permute a round).
    Each lost piece comes back along a chain: its holder sends its parity row to the group's first
    other member (early: it needs no member's row; ``rebuild`` runs it once the members' pieces are
    packed too, the late rounds right after); each member XORs in its own piece and sends the sum on,
    the last to the lost process (late).
    Every transfer carries one piece, so a lost process receives its share once, whatever ``k``;
    after the members' rows are in hand, ``k - 2`` rounds along the chains, then ``k`` into each
    lost process."""
    early, chains = [], []
    for p in sorted(lost):
        for j, holder, others in sources(order, k, p):
            hops = [holder] + [m for m, _ in others] + [p]
            early.append((holder, hops[1], p, j, None))
            chains.append([(hops[t], hops[t + 1], p, j, others[t - 1][1]) for t in range(1, len(hops) - 1)])
    late: list[list] = []
    after = [0] * len(chains)   # the round each chain's next hop may go in at the earliest
    for t in range(max(map(len, chains), default=0)):
        for c, chain in enumerate(chains):
            if t < len(chain):
                after[c] = _place(late, chain[t], after[c]) + 1
    return _place_all(early), [tuple(r) for r in late]


def _place(rounds: list[list], move: tuple, earliest: int = 0) -> int:
    """Put ``move`` (sender, receiver, ...) in the first round of ``rounds`` from ``earliest`` on in
    which its sender sends nothing and its receiver receives nothing (a new one at the end if none);
    its index."""
    r = earliest
    while r < len(rounds) and any(move[0] == m[0] or move[1] == m[1] for m in rounds[r]):
        r += 1
    while len(rounds) <= r:
        rounds.append([])
    rounds[r].append(move)
    return r


def _place_all(moves: list[tuple]) -> list[tuple]:
    """``moves`` packed in order into the fewest rounds a greedy pass finds (:func:`_place`)."""
    rounds: list[list] = []
    for move in moves:
        _place(rounds, move)
    return [tuple(r) for r in rounds]


def storage(section: Mapping, own: int) -> int:
    """The bytes of parity rows a process keeps for a step (``section``: its ``"parity"`` record,
    ``own``: its devices): ``W / k`` per group and device -- (1 + 1/k)x its share, with the share."""
    return sum(group["W"] // section["k"] for group in section["groups"]) * own


def _regions(section: Mapping, process: int) -> dict[str, set] | None:
    """{key path: regions} that ``process``'s protected rows hold, by its recorded layout (None if
    ``section`` records none for it)."""
    layout = section.get("layouts", {}).get(str(process))
    if layout is None:
        return None
    found: dict[str, set] = {}
    for group, by_device in zip(section["groups"], layout):
        for regions in by_device:
            for keypath, region in zip(group["leaves"], regions):
                if region is not None:
                    found.setdefault(keypath, set()).add(tuple(tuple(b) for b in region))
    return found


def rebuildable(reports: Mapping[int, Mapping], count: int) -> dict[int, dict[str, set]]:
    """{lost process: {key path: regions}} of the processes without a copy of a step whose
    protected regions parity rebuilds. ``reports``: {process: {"held": {key path: set of regions},
    "parity": its step's parity section, or None, "committed": whether its parity rows are,
    "process": the process that saved its copy}} of the processes with a copy (of ``count``). A
    lost process is rebuilt when every holder of its pieces has committed parity rows and every
    other member of those groups holds its own protected regions (the regions its own layout
    records); one lost process per group. Nothing is rebuilt where a copy was saved by another
    process (ids permuted on a restart): parity rows and layouts are of their saver's place in the
    ring, and the XOR of another place's rows is not the lost regions."""
    if any(r.get("process", p) != p for p, r in reports.items()):
        return {}
    sections = {p: r["parity"] for p, r in reports.items() if isinstance(r.get("parity"), Mapping)}
    if not sections:
        return {}
    first = sections[min(sections)]
    order, k = tuple(first["ring"]), first["k"]
    if sorted(order) != list(range(count)):
        return {}
    found = {}
    for lost in (p for p in range(count) if p not in reports):
        layout = next((_regions(s, lost) for s in sections.values() if _regions(s, lost) is not None), None)
        if layout is None:
            continue
        whole = True
        for _, holder, others in sources(order, k, lost):
            if not reports.get(holder, {}).get("committed") or holder not in sections:
                whole = False
            for member, _ in others:
                own = _regions(sections.get(member, {}), member)
                held = reports.get(member, {}).get("held", {})
                if own is None or any(not regions <= set(held.get(kp, ())) for kp, regions in own.items()):
                    whole = False
        if whole:
            found[lost] = layout
    return found


def spans(group: Mapping, regions: Sequence) -> list[tuple[str, tuple, int, int]]:
    """(key path, region, byte offset in the row, bytes) of each leaf of ``group`` a device holds
    (``regions``: its layout there, a region or None per leaf)."""
    found = []
    for keypath, region, offset, itemsize, trail in zip(group["leaves"], regions, group["offsets"],
                                                        group["itemsize"], group["trail"]):
        if region is not None:
            region = tuple(tuple(b) for b in region)
            found.append((keypath, region, offset, math.prod(hi - lo for lo, hi in region) * math.prod(trail) * itemsize))
    return found


def touched(offset: int, nbytes: int, width: int, k: int) -> set[int]:
    """The pieces (indices ``j`` of ``k``, each ``width`` bytes) of a row that its bytes
    ``offset .. offset + nbytes`` fall in (none for no bytes)."""
    return {j for j in range(k) if nbytes and offset < (j + 1) * width and j * width < offset + nbytes}


def carried(i: int, offset: int, nbytes: int, width: int, pieces) -> list[tuple[int, slice, slice]]:
    """Where the bytes ``offset .. offset + nbytes`` of device position ``i``'s row travel: for each
    piece ``j`` of ``pieces`` (indices, each ``width`` bytes) they have a byte in, in order, (j, their
    place in the transfer of piece j -- every device position's piece j in turn --, their place in
    those bytes). What a member packs its pieces by and a lost process cuts its regions by."""
    found = []
    for j in sorted(pieces):
        lo, hi = max(offset, j * width), min(offset + nbytes, (j + 1) * width)
        if lo < hi:
            at = i * width - j * width
            found.append((j, slice(at + lo, at + hi), slice(lo - offset, hi - offset)))
    return found


def hit(group: Mapping, regions: Sequence, k: int, pieces: set) -> list[tuple[str, tuple]]:
    """(key path, region) of the leaves in ``regions`` (as :func:`spans`) with a byte in one of the
    ``pieces`` (indices ``j``) of ``group``'s row: what a bad piece loses."""
    width = group["W"] // k
    return [(keypath, region) for keypath, region, offset, nbytes in spans(group, regions)
            if touched(offset, nbytes, width, k) & set(pieces)]


def rebuilt_steps(reports: Mapping[int, Mapping[int, Mapping]], count: int) -> dict[int, dict[int, dict[str, set]]]:
    """{step: {lost process: {key path: regions}}} parity rebuilds (:func:`rebuildable`), from each
    process's reports: {process: {step: {"held": {key path: [region, ...]} (JSON), "parity": the
    step's parity section or None, "committed": whether its parity rows are, "process": its saver}}}."""
    by_step: dict = {}
    for p, steps in reports.items():
        for step, report in steps.items():
            by_step.setdefault(step, {})[p] = {**report, "held": placement.as_regions(report.get("held") or {})}
    found = {step: rebuildable(present, count) for step, present in by_step.items()}
    return {step: lost for step, lost in found.items() if lost}
