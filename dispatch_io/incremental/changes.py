"""Incremental saves: which of this process's chunks changed since the newest committed step of
the root, so that only those are copied and written (``Dispatcher.save(..., incremental=True)``).

:func:`prepare` finds the base (the newest committed step of the save's root below this one; its
manifest, validated, gives each chunk's digest and where its bytes are), digests this process's
chunks where they are (``digests``: on an accelerator, on the device), and returns the batches
without the unchanged chunks plus an :class:`Increment` that records, in the manifest, every
chunk's digest and a reference for each unchanged one (``manifest.build``'s ``increment``). A reference names
the step that *stores* the bytes (the base, or the step the base itself references), with that
step's commit id, so references never chain. Packed leaves (small by definition) are always
written. In a multi-process job each process decides for its own chunks and attaches its
decisions as a small file (``incremental/p<k>.json`` in the arrays folder); the leader reads them
all when it writes the manifest.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import threading
import weakref

import jax
import numpy as np
import tensorstore as ts
from absl import logging

from dispatch_io.incremental import digests as digests_lib
from dispatch_io import manifest as manifest_lib
from dispatch_io.incremental import references
from dispatch_io.errors import CheckpointError
from dispatch_io.jax_compat import slice_exact
from dispatch_io.plan.batches import Batch, aligned
from dispatch_io.save.sources import Sources
from dispatch_io.storage import COMMITTED, STEP, Location, StepRoot
from dispatch_io.workers import host_cpus

FILE = "incremental/p{}.json"


@dataclasses.dataclass
class Increment:
    """This process's decisions for one save: ``digests`` (chunk index -> digest) of its chunks,
    ``refs`` (chunk index -> (step, commit id)) of the unchanged ones, ``crcs`` (chunk index ->
    CRC-32C carried over from the step that stores it, where that step has one)."""

    digests: dict
    refs: dict
    crcs: dict

    def encode(self) -> bytes:
        return json.dumps({"digests": {str(i): d for i, d in self.digests.items()},
                           "refs": {str(i): list(r) for i, r in self.refs.items()},
                           "crcs": {str(i): c for i, c in self.crcs.items()}}).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Increment":
        doc = json.loads(data)
        return cls({int(i): d for i, d in doc["digests"].items()}, {int(i): tuple(r) for i, r in doc["refs"].items()},
                   {int(i): c for i, c in doc["crcs"].items()})


class DigestCache:
    """Chunk digests of the jax arrays this dispatcher saved incrementally, kept while each array
    lives. A ``jax.Array`` never changes, so the same array saved again (a frozen parameter) has
    the same digests: it is not read again, on the host or on its device. numpy arrays can change
    in place and are always digested."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_array: dict[int, tuple] = {}   # id(array) -> (weak reference, {(region, algorithm): digest})

    def get(self, array, key, compute) -> str:
        """The digest of ``array``'s chunk ``key`` (its region and the algorithm asked for), from
        ``compute()`` the first time."""
        if not isinstance(array, jax.Array):
            return compute()
        with self._lock:
            held = self._by_array.get(id(array))
            if held is not None and held[0]() is array and key in held[1]:
                return held[1][key]
        digest = compute()
        with self._lock:
            held = self._by_array.get(id(array))
            if held is None or held[0]() is not array:
                ident = id(array)
                held = (weakref.ref(array, lambda _, ident=ident: self._forget(ident)), {})
                self._by_array[ident] = held
            held[1][key] = digest
        return digest

    def _forget(self, ident: int):
        with self._lock:
            held = self._by_array.get(ident)
            if held is not None and held[0]() is None:
                del self._by_array[ident]


def base_of(location: Location) -> tuple[str, dict] | None:
    """(name, manifest document) of the newest committed step of ``location``'s root below its
    own step number whose manifest and references check out (one that does not is passed over,
    logged: its chunks are simply written again), or None (the first save). ValueError if the
    path's last name is not a step number: an incremental save is a step of a root
    (``<root>/<step>``)."""
    name = references.step_name(location)
    if not STEP.match(name):
        raise ValueError(f"incremental=True saves a step of a root (<root>/<step number>), but the last name of "
                         f"{location.display} is {name!r}")
    parent = location.display.rstrip("/").rpartition("/")[0]
    older = [s for s in StepRoot.open(parent or ".").committed_steps() if s < int(name)]
    for step in reversed(older):  # a step whose manifest cannot be read is no base (its chunks are written again)
        there = references.sibling(location, str(step))
        try:
            doc = there.read_manifest()
            references.resolve(manifest_lib.parse(doc, there.display), doc, there)  # its references hold
            commit = references.commit_id(there)
            if commit is None:
                raise CheckpointError(f"{there.display}: its {COMMITTED} marker names no commit")
        except (CheckpointError, OSError) as exc:
            logging.warning("dispatch_io: step %s is no base for an incremental save (every chunk is written): %s",
                            step, exc)
            continue
        return str(step), {**doc, "_commit": commit}
    return None


