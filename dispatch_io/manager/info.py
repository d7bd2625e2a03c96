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

import numbers
from typing import Mapping

import numpy as np

# Reading step info is the storage's (a verify below the manager checks a step's items too).
from dispatch_io.storage.step_files import FORMAT, VERSION, StepInfo, finite, items_ok, parse  # noqa: F401
from dispatch_io.storage import sealed


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
    return float(value) if finite(value) else None


def metric(value) -> float | None:
    """A stored metric as StepInfo holds it: a float, None where it is not finite."""
    return float(value) if finite(value) else None


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
        sealed.exact(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata must be a JSON value: {exc}") from None
    entries = {name: ({**entry, "processes": processes} if entry["kind"] == "per_process" else dict(entry))
               for name, entry in items.items()}
    return {"format": FORMAT, "version": VERSION, "step": step, "started": started, "metrics": dict(metrics),
            "metadata": metadata, "items": entries, "processes": processes, "dispatch_io": version,
            "durability": "persisted"}


