"""Parity in the local tier, the save side: each process's parity rows, made on the devices.

``parity_plan`` says who keeps the XOR of which pieces (pure). Here :func:`encode`, called by
every process at each local save, in the same order (like ``replicas.send``: it is a collective),
packs each device's shards of the protected leaves -- those some region of which too few
processes hold (:func:`protected`) -- as bytes in rows (``packed_rows.py``), and, for ``j = 0..k-1``,
sends piece ``j`` of every row to the device in the same place on the process ``j + 1`` places
back in the ring (one ``jax.device_put`` of the pieces onto the devices permuted: only ``W``
bytes per device cross the interconnect), which XORs it into its parity row (jitted, on the
device). The parity rows are saved after the step commits, as the step's nested checkpoint
``<step>/parity`` (``LocalTiers._finish``); :func:`record` is what the step's info says of them.
"""

from __future__ import annotations

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dispatch_io import tree as tree_lib
from dispatch_io.manager import incremental_retention
from dispatch_io.manager.tiers import parity_plan, packed_rows
from dispatch_io.plan.save_plan import device_regions
from dispatch_io.storage import PARITY, DirectoryRoot, StepRoot  # noqa: F401 - PARITY: the rows' folder, named here


def drop_retired_rows(root: StepRoot):
    """Delete the parity rows (``<step>/parity``) of the steps of this process's local ``root`` that
    retention retired (``incremental_retention``: unlisted, their arrays kept because a kept
    incremental step references them). A retired step is never restored, so its rows are never read:
    a lost process's regions of a kept step are rebuilt from that step's own rows (saved whole at
    every step), its members' regions read through their references. A deletion cut short is
    finished by the next call (nothing reads the rows meanwhile)."""
    if not isinstance(root, DirectoryRoot):   # a local tier is a directory on each host
        return
    for step in incremental_retention.retired_steps(root):
        rows = os.path.join(root.step_path(step), PARITY)
        if os.path.isdir(rows):
            shutil.rmtree(rows)


def placement(k: int, domains: list, count: int) -> tuple[int, ...]:
    """The ring of a job of ``count`` processes in ``domains`` (``parity_plan.ring``), checked
    (``parity_plan.check``); a warning where a parity group (a holder and the ``k`` processes it
    covers) has two processes in one failure domain: losing that domain loses two of the group."""
    order = parity_plan.ring(domains)
    shared = [h for h, covered in parity_plan.members(order, k).items()
              if len({domains[p] for p in (h, *covered)}) < k + 1]
    if shared:
        logging.warning("dispatch_io: LocalTier(parity=%d): %d of the %d parity groups have two processes in one "
                        "failure domain (%d domains for groups of %d): a lost process is rebuilt, a lost domain may "
                        "not be", k, len(shared), count, len(set(domains)), k + 1)
    return order


def protected(holders: list, domains) -> bool:
    """Whether a leaf whose regions are held by the process sets ``holders`` needs parity: some
    region held by one process, or in one failure domain while the job has more."""
    spread = min(2, len(set(domains)))
    return any(len(h) < 2 or len({domains[p] for p in h}) < spread for h in holders)


@functools.partial(jax.jit, static_argnames=("start", "size"))
def _cut(row, *, start, size):
    return row[:, start:start + size]


_xor = jax.jit(jnp.bitwise_xor)


def encode(tree, order: tuple, k: int, domains, row_bytes: int | None = None) -> tuple[dict, dict | None]:
    """({name: this process's parity row of one group and device position, a (1, W / k) uint8 array
    on that device}, the step info's ``"parity"`` section, :func:`record`) of ``tree``; ({}, None)
    where no leaf needs parity. Every process calls it, in the same order."""
    leaves = []
    for keypath, leaf in tree_lib.flatten(tree)[0]:
        if isinstance(leaf, jax.Array) and leaf.size:
            holders = [{d.process_index for d in held} for held in device_regions(leaf.sharding, leaf.shape).values()]
            if protected(holders, domains):
                leaves.append(packed_rows.leaf(keypath, leaf))
    if not leaves:
        return {}, None
    devices = sorted(jax.devices(), key=lambda d: d.id)
    by_process = packed_rows.by_process(devices)
    me, n = jax.process_index(), len(order)
    position = {p: t for t, p in enumerate(order)}
    arrays, groups = {}, packed_rows.groups(leaves, packed_rows.ROW_BYTES if row_bytes is None else row_bytes, by_dtype=False)
    for g, group in enumerate(groups):
        total = sum(leaf.nbytes for leaf in group)
        width = _row_bytes(group, k) // k
        shards = [{s.device: s.data for s in leaf.data.addressable_shards} for leaf in group]
        mine = [packed_rows.row(group, d, shards, by_bytes=True, pad=width * k - total) for d in by_process[me]]
        parity = [None] * len(mine)
        for j in range(k):   # piece j of position t goes to position t - j - 1, in the same place
            back = {p: order[(t - j - 1) % n] for p, t in position.items()}
            moved = packed_rows.permute([_cut(r, start=j * width, size=width) for r in mine], devices, [back] * len(mine))
            for shard in moved.addressable_shards:
                i = by_process[me].index(shard.device)
                parity[i] = shard.data if parity[i] is None else _xor(parity[i], shard.data)
        for i, data in enumerate(parity):
            arrays[row_name(g, i)] = data
    return arrays, record(groups, order, k, by_process)


def row_name(group: int, device: int) -> str:
    """The name (a top-level key of the parity checkpoint) of the parity row of ``group`` on device position ``device``."""
    return f"g{group}d{device}"


def _row_bytes(group: list, k: int) -> int:
    """``W``: the bytes of a row of ``group`` (its leaves' widths), padded to a multiple of ``k``."""
    return -(-sum(leaf.nbytes for leaf in group) // k) * k


def record(groups: list, order: tuple, k: int, by_process: dict) -> dict:
    """The step info's ``"parity"`` section (see ``parity_plan``): ``k``, the ring, the groups (leaves,
    byte offsets and widths, item sizes, key-data trailing dimensions, ``W``), and the layouts of this
    process and of the ``k`` it covers."""
    me = jax.process_index()
    described = []
    for group in groups:
        offsets = np.cumsum([0] + [leaf.nbytes for leaf in group])[:-1]
        described.append({"leaves": [leaf.keypath for leaf in group], "offsets": [int(o) for o in offsets],
                          "widths": [leaf.nbytes for leaf in group],
                          "itemsize": [leaf.data.dtype.itemsize for leaf in group],
                          "dtypes": [leaf.data.dtype.name for leaf in group],
                          "trail": [list(leaf.data.shape[leaf.ndim:]) for leaf in group], "W": _row_bytes(group, k)})

    def layout(p):
        return [[[None if d not in leaf.places else [list(b) for b in leaf.places[d][:leaf.ndim]] for leaf in group]
                 for d in by_process[p]] for group in groups]
    covered = parity_plan.members(order, k)[me]
    return {"k": k, "ring": list(order), "groups": described,
            "layouts": {str(p): layout(p) for p in (me, *covered)}}
