"""A manager's own files in a step, beside its arrays: the step info and the item files.

Read and checked here, below every layer that reads a checkpoint, so that ``Dispatcher.verify``,
``dispatch-io verify`` and a manager's ``restore(verify=True)`` all check a step's items with the
one function (:func:`verify_items`) and give the same answer for the same path. Writing them is
the manager's (``manager/info.py``, ``manager/items.py``).

A root step's ``info.json`` (written by process 0 in the commit, beside the manifest)::

    {"format": "dispatch_io.step", "version": 1, "step": 100,
     "started": 1764150000.1, "committed": 1764150003.7,        # UNIX seconds
     "metrics": {"eval_loss": 2.31}, "metadata": {...},           # JSON
     "items": {"data": {"kind": "per_process", "processes": 8}, "config": {"kind": "json"}},
     "processes": 8, "dispatch_io": "0.1.0", "arrays": "arrays/", "durability": "persisted"}

A local tier's step has its own ``info.json`` (``"tier": "local"``, the saving ``"process"``, the
same ``"items"``: ``manager/tiers/local_steps.py``) and holds that process's item files only.
Item files are under the arrays folder::

    arrays/items/<name>/value.json        a Json item (written by process 0)
    arrays/items/<name>/<process>.json    a PerProcess item, one file per process

Each file is ``{"json": value}`` or ``{"bytes": "<base64>"}``, with ``"crc32c"`` added when the
save has checksums on (``Options(checksums=True)``): the CRC-32C of the value's bytes (a bytes
value) or of its JSON text (``json.dumps(value)``). An item whose info entry says ``"crc32c": true``
is checked when read: a file without one or that does not match is a ``CorruptCheckpointError``
naming the step, the item and the process.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import re
from typing import Any, Mapping

import numpy as np

from dispatch_io.errors import CheckpointError, CorruptCheckpointError
from dispatch_io.storage import ARRAYS, INFO, PARITY, Location, sealed
from dispatch_io.workers import crc32c

FORMAT, VERSION = "dispatch_io.step", 1
ITEMS = "items/"
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")   # an item's name: never a path
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


def finite(value) -> bool:
    """Whether ``value`` is a finite int or float (not a bool): what a step's metric may be."""
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False



