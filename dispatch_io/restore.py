"""Restore: check the whole target against the manifest, then read each needed region once,
in budgeted batches, straight into the memory the result will live in.

Each device's region is read only once even if several devices hold it (replicas), regions
larger than the chunk limit are read piecewise into one 64-byte aligned buffer (which
``device_put`` adopts without a copy on CPU), and at most two batches of reads are in flight.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import numpy as np

from dispatch_io import manifest as manifest_lib
from dispatch_io import tree as tree_lib
from dispatch_io.batches import pack
from dispatch_io.errors import CheckpointError, CorruptCheckpointError, TreeMismatchError, WorkerError
from dispatch_io.manifest import Manifest, SavedLeaf
from dispatch_io.plan import device_regions, storage_chunk_shape
from dispatch_io.progress import Progress
from workers import ChunkError, Region, aligned_empty

HOST, DEVICE = "host", "device"


@dataclasses.dataclass(frozen=True)
class RestoreStats:
    """What one restore (or ``Dispatcher.verify``) did, in this process. Seconds are wall time.

    The same numbers go to ``jax.monitoring`` (``dispatch_io.progress.EVENTS``) and, in short,
    to the INFO line it logs. A restore's are kept as ``dispatcher.last_restore_stats``.
    """

    path: str
    bytes_read: int         # stored bytes read, every pass (verify=True reads whole chunks first)
    batches: int            # batches of reads, every pass
    plan_seconds: float     # manifest read and the target checked against it
    verify_seconds: float   # reading stored chunks and checking their CRC-32C (verify=True / verify())
    read_seconds: float     # reading the regions into the result's host buffers
    total_seconds: float    # called -> result built (arrays on their devices) / verified
    verified: bool          # every chunk read was checked against its saved CRC-32C


@dataclasses.dataclass
class _Output:
    """One leaf of the result and how to build it."""

    saved: SavedLeaf
    where: str                         # HOST (numpy) or DEVICE (jax.Array)
    dtype: np.dtype | None             # element dtype of the result (stored dtype for keys)
    sharding: Any = None               # DEVICE only
    as_scalar: bool = False            # numpy scalar (np.generic) rather than a 0-d array
    regions: dict = dataclasses.field(default_factory=dict)  # region -> [devices] (DEVICE) / [None]
    buffers: dict = dataclasses.field(default_factory=dict)  # region -> host array

    def stored_bounds(self, region) -> tuple:
        """``region`` (over the logical shape) as bounds over the stored array: PRNG keys'
        trailing ``key_data`` dimensions are read whole."""
        return region + tuple((0, n) for n in self.saved.stored.shape[len(region):])

    def buffer_shape(self, region) -> tuple[int, ...]:
        """Shape of the host buffer holding ``region`` as stored."""
        return tuple(hi - lo for lo, hi in self.stored_bounds(region))

    @property
    def saved_dtype(self) -> np.dtype:
        """Element dtype of what is stored (``key_data``'s for keys)."""
        return manifest_lib.numpy_dtype(self.saved.stored.dtype)


def _describe(x) -> str:
    if isinstance(x, tree_lib._SCALAR_TYPES):
        return f"a Python {type(x).__name__}"
    return f"shape {tuple(x.shape)} dtype {x.dtype}"


def _target_problem(saved: SavedLeaf, leaf, cast: bool) -> str | None:
    if saved.kind == tree_lib.SCALAR:
        if isinstance(leaf, tree_lib._SCALAR_TYPES) or getattr(leaf, "shape", None) == ():
            return None
        return f"checkpoint has a Python {type(saved.value).__name__}, target asks for {_describe(leaf)}"
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        return (f"checkpoint has shape {saved.shape} dtype {saved.dtype}, target leaf is "
                f"{type(leaf).__name__} (use jax.ShapeDtypeStruct, jax.Array or np.ndarray)")
    if tuple(leaf.shape) != saved.shape:
        return f"shape mismatch: checkpoint {saved.shape}, target {tuple(leaf.shape)}"
    target_is_key = tree_lib.is_prng_key(leaf)
    if (saved.kind == tree_lib.KEY) != target_is_key:
        return f"checkpoint has {'a PRNG key' if saved.kind == tree_lib.KEY else 'a plain array'} of dtype {saved.dtype}, target dtype is {leaf.dtype}"
    if target_is_key and leaf.dtype != saved.dtype:
        return f"PRNG key impl mismatch: checkpoint {saved.dtype} ({saved.key_impl}), target {leaf.dtype}"
    if not target_is_key and np.dtype(leaf.dtype) != saved.dtype and not cast:
        return f"dtype mismatch: checkpoint {saved.dtype}, target {leaf.dtype} (pass cast=True to convert)"
    return None


def _output_for(saved: SavedLeaf, leaf) -> _Output:
    """Where and how a leaf is restored, given its target leaf (None: as saved, on host)."""
    key = saved.kind == tree_lib.KEY
    stored_dtype = None if saved.stored is None else manifest_lib.numpy_dtype(saved.stored.dtype)
    if leaf is None or isinstance(leaf, (np.ndarray, np.generic)):
        if key:  # keys have no numpy form: as key arrays on the default device
            return _Output(saved, DEVICE, stored_dtype, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
        as_scalar = isinstance(leaf, np.generic) or (leaf is None and saved.origin == "numpy_scalar")
        dtype = saved.dtype if leaf is None else np.dtype(leaf.dtype)
        return _Output(saved, HOST, dtype, as_scalar=as_scalar)
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    dtype = stored_dtype if key else np.dtype(leaf.dtype)
    return _Output(saved, DEVICE, dtype, sharding)


def plan_outputs(manifest: Manifest, target, partial: bool, cast: bool):
    """(treedef, [_Output or scalar value]) for the result; TreeMismatchError lists every problem."""
    if target is None:
        return manifest.treedef, [_output_for(s, None) if s.kind != tree_lib.SCALAR else s.value
                                  for s in manifest.leaves]
    flat, treedef = tree_lib.flatten(target)
    problems = []
    outputs = []
    named = set()
    for keypath, leaf in flat:
        named.add(keypath)
        saved = manifest.by_keypath.get(keypath)
        if saved is None:
            problems.append((keypath, "not in the checkpoint"))
            continue
        problem = _target_problem(saved, leaf, cast)
        if problem:
            problems.append((keypath, problem))
        elif saved.kind == tree_lib.SCALAR:
            outputs.append(_scalar_output(saved.value, leaf))
        else:
            outputs.append(_output_for(saved, leaf))
    if not partial:
        problems += [(s.keypath, "in the checkpoint but not in the target (pass partial=True to skip it)")
                     for s in manifest.leaves if s.keypath not in named]
    if problems:
        raise TreeMismatchError(problems)
    return treedef, outputs


def _scalar_output(value, leaf):
    if isinstance(leaf, tree_lib._SCALAR_TYPES):
        return value
    array = np.asarray(value, dtype=leaf.dtype)
    if isinstance(leaf, (np.ndarray, np.generic)):
        return array
    return jax.device_put(array, getattr(leaf, "sharding", None))


# ---- reading ------------------------------------------------------------------------------

def _regions(out: _Output) -> dict:
    return device_regions(None if out.where == HOST else out.sharding, out.saved.shape, addressable_only=True)


def units(outputs: list) -> list[tuple[_Output, tuple]]:
    """(output, region) for every distinct region this process needs; sets ``out.regions``."""
    found = []
    for out in outputs:
        if not isinstance(out, _Output) or out.saved.stored is None:
            continue
        out.regions = _regions(out)
        found += [(out, region) for region in out.regions]
    return found


def pieces(out: _Output, region, chunk_limit: int):
    """(piece bounds over the stored array, slices into the region buffer) covering ``region``."""
    full = out.stored_bounds(region)
    shape = out.buffer_shape(region)
    step = storage_chunk_shape(shape, np.dtype(out.dtype).itemsize, chunk_limit)
    for starts in itertools.product(*[range(0, n, s) for n, s in zip(shape, step)]):
        local = tuple(slice(s, min(s + k, n)) for s, k, n in zip(starts, step, shape))
        bounds = tuple((lo + sl.start, lo + sl.stop) for (lo, _), sl in zip(full, local))
        yield bounds, local


def read_outputs(engine, session, outputs: list, progress: Progress):
    """Fill every _Output's buffers through ``engine.submit_read``, under the budget; each
    batch counted on ``progress`` (phase ``read``)."""
    display = progress.path
    chunk_limit = engine.options.chunk_bytes
    batch_limit = engine.options.batch_bytes
    work = [(out, region, bounds, local) for out, region in units(outputs)
            for bounds, local in pieces(out, region, chunk_limit)]
    piece_bytes = lambda item: math.prod(hi - lo for lo, hi in item[2]) * item[0].saved_dtype.itemsize  # noqa: E731
    batches = [items for items, _ in pack(work, piece_bytes, batch_limit)]
    progress.phase("read", len(batches), sum(map(piece_bytes, work)))

    def submit(batch):
        regions = [Region(o.saved.stored, b, o.saved.keypath) for o, _, b, _ in batch]
        return engine.submit_read(session, regions, [_destination(o, r, local) for o, r, _, local in batch])

    in_flight = [submit(batches[0])] if batches else []
    for k, batch in enumerate(batches):
        if k + 1 < len(batches):  # read the next batch while this one is placed
            in_flight.append(submit(batches[k + 1]))
        try:
            arrays = in_flight.pop(0).result()
        except ChunkError as exc:
            for f in in_flight:
                f.exception()
            raise WorkerError(f"worker {engine.worker_id} failed reading {exc.keypath} from {display}: {exc}",
                              worker=engine.worker_id, keypath=exc.keypath) from exc
        for (out, region, _, local), piece in zip(batch, arrays):
            if out.dtype != out.saved_dtype:  # cast=True: read as saved, converted here
                np.copyto(out.buffers[region][local + (Ellipsis,)], piece, casting="unsafe")
        progress.advance(sum(map(piece_bytes, batch)))


def _destination(out: _Output, region, local) -> np.ndarray | None:
    """Where a piece is read to: a view of its region's buffer (allocated on first use,
    64-byte aligned so ``device_put`` adopts it on CPU), or None when it must be converted."""
    if region not in out.buffers:
        out.buffers[region] = aligned_empty(out.buffer_shape(region), np.dtype(out.dtype))
    if out.dtype != out.saved_dtype:
        return None
    # ``...``: a view even for 0-d arrays (indexing one with ``()`` gives a numpy scalar).
    return out.buffers[region][local + (Ellipsis,)]


def finish(out) -> Any:
    """The result leaf for an _Output whose buffers are full."""
    if not isinstance(out, _Output):
        return out
    saved = out.saved
    if saved.stored is None:  # zero-size: nothing was stored
        phys = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(saved.shape, saved.dtype)) \
            if saved.kind == tree_lib.KEY else jax.ShapeDtypeStruct(saved.shape, out.dtype)
        out.regions = _regions(out)
        out.buffers = {r: np.zeros(tuple(hi - lo for lo, hi in r) + phys.shape[len(r):], phys.dtype)
                       for r in out.regions}
    if out.where == HOST:
        array = next(iter(out.buffers.values()))
        return array[()] if out.as_scalar else array
    wrap = saved.kind == tree_lib.KEY
    by_device = {}
    for region, devices in out.regions.items():
        host = out.buffers.pop(region)   # numpy, or an array on a colocated CPU device
        for device in devices:
            shard = jax.device_put(host, device)
            if wrap and not tree_lib.is_prng_key(shard):
                shard = jax.random.wrap_key_data(shard, impl=saved.key_impl)
            by_device[device] = shard
    # In the sharding's device order: JAX does not reorder the shards of key arrays.
    shards = [by_device[d] for d in out.sharding.addressable_devices_indices_map(saved.shape)]
    # dtype: JAX cannot infer it when this process holds no shard of the array.
    return jax.make_array_from_single_device_arrays(saved.shape, out.sharding, shards,
                                                    dtype=saved.dtype if wrap else out.dtype)


# ---- verify=True ------------------------------------------------------------------------------

def _stored_cells(out: _Output, region):
    """(grid index, bounds) of every stored chunk overlapping ``region`` (whole chunks)."""
    stored = out.saved.stored
    axes = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(out.stored_bounds(region), stored.chunk_shape)]
    for grid in itertools.product(*axes):
        yield grid, tuple((g * c, min((g + 1) * c, n)) for g, c, n in zip(grid, stored.chunk_shape, stored.shape))


