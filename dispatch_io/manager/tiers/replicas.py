"""Replicas in the local tier: copies, on peer processes, of the regions too few processes hold.

A local save writes what each process's devices hold, so a region held by one process (pure
FSDP state, a leaf on one process's devices) is lost with that process. With
``LocalTier(replicas=k)`` every region is held by ``k + 1`` processes once the save commits:

* where: :func:`placement` orders the processes by failure domain (``LocalTier.domains``,
  default their host names) and gives ``k`` permutations (``replica_plan.replica_orders``):
  replica ``j`` of what process ``p`` holds goes to process ``orders[j][p]``, in another
  domain while the domains allow -- and up to ``replica_plan.SPREAD`` variants of them that keep
  that rule with other peers (``replica_plan.replica_variants``);
* what: :func:`send` takes, leaf by leaf, as many of those permutations as the leaf needs --
  none where data parallelism already spreads each region over ``k + 1`` processes
  (``replica_plan.replicas_needed``) -- from the variant ``replica_plan.assign_variants`` gives
  it (balancing bytes, so each process's share is split over several peers and a lost
  process's share is read back by several holders at once), each device place of a process by
  the next allowed variant (``replica_plan.by_place``: a state of one giant leaf spreads too), and
  moves each shard of the leaf from its device to the device in the same place on the peer
  process. Each process then saves, with its own
  regions, the regions it received (``Dispatcher.save(own=True, copies=...)``): one local
  step per process holding both, its info listing them.

The move is device to device over the interconnect (gloo on CPU, ICI / NVLink on
accelerators), one collective per variant, replica and group of leaves of one dtype: each device packs
its shards of the group, flattened and padded to their leaf's largest shard, into one row (of
at most about ``packed_rows.ROW_BYTES``) of an array over all the job's devices, and ``jax.device_put``
onto the same devices permuted delivers each row to its peer -- whatever the leaves' shardings,
even a leaf on a subset of the devices. Packing and unpacking are one jitted call per device.
All of it is dispatched asynchronously by the thread calling ``save``, in the same order on
every process, like the training step's own collectives, so it never races them; every process
must therefore take the same local saves (:func:`decisions`). Its costs: the interconnect
bandwidth of each process's unreplicated share per replica, and device memory for the rows in
flight (about three rows) and the received regions until the save has staged them to the host
(the same staging budget as any save).
"""

from __future__ import annotations

import collections
import math
from typing import Mapping

import jax
import numpy as np
from absl import logging

from dispatch_io.manager.tiers import parity_plan, replica_plan, packed_rows
from dispatch_io import tree as tree_lib
from dispatch_io.multihost.coordination import open_room
from dispatch_io.manager.decisions import SharedDecisions
from dispatch_io.plan.save_plan import device_regions
from dispatch_io.plan.held import Replica


def domains_of(domains) -> tuple:
    """``LocalTier(domains=...)`` as a tuple indexed by process: a sequence as it is, a mapping
    {process: domain} by its keys 0..n-1; each domain hashable (lists, e.g. a (rack, host) pair
    from a JSON config, become tuples). TypeError / ValueError naming ``domains`` otherwise."""
    if isinstance(domains, Mapping):
        if sorted(domains) != list(range(len(domains))):
            raise ValueError(f"LocalTier(domains={domains!r}): a mapping must have the keys 0..n-1 (process indices)")
        domains = [domains[p] for p in range(len(domains))]
    elif isinstance(domains, (str, bytes)) or not hasattr(domains, "__len__"):
        raise TypeError(f"LocalTier(domains={domains!r}): a sequence (or mapping), the failure domain of each process")
    domains = tuple(tuple(d) if isinstance(d, list) else d for d in domains)
    try:
        hash(domains)
    except TypeError:
        raise TypeError(f"LocalTier(domains={domains!r}): each failure domain must be hashable (a name, a number, "
                        "a tuple)") from None
    return domains


