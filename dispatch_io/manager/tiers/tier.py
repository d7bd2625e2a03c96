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
from dispatch_io.manager import items as items_lib
from dispatch_io.manager.tiers import job_steps, local_steps
from dispatch_io.manager.tiers import parity, parity_plan, replicas
from dispatch_io.manager.tiers import tier_restore
from dispatch_io.errors import CheckpointError
from dispatch_io.save.driver import SaveHandle
from dispatch_io.save.job import Attachments
from dispatch_io.storage import StepRoot, step_files


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
        hosts, self._last_step = job_steps.check_apart(tier.process_path("{process}"), self.path, process, count,
                                                         dispatcher.options.barrier_timeout, newest)
        self.domains, self._variants = replicas.placement(tier, hosts, count)
        self._ring = parity.placement(tier.parity, self.domains, count) if tier.parity else None
        self._decisions = replicas.decisions(tier, count, dispatcher.options.barrier_timeout)
        self._times = self._shared_clock()
        self._agreement = job_steps.SaveAgreement.open(tier.process_path("{process}"), count,
                                                       dispatcher.options.barrier_timeout)
        self.whole: int | None = None      # the newest local step the job agreed whole (every process committed it)
        self.root.remove_leftovers()
        local_steps.read_steps(self.root, self._owner, remove=True)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dispatch_io-local-tier")
        self._in_flight: concurrent.futures.Future | None = None
        self._lock = threading.Lock()
        self.promoting: set[int] = set()  # steps a promotion reads (promotion.py): local retention keeps them
        self._afresh = False               # no step was whole: the job started over (resume(None))
        self._resumed_at: int | None = None  # the step a restore resumed, until the next save
        self._shared_items: dict[int, dict] = {}   # the last restore's: Json items of a step this process lacks
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
        (``job_steps.whole_steps``: every process together, the same answer everywhere)."""
        return job_steps.whole_steps(self.root, self.infos()[0], self.process, self.count,
                                     self.tier.process_path("{process}"), self.dispatcher.options.barrier_timeout,
                                     persistent_steps)

    def durability(self, step: int) -> str | None:
        """What this process's local copy of ``step`` says of its durability (``local_steps.durability``:
        ``"replicated k"``, ``"parity k"``, ``"local"``); None if it has no copy."""
        info = self.infos()[0].get(step)
        return None if info is None else local_steps.durability(self.root, step, info)

    def read_item(self, step: int, name: str, persistent: str):
        """Item ``name`` of ``step`` from this process's local copy (a step the persistent root
        ``persistent`` does not hold); raises as ``local_steps.read_item``."""
        return local_steps.read_item(self.root, step, self.infos()[0].get(step), name, self.process, self.count,
                                     persistent, self._shared_items.get(step))

    def verify_items(self, step: int, persistent: str) -> int:
        """Read and check (against their CRC-32Cs, where saved with them) the item files of this
        process's copy of local ``step``; how many (0: no copy here). The one check every verify of
        the step's directory makes (``storage.step_files.verify_items``); raises as it does."""
        if step not in self.infos()[0]:
            return 0
        return step_files.verify_items(self.root.step_path(step), step)

    def should_save(self, step: int, preempted: bool = False) -> bool:
        """Whether the local save policy saves ``step`` (never a step not newer than the last)."""
        policy = self.tier.save_policy
        if policy is None or (self._last_step is not None and step <= self._last_step):
            return False
        return self._decisions.decide(step, lambda: policy.should_save(
            step_policies.SaveState(step, self._clock(), self._last_save, self._last_step, preempted)))

    def save_with(self, step: int, tree, forced: bool | None, persist: bool, items, info: dict, save_kwargs: dict,
                  root_latest=None) -> SaveHandle | None:
        """The local tier's part of a manager's ``save()`` of ``step``: its handle, or None if the
        tier does not save it. ``forced``: the ``save(local=)`` argument (None: the save policy
        decides); ``persist``: whether the root saves it too. If either tier saves, the local steps
        from ``step`` on are deleted first (:meth:`drop_from`). Saves this process's regions of
        ``tree``, its item files (its own PerProcess values and every Json item:
        ``items.files(own_step=True)``), and the step info's items, metrics and metadata (``info``,
        as ``info.make`` gives it). ValueError for a local save alone of a step the root holds one
        as new as (``root_latest``: (the newest step the manager saw persisted, a call listing the
        root's newest)): the root's would be of the history before a rollback, and a restore could
        mix them."""
        save_kwargs = self.incremental_kwargs(save_kwargs, persist)   # refused before anything is deleted
        saves = self.should_save(step) if forced is None else forced
        if saves and not persist and root_latest and root_latest[0] is not None and step <= root_latest[0]:
            newest = root_latest[1]()   # listed only then: the manager's view may be stale
            if newest is not None and step <= newest:
                raise ValueError(f"cannot save step {step} in the local tier alone: the root holds step {newest}, of "
                                 f"the history before a rollback, which a restore could mix with it; remove the "
                                 f"root's steps from {step} on first, or save the step to both tiers")
        if saves or persist:
            self.drop_from(step)
        if not saves:
            return None
        checksums = any(entry.get("crc32c") for entry in info["items"].values())  # as the root's step says
        return self.save(step, tree, items_lib.files(items, self.process, own_step=True, checksums=checksums)[0],
                         {k: info[k] for k in ("items", "metrics", "metadata")}, **save_kwargs)

    def incremental_kwargs(self, save_kwargs: dict, persist: bool) -> dict:
        """``save_kwargs`` for a local save: ``incremental`` (the manager's, or the save's own) as it
        asks -- each process's local step references its own newest local step (its base), for its
        own regions and the peers' regions it keeps (``replicas``) alike; parity rows (a step's nested
        ``parity`` checkpoint) are always saved whole -- and ``"whole"`` for a step promotion will copy
        byte for byte (``persist`` with ``LocalTier(promote=True)``: it must hold every chunk itself,
        its digests recorded for the steps after it). See docs/design.md "Incremental local steps"."""
        if not save_kwargs.get("incremental"):
            return save_kwargs
        return {**save_kwargs, "incremental": "whole" if persist and self.tier.promote else True}

    def save(self, step: int, tree, files=None, described=None, **save_kwargs) -> SaveHandle:
        """Save this process's regions of ``tree`` as local ``step`` (after the local save in
        flight), and the regions of peers it keeps replicas of (``LocalTier.replicas``), with ``files``
        (its item files, ``items.files(own_step=True)``) and ``described`` (the step info's items,
        metrics and metadata). On the tier's thread, once it committed (with its parity rows), the job
        agrees whether every process did (:meth:`_finish`); only then does the step count as whole
        and retention run. A failure here is reported to the others first; one of the save itself
        (a CheckpointError) is raised as the agreement's (``job_steps.SaveAgreement.agree``)."""
        self.wait()
        # The policies' view moves on here, on every process alike -- before anything that may fail on
        # one alone: should_save then answers the same everywhere after a failed attempt too.
        self._last_step, self._afresh = step, False
        if self.tier.replicas or self._ring:   # the job is all here before its collectives (not after a death)
            self._agreement.begin(step, self.process)
        try:
            started = self._last_save = self._times.time_of(step)
            moves, copies = replicas.send(tree, self._variants, self.tier.replicas, self.domains)  # every process, in step order
            rows, section = parity.encode(tree, self._ring, self.tier.parity, self.domains) if self._ring else ({}, None)
            agreed = {} if self._times.room is None else {"time": started}   # the step's one time, job-wide
            record = placement.local_record(tree, self.process, self.count, moves, self.domains, section)
            reached = None
            if self.count > 1:   # its copies and durability once the job agrees it is whole (_finish), not before
                reached = {"copies": record["copies"], "domains": record["domains"], "durability": record["durability"],
                           "agreed": True}
                record.update(copies=1, domains=1, durability="local", agreed=False)
            info = {"step": step, "tier": "local", "root": self._owner, "process": self.process, "started": started,
                    **agreed, **record, **(described or {})}
            handle = self.dispatcher.save(self.root.step_path(step), tree, own=True, overwrite=True, copies=copies,
                                          attachments=Attachments(files or {}, info=info, clock=self._clock),
                                          **save_kwargs)
        except CheckpointError as exc:   # the save itself failed (e.g. an exchange with a dead peer): as in _finish
            self._agreement.agree(step, self.process, exc)   # raises, naming the processes missing or failed
            raise
        except Exception as exc:   # the caller's (a bad tree or keyword): the others fail at once, naming this process
            self._agreement.report(step, self.process, exc)
            self._agreement.failed(step)
            raise
        with self._lock:
            self._in_flight = self._thread.submit(self._finish, handle, agreed.get("time"), step, rows, reached)
        return handle

    def _finish(self, handle: SaveHandle, now: float | None, step: int, rows: dict, reached: dict | None):
        """On the tier's thread: wait for the save and save its parity ``rows`` (``parity.encode``) as
        the step's nested checkpoint; then agree with the other processes whether every one committed
        the step (``job_steps.SaveAgreement``: a failure anywhere, or a process that does not report
        within the barrier timeout, is raised here -- by :meth:`wait` -- naming the processes, and the
        step is not whole). Once whole: its info says so (``reached``: its ``"agreed"``, and the
        ``"copies"`` and ``"durability"`` -- ``"replicated k"``, ``"parity k"`` -- every process's
        commit gave it; until then ``"local"``, one copy, not agreed: a restore and the job's listing
        pass it over), and the local steps the keep policy drops are deleted -- never the
        step just agreed whole (logged, never raised: the save committed), and the parity rows of the
        steps it retired (``parity.drop_retired_rows``). ``now``: the save's
        job-wide time, if agreed (the policy then sees the same on every process)."""
        error = None
        try:
            handle.wait()
            if rows:
                self.dispatcher.save(os.path.join(self.root.step_path(step), parity.PARITY), rows, own=True,
                                     overwrite=True).wait()
        except Exception as exc:  # noqa: BLE001 - reported to the job, then raised (SaveAgreement.agree)
            error = exc
        self._agreement.agree(step, self.process, error)
        self.whole = step
        if reached:
            try:
                local_steps.update_info(self.root, step, reached)
            except (OSError, ValueError) as exc:   # the info then understates it (not agreed): logged, not failed
                logging.warning("dispatch_io: the info of local step %s still says it is not agreed whole: %s",
                                self.root.step_path(step), exc)
        if self.tier.keep_policy is None:
            return
        try:
            infos = self.infos()[0]
            records = [local_steps.record(s, infos.get(s)) for s in self.root.committed_steps()]
            dropped = retention.steps_to_delete(records, self.tier.keep_policy, self._clock() if now is None else now)
            retention.delete_dropped(self.root, [s for s in dropped if s not in self.promoting and s != self.whole],
                                     lambda step: None)
            if self._ring:   # a retired step's rows are never read again (incremental saves)
                parity.drop_retired_rows(self.root)
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
        :meth:`~dispatch_io.manager.tiers.tier_restore.TierRestore.restore`. Returns (tree, stats).
        Then local saves go on after the step restored, on every process (:meth:`resume`); if no
        step was whole and none was named, from scratch."""
        restore = tier_restore.TierRestore(self.dispatcher, self.root, self.path, self.tier.process_path("{process}"),
                                           self.process, self.count)
        try:
            tree, stats = restore.restore(target, self.infos(), persistent_steps, persistent_path, persistent_display,
                                          **kwargs)
        except tier_restore.NoWholeStep:
            if kwargs.get("step") is None:  # the job starts afresh: local saves from step 0 on, on every process alike
                self.resume(None)
            raise
        self.resume(stats.step)
        self._shared_items = {stats.step: restore.shared_items[stats.step]} if stats.step in restore.shared_items else {}
        return tree, stats

    def abandoned(self, step: int) -> bool:
        """Whether local ``step`` is newer than the step the job goes on from (after a rollback, or
        a fresh start): of a history the job left, never to be persisted or resumed."""
        return step > self._last_step if self._last_step is not None else self._afresh

    def resume(self, step: int | None):
        """After a restore of ``step`` (through the tiers or of a named step, onto any mesh): local
        saves go on after ``step`` -- and the first save of the resumed history (either tier)
        deletes the local steps it makes stale (:meth:`save_with`); until then a restore
        deletes nothing. The same on every process, whatever each one's local directory holds (a
        per-process answer would make ``should_save`` differ: with replicas, a hang). None: no step
        was whole for the restore's target, the job starts afresh: its saves replace the steps they
        reach, and older local steps stay (the target may have been the caller's mistake: disk is
        cheaper than a lost run)."""
        self._last_step, self._afresh = step, step is None
        self._resumed_at = step   # the first save then drops the local steps after it

    def restoring(self):
        """A restore begins (every process together, through the tiers or from the root): local
        saves after it are of a new history, whose agreements (``SaveAgreement``) are asked afresh
        -- a step saved again after a rollback is not answered by its first save's. First thing,
        before anything that may fail: every process then counts the same histories, whatever the
        restore raises on which of them -- and after the local save in flight agreed (its keys are of
        the history it was saved in; its failure is still raised by :meth:`wait`)."""
        with self._lock:
            pending = self._in_flight
        if pending is not None:
            concurrent.futures.wait([pending])
        self._agreement.afresh()
        self._shared_items = {}

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
