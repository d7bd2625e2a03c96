"""What the job agrees about the local tier's steps: one gather per question, in a named room.

Each process's local steps are its own (``local_steps``); these answers are the job's, the same on
every process: whether two processes would share a directory and where the job goes on from
(:func:`check_apart`), which local steps the job can restore whole (:func:`whole_steps`), whether
every process committed a local save (:class:`SaveAgreement`), and a step's manifest for the
processes without a copy (:func:`share_manifest`). Every function takes
plain values (the tier's path template, this process's infos, the barrier timeout) and calls
nothing of the tier; every process of the job calls it together.
"""

from __future__ import annotations

import os
import socket

from dispatch_io.errors import BarrierTimeoutError, CheckpointError
from dispatch_io.manager.tiers import local_steps, parity_plan, placement
from dispatch_io.multihost.coordination import open_room
from dispatch_io.storage import StepRoot


def share(room, key: str, what: str, having: list[int], process: int, read):
    """``what`` (JSON, ``read()`` gives it in a process with a copy of the local step) for a process
    without a copy of it, shared by the first of ``having`` (the processes with a copy, ascending)
    through ``room`` under ``key``; None in the processes with a copy of their own, and where none
    has one. BarrierTimeoutError naming the sharer if it does not share it within the room's timeout."""
    if process in having:
        if process == having[0]:
            room.set(key, read())
        return None
    if not having:
        return None
    doc = room.wait_for(key, room.timeout)
    if doc is None:
        raise BarrierTimeoutError(f"process {having[0]} did not share {what} within {room.timeout:g} s",
                                  processes=[having[0]], barrier=f"{room.prefix}/{key}")
    return doc


def share_manifest(room, step: int, having: list[int], process: int, read) -> dict | None:
    """The manifest of local ``step`` (JSON) for a process without a copy of it -- every copy's
    manifest describes the same stored arrays, so it plans its part with a peer's (:func:`share`)."""
    return share(room, f"manifest/{step}", f"the manifest of local step {step}", having, process, read)


def reports(root: StepRoot, infos: dict[int, dict]) -> dict[int, dict]:
    """{step: what this process tells the job of its local copy}: its held regions, leaf shapes,
    copies, whether its info says the job agreed it (``local_steps.agreed``) and parity
    (``local_steps.parity_report``) -- ``placement.whole_steps``'s report."""
    return {step: {"held": info["held"], "shapes": info.get("shapes"), "copies": info.get("copies"),
                   "agreed": local_steps.agreed(info), **local_steps.parity_report(root, step, info)}
            for step, info in infos.items()}


def whole_steps(root: StepRoot, infos: dict[int, dict], process: int, count: int, template: str, timeout: float,
                persistent_steps: list[int]) -> dict[int, str]:
    """{step: durability} of the steps the job can restore whole (``placement.whole_steps``):
    ``persistent_steps`` and the local steps the job agreed whole (``local_steps.agreed_steps``)
    whose every region some process's local copy holds (``infos``: this process's, under ``root``;
    parity rebuilds what it can). In a job of ``count``
    processes, one gather in the room of the tier ``template`` of what each holds, with process 0's
    listing of the root, so every process gets the same list. BarrierTimeoutError naming a process
    that does not come within ``timeout``."""
    mine = reports(root, infos)
    if count == 1:
        return placement.whole_steps({process: {s: r for s, r in mine.items() if r["agreed"]}}, persistent_steps)
    room = open_room("tiers-steps", template, f"the listing of the steps of the local tier {template}", timeout)
    if room.leader:
        room.set("persistent", list(persistent_steps))
    room.set(f"held/{process}", {str(step): report for step, report in mine.items()})
    gathered = room.gather("held")
    persistent = room.from_leader("persistent")
    room.close()
    agreed = local_steps.agreed_steps({p: {s: r.get("agreed") is True for s, r in held.items()}
                                       for p, held in gathered.items()})
    by_process = {p: {int(s): r for s, r in held.items() if s in agreed} for p, held in gathered.items()}
    for step, lost in parity_plan.rebuilt_steps(by_process, count).items():   # parity rebuilds them
        present = next(held[step] for held in by_process.values() if step in held)
        for p, regions in lost.items():
            by_process.setdefault(p, {})[step] = {**present, "held": {k: [[list(b) for b in r] for r in sorted(v)]
                                                                      for k, v in regions.items()}}
    return placement.whole_steps(by_process, persistent)