def placement(tier, hosts: list[str], count: int) -> tuple[list, list[tuple]]:
    """(the failure domain of each process, the replica variants) of ``tier`` in a job of
    ``count`` processes whose host names are ``hosts``: ``replica_plan.replica_variants``, each a
    tuple of ``tier.replicas`` permutations (:func:`send` sends each leaf by one); none for ``replicas=0``.
    ValueError for domains not one per process, too few processes for the replicas or the
    parity (``parity_plan.check``), or, with either, processes with different numbers of devices."""
    domains = list(tier.domains) if tier.domains is not None else list(hosts)
    if len(domains) != count:
        raise ValueError(f"LocalTier(domains=...) names {len(domains)} failure domains for a job of {count} "
                         "processes: give one per process (domains[process])")
    if not tier.replicas and not tier.parity:
        return domains, []
    counts = collections.Counter(d.process_index for d in jax.devices())
    if len(set(counts.values())) > 1:  # a shard goes to the device in the same place on the peer
        which = f"replicas={tier.replicas}" if tier.replicas else f"parity={tier.parity}"
        raise ValueError(f"LocalTier({which}) needs the same number of devices in every "
                         f"process; this job has {dict(sorted(counts.items()))} (process: devices)")
    if not tier.replicas:
        parity_plan.check(tier.parity, count)
        return domains, []
    variants = replica_plan.replica_variants(domains, tier.replicas)
    if len(set(domains)) == 1:
        logging.warning("dispatch_io: every process of the job is in one failure domain (%s): the local tier's "
                        "replicas survive lost processes, not a lost host; set LocalTier(domains=...)", domains[0])
    return domains, variants


def decisions(tier, count: int, timeout: float) -> SharedDecisions:
    """The local save decisions: process 0's, shared, for a clock-reading save policy with
    replicas or parity (every process must send its copies or pieces at the same steps: each
    ``send`` / ``parity.encode`` is a collective) or with a clock-reading keep policy (each save's time is process 0's, shared in
    save order: ``decisions.SharedClock``); else each process's own, the same everywhere by construction."""
    policy, keep = tier.save_policy, tier.keep_policy
    agreed = tier.replicas or tier.parity or (keep is not None and keep.uses_clock)
    if count > 1 and agreed and policy is not None and policy.uses_clock:
        template = tier.process_path("{process}")
        return SharedDecisions(open_room("tiers-decisions", template, f"the local tier {template}", timeout))
    return SharedDecisions(None)


def send(tree, variants: list[tuple], replicas: int, domains,
         row_bytes: int = packed_rows.ROW_BYTES) -> tuple[dict[str, dict], dict[str, tuple]]:
    """(moves, copies) of the array leaves of ``tree`` whose regions fewer than ``replicas + 1``
    processes hold: ``moves`` {key path: {region: the orders it was sent by}} (regions as
    ``device_regions`` gives them), ``copies`` {key path: (:class:`~dispatch_io.plan.held.Replica`,
    ...)}: the regions of other processes this process received (see the module doc;
    ``variants``: :func:`placement`'s replica orders, ``domains[process]``: its failure domain).
    Each leaf goes by one variant (``replica_plan.assign_variants``, from the shardings alone: the
    same plan everywhere), its device places by that variant's neighbours (``replica_plan.by_place``)
    where :func:`_by_place` allows; leaves of one plan and dtype travel together,
    each device's shards packed in one row of at most about ``row_bytes``: one collective per
    group and order. Every process calls it, in the same order."""
    found = []   # (key path, packed leaf, the variants needing the fewest replicas for it, {process: bytes})
    for keypath, leaf in tree_lib.flatten(tree)[0] if variants else ():
        if not isinstance(leaf, jax.Array) or not leaf.size:
            continue
        holders = [{d.process_index for d in held} for held in device_regions(leaf.sharding, leaf.shape).values()]
        needed = [replica_plan.replicas_needed(holders, orders, replicas, domains) for orders in variants]
        if min(needed):
            packed = packed_rows.leaf(keypath, leaf, min(needed))
            found.append((keypath, packed, [v for v, n in enumerate(needed) if n == packed.needed], _shares(packed)))
    devices = sorted(jax.devices(), key=lambda d: d.id)
    place = {d: i for held in packed_rows.by_process(devices).values() for i, d in enumerate(held)}
    plans = replica_plan.leaf_plans([shares for *_, shares in found], [allowed for _, _, allowed, _ in found],
                                    [_by_place(leaf, place) for _, leaf, _, _ in found], max(place.values(), default=-1) + 1)
    moves = {keypath: {region[:leaf.ndim]: variants[plan[place[d]]][:leaf.needed] for d, region in leaf.places.items()}
             for (keypath, leaf, _, _), plan in zip(found, plans)}
    copies = collections.defaultdict(list)
    for plan in dict.fromkeys(plans):   # in the order the leaves first take each: the same everywhere
        leaves = [leaf for (_, leaf, _, _), taken in zip(found, plans) if taken == plan]
        for j in range(max(leaf.needed for leaf in leaves)):
            for group in packed_rows.groups([leaf for leaf in leaves if leaf.needed > j], row_bytes):
                for keypath, replica in _exchange(group, [variants[v][j] for v in plan], devices):
                    copies[keypath].append(replica)
    return moves, {keypath: tuple(received) for keypath, received in copies.items()}


