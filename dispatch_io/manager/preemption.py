"""Preemption: has the job been told to stop, and at which step do all its processes stop?

Spot / preemptible machines get SIGTERM some time before they are taken away. Two sources,
picked once when a manager is made:

* ``jax.distributed`` with its preemption service (the default when it is initialized):
  SIGTERM to any process starts JAX's sync protocol, and
  ``multihost_utils.reached_preemption_sync_point(step)`` is True on every process at the same
  step -- the one after the largest step any process had reached.
* one process without ``jax.distributed``: the watcher's own SIGTERM handler (installed from
  the main thread; a handler the program had is still called), and every step from the next
  ``reached(step)`` on is the stop step. A second SIGTERM, if the program has not stopped
  by then, ends it as SIGTERM would have.

Otherwise (the preemption service disabled, or a manager made off the main thread) nothing
is ever reached: ``reached`` is False, never an error.
"""

from __future__ import annotations

import signal
import threading

from absl import logging


def _jax_sync_manager():
    from jax._src.distributed import global_state  # where jax.distributed keeps its client
    return global_state.client, global_state.preemption_sync_manager


class PreemptionWatcher:
    """Tells whether the job reached its preemption point at a step. ``close()`` puts back the
    SIGTERM handler it replaced."""

    def __init__(self):
        client, sync_manager = _jax_sync_manager()
        self._sync_manager = sync_manager
        self._signalled = threading.Event()
        self._previous = None
        self._installed = False
        self._last: tuple[int, bool] | None = None   # JAX's answer for the step asked last
        if client is not None:
            if sync_manager is None:
                logging.warning("dispatch_io: jax.distributed runs without its preemption service "
                                "(jax_enable_preemption_service): preemption is never reached")
        elif threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        else:
            logging.warning("dispatch_io: CheckpointManager made off the main thread: it cannot watch SIGTERM, "
                            "so preemption is never reached")

    def _on_sigterm(self, signum, frame):
        if self._signalled.is_set() and not callable(self._previous):
            # A second SIGTERM while the program has not stopped: die as the signal asks.
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
            return
        self._signalled.set()
        if callable(self._previous):
            self._previous(signum, frame)

    def reached(self, step: int) -> bool:
        """True at the step where every process of the job stops for a preemption (with JAX's
        service, ask at every step, the same on every process)."""
        if self._sync_manager is not None:
            if self._last is None or self._last[0] != step:
                self._last = (step, bool(self._sync_manager.reached_sync_point(step)))
            return self._last[1]
        return self._signalled.is_set()

    def close(self):
        if self._installed:
            self._installed = False
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