def _known(base: tuple[str, dict] | None) -> dict:
    """keypath -> (stored shape, dtype, chunk shape, {grid: ("sample[|digest]", (step, commit),
    crc)}) of the base's unpacked leaves."""
    if base is None:
        return {}
    step, doc = base
    targets = [(r["step"], r["commit"]) for r in doc.get(manifest_lib.REFERENCES, [])]
    known = {}
    for entry in doc["leaves"]:
        stored = entry.get("stored")
        if not stored or "pack" in stored or "digests" not in stored:
            continue
        where = {g: targets[int(k)] for k, gs in stored.get("refs", {}).items() for g in gs}
        crcs = stored.get("crc32c", {})
        known[entry["keypath"]] = (tuple(stored["shape"]), stored["dtype"], tuple(stored["chunk_shape"]), {
            g: (d, where.get(g, (step, doc["_commit"])), crcs.get(g)) for g, d in stored["digests"].items()})
    return known


def prepare(location: Location, plan, leaves: list, batches: tuple[Batch, ...], checksums: bool,
            cache: DigestCache, whole: bool = False, copies: dict | None = None) -> tuple[tuple[Batch, ...], Increment]:
    """This process's ``batches`` without the chunks unchanged since the base step, and the
    :class:`Increment` saying so (see the module doc). Each chunk is sampled (``digests.sample``:
    a few KiB of it); only a chunk whose sample is the base's (or that the base lacks) is digested
    whole, so a state that changes everywhere costs a sample per chunk, not a pass over it. Its
    manifest entry is ``"<sample>"`` or ``"<sample>|<digest>"``. ``checksums``: the save records CRC-32Cs,
    so a chunk is taken as unchanged only where the step storing it has one to carry over;
    ``cache``: digests of arrays saved before; ``whole``: no base (every chunk written, its digest
    recorded: a step that must hold every chunk itself, the base of the incremental saves after it);
    ``copies``: a local-tier save's regions of other processes received here (leaf index ->
    ``held.Replica``s, ``held.own_plan``), digested from the replicas like any chunk: a peer's region
    unchanged since this process's base step is stored by reference too."""
    known = {} if whole else _known(base_of(location))
    wanted = [i for batch in batches for i in batch.chunks if plan.leaves[plan.chunks[i].leaf].packed is None]
    before = {i: _before(known, plan, i) for i in wanted}
    sources = Sources(plan, leaves, copies)
    samples = _digests(sources, plan, leaves, wanted, cache, digests_lib.sample)
    # A full digest where the chunk may be unchanged (no base to tell, or its sample is the base's),
    # and for every chunk of a leaf that changed here only in part (sparse updates: a chunk that
    # changed now may not next time); not for the chunks of a leaf that changed everywhere here.
    maybe = {i for i in wanted if before[i] is None or before[i][0] == samples[i]}
    partly = {plan.chunks[i].leaf for i in maybe}
    full = _digests(sources, plan, leaves, [i for i in wanted if i in maybe or plan.chunks[i].leaf in partly], cache,
                    digests_lib.digest)
    increment = Increment({i: samples[i] + (f"|{full[i]}" if i in full else "") for i in wanted}, {}, {})
    for i, cell in before.items():
        if cell is not None and cell[1] is not None and cell[1] == full.get(i) and (cell[3] is not None or not checksums):
            increment.refs[i] = cell[2]
            if cell[3] is not None:
                increment.crcs[i] = int(cell[3], 16)
    kept = []
    for batch in batches:
        chunks = tuple(i for i in batch.chunks if i not in increment.refs)
        if chunks:
            skipped = sum(aligned(plan.chunks[i].nbytes) for i in batch.chunks if i in increment.refs)
            kept.append(Batch(batch.priority, chunks, batch.nbytes - skipped))
    return tuple(kept), increment


