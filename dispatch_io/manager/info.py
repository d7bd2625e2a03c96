"""Step info: when a step started and committed, its metrics, free metadata, its items.

The manager attaches it to each save as the checkpoint's ``info.json`` (written by process 0
in the commit, beside the manifest: a step has it exactly when it is committed)::

    {"format": "dispatch_io.step", "version": 1, "step": 100,
     "started": 1764150000.1, "committed": 1764150003.7,        # UNIX seconds
     "metrics": {"eval_loss": 2.31}, "metadata": {...},           # JSON
     "items": {"data": {"kind": "per_process", "processes": 8}, "config": {"kind": "json"}},
     "processes": 8, "dispatch_io": "0.1.0", "arrays": "arrays/", "durability": "persisted"}

It is small and read without the manifest or any device, so retention and ``inspect`` of a
root read one small file per step. A step saved without a manager, or before step info
existed, has none: its :class:`StepInfo` is empty but for the step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from typing import Any, Mapping

import numpy as np

from dispatch_io.errors import CheckpointError
from dispatch_io.manager.items import NAME

FORMAT, VERSION = "dispatch_io.step", 1
_LAST_SECOND = 253402300799   # 9999-12-31 23:59:59 UTC: a time beyond is no time a step was saved
_ARRAYS = re.compile(r"arrays/([A-Za-z0-9_-]+/)?")   # where item files may be: never outside the step
_DURABILITY = re.compile(r"persisted|local|replicated [1-9][0-9]{0,6}")


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What is known of a committed step. ``started`` / ``committed``: UNIX seconds (None:
    unknown); ``metrics``: name -> number (None where it was NaN); ``metadata``: the JSON saved
    with it; ``items``: name -> kind (``"json"``, ``"per_process"``, or for an Orbax step its
    handler); ``processes``: how many processes saved it; ``version``: the dispatch_io that
    wrote it; ``durability``: ``"persisted"`` for a step of the root (a local tier's steps record
    ``"replicated k"`` or ``"local"``: ``CheckpointManager.durability``; None: not recorded).
    ``arrays`` is where its item files are (for the manager)."""

    step: int
    started: float | None = None
    committed: float | None = None
    metrics: Mapping[str, float | None] = dataclasses.field(default_factory=dict)
    metadata: Any = None
    items: Mapping[str, str] = dataclasses.field(default_factory=dict)
    processes: int | None = None
    version: str | None = None
    arrays: str | None = None
    item_entries: Mapping[str, Mapping] = dataclasses.field(default_factory=dict, repr=False)
    durability: str | None = None


def _number(name: str, value) -> float | None:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError
    if isinstance(value, (np.ndarray, np.generic)) or hasattr(value, "__array__"):
        value = np.asarray(value)
        if value.shape != () or value.dtype.kind not in "iuf":
            raise TypeError
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError
    return float(value) if _finite(value) else None


def metric(value) -> float | None:
    """A stored metric as StepInfo holds it: a float, None where it is not finite."""
    return float(value) if _finite(value) else None


def metrics_of(metrics: Mapping | None) -> dict[str, float | None]:
    """``metrics`` as JSON numbers (numpy / JAX scalars converted; NaN and inf as None, which
    ``BestN`` treats as missing). ``TypeError`` naming the metric for anything else."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    out = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise TypeError(f"metric names must be str, got {name!r}")
        try:
            out[name] = _number(name, value)
        except TypeError:
            raise TypeError(f"metric {name!r} must be a real number (a Python, numpy or 0-d JAX scalar), "
                            f"got {type(value).__name__}") from None
    return out


def make(step: int, started: float, metrics: Mapping, metadata, items: Mapping, processes: int,
         version: str) -> dict:
    """The step info to attach to a save (``"committed"`` and ``"arrays"`` are added by the
    commit). ``ValueError`` if ``metadata`` is not JSON."""
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata must be a JSON value: {exc}") from None
    entries = {name: ({**entry, "processes": processes} if entry["kind"] == "per_process" else dict(entry))
               for name, entry in items.items()}
    return {"format": FORMAT, "version": VERSION, "step": step, "started": started, "metrics": dict(metrics),
            "metadata": metadata, "items": entries, "processes": processes, "dispatch_io": version,
            "durability": "persisted"}


def _finite(value) -> bool:
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def parse(data: bytes | None, step: int | None, where: str) -> StepInfo:
    """The :class:`StepInfo` in ``data`` (a step's ``info.json``; None: it has none) of ``step``
    (None: the step it records). CheckpointError naming ``where`` if it is not step info this
    version reads: every field typed and in range (finite times and metrics, item names as
    :mod:`items` makes them, ``"arrays"`` the checkpoint's own arrays folder)."""
    if data is None:
        return StepInfo(step)
    try:
        info = json.loads(data)
        ok = (isinstance(info, dict) and info.get("format") == FORMAT and info.get("version") == VERSION
              and isinstance(info.get("metrics"), dict) and items_ok(info.get("items"))
              and all(v is None or _finite(v) for v in info["metrics"].values())
              and all(info.get(k) is None or (_finite(info[k]) and 0 <= info[k] <= _LAST_SECOND)
                      for k in ("started", "committed"))
              and _count(info.get("processes"))
              and isinstance(info.get("arrays"), str) and _ARRAYS.fullmatch(info["arrays"]) is not None
              and (info.get("durability") is None or (isinstance(info["durability"], str)
                                                       and _DURABILITY.fullmatch(info["durability"]) is not None)))
    except (ValueError, TypeError, RecursionError):
        ok = False
    if not ok:
        raise CheckpointError(f"{where}: its step info is not one this version of dispatch_io reads "
                              "(malformed checkpoint, or written by a newer version)")
    recorded = info.get("step")
    if step is None and not (isinstance(recorded, int) and not isinstance(recorded, bool) and recorded >= 0):
        raise CheckpointError(f"{where}: its step info records no step number (malformed checkpoint)")
    metrics = {k: None if v is None else float(v) for k, v in info["metrics"].items()}
    return StepInfo(info["step"] if step is None else step, info["started"], info["committed"], metrics, info.get("metadata"),
                    {name: e["kind"] for name, e in info["items"].items()}, info["processes"],
                    info.get("dispatch_io"), info["arrays"], info["items"], info.get("durability"))


def items_ok(items) -> bool:
    """Whether ``items`` is a step info's ``"items"`` as :func:`make` writes it: {name: {"kind": "json"
    or "per_process" (with its "processes" count), "crc32c": a bool if there}}, names as items makes them."""
    return isinstance(items, dict) and all(
        isinstance(name, str) and NAME.fullmatch(name) and isinstance(e, dict)
        and (e.get("kind") == "json" or (e.get("kind") == "per_process" and _count(e.get("processes"))))
        and isinstance(e.get("crc32c", False), bool) for name, e in items.items())


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1 << 24
