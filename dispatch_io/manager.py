"""CheckpointManager: numbered steps under one root, for a training loop.

    with dio.CheckpointManager("ckpts", max_to_keep=3, keep_every_n_steps=1000) as manager:
        for step in range(start, steps):
            state = train_step(state)
            if step % 100 == 0:
                manager.save(step, state)           # async; returns once SYNC leaves are off the device
        ...
    state = manager.restore(target=abstract_state)  # the latest committed step

Layout: ``<root>/<step>/`` is an ordinary dispatch_io checkpoint (so ``dio.metadata`` and
``dispatcher.restore`` read it directly, and a copy of it elsewhere restores as well). The root
is a directory or an object-store prefix (``s3://bucket/run1``, ``gs://...``; see dispatch_io.storage).

What the manager guarantees, built only on the dispatcher's atomic commit:

* A step is listed (``all_steps``, ``latest_step``, ``restore``) only once committed; a save
  that failed or was killed never is. Leftovers of killed saves are removed when a manager
  opens the root -- only those it can prove are its own and dead (a ``WRITING`` marker naming
  a process of this host that no longer runs). A replaced step that a crash left moved aside
  is put back.
* Saves never interleave: ``save()`` first waits for the save in flight. A failed save raises
  from its own handle and, once, from the next ``save()`` / ``wait()``; the manager stays usable.
* Retention (``max_to_keep`` most recent, plus every step divisible by ``keep_every_n_steps``)
  runs after a newer step committed, on the manager's thread, never inside ``save()``. It
  deletes only committed dispatch_io checkpoints with step names; anything else in the root
  (``notes/``, a numeric directory without a manifest, someone else's temporary directory) is
  neither listed nor deleted. A deleted step is first unlisted (renamed away; on object stores,
  its marker deleted), so a crash mid-delete never leaves a listed but broken step. With several processes, process 0 alone decides and deletes.
* A directory root that Orbax's CheckpointManager wrote: its committed steps (``<root>/<step>/``
  holding one Orbax item, e.g. ``default``; ``ckpt_100`` or ``00000100`` under Orbax's
  ``step_prefix`` / ``step_format_fixed_length``) are listed and restored like ours, and new
  saves are dispatch_io checkpoints beside them, named ours (``<root>/<step>/``). A step Orbax
  holds under any name is never saved again (``FileExistsError``), and a step two directories
  hold is an error naming both, never a guess. Retention counts Orbax steps but never deletes one (it
  logs that it kept it; remove it yourself, ``rm -r <root>/<step>``); Orbax's temporary
  directories are never touched.
"""

from __future__ import annotations

import concurrent.futures
import operator
import threading

import jax
import numpy as np
from absl import logging

from dispatch_io.dispatcher import Dispatcher, LocalDispatcher
from dispatch_io.formats import committed_steps, metadata, step_path
from dispatch_io.storage import StepRoot
from dispatch_io.save import SaveHandle


