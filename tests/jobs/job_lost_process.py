"""One process of a 4-process x 2-CPU-device pure-FSDP job that loses process 1 and goes on saving
(run by tests/test_tier_lost_process.py): the local tier must keep the newest step whole job-wide.

    python job_lost_process.py PROCESS PORT ROOT LOCAL MODE PHASE

MODE: the tier's redundancy -- ``neither``, ``replicas`` (``replicas=1``) or ``parity`` (``parity=2``);
``LocalTier(save_policy=EveryNSteps(2), keep_policy=LatestN(2))`` beside a root that saves step 0.

PHASE ``train``: steps 0..13, each local save waited for (``saved N``, or ``failed N <error type>
processes [...]: <message>`` where the save or its wait raised). At step 9 each process prints
``step 9`` and waits for the file ``ROOT/../go`` (the test SIGKILLs process 1 first); at the end it
prints ``local steps [...]``, ``durability {step: what its info.json says}`` and ``trained``, then waits to be
killed (a job with a dead process cannot shut down together).
PHASE ``rowsfail`` (MODE ``parity``, nobody killed): as ``train`` without the wait at step 9, but
process 2's parity rows of step 10 fail to save (a full disk, say); prints the same, then ``steps
{step: durability}`` (the job's listing), and ``promote 10 refused: <why>`` if ``mgr.promote(10)``
raises ValueError, and ends.
PHASE ``stall`` (nobody killed): as ``rowsfail``, but process 1 comes to its local save of step 4
only once the file ``ROOT/../go4`` exists, and reports its local save of step 8 (to the job's
agreement) only once ``ROOT/../go8`` does; the others, once they gave step N up, print ``gave up N``
and wait for ``goN`` too. Then it prints the same, restores step 0 (a rollback), saves step 4 again
and prints ``again 4 saved`` and ``steps {step: durability}``; then saves step 6, whose save fails on
process 2 alone (``first 6 failed <error type> processes [...]``, then ``policy saves 6 again: BOOL``),
forces it again (``save(local=True)``: ``again 6 saved``) and prints ``steps {step: durability}``; then
saves steps 8 and 10 with a PerProcess item, process 3's of step 8 no JSON (NaN): ``then N saved`` or
``then N failed <error type> processes [...]``, and ends.
PHASE ``diesaving``: as ``train``, but process 1 SIGKILLs itself once its local save of step 10
committed (its replicas sent and received), before it reports to the job's agreement; no wait at step 9.
PHASE ``resume``: prints ``latest N`` (``latest_step()``), restores it through the tiers and prints
``resumed STEP exact BOOL`` (bit for bit against the state of that step) and ``read local L received R``
(the bytes this process read from its local copy and received from peers).
"""

import json
import os
import sys
import time

import jax
from jax.experimental import multihost_utils

import dispatch_io as dio
from dispatch_io import policies
from job_states import JobState

process, port, root, local, mode, phase = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], \
    sys.argv[6]
jax.distributed.initialize(f"127.0.0.1:{port}", 4, process)
mesh = jax.make_mesh((8,), ("fsdp",))
STATE = JobState(keys=True)
tier = dio.LocalTier(local, save_policy=policies.EveryNSteps(2), keep_policy=policies.LatestN(2),
                     replicas=1 if mode == "replicas" else 0, parity=2 if mode == "parity" else 0,
                     domains=(0, 0, 1, 1))
dispatcher = dio.LocalDispatcher(checksums=True, barrier_timeout=float(os.environ.get("DIO_TEST_BARRIER_TIMEOUT", 30)))
mgr = dio.CheckpointManager(root, dispatcher, save_policy=policies.EveryNSteps(100), local=tier)
if phase == "rowsfail" and process == 2:
    save = dispatcher.save

    def failing_rows(path, *args, **kwargs):
        if path.endswith(os.path.join("10", "parity")):
            raise dio.CheckpointError(f"{path}: no space left (the test's)")
        return save(path, *args, **kwargs)
    dispatcher.save = failing_rows
ARMED = []   # phase stall, after the rollback: process 2's next local save of step 6 fails once
if phase == "stall" and process == 2:
    save_once = dispatcher.save

    def failing_once(path, *args, **kwargs):
        if ARMED and path.endswith(os.sep + "6"):
            ARMED.clear()
            raise ValueError(f"{path}: the test's failure")
        return save_once(path, *args, **kwargs)
    dispatcher.save = failing_once
go = os.path.join(os.path.dirname(os.path.abspath(root)), "go")
STALLS = {4: "begin", 8: "agree"}   # phase stall: where process 1 comes late, the others giving the step up first


