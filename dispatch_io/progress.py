"""Progress of long saves and restores, and the numbers they report when done.

Three outlets, each fed from the same counts:

* **absl logging, INFO** (``Progress``): a line every :data:`LOG_EVERY_SECS` while batches
  complete, and one summary line when the operation ends, so a save shorter than that writes
  exactly one line into the training log::

      dispatch_io: save ckpt/step_100: batch 5/16, 320.0 MiB / 1.0 GiB (31%), 412.3 MiB/s
      dispatch_io: saved ckpt/step_100: 1.0 GiB in 16 batches, 2.48 s (412.9 MiB/s), blocked 0.004 s, peak host 256.0 MiB

* **a terminal line**: when ``sys.stderr`` is a terminal the periodic lines are not logged;
  instead one line is rewritten in place (``\\r``) for operations running longer than
  :data:`TTY_AFTER_SECS`, and left behind, ending in a newline, holding the summary.
  ``Options(progress=False)`` turns both off (the stats and events below stay).

* **jax.monitoring** (``record``): once per committed save, finished restore or verify, the
  events of :data:`EVENTS`, so the metric sinks registered with JAX pick them up. Durations go
  through ``record_event_duration_secs``, byte counts through ``record_scalar``; each value is
  the :class:`SaveStats` / :class:`RestoreStats` field named in the table, so programs and
  dashboards see the same numbers:

  ==========================================  ========  =====================================
  event                                       recorded  value
  ==========================================  ========  =====================================
  /dispatch_io/save/plan_duration_secs        duration  SaveStats.plan_seconds
  /dispatch_io/save/blocked_duration_secs     duration  SaveStats.blocked_seconds
  /dispatch_io/save/transfer_duration_secs    duration  SaveStats.transfer_seconds
  /dispatch_io/save/write_duration_secs       duration  SaveStats.write_seconds
  /dispatch_io/save/commit_duration_secs      duration  SaveStats.commit_seconds
  /dispatch_io/save/total_duration_secs       duration  SaveStats.total_seconds
  /dispatch_io/save/bytes                     scalar    SaveStats.bytes_written
  /dispatch_io/save/peak_host_bytes           scalar    SaveStats.peak_host_bytes
  /dispatch_io/restore/plan_duration_secs     duration  RestoreStats.plan_seconds
  /dispatch_io/restore/verify_duration_secs   duration  RestoreStats.verify_seconds (verify=True)
  /dispatch_io/restore/read_duration_secs     duration  RestoreStats.read_seconds
  /dispatch_io/restore/total_duration_secs    duration  RestoreStats.total_seconds
  /dispatch_io/restore/bytes                  scalar    RestoreStats.bytes_read
  /dispatch_io/restore/broadcast_bytes        scalar    RestoreStats.bytes_broadcast
  /dispatch_io/restore/received_bytes         scalar    RestoreStats.bytes_received
  /dispatch_io/restore/sent_bytes             scalar    RestoreStats.bytes_sent
  /dispatch_io/verify/total_duration_secs     duration  RestoreStats.total_seconds (verify())
  /dispatch_io/verify/bytes                   scalar    RestoreStats.bytes_read
  ==========================================  ========  =====================================

  Events carry no tags (a path would make every checkpoint a metric of its own). With several
  processes, each records its own save (its bytes, its batches).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time

import humanize
import jax
from absl import logging

LOG_EVERY_SECS = 2.0     # periodic INFO lines at most this often (the summary always)
TTY_AFTER_SECS = 0.5     # a terminal line appears only for operations running longer than this
TTY_EVERY_SECS = 0.1     # and is redrawn at most this often

DURATION, SCALAR = "duration", "scalar"

# event name -> (how it is recorded, the stats field it carries)
EVENTS: dict[str, tuple[str, str]] = {
    "/dispatch_io/save/plan_duration_secs": (DURATION, "plan_seconds"),
    "/dispatch_io/save/blocked_duration_secs": (DURATION, "blocked_seconds"),
    "/dispatch_io/save/transfer_duration_secs": (DURATION, "transfer_seconds"),
    "/dispatch_io/save/write_duration_secs": (DURATION, "write_seconds"),
    "/dispatch_io/save/commit_duration_secs": (DURATION, "commit_seconds"),
    "/dispatch_io/save/total_duration_secs": (DURATION, "total_seconds"),
    "/dispatch_io/save/bytes": (SCALAR, "bytes_written"),
    "/dispatch_io/save/peak_host_bytes": (SCALAR, "peak_host_bytes"),
    "/dispatch_io/restore/plan_duration_secs": (DURATION, "plan_seconds"),
    "/dispatch_io/restore/verify_duration_secs": (DURATION, "verify_seconds"),
    "/dispatch_io/restore/read_duration_secs": (DURATION, "read_seconds"),
    "/dispatch_io/restore/total_duration_secs": (DURATION, "total_seconds"),
    "/dispatch_io/restore/bytes": (SCALAR, "bytes_read"),
    "/dispatch_io/restore/broadcast_bytes": (SCALAR, "bytes_broadcast"),
    "/dispatch_io/restore/received_bytes": (SCALAR, "bytes_received"),
    "/dispatch_io/restore/sent_bytes": (SCALAR, "bytes_sent"),
    "/dispatch_io/verify/total_duration_secs": (DURATION, "total_seconds"),
    "/dispatch_io/verify/bytes": (SCALAR, "bytes_read"),
}



@dataclasses.dataclass(frozen=True)
class SaveStats:
    """What one save did (this process's part of it); the ``/dispatch_io/save/...`` events of
    :data:`EVENTS` carry these fields. Seconds are wall time; transfer and write overlap."""

    path: str
    bytes_written: int
    batches: int
    plan_seconds: float
    blocked_seconds: float     # how long save() blocked the caller
    transfer_seconds: float    # device -> host copies
    write_seconds: float       # first write handed out -> last write durable
    commit_seconds: float
    total_seconds: float       # save() called -> committed
    peak_host_bytes: int       # most staging bytes held at once (<= host_memory_budget)
    plan_cached: bool
    snapshot_bytes: int = 0    # SYNC bytes copied on their devices first (Options.device_snapshots)


@dataclasses.dataclass(frozen=True)
class RestoreStats:
    """What one restore (or ``Dispatcher.verify``) did, in this process; the
    ``/dispatch_io/restore/...`` and ``/dispatch_io/verify/...`` events of :data:`EVENTS` carry
    these fields. Seconds are wall time. A restore's are kept as ``dispatcher.last_restore_stats``."""

    path: str
    bytes_read: int         # stored bytes read, every pass (verify=True reads whole chunks first)
    batches: int            # batches of reads, every pass
    plan_seconds: float     # manifest read and the target checked against it
    verify_seconds: float   # reading stored chunks and checking their CRC-32C (verify=True / verify())
    read_seconds: float     # reading the regions into the result's host buffers
    total_seconds: float    # called -> result built (arrays on their devices) / verified
    verified: bool          # every chunk read was checked against its saved CRC-32C
    bytes_broadcast: int = 0  # result bytes received from other processes' reads (scale-out restore)
    bytes_received: int = 0   # bytes the scale-out restore's collectives brought here (rows: padding too)
    bytes_sent: int = 0       # bytes of this process's rows they took to other processes
    items_checked: int = 0    # verify(): a manager step's item files read and checked (storage.step_files)

def size(nbytes: float) -> str:
    """``412.3 MiB``."""
    return humanize.naturalsize(nbytes, binary=True)


def rate(nbytes: float, seconds: float) -> str:
    """``412.3 MiB/s`` (``-`` before any time has passed)."""
    return f"{size(nbytes / seconds)}/s" if seconds > 0 else "-"


@dataclasses.dataclass
class Phase:
    """One pass over batches (a save's writes; a restore's verify, then its reads)."""

    name: str            # "" for an operation with a single pass
    batches: int         # expected
    nbytes: int          # expected
    started: float
    batches_done: int = 0
    bytes_done: int = 0


class Progress:
    """Reports one save, restore or verify as its batches complete (see the module doc).

    ``phase(name, batches, nbytes)`` starts a pass whose totals are known; ``advance(nbytes)``
    counts one finished batch of it, from any thread; ``finish(summary)`` or ``fail()`` (also
    ``with progress:`` around the work) ends the operation. The counts are kept whether or not
    anything is shown (``enabled``): callers build their stats from them. Writing to a broken
    stream stops the terminal line instead of raising into the IO being reported.
    """

    def __init__(self, what: str, path: str, *, enabled: bool = True, stream=None, clock=time.monotonic):
        self.what, self.path, self.enabled = what, path, enabled
        self._clock = clock
        self._stream = (sys.stderr if stream is None else stream) if enabled else None
        self._tty = enabled and _isatty(self._stream)
        self._lock = threading.Lock()
        self.started = clock()
        self.phases: dict[str, Phase] = {}
        self._current: Phase | None = None
        self._next_log = self.started + LOG_EVERY_SECS
        self._next_draw = self.started + TTY_AFTER_SECS
        self._drawn = 0      # length of the terminal line on screen (0: none)

    def phase(self, name: str, batches: int, nbytes: int) -> Phase:
        with self._lock:
            self._current = self.phases[name] = Phase(name, batches, nbytes, self._clock())
            return self._current

    def advance(self, nbytes: int, batches: int = 1):
        """Count ``batches`` finished batches holding ``nbytes`` bytes of the current phase."""
        with self._lock:
            p = self._current
            p.batches_done += batches
            p.bytes_done += nbytes
            if not self.enabled or p.batches_done >= p.batches:  # the summary follows soon
                return
            now = self._clock()
            if self._tty and now >= self._next_draw:
                self._draw(self._line(p, now))
                self._next_draw = now + TTY_EVERY_SECS
            elif not self._tty and now >= self._next_log:
                logging.info("%s", self._line(p, now))
                self._next_log = now + LOG_EVERY_SECS

    def finish(self, summary: str):
        """The operation succeeded: log ``summary``; a terminal line is left holding it."""
        if not self.enabled:
            return
        with self._lock:
            if self._drawn:
                self._draw(summary, end="\n")
        logging.info("%s", summary)

    def fail(self):
        """The operation failed (its error is raised elsewhere): end the terminal line."""
        with self._lock:
            if self._drawn:
                self._write("\n")
                self._drawn = 0

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, *_):
        """``with progress:`` -- ``fail()`` if the block raises."""
        if exc_type is not None:
            self.fail()

    # -- text ------------------------------------------------------------------------------------

    def _line(self, p: Phase, now: float) -> str:
        percent = 100 * p.bytes_done // p.nbytes if p.nbytes else 100
        name = f"{p.name} " if p.name and p.name != self.what else ""
        return (f"dispatch_io: {self.what} {self.path}: {name}batch {p.batches_done}/{p.batches}, "
                f"{size(p.bytes_done)} / {size(p.nbytes)} ({percent}%), {rate(p.bytes_done, now - p.started)}")

    def _draw(self, line: str, end: str = ""):
        """Rewrite the terminal line (padded over a longer previous one)."""
        self._write("\r" + line.ljust(self._drawn) + end)
        self._drawn = 0 if end else len(line)

    def _write(self, text: str):
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):  # closed or broken: stop drawing
            self._tty = False


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


