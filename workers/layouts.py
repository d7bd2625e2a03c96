"""Layouts: where the zarr arrays of a checkpoint keep their chunks (``"files"`` or ``"ocdbt"``),
and the merge of a save's per-writer OCDBT databases into one."""

from __future__ import annotations

import tensorstore as ts

from workers.contract import LAYOUTS

_WRITER_MANIFEST = "/manifest.ocdbt"
# OCDBT's B-tree nodes get a small cache of their own (array chunks are never cached): without
# it every chunk read walks the tree from storage again.
NODE_CACHE = {"cache_pool#ocdbt": {"total_bytes_limit": 32 << 20}}


_OBJECT_STORES = ("s3", "gcs")


def layout_kvstore(base: dict, layout: str, writer: str | None = None, data_file_bytes: int | None = None) -> dict:
    """The kvstore holding a checkpoint's zarr arrays, given ``base``, its ``arrays/`` kvstore.

    ``"files"``: ``base`` itself, one file (key) per stored chunk. ``"ocdbt"``: an OCDBT
    database in ``base``: chunks packed into a few large data files. Each writer (a process,
    a colocated host) writes a database of its own under ``base/<writer>/``, and
    :func:`merge_writers` makes them one database at ``base`` before the commit: the merge copies
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


def merge_writers(base: dict, context: ts.Context | None = None):
    """Merge every writer database under ``base`` (see :func:`layout_kvstore`) into the
    database at ``base``, in one transaction."""
    context = ts.Context(NODE_CACHE, parent=context) if context is not None else ts.Context(NODE_CACHE)
    listing = ts.KvStore.open(base, context=context).result().list().result()
    writers = sorted(key.decode()[:-len(_WRITER_MANIFEST)] for key in listing
                     if key.decode().endswith(_WRITER_MANIFEST) and key.decode().count("/") == 1)
    target = ts.KvStore.open(_created(layout_kvstore(base, "ocdbt")), context=context).result()
    txn = ts.Transaction()
    for writer in writers:
        source = ts.KvStore.open(layout_kvstore(base, "ocdbt", writer), context=context).result()
        source.experimental_copy_range_to(target.with_transaction(txn)).result()
    txn.commit_async().result()


def storage_of(kvstore: dict) -> dict:
    """The kvstore that holds the bytes (under any OCDBT database)."""
    while kvstore.get("driver") == "ocdbt":
        kvstore = kvstore["base"]
    return kvstore
