"""How the processes of a job agree on a save and commit it: agree, then commit -- no callbacks.

A coordinator (:func:`for_this_job`) opens one commit object per save; the save driver calls
it in this order and never the other way round::

    commit = coordinator.open(location)
    commit.check_same_plan(plan, stored)  # every process planned the same save (else all raise)
    commit.start(overwrite)           # the leader creates the temporary checkpoint, the others join it
    ... every process writes its chunks, reporting commit.progress(bytes) ...
    checksums = commit.agree(error, checksums)   # raises everywhere if any process failed
    leader: store the arrays' metadata, merge the writers' databases, build the manifest
                                      (the driver, not the commit)
    commit.commit(manifest)           # the leader writes it (others: wait for its outcome)
    commit.end()                      # everyone leaves together

With one controller (one JAX process, or Pathways) :class:`SingleProcessCommit` has nothing to
agree on. Under ``jax.distributed`` every process plans the same save (plans are
deterministic) and writes only its chunks; :class:`MultiProcessCommit` coordinates through the
coordination service that ``jax.distributed.initialize`` started -- its key-value store and
barriers -- and never through a device collective.

Keys and barrier ids derive from the checkpoint path and the phase only (never from
process-local counters, which diverge). A wait fails with :class:`BarrierTimeoutError`, naming
the processes that never arrived, once the others have made no progress for
``barrier_timeout`` seconds: a long save of a big checkpoint never times out, a hung one does.
"""

from __future__ import annotations

import jax
from absl import logging

from dispatch_io.multihost.coordination import Room, job_client
from dispatch_io.errors import BarrierTimeoutError, CheckpointError, WorkerError
from dispatch_io.plan.save_plan import Plan
from dispatch_io.storage import KvLocation, Location, WriteTarget
from dispatch_io.workers import brief_error


def for_this_job(barrier_timeout: float) -> "SingleProcess | MultiProcess":
    """The coordinator for the running JAX job (one process, or several under jax.distributed)."""
    if jax.process_count() == 1:
        return SingleProcess()
    return MultiProcess(job_client(), jax.process_index(), jax.process_count(), barrier_timeout)


def _abort(target: WriteTarget | None):
    if target is None:
        return
    try:
        target.abort()
    except Exception:  # noqa: BLE001 - the save's own error is what the caller needs
        logging.exception("dispatch_io: could not remove a partial save")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {brief_error(exc)}"


class SingleProcess:
    def open(self, location: Location) -> "SingleProcessCommit":
        return SingleProcessCommit(location)


class SingleProcessCommit:
    """The commit protocol of a single-process save: nothing to agree on."""

    leader = True

    def __init__(self, location: Location):
        self.location = location
        self.target: WriteTarget | None = None

    def check_same_plan(self, plan: Plan, stored: dict, agreed=None):
        pass

    def start(self, overwrite: bool):
        self.target = self.location.start_write(overwrite)

    def peer_failed(self) -> bool:
        return False

    def progress(self, nbytes: int):
        pass

    def abandon(self, error: BaseException):
        """The save could not be run: remove what it created."""
        _abort(self.target)

    def agree(self, error: BaseException | None, checksums: dict) -> dict:
        """All chunks' checksums (chunk index -> CRC-32C); with ``error``, remove the save and raise it."""
        if error is not None:
            self.fail(error)
        return checksums

    def fail(self, error: BaseException):
        """Remove the save and raise ``error`` -- or, where another save took the path over
        meanwhile (the likely cause of ``error``), the CheckpointError that says so."""
        superseded = self.target.superseded()
        _abort(self.target)
        if superseded is not None:
            raise superseded from error
        raise error

    def commit(self, manifest: bytes | None, fsync: bool, files=None):
        try:
            self.target.commit(manifest, fsync=fsync, files=files)
        except BaseException:
            _abort(self.target)
            raise

    def end(self):
        pass


def _unlike_leader(published: dict[int, object]) -> list[int]:
    """The processes whose published value is not process 0's, ascending."""
    return sorted(p for p, value in published.items() if value != published[0])


class MultiProcess:
    """Coordinates the saves of a ``jax.distributed`` job through its coordination service."""

    def __init__(self, client, process: int, count: int, timeout: float):
        self.client, self.process, self.count, self.timeout = client, process, count, timeout

    def open(self, location: Location) -> "MultiProcessCommit":
        if isinstance(location, KvLocation) and location.url.startswith("memory://"):
            raise ValueError(f"{location.display}: memory:// lives inside one process; a multi-process "
                             "save needs storage every process sees (a directory or an object store)")
        return MultiProcessCommit(self, location)