def _wait_for(name):
    while not os.path.exists(go + name):
        time.sleep(0.05)


if phase == "stall" and process == 1:
    from dispatch_io.manager.tiers import job_steps

    def late(method):
        def called(self, step, *args):
            if STALLS.get(step) == method.__name__:
                _wait_for(str(step))
            return method(self, step, *args)
        return called
    job_steps.SaveAgreement.begin = late(job_steps.SaveAgreement.begin)
    job_steps.SaveAgreement.agree = late(job_steps.SaveAgreement.agree)
if phase == "diesaving" and process == 1:   # dies between its commit of step 10 and the job's agreement
    from dispatch_io.manager.tiers import job_steps
    agree = job_steps.SaveAgreement.agree

    def dying(self, step, *args):
        if step == 10:
            os.kill(os.getpid(), 9)
        return agree(self, step, *args)
    job_steps.SaveAgreement.agree = dying
if phase in ("train", "rowsfail", "stall", "diesaving"):
    for step in range(14):
        if step == 9 and phase == "train":
            print("step 9", flush=True)
            while not os.path.exists(go):
                time.sleep(0.05)
        if mgr.should_save(step):
            try:
                mgr.save(step, STATE.state_at(mesh, step))
                mgr.wait()
                print(f"saved {step}", flush=True)
            except Exception as exc:  # noqa: BLE001 - what the survivors see is what the test checks
                print(f"failed {step} {type(exc).__name__} processes {getattr(exc, 'processes', None)}: "
                      f"{str(exc).splitlines()[0]}", flush=True)
        if phase == "stall" and step in STALLS and process != 1:   # the job waits there for process 1
            print(f"gave up {step}", flush=True)
            _wait_for(str(step))
    print(f"local steps {mgr.local.steps()}", flush=True)
    infos = mgr.local.infos()[0]
    print(f"durability {json.dumps({s: i.get('durability') for s, i in sorted(infos.items())})}", flush=True)
    print("trained", flush=True)
    if phase in ("train", "diesaving"):
        time.sleep(600)   # killed here
    print(f"steps {mgr.steps()}", flush=True)
    if phase == "rowsfail":   # step 10 was never agreed whole: not promoted
        try:
            mgr.promote(10)
        except ValueError as exc:
            print(f"promote 10 refused: {exc}", flush=True)
    if phase == "stall":   # a rollback: step 4 saved again, asked afresh (its first save was given up)
        mgr.restore(0, STATE.target(mesh))
        mgr.save(4, STATE.state_at(mesh, 4))
        mgr.wait()
        print("again 4 saved", flush=True)
        print(f"steps {mgr.steps()}", flush=True)
        ARMED.append(True)
        for attempt in ("first", "again"):   # fails on process 2 alone, then is tried again: asked afresh
            try:
                mgr.save(6, STATE.state_at(mesh, 6), **({"local": True} if attempt == "again" else {}))
                mgr.wait()
                print(f"{attempt} 6 saved", flush=True)
            except Exception as exc:  # noqa: BLE001 - what each process sees is what the test checks
                print(f"{attempt} 6 failed {type(exc).__name__} processes {getattr(exc, 'processes', None)}",
                      flush=True)
                print(f"policy saves 6 again: {mgr.should_save(6)}", flush=True)   # one answer everywhere
        print(f"steps {mgr.steps()}", flush=True)
        for step in (8, 10):   # process 3's item of step 8 is no JSON: it fails before its local save even begins
            value = float("nan") if step == 8 and process == 3 else step
            try:
                mgr.save(step, STATE.state_at(mesh, step), items={"data": dio.PerProcess(value)})
                mgr.wait()
                print(f"then {step} saved", flush=True)
            except Exception as exc:  # noqa: BLE001 - what each process sees is what the test checks
                print(f"then {step} failed {type(exc).__name__} processes {getattr(exc, 'processes', None)}", flush=True)
            # a training step's collective: process 3, failing at once, does not run a barrier timeout ahead
            multihost_utils.sync_global_devices(f"trained past {step}")
    mgr.close()
    dispatcher.close()
    jax.distributed.shutdown()
    sys.exit(0)
latest = mgr.latest_step()
print(f"latest {latest}", flush=True)
restored = mgr.restore(None, STATE.target(mesh))
stats = mgr.last_tier_restore
step = stats.step
print(f"resumed {step} exact {STATE.exact(restored, step)}", flush=True)
print(f"read local {stats.bytes_read_local} received {stats.bytes_received}", flush=True)
mgr.close()
dispatcher.close()
jax.distributed.shutdown()
