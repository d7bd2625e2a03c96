"""The read side of the dispatcher's API: ``restore`` and ``verify`` of a checkpoint at a path.

Both open the path (``formats.open_checkpoint``: ours, Orbax's or safetensors), read through
the dispatcher's runner and check that no save replaced the checkpoint while it was read
(:func:`read_checkpoint`); what differs is the work done with the reader. The save side
(plans, batches, the staging ring, per-path locks) stays in ``dispatcher.py``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax

from dispatch_io import collector
from dispatch_io import progress as progress_lib
from dispatch_io.read import loop as read_loop
from dispatch_io.read import targets
from dispatch_io.read import ring as read_ring
from dispatch_io.formats.detect import open_checkpoint
from dispatch_io.multihost import scaleout
from dispatch_io.multihost.shared_verify import verify_shared
from dispatch_io.options import Options
from dispatch_io.progress import Progress, RestoreStats
from dispatch_io.storage import step_files


def restore(runner, options: Options, path, target, *, partial: bool, cast: bool, verify: bool,
            names: Callable | None, ring=None) -> tuple:
    """(the restored tree, RestoreStats): ``Dispatcher.restore`` (see its doc); ``ring``: the
    dispatcher's ``read_ring.ReadRing``, where it reads through one."""

    def work(manifest, reader, progress, times):
        exchanged = scaleout.Exchanged(0, 0, 0)
        if names is not None:
            manifest = dataclasses.replace(manifest, tensor_names=names)
        treedef, outputs = targets.plan_outputs(manifest, target, partial, cast, options.small_leaf_bytes)
        times.append(time.perf_counter())
        if options.restore_broadcast and jax.process_count() > 1:
            exchanged = scaleout.fill_outputs(reader, outputs, options, progress, verify=verify, times=times)
        else:
            if verify:
                read_loop.verify_outputs(reader, outputs, options.read_batch_bytes, progress)
            times.append(time.perf_counter())
            if ring is not None:
                read_ring.read_outputs(reader, outputs, ring, options.chunk_bytes, options.read_batch_bytes, progress)
            else:
                read_loop.read_outputs(reader, outputs, options.chunk_bytes, options.read_batch_bytes, progress,
                                     place=True)
        times.append(time.perf_counter())
        return jax.tree_util.tree_unflatten(treedef, [targets.finish(o) for o in outputs]), verify, exchanged

    return read_checkpoint(runner, options, "restore", path, work)


def verify(runner, options: Options, path) -> RestoreStats:
    """``Dispatcher.verify`` (see its doc)."""
    held, rows = step_files.local_share(path)   # one process's local tier step: its share is all it holds
    items, stats = read_checkpoint(runner, options, "verify", path, _verify_work(options, path, held))
    stats = dataclasses.replace(stats, items_checked=items)
    if rows is None:
        return stats
    # Its parity rows too -- what rebuilds a lost peer's share -- all of them, by this process alone.
    _, of_rows = read_checkpoint(runner, options, "verify", rows, _verify_work(options, None, None, alone=True))
    return dataclasses.replace(
        stats, bytes_read=stats.bytes_read + of_rows.bytes_read, batches=stats.batches + of_rows.batches,
        verify_seconds=stats.verify_seconds + of_rows.total_seconds,
        total_seconds=stats.total_seconds + of_rows.total_seconds, verified=stats.verified and of_rows.verified)


def _verify_work(options: Options, path, held: dict | None, alone: bool = False):
    """``read_checkpoint``'s work for a verify: the regions ``held`` ({key path: [region]}: a local
    tier's step), else every chunk -- in a multi-process job a share each (``verify_shared``) unless
    ``alone`` --; then the item files of a manager's step at ``path`` (None: none)."""

    def work(manifest, reader, progress, times):
        _, outputs = targets.plan_outputs(manifest, None, partial=False, cast=False)
        times.append(time.perf_counter())
        if held is not None:
            wanted = [(out, out.stored_bounds(region)) for out in outputs if isinstance(out, targets.Output)
                      and out.saved.stored is not None for region in held.get(out.saved.keypath, ())]
            read_loop.verify_stored(reader, wanted, options.read_batch_bytes, progress, compare=manifest.has_checksums)
        elif jax.process_count() > 1 and not alone:
            verify_shared(reader, outputs, options.read_batch_bytes, options.barrier_timeout, progress,
                          compare=manifest.has_checksums)
        else:
            read_loop.verify_outputs(reader, outputs, options.read_batch_bytes, progress,
                                     compare=manifest.has_checksums)
        items = step_files.verify_items(path) if path is not None else 0  # a manager's step: as every verify does
        times += [time.perf_counter()] * 2  # nothing read into a result
        return items, manifest.has_checksums, scaleout.Exchanged(0, 0, 0)
    return work


def read_checkpoint(runner, options: Options, kind: str, path, work) -> tuple:
    """The skeleton restore and verify share: the manifest, a reader, progress, and the check
    that no save replaced the checkpoint while it was read. ``work(manifest, reader, progress,
    times)`` appends the times it planned, verified and read at and returns (result, whether
    every chunk read was checked, what it exchanged with other processes: ``scaleout.Exchanged``);
    returns (result, RestoreStats). The garbage collector is paused throughout (``collector``)."""
    started = time.perf_counter()
    with collector.paused():
        source = open_checkpoint(path)
        progress = Progress(kind, source.display, enabled=options.progress)
        times: list[float] = []
        with progress:  # a terminal line is ended if this raises
            reader = runner.open_reader(source.arrays, source.context)
            try:
                result, verified, exchanged = work(source.manifest, reader, progress, times)
            except Exception as exc:
                source.check_unchanged(exc)  # a read failure caused by a replacement
                raise
            finally:
                reader.close()
            source.check_unchanged()  # else the result may mix two checkpoints
    phases = progress.phases.values()
    stats = RestoreStats(
        path=source.display, bytes_read=sum(p.bytes_done for p in phases),
        batches=sum(p.batches_done for p in phases), plan_seconds=times[0] - started,
        verify_seconds=times[1] - times[0], read_seconds=times[2] - times[1],
        total_seconds=time.perf_counter() - started, verified=verified, bytes_broadcast=exchanged.useful,
        bytes_received=exchanged.received, bytes_sent=exchanged.sent)
    progress_lib.report(kind, progress, stats)
    return result, stats
