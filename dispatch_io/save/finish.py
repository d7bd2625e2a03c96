"""The end of a save, once this process's batches are written: the processes agree, the leader
puts the arrays in their final form and writes the manifest that describes them (and the
attached info file), and the save commits -- or, if anything failed anywhere, is removed.

The save driver (:class:`~dispatch_io.save.driver.SaveRun`) calls :func:`commit` once, with the save's
commit object (``multihost.commit``), in the order that module gives: agree, commit, end.
"""

from __future__ import annotations

from dispatch_io import collector
from dispatch_io import manifest as manifest_lib
from dispatch_io.storage import INFO, sealed
from dispatch_io.save.job import SaveJob
from dispatch_io.workers import IOSettings, finish_arrays


def commit(job: SaveJob, commit_, settings: IOSettings, error: BaseException | None, checksums: dict[int, int]):
    """Agree with the other processes on the outcome of the save of ``job`` (``error``: this
    process's failure, None if none; ``checksums``: its chunks' CRC-32C, chunk index -> value);
    the leader then stores the arrays' metadata, merges the writers' databases and writes the
    manifest; ``commit_`` commits. Raises (after the save is removed) if any process failed,
    here or before; the commit object is ended in every case."""
    agreed = commit_.agree(error, checksums)
    try:
        manifest = files = None
        if commit_.leader:
            try:
                target = commit_.target
                finish_arrays(target.kvstore, settings.layout, job.plan.arrays, settings.compression, target.context)
                increment = job.increment(target) if job.increment else None
                with collector.paused():
                    manifest = manifest_lib.build(
                        job.plan, job.scalars, agreed, settings.layout, arrays=target.arrays,
                        compression=settings.compression, described=job.describe() if job.describe else None,
                        increment=increment)
                files = _info_files(job, target.arrays)
            except BaseException as exc:  # noqa: BLE001 - every process must hear of it
                commit_.fail(exc)
        commit_.commit(manifest, fsync=settings.fsync, files=files)
    finally:
        commit_.end()


def _info_files(job: SaveJob, arrays: str) -> dict[str, bytes] | None:
    """The leader's attached info file, stamped with the commit time and the arrays folder."""
    info = job.attachments.info
    if info is None:
        return None
    stamped = {**info, "committed": job.attachments.clock(), "arrays": arrays}
    return {INFO: sealed.dumps(stamped, allow_nan=False)}
