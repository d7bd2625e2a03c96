"""Stored chunks as they are: read and write a zarr3 array's encoded chunk values by key.

A promotion (``dispatch_io.manager.tiers.promotion``) copies a local step's chunks into a persistent
step without decoding them: the bytes written are the bytes read, whatever codec made them.
Keys follow zarr3's default chunk key encoding: ``<array>/c/<i>/<j>/...`` (``<array>/c`` for a
0-d array), under the checkpoint's arrays kvstore (``layouts.layout_kvstore``).
"""

from __future__ import annotations

from typing import Sequence

import tensorstore as ts


def chunk_key(name: str, grid: Sequence[int]) -> str:
    """The key of the chunk at grid index ``grid`` of the stored array ``name``."""
    return "/".join([name, "c", *map(str, grid)])


def read_values(store: ts.KvStore, keys: Sequence[str]) -> list[bytes | None]:
    """The stored value of each key (read concurrently; None: the key is missing). Raises what
    TensorStore raises, once none is still reading."""
    reads = [store.read(key) for key in keys]
    failed = [exc for exc in (read.exception() for read in reads) if exc is not None]
    if failed:
        raise failed[0]
    return [read.result().value if read.result().state == "value" else None for read in reads]


def write_values(store: ts.KvStore, values: dict[str, bytes], transactional: bool):
    """Write ``values`` (key -> bytes) and return once they are durable: in one transaction
    where ``transactional`` (an OCDBT database: one commit per call), else one write each.
    Raises the first failure, once none is still writing."""
    txn = ts.Transaction() if transactional else None
    target = store.with_transaction(txn) if txn is not None else store
    writes = [target.write(key, value) for key, value in values.items()]
    if txn is not None:
        commit = txn.commit_async()
        writes.append(commit)
    failed = [exc for exc in (write.exception() for write in writes) if exc is not None]
    if failed:
        raise failed[0]
