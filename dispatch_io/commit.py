"""How the processes of a job agree on a save and commit it: agree, then commit -- no callbacks.

A coordinator (:func:`for_this_job`) opens one commit object per save; the save driver calls
it in this order and never the other way round::

    commit = coordinator.open(location)
    commit.check_same_plan(plan)      # every process planned the same save (else all raise)
    commit.start(overwrite)           # the leader creates the temporary checkpoint, the others join it
    ... every process writes its chunks, reporting commit.progress(bytes) ...
    checksums = commit.agree(error, checksums)   # raises everywhere if any process failed
    leader: merge the writers' databases, build the manifest      (the driver, not the commit)
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

import hashlib
import json
import time

import jax
from absl import logging

from dispatch_io.errors import BarrierTimeoutError, CheckpointError, WorkerError
from dispatch_io.plan import Plan
from dispatch_io.storage import KvLocation, Location, WriteTarget


def for_this_job(barrier_timeout: float) -> "SingleProcess | MultiProcess":
    """The coordinator for the running JAX job (one process, or several under jax.distributed)."""
    if jax.process_count() == 1:
        return SingleProcess()
    from jax._src.distributed import global_state  # the coordination service's client

    if global_state.client is None:
        raise RuntimeError("several JAX processes but no coordination service client: "
                           "call jax.distributed.initialize() before creating a dispatcher")
    return MultiProcess(global_state.client, jax.process_index(), jax.process_count(), barrier_timeout)


def _abort(target: WriteTarget | None):
    if target is None:
        return
    try:
        target.abort()
    except Exception:  # noqa: BLE001 - the save's own error is what the caller needs
        logging.exception("dispatch_io: could not remove a partial save")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class SingleProcess:
    def open(self, location: Location) -> "SingleProcessCommit":
        return SingleProcessCommit(location)


class SingleProcessCommit:
    """The commit protocol of a single-process save: nothing to agree on."""

    leader = True

    def __init__(self, location: Location):
        self.location = location
        self.target: WriteTarget | None = None

    def check_same_plan(self, plan: Plan):
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
        """Remove the save and raise ``error``."""
        _abort(self.target)
        raise error

    def commit(self, manifest: bytes | None, fsync: bool):
        try:
            self.target.commit(manifest, fsync=fsync)
        except BaseException:
            _abort(self.target)
            raise

    def end(self):
        pass


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
        self.client = job.client
        self.location = location
        digest = hashlib.sha256(location.key.encode()).hexdigest()[:24]
        self.prefix = "dispatch_io/save/" + digest
        self.arrivals = "dispatch_io/arrived/" + digest
        self.leader = job.process == 0
        self.target: WriteTarget | None = None
        self._failed_seen = False
        if self.leader:  # keys of an earlier save of this path; nobody reads them before "begin"
            self.client.key_value_delete(self.prefix + "/")
        self._barrier("begin")

    # -- key-value helpers ---------------------------------------------------------------------

    def _set(self, key: str, value):
        self.client.key_value_set(f"{self.prefix}/{key}", json.dumps(value), allow_overwrite=True)

    def _entries(self, directory: str) -> dict[int, object]:
        found = self.client.key_value_dir_get(f"{self.prefix}/{directory}/")
        return {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in found}

    def _barrier(self, phase: str):
        """Wait until every process is here. Each process records its arrival first (outside
        the save's keys, which the leader clears on open while others may already be waiting),
        so a timeout names the processes that never came."""
        barrier = f"{self.prefix}/{phase}"
        arrivals = f"{self.arrivals}/{phase}/"
        self.client.key_value_set(f"{arrivals}{self.job.process}", "1", allow_overwrite=True)
        started = time.monotonic()
        try:
            self.client.wait_at_barrier(barrier, int(self.job.timeout * 1000))
        except Exception as exc:  # noqa: BLE001 - the service's errors have no type of their own
            timed_out = time.monotonic() - started >= self.job.timeout * 0.99
            try:
                arrived = {int(k.rsplit("/", 1)[1]) for k, _ in self.client.key_value_dir_get(arrivals)}
            except Exception:  # noqa: BLE001 - the service itself is gone
                arrived = set(range(self.job.count))
            missing = sorted(set(range(self.job.count)) - arrived)
            if not (missing or timed_out):
                raise CheckpointError(f"barrier '{phase}' of the save to {self.location.display} failed (is the "
                                      f"coordination service, on process 0, still up?): {exc}") from exc
            who = f"process(es) {missing}" if missing else "some processes"
            raise BarrierTimeoutError(f"{who} did not reach barrier '{phase}' of the save to "
                                      f"{self.location.display} within {self.job.timeout:g} s",
                                      processes=missing, barrier=barrier) from exc

    def _from_leader(self, phase: str):
        """What process 0 published for ``phase`` (waiting up to the timeout for it)."""
        try:
            return json.loads(self.client.blocking_key_value_get(f"{self.prefix}/{phase}",
                                                                 int(self.job.timeout * 1000)))
        except Exception as exc:  # noqa: BLE001 - not there in time, or the service is gone
            raise BarrierTimeoutError(f"process 0 did not {phase} the save to {self.location.display} within "
                                      f"{self.job.timeout:g} s: {exc}", processes=[0],
                                      barrier=f"{self.prefix}/{phase}") from exc

    def _gather(self, phase: str) -> dict[int, object]:
        """Wait until every process has published ``phase``; the deadline moves while any
        missing process still reports progress. Then a barrier, so all leave together."""
        deadline = time.monotonic() + self.job.timeout
        last_progress, pause = None, 0.005
        while True:
            entries = self._entries(phase)
            if len(entries) == self.job.count:
                break
            progress = self._entries("progress")
            if progress != last_progress:
                last_progress, deadline = progress, time.monotonic() + self.job.timeout
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.job.count)) - set(entries))
                doing = "finish writing their part of" if phase == "status" else f"reach '{phase}' of"
                raise BarrierTimeoutError(
                    f"process(es) {missing} did not {doing} the save to {self.location.display} "
                    f"and made no progress for {self.job.timeout:g} s",
                    processes=missing, barrier=f"{self.prefix}/{phase}")
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
        self._barrier(phase)
        return entries

    # -- the protocol ------------------------------------------------------------------------

    def check_same_plan(self, plan: Plan):
        """Every process must have planned the same save, or chunks would be written twice or
        by nobody. All processes see the same digests, so all raise (before anything is written)."""
        self._set(f"plan/{self.job.process}", plan.digest)
        digests = self._gather("plan")
        if len(set(digests.values())) == 1:
            return
        self._set(f"leaves/{self.job.process}", plan.leaf_digests)
        leaves = self._gather("leaves")
        differ = sorted(p for p, d in digests.items() if d != digests[0])
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
                self._set("start", {"error": _describe(exc), "type": type(exc).__name__})
                raise
            self._set("start", {"token": self.target.token})
            return
        started = self._from_leader("start")
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
            try:
                self.client.key_value_try_get(f"{self.prefix}/failed")
                self._failed_seen = True
            except Exception:  # noqa: BLE001 - NOT_FOUND: nobody failed
                pass
        return self._failed_seen

    def progress(self, nbytes: int):
        """This process has written ``nbytes``: the others' deadlines move while this grows."""
        self._set(f"progress/{self.job.process}", nbytes)

    def abandon(self, error: BaseException):
        """The save could not be run here: tell the others (they stop and raise), remove it."""
        try:
            self._set("failed", self.job.process)
            self._set(f"status/{self.job.process}", {"error": _describe(error), "keypath": None})
        finally:
            if self.leader:
                _abort(self.target)

    def agree(self, error: BaseException | None, checksums: dict) -> dict:
        """Publish this process's outcome and wait for everyone's. Returns every process's
        checksums merged; if any process failed, the save is removed and every process raises
        (its own error, or a WorkerError naming the process that failed)."""
        if error is not None:
            self._set("failed", self.job.process)
            self._set(f"status/{self.job.process}", {"error": _describe(error),
                                                      "keypath": getattr(error, "keypath", None)})
        else:
            self._set(f"status/{self.job.process}", {"ok": True, "checksums": checksums})
        try:
            statuses = self._gather("status")
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
        self._set("commit", {"error": _describe(error)})
        _abort(self.target)
        raise error

    def commit(self, manifest: bytes | None, fsync: bool):
        """The leader commits ``manifest``; every other process waits for the outcome."""
        if not self.leader:
            result = self._from_leader("commit")
            if "error" in result:
                raise CheckpointError(f"process 0 could not commit the save to {self.location.display}: "
                                      f"{result['error']}")
            return
        try:
            self.target.commit(manifest, fsync=fsync)
        except BaseException as exc:
            self._set("commit", {"error": _describe(exc)})
            _abort(self.target)
            raise
        self._set("commit", {"ok": True})

    def end(self):
        """Everyone leaves together; the leader removes the save's keys."""
        try:
            self._barrier("end")
            if self.leader:
                self.client.key_value_delete(self.prefix + "/")
                self.client.key_value_delete(self.arrivals + "/")
        except BarrierTimeoutError:  # the outcome is decided; only the key cleanup is skipped
            logging.warning("dispatch_io: a process did not reach the end of the save to %s", self.location.display)
