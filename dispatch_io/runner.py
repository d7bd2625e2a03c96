"""Where worker code runs: the small interface a dispatcher is given, and the in-process runner.

A :class:`Runner` answers five questions for the save and restore drivers, which never see a
dispatcher:

* ``open_writer(target)``: a :class:`Writer` for this process's part of a save;
  ``writer.write(regions, buffers)`` writes one batch's chunks (the leader stores the arrays'
  metadata when the save commits: ``workers.finish_arrays``).
* ``copy_to_host(plan, chunks, sources, staging)``: one batch off its devices.
* ``open_reader(kvstore, context)``: a :class:`Reader` of a checkpoint's arrays;
  ``reader.read(items)`` reads :class:`~workers.ReadItem` s, ``reader.checksums(regions)``
  computes CRC-32Cs of stored regions.
* ``threads``: the :class:`IOThreads` its calls run on (callbacks run there too).

Every call that does IO returns a ``concurrent.futures.Future``; workers get plain data only.
:class:`LocalRunner` runs the worker functions on a thread pool in this process;
``dispatch_io.colocated.ColocatedRunner`` runs them through ``colocated_python``.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Protocol, Sequence

import jax
import tensorstore as ts

from dispatch_io.plan.save_plan import Chunk, Plan
from dispatch_io.save import pinned_save
from dispatch_io.save.transfer import PAGEABLE, PINNED, copy_chunks_to_host
from dispatch_io.storage import WriteTarget
from dispatch_io.workers import (IOSettings, ReadItem, Region, Session, checksum_regions, read_items,
                     write_regions)

_current = threading.local()  # .owner: the IOThreads the running thread belongs to


class IOThreads:
    """The threads one dispatcher runs its IO and callbacks on: a pool, and threads that mark
    themselves (save drivers). ``is_current()`` tells a call made from one of them, which
    must not wait for the dispatcher (it would wait for itself)."""

    def __init__(self, count: int, name: str):
        self.name = name
        self.pool = concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix=name, initializer=self.mark)

    def mark(self):
        """Count the calling thread as one of these."""
        _current.owner = self

    def is_current(self) -> bool:
        return getattr(_current, "owner", None) is self

    def submit(self, fn, *args) -> concurrent.futures.Future:
        return self.pool.submit(fn, *args)

    def shutdown(self):
        self.pool.shutdown(wait=True)


class Writer(Protocol):
    def write(self, regions: Sequence[Region], buffers: Sequence) -> concurrent.futures.Future:
        """Write a batch; resolves to the CRC-32C of each region (None without checksums)."""

    def close(self):
        ...


class Reader(Protocol):
    def read(self, items: Sequence[ReadItem]) -> concurrent.futures.Future:
        """Read the items; resolves to one array per item (numpy, or on a colocated CPU device)."""

    def checksums(self, regions: Sequence[Region]) -> concurrent.futures.Future:
        """Resolves to the CRC-32C of each stored region's bytes."""

    def close(self):
        ...


class Runner(Protocol):
    threads: IOThreads
    host_staging: bool  # copies land in the staging ring (False: elsewhere; the ring only counts bytes)

    def open_writer(self, target: WriteTarget) -> Writer:
        """A writer of this process's chunks into ``target``."""

    def copy_to_host(self, plan: Plan, chunks: Sequence[Chunk], sources, staging) -> list:
        """The chunks' data on the host (numpy views of ``staging``, or arrays on colocated CPU
        devices), in order; raises ChunkError naming the chunk that failed."""

    def open_reader(self, kvstore: dict, context: ts.Context | None) -> Reader:
        ...

    def close(self):
        ...


class LocalRunner:
    """Runs the worker functions in this process on ``settings.threads`` threads: one writer
    per JAX process (``p<index>``). ``transfer`` (``transfer.PAGEABLE`` or ``PINNED``, as
    ``transfer.resolve`` decides) is how chunks come off their devices: pageable copies
    straight into the staging ring, or pinned host buffers the writers read as they are (the
    ring then only counts their bytes)."""

    def __init__(self, settings: IOSettings, threads: IOThreads | None = None, transfer: str = PAGEABLE):
        if transfer not in (PAGEABLE, PINNED):
            raise ValueError(f"LocalRunner: transfer must be {PAGEABLE!r} or {PINNED!r} (transfer.resolve gives "
                             f"one), got {transfer!r}")
        self.settings = settings
        self.threads = threads or IOThreads(settings.threads, "dispatch_io-worker")
        self.transfer = transfer
        self.host_staging = transfer == PAGEABLE

    def open_writer(self, target: WriteTarget) -> "LocalWriter":
        return LocalWriter(self.threads, Session.writer(target.kvstore, f"p{jax.process_index()}", self.settings,
                                                        target.context))

    def copy_to_host(self, plan, chunks, sources, staging):
        if self.host_staging:
            return copy_chunks_to_host(plan, chunks, sources, staging)
        return pinned_save.start(plan, chunks, sources).finish()

    def start_copy(self, plan, chunks, sources, staging):
        """The pinned path's copy of a batch, started and not awaited: ``.finish()`` returns what
        ``copy_to_host`` would (``pinned_save.start``; the save driver's ``lookahead``)."""
        return pinned_save.start(plan, chunks, sources)

    def open_reader(self, kvstore: dict, context) -> "LocalReader":
        return LocalReader(self.threads, Session(kvstore, self.settings, context))

    def close(self):
        self.threads.shutdown()


class LocalWriter:
    def __init__(self, threads: IOThreads, session: Session):
        self._threads, self._session = threads, session

    def write(self, regions, buffers):
        return self._threads.submit(write_regions, self._session, regions, buffers, True)  # views of the staging ring

    def close(self):
        self._session.close()


class LocalReader:
    def __init__(self, threads: IOThreads, session: Session):
        self._threads, self._session = threads, session

    def read(self, items, out=None):
        """``out``: a buffer per item that TensorStore reads into (a read ring's), else new ones."""
        return self._threads.submit(read_items, self._session, items, out)

    def checksums(self, regions):
        return self._threads.submit(checksum_regions, self._session, regions)

    def close(self):
        self._session.close()
