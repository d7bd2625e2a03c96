"""One process of a 4-process x 2-CPU-device pure-FSDP job whose local tier keeps one replica
(run by tests/test_tier_multiprocess.py, and with parity by tests/test_tier_parity.py).

    python job_fsdp_replicas.py PROCESS PORT ROOT LOCAL MODE

Mesh (fsdp=8): every region of w, m and k is held by one process; s by process 0 alone; b by
all. ``LocalTier(replicas=1, domains=(0, 0, 1, 1))``: processes 0, 1 share a host, as do 2, 3,
so the replicas of what process p holds go to the other host, spread leaf by leaf over its two
processes (``replica_plan.assign_variants``): big to (p + 2) % 4, w, m, k and s to 3 - p.

MODE ``train``: steps 0..9, local saves every 2 steps, persistent every 6 (each waited for);
prints ``saved N`` and, at step 9, waits to be killed. MODE ``resume``: restores through the
tiers (twice) and prints ``resumed STEP exact BOOL local L persistent P received R rchar C`` (C: bytes the
second restore read, from ``/proc/self/io``); MODE ``reshard``
likewise onto another mesh, (data=2, fsdp=4): each of its regions is two saved regions; MODE ``narrow``
onto the first device of each process (fsdp=4): each of its regions is the two its process saved; MODE
``reversed`` onto the devices in reverse order: each process's regions are another process's. MODE
``clock``: local saves by ``EveryNSeconds(25)`` with clocks that disagree (process 1's twice as
fast); prints ``local steps [...]``. MODE ``promote``: as
``resume``, then promotes that step to the root and restores it from there: ``promoted STEP exact BOOL written W``.

With ``DIO_TEST_PARITY=K`` the tier keeps parity of groups of K instead of the replica
(``LocalTier(parity=K)``); with ``DIO_TEST_DURABILITY`` its restores require that durability; ``resume`` then first prints ``steps {step: durability}`` (the job's
listing, ``mgr.steps()``) and after the restore ``regions peer P persistent Q`` (TierRestoreStats).
With ``DIO_TEST_CAST`` the restores read ``w`` as bfloat16 and ``m`` as float32 (``cast=True``), compared
with the values cast; with ``DIO_TEST_NAMES`` the target's leaves are named in upper case and read
through ``names=`` (the saved name: the lower case). With ``DIO_TEST_SLOW_OWN_READS=S`` each region a
pass reads of a process's own copy is a batch of its own, the first four landing S seconds late each
(a slow disk: a pass 4 S seconds long); with
``DIO_TEST_SLOW_OWN_READS_IN=P`` only process P's are; with
``DIO_TEST_FAILING_OWN_READS=P`` those reads fail in process P (an OSError: its disk failed).
"""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import dispatch_io as dio
from dispatch_io import policies
from job_states import JobState

process, port, root, local, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
jax.distributed.initialize(f"127.0.0.1:{port}", 4, process)
mesh = jax.make_mesh((8,), ("fsdp",))
now = [0.0]   # MODE clock: each process's clock, at 10 s a step -- process 1's runs twice as fast
local_policy = policies.EveryNSeconds(25) if mode == "clock" else policies.EveryNSteps(2)
parity = int(os.environ.get("DIO_TEST_PARITY", 0))
if "DIO_TEST_ROW_BYTES" in os.environ:   # small rows: a local save's parity spans several row groups
    from dispatch_io.manager.tiers import packed_rows
    packed_rows.ROW_BYTES = int(os.environ["DIO_TEST_ROW_BYTES"])
STATE = JobState(keys=True, big=not parity)   # big: bytes read measurable (replicas); parity's tests count small leaves
targets = {"reshard": jax.make_mesh((2, 4), ("data", "fsdp")),   # each process's first device alone:
           "narrow": Mesh(np.array([min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                                    for p in range(4)]), ("fsdp",)),
           "reversed": Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)[::-1]), ("fsdp",))}
