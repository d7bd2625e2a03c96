"""The local tier's plans (pure): what a local save writes, and where a restore reads each region.

A **local save** (:func:`own_plan`) writes, into this process's own directory, every distinct
region of every leaf that this process's devices hold -- once per process, however many of its
devices hold a replica -- and host (numpy) leaves whole, all by this process, plus the regions of
peers it received (``replica_plan``). :func:`local_record` is what it records holding (in its step
info), so that a restore maps copies by what they hold, and how safe the step is.

A **restore** (:func:`plan_restore`) takes plain data: what every process reports holding
(``{process: {step: {key path: [region, ...]}}}``), the persistent steps, the steps a required
durability allows (:func:`eligible`), and what the target wants (``{key path: {region: holder
processes}}``, any mesh); every process computes the same :class:`TierPlan` from it. See
docs/design.md "Tiers".
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Mapping, Sequence

from dispatch_io import tree as tree_lib
from dispatch_io.plan.save_plan import device_regions

LOCAL, PEER, PERSISTENT = "local", "peer", "persistent"
DURABILITY = ("local", "replicated", "persisted")   # what a restore may require, weakest first


def _leaf_holders(tree):
    """(key path, {region: holder processes, or None for host data (every process)}) of every
    stored leaf of ``tree`` (arrays, keys, numpy data), regions as
    :func:`~dispatch_io.plan.save_plan.device_regions` gives them."""
    flat, _ = tree_lib.flatten(tree)
    for keypath, leaf in flat:
        if not hasattr(leaf, "shape") or not math.prod(leaf.shape):  # Python scalars, empty arrays: nothing stored
            continue
        yield keypath, {region: None if devices == [None] else {d.process_index for d in devices}
                        for region, devices in device_regions(getattr(leaf, "sharding", None), leaf.shape).items()}


def _json(region) -> list:
    return [list(bounds) for bounds in region]


def local_record(tree, process: int, count: int, moves: Mapping[str, Sequence[tuple]] | None = None,
                 domains=None, parity: Mapping | None = None) -> dict:
    """What a local step of ``tree`` saved by ``process`` (of ``count``) records in its info, from
    the shardings alone (one pass over the leaves, no device data): ``"sharded"`` {key path:
    [region, ...]} its devices hold (host leaves: every process), ``"held"`` the same with the
    replicas it keeps (``moves[key path][region]``: the replica orders the region was sent by,
    ``replica_plan.replica_orders``, as ``replicas.send`` gives them), regions as JSON ``[[start, stop], ...]`` over the logical
    shape, so a restore maps copies by what they hold; ``"copies"`` / ``"domains"`` the fewest
    processes / failure domains (``domains[process]``; None: one per process) holding any region
    once every process saved it -- k copies survive any k - 1 lost processes, in k domains any
    k - 1 lost hosts --, ``"durability"`` (:func:`durability`) and ``"shapes"`` {key path: the leaf's
    logical shape}, so the job can tell a step whole without a target (:func:`whole_steps`);
    ``"parity"``: the step's parity section (``parity_plan``), if it keeps parity rows."""
    domains = list(range(count)) if domains is None else domains
    sharded: dict[str, list] = {}
    held: dict[str, list] = {}
    shapes: dict[str, list] = {}
    copies, spread = count, len(set(domains))
    for keypath, holders in _leaf_holders(tree):
        shapes[keypath] = [max(stops) for stops in zip(*([hi for _, hi in region] for region in holders))]
        sent = (moves or {}).get(keypath, {})
        for region, base in sorted(holders.items()):
            every = None if base is None else base.union(*({order[p] for p in base} for order in sent.get(region, ())))
            if base is None or process in base:
                sharded.setdefault(keypath, []).append(_json(region))
            if every is None or process in every:
                held.setdefault(keypath, []).append(_json(region))
            if every is not None:
                copies, spread = min(copies, len(every)), min(spread, len({domains[p] for p in every}))
    k = parity["k"] if parity else None
    return {"copies": copies, "domains": spread, "durability": durability(copies, False, k), "sharded": sharded,
            "held": held, "shapes": shapes, **({"parity": parity} if parity else {})}


def durability(copies, persisted: bool, parity: int | None = None) -> str:
    """A step's durability, as its step info states it: ``"persisted"`` (committed in the
    persistent root), ``"replicated k"`` (only local, every region held by ``k >= 2`` processes:
    any ``k - 1`` lost processes lose nothing), ``"parity k"`` (some region held by one process,
    covered by parity of groups of ``k``: one lost process per group loses nothing) or ``"local"``
    (some region held by one process)."""
    if persisted:
        return "persisted"
    if isinstance(copies, int) and copies > 1:
        return f"replicated {copies}"
    return f"parity {parity}" if parity else "local"


