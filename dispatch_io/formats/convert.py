"""Converting a stored checkpoint (Orbax or dispatch_io) into a new dispatch_io checkpoint.

A conversion is an ordinary save whose "device to host copy" reads the source checkpoint:
:func:`plan_stored` plans the destination from the source's manifest (key paths, dtypes, key
impls and saved shardings kept; every chunk read and written by process 0), and
:class:`StoredSource` is the runner that fills each batch's staging slice straight from the
source's arrays (TensorStore decodes into it). Everything else -- batches under the budget,
the staging ring, writes, the commit protocol and the manifest -- is the save driver's, so the
host memory bound and "nothing committed on failure" hold as for any save.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import jax
import numpy as np

from dispatch_io import tree as tree_lib
from dispatch_io.plan.batches import aligned
from dispatch_io.storage import Location
from dispatch_io.storage.directory import DirectoryLocation
from dispatch_io.manifest import Manifest
from dispatch_io.plan.save_plan import Chunk, LeafSpec, Plan, device_regions, plan_chunks, stored_leaf_spec, with_packs
from dispatch_io.workers import ArraySpec, Region, Session, aligned_empty, numpy_dtype, read_regions


def check_apart(src: Location, dst: Location):
    """``ValueError`` if the destination ``dst`` of a conversion is the source ``src``, inside
    it, or holds it: writing (or replacing) it would change the checkpoint being read. Local
    paths are compared with symlinks resolved (``link/sub`` with ``link -> src`` is inside src)."""
    def resolved(location: Location) -> str:
        key = os.path.realpath(location.key) if isinstance(location, DirectoryLocation) else location.key
        return key.rstrip("/") + "/"

    a, b = resolved(src), resolved(dst)
    if a.startswith(b) or b.startswith(a):
        where = "is" if a == b else "is inside" if b.startswith(a) else "holds"
        raise ValueError(f"cannot convert {src.display} into {dst.display}: the destination {where} the source; "
                         "choose a destination outside it")


def plan_stored(manifest: Manifest, chunk_limit: int, small_leaf_bytes: int = 0) -> Plan:
    """The plan of a save holding what ``manifest`` describes, read from storage (host data);
    leaves of at most ``small_leaf_bytes`` are packed (``plan.with_packs``)."""
    specs = []
    for i, saved in enumerate(manifest.leaves):
        if saved.kind == tree_lib.SCALAR:
            specs.append(LeafSpec(i, saved.keypath, saved.kind, origin="python"))
            continue
        spec = jax.ShapeDtypeStruct(saved.shape, saved.dtype, sharding=saved.sharding)
        if saved.stored is not None:
            shape, dtype = saved.stored.shape, numpy_dtype(saved.stored.dtype)
        elif saved.kind == tree_lib.KEY:  # zero-size: nothing stored, the logical shape says it all
            phys = jax.eval_shape(jax.random.key_data, spec)
            shape, dtype = tuple(phys.shape), np.dtype(phys.dtype)
        else:
            shape, dtype = saved.shape, np.dtype(saved.dtype)
        specs.append(stored_leaf_spec(i, saved.keypath, saved.kind, saved.origin, spec, tuple(shape), dtype, saved.key_impl, chunk_limit))
    specs = tuple(specs)
    plan = Plan(manifest.treedef, specs, plan_chunks(specs, lambda spec: device_regions(None, spec.spec.shape)),
                keys_by_name=manifest.keys_by_name)
    return with_packs(plan, small_leaf_bytes, chunk_limit // 2)


def source_session(source, settings, chunk_bytes: int) -> Session:
    """A Session reading the arrays of ``source`` (a ``formats.Opened``) with ``settings``. Stored
    chunks larger than ``chunk_bytes`` are read in several pieces: one decoded chunk is cached."""
    largest = max((math.prod(s.stored.chunk_shape) * numpy_dtype(s.stored.dtype).itemsize
                   for s in source.manifest.leaves if s.stored is not None), default=0)
    return Session(source.arrays, settings, source.context, cache_bytes=largest if largest > chunk_bytes else 0)


class StoredSource:
    """A runner for :func:`plan_stored` plans: ``copy_to_host`` reads each chunk from the
    source checkpoint (``stored[leaf]``: the source array of each leaf) into the staging ring,
    then calls ``check_unchanged()`` (which raises if the source was replaced meanwhile: the
    save then fails before its commit); writers and threads are ``runner``'s (a ``LocalRunner``)."""

    host_staging = True

    def __init__(self, runner, session: Session, stored: Sequence[ArraySpec | None], check_unchanged):
        self._runner, self._session, self._stored = runner, session, list(stored)
        self._check_unchanged = check_unchanged
        self.threads = runner.threads
        self.settings = runner.settings

    def open_writer(self, target):
        return self._runner.open_writer(target)

    def copy_to_host(self, plan: Plan, chunks: Sequence[Chunk], sources, staging: np.ndarray) -> list:
        regions, out, offset = [], [], 0
        for chunk in chunks:
            spec = plan.leaves[chunk.leaf]
            shape = tuple(hi - lo for lo, hi in chunk.region)
            if staging is None:  # a ring that only counts bytes (a colocated dispatcher's)
                out.append(aligned_empty(shape, spec.dtype))
            else:
                out.append(staging[offset:offset + chunk.nbytes].view(spec.dtype).reshape(shape))
            offset += aligned(chunk.nbytes)
            regions.append(Region(self._stored[chunk.leaf], chunk.region, spec.keypath))
        read = read_regions(self._session, regions, out)  # raises ChunkError naming the leaf
        self._check_unchanged()
        return read

    def close(self):
        self._session.close()
