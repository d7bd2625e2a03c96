"""The local tier of a CheckpointManager: its saves, its steps, and the restore that mixes tiers.

    mgr = dio.CheckpointManager("gs://bucket/run1", save_policy=P.EveryNSteps(500),
                                local=dio.LocalTier("/dev/shm/run1/{process}", save_policy=P.EveryNSteps(50),
                                                    keep_policy=P.LatestN(2)))

Each process saves, to ``<local>/<step>/``, the regions its own devices hold -- and, with
``replicas``, the regions of peers sent to it (``replicas.py``) -- committed by itself alone
(``Dispatcher.save(own=True, copies=)``): no coordination-service round trip, no object store,
the same staging budget and asynchronous copies as any save. The step's info records the regions
it holds and its durability; ``local_steps`` reads them back. :meth:`LocalTiers.restore` mixes the
tiers (``tier_restore``); ``promotion`` persists a local step. See docs/design.md "Tiers".
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading

from absl import logging

from dispatch_io.manager.tiers import placement
from dispatch_io.manager import step_policies, retention
from dispatch_io.manager.decisions import SharedClock
from dispatch_io.multihost.coordination import open_room
from dispatch_io.manager.tiers import local_steps
from dispatch_io.manager.tiers import parity, parity_plan, replicas
from dispatch_io.manager.tiers import tier_restore
from dispatch_io.save import Attachments, SaveHandle
from dispatch_io.storage import StepRoot


@dataclasses.dataclass(frozen=True)
class LocalTier:
    """A fast local tier beside a manager's persistent root (``CheckpointManager(local=...)``).
    ``promote``: a ``save()`` that saves a step in both tiers persists it by promotion of its local
    copies (``promotion.after``: the device is copied once, for the local save).

    ``path``: a directory on each host (a RAM disk or local SSD; not a URL); ``{process}`` in it is
    replaced by the process index (needed where processes share a host: checked when a manager
    opens). ``save_policy``: when to save locally (None: never, unless ``save(..., local=True)``);
    ``keep_policy``: which local steps each process keeps (the latest always; None: all; one that
    reads the clock, ``EveryNSeconds``, sees one time per step in a multi-process job: process 0's
    clock as it saved the step, so every process keeps the same steps).
    ``replicas``: how many processes besides its holders keep a copy of each region -- so that any
    ``replicas`` lost processes lose nothing. Regions data parallelism already spreads over that
    many processes are not copied; the rest (pure FSDP state, a leaf on one process) are sent to
    peer processes at each local save (one ``jax.device_put`` per leaf onto the devices of a
    peer: the interconnect's collectives) and saved there. ``domains``: the failure domain of
    each process (``domains[process]``: its host, rack...); copies go to other domains first.
    None: each process's host name.
    ``parity``: instead of replicas, keep on each process the XOR of ``k = parity`` other
    processes' protected bytes (``parity_plan``): the regions one process alone holds survive
    one lost process per parity group at (1 + 1/k)x local storage (``replicas=1``: 2x). Needs
    ``k >= 2``, at least ``k + 1`` processes with the same number of devices each, and no
    ``replicas``; 0 or None: no parity."""

    path: str
    save_policy: step_policies.Policy | None = None
    keep_policy: step_policies.Policy | None = None
    promote: bool = False
    replicas: int = 0
    domains: tuple | None = None
    parity: int | None = 0

    def __post_init__(self):
        if not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"LocalTier path must be a directory path, got {self.path!r}")
        if "://" in os.fspath(self.path):
            raise ValueError(f"LocalTier({os.fspath(self.path)!r}): the local tier is a directory on each host (a RAM "
                             "disk or local SSD), not a URL; the manager's root is the persistent tier")
        step_policies.check(self.save_policy, "save")
        step_policies.check(self.keep_policy, "keep")
        step_policies.integer(self.replicas, "LocalTier replicas", 0, "a non-negative integer")
        if self.parity is not None and (type(self.parity) is not int or self.parity != 0):   # 0 / None: no parity
            parity_plan.check(self.parity, None, self.replicas)   # the job's size: when a manager opens
        if self.domains is not None:
            object.__setattr__(self, "domains", replicas.domains_of(self.domains))

    def process_path(self, process: int) -> str:
        return os.fspath(self.path).replace("{process}", str(process))


class LocalTiers:
    """The local tier of one manager, in one process (see the module doc)."""

    def __init__(self, tier: LocalTier, dispatcher, clock, process: int, count: int, root: StepRoot):
        self.tier, self.dispatcher, self._clock = tier, dispatcher, clock
        self.process, self.count = process, count
        self.path = tier.process_path(process)
        self.root = StepRoot.open(self.path)
        self._owner = local_steps.owner(root)  # local steps saved beside another root are never used
        newest = max(local_steps.read_steps(self.root, self._owner)[0], default=None)
        hosts, self._last_step = local_steps.check_apart(tier.process_path("{process}"), self.path, process, count,
                                                         dispatcher.options.barrier_timeout, newest)
        self.domains, self._orders = replicas.placement(tier, hosts, count)
        self._ring = parity.placement(tier.parity, self.domains, count) if tier.parity else None
        self._decisions = replicas.decisions(tier, count, dispatcher.options.barrier_timeout)
        self._times = self._shared_clock()
        self.root.remove_leftovers()
        local_steps.read_steps(self.root, self._owner, remove=True)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dispatch_io-local-tier")
        self._in_flight: concurrent.futures.Future | None = None
        self._lock = threading.Lock()
        self.promoting: set[int] = set()  # steps a promotion reads (promotion.py): local retention keeps them
        self._afresh = False               # no step was whole: the job started over (resume(None))
        self._resumed_at: int | None = None  # the step a restore resumed, until the next save
        self._last_save = clock()

    def _shared_clock(self) -> SharedClock:
        """Each local save's time: process 0's clock, shared, where a clock-reading keep policy decides
        in a job of several processes (each process commits its local step alone, at its own time: a
        policy reading those would keep different steps on different processes, and a step one of
        them dropped is whole nowhere); else this process's clock."""
        keep = self.tier.keep_policy
        if self.count == 1 or keep is None or not keep.uses_clock:
            return SharedClock(None, self._clock)
        template = self.tier.process_path("{process}")
        return SharedClock(open_room("tiers-times", template, f"the local tier {template}",
                                     self.dispatcher.options.barrier_timeout), self._clock)

    def steps(self) -> list[int]:
        """This process's committed local steps of this manager's root, ascending (steps whose info
        cannot be read are left out: lost, as a wiped step is)."""
        return sorted(self.infos()[0])

    def infos(self) -> tuple[dict[int, dict], list[str]]:
        """({step: info} of this process's committed local steps of this root, [unreadable info files])."""
        return local_steps.read_steps(self.root, self._owner)

    def whole_steps(self, persistent_steps: list[int]) -> dict[int, str]:
        """{step: durability} of the steps the job can restore whole, persistent or local
        (``local_steps.whole_steps``: every process together, the same answer everywhere)."""
        return local_steps.whole_steps(self, persistent_steps)

    def should_save(self, step: int, preempted: bool = False) -> bool:
        """Whether the local save policy saves ``step`` (never a step not newer than the last)."""
        policy = self.tier.save_policy
        if policy is None or (self._last_step is not None and step <= self._last_step):
            return False
        return self._decisions.decide(step, lambda: policy.should_save(
            step_policies.SaveState(step, self._clock(), self._last_save, self._last_step, preempted)))

    def save(self, step: int, tree, files=None, described=None, **save_kwargs) -> SaveHandle:
        """Save this process's regions of ``tree`` as local ``step`` (after the local save in
        flight), and the regions of peers it keeps replicas of (``LocalTier.replicas``), with ``files``
        (its item files, ``items.files(own_step=True)``) and ``described`` (the step info's items,
        metrics and metadata); retention of local steps follows its commit, on the tier's thread."""
        self.wait()
        moves, copies = replicas.send(tree, self._orders, self.tier.replicas, self.domains)  # every process, in step order
        rows, section = parity.encode(tree, self._ring, self.tier.parity, self.domains) if self._ring else ({}, None)
        started = self._times.time_of(step)
        agreed = {} if self._times.room is None else {"time": started}   # the step's one time, job-wide
        info = {"step": step, "tier": "local", "root": self._owner, "process": self.process, "started": started,
                **agreed, **placement.local_record(tree, self.process, self.count, moves, self.domains, section),
                **(described or {})}
        handle = self.dispatcher.save(self.root.step_path(step), tree, own=True, overwrite=True, copies=copies,
                                      attachments=Attachments(files or {}, info=info, clock=self._clock), **save_kwargs)
        self._last_step, self._last_save, self._afresh = step, info["started"], False
        with self._lock:
            self._in_flight = self._thread.submit(self._finish, handle, agreed.get("time"), step, rows)
        return handle

    def _finish(self, handle: SaveHandle, now: float | None, step: int, rows: dict):
        """On the tier's thread: wait for the save (its failure is raised by :meth:`wait`), save its
        parity ``rows`` (``parity.encode``) as the step's nested checkpoint (a failure is logged: the
        step then has no parity from this process), then delete the local steps the keep policy drops
        (logged, never raised: the save committed). ``now``: the save's job-wide time, if agreed (the
        policy then sees the same on every process)."""
        handle.wait()
        if rows:
            try:
                self.dispatcher.save(os.path.join(self.root.step_path(step), parity.PARITY), rows, own=True,
                                     overwrite=True).wait()
            except Exception:  # noqa: BLE001 - logged; the step stands, without parity from this process
                logging.exception("dispatch_io: the parity rows of local step %s were not saved",
                                  self.root.step_path(step))
        if self.tier.keep_policy is None:
            return
        try:
            infos = self.infos()[0]
            records = [local_steps.record(s, infos.get(s)) for s in self.root.committed_steps()]
            dropped = retention.steps_to_delete(records, self.tier.keep_policy, self._clock() if now is None else now)
            retention.delete_dropped(self.root, [s for s in dropped if s not in self.promoting], lambda step: None)
        except Exception:  # noqa: BLE001 - logged; the next local save tries again
            logging.exception("dispatch_io: retention of the local tier %s failed", self.path)

    def wait(self):
        """Wait for the local save in flight and its retention; raise its failure."""
        with self._lock:
            pending, self._in_flight = self._in_flight, None
        if pending is not None:
            pending.result()

    def close(self):
        try:
            self.wait()
        finally:
            self._thread.shutdown(wait=True)

    # ---- restore ------------------------------------------------------------------------------

    def restore(self, target, persistent_steps, persistent_path, persistent_display: str, **kwargs):
        """Restore ``target`` through the tiers (every process together): see
        :meth:`~dispatch_io.manager.tiers.tier_restore.TierRestore.restore`. Returns (tree, stats)."""
        return tier_restore.TierRestore(self).restore(target, persistent_steps, persistent_path, persistent_display,
                                                      **kwargs)

    def abandoned(self, step: int) -> bool:
        """Whether local ``step`` is newer than the step the job goes on from (after a rollback, or
        a fresh start): of a history the job left, never to be persisted or resumed."""
        return step > self._last_step if self._last_step is not None else self._afresh

    def resume(self, step: int | None):
        """After a restore of ``step`` (through the tiers or of a named step, onto any mesh): local
        saves go on after ``step`` -- and the first save of the resumed history (either tier)
        deletes the local steps it makes stale (``local_steps.prepare_save``); until then a restore
        deletes nothing. The same on every process, whatever each one's local directory holds (a
        per-process answer would make ``should_save`` differ: with replicas, a hang). None: no step
        was whole anywhere, the job starts afresh."""
        self._last_step, self._afresh = step, step is None
        self._resumed_at = -1 if step is None else step   # the first save then drops the local steps after it

    def drop_from(self, step: int):
        """Delete this process's local steps after ``step`` (and ``step``, unless it is the local
        step of this history) -- and, at the first save after a restore, every local step after the
        restored one: a save of ``step`` means the job follows a history where they never happened
        (a rollback), and a later restore must never resume them over it."""
        after = self._resumed_at

        def stale():
            return [s for s in self.root.committed_steps()
                    if s > step or (s == step and s != self._last_step) or (after is not None and s > after)]
        self._resumed_at = None
        if stale():
            self.wait()  # the local save in flight and its retention first (it may delete some of them)
            for s in stale():
                logging.info("dispatch_io: local step %s is deleted: the job saves step %d of another history",
                             self.root.step_path(s), step)
                self.root.delete(s)
