"""What both exports (to safetensors, to Orbax) share: names, refusals, reading the source in
bounded pieces, and committing a local directory.

An export is a stream: every leaf of the source is read in pieces of whole leading-axis blocks
(C order, at most ``max_chunk_bytes`` each), in batches of at most half the budget with one
batch read while the previous one is written, so host memory stays within the budget however
large the leaves. A local output is written into a temporary sibling of the destination and
renamed into place only once complete (:class:`LocalOutput`); an object-store prefix has no rename,
so its files are written where they belong, between a marker written first and removed last
(:data:`IN_PROGRESS`), and the export is committed by the one file its readers look for first,
written last (:class:`ObjectOutput`). A failure leaves nothing at the destination either way; a
killed export leaves its marker, which lets the next export replace what it left.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import math
import os
import shutil
import uuid
from typing import Callable

import jax
import tensorstore as ts

from dispatch_io.read import loop as reading
from dispatch_io import tree as tree_lib
from dispatch_io.plan.batches import pack
from dispatch_io.manifest import Manifest, SavedLeaf
from dispatch_io.plan.save_plan import storage_chunk_shape
from dispatch_io.progress import Progress
from dispatch_io.storage import DirectoryLocation, Location
from dispatch_io.storage.folders import Folder
from dispatch_io.storage.objectstore import KvLocation
from dispatch_io.workers import Region, Session, numpy_dtype, read_regions

TARGETS = ("dispatch_io", "safetensors", "orbax")


@dataclasses.dataclass(frozen=True)
class ExportStats:
    """What an export did: where it wrote, the bytes of tensor data, the files it made, the
    key paths it skipped (``skip_unsupported``), and how long it took."""

    path: str
    bytes_written: int
    files: tuple[str, ...]
    skipped: tuple[str, ...]
    total_seconds: float


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A source leaf being exported: its JAX key path, its name in the output, what it is."""

    path: tuple
    name: str
    saved: SavedLeaf


# A leaf's name in an export: its key names joined by ``.`` (one rule with restore's default
# safetensors name): ``['model']['layers'][3]['w']`` is ``model.layers.3.w``.
default_name = tree_lib.dotted_name

# The keywords each target takes beyond ``overwrite`` (``Dispatcher.convert``).
KEYWORDS = {"dispatch_io": (), "safetensors": ("names", "skip_unsupported", "max_shard_size"), "orbax": ()}


def check_keywords(to: str, names, skip_unsupported: bool, max_shard_size: int | None):
    """ValueError for a ``to`` that is not a target, for a keyword ``to`` does not take (an
    Orbax checkpoint names its leaves by their key paths, keeps the whole tree and has no
    shards; a dispatch_io one too), and for a ``max_shard_size`` that is not a positive int."""
    if to not in TARGETS:
        raise ValueError(f"to must be one of {TARGETS}, got {to!r}")
    given = {"names": names is not None, "skip_unsupported": bool(skip_unsupported),
             "max_shard_size": max_shard_size is not None}
    refused = [key for key, used in given.items() if used and key not in KEYWORDS[to]]
    if refused:
        raise ValueError(f"{', '.join(k + '=' for k in refused)}: only an export to safetensors takes "
                         f"{'it' if len(refused) == 1 else 'them'}, not to={to!r}")
    if max_shard_size is not None and not (type(max_shard_size) is int and max_shard_size > 0):
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")


class Unsupported(ValueError):
    """A leaf (``keypath``) that the export's format cannot hold, and why (``reason``); the
    message names ``remedy``, what leaves such leaves out where the call came from."""

    def __init__(self, keypath: str, reason: str, remedy: str = "skip_unsupported=True"):
        super().__init__(f"{keypath}: {reason} ({remedy} leaves such leaves out)")
        self.keypath, self.reason = keypath, reason


