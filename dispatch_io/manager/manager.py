"""CheckpointManager: numbered steps under one root, for a training loop.

    with dio.CheckpointManager("ckpts/run1",
                               save_policy=P.EveryNSteps(1000) | P.EveryNSeconds(900) | P.Preemption(),
                               keep_policy=P.LatestN(2) | P.BestN(3, metric="eval_loss")) as mgr:
        ...
        if mgr.should_save(step):                      # the same answer on every process
            mgr.save(step, state, items={"data": dio.PerProcess(it.get_state())}, metrics=m)
        if mgr.reached_preemption(step):
            mgr.wait(); break

Layout: ``<root>/<step>/`` is an ordinary dispatch_io checkpoint (so ``dio.metadata`` and ``dispatcher.restore``
read it directly, and a copy of it elsewhere restores as well), plus what the manager attaches to its save: the
step's ``info.json`` (``info.py``) and its items' files (``items.py``), committed with the state or not at all.
The root is a directory or an object-store prefix (``s3://bucket/run1``, ``gs://...``; see dispatch_io.storage).

What the manager guarantees, built only on the dispatcher's atomic commit:

* A step is listed (``persistent_steps``, ``all_steps``, ``latest_step``) only once committed, with all its items (the
  listing and restore side: ``reads.py``, which also lists the local tier's whole steps); a save
  that failed or was killed never is, and its leftovers are removed when a manager opens the root, where markers
  prove them ours and dead.
* Saves never interleave: ``save()`` first waits for the save in flight. A failed save raises from its own handle
  and, once, from the next ``save()`` / ``wait()``.
* ``step_policies`` decide when to save and what to keep (one answer on every process: ``decisions``); ``preemption``
  says where a preempted job stops; ``retention`` deletes what the keep policy drops, off the save path, never a
  step it did not write. Steps Orbax wrote are listed and restored beside ours (``orbax_items``). A local tier
  (``tiers``) saves, restores and promotes (``promotion``) beside the root. See docs/manager.md.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import threading
import time

import jax
from absl import logging

from dispatch_io.multihost.coordination import open_room
from dispatch_io.dispatcher import Dispatcher, LocalDispatcher
from dispatch_io.manager import info as info_lib
from dispatch_io.manager import items as items_lib
from dispatch_io.manager import step_policies, retention, root_steps
from dispatch_io.manager.reads import StepReads, step_number
from dispatch_io.manager.tiers import promotion
from dispatch_io.manager.tiers import tier as tiers
from dispatch_io.manager.decisions import SharedDecisions
from dispatch_io.manager.preemption import PreemptionWatcher
from dispatch_io.save.driver import SaveHandle
from dispatch_io.save.job import Attachments
from dispatch_io.storage import StepRoot


class CheckpointManager(StepReads):
    """Numbered steps under ``root`` (a directory or kvstore URL), saved through ``dispatcher`` (a
    :class:`LocalDispatcher` with default options if None; the manager then owns and closes it).

    ``save_policy``: when :meth:`should_save` (and :meth:`save` without ``force``) says yes; None: always (you
    decide). ``keep_policy``: which committed steps retention keeps (the latest always); None: all. ``max_to_keep``
    / ``keep_every_n_steps``: shorthands for ``LatestN(max_to_keep) | EveryNSteps(keep_every_n_steps)``.
    ``barrier_timeout``: seconds a process of a multi-process job waits for the others, for the dispatcher the
    manager creates; with a ``dispatcher`` of your own, set it in its options instead (passing both is a
    ``ValueError``). ``clock``: UNIX seconds, for the policies (tests pass their own). ``local``: a fast local tier
    (:class:`~dispatch_io.manager.tiers.tier.LocalTier`; design.md "Tiers"). ``incremental``: persistent saves
    store chunks unchanged since the newest step by reference (``save(..., incremental=...)`` per save;
    design.md "Incremental saves"), and local saves since each process's newest local step (with
    ``replicas`` the peers' regions it keeps too; with ``parity`` the rows are saved whole). Raises
    ``TypeError`` for a policy used in the wrong role (``LatestN`` cannot decide saves), ``ValueError`` for bad
    numbers or a keep policy given twice."""

    def __init__(self, root, dispatcher: Dispatcher | None = None, *, save_policy: step_policies.Policy | None = None,
                 keep_policy: step_policies.Policy | None = None, max_to_keep: int | None = None,
                 keep_every_n_steps: int | None = None, barrier_timeout: float | None = None, clock=time.time,
                 local: tiers.LocalTier | None = None, incremental: bool = False):
        self.save_policy = step_policies.check(save_policy, "save")
        self.keep_policy, self.max_to_keep, self.keep_every_n_steps = step_policies.keep_policy(
            keep_policy, max_to_keep, keep_every_n_steps)
        step_policies.check_barrier_timeout(dispatcher, barrier_timeout)
        if not callable(clock):
            raise TypeError(f"clock must be callable (returning UNIX seconds), got {clock!r}")
        step_root = StepRoot.open(root)   # before a dispatcher exists: a bad root leaks none
        self.incremental = incremental  # persistent saves store unchanged chunks by reference (dispatch_io.incremental)
        self._owns_dispatcher = dispatcher is None
        if dispatcher is None:
            extra = {} if barrier_timeout is None else {"barrier_timeout": barrier_timeout}
            dispatcher = LocalDispatcher(**extra)
        super().__init__(step_root, dispatcher, self.keep_policy, clock, jax.process_index(),
                         jax.process_count(), self._check_usable)
        self._leader = self._process == 0
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._in_flight: concurrent.futures.Future | None = None  # the last save, until committed
        self._deleting: concurrent.futures.Future | None = None   # the last retention
        self._saving_thread: int | None = None                   # the thread inside save(), if any
        self._unreported: BaseException | None = None            # a failure not raised by save()/wait() yet
        self._closed = False
        try:  # what can fail (the store, another process, a bad local tier) before threads exist
            if self._leader:
                self._root.remove_leftovers()
            room = None
            if self._processes > 1 and self.save_policy is not None and self.save_policy.uses_clock:
                room = open_room("manager", self._root.display, f"the CheckpointManager of {self.root}",
                                 dispatcher.options.barrier_timeout)
            self._decisions = SharedDecisions(room)
            self._last_saved_step = self._latest_persistent()
            self._last_save = root_steps.started(self.step_info, self._last_saved_step, self._clock())
            self.local = None if local is None else tiers.LocalTiers(local, dispatcher, clock, self._process,
                                                                     self._processes, self._root)
        except BaseException:
            if self._owns_dispatcher:
                dispatcher.close()
            raise
        self._preemption = PreemptionWatcher()
        self._decision: tuple[int, bool] | None = None           # should_save's last answer
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dispatch_io-manager")
        self._deleter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dispatch_io-retention")

    # ---- policies ------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether to save ``step``: any save policy (the local tier's too) says so, or the job reached
        its preemption point at it (always True without a save policy; with one, False for a step not
        newer than the last saved). Identical on every process of a job (a clock-reading decision is
        process 0's); call it at every step, on every process."""
        step = step_number(step)
        return self._should_persist(step) or (self.local is not None and self.local.should_save(step))

    def _should_persist(self, step: int) -> bool:
        """Whether the persistent root saves ``step`` (what ``should_save`` says without a local tier)."""
        if self._decision is not None and self._decision[0] == step:
            return self._decision[1]
        preempted = self._preemption.reached(step)
        policy = self.save_policy
        saved = self._last_saved_step

        def decide() -> bool:
            if policy is not None and saved is not None and step <= saved:
                return False  # saved already (a resumed loop asks again about the step it restored)
            if policy is None or preempted:
                return True
            return policy.should_save(step_policies.SaveState(step, self._clock(), self._last_save,
                                                         self._last_saved_step, preempted))

        answer = self._decisions.decide(step, decide) if policy is not None and policy.uses_clock else decide()
        self._decision = (step, answer)
        return answer

    def reached_preemption(self, step: int) -> bool:
        """True at the step where the job stops for a preemption: JAX's sync point under
        ``jax.distributed`` (the same step on every process), else after SIGTERM. Save there
        (``should_save`` says so), ``wait()``, and stop. Never raises for want of a service."""
        return self._preemption.reached(step_number(step))

    # ---- save / restore --------------------------------------------------------------------------

    def save(self, step: int, tree, *, items=None, metrics=None, metadata=None, force: bool = False,
             overwrite: bool = False, local: bool | None = None, **save_kwargs) -> SaveHandle | None:
        """Save ``tree`` as ``step`` (after the save in flight, if any, has finished), with ``items`` (name ->
        ``dio.Json`` / ``dio.PerProcess``), ``metrics`` (name -> number, for ``BestN``) and ``metadata`` (JSON), all
        committed together. Without ``force``, a step the save policy does not save is skipped (returns None). Same
        keyword arguments as ``Dispatcher.save``. ``local``: True saves the step in the local tier too, False not;
        None: as its save policy says.

        Raises, before anything is written: ``TypeError`` / ``ValueError`` for a bad item, metric or metadata
        (naming it); ``ValueError`` if ``step`` is older than the latest committed step; ``FileExistsError`` if the
        step exists and not ``overwrite``, or Orbax wrote it; ``CheckpointError`` if several directories hold it;
        ``RuntimeError`` after ``close()`` or from a save callback. An earlier save's failure, not yet raised, is
        raised here (once)."""
        step = step_number(step)
        self._check_usable("save")
        self._check_not_inside_save("save")
        _check_save_keywords(self.dispatcher, save_kwargs)
        files, index = items_lib.files(items, self._process, checksums=self.dispatcher.options.checksums)
        info = info_lib.make(step, self._clock(), info_lib.metrics_of(metrics), metadata, index, self._processes, _version())
        persist = force or self.save_policy is None or self._should_persist(step)
        if persist and self.local is not None:  # the root's refusal first: the local save would write before it
            root_steps.check_new(self._root, step, overwrite, self.step_path, self.persistent_steps(), self.root)
        if local is not None and not isinstance(local, bool):
            raise TypeError(f"save(local={local!r}): True, False or None")
        if self.local is None:
            if local:
                raise ValueError("save(local=True) on a CheckpointManager without a local tier "
                                 "(pass local=dio.LocalTier(...))")
            handle = None
        else:  # fast: first
            handle = self.local.save_with(step, tree, local, persist, items, info,
                                          {"incremental": self.incremental, **save_kwargs},
                                          (self._last_saved_step, self._latest_persistent))
        if not persist:
            return handle
        if handle is not None and self.local.tier.promote:  # the root's copy from the local one: one device copy
            return self._persist("save", step, info["started"], overwrite,
                                 promotion.after(handle, self.local, step, _version(), self._clock, overwrite))
        return self._persist("save", step, info["started"], overwrite, lambda path: self.dispatcher.save(
            path, tree, overwrite=overwrite, attachments=Attachments(files, info, self._clock, agreed=index),
            **{"incremental": self.incremental, **save_kwargs}))

    def promote(self, step: int, *, overwrite: bool = False) -> SaveHandle:
        """Persist local ``step`` from the local copies, byte for byte, with its items and info, touching no device
        (every process; ``promotion.promote``). Returns its handle; raises as ``save`` and ``promotion.promote``."""
        step = step_number(step)
        self._check_not_inside_save("promote")
        return self._persist("promote", step, self._clock(), overwrite, lambda path: promotion.promote(
            self.local, step, path, _version(), self._clock, overwrite=overwrite))

    def _persist(self, what: str, step: int, started: float, overwrite: bool, launch) -> SaveHandle:
        """``launch(path)``, a save of ``step`` to the root (checked first: ``root_steps.check_new``), after the save
        in flight; then its retention."""
        with self._save_lock:  # saves from several threads run one after the other; close() waits here
            self._check_usable(what)  # again: close() may have run while this waited for the lock
            self._saving_thread = threading.get_ident()
            try:
                self._wait_for_save()
                path = root_steps.check_new(self._root, step, overwrite, self.step_path, self.persistent_steps(), self.root)
                handle = launch(path)
                self._last_save, self._last_saved_step = started, step
                self._infos.pop(step, None)
                with self._lock:
                    self._in_flight = self._thread.submit(self._finish_save, handle, step)
            finally:
                self._saving_thread = None
        return handle

    def _finish_save(self, handle: SaveHandle, step: int):
        """On the manager's thread: wait for the save, then hand retention to its own thread."""
        try:
            handle.wait()
        except BaseException as exc:  # noqa: BLE001 - raised by the next save()/wait() (once: promotion.to_report)
            with self._lock:
                self._unreported = promotion.to_report(handle, exc)
            return
        finally:  # info read while it was being saved (an overwrite) is the replaced step's
            self._infos.pop(step, None)
        if self._leader and self.keep_policy is not None:
            with self._lock:
                self._deleting = self._deleter.submit(self._apply_retention)

    def _wait_for_save(self):
        """Wait for the save in flight (not its retention); raise a failure not yet raised."""
        with self._lock:
            pending = self._in_flight
        if pending is not None:
            pending.result()
        with self._lock:
            error, self._unreported = self._unreported, None
        if error is not None:
            raise error

    def wait(self):
        """Wait for the save in flight and its retention; raise a failure not yet raised.
        ``RuntimeError`` from a save callback (that would deadlock)."""
        self.dispatcher.check_not_io_thread("CheckpointManager.wait")
        try:
            if self.local is not None:
                self.local.wait()
            self._wait_for_save()
        finally:
            with self._lock:
                deleting = self._deleting
            if deleting is not None:
                deleting.result()

    # ---- retention and clean-up ------------------------------------------------------------------

    def steps_to_delete(self, steps: list[int]) -> list[int]:
        """Which of the committed ``steps`` (any order) the keep policy drops, ascending; the newest is always kept."""
        return retention.steps_to_delete([retention.record(s, self.step_info) for s in steps], self.keep_policy, self._clock())

    def _apply_retention(self):
        """Delete the dropped steps dispatch_io wrote; never one it did not (Orbax's are kept).
        Never raises: a committed save is not failed over clean-up."""
        try:
            retention.delete_dropped(self._root, self.steps_to_delete(self.persistent_steps()),
                                     lambda step: self._infos.pop(step, None))
        except Exception:  # noqa: BLE001 - logged; the next retention tries again
            logging.exception("dispatch_io: retention under %s failed", self.root)
    # ---- lifecycle -------------------------------------------------------------------------------

    def _check_usable(self, what: str):
        """RuntimeError, instead of a hang, from a save callback (it runs on the dispatcher's IO
        threads, which the manager's save and wait wait for), or after close()."""
        self.dispatcher.check_not_io_thread(f"CheckpointManager.{what}")
        if self._closed:
            raise RuntimeError(f"CheckpointManager.{what}() called after close()")

    def _check_not_inside_save(self, what: str):
        """RuntimeError if called by the thread inside ``save()`` (its signal handler, a priority callback)."""
        if self._saving_thread == threading.get_ident():
            raise RuntimeError(f"CheckpointManager.{what}() called by the thread inside its save() (from a signal "
                               f"handler or a priority callback?): it would wait for that save, so for itself; set a "
                               f"flag there and call {what}() after save() returned")

    def close(self):
        """Wait for a ``save()`` another thread has begun to start its save, then for the save in flight and its
        retention (raising its failure, if not raised yet); then release the manager's threads, its SIGTERM handler
        and, if the manager made it, the dispatcher. A ``save()`` that begins later raises ``RuntimeError``.
        ``RuntimeError`` from a save callback, or from the thread inside ``save()`` (e.g. its signal handler):
        either would deadlock."""
        self.dispatcher.check_not_io_thread("CheckpointManager.close")
        self._check_not_inside_save("close")
        with self._save_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.wait()
        finally:
            self._thread.shutdown(wait=True)
            self._deleter.shutdown(wait=True)
            self._preemption.close()
            if self.local is not None:
                self.local.close()
            if self._owns_dispatcher:
                self.dispatcher.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_save_keywords(dispatcher, save_kwargs: dict):
    """TypeError for a keyword ``Dispatcher.save`` does not take, before (and whether or not) anything is saved."""
    try:
        inspect.signature(dispatcher.save).bind(None, None, **save_kwargs)
    except TypeError as exc:
        raise TypeError(f"CheckpointManager.save(): {exc} (its keywords are Dispatcher.save's)") from None


def _version() -> str:
    from dispatch_io import __version__
    return __version__
