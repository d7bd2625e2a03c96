"""The items of a step that Orbax's CheckpointManager wrote with ``Composite`` args.

MaxText saves ``items`` (the state, a PyTree item) and ``iter`` (Grain's iterator state);
others add a ``JsonSave`` item. On disk, in the step directory::

    _CHECKPOINT_METADATA          {"item_handlers": {name: handler class}, "metrics": ..., timestamps}
    items/_METADATA, ...          a PyTree item (what ``restore(item="items")`` reads)
    iter/process_<i>-of-<n>.json  Grain's handler: each process's iterator state, as text
    config/metadata               a JSON item's value

An item's kind is taken from ``item_handlers`` where the step names its handler, else from
the files present. Grain's states are returned as the bytes Orbax stored (a Grain
``DataLoader`` iterator's ``set_state`` takes them as they are; a dataset iterator's takes
``json.loads`` of them). A step is read where it lives: a local directory or an object-store
prefix (``storage.folders``).
"""

from __future__ import annotations

import re

from dispatch_io.formats import orbax
from dispatch_io.errors import CheckpointError
from dispatch_io.manager.info import StepInfo, metric
from dispatch_io.storage import COMMITTED, MANIFEST, MAX_MANIFEST_BYTES
from dispatch_io.storage.folders import Folder
from dispatch_io.workers import brief_error

_GRAIN_FILE = re.compile(r"process_([0-9]+)-of-([0-9]+)\.json")
_METRICS = "metrics"   # the item Orbax's manager stores a step's metrics in (a JSON item)


def _json_file(item: Folder) -> str | None:
    """The file of a JSON item: ``metadata`` (JsonSave's), else ``<name>`` (Orbax's metrics
    item names its file after itself)."""
    return next((name for name in ("metadata", item.name) if item.is_file(name)), None)


def is_orbax_step(path: str) -> bool:
    """Whether ``path`` is a step Orbax wrote (not one of ours), in a local directory or under an
    object-store prefix."""
    step = Folder.open(path)
    if any(step.is_file(name) for name in (MANIFEST, COMMITTED)):
        return False
    return step.is_file(orbax.STEP_METADATA) or bool(orbax.items(step))


def _step_metadata(step: Folder) -> dict:
    if not step.is_file(orbax.STEP_METADATA):
        return {}
    try:
        found = orbax.read_json(step, orbax.STEP_METADATA)
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{step.display}: Orbax's {orbax.STEP_METADATA} cannot be read ({brief_error(exc)})") from None
    if not isinstance(found, dict):
        raise CheckpointError(f"{step.display}: Orbax's {orbax.STEP_METADATA} is not a JSON object "
                              "(malformed checkpoint)")
    return found


def _kinds(step: Folder) -> dict[str, str]:
    """name -> ``"pytree"`` / ``"grain"`` / ``"json"`` / the handler's name, for every item."""
    handlers = _step_metadata(step).get("item_handlers")
    kinds = {}
    for name in step.names():
        if not step.is_folder(name) or name.startswith((".", "_")):
            continue
        item = step.child(name)
        handler = handlers.get(name) if isinstance(handlers, dict) else None
        if orbax.is_item(item):
            kinds[name] = "pytree"
        elif isinstance(handler, str) and "grain" in handler.lower() or any(map(_GRAIN_FILE.fullmatch, item.names())):
            kinds[name] = "grain"
        elif _json_file(item) is not None:
            kinds[name] = "json"
        elif isinstance(handler, str):
            kinds[name] = handler.rsplit(".", 1)[-1]
    return kinds


def pytree_path(path: str, item: str | None) -> str:
    """The path a restore of ``item`` (None: the step's only PyTree item) reads. KeyError,
    listing the PyTree items, if ``item`` is not one."""
    if item is None:
        return path
    step = Folder.open(path)
    pytrees = [name for name, kind in _kinds(step).items() if kind == "pytree"]
    if item not in pytrees:
        raise KeyError(f"{path} has no PyTree item {item!r} (its PyTree items: {', '.join(pytrees) or 'none'})")
    return step.child(item).display


def item(path: str, name: str, process: int, processes: int):
    """A JSON item's value, or this process's Grain state (bytes, as stored). KeyError
    (listing the items) if there is no such item; CheckpointError if the Grain states were
    saved by another number of processes, or the item is of a kind not read here."""
    step = Folder.open(path)
    kinds = _kinds(step)
    kind = kinds.get(name)
    folder = step.child(name)
    where = folder.display
    if kind is None:
        raise KeyError(f"{path} has no item {name!r} (its items: {', '.join(kinds) or 'none'})")
    if kind == "json":
        try:
            return orbax.read_json(folder, _json_file(folder))
        except (OSError, ValueError, RecursionError) as exc:
            raise CheckpointError(f"{where}: the JSON item cannot be read ({brief_error(exc)})") from None
    if kind == "grain":
        counts = {int(m.group(2)) for m in map(_GRAIN_FILE.fullmatch, folder.names()) if m}
        if counts != {processes}:
            raise CheckpointError(f"item {name!r} of {path} holds Grain states of {sorted(counts)} processes; this "
                                  f"job has {processes}: each process's own state cannot be told")
        try:
            return folder.read(f"process_{process}-of-{processes}.json", MAX_MANIFEST_BYTES)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{where}: process {process}'s Grain state cannot be read ({brief_error(exc)})") from None
    raise CheckpointError(f"item {name!r} of {path} is {'a PyTree item: restore(step, item=' + repr(name) + ')' if kind == 'pytree' else f'of a kind dispatch_io does not read ({kind})'}")


def step_info(path: str, step: int) -> StepInfo:
    """What Orbax recorded of the step: timestamps, metrics, custom metadata, item handlers."""
    step_folder = Folder.open(path)
    meta = _step_metadata(step_folder)
    seconds = lambda key: meta[key] / 1e9 if isinstance(meta.get(key), (int, float)) else None
    kinds = _kinds(step_folder)
    metrics = item(path, _METRICS, 0, 1) if kinds.get(_METRICS) == "json" else meta.get("metrics")
    metrics = {k: metric(v) for k, v in (metrics if isinstance(metrics, dict) else {}).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return StepInfo(step, seconds("init_timestamp_nsecs"), seconds("commit_timestamp_nsecs"), metrics,
                    meta.get("custom_metadata"), kinds, version="orbax")
