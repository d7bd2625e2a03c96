"""The contract between the controller and the workers: plain, picklable data only.

Everything a worker function receives is one of these (or a TensorStore kvstore spec, a
``dict``), so the same functions run in-process, in a colocated Python worker, or in another
``jax.distributed`` process:

* :class:`ArraySpec`: one stored array (name, shape, dtype, chunk shape), or one small leaf
  packed into a byte array shared with others (:attr:`ArraySpec.packed`).
* :class:`Region`: a box of one stored array, named by the key path of its leaf.
* :class:`ReadItem`: one region of a restore's result, and the stored pieces that fill it.
* :class:`IOSettings`: how workers move bytes, built once from ``dispatch_io.Options``.
* :class:`ChunkError`: what a worker raises when one region fails, naming its key path.

Compression is a plain ``(codec, level)`` pair or ``None`` (:func:`compression_codec`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re

import numpy as np
import tensorstore as ts

from . import deadlines

LAYOUTS = ("ocdbt", "files")
COMPRESSIONS = ("zstd",)
RAW = "raw"                        # ArraySpec.driver of arrays stored as plain bytes at an offset
ZSTD_DEFAULT_LEVEL = 3             # zstd's own default
ZSTD_LEVELS = (-131072, 22)        # what zstd (and TensorStore's zarr3 codec) accepts


def host_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or ``taskset``'s share,
    not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this OS
        return os.cpu_count() or 1


def default_threads(cpus: int) -> int:
    """IO calls a runner runs at once on a host with ``cpus`` CPUs: half of them (each call
    keeps TensorStore's own threads busy too), at least 2 (one writes while one is copied), at
    most 16 (more batches would only split the budget finer)."""
    return max(2, min(16, cpus // 2))


def default_io_concurrency(cpus: int) -> int:
    """File reads and writes TensorStore keeps in flight per session: they wait on storage, not
    on a CPU, so at least 16 and 2 per CPU on larger hosts."""
    return max(16, 2 * cpus)


def check_data_file_bytes(value) -> None:
    """Raise ValueError (naming the option) unless ``value`` is None or a number of bytes in
    [1, 2**63), what TensorStore's OCDBT ``target_data_file_size`` takes."""
    if value is not None and not (type(value) is int and 0 < value < 1 << 63):
        raise ValueError(f"data_file_bytes must be a number of bytes in [1, 2**63) or None, got {value!r}")


def compression_codec(value) -> tuple[str, int] | None:
    """``value`` as a plain ``(codec, level)`` pair, or None for no compression.

    value: ``None``, ``"zstd"`` (level 3, zstd's default) or ``("zstd", level)`` with an int
    level in [-131072, 22] (negative: zstd's fast modes). Raises ``ValueError`` naming the
    ``compression`` option for anything else."""
    if value is None:
        return None
    if isinstance(value, str):
        value = (value, ZSTD_DEFAULT_LEVEL)
    if not (isinstance(value, tuple) and len(value) == 2 and value[0] in COMPRESSIONS):
        raise ValueError(f"compression must be None, 'zstd' or ('zstd', level), got {value!r}")
    level = value[1]
    if isinstance(level, bool) or not isinstance(level, int) or not ZSTD_LEVELS[0] <= level <= ZSTD_LEVELS[1]:
        raise ValueError(f"compression level must be an int in [{ZSTD_LEVELS[0]}, {ZSTD_LEVELS[1]}], got {level!r}")
    return value[0], level


# TensorStore appends status payloads to its messages: " [tensorstore_spec='{...}']" (the whole
# spec JSON, context included: kilobytes) and " [source locations='...']".
_PAYLOAD = re.compile(r"\s*\[[A-Za-z_ ]+='(?:[^'\\]|\\.)*'\]")
BRIEF_CHARS = 400


def brief_error(exc: BaseException) -> str:
    """``str(exc)`` for a person: TensorStore's status payloads (its spec JSON with its context,
    source locations) left out, the first line only, at most ``BRIEF_CHARS`` characters. Only
    for messages: the exception itself, chained, keeps every detail."""
    text = _PAYLOAD.sub("", str(exc)).strip().split("\n", 1)[0]
    return text if len(text) <= BRIEF_CHARS else text[:BRIEF_CHARS - 3] + "..."


class ChunkError(Exception):
    """A read or write of one region failed; names the leaf's key path (the cause is chained;
    the message has its :func:`brief_error`)."""

    def __init__(self, keypath: str, region, cause: BaseException):
        self.keypath = keypath
        self.region = region
        super().__init__(f"{keypath} region {list(region)}: {type(cause).__name__}: {brief_error(cause)}")


@functools.cache
def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a numpy or ml_dtypes name (``"bfloat16"``, ``"int4"``, ...)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))