def leaves(manifest: Manifest, names: Callable | None, refuse: Callable[[SavedLeaf], str | None],
           skip: bool | None) -> tuple[list[Leaf], list[str]]:
    """(leaves to export, key paths skipped) of ``manifest``. ``names(path) -> str`` names them
    (``tree.call_names``; default :data:`default_name`); ``refuse(saved)`` says why a leaf cannot
    be exported (None: it can). Raises :class:`Unsupported` for the first refused leaf unless
    ``skip`` (None: skipping is not offered, and renaming neither: a plain ValueError), and
    ValueError naming the key paths of two leaves given one name."""
    tree = jax.tree_util.tree_unflatten(manifest.treedef, manifest.leaves)
    out, skipped, owners = [], [], {}
    for path, saved in jax.tree_util.tree_flatten_with_path(tree)[0]:
        problem = refuse(saved)
        if problem is not None:
            if skip is None:
                raise ValueError(f"{saved.keypath}: {problem}")
            if not skip:
                raise Unsupported(saved.keypath, problem)
            skipped.append(saved.keypath)
            continue
        name = tree_lib.call_names(names or default_name, path)
        if name in owners:
            remedy = "rename one of their keys" if skip is None else "pass names= to name them apart"
            raise ValueError(f"{owners[name]} and {saved.keypath} would both be named {name!r}: {remedy}")
        owners[name] = saved.keypath
        out.append(Leaf(path, name, saved))
    return out, skipped


def pieces(saved: SavedLeaf, limit: int) -> list[Region]:
    """The stored array of ``saved`` as regions of whole leading-axis blocks of at most ``limit``
    bytes (or one row), in C order: concatenated, their bytes are the array's."""
    stored = saved.stored
    if stored is None:
        return []
    block = storage_chunk_shape(stored.shape, numpy_dtype(stored.dtype).itemsize, limit)
    regions = []
    # Blocks cut from the leading axes: iterate them in C order.
    axes = [range(0, n, b) for n, b in zip(stored.shape, block)]
    for starts in itertools.product(*axes):
        bounds = tuple((s, min(s + b, n)) for s, b, n in zip(starts, block, stored.shape))
        regions.append(Region(stored, bounds, saved.keypath))
    return regions


def stream(session: Session, work: list[tuple[object, Region]], batch_limit: int,
           write: Callable[[list[tuple]], None], display: str):
    """Read each (tag, region) of ``work`` through ``session``, in order, in batches of at most
    ``batch_limit`` bytes, and hand each batch to ``write`` as (tag, region, host array) triples
    while the next batch is read: :func:`~dispatch_io.read.loop.pipelined`, the loop restore and
    verify read with. Raises WorkerError naming the key path and ``display`` (the source) for a
    region that cannot be read, what ``write`` raises as it is; no read outlives the call."""
    batches = [batch for batch, _ in pack(work, lambda w: w[1].nbytes, batch_limit)]
    progress = Progress("export", display, enabled=False)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dispatch_io-export") as pool:
        reading.pipelined(
            batches, lambda batch: pool.submit(read_regions, session, [region for _, region in batch]),
            lambda batch, arrays: write([(tag, region, array) for (tag, region), array in zip(batch, arrays)]),
            lambda batch: sum(region.nbytes for _, region in batch), progress, "export",
            lambda exc, batch: reading.read_failure(exc, batch[0][1].keypath, display))


class LocalOutput:
    """A directory (or file) written beside ``dst`` and renamed into place by :meth:`commit`.

    ``tmp`` is where to write (a sibling whose name holds ``marker``). Raises FileExistsError if
    ``dst`` exists and not ``overwrite``; ``replaceable(dst)`` must then say it is something an
    export may replace (ValueError otherwise). :meth:`abort` removes what was written."""

    def __init__(self, dst: str, overwrite: bool, replaceable: Callable[[str], bool], marker: str, is_dir: bool):
        self.dst = os.path.abspath(dst)
        if os.path.lexists(self.dst):
            if not overwrite:
                raise FileExistsError(f"{dst} exists (pass overwrite=True to replace it)")
            if not replaceable(self.dst):
                raise ValueError(f"{dst} exists and is not a checkpoint this export writes: it is not replaced")
        os.makedirs(os.path.dirname(self.dst), exist_ok=True)
        self.tmp = os.path.join(os.path.dirname(self.dst), f".{os.path.basename(self.dst)}.{marker}-{uuid.uuid4().hex[:12]}")
        if is_dir:
            os.mkdir(self.tmp)

    def commit(self):
        """fsync what was written, then move it to ``dst`` (replacing what was there)."""
        if os.path.isdir(self.tmp):
            for root, _, files in os.walk(self.tmp):
                for path in [root] + [os.path.join(root, name) for name in files]:
                    _fsync(path)
        else:
            _fsync(self.tmp)
        old = None
        if os.path.lexists(self.dst):
            old = f"{self.tmp}.old"
            os.rename(self.dst, old)
        os.rename(self.tmp, self.dst)
        if old is not None:
            _remove(old)
        _fsync(os.path.dirname(self.dst))

    def abort(self):
        _remove(self.tmp)