def _by_place(leaf: packed_rows.Leaf, place: Mapping) -> bool:
    """Whether ``leaf``'s device places may send by different variants: every region of it is held
    at one place (``place[device]``) wherever it is held -- each region then goes by one variant --,
    and it is on the devices of more than one process (a small leaf on one process's devices is
    stored as one chunk, ``save_plan``: a holder keeps all of it or none)."""
    seen: dict = {}
    return len({d.process_index for d in leaf.places}) > 1 and \
        all(seen.setdefault(region, place[d]) == place[d] for d, region in leaf.places.items())


def _shares(leaf: packed_rows.Leaf) -> dict[int, int]:
    """{process: bytes of ``leaf``'s distinct regions its devices hold} (what it sends, per replica)."""
    shares: collections.Counter = collections.Counter()
    for process, region in {(d.process_index, region) for d, region in leaf.places.items()}:
        shares[process] += math.prod(hi - lo for lo, hi in region) * leaf.data.dtype.itemsize
    return dict(shares)


def _exchange(group: list[packed_rows.Leaf], orders: list, devices: list) -> list[tuple[str, Replica]]:
    """Send each shard of the ``group``'s leaves from its device (at place ``i`` of process ``p``)
    to the device in the same place on process ``orders[i][p]``: each device's shards, flattened,
    padded to their leaf's width and packed in one row of an array over all ``devices``,
    ``device_put`` onto those devices permuted (one collective). Returns the (key path, replica) of each region received here that this
    process does not hold itself, once per region."""
    widths = tuple(leaf.width for leaf in group)
    shards = [{s.device: s.data for s in leaf.data.addressable_shards} for leaf in group]
    moved = packed_rows.permute([packed_rows.row(group, d, shards) for d in packed_rows.by_process(devices)[jax.process_index()]],
                                devices, orders)
    own = [{leaf.places[d] for d in held} for leaf, held in zip(group, shards)]
    offsets = np.cumsum((0,) + widths)
    received, seen = [], set()
    for shard in moved.addressable_shards:
        source = devices[shard.index[0].start]
        wanted = [(i, leaf.places[source]) for i, leaf in enumerate(group)
                  if source in leaf.places and leaf.places[source] not in own[i] and (i, leaf.places[source]) not in seen]
        seen.update(wanted)
        spans = tuple((int(offsets[i]), tuple(hi - lo for lo, hi in region)) for i, region in wanted)
        for (i, region), data in zip(wanted, packed_rows.unpack(shard.data, spans=spans) if spans else ()):
            received.append((group[i].keypath, Replica(shard.device, region[:group[i].ndim], data)))
    return received
