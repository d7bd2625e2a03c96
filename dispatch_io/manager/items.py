"""Items: what a step holds besides the state -- a JSON value for the step, or each process's own.

    mgr.save(step, state, items={"data": dio.PerProcess(loader.get_state()),   # bytes or JSON
                                 "config": dio.Json(cfg)})                     # one value, process 0's
    loader.set_state(mgr.item(step, "data"))                                   # this process's

Items are files attached to the step's save (``Dispatcher.save(attachments=...)``), under its
arrays folder, so they commit with the state or not at all::

    arrays/items/<name>/value.json        a Json item (written by process 0)
    arrays/items/<name>/<process>.json    a PerProcess item, one file per process

Each file is ``{"json": value}`` or ``{"bytes": "<base64>"}``. The step's info (``info.py``)
lists the items with their kind and, for PerProcess items, the process count.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from typing import Any, Mapping

from dispatch_io.errors import CheckpointError

ITEMS = "items/"
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")   # an item's name: never a path


@dataclasses.dataclass(frozen=True)
class Json:
    """One JSON value for the step (a config, a tokenizer's vocabulary size, ...), written by
    process 0; every process reads the same value back."""

    value: Any


@dataclasses.dataclass(frozen=True)
class PerProcess:
    """Each process's own value (``bytes`` or a JSON value): a data iterator's state. A step
    restores it only on the same number of processes, each getting back its own."""

    value: Any


def _encode(name: str, value) -> bytes:
    """``value`` as an item file; ValueError naming the item if it is neither bytes nor JSON."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return json.dumps({"bytes": base64.b64encode(bytes(value)).decode()}).encode()
    try:
        return json.dumps({"json": value}, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"item {name!r}: {type(value).__name__} is neither bytes nor a JSON value "
                         f"({exc})") from None


def _decode(data: bytes, where: str):
    try:
        stored = json.loads(data)
        if isinstance(stored, dict) and set(stored) == {"bytes"}:
            return base64.b64decode(stored["bytes"], validate=True)
        if isinstance(stored, dict) and set(stored) == {"json"}:
            return stored["json"]
    except (ValueError, TypeError, RecursionError):
        pass
    raise CheckpointError(f"{where} is not an item file dispatch_io wrote (malformed checkpoint)")


def files(items: Mapping[str, Json | PerProcess] | None, process: int, own_step: bool = False
          ) -> tuple[dict[str, bytes], dict]:
    """This process's item files (key under the arrays folder -> bytes) and the items' entry of
    the step info (name -> ``{"kind": ...}``). ``own_step``: the files of a step this process
    saves alone (a local-tier step), which holds the Json items too (else process 0 writes them).
    ``TypeError`` / ``ValueError`` naming the item for a bad name or value, before anything is written."""
    if items is None:
        return {}, {}
    if not isinstance(items, Mapping):
        raise TypeError(f"items must be a dict of name -> dio.Json / dio.PerProcess, got {type(items).__name__}")
    out, index = {}, {}
    for name, item in items.items():
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"item name {name!r}: use letters, digits, '_', '.' and '-' (at most 100, "
                             "not starting with '.' or '-')")
        if isinstance(item, Json):
            encoded = _encode(name, item.value)
            if process == 0 or own_step:
                out[f"{ITEMS}{name}/value.json"] = encoded
            index[name] = {"kind": "json"}
        elif isinstance(item, PerProcess):
            out[f"{ITEMS}{name}/{process}.json"] = _encode(name, item.value)
            index[name] = {"kind": "per_process"}
        else:
            raise TypeError(f"item {name!r} must be dio.Json(value) or dio.PerProcess(value), "
                            f"got {type(item).__name__}")
    return out, index


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


def decode(data: bytes | None, name: str, where: str):
    """The value of item ``name`` from its file's bytes (None: the file is missing)."""
    if data is None:
        raise CheckpointError(f"item {name!r} of {where} is listed but its file is missing (malformed checkpoint)")
    return _decode(data, f"item {name!r} of {where}")