# An export to an object store writes this object first and deletes it last: while it is there,
# everything under the prefix is that export's (begun on an empty or replaceable prefix), so an
# export killed before its commit leaves a prefix that the next one may replace.
IN_PROGRESS = ".dispatch_io-export-in-progress"
_IN_PROGRESS_TEXT = b"dispatch_io: an export in progress; everything under this prefix is its own\n"


def in_progress(folder: Folder) -> bool:
    """Whether ``folder`` holds the :data:`IN_PROGRESS` marker of an export (one not committed):
    an object of that name and of its text (a larger one is not it)."""
    if not folder.is_file(IN_PROGRESS):
        return False
    try:
        return folder.read(IN_PROGRESS, len(_IN_PROGRESS_TEXT)) == _IN_PROGRESS_TEXT
    except ValueError:   # larger than the marker's text: an object of the user's
        return False


class ObjectOutput:
    """An export to the object-store prefix ``dst`` (``s3://``, ``gs://``): files are whole
    objects written at their final keys (:meth:`write`, or TensorStore through :meth:`kvstore`),
    and :meth:`commit` writes the commit files last -- the ones a reader looks for first -- so a
    reader sees the export whole or not at all.

    The :data:`IN_PROGRESS` marker is written first and deleted last (after the commit files, or
    after everything else on :meth:`abort`), so a prefix is never left without it while it holds
    an uncommitted export's files. Raises FileExistsError if anything is under ``dst`` and not
    ``overwrite``; ValueError unless what is there is an uncommitted export (its marker) or
    ``replaceable(folder)`` says it is an export's. A replaced export loses its ``unlist`` files
    first (it is no longer seen), then everything under ``dst``. :meth:`abort` removes everything
    under ``dst`` (by then, only what this export wrote)."""

    def __init__(self, dst: str, overwrite: bool, replaceable: Callable[[Folder], bool], unlist: tuple[str, ...]):
        self.location: KvLocation = Location.parse(dst)
        self.display = self.location.display
        self.kv = self.location.open_kv()
        held = Folder.open(dst)
        replacing = held.exists()
        if replacing:
            if not overwrite:
                raise FileExistsError(f"{dst} exists (pass overwrite=True to replace it)")
            if not (in_progress(held) or replaceable(held)):
                raise ValueError(f"{dst} holds files that are not a checkpoint this export writes: it is not replaced")
        self.write(IN_PROGRESS, _IN_PROGRESS_TEXT)   # before anything is deleted: a kill from here on is replaceable
        if replacing:
            for name in unlist:
                self._delete(name)
            self._clear()

    def kvstore(self, sub: str = "") -> dict:
        """The kvstore spec of ``sub`` (``""`` or ending in ``/``) under the destination."""
        return self.location.arrays_kvstore(sub)

    def write(self, name: str, data: bytes):
        self.location.wait(self.kv.write(name, data), f"write {name}")

    def commit(self, files: list[tuple[str, bytes]]):
        """Write ``files`` (name, bytes), in order, last: the export is then visible; then delete
        the :data:`IN_PROGRESS` marker (an export always commits, if with no files)."""
        for name, data in files:
            self.write(name, data)
        self._delete(IN_PROGRESS)

    def abort(self):
        self._clear()
        self._delete(IN_PROGRESS)

    def _delete(self, name: str):
        self.location.wait(self.kv.write(name, None), f"delete {name}")

    def _clear(self):
        """Delete everything under the destination but the :data:`IN_PROGRESS` marker."""
        for keys in (ts.KvStore.KeyRange("", IN_PROGRESS), ts.KvStore.KeyRange(IN_PROGRESS + "\0")):
            self.location.wait(self.kv.delete_range(keys), "delete what was written")


def is_local(dst) -> bool:
    """Whether ``dst`` is a local path (else an object-store URL: :class:`ObjectOutput`).
    ValueError for ``memory://`` (it lives inside one process: nothing an export is for)."""
    location = Location.parse(dst)
    if isinstance(location, DirectoryLocation):
        return True
    if location.spec.get("driver") not in ("s3", "gcs"):
        raise ValueError(f"an export writes a local path or an s3:// / gs:// prefix, not {dst}")
    return False


def _fsync(path: str):
    """Make the file or directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def nbytes(saved: SavedLeaf) -> int:
    """The bytes of the stored array of ``saved`` (0 for none)."""
    stored = saved.stored
    return 0 if stored is None else math.prod(stored.shape) * numpy_dtype(stored.dtype).itemsize
