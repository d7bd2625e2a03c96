"""The read side of a :class:`~dispatch_io.manager.manager.CheckpointManager`: which steps there are, what
each holds, and restoring one.

Two listings, each with one meaning:

* **persistent steps** (:meth:`StepReads.persistent_steps`): committed in the root. The root's retention,
  ``best_step``, ``step_info``, ``metadata`` and ``dispatch-io inspect`` see these only.
* **restorable steps** (:meth:`StepReads.all_steps`, :meth:`StepReads.latest_step`): with a local tier, also
  the local steps whose every region survives on some process (``job_steps.whole_steps``: agreed job-wide,
  like ``should_save``); without one, the persistent steps. ``restore(step, target)`` reads a step through
  the tiers (own copy, a peer's, the root) whether or not the root holds it, so the loop

      step = mgr.latest_step()
      if step is not None:
          state = mgr.restore(step, target)

  is the same with or without ``local=``. See docs/manager.md.
"""

from __future__ import annotations

from dispatch_io.formats.detect import committed_steps, metadata, step_path
from dispatch_io.manager import info as info_lib
from dispatch_io.manager import orbax_items, step_policies, retention, root_steps
from dispatch_io.manager.tiers import placement


def step_number(step) -> int:
    return step_policies.integer(step, "step", 0, "a non-negative integer")


