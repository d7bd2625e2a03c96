"""Layouts: where the zarr arrays of a checkpoint keep their chunks (``"files"`` or ``"ocdbt"``),
and a save's last step on its arrays: their metadata stored, per-writer OCDBT databases merged."""

from __future__ import annotations

import json
from typing import Sequence

import tensorstore as ts

from .contract import LAYOUTS, ArraySpec

_WRITER_MANIFEST = "/manifest.ocdbt"
# OCDBT's B-tree nodes get a small cache of their own (array chunks are never cached): without
# it every chunk read walks the tree from storage again.
NODE_CACHE = {"cache_pool#ocdbt": {"total_bytes_limit": 32 << 20}}


_OBJECT_STORES = ("s3", "gcs")
_INLINE_BYTES = 4096  # values up to this size are kept in the merged database's B-tree


def layout_kvstore(base: dict, layout: str, writer: str | None = None, data_file_bytes: int | None = None) -> dict:
    """The kvstore holding a checkpoint's zarr arrays, given ``base``, its ``arrays/`` kvstore.

    ``"files"``: ``base`` itself, one file (key) per stored chunk. ``"ocdbt"``: an OCDBT
    database in ``base``: chunks packed into a few large data files. Each writer (a process,
    a colocated host) writes a database of its own under ``base/<writer>/``, and
    :func:`finish_arrays` makes them one database at ``base`` before the commit: the merge copies
    references to the data files, not the data. ``data_file_bytes`` (a writer's, when it writes):
    the size at which the writer starts a new data file. TensorStore writes the data files of
    one commit concurrently, so smaller files write a batch in parallel; None: one file per commit.
    """
    if layout == "files":
        return base
    if layout != "ocdbt":
        raise ValueError(f"unknown checkpoint layout {layout!r}; expected one of {LAYOUTS}")
    spec = {"driver": "ocdbt", "base": base, "cache_pool": "cache_pool#ocdbt"}
    if writer is not None:
        spec = _created({**spec, "base": {**base, "path": base.get("path", "") + writer + "/"}})
    if data_file_bytes is not None:
        spec["target_data_file_size"] = data_file_bytes
    return spec


def _created(spec: dict) -> dict:
    """The spec of an OCDBT database this save creates. Each commit of a database rewrites its
    manifest.ocdbt, and creating one writes it twice; GCS allows about one write per second to
    an object name (429s beyond), and a writer commits once per batch. On object stores,
    numbered manifests make every commit a new object. (Readers pass no config: they read what
    is stored, so a checkpoint copied from disk, with a single manifest, reads the same.)"""
    if storage_of(spec["base"]).get("driver") in _OBJECT_STORES:
        return {**spec, "config": {"manifest_kind": "numbered"}}
    return spec


def finish_arrays(base: dict, layout: str, arrays: Sequence[ArraySpec], compression: tuple[str, int] | None,
                  context: ts.Context | None = None):
    """A save's last step on its arrays, taken by one process once every writer is done.

    Writers write chunks only (``Session.open_arrays``): this stores each array's zarr metadata
    (``zarr.json``, for chunks stored with ``compression``) and, with the ``"ocdbt"`` layout,
    merges every writer database under ``base`` (see :func:`layout_kvstore`) into the database
    at ``base``, all in one transaction. ``arrays``: every stored array the save wrote, each
    once (a pack, not its leaves: ``Plan.arrays``). Raises what TensorStore raises."""
    context = ts.Context(NODE_CACHE, parent=context) if context is not None else ts.Context(NODE_CACHE)
    metadata = {f"{spec.name}/zarr.json": json.dumps(spec.zarr_metadata(compression), separators=(",", ":"))
                for spec in arrays}
    if layout != "ocdbt":
        write_files(base, context, metadata)
        return
    listing = ts.KvStore.open(base, context=context).result().list().result()
    writers = sorted(key.decode()[:-len(_WRITER_MANIFEST)] for key in listing
                     if key.decode().endswith(_WRITER_MANIFEST) and key.decode().count("/") == 1)
    spec = _created(layout_kvstore(base, "ocdbt"))
    # The metadata lives in the merged database's B-tree, not in a data file of its own.
    spec["config"] = {**spec.get("config", {}), "max_inline_value_bytes": _INLINE_BYTES}
    target = ts.KvStore.open(spec, context=context).result()
    txn = ts.Transaction()
    staged = target.with_transaction(txn)
    for writer in writers:
        source = ts.KvStore.open(layout_kvstore(base, "ocdbt", writer), context=context).result()
        source.experimental_copy_range_to(staged).result()
    for key, value in metadata.items():
        staged[key] = value
    txn.commit_async().result()


def write_files(kvstore: dict, context: ts.Context | None, files: dict[str, bytes | str]):
    """Write small whole files (key under ``kvstore`` -> bytes) at once: the arrays' metadata, a
    manager's items. Raises the first failure, only once none is still writing (a failed save's
    files are removed next)."""
    store = ts.KvStore.open(kvstore, context=context).result()
    writes = [store.write(key, value) for key, value in files.items()]
    failed = [exc for exc in (write.exception() for write in writes) if exc is not None]
    if failed:
        raise failed[0]


def storage_of(kvstore: dict) -> dict:
    """The kvstore that holds the bytes (under any OCDBT database)."""
    while kvstore.get("driver") == "ocdbt":
        kvstore = kvstore["base"]
    return kvstore