target = STATE.target(targets.get(mode, mesh))
CAST = {"w": jnp.bfloat16, "m": np.float32} if os.environ.get("DIO_TEST_CAST") else {}   # restored with cast=True
target = {name: jax.ShapeDtypeStruct(t.shape, CAST.get(name, t.dtype), sharding=t.sharding) for name, t in target.items()}
NAMES = bool(os.environ.get("DIO_TEST_NAMES"))   # the target's leaves renamed (upper case), read through names=
if os.environ.get("DIO_TEST_SLOW_OWN_READS"):   # each region a pass reads of the process's own copy lands late
    from dispatch_io.read import loop

    def _apart(init):
        def made(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if self.check is not None:   # a pass's own reads (checked), not a lost process's placing
                self.batches = [[work] for batch in self.batches for work in batch]
        return made

    slowed = []

    def _late(consume):
        def consumed(self, batch, arrays):
            if self.check is not None and os.environ.get("DIO_TEST_SLOW_OWN_READS_IN", str(process)) == str(process) \
                    and len(slowed) < 4:
                slowed.append(batch)
                time.sleep(float(os.environ["DIO_TEST_SLOW_OWN_READS"]))
            return consume(self, batch, arrays)
        return consumed

    loop.RegionReads.__init__, loop.RegionReads.consume = _apart(loop.RegionReads.__init__), \
        _late(loop.RegionReads.consume)
if os.environ.get("DIO_TEST_FAILING_OWN_READS") == str(process):   # its disk fails under a pass's own reads
    import concurrent.futures

    from dispatch_io.read import loop

    def _failing(submit):
        def submitted(self, batch):
            if self.check is None or not batch:
                return submit(self, batch)
            failed = concurrent.futures.Future()
            failed.set_exception(OSError(f"process {process}'s disk failed"))
            return failed
        return submitted

    loop.RegionReads.submit = _failing(loop.RegionReads.submit)
if NAMES:
    target = {name.upper(): t for name, t in target.items()}
tier = dio.LocalTier(local, save_policy=local_policy, replicas=0 if parity else 1, parity=parity, domains=(0, 0, 1, 1))
dispatcher = dio.LocalDispatcher(checksums=True, barrier_timeout=float(os.environ.get("DIO_TEST_BARRIER_TIMEOUT", 30)))
with dio.CheckpointManager(root, dispatcher, save_policy=policies.EveryNSteps(6), local=tier,
                           clock=lambda: now[0]) as mgr:
    if mode == "clock":   # a clock-reading local policy with replicas: process 0 decides for every process
        for step in range(12):
            now[0] = 1e9 + step * (20 if process == 1 else 10)
            if mgr.should_save(step):
                mgr.save(step, STATE.state_at(mesh, step))
        mgr.wait()
        print(f"local steps {mgr.local.steps()}", flush=True)
        time.sleep(600)  # killed here (job_fsdp_replicas's clock mode ends here)
    if mode == "train":
        for step in range(10):
            print(f"step {step}", flush=True)
            if mgr.should_save(step):
                mgr.save(step, STATE.state_at(mesh, step))
                mgr.wait()
                print(f"saved {step}", flush=True)
        time.sleep(600)  # killed here
    if parity:
        print(f"steps {mgr.steps()}", flush=True)
    for _ in range(2):  # the second restore's bytes read from /proc/self/io (the first reads modules as well)
        with open("/proc/self/io") as f:
            rchar = -int(dict(line.split(": ") for line in f.read().splitlines())["rchar"])
        restored = mgr.restore(None, target, durability=os.environ.get("DIO_TEST_DURABILITY", "local"),
                               **({"cast": True} if CAST else {}),
                               **({"names": lambda path: path[0].key.lower()} if NAMES else {}))
        restored = {name.lower(): leaf for name, leaf in restored.items()}
        with open("/proc/self/io") as f:
            rchar += int(dict(line.split(": ") for line in f.read().splitlines())["rchar"])
    s = mgr.last_tier_restore
    exact = STATE.exact(restored, s.step, CAST)
    print(f"resumed {s.step} exact {exact} local {s.bytes_read_local} persistent {s.bytes_read_persistent} "
          f"received {s.bytes_received} rchar {rchar}", flush=True)
    if parity:
        print(f"regions peer {s.peer_regions} persistent {s.persistent_regions}", flush=True)
    if mode == "promote":  # from the copies that survive, replicas included
        written, exact = STATE.promoted(mgr, s.step, target)
        print(f"promoted {s.step} exact {exact} written {written}", flush=True)
print("done", flush=True)
dispatcher.close()
jax.distributed.shutdown()