def check_apart(template: str, path: str, process: int, count: int, timeout: float,
                newest: int | None) -> tuple[list[str], int | None]:
    """(each process's host name by process index, the newest of the processes' ``newest`` local
    steps), gathered in one named room: the last local step every process starts from (a process
    whose local directory was lost takes the others', so the local policy answers alike
    everywhere). ValueError (in every process) if two processes of the job would save into the
    same local directory (one host, a path without ``{process}``): they would replace each
    other's steps."""
    if count < 2:
        return [socket.gethostname()], newest
    room = open_room("tiers-paths", template, f"the local tier {template}", timeout)
    room.set(f"path/{process}", [socket.gethostname(), os.path.realpath(path), newest])
    places = room.gather("path")
    room.close()
    seen: dict[tuple, int] = {}
    for p in sorted(places):
        where = tuple(places[p][:2])
        if where in seen:
            raise ValueError(f"LocalTier({template!r}): processes {seen[where]} and {p} would both save into "
                             f"{where[1]} on host {where[0]}; put {{process}} in the path (it becomes the "
                             "process index)")
        seen[where] = p
    steps = [places[p][2] for p in range(count) if isinstance(places[p][2], int)]
    return [places[p][0] for p in range(count)], max(steps, default=None)


_GO = "go"   # SaveAgreement's decision that every process came (or reported)


class LocalSaveError(CheckpointError):
    """A local save did not commit on every process of the job: ``processes`` lists those whose save
    (their share, parity rows or replicas) failed. The step is not whole job-wide."""

    def __init__(self, message, *, processes=()):
        self.processes = sorted(processes)
        super().__init__(message)