# ---- summaries and jax.monitoring ----------------------------------------------------------------

def save_summary(stats) -> str:
    """The one line a committed save logs (``stats``: SaveStats)."""
    return (f"dispatch_io: saved {stats.path}: {size(stats.bytes_written)} in {stats.batches} batches, "
            f"{stats.total_seconds:.2f} s ({rate(stats.bytes_written, stats.total_seconds)}), "
            f"blocked {stats.blocked_seconds:.3f} s, peak host {size(stats.peak_host_bytes)}")


def restore_summary(stats) -> str:
    """The one line a finished restore logs (``stats``: RestoreStats)."""
    checked = ", every chunk read checked against its CRC-32C" if stats.verified else ""
    received = f", {size(stats.bytes_broadcast)} received from other processes" if stats.bytes_broadcast else ""
    return (f"dispatch_io: restored {stats.path}: {size(stats.bytes_read)} in {stats.batches} batches, "
            f"{stats.total_seconds:.2f} s ({rate(stats.bytes_read, stats.total_seconds)}){received}{checked}")


def verify_summary(stats) -> str:
    """The one line ``Dispatcher.verify`` logs (``stats``: RestoreStats)."""
    checked = "CRC-32C checked" if stats.verified else "saved without checksums"
    return (f"dispatch_io: verified {stats.path}: {size(stats.bytes_read)} read in {stats.batches} batches, "
            f"{stats.total_seconds:.2f} s ({rate(stats.bytes_read, stats.total_seconds)}), {checked}")


