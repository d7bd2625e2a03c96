"""A promotion's plan (pure): which process copies each stored chunk of a local step to the root.

Every process's local copy of a step describes the same stored arrays (unpacked, one chunk grid
per leaf: ``held.own_plan``) and holds the chunks of the regions its devices held. A
promotion writes each stored chunk once, job-wide: by the least loaded (in bytes) of the processes
whose local copy holds it, as a save spreads replicated chunks over their holders. From plain data
(the step's manifest and what each process reports holding) every process computes the same
:class:`~dispatch_io.plan.save_plan.Plan`; its chunks are whole stored chunks, each copied byte for byte.
"""

from __future__ import annotations

import itertools
import math
from typing import Mapping

import jax

from dispatch_io import tree as tree_lib
from dispatch_io.manifest import Manifest
from dispatch_io.plan.balance import LeastLoaded
from dispatch_io.plan.save_plan import Chunk, LeafSpec, Plan
from dispatch_io.workers import numpy_dtype


def leaf_specs(manifest: Manifest) -> tuple[LeafSpec, ...]:
    """The leaves of a plan storing exactly what ``manifest`` describes: each stored array's name,
    shape, dtype and chunk shape as they are. ValueError for a packed leaf (local steps have none)."""
    specs = []
    for i, saved in enumerate(manifest.leaves):
        stored = saved.stored
        if stored is not None and stored.packed is not None:
            raise ValueError(f"{saved.keypath} is packed: only unpacked (local-tier) steps are promoted")
        spec = None if saved.kind == tree_lib.SCALAR else jax.ShapeDtypeStruct(saved.shape, saved.dtype)
        if stored is None:
            specs.append(LeafSpec(i, saved.keypath, saved.kind, saved.origin, spec, key_impl=saved.key_impl))
            continue
        specs.append(LeafSpec(i, saved.keypath, saved.kind, saved.origin, spec, tuple(stored.shape),
                              numpy_dtype(stored.dtype), saved.key_impl, stored.name, tuple(stored.chunk_shape)))
    return tuple(specs)


def _cells(spec: LeafSpec, region) -> list[tuple]:
    """The chunk-grid cells (as regions of the stored array) that ``region`` (over the logical
    shape) touches: a local copy of a region holds every chunk it touches (chunks tile each shard;
    a leaf copied whole is one chunk, held by the one process holding it)."""
    region = tuple(tuple(b) for b in region) + tuple((0, n) for n in spec.shape[len(region):])
    axes = [range(lo // step, (hi - 1) // step + 1) if hi > lo else range(0)
            for (lo, hi), step in zip(region, spec.chunk_shape)]
    return [tuple((g * step, min((g + 1) * step, n)) for g, step, n in zip(grid, spec.chunk_shape, spec.shape))
            for grid in itertools.product(*axes)]


def plan_promotion(manifest: Manifest, held: Mapping[int, Mapping[str, list]], where: str) -> Plan:
    """The plan of a promotion of the local step ``manifest`` describes (named ``where``).

    Args:
      manifest: the step's manifest (any holder's: they describe the same arrays).
      held: process -> {key path: [region, ...]} of the processes that have a local copy of the
        step (its info's ``"held"``, regions ``[[start, stop], ...]`` over the logical shape).

    Each stored chunk is copied by one process whose copy holds it: the least loaded so far (in
    bytes; ties: the lowest index). Raises FileNotFoundError naming the key path if a chunk is in
    no process's copy (the step is not held whole); ValueError for a packed leaf."""
    specs = leaf_specs(manifest)
    load = {p: 0 for p in held}
    least = LeastLoaded(lambda p: (load[p], p))
    holder_sets: dict[tuple[int, ...], tuple[int, ...]] = {}  # one object per set: LeastLoaded knows sets by id
    chunks = []
    for spec in specs:
        if spec.storage is None:
            continue
        holders: dict[tuple, list[int]] = {}
        for process in sorted(held):
            for region in held[process].get(spec.keypath, ()):
                for cell in _cells(spec, region):
                    of_cell = holders.setdefault(cell, [])
                    if not of_cell or of_cell[-1] != process:  # processes come in order: a repeat is the last
                        of_cell.append(process)
        expected = math.prod(-(-n // step) for n, step in zip(spec.shape, spec.chunk_shape))
        if len(holders) != expected:
            raise FileNotFoundError(f"{where}: {spec.keypath} is not held whole by the local copies of the step "
                                    f"({len(holders)} of its {expected} chunks are): it cannot be promoted")
        for cell in sorted(holders):
            nbytes = math.prod(hi - lo for lo, hi in cell) * spec.dtype.itemsize
            candidates = holder_sets.setdefault(tuple(holders[cell]), tuple(holders[cell]))
            writer = least.pick(candidates)
            load[writer] += nbytes
            chunks.append(Chunk(spec.index, cell, nbytes, None, writer))
    return Plan(manifest.treedef, specs, tuple(chunks), keys_by_name=manifest.keys_by_name)


def items_of(step: int, reports: Mapping[int, Mapping], count: int) -> tuple[dict, int | None]:
    """(the step's items {name: {"kind": ...}}, the process whose copy gives the Json items) from
    what each process reports of its local copy (``{"has": bool, "items": {name: entry}}``).
    ValueError naming the step, item and processes if a PerProcess item would be lost with a
    process that has no copy (each value lives only in its own process's copy), or if the copies
    list different items."""
    having = sorted(p for p, r in reports.items() if r["has"])
    items = reports[having[0]]["items"] if having else {}
    differ = [p for p in having if reports[p]["items"] != items]
    if differ:
        raise ValueError(f"step {step}: the local copies of processes {differ} list other items than process "
                         f"{having[0]}'s: they were not saved by one save")
    missing = sorted(set(range(count)) - set(having))
    per_process = sorted(name for name, entry in items.items() if entry.get("kind") == "per_process")
    if per_process and missing:
        raise ValueError(f"step {step} cannot be promoted with its items: process(es) {missing} have no local copy "
                         f"of it, and their PerProcess item(s) {', '.join(per_process)} were only there")
    return {name: {"kind": entry["kind"]} for name, entry in items.items()}, (having[0] if having else None)
