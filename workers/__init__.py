"""Code that runs where the data is: write host chunks into TensorStore arrays, read regions back.

Nothing in here knows about plans, priorities or checkpoints: every call receives what it
needs as plain, picklable data (``workers.contract``), so the same functions run in-process,
in a colocated Python worker, or in another ``jax.distributed`` process.
"""

from .contract import (
    COMPRESSIONS,
    LAYOUTS,
    RAW,
    ArraySpec,
    ChunkError,
    IOSettings,
    ReadItem,
    Region,
    brief_error,
    check_data_file_bytes,
    compression_codec,
    default_io_concurrency,
    default_threads,
    host_cpus,
    numpy_dtype,
    storage_dtype_name,
)
from .layouts import finish_arrays, layout_kvstore, write_files
from .packs import pack_spec, packed_leaf
from .session import Session, aligned_empty, shared_context
from .tensorstore_io import checksum_regions, crc32c, read_items, read_regions, write_regions

__all__ = ["COMPRESSIONS", "LAYOUTS", "RAW", "ArraySpec", "ChunkError", "IOSettings", "ReadItem", "Region", "Session",
           "aligned_empty", "brief_error", "check_data_file_bytes", "checksum_regions", "compression_codec", "crc32c",
           "default_io_concurrency", "default_threads", "host_cpus",
           "finish_arrays", "layout_kvstore",
           "numpy_dtype", "pack_spec", "packed_leaf", "read_items", "read_regions", "shared_context", "storage_dtype_name", "write_files", "write_regions"]
