"""How the processes of a job agree on a save: who creates it, who commits, who failed.

With one controller (one JAX process, or Pathways) there is nothing to agree on:
:class:`SingleProcess` commits when the local writes succeeded. Under ``jax.distributed``
every process runs the same program, plans the same save (plans are deterministic) and
writes only its own chunks; :class:`MultiProcess` then coordinates through the
coordination service that ``jax.distributed.initialize`` started -- its key-value store and
``wait_at_barrier`` -- and never through a device collective (those hang, or do not exist,
on multi-process CPU)::

    leader (process 0)                         every other process
    clear old keys ─┐
                    ├─ barrier "begin" ─────────┤
    publish plan digest ─ gather "plan" ────────┴─ publish plan digest   (differ: everyone raises)
    start_write; publish token / error  ──────▶ join the temporary directory (or raise it)
    ... every process writes its chunks, publishing progress after each batch ...
    publish status ─┴─ gather "status" ─────────┴─ publish status     (errors: everyone raises)
    commit; publish result ───────────────────▶ read result
                    └─ barrier "end" ───────────┘

Keys and barrier ids derive from the checkpoint path and the phase only (never from
process-local counters, which diverge). A wait fails with :class:`BarrierTimeoutError`, naming
the processes that never arrived, once the others have made no progress for
``barrier_timeout`` seconds -- so a long save of a big checkpoint never times out, a hung one does.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import Callable

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


class SingleProcess:
    """One controller: start, write, commit; nothing to agree on."""

    def start_write(self, location: Location, overwrite: bool, plan: Plan) -> "LocalSave":
        return LocalSave(location.start_write(overwrite))


class LocalSave:
    """The commit protocol of a single-process save."""

    def __init__(self, target: WriteTarget):
        self.target = target

    def peer_failed(self) -> bool:
        return False

    def abandon(self, error: BaseException):
        _abort(self.target)

    def progress(self, nbytes: int):
        pass

    def finish(self, error: BaseException | None, checksums: dict, manifest: Callable[[dict], bytes], fsync: bool):
        """Commit (``error`` None) or remove the partial save and raise ``error``. ``checksums``
        (chunk index -> CRC-32C) are this process's; ``manifest(all checksums)`` builds the manifest."""
        if error is not None:
            _abort(self.target)
            raise error
        try:
            self.target.commit(manifest(checksums), fsync=fsync)
        except BaseException:
            _abort(self.target)
            raise


def _abort(target: WriteTarget):
    try:
        target.abort()
    except Exception:  # noqa: BLE001 - the save's own error is what the caller needs
        logging.exception("dispatch_io: could not remove a partial save")


class MultiProcess:
    """Coordinates the saves of a ``jax.distributed`` job (see the module doc)."""

    def __init__(self, client, process: int, count: int, timeout: float):
        self.client, self.process, self.count, self.timeout = client, process, count, timeout

    def start_write(self, location: Location, overwrite: bool, plan: Plan) -> "DistributedSave":
        if isinstance(location, KvLocation) and location.url.startswith("memory://"):
            raise ValueError(f"{location.display}: memory:// lives inside one process; a multi-process "
                             "save needs storage every process sees (a directory or an object store)")
        save = DistributedSave(self, location)
        return save.start(overwrite, plan)


