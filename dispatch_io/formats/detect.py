"""Which format a checkpoint path holds, and opening it for reading.

Detection looks at the files present, never tries and fails: a dispatch_io checkpoint has
``manifest.json`` / ``COMMITTED``; an Orbax PyTree item has ``_METADATA``; an Orbax step
directory holds exactly one such item (``default``, ``state``, ...). Anything else is read as a
dispatch_io path, whose errors say what is missing. Orbax checkpoints are read where they are:
local directories (``file://`` too) and object-store prefixes (``s3://``, ``gs://``), through a
:class:`~dispatch_io.storage.folders.Folder`. Hugging Face safetensors (``dispatch_io.formats.safetensors``) are a
``.safetensors`` file, or a directory / URL prefix holding such files and no dispatch_io
checkpoint (local or ``s3://`` / ``gs://``).

:func:`open_checkpoint` gives restore, verify, metadata and convert one view of either format:
a :class:`~dispatch_io.manifest.Manifest`, the kvstore its arrays are read from, and a check
that nothing replaced the checkpoint while it was read. :func:`open_ours` opens a dispatch_io
checkpoint without looking for the others first, for callers that know what they wrote there
(a manager's or a tier's own steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Callable

import tensorstore as ts

from dispatch_io import manifest as manifest_lib
from dispatch_io.incremental import references
from dispatch_io import validate
from dispatch_io.formats import orbax
from dispatch_io.formats import safetensors
from dispatch_io.errors import CheckpointError
from dispatch_io.manifest import Manifest
from dispatch_io.storage import COMMITTED, MANIFEST, DirectoryLocation, Location, StepRoot
from dispatch_io.storage.folders import Folder
from dispatch_io.workers import layout_kvstore, shared_context


@dataclasses.dataclass(frozen=True)
class Opened:
    """A committed checkpoint, ready to be read.

    ``display``: the path as given; ``manifest``: what it holds (``manifest.format`` says who
    wrote it); ``arrays``: the kvstore spec its arrays are read from, with ``context`` (None:
    any); ``check_unchanged(cause=None)`` raises CheckpointError (chained to ``cause``) if
    another save replaced the checkpoint since it was opened."""

    display: str
    manifest: Manifest
    arrays: dict
    context: ts.Context | None
    check_unchanged: Callable[..., None]


def orbax_item(path) -> Folder | None:
    """The Orbax item folder ``path`` names (an item, or a step holding exactly one; a local
    directory or an object-store prefix), or None if ``path`` holds no Orbax checkpoint.
    CheckpointError for a step with several items (the message lists them)."""
    if Location.parse(path).commit_marker() is not None:  # ours: told by one read, before any listing
        return None
    folder = Folder.open(path)
    if not folder.exists() or folder.is_file(MANIFEST) or folder.is_file(COMMITTED):
        return None
    if orbax.is_item(folder):
        return folder
    names = orbax.items(folder)
    if len(names) > 1:
        raise CheckpointError(f"{folder.display} is an Orbax step with {len(names)} items "
                              f"({', '.join(names)}): name one, e.g. {folder.child(names[0]).display}")
    return folder.child(names[0]) if names else None


def committed_steps(root: StepRoot) -> list[int]:
    """Every committed step under a manager's ``root`` (a directory or an object-store prefix):
    dispatch_io's and Orbax's, ascending, from one listing of the root."""
    folder = Folder.open(root.display, bounded=False)   # a root: every step's keys
    return sorted(set(root.committed_steps(folder)) | set(orbax.committed_steps(folder)))


def step_path(root: StepRoot, step: int) -> str:
    """The checkpoint of ``step`` under a manager's ``root``: ``<root>/<step>``, or the Orbax step
    folder holding it under another of Orbax's namings (``ckpt_100``, ``00000100``; see
    ``orbax.step_directories``), committed or not. Raises CheckpointError if several folders
    hold the step: which one is the step cannot be told."""
    ours = root.step_path(step)
    folder = Folder.open(root.display, bounded=False)   # a root: every step's keys
    names = orbax.step_directories(folder).get(step, [])
    others = [folder.child(name).display for name in names if folder.child(name).display != ours]
    if not others:
        return ours
    held_ours = folder.is_folder(str(step)) or folder.is_file(str(step))
    if len(others) > 1 or held_ours:
        held = [ours] * held_ours + others
        raise CheckpointError(f"step {step} is held by {len(held)} directories under {root.display} "
                              f"({', '.join(p.rstrip('/').rsplit('/', 1)[-1] for p in held)}): remove all but one")
    return others[0]


def _check_links(folder: Folder, display: str):
    """CorruptCheckpointError if a symbolic link in the checkpoint ``folder`` leads outside it:
    a reader reads nothing but the checkpoint."""
    outside = folder.links_outside()
    if outside:
        raise validate.malformed(display, f"{len(outside)} symbolic link(s) in it lead outside it "
                                          f"({', '.join(outside[:3])}{', ...' if len(outside) > 3 else ''})")


@contextlib.contextmanager
def _collection_paused():
    """No cyclic garbage collection while the manifest is decoded and parsed.

    Decoding a manifest allocates hundreds of thousands of objects (10 000 leaves: ~4 MB of
    JSON) and keeps them all; each allocation counts towards the collector's next pass, so
    it walks the growing heap over and over, finding nothing (JSON and the parsed description
    hold no cycles): half the time of opening such a checkpoint. Paused here, it resumes as
    it was once the manifest is parsed, raising or not (another thread that switches the
    collector off meanwhile would find it on again: this pauses a process-wide switch)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def open_checkpoint(path) -> Opened:
    """Open the committed checkpoint at ``path`` (dispatch_io or Orbax) for reading.

    Raises TypeError / ValueError for a malformed path, FileNotFoundError if nothing is there,
    IncompleteCheckpointError if it holds no committed checkpoint, CorruptCheckpointError for a
    malformed one (its description, and each stored array's own metadata, are checked here,
    before anything is planned: ``dispatch_io.validate``), CheckpointError for one this version
    cannot read."""
    item = orbax_item(path)
    if item is not None:
        display = Location.parse(path).display
        before = item.stamp(orbax.METADATA)  # Orbax replaces a checkpoint by writing a new directory
        _check_links(item, display)
        manifest, arrays = orbax.read(item, display)
        validate.check_manifest(manifest, display, names=None)

        def check_orbax(cause: BaseException | None = None):
            if item.stamp(orbax.METADATA) != before:
                raise CheckpointError(f"the checkpoint at {display} was replaced while it was being "
                                      "read; read it again") from cause

        return Opened(display, manifest, arrays, None, check_orbax)
    found = safetensors.find(path)
    if found is not None:
        return _open_safetensors(Location.parse(path).display, *found)
    return open_ours(path)