def copies_of(info: Mapping) -> int:
    """The copies a restore's required durability counts for a local step's ``info``: its recorded
    ``"copies"`` (1 where it records none or nonsense), or 2 for a step with parity whose rows
    committed (``"committed"``, as ``local_steps.parity_report`` adds it; absent: committed) -- it
    survives a lost process (one per parity group), which is what requiring ``"replicated"`` asks for."""
    copies = info.get("copies") if type(info.get("copies")) is int and info["copies"] >= 1 else 1
    parity = isinstance(info.get("parity"), Mapping) and info.get("committed", True) is True
    return 2 if copies < 2 and parity else copies


def agreed_reports(by_process: Mapping[int, Mapping]) -> list:
    """The reports of one step (``{process: report}``, each with its info's ``"agreed"``) whose
    durability counts: those whose info says the job agreed the step (each records what the job
    reached, rewritten after the agreement); all of them if none does. A process that died between
    the agreement and its rewrite still says one copy, ``"local"``: it must not understate the step."""
    agreed = [r for r in by_process.values() if r.get("agreed", True) is True]
    return agreed or list(by_process.values())


def check_durability(require) -> str:
    """``require`` if it is one of :data:`DURABILITY`; ValueError naming them otherwise."""
    if require not in DURABILITY:
        raise ValueError(f"durability={require!r}: one of {', '.join(map(repr, DURABILITY))} (the weakest "
                         "durability of a step the restore may pick)")
    return require


def eligible(require: str, persistent_steps, copies: Mapping[int, int]) -> set[int]:
    """The steps a restore requiring durability ``require`` may pick: every persistent step, and
    the local steps whose recorded ``copies`` (step -> the fewest processes holding a region)
    meet it (``"local"``: all; ``"replicated"``: 2 or more -- parity steps count 2, :func:`copies_of`;
    ``"persisted"``: none)."""
    least = {"local": 1, "replicated": 2}.get(check_durability(require))
    return set(persistent_steps) | {s for s, n in copies.items() if least is not None and n >= least}


def wanted_regions(target, count: int) -> dict[str, dict]:
    """{key path: {region: sorted holder processes}} of a restore ``target`` (leaves with global
    shardings; host leaves: one region, wanted by all ``count`` processes)."""
    return {keypath: {region: tuple(range(count)) if processes is None else tuple(sorted(processes))
                      for region, processes in holders.items()}
            for keypath, holders in _leaf_holders(target)}


def as_regions(held: Mapping[str, list]) -> dict[str, set]:
    """:func:`local_record`'s held regions (JSON) back as {key path: {region tuple}}."""
    return {keypath: {tuple(tuple(b) for b in region) for region in regions} for keypath, regions in held.items()}


@dataclasses.dataclass(frozen=True)
class Route:
    """Where one region of the result comes from. ``own``: the holders that read their own local
    copy. ``receivers``: the holders without one, which get it from ``kind``: PEER (``reader``'s
    local copy, delivered to them) or PERSISTENT (the persistent step, read by one of the
    receivers and delivered to the others); None when every holder has one."""

    own: tuple[int, ...]
    kind: str | None = None
    receivers: tuple[int, ...] = ()
    reader: int | None = None          # PEER: whose copy is read (a holder's if any has one)
    # PEER from copies of other regions (a restore onto another mesh): ((part, its holders), ...)
    # whose parts make up the region; each piece is read by a holder of its part.
    parts: tuple = ()


@dataclasses.dataclass(frozen=True)
class TierPlan:
    """The step to restore and, per key path and region, its :class:`Route`."""

    step: int
    routes: dict                       # key path -> {region: Route}
    persisted: bool                    # the step is also in persistent storage

    def regions(self, kind: str) -> int:
        """How many regions are read for someone who lacks them from ``kind`` (PEER / PERSISTENT)."""
        return sum(r.kind == kind for regions in self.routes.values() for r in regions.values())


def _route(region, holders: tuple, local: dict, persisted: bool, load: Mapping[int, int]) -> Route | None:
    """The route of one region, or None if no source has it. ``local``: process -> the regions
    it holds locally at the step (of this leaf); ``load``: regions each process reads for others."""
    own = tuple(p for p in holders if region in local.get(p, ()))
    missing = tuple(p for p in holders if p not in own)
    if not missing:
        return Route(own)
    # A holder's copy first (it travels within the region's holders), else anyone's (a process
    # that held the region before a restart with permuted process ids or on another mesh).
    copies = own or tuple(sorted(p for p, regions in local.items() if region in regions))
    if copies:
        return Route(own, PEER, missing, min(copies, key=lambda p: (load[p], p)))
    parts = _cover(region, local)   # copies saved on another mesh: the region cut from several
    if parts:  # a holder with every part reads it itself; the others receive it, part by part
        whole = tuple(p for p in holders if all(p in procs for _, procs in parts))
        rest = tuple(p for p in holders if p not in whole)
        return Route(whole, PEER, rest, parts=parts) if rest else Route(whole)
    return Route((), PERSISTENT, holders) if persisted else None


