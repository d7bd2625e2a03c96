"""Scale simulation: the save and restore plans of a job of up to 1,024 processes, on paper.

    .venv/bin/python benchmarks/scale.py [--processes 2 8 64 256 1024] [--states 1 100] [--json out.jsonl]

No devices and no data: the planners a save and a restore run (``plan.plan_chunks``: who writes
each chunk; ``delivery.plan_delivery``: who reads each shared piece and who receives it) are
called with plain descriptions of the job -- processes, each with one device of a mesh, and the
processes holding each region of each leaf (:func:`holders`, checked against JAX's own
``devices_indices_map`` in tests/test_delivery.py). A transformer-shaped state (float32
parameters and two Adam moments, per layer: qkv, out, mlp in, mlp out, two norms; an
embedding) of about 1 GiB or 100 GiB, on five layouts:

* ``dp``: pure data parallel (every leaf replicated on every process);
* ``fsdp``: every matrix sharded over all processes (norms replicated);
* ``fsdp x dp2`` / ``fsdp x dp8``: FSDP within 2 or 8 replicas;
* ``fsdp x tp x dp``: 2 replicas of FSDP x tensor parallel (8-way, 2-way under 64 processes).

Per process (the busiest; each process plans the whole job, so planning time is per process):
bytes written (save) and read (restore) against the fair share (stored / P); bytes received and
sent through the restore's collectives against what the process holds but did not read itself;
rounds; coordination-service operations (:func:`coordination_ops`); planning seconds; the
manifest's size; the leader's commit work (writer databases merged). Default options
(1 GiB budget: 64 MiB chunks, 512 MiB read batches).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dispatch_io import collector, manifest, tree  # noqa: E402
from dispatch_io.multihost.delivery import plan_delivery  # noqa: E402
from dispatch_io.manifest import SavedLeaf  # noqa: E402
from dispatch_io.options import Options  # noqa: E402
from dispatch_io.plan.save_plan import LeafSpec, Plan, plan_chunks, storage_chunk_shape  # noqa: E402
from dispatch_io.read.targets import DEVICE, Output  # noqa: E402
from dispatch_io.workers import ArraySpec  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20


@dataclasses.dataclass(frozen=True, eq=False)   # hashed by identity, as fast as a jax Device
class Device:
    """A device as the planners see it: its id and the process it belongs to."""

    id: int
    process_index: int


def transformer(gib: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, role)} of a float32 transformer state of about ``gib`` GiB (parameters and
    two Adam moments). Roles: "in" (d, k), "out" (k, d), "emb" (vocab, d), "norm" (d,)."""
    d, vocab = (1024, 32768) if gib <= 1 else (8192, 32768)
    per_layer = 12 * d * d * 12          # 12 d^2 parameters, 12 bytes each with two moments
    layers = max(1, round((gib * GiB - vocab * d * 12) / per_layer))
    params = {"emb": ((vocab, d), "emb")}
    for i in range(layers):
        params.update({f"l{i}.qkv": ((d, 3 * d), "in"), f"l{i}.out": ((d, d), "out"),
                       f"l{i}.mlp_in": ((d, 4 * d), "in"), f"l{i}.mlp_out": ((4 * d, d), "out"),
                       f"l{i}.norm1": ((d,), "norm"), f"l{i}.norm2": ((d,), "norm")})
    return {f"{part}/{name}": leaf for part in ("params", "mu", "nu") for name, leaf in params.items()}


