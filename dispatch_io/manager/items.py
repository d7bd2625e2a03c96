"""Items: what a step holds besides the state -- a JSON value for the step, or each process's own.

    mgr.save(step, state, items={"data": dio.PerProcess(loader.get_state()),   # bytes or JSON
                                 "config": dio.Json(cfg)})                     # one value, process 0's
    loader.set_state(mgr.item(step, "data"))                                   # this process's

Items are files attached to the step's save (``Dispatcher.save(attachments=...)``), under its
arrays folder, so they commit with the state or not at all::

    arrays/items/<name>/value.json        a Json item (written by process 0)
    arrays/items/<name>/<process>.json    a PerProcess item, one file per process

Each file is ``{"json": value}`` or ``{"bytes": "<base64>"}``, with ``"crc32c"`` added when the
save has checksums on (``Options(checksums=True)``): the CRC-32C of the value's bytes (a bytes
value) or of its JSON text (``json.dumps(value)``). The step's info (``info.py``) lists the items
with their kind, for PerProcess items the process count, and ``"crc32c": true`` for items that
carry one: reading such an item checks it, and a file without one or that does not match is a
``CorruptCheckpointError`` naming the step, the item and the process.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from typing import Any, Mapping

import numpy as np

from dispatch_io.errors import CheckpointError, CorruptCheckpointError
from dispatch_io.workers import crc32c

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


def _crc(content: bytes) -> int:
    return crc32c(np.frombuffer(content, np.uint8))


def _encode(name: str, value, checksums: bool) -> bytes:
    """``value`` as an item file (with its CRC-32C if ``checksums``); ValueError naming the item
    if it is neither bytes nor JSON."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        content = bytes(value)
        stored = {"bytes": base64.b64encode(content).decode()}
    else:
        try:
            content = json.dumps(value, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"item {name!r}: {type(value).__name__} is neither bytes nor a JSON value "
                             f"({exc})") from None
        if json.dumps(json.loads(content)).encode() != content:   # two keys alike as JSON strings: one lost
            raise ValueError(f"item {name!r}: its JSON text does not read back as saved (two keys of one object are "
                             "the same JSON string, e.g. 1 and '1')")
        stored = {"json": value}
    if checksums:
        stored["crc32c"] = _crc(content)
    return json.dumps(stored).encode()


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
    if saved is not None and saved != _crc(content):
        raise CorruptCheckpointError(f"{where} does not match its CRC-32C (saved {saved}, read "
                                     f"{_crc(content)}): the stored item is corrupt", path=where)
    return value


def files(items: Mapping[str, Json | PerProcess] | None, process: int, own_step: bool = False,
          checksums: bool = False) -> tuple[dict[str, bytes], dict]:
    """This process's item files (key under the arrays folder -> bytes) and the items' entry of
    the step info (name -> ``{"kind": ...}``, with ``"crc32c": true`` if ``checksums``: each file
    then carries its value's CRC-32C). ``own_step``: the files of a step this process
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
            encoded = _encode(name, item.value, checksums)
            if process == 0 or own_step:
                out[f"{ITEMS}{name}/value.json"] = encoded
            index[name] = {"kind": "json"}
        elif isinstance(item, PerProcess):
            out[f"{ITEMS}{name}/{process}.json"] = _encode(name, item.value, checksums)
            index[name] = {"kind": "per_process"}
        else:
            raise TypeError(f"item {name!r} must be dio.Json(value) or dio.PerProcess(value), "
                            f"got {type(item).__name__}")
        if checksums:
            index[name]["crc32c"] = True
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