@functools.cache
def _tensorstore_knows(name: str) -> bool:
    try:
        ts.dtype(name)
        return True
    except (ValueError, TypeError):
        return False


def storage_dtype_name(dtype) -> str:
    """The TensorStore dtype a numpy/ml_dtypes dtype (or its name) is stored as.

    Its own name when TensorStore knows it (so other zarr readers see real values);
    otherwise an unsigned integer of the same width holding the same bits (uint4, float6,
    newer float8 variants), which still round-trips bit-exactly."""
    return _storage_dtype_name(dtype if isinstance(dtype, str) else np.dtype(dtype).name)


@functools.cache
def _storage_dtype_name(name: str) -> str:
    dtype = numpy_dtype(name)
    if _tensorstore_knows(dtype.name):
        return dtype.name
    return f"uint{8 * dtype.itemsize}"


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """One stored array: its name under the checkpoint's arrays kvstore and its layout.

    ``driver``: the TensorStore driver it is stored with (dispatch_io writes ``zarr3``; Orbax
    checkpoints are also read as ``zarr``). ``missing_is_fill``: a chunk that is not stored
    reads as the fill value (arrays whose writer skipped such chunks); otherwise a missing chunk
    is lost data, an error. Its codecs are not part of it: a writer's
    (:meth:`zarr_metadata`) are ``IOSettings.compression``, a reader takes the stored ones.

    ``driver="raw"`` (:data:`RAW`): the array's bytes, C order and little-endian, are
    ``[offset, offset + nbytes)`` of the key ``name`` itself (a tensor in a safetensors file);
    ``chunk_shape`` then only says how reads of it are cut, and workers read its regions as
    byte ranges (``workers.raw_bytes``).

    ``layers``: chunks of an incremental step that another step of its root stores (read as one
    TensorStore ``stack`` of this array and those chunks there; ``workers.tensorstore_io``).

    ``packed``: ``(pack, offset)`` for a small leaf stored as bytes ``[offset, offset + nbytes)``
    of ``pack``, a 1-D ``uint8`` array holding many leaves (``workers.packs``); its own
    ``shape`` / ``dtype`` are the leaf's and it is one chunk (``chunk_shape == shape``). Workers
    read and write such leaves through their pack (``workers.tensorstore_io``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str            # numpy / ml_dtypes name of the data
    chunk_shape: tuple[int, ...]
    driver: str = "zarr3"
    missing_is_fill: bool = False
    packed: "tuple[ArraySpec, int] | None" = None
    offset: int = 0       # driver "raw": where the bytes start in the key ``name``
    # Incremental steps (dispatch_io.incremental.references): ((home, layout, name, (chunk bounds, ...)), ...):
    # those chunks are read from array ``name`` of the arrays folder ``home`` (relative to this
    # one's, e.g. "../../3/arrays/"), stored with ``layout``; the others from this array.
    layers: tuple = ()

    @property
    def storage_dtype(self) -> str:
        return storage_dtype_name(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * numpy_dtype(self.dtype).itemsize

    @property
    def stored(self) -> "ArraySpec":
        """The array that holds the bytes: the pack of a packed leaf, else this one."""
        return self if self.packed is None else self.packed[0]

    def tensorstore_spec(self, kvstore: dict) -> dict:
        """The spec that opens this stored array under ``kvstore`` (the checkpoint's arrays),
        reading its metadata from storage."""
        return {"driver": self.driver, "kvstore": {**kvstore, "path": kvstore.get("path", "") + self.name + "/"}}

    def zarr_metadata(self, compression: tuple[str, int] | None) -> dict:
        """This array's zarr v3 metadata (``zarr.json``) when its chunks are stored with
        ``compression`` (:func:`compression_codec`), in the form TensorStore writes it."""
        stored = numpy_dtype(self.storage_dtype)
        codecs: list = [{"name": "bytes", "configuration": {"endian": "little"}} if stored.itemsize > 1
                        else {"name": "bytes"}]
        if compression is not None:
            codec, level = compression
            codecs.append({"name": codec, "configuration": {"checksum": False, "level": level}})
        return {
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(self.chunk_shape)}},
            "chunk_key_encoding": {"name": "default"},
            "codecs": codecs,
            "data_type": self.storage_dtype,
            "fill_value": _zero(self.storage_dtype),
            "node_type": "array",
            "shape": list(self.shape),
            "zarr_format": 3,
        }


def _zero(storage_dtype: str):
    """The zero fill value of a stored dtype, as zarr v3 JSON (by name: ml_dtypes' are numpy kind "V")."""
    if storage_dtype == "bool":
        return False
    if storage_dtype.startswith("complex"):
        return [0.0, 0.0]
    return 0 if storage_dtype.startswith(("int", "uint")) else 0.0


@dataclasses.dataclass(frozen=True)
class Region:
    """A rectangular region ``((start, stop), ...)`` of one stored array."""

    array: ArraySpec
    bounds: tuple[tuple[int, int], ...]
    keypath: str

    @property
    def index(self) -> tuple[slice, ...]:
        return tuple(slice(lo, hi) for lo, hi in self.bounds)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.bounds)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * numpy_dtype(self.array.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class ReadItem:
    """One region of a restore's result, as a worker reads it.

    ``pieces`` are (stored region, ``((start, stop), ...)`` in the result buffer) pairs that
    together fill a buffer of ``shape`` holding ``dtype`` (converted from the stored dtype
    where it differs, ``cast=True``). ``key_impl``: the buffer is the ``key_data`` of PRNG keys
    of that impl. ``on_host``: the result is wanted as host numpy, not on a device (a
    colocated worker then ships it as raw bytes, which a jax.Array can hold in every dtype).
    ``device``: the id of the device the result is read for first (None: host results), whose
    colocated host reads it where that matters."""

    pieces: tuple[tuple[Region, tuple[tuple[int, int], ...]], ...]
    shape: tuple[int, ...]
    dtype: str
    key_impl: str | None = None
    on_host: bool = False
    device: int | None = None

    @property
    def stored_dtype(self) -> str:
        return self.pieces[0][0].array.dtype

    @property
    def keypath(self) -> str:
        return self.pieces[0][0].keypath

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * numpy_dtype(self.stored_dtype).itemsize


@dataclasses.dataclass(frozen=True)
class IOSettings:
    """How workers move bytes: the part of ``dispatch_io.Options`` they need, as plain data.

    layout: ``"ocdbt"`` or ``"files"`` (see ``workers.layout_kvstore``).
    fsync: make written files durable before a write returns.
    checksums: compute a CRC-32C of every written region.
    keep_page_cache: leave the checkpoint's files in the OS page cache after IO.
    threads: how many IO calls a runner runs at once (default: :func:`default_threads` of
        this host's CPUs).
    read_window: most stored bytes one read call decodes at a time (bounds TensorStore's
        temporary memory for regions larger than it).
    compression: ``(codec, level)`` the chunks a writer writes are compressed with, or None
        (:func:`compression_codec`); reads take each array's stored codecs.
    data_file_bytes: OCDBT layout: a writer starts a new data file once one holds about this
        many bytes (a value is never split), so a batch is written as several files at once;
        None: one data file per batch.
    io_concurrency: file reads and writes a TensorStore session keeps in flight (default:
        :func:`default_io_concurrency` of this host's CPUs).
    copy_concurrency: threads a TensorStore session encodes, decodes and copies chunks on
        (default: this host's CPUs, :func:`host_cpus`; TensorStore's own default counts the
        machine's, not the CPUs this process may use).
    request_timeout, min_request_rate: object stores: an HTTP request slower than
        ``min_request_rate`` bytes/s for ``request_timeout`` seconds is abandoned and retried
        (:mod:`workers.deadlines`, process-wide); None: no deadline.
    hedge_reads, hedge_after: object stores: a read lagging its peers (at least ``hedge_after``
        seconds) is read again, the first answer used (:mod:`workers.hedged`).
    """

    layout: str = "ocdbt"
    fsync: bool = True
    checksums: bool = False
    keep_page_cache: bool = False
    threads: int = dataclasses.field(default_factory=lambda: default_threads(host_cpus()))
    read_window: int = 64 << 20
    compression: tuple[str, int] | None = None
    data_file_bytes: int | None = None
    io_concurrency: int = dataclasses.field(default_factory=lambda: default_io_concurrency(host_cpus()))
    copy_concurrency: int = dataclasses.field(default_factory=host_cpus)
    request_timeout: float | None = deadlines.DEFAULT_REQUEST_TIMEOUT
    min_request_rate: int = deadlines.DEFAULT_MIN_REQUEST_RATE
    hedge_reads: bool = True
    hedge_after: float = 1.0

    def __post_init__(self):
        for name in ("threads", "io_concurrency", "copy_concurrency"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        check_data_file_bytes(self.data_file_bytes)
        deadlines.check(self.request_timeout, self.min_request_rate)
        if compression_codec(self.compression) != self.compression:
            raise ValueError(f"compression must be a (codec, level) pair or None, got {self.compression!r}")

    @property
    def stored_as(self) -> dict:
        """The settings that shape the stored bytes (the processes of a save must agree on them)."""
        return {"layout": self.layout, "compression": self.compression, "checksums": self.checksums}