def layout(kind: str, count: int) -> tuple[dict, dict] | None:
    """(mesh axis sizes, {role: spec}) of a layout over ``count`` processes; None where it does
    not fit (fewer processes than replicas)."""
    if kind == "dp":
        return {"data": count}, dict.fromkeys(("in", "out", "emb", "norm"), ())
    fsdp_specs = {"in": ("fsdp", None), "out": ("fsdp", None), "emb": ("fsdp", None), "norm": ()}
    if kind == "fsdp":
        return {"fsdp": count}, fsdp_specs
    if kind.startswith("fsdp x dp"):
        replicas = int(kind[len("fsdp x dp"):])
        return None if count < 2 * replicas else ({"data": replicas, "fsdp": count // replicas}, fsdp_specs)
    tp = 8 if count >= 64 else 2
    if count < 2 * tp:
        return None
    return ({"data": 2, "fsdp": count // (2 * tp), "tensor": tp},
            {"in": ("fsdp", "tensor"), "out": ("tensor", "fsdp"), "emb": ("tensor", "fsdp"), "norm": ()})


def holders(shape: tuple[int, ...], axes: dict, spec: tuple) -> dict:
    """{region: sorted process indices holding it} of a ``shape`` sharded by ``spec`` (one mesh
    axis name or None per dimension) over a mesh of ``axes`` (name: size, row-major, device i
    on process i) -- what ``devices_indices_map`` of that NamedSharding gives, per process."""
    names, sizes = list(axes), list(axes.values())
    coords = np.indices(sizes).reshape(len(sizes), -1).T        # device i's mesh coordinates
    regions: dict = {}
    for device, coord in enumerate(coords):
        region = []
        for dim, n in enumerate(shape):
            axis = spec[dim] if dim < len(spec) else None
            parts = 1 if axis is None else sizes[names.index(axis)]
            block = 0 if axis is None else coord[names.index(axis)]
            step = -(-n // parts)
            region.append((int(min(n, block * step)), int(min(n, (block + 1) * step))))
        regions.setdefault(tuple(region), []).append(device)
    return {region: tuple(devices) for region, devices in regions.items()}


def leaf_specs(state: dict, axes: dict, specs: dict, chunk_limit: int):
    """The save's LeafSpecs (chunked per shard, as ``plan.stored_leaf_spec`` does) and each
    leaf's {region: holders}."""
    leaves, held, cache = [], [], {}
    for index, (name, (shape, role)) in enumerate(state.items()):
        spec = specs[role]
        if (shape, spec) not in cache:
            cache[shape, spec] = holders(shape, axes, spec)
        regions = cache[shape, spec]
        shard = tuple(hi - lo for lo, hi in next(iter(regions)))
        chunk = storage_chunk_shape(shard, 4, chunk_limit)
        leaves.append(LeafSpec(index, f"['{name}']", tree.ARRAY, "jax", jax.ShapeDtypeStruct(shape, np.float32),
                               shape, np.dtype(np.float32), storage=f"{index}.{name}", chunk_shape=chunk))
        held.append(regions)
    return leaves, held


def coordination_ops(rounds: int, batches: int) -> dict:
    """Coordination-service operations per process, by the protocols (``coordination.Room``;
    waits counted once, not their polls): a save opens (2 barriers), agrees on the plan (set,
    gather, barrier), starts (1), reports progress once per batch, agrees on the outcome (set,
    gather), commits (1), closes (1 barrier); a restore opens, agrees on the plan, per round says
    it is ready and reads the decision (2), per batch of its own regions reports progress,
    agrees on the outcome and closes."""
    return {"save": 2 + 3 + 1 + batches + 2 + 1 + 1, "restore": 2 + 3 + 2 * rounds + batches + 2 + 1}


def fitted(stored: int, count: int, largest_group: int, options: Options) -> Options:
    """``options`` with chunks of at most an eighth of a process's fair share and of a row
    (``read_batch_bytes`` / the largest replica group), a power of two (64 KiB at least)."""
    limit = min(options.chunk_bytes, stored // count // 8, options.read_batch_bytes // largest_group)
    return dataclasses.replace(options, max_chunk_bytes=max(64 << 10, 1 << (limit.bit_length() - 1)))


def simulate(gib: int, kind: str, count: int, options: Options, fit: bool = False) -> dict | None:
    """Plan the save and the restore of the state for one layout and job size; per-process
    numbers. ``fit``: with :func:`fitted` chunks."""
    shape = layout(kind, count)
    if shape is None:
        return None
    axes, specs = shape
    state = transformer(gib)
    if fit:
        stored = sum(math.prod(shape) * 4 for shape, _ in state.values())
        options = fitted(stored, count, math.prod(n for a, n in axes.items() if a == "data") or 1, options)
    chunk_limit, batch_limit = options.chunk_bytes, options.read_batch_bytes
    leaves, held = leaf_specs(state, axes, specs, chunk_limit)
    total = sum(spec.nbytes for spec in leaves)
    devices = [Device(i, i) for i in range(count)]

    started = time.process_time()   # CPU seconds: this machine's other load does not count
    with collector.paused():         # as a save plans
        chunks = plan_chunks(leaves, lambda spec: {r: [devices[p] for p in procs]
                                                   for r, procs in held[spec.index].items()})
    save_plan = time.process_time() - started
    written = np.zeros(count, np.int64)
    for c in chunks:
        written[c.worker] += c.nbytes
    plan = Plan(jax.tree_util.tree_structure(list(state)), tuple(leaves), chunks)
    manifest_bytes = len(manifest.build(plan, (None,) * len(leaves), {i: 0 for i in range(len(chunks))}))

    # The restore onto the same layout: regions held by one process are read there; the others
    # are delivered as planned (what scaleout.plan_split hands plan_delivery).
    started = time.process_time()
    outputs = [Output(SavedLeaf(spec.keypath, tree.ARRAY, "jax", spec.shape, spec.dtype,
                                stored=ArraySpec(spec.storage, spec.shape, "float32", spec.chunk_shape)),
                      DEVICE, spec.dtype) for spec in leaves]
    shared = [(i, out, {r: p for r, p in held[i].items() if len(p) > 1}) for i, out in enumerate(outputs)]
    with collector.paused():         # as a restore runs
        delivery = plan_delivery([s for s in shared if s[2]], count, chunk_limit, batch_limit)
    restore_plan = time.process_time() - started
    hold, read, received, sent = (np.zeros(count, np.int64) for _ in range(4))
    local = np.zeros(count, np.int64)
    for regions in held:
        for region, procs in regions.items():
            nbytes = math.prod(hi - lo for lo, hi in region) * 4
            hold[list(procs)] += nbytes
            if len(procs) == 1:
                local[procs[0]] += nbytes
    for r in delivery.rounds:
        for process, row in r.rows.items():
            read[process] += sum(p.nbytes for p in row)
        got, gave = r.traffic(r.active[0][0]) if r.active else (0, 0)   # whole rows: the same in every
        for group in r.active:                                           # group in which someone reads
            received[list(group)] += got
            sent[list(group)] += gave
    read += local
    fair = total / count
    missing = hold - read
    busiest = int(np.argmax(received)) if received.any() else int(np.argmax(read))
    batches = int(-(-local.max() // batch_limit))
    ops = coordination_ops(len(delivery.rounds), batches)
    return {
        "state_gib": gib, "layout": kind, "processes": count, "leaves": len(leaves), "stored_bytes": total,
        "chunk_limit": chunk_limit,
        "written_max": int(written.max()), "written_vs_fair": float(written.max() / fair),
        "chunks": len(chunks), "writers_merged": int((written > 0).sum()), "manifest_bytes": manifest_bytes,
        "save_plan_s": save_plan, "save_ops": coordination_ops(0, int(-(-written.max() // options.staging_bytes)))["save"],
        "held_max": int(hold.max()), "read_max": int(read.max()), "read_vs_fair": float(read.max() / fair),
        "received": int(received[busiest]), "missing": int(missing[busiest]), "sent_max": int(sent.max()),
        "received_vs_missing": float(max((received[p] / missing[p]) if missing[p] else (0.0 if not received[p] else
                                                                                       math.inf)
                                         for p in range(count))),
        "rounds": len(delivery.rounds), "restore_ops": ops["restore"], "restore_plan_s": restore_plan,
    }


def size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.{3 if n < 1000 * scale else 4}g} {unit}"
    return f"{int(n)} B"


def table(rows: list[dict]) -> str:
    """Markdown: the restore's columns, then the save's, each beside its ideal."""
    out = ["| state | layout | P | chunks | read / fair (ideal 1) | received / (held - read) (ideal 1) | "
           "received (held - read), busiest | rounds | restore ops | restore plan s | written / fair (ideal 1) | "
           "writers merged (ideal P) | manifest | save ops | save plan s |",
           "|" + "---|" * 15]
    for r in rows:
        out.append(f"| {r['state_gib']} GiB | {r['layout']} | {r['processes']} | {size(r['chunk_limit'])} | "
                   f"{r['read_vs_fair']:.2f} | {r['received_vs_missing']:.2f} | {size(r['received'])} "
                   f"({size(r['missing'])}) | {r['rounds']} | {r['restore_ops']} | {r['restore_plan_s']:.2f} | "
                   f"{r['written_vs_fair']:.2f} | {r['writers_merged']} | {size(r['manifest_bytes'])} | "
                   f"{r['save_ops']} | {r['save_plan_s']:.2f} |")
    return "\n".join(out)


LAYOUTS = ("dp", "fsdp", "fsdp x dp2", "fsdp x dp8", "fsdp x tp x dp")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, nargs="+", default=[2, 8, 64, 256, 1024])
    ap.add_argument("--states", type=int, nargs="+", default=[1, 100], help="GiB")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    ap.add_argument("--fitted", type=int, nargs="*", default=[256, 1024],
                    help="job sizes also planned with fitted chunks (see fitted())")
    ap.add_argument("--json", help="also write every row here, one JSON object a line")
    ap.add_argument("--quick", action="store_true", help="that it runs: 2 and 8 processes, the 1 GiB state, no fitted")
    a = ap.parse_args()
    if a.quick:
        a.processes, a.states, a.fitted = [2, 8], [1], []
    options = Options()
    tables = {}
    for fit, sizes in ((False, a.processes), (True, a.fitted)):
        for gib, kind, count in itertools.product(a.states, a.layouts, sizes):
            row = simulate(gib, kind, count, options, fit)
            if row is not None:
                tables.setdefault(fit, []).append({**row, "fitted": fit})
                print(json.dumps(tables[fit][-1]), file=sys.stderr, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for rows in tables.values() for r in rows)
    for fit, rows in tables.items():
        print(f"\n{'Fitted chunks' if fit else 'Default options'}:\n\n{table(rows)}")


if __name__ == "__main__":
    main()
