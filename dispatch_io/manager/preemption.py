"""Preemption: has the job been told to stop, and at which step do all its processes stop?

Spot / preemptible machines get SIGTERM some time before they are taken away. Two sources:

* ``jax.distributed`` with its preemption service (the default when it is initialized):
  SIGTERM to any process starts JAX's sync protocol, and
  ``multihost_utils.reached_preemption_sync_point(step)`` is True on every process at the same
  step -- the one after the largest step any process had reached.
* one process without ``jax.distributed``: a SIGTERM handler of the watcher's own, installed
  (from the main thread) when the loop first asks, so a program that never asks is stopped by
  SIGTERM as before; a handler the program had is still called. Every step after the signal
  is the stop step (a second SIGTERM -- a launcher passing its own on -- changes nothing).
  ``close()`` takes the handler out again (a handler that cannot be taken
  out -- another was installed over it, or ``close()`` runs off the main thread -- passes the
  signal on as if it were not there).

Otherwise (the preemption service disabled, a watcher asked off the main thread) nothing is
ever reached: ``reached`` is False, never an error. The answer for a step is fixed when it is
first asked, so ``should_save(step)`` and ``reached_preemption(step)`` always agree.
"""

from __future__ import annotations

import signal
import threading

from absl import logging


def _jax_sync_manager():
    from jax._src.distributed import global_state  # where jax.distributed keeps its client
    return global_state.client, global_state.preemption_sync_manager


def _skip_closed(handler):
    """``handler``, or what a closed watcher's handler passes the signal on to."""
    while isinstance(getattr(handler, "__self__", None), PreemptionWatcher) and handler.__self__._closed:
        handler = handler.__self__._previous
    return handler


class PreemptionWatcher:
    """Tells whether the job reached its preemption point at a step (see the module doc)."""

    def __init__(self):
        self._client, self._sync_manager = _jax_sync_manager()
        self._signalled = threading.Event()
        self._previous = None
        self._installed = self._closed = False
        self._lock = threading.Lock()
        self._last: tuple[int, bool] | None = None   # the answer for the step asked last
        if self._client is not None and self._sync_manager is None:
            logging.warning("dispatch_io: jax.distributed runs without its preemption service "
                            "(jax_enable_preemption_service): preemption is never reached")

    def reached(self, step: int) -> bool:
        """True at the step where every process of the job stops for a preemption (with JAX's
        service, ask at every step, the same on every process)."""
        with self._lock:
            if self._last is None or self._last[0] != step:
                self._last = (step, self._ask(step))
            return self._last[1]

    def _ask(self, step: int) -> bool:
        if self._sync_manager is not None:
            return bool(self._sync_manager.reached_sync_point(step))
        if self._client is None and not self._installed and not self._closed:
            self._install()
        return self._signalled.is_set()

    def _install(self):
        if threading.current_thread() is not threading.main_thread():
            logging.warning("dispatch_io: preemption asked off the main thread: SIGTERM cannot be watched there, "
                            "so preemption is never reached")
            self._closed = True
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def _on_sigterm(self, signum, frame):
        previous = _skip_closed(self._previous)
        if self._closed:  # not watching any more: do what SIGTERM would do without us
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.raise_signal(signal.SIGTERM)
            return
        self._signalled.set()
        if callable(previous):
            previous(signum, frame)

    def close(self):
        """Stop watching; put back the handler this one replaced where it can."""
        with self._lock:
            self._closed = True
            if not self._installed:
                return
            self._installed = False
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm and \
                    threading.current_thread() is threading.main_thread():
                previous = _skip_closed(self._previous)
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