class DistributedSave:
    """One save of a multi-process job: the keys under ``dispatch_io/<hash of path>/``."""

    def __init__(self, coordinator: MultiProcess, location: Location):
        self.c = coordinator
        self.client = coordinator.client
        self.location = location
        self.prefix = "dispatch_io/save/" + hashlib.sha256(location.key.encode()).hexdigest()[:24]
        self.leader = coordinator.process == 0
        self.target: WriteTarget | None = None
        self._failed_seen = False

    # -- key-value helpers ---------------------------------------------------------------------

    def _set(self, key: str, value):
        self.client.key_value_set(f"{self.prefix}/{key}", json.dumps(value), allow_overwrite=True)

    def _entries(self, directory: str) -> dict[int, object]:
        found = self.client.key_value_dir_get(f"{self.prefix}/{directory}/")
        return {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in found}

    def _barrier(self, phase: str):
        """``wait_at_barrier`` with the timeout; a timeout names the processes that did not arrive."""
        barrier = f"{self.prefix}/{phase}"
        try:
            self.client.wait_at_barrier(barrier, int(self.c.timeout * 1000))
        except Exception as exc:  # noqa: BLE001 - JaxRuntimeError carries the service's status
            if "DEADLINE_EXCEEDED" not in str(exc):
                raise CheckpointError(f"barrier '{phase}' of the save to {self.location.display} failed (is the "
                                      f"coordination service, on process 0, still up?): {exc}") from exc
            missing = _missing_tasks(str(exc))
            who = f"process(es) {missing}" if missing else "some processes"
            raise BarrierTimeoutError(
                f"{who} did not reach barrier '{phase}' of the save to {self.location.display} within "
                f"{self.c.timeout:g} s: {str(exc).splitlines()[0]}", processes=missing, barrier=barrier) from exc

    def _from_leader(self, phase: str):
        """What process 0 published for ``phase`` (waiting up to the timeout for it)."""
        try:
            return json.loads(self.client.blocking_key_value_get(f"{self.prefix}/{phase}",
                                                                 int(self.c.timeout * 1000)))
        except Exception as exc:  # noqa: BLE001 - DEADLINE_EXCEEDED, or the service is gone
            raise BarrierTimeoutError(f"process 0 did not {phase} the save to {self.location.display} within "
                                      f"{self.c.timeout:g} s: {exc}", processes=[0],
                                      barrier=f"{self.prefix}/{phase}") from exc

    def _gather(self, phase: str) -> dict[int, object]:
        """Wait until every process has published ``phase``; the deadline moves while any
        missing process still reports progress. Then a barrier, so all leave together."""
        deadline = time.monotonic() + self.c.timeout
        last_progress, pause = None, 0.005
        while True:
            entries = self._entries(phase)
            if len(entries) == self.c.count:
                break
            progress = self._entries("progress")
            if progress != last_progress:
                last_progress, deadline = progress, time.monotonic() + self.c.timeout
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.c.count)) - set(entries))
                doing = "finish writing their part of" if phase == "status" else f"reach '{phase}' of"
                raise BarrierTimeoutError(
                    f"process(es) {missing} did not {doing} the save to {self.location.display} "
                    f"and made no progress for {self.c.timeout:g} s",
                    processes=missing, barrier=f"{self.prefix}/{phase}")
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
        self._barrier(phase)
        return entries

    # -- the protocol ------------------------------------------------------------------------

    def start(self, overwrite: bool, plan: Plan) -> "DistributedSave":
        if self.leader:  # keys of an earlier save of this path; nobody reads them before "begin"
            self.client.key_value_delete(self.prefix + "/")
        self._barrier("begin")
        self._check_same_plan(plan)
        if self.leader:
            try:
                self.target = self.location.start_write(overwrite)
            except Exception as exc:
                self._set("start", {"error": _describe(exc), "type": type(exc).__name__})
                raise
            self._set("start", {"token": self.target.token})
            return self
        started = self._from_leader("start")
        if "error" in started:
            kind = FileExistsError if started["type"] == "FileExistsError" else CheckpointError
            raise kind(f"process 0 could not start the save to {self.location.display}: {started['error']}")
        try:
            self.target = self.location.join_write(started["token"])
        except Exception as exc:  # the others are writing already: fail the save everywhere
            self.finish(exc, {}, None, False)
        return self

    def abandon(self, error: BaseException):
        """The save could not be run here: tell the others (they stop and raise), remove it."""
        try:
            self._set("failed", self.c.process)
            self._set(f"status/{self.c.process}", {"error": _describe(error), "keypath": None})
        finally:
            if self.leader:
                _abort(self.target)

    def _check_same_plan(self, plan: Plan):
        """Every process must have planned the same save, or chunks would be written twice or
        by nobody. All processes see the same digests, so all raise (before anything is written)."""
        self._set(f"plan/{self.c.process}", plan.digest)
        digests = self._gather("plan")
        if len(set(digests.values())) == 1:
            return
        self._set(f"leaves/{self.c.process}", plan.leaf_digests)
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
        self._set(f"progress/{self.c.process}", nbytes)

    def finish(self, error: BaseException | None, checksums: dict, manifest: Callable[[dict], bytes], fsync: bool):
        if error is not None:
            self._set("failed", self.c.process)
            self._set(f"status/{self.c.process}", {"error": _describe(error),
                                                   "keypath": getattr(error, "keypath", None)})
        else:
            self._set(f"status/{self.c.process}", {"ok": True, "checksums": checksums})
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
        try:
            if self.leader:
                merged = {int(i): crc for s in statuses.values() for i, crc in s["checksums"].items()}
                self._commit(lambda: manifest(merged), fsync)
            else:
                self._await_commit()
        finally:
            try:
                self._barrier("end")
                if self.leader:
                    self.client.key_value_delete(self.prefix + "/")
            except BarrierTimeoutError:  # the outcome is decided; only the key cleanup is skipped
                logging.warning("dispatch_io: a process did not reach the end of the save to %s",
                                self.location.display)

    def _commit(self, manifest, fsync):
        try:
            self.target.commit(manifest(), fsync=fsync)
        except BaseException as exc:
            self._set("commit", {"error": _describe(exc)})
            _abort(self.target)
            raise
        self._set("commit", {"ok": True})

    def _await_commit(self):
        result = self._from_leader("commit")
        if "error" in result:
            raise CheckpointError(f"process 0 could not commit the save to {self.location.display}: "
                                  f"{result['error']}")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _missing_tasks(message: str) -> list[int]:
    """Process indices listed by the coordination service after 'timed out task names:'."""
    _, _, tail = message.partition("timed out task names:")
    found = []
    for line in tail.strip().splitlines():
        match = re.fullmatch(r"\s*(?:.*task:)?(\d+)\s*", line)
        if not match:
            break
        found.append(int(match.group(1)))
    return found
