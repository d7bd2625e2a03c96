"""Replicas in the local tier: copies, on peer processes, of the regions too few processes hold.

A local save writes what each process's devices hold, so a region held by one process (pure
FSDP state, a leaf on one process's devices) is lost with that process. With
``LocalTier(replicas=k)`` every region is held by ``k + 1`` processes once the save commits:

* where: :func:`placement` orders the processes by failure domain (``LocalTier.domains``,
  default their host names) and gives ``k`` permutations (``replica_plan.replica_orders``):
  replica ``j`` of what process ``p`` holds goes to process ``orders[j][p]``, in another
  domain while the domains allow;
* what: :func:`send` takes, leaf by leaf, as many of those permutations as the leaf needs --
  none where data parallelism already spreads each region over ``k + 1`` processes
  (``replica_plan.replicas_needed``) -- and moves each shard of the leaf from its device to
  the device in the same place on the peer process. Each process then saves, with its own
  regions, the regions it received (``Dispatcher.save(own=True, copies=...)``): one local
  step per process holding both, its info listing them.

The move is one collective per leaf and replica, over the interconnect (gloo on CPU, ICI /
NVLink on accelerators), device to device: every device's shard, flattened and padded to the
largest, is one row of an array over all the job's devices, and ``jax.device_put`` onto the
same devices permuted delivers each row to its peer -- whatever the leaf's sharding, even on a
subset of the devices. It is dispatched asynchronously by the thread calling ``save``, in the
same order on every process, like the training step's own collectives, so it never races them;
every process must therefore take the same local saves (:func:`decisions`). Its costs: the
interconnect bandwidth of each process's unreplicated share per replica, and device memory for
the rows until the save has staged the received regions to the host (the same staging budget
as any save).
"""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dispatch_io import replica_plan
from dispatch_io import tree as tree_lib
from dispatch_io.coordination import open_room
from dispatch_io.manager.decisions import SharedDecisions
from dispatch_io.plan import device_regions, index_region
from dispatch_io.replica_plan import Replica


def placement(tier, hosts: list[str], count: int) -> tuple[list, list[tuple[int, ...]]]:
    """(the failure domain of each process, the replica permutations) of ``tier`` in a job of
    ``count`` processes whose host names are ``hosts``. No permutations for ``replicas=0``.
    ValueError for domains not one per process, or too few processes for the replicas."""
    domains = list(tier.domains) if tier.domains is not None else list(hosts)
    if len(domains) != count:
        raise ValueError(f"LocalTier(domains=...) names {len(domains)} failure domains for a job of {count} "
                         "processes: give one per process (domains[process])")
    if not tier.replicas:
        return domains, []
    orders = replica_plan.replica_orders(domains, tier.replicas)
    if len(set(domains)) == 1:
        logging.warning("dispatch_io: every process of the job is in one failure domain (%s): the local tier's "
                        "replicas survive lost processes, not a lost host; set LocalTier(domains=...)", domains[0])
    return domains, orders


def decisions(tier, count: int, timeout: float) -> SharedDecisions:
    """The local save decisions: process 0's, shared, for a clock-reading save policy with
    replicas (every process must send its copies at the same steps: each ``send`` is a
    collective); else each process's own, the same everywhere by construction."""
    policy = tier.save_policy
    if count > 1 and tier.replicas and policy is not None and policy.uses_clock:
        template = tier.process_path("{process}")
        return SharedDecisions(open_room("tiers-decisions", template, f"the local tier {template}", timeout))
    return SharedDecisions(None)


def send(tree, orders: list[tuple[int, ...]], replicas: int) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(moves, copies) of the array leaves of ``tree`` whose regions fewer than ``replicas + 1``
    processes hold: ``moves`` {key path: the orders each was sent by}, ``copies`` {key path:
    (:class:`~dispatch_io.replica_plan.Replica`, ...)}: the regions of other processes this
    process received (see the module doc). Every process calls it, in the same order."""
    moves, copies = {}, {}
    if not orders:
        return moves, copies
    devices = sorted(jax.devices(), key=lambda d: d.id)
    for keypath, leaf in tree_lib.flatten(tree)[0]:
        if not isinstance(leaf, jax.Array) or not leaf.size:
            continue
        holders = [{d.process_index for d in held} for held in device_regions(leaf.sharding, leaf.shape).values()]
        needed = replica_plan.replicas_needed(holders, orders, replicas)
        if needed:
            moves[keypath] = tuple(orders[:needed])
            received = [r for order in orders[:needed] for r in _send(leaf, order, devices)]
            if received:
                copies[keypath] = tuple(received)
    return moves, copies


def _send(leaf: jax.Array, order: tuple[int, ...], devices: list) -> list[Replica]:
    """Send each shard of ``leaf`` from its device to the device in the same place on process
    ``order[p]`` (one collective: every device's shard, flattened and padded to the largest, as one
    row of an array over all ``devices``, ``device_put`` onto those devices permuted); returns the
    regions received here that this process does not hold itself, one per region."""
    data = jax.random.key_data(leaf) if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf
    places = {d: index_region(index, data.shape) for d, index in data.sharding.devices_indices_map(data.shape).items()}
    width = max(math.prod(hi - lo for lo, hi in region) for region in places.values())
    by_process = collections.defaultdict(list)
    for d in devices:
        by_process[d.process_index].append(d)
    here = jax.process_index()
    shards = {s.device: s.data for s in data.addressable_shards}
    rows = [jnp.pad(shards[d].reshape(-1), (0, width - shards[d].size))[None] if d in shards else
            jax.device_put(np.zeros((1, width), data.dtype), d) for d in by_process[here]]
    flat = jax.make_array_from_single_device_arrays((len(devices), width), _rows(devices), rows)
    moved = jax.device_put(flat, _rows([by_process[order[d.process_index]][by_process[d.process_index].index(d)]
                                        for d in devices]))
    own = {places[d] for d in shards}
    received = {}
    for shard in moved.addressable_shards:
        source = devices[shard.index[0].start]
        if source not in places:
            continue
        region = places[source]
        if region not in own and region not in received:
            shape = tuple(hi - lo for lo, hi in region)
            received[region] = Replica(shard.device, region[:leaf.ndim], shard.data[0, :math.prod(shape)].reshape(shape))
    return list(received.values())


def _rows(devices: list) -> NamedSharding:
    return NamedSharding(Mesh(np.array(devices), ("rows",)), PartitionSpec("rows"))