def _cover(region, local: dict) -> tuple | None:
    """((part, sorted processes holding it), ...): ``region`` cut into its intersections with the
    regions processes hold locally (``local``: process -> regions), if they make it up whole; else
    None. Held regions of one step come from one sharding: disjoint or equal (an overlap is skipped)."""
    held = collections.defaultdict(set)
    for p, regions in local.items():
        for r in regions:
            held[r].add(p)
    parts, volume = [], 0
    for r in sorted(held):
        part = tuple((max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(r, region))
        if all(lo < hi for lo, hi in part) and not any(_overlap(part, q) for q, _ in parts):
            parts.append((part, tuple(sorted(held[r]))))
            volume += math.prod(hi - lo for lo, hi in part)
    return tuple(parts) if parts and volume == math.prod(hi - lo for lo, hi in region) else None


def _overlap(a, b) -> bool:
    return all(max(lo, x) < min(hi, y) for (lo, hi), (x, y) in zip(a, b))


def plan_restore(wanted: Mapping[str, Mapping[tuple, tuple]], reports: Mapping[int, Mapping[int, Mapping]],
                 persistent_steps, candidates=None) -> TierPlan | None:
    """The newest step all of whose wanted regions are available, and their routes; None if no
    step is (then nothing local or persistent can be restored onto this target).

    Args:
      wanted: key path -> {region: sorted holder processes} of the restore's target.
      reports: process -> {step: {key path: set of regions held locally}} (:func:`as_regions`).
      persistent_steps: the steps committed in persistent storage (every region available).
      candidates: the steps it may pick (:func:`eligible`); None: any.

    A holder with its own copy reads it; the others get it from another process's copy (PEER:
    a holder's if any has one, else any process's, the least loaded reader; for a target on
    another mesh, from the copies whose regions make it up: ``Route.parts``), or, if no process
    has one, from persistent storage (PERSISTENT). Copies are matched by the regions they hold,
    never by process index: process ids permuted on a restart lose nothing."""
    persistent = set(persistent_steps)
    steps = persistent | {s for held in reports.values() for s in held}
    steps = steps if candidates is None else steps & set(candidates)
    for step in sorted(steps, reverse=True):
        routes, complete, load = {}, True, collections.Counter()
        for keypath, regions in wanted.items():
            local = {p: held[step].get(keypath, ()) for p, held in reports.items() if step in held}
            routes[keypath] = {}
            for region, holders in regions.items():
                route = _route(region, tuple(holders), local, step in persistent, load)
                if route is None:
                    complete = False
                    break
                if route.reader is not None:
                    load[route.reader] += 1
                routes[keypath][region] = route
            if not complete:
                break
        if complete:
            return TierPlan(step, routes, step in persistent)
    return None


def whole_steps(reports: Mapping[int, Mapping[int, Mapping]], persistent_steps) -> dict[int, str]:
    """{step: its durability} of the steps a job can restore whole, ascending: every persistent step
    (``"persisted"``), and each local step every region of which some process reports holding
    (:func:`durability` of the fewest copies any process recorded for it).

    ``reports``: process -> {step: {"held": {key path: [region, ...]} (:func:`local_record`'s JSON),
    "shapes": {key path: shape}, "copies": int, "parity": its parity section, if any, "committed": whether
    its parity rows are}} (``"parity k"`` only where every process's are). A local step is whole if,
    for every leaf of the shapes any process recorded, the regions all processes hold make up the
    whole leaf (:func:`_cover`: on any mesh); a step no process recorded shapes for is not listed (a restore with a target still
    finds it)."""
    steps = {step: durability(None, True) for step in persistent_steps}
    local = collections.defaultdict(dict)   # step -> {process: its report}
    for process, held in reports.items():
        for step, report in held.items():
            local[step][process] = report
    for step, by_process in local.items():
        shapes = next((r.get("shapes") for r in by_process.values() if isinstance(r.get("shapes"), dict)), None)
        if shapes is None or step in steps:
            continue
        held = {p: as_regions(r.get("held", {})) for p, r in by_process.items()}
        if all(isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape) for shape in shapes.values()) \
                and all(_cover(tuple((0, n) for n in shape), {p: h.get(keypath, ()) for p, h in held.items()})
                        for keypath, shape in shapes.items()):
            counted = agreed_reports(by_process)
            copies = [r.get("copies") for r in counted]
            parity = [r.get("parity") if r.get("committed", True) else None for r in counted]
            steps[step] = durability(min((c for c in copies if type(c) is int), default=None)
                                     if all(type(c) is int for c in copies) else None, False,
                                     parity[0].get("k") if all(isinstance(x, Mapping) for x in parity) else None)
    return dict(sorted(steps.items()))