class StepReads:
    """The listing and restore methods of a CheckpointManager, over the state its constructor takes:
    the ``root`` (a ``StepRoot``), the ``dispatcher`` that reads it, the ``keep_policy`` (for
    ``best_step``), the ``clock``, this ``process`` of ``processes``, and ``check_usable(what)``
    (RuntimeError where the manager cannot be used: after close(), from a save callback). ``local``
    (the local tier's ``LocalTiers``, None without one) is set once the tier is open."""

    def __init__(self, root, dispatcher, keep_policy, clock, process: int, processes: int, check_usable):
        self._root, self.root = root, root.display
        self.dispatcher, self.keep_policy, self._clock = dispatcher, keep_policy, clock
        self._process, self._processes = process, processes
        self._check_usable = check_usable
        self._infos: dict[int, info_lib.StepInfo] = {}   # step info read, per committed step
        self.local = None
        self.last_tier_restore = None   # what restore() through the tiers did (TierRestoreStats)

    def step_path(self, step: int) -> str:
        """Where ``step`` is (or would be saved): ``<root>/<step>``, or the Orbax step directory
        holding it under Orbax's ``step_prefix`` / ``step_format_fixed_length`` naming. Raises
        CheckpointError if several directories hold the step."""
        return step_path(self._root, step_number(step))

    def persistent_steps(self) -> list[int]:
        """Steps committed in the root, ascending: dispatch_io's, and Orbax's in a directory root (no
        coordination: any process, any time)."""
        return committed_steps(self._root)

    def steps(self) -> dict[int, str]:
        """{step: durability} of the steps the job can restore whole, ascending: the persistent steps
        (``"persisted"``) and, with a local tier, the local steps every region of which some process's local
        copy holds (``"replicated k"``: every region saved by k processes; ``"local"``) -- the same answer on
        every process: with a local tier in a multi-process job every process calls it together (one
        gather of what each holds, ``job_steps.whole_steps``)."""
        persistent = self.persistent_steps()
        if self.local is None:
            return {step: "persisted" for step in persistent}
        return self.local.whole_steps(persistent)

    def all_steps(self) -> list[int]:
        """The steps of :meth:`steps`, ascending (every process together, with a local tier)."""
        return list(self.steps())

    def latest_step(self) -> int | None:
        """The newest of :meth:`all_steps` (None: none), the step a resumed job restores."""
        return (self.all_steps() or [None])[-1]

    def _latest_persistent(self) -> int | None:
        return (self.persistent_steps() or [None])[-1]

    def step_info(self, step: int | None = None) -> info_lib.StepInfo:
        """What is known of persistent ``step`` (None: the newest persistent): :class:`StepInfo` (one small file,
        no device). FileNotFoundError if the step is not committed; CheckpointError if its info is malformed."""
        step = self._resolve(step)
        if step not in self._infos:
            self._infos[step] = root_steps.read_info(self.step_path(step), step)
        return self._infos[step]

    def best_step(self, metric: str | None = None, mode: str | None = None) -> int | None:
        """The persistent step with the best ``metric`` (``mode`` ``"min"`` / ``"max"``); both default to the
        keep policy's ``BestN``. None if no step has the metric. ValueError if no metric is given and the keep
        policy has no single ``BestN``."""
        return retention.best_step([retention.record(s, self.step_info) for s in self.persistent_steps()],
                                   self.keep_policy, metric, mode, self._clock())

    def restore(self, step: int | None = None, target=None, *, item: str | None = None, durability: str = "local",
                **restore_kwargs):
        """Restore ``step`` (None: the newest); same keywords as ``Dispatcher.restore``. ``item``: which pytree
        item of an Orbax step with several (``"items"`` for MaxText's); None: the only one. Our steps hold one
        pytree (``item`` must be None).

        With a local tier and a ``target`` (every process together): through the tiers -- each region from
        this process's local copy, a peer's, else the root (``last_tier_restore`` says what came from where) --
        ``step`` if given (local, persistent or both: FileNotFoundError if no tier holds it whole), else the
        newest step of at least ``durability`` (``"local"`` / ``"replicated"`` / ``"persisted"``:
        :meth:`durability`; without a target: ValueError). Without a local tier, or a step named without a
        target: from the root (the newest persistent step for None). ``verify=True`` checks the restored step's
        items too (``root_steps.verify_items``; a local step's: this process's copy's)."""
        self._check_usable("restore")
        placement.check_durability(durability)
        if self.local is not None:
            self.local.restoring()
        if self.local is not None and item is None and (target is not None or step is None):
            persistent = self.persistent_steps()
            tree, self.last_tier_restore = self.local.restore(
                target, persistent, lambda s: self._pytree_path(s, None), self.root,
                durability=durability, step=None if step is None else step_number(step), **restore_kwargs)
            if restore_kwargs.get("verify"):  # its items too, as from the root: the root's, else this process's copy's
                restored = self.last_tier_restore.step
                if restored in persistent:
                    root_steps.verify_items(self.step_path(restored), restored)
                else:
                    self.local.verify_items(restored, self.root)
            return tree
        step = self._resolve(step)
        tree = self.dispatcher.restore(self._pytree_path(step, item), target, **restore_kwargs)
        if restore_kwargs.get("verify"):  # its items too, each against its CRC-32C
            root_steps.verify_items(self.step_path(step), step)
        if self.local is not None:  # resuming an older step: the newer local steps are an abandoned history
            self.local.resume(step)
        return tree

    def durability(self, step: int) -> str | None:
        """``"persisted"`` (committed in the root), else, if this process has ``step`` locally, ``"replicated k"``
        (any ``k - 1`` lost processes lose nothing) or ``"local"``; None if neither holds it (this process's
        view, no coordination; :meth:`steps` answers job-wide)."""
        step = step_number(step)
        if step in self.persistent_steps():
            return "persisted"
        return None if self.local is None else self.local.durability(step)

    def metadata(self, step: int | None = None, *, item: str | None = None):
        """The saved tree's metadata of persistent ``step`` (None: the newest persistent)."""
        return metadata(self._pytree_path(step, item))

    def item(self, step: int | None, name: str):
        """Item ``name`` of ``step`` (None: the newest persistent; a step only the local tier holds: from this
        process's copy, else FileNotFoundError): a ``Json`` item's value, or this process's ``PerProcess`` value
        (bytes or JSON, as saved). In an Orbax step: a JSON item's value, or this process's Grain iterator
        state. KeyError (listing the step's items) if it has none of that name; CheckpointError if it was saved
        by another number of processes (naming both counts) or is malformed."""
        step = self._resolve(step)
        path = self.step_path(step)
        if self.local is not None and step not in self.persistent_steps():  # a step the local tier alone holds
            return self.local.read_item(step, name, self.root)
        info = None if orbax_items.is_orbax_step(path) else self.step_info(step)
        return root_steps.read_item(path, info, name, self._process, self._processes)

    def _pytree_path(self, step: int | None, item: str | None) -> str:
        return root_steps.pytree_path(self.step_path(self._resolve(step)), item)

    def _resolve(self, step: int | None) -> int:
        """``step``, or for None the newest persistent step (FileNotFoundError if there is none)."""
        if step is not None:
            return step_number(step)
        latest = self._latest_persistent()
        if latest is None:
            raise FileNotFoundError(f"no committed step under {self.root}")
        return latest