class MultiProcessCommit:
    """One save of a multi-process job: the keys under ``dispatch_io/save/<hash of path>/``."""

    def __init__(self, job: MultiProcess, location: Location):
        self.job = job
        self.location = location
        self.room = Room(job.client, job.process, job.count, job.timeout, "save", location.key,
                         f"the save to {location.display}")
        self.leader = self.room.leader
        self.target: WriteTarget | None = None
        self._failed_seen = False
        self.room.open()

    # -- the protocol ------------------------------------------------------------------------

    def check_same_plan(self, plan: Plan, stored: dict, agreed=None):
        """Every process must have planned the same save, or chunks would be written twice or
        by nobody, and store it alike (``stored``: ``IOSettings.stored_as``), or the leader's
        metadata would describe other processes' chunks wrongly; and attach files alike
        (``agreed``: ``Attachments.agreed``), or the leader's info would list files some never
        wrote. All processes see the same digests and options, so all raise ValueError
        (before anything is written)."""
        self.room.set(f"plan/{self.job.process}", [plan.digest, stored, agreed])
        published = self.room.gather("plan")
        digests, options, attached = ({p: entry[i] for p, entry in published.items()} for i in range(3))
        differ = _unlike_leader(attached)
        if differ:
            raise ValueError(f"the processes attach different items to the save of {self.location.display}: "
                             f"process(es) {differ} attach {attached[differ[0]]}, process 0 {attached[0]}. Every "
                             "process must pass the same item names and kinds.")
        differ = _unlike_leader(options)
        if differ:
            raise ValueError(f"the processes save {self.location.display} with different options: process(es) "
                             f"{differ} store {options[differ[0]]}, process 0 {options[0]}. Every process must "
                             "save with the same Options.")
        differ = _unlike_leader(digests)
        if not differ:
            return
        self.room.set(f"leaves/{self.job.process}", plan.leaf_digests)
        leaves = self.room.gather("leaves")
        keypaths = [spec.keypath for spec in plan.leaves
                    if any(len(l) != len(plan.leaves) or l[spec.index] != leaves[0][spec.index]
                           for l in leaves.values())]
        shown = ", ".join(keypaths[:5]) + (f" and {len(keypaths) - 5} more" if len(keypaths) > 5 else "")
        raise ValueError(
            f"the processes planned different saves of {self.location.display}: process(es) {differ} differ from "
            f"process 0 ({f'first at {keypaths[0]}; differing leaves: {shown}' if keypaths else 'in the tree structure'}). "
            "Every process must save the "
            "same tree of global arrays; an array made without a sharding (e.g. jnp.ones) lives on each "
            "process's own device -- give it a global sharding (jax.device_put / make_array_from_callback).")

    def start(self, overwrite: bool):
        """The leader creates the save and publishes its token; the others join it."""
        if self.leader:
            try:
                self.target = self.location.start_write(overwrite)
            except Exception as exc:
                self.room.set("start", {"error": _describe(exc), "type": type(exc).__name__})
                raise
            self.room.set("start", {"token": self.target.token})
            return
        started = self.room.from_leader("start")
        if "error" in started:
            kind = FileExistsError if started["type"] == "FileExistsError" else CheckpointError
            raise kind(f"process 0 could not start the save to {self.location.display}: {started['error']}")
        try:
            self.target = self.location.join_write(started["token"])
        except Exception as exc:  # the others are writing already: fail the save everywhere
            self.agree(exc, {})

    def peer_failed(self) -> bool:
        """True once another process reported a failure (so this one stops copying early)."""
        if not self._failed_seen:
            self._failed_seen = self.room.get("failed") is not None
        return self._failed_seen

    def progress(self, nbytes: int):
        """This process has written ``nbytes``: the others' deadlines move while this grows."""
        self.room.set(f"progress/{self.job.process}", nbytes)

    def abandon(self, error: BaseException):
        """The save could not be run here: tell the others (they stop and raise), remove it."""
        try:
            self.room.set("failed", self.job.process)
            self.room.set(f"status/{self.job.process}", {"error": _describe(error), "keypath": None})
        finally:
            if self.leader:
                _abort(self.target)

    def agree(self, error: BaseException | None, checksums: dict) -> dict:
        """Publish this process's outcome and wait for everyone's. Returns every process's
        checksums merged; if any process failed, the save is removed and every process raises
        (its own error, or a WorkerError naming the process that failed)."""
        if error is not None:
            self.room.set("failed", self.job.process)
            self.room.set(f"status/{self.job.process}", {"error": _describe(error),
                                                      "keypath": getattr(error, "keypath", None)})
        else:
            self.room.set(f"status/{self.job.process}", {"ok": True, "checksums": checksums})
        try:
            statuses = self.room.gather("status", doing="finish writing their part of")
        except BarrierTimeoutError:
            if self.leader:
                _abort(self.target)
            raise
        failures = {p: s for p, s in sorted(statuses.items()) if "error" in s}
        if failures:
            if self.leader:
                _abort(self.target)
            if error is not None:
                raise error
            process, status = next(iter(failures.items()))
            raise WorkerError(f"process {process} failed, so the save to {self.location.display} was not "
                              f"committed: {status['error']}", worker=process, keypath=status["keypath"])
        return {int(i): crc for s in statuses.values() for i, crc in s["checksums"].items()}

    def fail(self, error: BaseException):
        """The leader could not make the manifest: the save is removed, every process raises."""
        self.room.set("commit", {"error": _describe(error)})
        _abort(self.target)
        raise error

    def commit(self, manifest: bytes | None, fsync: bool, files=None):
        """The leader commits ``manifest`` (and ``files`` beside it: ``WriteTarget.commit``);
        every other process waits for the outcome."""
        if not self.leader:
            result = self.room.from_leader("commit")
            if "error" in result:
                raise CheckpointError(f"process 0 could not commit the save to {self.location.display}: "
                                      f"{result['error']}")
            return
        try:
            self.target.commit(manifest, fsync=fsync, files=files)
        except BaseException as exc:
            self.room.set("commit", {"error": _describe(exc)})
            _abort(self.target)
            raise
        self.room.set("commit", {"ok": True})

    def end(self):
        """Everyone leaves together; the leader removes the save's keys."""
        try:
            self.room.close()
        except BarrierTimeoutError:  # the outcome is decided; only the key cleanup is skipped
            logging.warning("dispatch_io: a process did not reach the end of the save to %s", self.location.display)