def _before(known: dict, plan, i: int) -> tuple | None:
    """(sample, full digest or None, (step, commit) storing it, CRC-32C hex or None) the base
    records for chunk ``i`` of ``plan``, if it has this leaf alike (shape, dtype, chunk grid)."""
    chunk = plan.chunks[i]
    spec = plan.leaves[chunk.leaf]
    shape, dtype, chunk_shape, cells = known.get(spec.keypath, (None, None, None, {}))
    if (shape, dtype, chunk_shape) != (spec.shape, spec.dtype.name, spec.chunk_shape):
        return None
    cell = cells.get(manifest_lib.grid_key(lo // c for (lo, _), c in zip(chunk.region, spec.chunk_shape)))
    if cell is None:
        return None
    sampled, _, full = cell[0].partition("|")
    return sampled, full or None, cell[1], cell[2]


def _digests(sources: Sources, plan, leaves: list, wanted: list[int], cache: DigestCache, how) -> dict[int, str]:
    """{chunk index: ``how(chunk data)``} (``digests.sample`` or ``digests.digest``) of the
    ``wanted`` chunks, found in ``sources``: from ``cache``, or computed by up to 8 threads (the
    hash releases the GIL; device digests are dispatched from them). The cache is keyed by the
    leaf's array and the chunk's region, a peer's region received as a replica too: a
    ``jax.Array`` is the same everywhere, so a replica of its region holds the same bytes."""

    def run(share: list[int]) -> list[tuple[int, str]]:
        return [(i, cache.get(leaves[plan.chunks[i].leaf], (plan.chunks[i].region, how.__name__),
                              lambda i=i: _digest(sources, plan.chunks[i], how))) for i in share]

    threads = max(1, min(8, host_cpus(), len(wanted)))
    if threads == 1:
        return dict(run(wanted))
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="dispatch_io-digest") as pool:
        return dict(pair for share in pool.map(run, [wanted[k::threads] for k in range(threads)]) for pair in share)


def _digest(sources: Sources, chunk, how) -> str:
    """``how`` (``digests.sample`` / ``digests.digest``) of ``chunk``'s data, where the data is."""
    parts = sources.parts(chunk)
    if len(parts) == 1 and not parts[0][2]:
        data, local, _ = parts[0]
        if not digests_lib.on_device(data):  # host memory (numpy, CPU devices): a view, no copy
            return how(np.asarray(data)[local])
        return how(slice_exact(data, local))   # cut on the device keeping NaN payloads (JAX 0.12 quiets them)
    return how(sources.locate(chunk)[0])  # a small leaf copied whole


def merger(increment: Increment, processes: int, process: int):
    """The ``merged(target)`` the leader calls before it builds the manifest (``SaveJob.increment``):
    every process's decisions -- its own ``increment``, the others' read from the files they attached
    to the save writing to ``target`` -- as one :class:`Increment`, which ``manifest.build`` records."""
    def merged(target) -> Increment:
        merged = Increment(dict(increment.digests), dict(increment.refs), dict(increment.crcs))
        if processes > 1:
            store = ts.KvStore.open(target.kvstore, context=target.context).result()
            for p in range(processes):
                if p != process:
                    theirs = Increment.decode(store.read(FILE.format(p)).result().value)
                    merged.digests.update(theirs.digests)
                    merged.refs.update(theirs.refs)
                    merged.crcs.update(theirs.crcs)
        return merged
    return merged


def plan_save(location: Location, plan, leaves: list, batches: tuple[Batch, ...], checksums: bool, attachments,
              cache: DigestCache, alone: bool = False, whole: bool = False, copies: dict | None = None):
    """(batches, ``SaveJob.increment``, attachments) of an incremental save (``Dispatcher.save``):
    :func:`prepare`, and in a multi-process job this process's decisions attached for the leader.
    ``alone``: a save this process commits by itself (``own=True``: a local tier's step, whose base
    is this process's own newest local step), its decisions the whole manifest's. ``whole``, ``copies``: as
    :func:`prepare`."""
    batches, increment = prepare(location, plan, leaves, batches, checksums, cache, whole, copies)
    processes, process = (1, 0) if alone else (jax.process_count(), jax.process_index())
    if processes > 1:
        attachments = dataclasses.replace(attachments, files={**attachments.files,
                                                              FILE.format(process): increment.encode()})
    return batches, merger(increment, processes, process), attachments