def open_ours(path) -> Opened:
    """Open the committed dispatch_io checkpoint at ``path`` for reading, without looking for an
    Orbax or safetensors checkpoint there first (:func:`open_checkpoint` does): for callers that
    know they wrote it. Raises as :func:`open_checkpoint` does for a checkpoint of ours; for
    anything else at ``path``, what a checkpoint of ours would lack (IncompleteCheckpointError
    or FileNotFoundError)."""
    location = Location.parse(path)
    marker = location.commit_marker()  # a save that replaces the checkpoint changes it
    with _collection_paused():
        doc = location.read_manifest()
        manifest = references.resolve(manifest_lib.parse(doc, location.display), doc, location)  # incremental steps
    if isinstance(location, DirectoryLocation):
        _check_links(Folder.open(location.path), location.display)
    arrays = layout_kvstore(location.arrays_kvstore(manifest.arrays), manifest.layout)
    validate.check_stored(manifest, arrays, location.context, location.display)
    return Opened(location.display, manifest, arrays, location.context,
                  lambda cause=None: location.check_commit_marker(marker, cause))


def _open_safetensors(display: str, spec: dict, files, index) -> Opened:
    """:func:`open_checkpoint` of the safetensors ``safetensors.find`` found at ``display``."""
    context = shared_context(spec)
    manifest, generations = safetensors.read(spec, files, index, display, context)
    return Opened(display, manifest, spec, context,
                  lambda cause=None: safetensors.check_unchanged(spec, generations, display, context, cause))


def metadata(path):
    """The saved tree with ``jax.ShapeDtypeStruct`` leaves (PRNG keys with their key dtype;
    the saved sharding where the format records one and its devices exist here), Python
    scalars as saved. Reads only metadata; needs no devices beyond the default."""
    return manifest_lib.abstract_tree(open_checkpoint(path).manifest)