def verify_checksums(outputs: list, batch_limit: int, submit_checksums, progress: Progress, *,
                     compare: bool = True):
    """Check every stored chunk the restore reads against the CRC-32C saved in the manifest.

    ``submit_checksums(regions)`` returns a future of the regions' CRC-32C, computed where the
    worker code runs; at most ``batch_limit`` bytes a call and two calls at a time, so host
    memory stays within the budget (or two chunks, for chunks over half of it) however large the leaves. Raises CorruptCheckpointError naming every bad chunk's key
    path. ``compare=False`` (a checkpoint saved without checksums): only read every chunk, which
    still finds what cannot be read or decoded. Batches are counted on ``progress`` (phase
    ``verify``)."""
    display = progress.path
    cells = {}
    for out, region in units(outputs):
        if compare and out.saved.checksums is None:
            raise CheckpointError(f"{display} was saved without checksums (Options(checksums=True)): "
                                  f"cannot verify {out.saved.keypath}")
        for grid, bounds in _stored_cells(out, region):
            cells[(out.saved.keypath, grid)] = (out, bounds)
    work = [(keypath, grid, out, bounds) for (keypath, grid), (out, bounds) in cells.items()]
    nbytes = lambda item: math.prod(hi - lo for lo, hi in item[3]) * item[2].saved_dtype.itemsize  # noqa: E731
    bad = []
    batches = [batch for batch, _ in pack(work, nbytes, batch_limit)]
    progress.phase("verify", len(batches), sum(map(nbytes, work)))
    submit = lambda batch: submit_checksums([Region(o.saved.stored, b, k) for k, _, o, b in batch])  # noqa: E731
    in_flight = [submit(batches[0])] if batches else []
    for k, batch in enumerate(batches):
        if k + 1 < len(batches):  # the next batch reads while this one's CRC-32Cs are compared
            in_flight.append(submit(batches[k + 1]))
        try:
            sums = in_flight.pop(0).result()
        except Exception as exc:
            for f in in_flight:  # nothing may still read once this raises (the session closes)
                f.exception()
            if isinstance(exc, ChunkError):
                raise CorruptCheckpointError(f"cannot read {exc.keypath} from {display} to verify it: {exc}",
                                             keypath=exc.keypath) from exc
            raise
        for (keypath, grid, out, bounds), crc in zip(batch, sums):
            if not compare:
                continue
            expected = out.saved.checksums.get(tuple(grid))
            if expected != crc:
                bad.append((keypath, grid, bounds, expected, crc))
        progress.advance(sum(map(nbytes, batch)))
    if bad:
        lines = "\n".join(f"  {k} chunk {list(g)} (region {[list(b) for b in r]}): saved crc32c "
                           f"{'none' if e is None else f'{e:08x}'}, read {c:08x}" for k, g, r, e, c in bad)
        raise CorruptCheckpointError(f"{display}: {len(bad)} chunk(s) do not match their checksums:\n{lines}",
                                     keypath=bad[0][0], chunk=bad[0][1])
