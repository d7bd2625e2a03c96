"""Retention of incremental steps: never delete bytes a kept step references (a sweep).

Incremental steps reference the steps that store their unchanged chunks (``dispatch_io.incremental.references``),
always the step that stores them, never a chain. Retention decides as before which steps go
(``retention.steps_to_delete``); then, from the ``references`` of every step it keeps:

* a dropped step no kept step references is deleted as before (``StepRoot.delete``);
* a dropped step some kept step references is **retired**: a ``RETAINED`` marker (a copy of its
  ``COMMITTED`` marker, so references still find the commit they name) is written, then its
  ``COMMITTED`` marker is deleted. It is no longer a step (not listed, not restorable by number),
  but its arrays and manifest stay where the references point;
* a retired step no kept step references any more is deleted, ``RETAINED`` last.

Crash safety: each step changes state by writing or deleting one marker, in an order whose every
prefix is a valid state -- ``RETAINED`` beside ``COMMITTED`` is a listed step that is retired
again at the next retention; a retired step being deleted keeps ``RETAINED`` to the end, so the
next retention finds and finishes it. Saves reference only what the newest committed step
references or stores, and the newest step is always kept, so no save in flight loses its bytes.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, Sequence

import tensorstore as ts
from absl import logging

from dispatch_io.incremental import references
from dispatch_io.storage import COMMITTED, MANIFEST, STEP, DirectoryRoot, Location, StepRoot, sealed


def referenced(root: StepRoot, steps: Sequence[int]) -> set[int] | None:
    """The steps that the ``steps`` of ``root`` reference (their manifests' ``references``); None
    if a manifest cannot be read (logged): it may reference any step (a flipped byte fails its
    seal, and the step can still be mended), so nothing may be deleted."""
    found = set()
    for step in steps:
        location = Location.parse(root.step_path(step))
        try:
            found.update(int(r["step"]) for r in sealed.loads(location.read_file(MANIFEST) or b"{}").get(
                references.REFERENCES, []))
        except (ValueError, TypeError, KeyError, OSError) as exc:
            logging.warning("dispatch_io: the references of step %d under %s cannot be read (%s): the steps "
                            "retention drops are kept aside (retired), none deleted", step, root.display, exc)
            return None
    return found


def retired_steps(root: StepRoot) -> list[int]:
    """Steps of ``root`` that retention retired (a ``RETAINED`` marker, no ``COMMITTED``)."""
    if isinstance(root, DirectoryRoot):
        return sorted(int(name) for name in os.listdir(root.root) if STEP.match(name)
                      and os.path.isfile(os.path.join(root.root, name, references.RETAINED))
                      and not os.path.exists(os.path.join(root.root, name, COMMITTED)))
    return sorted(step for step, keys in root.step_keys().items() if references.RETAINED in keys and COMMITTED not in keys)


def _store(root: StepRoot, step: int) -> ts.KvStore:
    location = Location.parse(root.step_path(step))
    return ts.KvStore.open(location.arrays_kvstore(""), context=location.context).result()


def _delete(store: ts.KvStore, key: str):
    store.delete_range(ts.KvStore.KeyRange(key, key + "\x00")).result()


def retire(root: StepRoot, step: int):
    """Unlist ``step`` but keep its bytes: ``RETAINED`` (its ``COMMITTED`` marker's copy), then
    ``COMMITTED`` deleted."""
    store = _store(root, step)
    store.write(references.RETAINED, store.read(COMMITTED).result().value).result()
    _delete(store, COMMITTED)


def delete_retired(root: StepRoot, step: int):
    """Delete the retired ``step``, its ``RETAINED`` marker last."""
    path = root.step_path(step)
    if isinstance(root, DirectoryRoot):
        for name in os.listdir(path):
            if name != references.RETAINED:
                full = os.path.join(path, name)
                shutil.rmtree(full) if os.path.isdir(full) and not os.path.islink(full) else os.remove(full)
        shutil.rmtree(path)
        return
    store = _store(root, step)
    for key in store.list().result():
        if key.decode() != references.RETAINED:
            _delete(store, key.decode())
    _delete(store, references.RETAINED)


def apply(root: StepRoot, committed: Sequence[int], dropped: Sequence[int], on_gone: Callable[[int], None]):
    """Carry out retention's decision on ``root``: of its ``committed`` steps (ours), ``dropped``
    go, ``on_gone(step)`` called after each. Dropped steps a kept step references are retired
    rather than deleted; retired steps no kept step references any more are deleted. If a kept
    step's references cannot be read, every dropped step is retired and none deleted."""
    kept = sorted(set(committed) - set(dropped))
    live = referenced(root, kept)
    for step in dropped:
        retire(root, step) if live is None or step in live else root.delete(step)
        on_gone(step)
    for step in retired_steps(root) if live is not None else ():
        if step not in live:
            delete_retired(root, step)
