"""CheckpointManager and preemption (SIGTERM): reached only after a signal or a service's notice,
never a lost save between ``should_save`` and ``reached_preemption``, SIGTERM handed back once every
manager is closed, and managers that never watch for it (or live off the main thread) leave it alone."""

import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import dispatch_io as dio
from dispatch_io import policies as P


JOB_TIMEOUT = 120


AFTER_CLOSE = r"""
import os, signal, sys, threading, time
import dispatch_io as dio
root = sys.argv[1]
if sys.argv[2] == "out-of-order":            # two managers (model and EMA, say), closed a then b
    a = dio.CheckpointManager(root + "/a")
    b = dio.CheckpointManager(root + "/b")
    a.close()
    b.close()
else:                                        # made on the main thread, closed by a teardown thread
    mgr = dio.CheckpointManager(root + "/a")
    closer = threading.Thread(target=mgr.close)
    closer.start()
    closer.join()
os.kill(os.getpid(), signal.SIGTERM)         # no manager is open: SIGTERM must end the program again
time.sleep(2)
print("SURVIVED SIGTERM", flush=True)
"""


SIGTERM_WITHOUT_PREEMPTION = r"""
import os, signal, sys, time
import numpy as np
import dispatch_io as dio
with dio.CheckpointManager(sys.argv[1], max_to_keep=2) as mgr:   # a loop written before issue 25
    for step in range(3):
        mgr.save(step, {"w": np.zeros(4)})
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(2)
print("SURVIVED SIGTERM", flush=True)
"""
TIMEOUT = 60


def tree(step):
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4) + step, "step": step}

def test_sigterm_between_should_save_and_reached_preemption_never_stops_without_saving(tmp_path):
    """The loop of the issue: ``if should_save(s): save`` then ``if reached_preemption(s): wait;
    break``. A SIGTERM landing between the two calls (single process) must not make the loop
    stop at a step it did not save: the answers for one step must agree (JAX's sync point
    latches per step; the manager's own handler does not)."""
    program = signal.signal(signal.SIGTERM, lambda signum, frame: None)   # never lets SIGTERM end pytest
    mgr = dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(100) | P.Preemption())
    try:
        assert not mgr.should_save(5)
        os.kill(os.getpid(), signal.SIGTERM)          # arrives during the step's bookkeeping
        stops_here = mgr.reached_preemption(5)
        saved_here = mgr.should_save(5)
        assert not stops_here or saved_here, "the loop breaks at step 5, which it did not save"
    finally:
        mgr.close()
        signal.signal(signal.SIGTERM, program)


@pytest.mark.parametrize("mode", ["out-of-order", "closed-from-a-thread"])
def test_once_every_manager_is_closed_sigterm_ends_the_program_again(tmp_path, mode):
    """Once every manager is closed SIGTERM ends the program again, whether the managers are closed in
    another order than made (a, b; close a, then b) or from another thread: no closed manager's handler
    is left installed to swallow SIGTERM for the rest of the program."""
    out = subprocess.run([sys.executable, "-c", AFTER_CLOSE, str(tmp_path), mode],
                         capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert "SURVIVED SIGTERM" not in out.stdout and out.returncode == -signal.SIGTERM, (out.returncode, out.stdout)


def test_a_manager_that_never_watches_preemption_does_not_swallow_sigterm(tmp_path):
    """A loop that never asks reached_preemption (every loop written for the old manager) is still stopped
    by SIGTERM: the manager installs its handler when the loop first asks (reached_preemption /
    should_save), so it does not swallow the signal and run on until the SIGKILL that follows the grace
    period, possibly mid-save."""
    out = subprocess.run([sys.executable, "-c", SIGTERM_WITHOUT_PREEMPTION, str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert "SURVIVED SIGTERM" not in out.stdout and out.returncode == -signal.SIGTERM, (out.returncode, out.stdout)


def test_reached_preemption_is_false_without_a_signal_and_true_after_sigterm(tmp_path):
    previous = []
    old = signal.signal(signal.SIGTERM, lambda s, f: previous.append(s))
    try:
        with dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(100) | P.Preemption()) as mgr:
            assert not mgr.reached_preemption(1) and not mgr.should_save(1)
            os.kill(os.getpid(), signal.SIGTERM)
            assert mgr.reached_preemption(2) and mgr.should_save(2)
            assert previous == [signal.SIGTERM]        # the program's own handler still ran
        assert signal.getsignal(signal.SIGTERM) is not None and previous == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)           # put back on close: the program's handler again
        assert previous == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


def test_preemption_is_never_reached_and_never_an_error_without_a_service(tmp_path, monkeypatch):
    """Orbax #3406: jax.distributed running without its preemption service crashed the save
    policy. Here reached_preemption is False, and no SIGTERM handler is taken over."""
    from dispatch_io.manager import preemption
    monkeypatch.setattr(preemption, "_jax_sync_manager", lambda: (object(), None))
    before = signal.getsignal(signal.SIGTERM)
    with dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(10) | P.Preemption()) as mgr:
        assert signal.getsignal(signal.SIGTERM) is before
        assert not mgr.reached_preemption(3) and not mgr.should_save(3) and mgr.should_save(10)


def test_a_manager_made_off_the_main_thread_works_without_a_sigterm_handler(tmp_path):
    before, seen = signal.getsignal(signal.SIGTERM), []

    def run():
        with dio.CheckpointManager(tmp_path) as mgr:
            seen.append((mgr.reached_preemption(1), signal.getsignal(signal.SIGTERM) is before))
            mgr.save(1, tree(1), items={"data": dio.Json(1)})

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(TIMEOUT)
    assert seen == [(False, True)]
    with dio.CheckpointManager(tmp_path) as mgr:
        assert mgr.item(1, "data") == 1
