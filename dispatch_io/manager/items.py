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
from typing import Any, Mapping


# Reading and checking item files is the storage's (``Dispatcher.verify`` checks them too).
from dispatch_io.storage.step_files import ITEMS, NAME, decode, item_crc, key, label, read  # noqa: F401


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
        stored["crc32c"] = item_crc(content)
    return json.dumps(stored).encode()


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