def parse(data: bytes | None, step: int | None, where: str) -> StepInfo:
    """The :class:`StepInfo` in ``data`` (a step's ``info.json``; None: it has none) of ``step``
    (None: the step it records). CheckpointError naming ``where`` if it is not step info this
    version reads: every field typed and in range (finite times and metrics, item names as
    ``manager/items.py`` makes them, ``"arrays"`` the checkpoint's own arrays folder)."""
    if data is None:
        return StepInfo(step)
    try:
        info = _load(data, where)
        ok = (isinstance(info, dict) and info.get("format") == FORMAT and info.get("version") == VERSION
              and isinstance(info.get("metrics"), dict) and items_ok(info.get("items"))
              and all(v is None or finite(v) for v in info["metrics"].values())
              and all(info.get(k) is None or (finite(info[k]) and 0 <= info[k] <= _LAST_SECOND)
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
    """Whether ``items`` is a step info's ``"items"`` as ``info.make`` writes it: {name: {"kind": "json"
    or "per_process" (with its "processes" count), "crc32c": a bool if there}}, names as items makes them."""
    return isinstance(items, dict) and all(
        isinstance(name, str) and NAME.fullmatch(name) and isinstance(e, dict)
        and (e.get("kind") == "json" or (e.get("kind") == "per_process" and _count(e.get("processes"))))
        and isinstance(e.get("crc32c", False), bool) for name, e in items.items())


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1 << 24


def item_crc(content: bytes) -> int:
    """The CRC-32C an item file's entry records of its bytes."""
    return crc32c(np.frombuffer(content, np.uint8))



def _decode(data: bytes, where: str, checked: bool):
    """The value in an item file; with ``checked``, its CRC-32C must be there and match.
    CorruptCheckpointError naming ``where`` otherwise, or if it is not an item file we wrote."""
    try:
        stored = json.loads(data)
        kinds = set(stored) - {"crc32c"} if isinstance(stored, dict) else set()
        if kinds == {"bytes"}:
            value = base64.b64decode(stored["bytes"], validate=True)
            content = value
        elif kinds == {"json"}:
            value = stored["json"]
            content = json.dumps(value, allow_nan=False).encode()
        else:
            value = content = None
    except (ValueError, TypeError, RecursionError):
        value = content = None
    if content is None:
        raise CorruptCheckpointError(f"{where} is not an item file dispatch_io wrote (malformed checkpoint)",
                                     path=where)
    saved = stored.get("crc32c")
    if checked and saved is None:
        raise CorruptCheckpointError(f"{where}: its file has lost the CRC-32C the step info says it carries "
                                     "(malformed checkpoint)", path=where)
    if saved is not None and saved != item_crc(content):
        raise CorruptCheckpointError(f"{where} does not match its CRC-32C (saved {saved}, read "
                                     f"{item_crc(content)}): the stored item is corrupt", path=where)
    return value


def key(name: str, entry: Mapping, process: int, processes: int, where: str) -> str:
    """The file (under the arrays folder) holding item ``name`` for ``process`` of a job of
    ``processes``; CheckpointError naming the item and both counts if a PerProcess item was
    saved by another number of processes."""
    if entry.get("kind") == "json":
        return f"{ITEMS}{name}/value.json"
    saved = entry.get("processes")
    if saved != processes:
        raise CheckpointError(f"item {name!r} of {where} was saved by {saved} processes, one value each; this job "
                              f"has {processes}: each process's own value cannot be told (restore it with "
                              f"{saved} processes, or start the item afresh)")
    return f"{ITEMS}{name}/{process}.json"


def label(name: str, entry: Mapping, step: int, process: int, where: str) -> str:
    """How messages name item ``name`` of ``step`` at ``where`` as ``process`` reads it."""
    whose = "" if entry.get("kind") == "json" else f" (process {process}'s value)"
    return f"item {name!r}{whose} of step {step} at {where}"


def decode(data: bytes | None, entry: Mapping, label: str):
    """The value of the item whose step-info entry is ``entry`` from its file's bytes (None: the
    file is missing), checked against its CRC-32C where the entry says it has one. ``label``
    (:func:`label`) names it in errors: CheckpointError for a missing file,
    CorruptCheckpointError for a malformed or corrupt one."""
    if data is None:
        raise CheckpointError(f"{label} is listed but its file is missing (malformed checkpoint)")
    return _decode(data, label, entry.get("crc32c") is True)


def read(read_file, name: str, entry: Mapping, step: int, process: int, processes: int, where: str):
    """Item ``name`` (step-info ``entry``) of ``step`` at ``where`` for ``process`` of a job of
    ``processes``: its file read with ``read_file(key under the arrays folder)``, decoded and
    checked (:func:`key`, :func:`decode`). Returns (its key, its file's bytes, its value)."""
    key_ = key(name, entry, process, processes, where)
    data = read_file(key_)
    return key_, data, decode(data, entry, label(name, entry, step, process, where))


def verify_items(path, step: int | None = None) -> int:
    """Read every item file of the checkpoint at ``path`` that its step info lists and check each
    against its CRC-32C where the info says it carries one; the number of files checked (0: no
    step info there -- a checkpoint saved without a manager, an Orbax or safetensors one -- or a
    step without items). A root step's: every process's value of a PerProcess item; a local
    tier's step (``"tier": "local"``): the files of the process that saved it. ``step``: its
    number (None: as its info says).

    Raises CheckpointError naming the path for step info this version does not read or a listed
    item file that is missing; CorruptCheckpointError naming the step, the item and the process
    for an item file that is malformed or does not match its CRC-32C (a flipped byte)."""
    location = Location.parse(path)
    where = path if isinstance(path, str) else location.display
    data = location.read_file(INFO)
    if data is None:
        return 0
    local = _local_info(data, where)
    if local is None:
        info = parse(data, step, where)
        files = [(name, entry, process, entry.get("processes", 1)) for name, entry in info.item_entries.items()
                 for process in range(entry.get("processes", 1))]
        folder, number = info.arrays, info.step
    else:
        entries, process = local.get("items", {}), local.get("process")
        if not items_ok(entries) or not (type(process) is int and 0 <= process < 1 << 24):
            raise CorruptCheckpointError(f"{where}: its info's items are not what a local save records (malformed "
                                         "checkpoint)", path=where)
        files = [(name, entry, process, entry.get("processes", 1)) for name, entry in entries.items()]
        recorded = local.get("step")
        folder, number = ARRAYS, step if step is not None or type(recorded) is not int else recorded
    for name, entry, process, processes in files:
        read(lambda key_: location.read_file(folder + key_), name, entry, number, process, processes, where)
    return len(files)


def local_share(path) -> tuple[dict | None, str | None]:
    """What a verify of the local tier's step at ``path`` checks, from its step info (read once):
    ({key path: [region, ...]} (a region: ((lo, hi), ...) per dimension) that it holds -- its
    process's share, which is all a verify of that one step can check --, the nested checkpoint of
    its parity rows, ``<path>/parity``, if its info records parity and the rows committed). (None,
    None) for any other checkpoint (no step info, a root step's) and for a local one that records
    no regions (checked whole, as any checkpoint); the rows None where they never committed, or
    were dropped once the step retired. Raises CorruptCheckpointError naming the path for a local
    step's info whose ``held`` is not what a local save records."""
    location = Location.parse(path)
    where = path if isinstance(path, str) else location.display
    local = _local_info(location.read_file(INFO) or b"", where)
    if local is None or local.get("held") is None:
        return None, None
    try:
        held = {keypath: [tuple((int(lo), int(hi)) for lo, hi in region) for region in regions]
                for keypath, regions in local["held"].items() if isinstance(keypath, str)}
    except (AttributeError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: its info's held regions are not what a local save records "
                                     "(malformed checkpoint)", path=where) from exc
    if not isinstance(local.get("parity"), dict):
        return held, None
    rows = f"{os.fspath(path).rstrip('/')}/{PARITY}"
    return held, (rows if Location.parse(rows).is_committed() else None)


def _local_info(data: bytes, where: str) -> dict | None:
    """The info of a local tier's step (``"tier": "local"``) in ``data``, or None for any other
    (a root step's, checked by :func:`parse`). CorruptCheckpointError as :func:`_load`."""
    try:
        info = _load(data, where)
    except (ValueError, RecursionError):
        return None
    return info if isinstance(info, dict) and info.get("tier") == "local" else None


def _load(data: bytes, where: str):
    """The JSON document in ``data``, a step's info, its seal checked (:mod:`~dispatch_io.storage.sealed`).
    Raises CorruptCheckpointError naming ``where`` if it changed after it was written (a flipped
    byte), ValueError if it is not JSON."""
    try:
        return sealed.loads(data)
    except sealed.BrokenSeal as exc:
        raise CorruptCheckpointError(f"{where}: malformed checkpoint: its {INFO} {exc}", path=where) from exc
