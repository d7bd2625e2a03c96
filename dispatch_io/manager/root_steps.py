"""What a committed step holds, read from its files: its info, its items, its pytree's path.

A step is ours (``info.json`` and item files, ``info.py`` / ``items.py``) or Orbax's
(``orbax_items.py``); these functions answer for both, so the manager and the command line
never ask which.
"""

from __future__ import annotations

from dispatch_io.errors import CheckpointError
from dispatch_io.manager import info as info_lib
from dispatch_io.manager import items as items_lib
from dispatch_io.manager import orbax_items, retention
from dispatch_io.storage import INFO, Location, StepRoot, step_files


def started(step_info, step: int | None, now: float) -> float:
    """When the save of ``step`` started (``step_info(step).started``: EveryNSeconds counts from it
    after a restart), or ``now`` if that is not known (no step, none recorded, or its info unreadable)."""
    if step is None:
        return now
    try:
        begun = step_info(step).started
    except (CheckpointError, OSError):
        return now
    return now if begun is None or begun > now else begun


def check_new(root: StepRoot, step: int, overwrite: bool, step_path, committed: list[int], display: str) -> str:
    """The path a manager's save of ``step`` writes (``step_path(step)``), once checked against
    the ``committed`` steps of ``root`` (named ``display``), before anything is written:
    FileExistsError if an Orbax step holds it (never replaced, even with ``overwrite``) or, without
    ``overwrite``, a committed step does; ValueError if a newer step is committed
    (``retention.check_not_older``). The save's own start checks the path again (as
    ``Dispatcher.save`` does): a save still in flight may commit meanwhile."""
    path = step_path(step)
    if path != root.step_path(step):
        raise FileExistsError(f"step {step} is already held by the Orbax checkpoint {path}; a save never replaces "
                              "one, even with overwrite=True (remove it first if it may go)")
    retention.check_not_older(step, committed, display, step_path)
    if step in committed and not overwrite:
        raise FileExistsError(f"a checkpoint is already committed at {Location.parse(path).display}; pass "
                              "overwrite=True to replace it")
    return path


def read_info(path: str, step: int) -> info_lib.StepInfo:
    """The :class:`StepInfo` of the committed ``step`` at ``path``, from one small file.
    FileNotFoundError if nothing is committed there; CheckpointError if it is malformed."""
    if orbax_items.is_orbax_step(path):
        return orbax_items.step_info(path, step)
    location = Location.parse(path)
    if not location.is_committed():  # an info.json without the commit is a save under way (or killed)
        raise FileNotFoundError(f"no committed step {step} at {path}")
    return info_lib.parse(location.read_file(INFO), step, path)


def read_item(path: str, info: info_lib.StepInfo | None, name: str, process: int, processes: int):
    """Item ``name`` of the step at ``path`` for ``process`` of a job of ``processes``:
    ``info`` is the step's (None: an Orbax step). KeyError listing the step's items if it has
    none of that name; CheckpointError for another process count or a missing item file,
    CorruptCheckpointError for a malformed one or one that does not match its CRC-32C."""
    if info is None:
        return orbax_items.item(path, name, process, processes)
    entry = info.item_entries.get(name)
    if entry is None:
        raise KeyError(f"step {info.step} at {path} has no item {name!r} "
                       f"(it has: {', '.join(sorted(info.items)) or 'none'})")
    location = Location.parse(path)
    return items_lib.read(lambda key: location.read_file(info.arrays + key), name, entry, info.step, process,
                          processes, path)[2]


def verify_items(path: str, step: int | None = None) -> int:
    """Read every item file of the step at ``path`` (every process's value of a PerProcess item)
    and check each against its CRC-32C where the step info says it carries one; the number of
    files checked (0: a step without items, an Orbax step, or a checkpoint that is no manager's
    step). ``step``: its number (None: as its info says). The one check every verify makes
    (``storage.step_files.verify_items``: ``Dispatcher.verify`` too); raises as :func:`read_item`:
    a flipped byte is a CorruptCheckpointError naming the step, the item and the process."""
    if orbax_items.is_orbax_step(path):
        return 0
    return step_files.verify_items(path, step)


def pytree_path(path: str, item: str | None) -> str:
    """The path a restore of the step's pytree reads: the step itself, or an Orbax step's
    PyTree ``item``. ValueError for an ``item`` of one of our steps (they hold one pytree);
    KeyError for an Orbax item that is not a PyTree item."""
    if orbax_items.is_orbax_step(path):
        return orbax_items.pytree_path(path, item)
    if item is not None:
        raise ValueError(f"item={item!r}: {path} is a dispatch_io step, which holds one pytree (its other "
                         "items are read with item(step, name))")
    return path