def record(kind: str, stats):
    """Record the ``/dispatch_io/<kind>/...`` events of :data:`EVENTS` from ``stats``.

    ``verify_duration_secs`` only for a restore that verified. A listener that raises is logged,
    never raised: the save is committed (the restore done) by the time this runs."""
    prefix = f"/dispatch_io/{kind}/"
    for name, (how, field) in EVENTS.items():
        if not name.startswith(prefix) or (field == "verify_seconds" and not stats.verified):
            continue
        value = getattr(stats, field)
        try:
            if how == DURATION:
                jax.monitoring.record_event_duration_secs(name, float(value))
            else:
                jax.monitoring.record_scalar(name, value)
        except Exception:  # noqa: BLE001 - a metrics sink's bug must not fail the checkpoint
            logging.exception("dispatch_io: a jax.monitoring listener raised for %s", name)


_SUMMARIES = {"save": save_summary, "restore": restore_summary, "verify": verify_summary}


def report(kind: str, progress: Progress, stats):
    """A finished save / restore / verify (``kind``): its summary line on ``progress`` and its
    jax.monitoring events. Never raises: the work is done; reporting it is a courtesy."""
    try:
        progress.finish(_SUMMARIES[kind](stats))
        record(kind, stats)
    except Exception:  # noqa: BLE001
        logging.exception("dispatch_io: could not report the %s of %s", kind, stats.path)
