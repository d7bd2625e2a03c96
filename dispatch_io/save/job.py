"""What a save is given: the job the dispatcher planned (:class:`SaveJob`) and the small files
committed with it (:class:`Attachments`). Plain data, read by the driver (``save.driver``) and by
the end of the save (``save.finish``), which are given it and never build one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping

from dispatch_io.plan.batches import Batch
from dispatch_io.plan.save_plan import Plan


@dataclasses.dataclass(frozen=True)
class Attachments:
    """Small files a save commits together with its arrays (a manager's items and step info).

    ``files``: this process's, key (relative to the checkpoint's arrays folder) -> bytes, written
    once its batches are; every process's are in place before the commit. ``info``: JSON the
    leader writes as the checkpoint's :data:`~dispatch_io.storage.INFO` file when it commits,
    with ``"committed"`` (``clock()``, UNIX seconds) and ``"arrays"`` (the arrays folder) added.
    ``agreed``: JSON every process of a job must attach alike (what ``info`` says of all their
    files), checked with the plan before anything is written."""

    files: Mapping[str, bytes] = dataclasses.field(default_factory=dict)
    info: Mapping | None = None
    clock: Callable[[], float] = time.time
    agreed: object = None


@dataclasses.dataclass(frozen=True)
class SaveJob:
    """What one save writes, as planned by the dispatcher: ``batches`` are this process's, in
    the order they are copied; ``scalars`` the Python scalar leaves' values as the manifest
    records them (``manifest.scalar_values``; None for arrays)."""

    plan: Plan
    scalars: tuple
    batches: tuple[Batch, ...]
    display: str
    on_transfer_end: Callable[[str], None] | None = None
    on_write_end: Callable[[str], None] | None = None
    started: float = 0.0          # perf_counter when save() was called
    plan_seconds: float = 0.0
    plan_cached: bool = False
    snapshot_bytes: int = 0
    progress: bool = True         # Options.progress
    describe: Callable[[], tuple] | None = None   # manifest.describe(plan), kept across saves of the plan
    attachments: Attachments = Attachments()
    # An incremental save's: increment(target) -> every process's decisions (incremental.changes.Increment),
    # read by the leader once all are written to target, for manifest.build to record.
    increment: Callable | None = None