def _integer(value, name: str, minimum: int, expected: str) -> int:
    """``value`` as a Python int of at least ``minimum`` (numpy / jax integer scalars accepted;
    not bool, nor a float); ``ValueError`` saying ``name`` must be ``expected`` otherwise."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return number


def _step_number(step) -> int:
    return _integer(step, "step", 0, "a non-negative integer")


class CheckpointManager:
    """Numbered steps under ``root`` (a directory or kvstore URL), saved through ``dispatcher`` (a
    :class:`LocalDispatcher` with default options if None; the manager then owns and closes it).

    ``max_to_keep``: keep only this many most recent steps (None: all). ``keep_every_n_steps``:
    also keep, forever, every step divisible by it. ``barrier_timeout``: seconds a process of a
    multi-process job waits for the others, for the dispatcher the manager creates; with a
    ``dispatcher`` of your own, set ``barrier_timeout`` in its options instead (passing both
    is a ``ValueError``: the manager cannot change a dispatcher's options).
    """

    def __init__(self, root, dispatcher: Dispatcher | None = None, *, max_to_keep: int | None = None,
                 keep_every_n_steps: int | None = None, barrier_timeout: float | None = None):
        if max_to_keep is not None:
            max_to_keep = _integer(max_to_keep, "max_to_keep", 1, "a positive integer or None")
        if keep_every_n_steps is not None:
            keep_every_n_steps = _integer(keep_every_n_steps, "keep_every_n_steps", 1, "a positive integer or None")
        if dispatcher is not None and barrier_timeout is not None:
            raise ValueError(
                f"barrier_timeout={barrier_timeout!r} would not apply to the dispatcher you passed (its "
                f"Options.barrier_timeout is {dispatcher.options.barrier_timeout:g} s): create the dispatcher with "
                f"barrier_timeout={barrier_timeout!r} (e.g. LocalDispatcher(..., barrier_timeout={barrier_timeout!r})) "
                "and leave it out here")
        self._root = StepRoot.open(root)
        self.root = self._root.display
        self.max_to_keep = max_to_keep
        self.keep_every_n_steps = keep_every_n_steps
        self._owns_dispatcher = dispatcher is None
        if dispatcher is None:
            extra = {} if barrier_timeout is None else {"barrier_timeout": barrier_timeout}
            dispatcher = LocalDispatcher(**extra)
        self.dispatcher = dispatcher
        self._leader = jax.process_index() == 0
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._in_flight: concurrent.futures.Future | None = None  # the last save + its retention
        self._saving_thread: int | None = None                   # the thread inside save(), if any
        self._unreported: BaseException | None = None            # a failure not raised by save()/wait() yet
        self._closed = False
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dispatch_io-manager")
        if self._leader:
            self._root.remove_leftovers()

    # ---- listing ------------------------------------------------------------------------------

    def step_path(self, step: int) -> str:
        """Where ``step`` is (or would be saved): ``<root>/<step>``, or the Orbax step directory
        holding it under Orbax's ``step_prefix`` / ``step_format_fixed_length`` naming. Raises
        CheckpointError if several directories hold the step."""
        return step_path(self._root, _step_number(step))

    def all_steps(self) -> list[int]:
        """Committed steps, ascending: dispatch_io's, and Orbax's in a directory root."""
        return committed_steps(self._root)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ---- save / restore --------------------------------------------------------------------------

    def save(self, step: int, tree, *, overwrite: bool = False, **save_kwargs) -> SaveHandle:
        """Save ``tree`` as ``step`` (after the save in flight, if any, has finished). Same
        keyword arguments as ``Dispatcher.save``. ``ValueError``, before anything is written,
        if ``step`` is older than the latest committed step (after a rollback: remove the newer
        steps first). ``FileExistsError`` if the step exists and not ``overwrite``, or Orbax
        wrote it (whatever its naming: never replaced); ``CheckpointError`` if several
        directories hold it already; ``RuntimeError`` after ``close()`` or from a save callback.
        An earlier save's failure, not yet raised, is raised here (once)."""
        step = _step_number(step)
        self._check_usable("save")
        with self._save_lock:  # saves from several threads run one after the other; close() waits here
            self._check_usable("save")  # again: close() may have run while this waited for the lock
            self._saving_thread = threading.get_ident()
            try:
                self.wait()
                path = self.step_path(step)
                if path != self._root.step_path(step):
                    raise FileExistsError(f"step {step} is already held by the Orbax checkpoint {path}; a save "
                                          "never replaces one, even with overwrite=True (remove it first if it may go)")
                self._check_not_older(step)
                handle = self.dispatcher.save(path, tree, overwrite=overwrite, **save_kwargs)
                with self._lock:
                    self._in_flight = self._thread.submit(self._finish_save, handle)
            finally:
                self._saving_thread = None
        return handle

    def _check_not_older(self, step: int):
        """Retention ranks steps by number: a step below the newest committed one would be the
        first it deletes (and ``latest_step`` / ``restore()`` would ignore it)."""
        latest = self.latest_step()
        if latest is not None and step < latest:
            newer = [s for s in self.all_steps() if s > step]
            raise ValueError(
                f"cannot save step {step} under {self.root}: step {latest} is newer, so step {step} would never be "
                f"the latest and retention could delete it at once; remove the steps newer than {step} first "
                f"({', '.join(self.step_path(s) for s in newer)}), or save into another root")

    def _finish_save(self, handle: SaveHandle):
        """On the manager's thread: wait for the save, then apply retention."""
        try:
            handle.wait()
        except BaseException as exc:  # noqa: BLE001 - raised by the next save()/wait()
            with self._lock:
                self._unreported = exc
            return
        if self._leader and (self.max_to_keep is not None or self.keep_every_n_steps is not None):
            try:
                self._apply_retention()
            except Exception:  # noqa: BLE001 - never fail a committed save over clean-up
                logging.exception("dispatch_io: retention under %s failed", self.root)

    def wait(self):
        """Wait for the save in flight (and its retention); raise a failure not yet raised.
        ``RuntimeError`` from a save callback (that would deadlock)."""
        self.dispatcher.check_not_io_thread("CheckpointManager.wait")
        with self._lock:
            pending = self._in_flight
        if pending is not None:
            pending.result()
        with self._lock:
            error, self._unreported = self._unreported, None
        if error is not None:
            raise error

    def restore(self, step: int | None = None, target=None, **restore_kwargs):
        """Restore ``step`` (None: the latest committed); same keywords as ``Dispatcher.restore``."""
        self._check_usable("restore")
        return self.dispatcher.restore(self.step_path(self._resolve(step)), target, **restore_kwargs)

    def metadata(self, step: int | None = None):
        return metadata(self.step_path(self._resolve(step)))

    def _resolve(self, step: int | None) -> int:
        if step is not None:
            return _step_number(step)
        latest = self.latest_step()
        if latest is None:
            raise FileNotFoundError(f"no committed step under {self.root}")
        return latest

    # ---- retention and clean-up ------------------------------------------------------------------

    def steps_to_delete(self, steps: list[int]) -> list[int]:
        """Which of the committed ``steps`` (any order) the retention policy drops, ascending;
        the newest is always kept."""
        if self.max_to_keep is None:
            return []
        steps = sorted(steps)
        recent = set(steps[-self.max_to_keep:])
        every = self.keep_every_n_steps
        return [s for s in steps if s not in recent and not (every and s % every == 0)]

    def _apply_retention(self):
        """Delete the dropped steps dispatch_io wrote; never one it did not (Orbax's are kept)."""
        ours = set(self._root.committed_steps())
        for step in self.steps_to_delete(self.all_steps()):
            if step in ours:
                self._root.delete(step)
            else:
                logging.info("dispatch_io: keeping step %d under %s: dispatch_io did not write it "
                             "(remove it yourself to reclaim its space)", step, self.root)

    # ---- lifecycle -------------------------------------------------------------------------------

    def _check_usable(self, what: str):
        """RuntimeError, instead of a hang, from a save callback (it runs on the dispatcher's IO
        threads, which the manager's save and wait wait for), or after close()."""
        self.dispatcher.check_not_io_thread(f"CheckpointManager.{what}")
        if self._closed:
            raise RuntimeError(f"CheckpointManager.{what}() called after close()")

    def close(self):
        """Wait for a ``save()`` another thread has begun to start its save, then for the save in
        flight and its retention (raising its failure, if not raised yet); then release the
        manager's thread and, if the manager made it, the dispatcher. A ``save()`` that begins
        later raises ``RuntimeError``. ``RuntimeError`` from a save callback, or from the thread
        inside ``save()`` (e.g. its signal handler): either would deadlock."""
        self.dispatcher.check_not_io_thread("CheckpointManager.close")
        if self._saving_thread == threading.get_ident():
            raise RuntimeError("CheckpointManager.close() called by the thread inside its save() (from a signal "
                               "handler or a priority callback?): it cannot wait for that save; close after "
                               "save() returned, e.g. set a flag in the handler")
        with self._save_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.wait()
        finally:
            self._thread.shutdown(wait=True)
            if self._owns_dispatcher:
                self.dispatcher.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