class SaveAgreement:
    """Whether every process of the job committed a local step, agreed through the coordination
    service: a process's commit alone says nothing of the job's (a step is whole only if every
    process's share -- with its parity rows or replicas -- is there). One room for the tier's
    lifetime (every process opens it together, :meth:`open`); each local save is one gather of one
    report per process, in step order (every process takes the same local saves), and its outcome
    one decision (``Room.decide``: the first wins), so a process that comes or reports late, after
    the others gave up, fails too rather than going on alone. Its keys are the step's within the
    current round (:meth:`afresh`, at every restore: a step saved again after a rollback never meets
    its earlier save's answers) and, for a step saved again after its save failed, the attempt (the
    failed attempts this process took part in: a process that failed before it came counts one
    fewer, so its retry of that step times out -- every later step's keys are alike again)."""

    def __init__(self, room):
        self.room = room
        self._round = 0                      # the restores so far: every process counts them alike
        self._failed: dict[int, int] = {}    # step -> its failed attempts this process took part in, this round
        self._agreed: str | None = None      # the last save agreed: its keys go once the next is

    @classmethod
    def open(cls, template: str, count: int, timeout: float) -> "SaveAgreement":
        """The agreement of the local tier ``template`` in a job of ``count`` processes (alone: no room)."""
        if count == 1:
            return cls(None)
        return cls(open_room("tiers-whole", template, f"the local saves of the local tier {template}", timeout))

    def afresh(self):
        """A new round of keys, at each restore (every process alike: it is collective): a step saved
        again after a rollback never meets the answers of its earlier save, agreed or given up."""
        self._round, self._failed = self._round + 1, {}

    def _key(self, step: int) -> str:
        attempt = self._failed.get(step, 0)
        return f"{self._round}.{step}" + (f".{attempt}" if attempt else "")

    def failed(self, step: int):
        """This process's attempt at local ``step`` failed (raised here, or the job gave it up): a
        retry of the step is asked afresh, never answered by this attempt's reports (stale reports
        would make processes decide differently)."""
        self._failed[step] = self._failed.get(step, 0) + 1

    def _decided(self, phase: str, step: int, doing: str) -> dict:
        """Gather ``phase`` of the current history's ``step`` (each process published its entry) and
        decide once whether it is complete: {process: entry} if it is (decided by a process that saw
        every entry, or that saw the decision after its own wait timed out); else
        BarrierTimeoutError, in every process, naming the processes missing when the first wait
        timed out."""
        key = f"{phase}/{self._key(step)}"
        try:
            entries = self.room.gather(key, doing=doing, together=False)
        except BarrierTimeoutError as exc:
            decided = self.room.decide(f"decided/{key}", {"missing": exc.processes})
            if decided != _GO:
                raise
            entries = self.room.entries(key)   # all there: the process that decided saw them
        else:
            decided = self.room.decide(f"decided/{key}", _GO)
        if decided != _GO:
            missing = decided["missing"]
            raise BarrierTimeoutError(f"process(es) {missing} did not {doing} within {self.room.timeout:g} s: the "
                                      f"job gave local step {step} up", processes=missing,
                                      barrier=f"{self.room.prefix}/{key}")
        return entries

    def begin(self, step: int, process: int):
        """Wait until every process has come to its local save of ``step``: before the save's
        collectives (a replica exchange, parity's), which with a dead peer may fail or hang in the
        runtime (not ours to bound). A process that comes after the others gave the step up does
        not enter the collectives alone (a hang) but fails too. BarrierTimeoutError naming the
        processes that did not come within the barrier timeout, in every process."""
        if self.room is not None:
            self.room.set(f"begun/{self._key(step)}/{process}", True)
            try:
                self._decided("begun", step, f"come to their local save of step {step} for")
            except BarrierTimeoutError:
                self.failed(step)
                raise

    def report(self, step: int, process: int, error: BaseException | None):
        """Publish whether this process committed local ``step`` (``error``: why not), without waiting."""
        if self.room is not None:
            self.room.set(f"saved/{self._key(step)}/{process}",
                          None if error is None else f"{type(error).__name__}: {error}")

    def agree(self, step: int, process: int, error: BaseException | None):
        """Report (:meth:`report`) and wait for every process's report of ``step``; returns once every
        process committed it (the step is whole job-wide). Otherwise every process that tries the
        save fails, and none counts it whole: BarrierTimeoutError naming the processes that did not
        report within the barrier timeout (dead, or stuck: one that reports after the others gave
        up fails too); :class:`LocalSaveError` naming those whose save failed. This process's own
        failure (``error``) is the cause of either; alone in the job, it is raised as it is."""
        self.report(step, process, error)
        if self.room is None:
            if error is not None:
                raise error
            return
        try:
            reports = self._decided("saved", step, f"report their local save of step {step} to")
        except BarrierTimeoutError as exc:
            self.failed(step)
            raise exc from error
        failed = {p: why for p, why in sorted(reports.items()) if why is not None}
        if failed:
            self.failed(step)
            raise LocalSaveError(f"local step {step} is not whole in the job: its save failed on process(es) "
                                 f"{sorted(failed)} ({'; '.join(f'{p}: {why}' for p, why in failed.items())})",
                                 processes=list(failed)) from error
        if self.room.leader and self._agreed is not None:   # every process reported this one, so read the last
            for phase in (f"saved/{self._agreed}", f"begun/{self._agreed}"):   # one's keys
                for key in (f"{phase}/", f"arrived/{phase}", f"complete/{phase}", f"decided/{phase}"):
                    self.room.client.key_value_delete(f"{self.room.prefix}/{key}")
        self._agreed = self._key(step)
