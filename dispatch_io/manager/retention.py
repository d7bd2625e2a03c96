"""Retention: which committed steps go (pure), and deleting them (process 0, off the save path).

:func:`steps_to_delete` decides from plain data -- each step's :class:`StepRecord` and the keep
policy -- and is tested without IO. :func:`delete_dropped` carries the decision out on a
manager's root: only steps dispatch_io wrote are deleted (Orbax's are counted, logged and
kept), each unlisted first by the storage layer, so a crash mid-delete never leaves a listed
but broken step. The manager runs it on a thread of its own after a newer step committed, so
a slow delete (an object store) never delays the next save.
"""

from __future__ import annotations

from typing import Callable, Sequence

from absl import logging

from dispatch_io.errors import CheckpointError
from dispatch_io.manager import incremental_retention
from dispatch_io.manager.step_policies import BestN, Policy, StepRecord
from dispatch_io.storage import StepRoot


def steps_to_delete(steps: Sequence[StepRecord], keep_policy: Policy | None, now: float) -> list[int]:
    """The committed ``steps`` that ``keep_policy`` drops, ascending. The newest step is always
    kept (a run resumes from it); None keeps everything."""
    if keep_policy is None or not steps:
        return []
    kept = keep_policy.keep(steps, now) | {max(r.step for r in steps)}
    return sorted({r.step for r in steps} - kept)


def record(step: int, step_info: Callable) -> StepRecord:
    """``step``'s :class:`StepRecord` from ``step_info(step)`` -- without its info if it has none
    or a malformed one (logged: one bad info.json must not stop retention of the rest)."""
    try:
        info = step_info(step)
    except FileNotFoundError:
        return StepRecord(step)
    except CheckpointError as exc:
        logging.warning("dispatch_io: %s; step %d is ranked without its info", exc, step)
        return StepRecord(step)
    return StepRecord(step, info.committed, info.metrics)


def check_not_older(step: int, steps: Sequence[int], root: str, step_path: Callable[[int], str]):
    """ValueError if committed ``steps`` under ``root`` hold one newer than ``step``: retention ranks
    steps by number, so ``step`` would be the first it deletes (and never the latest)."""
    newer = [s for s in steps if s > step]
    if newer:
        raise ValueError(
            f"cannot save step {step} under {root}: step {newer[-1]} is newer, so step {step} would never be "
            f"the latest and retention could delete it at once; remove the steps newer than {step} first "
            f"({', '.join(step_path(s) for s in newer)}), or save into another root")


def best_step(steps: Sequence[StepRecord], keep_policy: Policy | None, metric: str | None, mode: str | None,
              now: float) -> int | None:
    """The step of ``steps`` with the best ``metric`` (``mode`` ``"min"`` / ``"max"``), both
    defaulting to ``keep_policy``'s single ``BestN``; None if no step has the metric. ValueError
    if no metric is given and the keep policy has no single ``BestN``."""
    if metric is None:
        parts = getattr(keep_policy, "policies", (keep_policy,))
        best = [p for p in parts if isinstance(p, BestN)]
        if len(best) != 1:
            raise ValueError("best_step() needs metric= (the keep policy has no single BestN to take it from)")
        metric, mode = best[0].metric, mode or best[0].mode
    return next(iter(BestN(1, metric, mode or "min", keep_without_metric=False).keep(steps, now)), None)


def delete_dropped(root: StepRoot, dropped: Sequence[int], on_deleted: Callable[[int], None]):
    """Delete the ``dropped`` steps of ``root`` that dispatch_io wrote, calling ``on_deleted``
    after each; log the others (never deleted). A dropped step that a kept incremental step
    references is retired instead (unlisted, its bytes kept: ``incremental_retention.apply``). Raises what the
    store raises."""
    ours = set(root.committed_steps())
    for step in dropped:
        if step not in ours:
            logging.info("dispatch_io: keeping step %d under %s: dispatch_io did not write it "
                         "(remove it yourself to reclaim its space)", step, root.display)

    incremental_retention.apply(root, sorted(ours), [s for s in dropped if s in ours], on_deleted)
