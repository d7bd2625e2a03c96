"""What a valid checkpoint description is: every check a reader makes before it plans or allocates.

Checkpoints travel (shared buckets, downloads, a teammate's directory), so a reader treats every
file of one as untrusted input. A damaged or crafted description must end in a prompt
:class:`~dispatch_io.errors.CorruptCheckpointError` ("malformed checkpoint", what is wrong, the
key path, the path), never in a plan sized by what a file claims. The checks, in the order a
checkpoint is opened, one module each:

* ``fields`` -- :func:`check_document`: ``manifest.json`` as JSON (ours), every field typed and
  bounded, the structure's depth and size bounded, names of stored arrays matching :data:`NAME`;
* ``consistency`` -- :func:`check_manifest`: the parsed description (ours and Orbax's) agrees
  with itself: shapes, dtypes, chunk grids (at most :data:`MAX_CHUNKS` chunks), names, sizes;
* ``zarr_json`` -- :func:`check_stored`: each stored array's own ``zarr.json`` (ours) agrees
  with the manifest. Read when the checkpoint is opened, before any buffer.

Part of the core (imports only ``errors``, ``tree`` and ``workers``). What a reader checks is
listed in ``docs/format.md`` ("What a reader checks").
"""

from dispatch_io.validate.consistency import MAX_CHUNKS, check_manifest, check_name, chunk_count
from dispatch_io.validate.fields import (MAX_DIM, MAX_RANK, MAX_STRUCTURE_DEPTH, MAX_TEXT, NAME, check_document,
                                         describes_sharding, malformed)
from dispatch_io.validate.zarr_json import MAX_ZARR_JSON_BYTES, check_stored, stored_problem

__all__ = ["MAX_CHUNKS", "MAX_DIM", "MAX_RANK", "MAX_STRUCTURE_DEPTH", "MAX_TEXT", "MAX_ZARR_JSON_BYTES", "NAME",
           "check_document", "check_manifest", "check_name", "check_stored", "chunk_count", "describes_sharding",
           "malformed", "stored_problem"]
