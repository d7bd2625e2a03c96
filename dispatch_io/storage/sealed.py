"""JSON documents that carry their own CRC-32C: a checkpoint's ``manifest.json`` and ``info.json``.

The arrays' chunks have checksums of their own (``Options(checksums=True)``), but the documents
that describe them had none: a flipped byte in a manifest restored a wrong Python scalar (kept
inline, in the manifest) with no error, and one in a local step's ``info.json`` changed what the
step says it holds, which a verify of the step's files could not see. So a writer **seals** the
document: :func:`dumps` writes it as compact JSON and appends a last member, ``"crc32c":
"<8 hex digits>"``, the CRC-32C of the document as compact JSON without it. :func:`loads` parses
it, takes the seal out and checks the bytes before it (as :func:`dumps` wrote them); failing that,
writes the rest again the same way (a JSON parser keeps the members' order, and Python writes
every number and string back as it read it) and compares: any change to what the document says --
a digit, a key, a string's byte -- fails it; a change a parser cannot see (whitespace) does not.

A document without the seal is read as it is (checkpoints written before this, and by tools that
write our format by hand), unless its last member has the seal's shape (a key of six characters
and a value of eight): a flipped byte in the seal's own key must not turn a sealed document into
an unsealed one.
"""

from __future__ import annotations

import json
import re
from typing import Any

import google_crc32c

SEAL = "crc32c"
_SEALED = re.compile(rb',?"crc32c":"[0-9a-f]{8}"}\Z')   # the seal as dumps writes it, last
_TAIL = re.compile(rb'[{,]\s*"[^"\\]{6}"\s*:\s*"[^"\\]{8}"\s*}\s*\Z')   # a seal, perhaps with a damaged key
_LOOK = 256   # both are searched for in the document's last bytes only: a search of the whole scans megabytes


class BrokenSeal(ValueError):
    """A sealed document whose content no longer matches its CRC-32C (a flipped byte, an edit)."""


def broken(exc: BaseException) -> bool:
    """Whether ``exc`` was caused, at any depth of its chain, by a :class:`BrokenSeal`: the
    checkpoint (or one it references) was damaged after it was written, not foreign or unfinished."""
    while exc is not None:
        if isinstance(exc, BrokenSeal):
            return True
        exc = exc.__cause__
    return False


def _crc_of(body: bytes) -> int:
    """CRC-32C of ``body`` with the closing brace its seal took the place of."""
    return google_crc32c.extend(google_crc32c.value(body), b"}")


def _body(doc: dict, allow_nan: bool = True) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=allow_nan).encode()


def exact(value, allow_nan: bool = True) -> bytes:
    """``value`` as compact JSON, which must read back as itself: ValueError if two of its keys are
    alike as JSON strings (``1`` and ``"1"``: JSON keeps one, so the document could never be read
    back, nor its seal match), or for a NaN or infinity with ``allow_nan=False``; TypeError for a
    value JSON cannot hold (as ``json.dumps``)."""
    body = _body(value, allow_nan)
    if _body(json.loads(body)) != body:
        raise ValueError("two of its keys are alike as JSON strings (e.g. 1 and '1'): one would be lost")
    return body


def dumps(doc: dict, *, allow_nan: bool = True) -> bytes:
    """``doc`` as compact JSON with its seal as the last member. Every key of it must be a string,
    none at its top :data:`SEAL` (ValueError): a manifest's are; a caller's own values go through
    :func:`exact` first (``info.make`` does, for a step's metadata). ValueError for a NaN or
    infinity with ``allow_nan=False``, TypeError for a value JSON cannot hold."""
    if SEAL in doc:
        raise ValueError(f"a document to seal must not have a {SEAL!r} member of its own")
    body = _body(doc, allow_nan)
    seal = f'"{SEAL}":"{google_crc32c.value(body):08x}"}}'.encode()
    return body[:-1] + (b"," if doc else b"") + seal


def loads(data: bytes | str) -> Any:
    """The JSON document in ``data``, its seal checked and taken out (unsealed: as it is).

    Raises BrokenSeal (a ValueError) if the seal does not match what the document says, or a
    sealed-looking last member is not a seal; ValueError if it is not JSON; RecursionError if it
    is nested too deep (as ``json.loads``)."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    doc = json.loads(raw)
    if not isinstance(doc, dict) or SEAL not in doc:
        if isinstance(doc, dict) and _TAIL.search(raw, max(len(raw) - _LOOK, 0)):
            raise BrokenSeal("ends in what looks like a damaged checksum member (a flipped byte?)")
        return doc
    seal = doc.pop(SEAL)
    written = _SEALED.search(raw, max(len(raw) - _LOOK, 0))
    if written is not None and seal == f"{_crc_of(raw[:written.start()]):08x}":
        return doc   # the bytes before the seal are the ones it was made of: no need to write them again
    if not isinstance(seal, str) or seal != f"{google_crc32c.value(_body(doc)):08x}":
        raise BrokenSeal("does not match its own CRC-32C: it changed after it was written (a flipped byte, "
                         "or an edit)")
    return doc
