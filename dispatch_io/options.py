"""One small, frozen options object, passed down whole instead of a dozen keyword arguments."""

from __future__ import annotations

import dataclasses

from dispatch_io.plan.batches import ALIGN
from dispatch_io.save.transfer import MODES as HOST_TRANSFERS
from dispatch_io.workers import (LAYOUTS, IOSettings, check_data_file_bytes, compression_codec, default_io_concurrency,
                     default_threads, host_cpus)
from dispatch_io.workers import deadlines

MiB = 1 << 20
MIN_OVERLAPPED_BATCH = 8 * MiB   # smallest save batch worth a writer's share of staging (batch_bytes)


@dataclasses.dataclass(frozen=True)
class Options:
    """How a dispatcher moves bytes.

    host_memory_budget: bytes of host memory the IO may hold at once (staging for saves,
        reads in flight for restores). Always respected, even for one array larger than it:
        such arrays are split into chunks. At least 64 bytes (256 with ``compression``): each
        chunk takes a 64-byte aligned staging slot or more.
    max_chunk_bytes: upper bound on one chunk (one storage chunk on disk, one unit of
        device-to-host copy). ``None`` picks ``min(staging // 4, 64 MiB)`` (staging: the
        budget, a quarter of it with ``compression``); at most half the staging space, so
        that a batch of it and the next one always fit together. A chunk larger than a batch
        (``batch_bytes``) is a batch of its own.
    write_threads: worker threads doing IO calls concurrently: writing batches, and the reads
        of a restore (a save batch is at most ``staging / (write_threads + 1)`` bytes: one per
        writer and one being copied; half the staging where that would be under 8 MiB). None
        (default): from the CPUs this process may use (``os.sched_getaffinity``): half of them,
        at least 2, at most 16 (2 on a 2-CPU host, 8 on a 16-CPU one).
    io_concurrency: file reads and writes TensorStore keeps in flight per writer or reader.
        None (default): 2 per CPU this process may use, at least 16.
    copy_concurrency: threads TensorStore encodes, decodes and copies chunks on. None
        (default): the CPUs this process may use.
    host_transfer: how a save's chunks come off their devices (``LocalDispatcher``).
        ``"pinned"``: ``jax.device_put`` into the device's ``pinned_host`` memory kind, every
        transfer of a batch started before the first is awaited, and the writers read the
        pinned buffers without another copy (the budget bounds the pinned bytes in flight).
        ``"pageable"``: copied into the staging ring (``copy_to_host_async`` on accelerators).
        ``"auto"`` (default): pinned on accelerators that have the ``pinned_host`` memory
        kind, pageable on CPU devices, whose memory is host memory already.
    fsync: make files and directories durable before the commit marker is written.
    keep_staging_warm: keep the staging buffer between saves. Memory freed to the OS is
        slow to touch again, so a warm buffer makes repeated saves several times faster;
        it stays bounded by the budget and is freed by ``dispatcher.close()``.
    layout: how chunks are stored. ``"ocdbt"`` (default): packed into a few large data files
        of one OCDBT database (about one file per batch and writer), which object stores and
        file systems handle far better than one file per chunk at the same speed.
        ``"files"``: one file per chunk under ``arrays/<leaf>/``, readable by any zarr v3 reader
        with no OCDBT support. Restores read either; the manifest records which.
    data_file_bytes: with the OCDBT layout, the size of its data files: a writer starts a new
        one once a file holds about this many bytes (a chunk is never split: a larger chunk is a
        file of its own), and writes the files of a batch concurrently. Smaller files write
        faster (the disk and the copies into the page cache work in parallel: 1.15-1.5x the save
        GB/s of one file per batch in the benchmark, up to 2x in-process, docs/benchmarks.md) and
        suit object stores (a PUT each); larger ones make fewer files: about one per
        ``data_file_bytes`` saved, at least one per batch and writer. None: one data file per batch.
    device_snapshots: when the SYNC leaves do not fit in the host budget at once, copy the
        ones that do not fit on their own accelerators first (it costs their size in device
        memory until each is copied to host), so that ``save()`` returns after one device-side
        copy instead of waiting for writes to free host memory. Never on CPU devices, whose
        memory is host memory. False: ``save()`` waits.
    keep_page_cache: leave the checkpoint's files in the OS page cache. By default the page
        cache of each batch's files is dropped once written (durable) or read: a checkpoint's
        bytes are used once, and recycling those pages makes IO much faster where fresh memory
        is slow (VMs returning freed memory to the host). Keep it when several processes on one
        host restore the same replicated data.
    checksums: store a CRC-32C of every chunk in the manifest, for ``restore(verify=True)``.
        Computed over the uncompressed bytes, so verify works the same with compression on.
    compression: ``None`` (default: raw little-endian chunks), ``"zstd"`` (zstd level 3) or
        ``("zstd", level)`` with level in [-131072, 22] (negative: zstd's fast modes). Chunks
        are compressed by TensorStore's zarr3 ``zstd`` codec; the manifest records it, and
        restores read any checkpoint whatever this option says. Costs CPU per byte; pays where
        storage or the network is slower than compressing (weights compress ~10-20 %). The
        budget holds with it on: a quarter of it stages chunks, the rest holds their compressed copies.
    barrier_timeout: seconds a process of a multi-process job waits for the others at a
        barrier (while they make no progress) before raising ``BarrierTimeoutError``.
    small_leaf_bytes: a sharded array of at most this many bytes whose devices are all in one
        process is saved as one chunk and copied to host whole, and restored with one read:
        per shard, small leaves (norm scales, biases) would cost a copy, a write and a read per
        few KiB. Leaves this small that one device's host writes whole are packed, many to a
        stored array (format version 2): thousands of leaves are a few arrays to create, write
        and open. 0: a chunk per shard and an array per leaf, always (format version 1). At
        most the chunk size limit.
    restore_broadcast: in a multi-process job, read every stored region once per job: of the
        processes holding a region, one reads it and the others receive it over the devices'
        interconnect (an all-gather: gloo on CPU, NVLink / ICI on accelerators), so N replicas
        do not read the checkpoint N times. False: each process reads all it holds (for a
        fabric slower than the storage).
    progress: report saves and restores as they run: absl INFO lines (one summary line per
        operation, plus one every 2 s while a long one runs) or, when stderr is a terminal, one
        line rewritten in place. False: silent. ``SaveStats`` / ``RestoreStats`` and the
        ``jax.monitoring`` events (``dispatch_io.progress.EVENTS``) are there either way.
    request_timeout: on object stores (``gs://``, ``s3://``), the seconds one HTTP request may
        go on below ``min_request_rate`` -- accepted and never answered, or trickling -- before
        it is abandoned and sent again (TensorStore's retries, at most 8, then the call fails
        with a ``CheckpointError`` naming the object). Default 20 s; whole seconds. None: no
        deadline (a request may wait as long as its connection lives). Process-wide and fixed
        at the process's first object-store request (``workers.deadlines`` says why): the first
        dispatcher's values hold, and the variables ``TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS``
        / ``_LIMIT_BYTES``, where exported, win over both options.
    min_request_rate: the floor, in bytes/s, of ``request_timeout`` (default 32 KiB/s): a
        request that moves fewer bytes a second than this for that long is abandoned. Keep it
        well under the bandwidth one request gets when all run at once.
    hedge_reads: on object stores, read again a region whose read lags the reads of the same
        call (see ``hedge_after``) and use whichever answer comes first, cancelling the other:
        one stalled or trickling read then costs about its peers' time, not ``request_timeout``.
        At most 2 hedges in flight per restore and process, each read hedged once, their bytes at most
        half the read window; reads land in TensorStore's arrays and are copied into place.
        False: no hedges (every read still ends by ``request_timeout``).
    hedge_after: the least time, in seconds, a read runs before it may be hedged (default 1.0).
        Past it, a read is hedged once it takes 4x what the finished reads of the same call
        predict for it, or moves under ``min_request_rate`` (docs/design.md).
    """

    host_memory_budget: int = 1 << 30
    max_chunk_bytes: int | None = None
    write_threads: int | None = None
    fsync: bool = True
    keep_staging_warm: bool = True
    layout: str = "ocdbt"
    data_file_bytes: int | None = 16 * MiB
    device_snapshots: bool = True
    keep_page_cache: bool = False
    checksums: bool = False
    compression: str | tuple[str, int] | None = None
    barrier_timeout: float = 300.0
    small_leaf_bytes: int = 256 << 10
    restore_broadcast: bool = True
    progress: bool = True
    io_concurrency: int | None = None
    copy_concurrency: int | None = None
    host_transfer: str = "auto"
    request_timeout: float | None = deadlines.DEFAULT_REQUEST_TIMEOUT
    min_request_rate: int = deadlines.DEFAULT_MIN_REQUEST_RATE
    hedge_reads: bool = True
    hedge_after: float = 1.0

    def __post_init__(self):
        if self.host_transfer not in HOST_TRANSFERS:
            raise ValueError(f"host_transfer must be one of {HOST_TRANSFERS}, got {self.host_transfer!r}")
        cpus = host_cpus()
        derived = {"write_threads": default_threads(cpus), "io_concurrency": default_io_concurrency(cpus),
                   "copy_concurrency": cpus}
        for name, value in derived.items():
            if getattr(self, name) is None:  # a frozen dataclass: the derived default is set once, here
                object.__setattr__(self, name, value)
            elif type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1 or None, got {getattr(self, name)!r}")
        if not isinstance(self.host_memory_budget, int) or self.host_memory_budget <= 0:
            raise ValueError(f"host_memory_budget must be a positive number of bytes, got {self.host_memory_budget!r}")
        compression_codec(self.compression)  # ValueError naming the option for a bad value
        least = ALIGN if self.compression is None else 4 * ALIGN  # one aligned staging slot per chunk
        if self.host_memory_budget < least:
            raise ValueError(f"host_memory_budget must be at least {least} bytes with compression="
                             f"{self.compression!r}, got {self.host_memory_budget}")
        if self.max_chunk_bytes is not None and not 0 < self.max_chunk_bytes <= self.staging_bytes // 2:
            raise ValueError(
                f"max_chunk_bytes must be in (0, {self.staging_bytes // 2}] (half the staging space: "
                f"host_memory_budget // 2, or // 8 with compression), got {self.max_chunk_bytes!r}")
        check_data_file_bytes(self.data_file_bytes)
        if not self.barrier_timeout > 0:
            raise ValueError(f"barrier_timeout must be a positive number of seconds, got {self.barrier_timeout!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        deadlines.check(self.request_timeout, self.min_request_rate)
        if not isinstance(self.hedge_reads, bool):
            raise ValueError(f"hedge_reads must be True or False, got {self.hedge_reads!r}")
        if isinstance(self.hedge_after, bool) or not isinstance(self.hedge_after, (int, float)) \
                or not self.hedge_after > 0:
            raise ValueError(f"hedge_after must be a positive number of seconds, got {self.hedge_after!r}")
        if not isinstance(self.small_leaf_bytes, int) or isinstance(self.small_leaf_bytes, bool) \
                or self.small_leaf_bytes < 0:
            raise ValueError(f"small_leaf_bytes must be a number of bytes >= 0, got {self.small_leaf_bytes!r}")

    @property
    def chunk_bytes(self) -> int:
        """The chunk size limit actually used."""
        if self.max_chunk_bytes is not None:
            return self.max_chunk_bytes
        return max(1, min(self.staging_bytes // 4, 64 * MiB))

    @property
    def staging_bytes(self) -> int:
        """Host bytes a save stages chunks in: the budget, or a quarter of it with compression on
        -- the copies TensorStore makes of the chunks being written (encoded, then in the data
        file being written; held until their batch commits) get the rest (measured)."""
        return self.host_memory_budget if self.compression is None else max(1, self.host_memory_budget // 4)

    @property
    def batch_bytes(self) -> int:
        """Largest save batch: the staging space shared by one batch per write thread and one
        more. Batches being written share the disk and finish about together; the extra one is
        copied meanwhile, so a writer never waits for a copy (with one batch per writer, the
        disk idled while the next was copied). Half the staging space where that share would
        be under ``MIN_OVERLAPPED_BATCH``: each batch is a commit, whose fixed cost (~ms) many
        small batches would multiply (measured 1.4-2x slower saves at 1-4 MiB budgets)."""
        share = self.staging_bytes // (self.write_threads + 1)
        return max(1, share if share >= MIN_OVERLAPPED_BATCH else self.staging_bytes // 2)

    @property
    def read_batch_bytes(self) -> int:
        """Largest batch of reads (restore, verify): half the budget, so one batch reads while the
        previous one's results are placed (compression does not change what a read holds)."""
        return max(1, self.host_memory_budget // 2)

    def io_settings(self) -> IOSettings:
        """The plain settings the workers need (a dispatcher makes them once)."""
        return IOSettings(layout=self.layout, fsync=self.fsync, checksums=self.checksums,
                          keep_page_cache=self.keep_page_cache, threads=self.write_threads,
                          read_window=self.read_batch_bytes, compression=compression_codec(self.compression),
                          data_file_bytes=self.data_file_bytes, io_concurrency=self.io_concurrency,
                          copy_concurrency=self.copy_concurrency, request_timeout=self.request_timeout,
                          min_request_rate=self.min_request_rate, hedge_reads=self.hedge_reads,
                          hedge_after=self.hedge_after)
