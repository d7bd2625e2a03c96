"""Code that runs where the data is: write host chunks into TensorStore arrays, read regions back.

Nothing in here knows about plans, priorities or checkpoints: every call receives what it
needs as plain, picklable data (:class:`ArraySpec`, :class:`Region`), so the same functions
run in-process, in a colocated Python worker, or in another ``jax.distributed`` process.
"""

from workers.tensorstore_io import (
    LAYOUTS,
    ArraySpec,
    ChunkError,
    Region,
    Session,
    aligned_empty,
    checksum_regions,
    crc32c,
    layout_kvstore,
    merge_writers,
    numpy_dtype,
    read_regions,
    shared_context,
    storage_dtype_name,
    write_regions,
)

__all__ = ["LAYOUTS", "ArraySpec", "ChunkError", "Region", "Session", "aligned_empty", "checksum_regions", "crc32c", "layout_kvstore", "merge_writers", "shared_context", "numpy_dtype", "read_regions", "storage_dtype_name", "write_regions"]
