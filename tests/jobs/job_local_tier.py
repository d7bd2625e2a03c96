"""One process of a 4-process x 2-CPU-device job with a local tier (run by tests/test_tier_multiprocess.py).

    python job_local_tier.py PROCESS PORT ROOT LOCAL MODE

Mesh (data=2, fsdp=4): process p holds fsdp regions 2(p % 2), 2(p % 2) + 1, so processes
{0, 2} and {1, 3} hold the same regions. The state is a deterministic function of the step.

MODE ``train``: steps 0..9, local saves every 2 steps, persistent every 6 (each save waited
for, so a step printed ``saved N`` is committed); prints ``step 9`` and waits to be killed.
MODE ``die``: as ``train`` to step 10, where process 1 is killed during its local save (the others commit
theirs, and print ``failed 10 processes [1]``: the job never agreed the step); its persistent steps (0, 6)
are promotions of the local ones (``LocalTier(promote=True)``).
MODE ``loop9`` / ``loop``: the README's loop (``latest_step``, ``restore(step, target)``, train, save) from
whatever step the tiers hold whole, each step ``x / 2 + step`` (floats; ``3x + step`` ints), to step 9 (then
waits to be killed) / 12, printing ``final 12 exact BOOL`` against the uninterrupted run (numpy).
MODE ``stall``: process 3 sleeps; the others print ``timed out waiting for [3]``.
MODE ``resume``: restores through the tiers (verifying checksums; twice) and prints ``resumed STEP exact BOOL local L
persistent P received R peer_regions A persistent_regions B``. MODE ``promote``: as ``resume``, then promotes that
step to the root and restores it from there: ``promoted STEP exact BOOL written W cfg STEP``.
Saves carry a Json item ``cfg`` ({"step": STEP}).
With ``DIO_TEST_TIERS_SHARED=1`` the state has no leaf ``s`` (process 0's alone): every region has two holders.
"""

import os
import sys
import time

import jax

import dispatch_io as dio
from dispatch_io import policies
from job_states import JobState, matches

process, port, root, local, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
jax.distributed.initialize(f"127.0.0.1:{port}", 4, process)
mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
STATE = JobState(solo=os.environ.get("DIO_TEST_TIERS_SHARED") != "1")
LAST = 12   # loop modes: the last step


def update(x, step):
    """One training step of a leaf, elementwise (the same bits however it is sharded): x / 2 + step."""
    return x * x.dtype.type(0.5) + x.dtype.type(step) if x.dtype.kind == "f" else x * 3 + step


train_step = jax.jit(lambda state, step: {k: update(v, step) for k, v in state.items()}, static_argnums=1)
init = STATE.state_at(mesh, 0)


def trained(last):
    """The state after steps 0..last, uninterrupted, on the host (numpy)."""
    state = {name: STATE.value(name, 0) for name in STATE.specs}
    for step in range(last + 1):
        state = {k: update(v, step) for k, v in state.items()}
    return state


target = STATE.target(mesh)
tier = dio.LocalTier(local, save_policy=policies.EveryNSteps(2), keep_policy=policies.LatestN(3), promote=mode == "die")
dispatcher = dio.LocalDispatcher(checksums=True, barrier_timeout=float(os.environ.get("DIO_TEST_BARRIER_TIMEOUT", 30)))
with dio.CheckpointManager(root, dispatcher, save_policy=policies.EveryNSteps(6), local=tier) as mgr:
    if mode in ("train", "die"):
        for step in range(10 if mode == "train" else 11):
            print(f"step {step}", flush=True)
            if mgr.should_save(step):
                dies = mode == "die" and step == 10 and process == 1
                # SIGKILL from the IO thread, once the first leaf is copied: mid-save, before its commit
                mgr.save(step, STATE.state_at(mesh, step), on_transfer_end=(lambda _: os.kill(os.getpid(), 9)) if dies else None,
                         items={"cfg": dio.Json({"step": step})})
                try:
                    mgr.wait()
                except dio.BarrierTimeoutError as exc:   # MODE die: the job never agreed step 10 (process 1 died)
                    print(f"failed {step} processes {exc.processes}", flush=True)
                else:
                    print(f"saved {step}", flush=True)
        time.sleep(600)  # killed here
    if mode in ("loop", "loop9"):  # the README's loop, unchanged but for local=: resume from the newest whole step
        print(f"steps {mgr.steps()}", flush=True)
        step = mgr.latest_step()
        state = init
        if step is not None:
            state = mgr.restore(step, target)
            assert mgr.item(step, "cfg") == {"step": step}, mgr.item(step, "cfg")
            print(f"resumed {step} from root {mgr.last_tier_restore.bytes_read_persistent}", flush=True)
        for step in range(0 if step is None else step + 1, LAST + 1):
            state = train_step(state, step)
            if mgr.should_save(step):
                mgr.save(step, state, items={"cfg": dio.Json({"step": step})})
                mgr.wait()
            print(f"step {step}", flush=True)
            if mode == "loop9" and step == 9:
                time.sleep(600)  # killed here
        exact = matches(state, trained(LAST))
        print(f"final {LAST} exact {exact}", flush=True)
    if mode == "stall":  # process 3 never comes to the restore; the others must name it, not hang
        if process == 3:
            time.sleep(600)
        try:
            mgr.restore(None, target)
        except dio.BarrierTimeoutError as exc:
            print(f"timed out waiting for {exc.processes}", flush=True)
            time.sleep(600)  # killed here (the job is broken: no clean shutdown with process 3 gone)
    if mode in ("resume", "promote"):
        again = None
        for _ in range(2):  # two restores in a row: the same step, the same bytes
            restored = mgr.restore(None, target, verify=True)
            s = mgr.last_tier_restore
            exact = STATE.exact(restored, s.step)
            assert again is None or again == (s, exact), (again, s, exact)
            again = (s, exact)
        print(f"resumed {s.step} exact {exact} local {s.bytes_read_local} persistent {s.bytes_read_persistent} "
              f"received {s.bytes_received} peer_regions {s.peer_regions} persistent_regions {s.persistent_regions}",
              flush=True)
        if mode == "promote":
            written, exact = STATE.promoted(mgr, s.step, target)
            print(f"promoted {s.step} exact {exact} written {written} cfg {mgr.item(s.step, 'cfg')['step']}", flush=True)
print("done", flush=True)
dispatcher.close()
jax.distributed.shutdown()
