"""One process of a 4-process x 2-CPU-device pure-FSDP job (run by tests/test_tier_incremental_copies.py):
a LoRA-shaped state -- a frozen base sharded over the 8 devices, a small frozen leaf on process 0's devices
alone, small adapters that change every step --
saved every step to a local tier kept safe by replicas or parity, with ``CheckpointManager(incremental=True)``.

    python job_local_incremental_copies.py PROCESS PORT ROOT LOCAL MODE PHASE

MODE: ``replicas`` (``LocalTier(replicas=1)``) or ``parity`` (``parity=2``); ``keep_policy=LatestN(2)``,
``promote=True``, each process in its own directory (``LOCAL`` has ``{process}``); the root saves step 4
alone (``EveryNSteps(4)``), by promotion of its local copies.
PHASE ``train``: steps 1..6, each waited for; prints ``steps [...]`` (the step folders in this process's
directory, retired ones too), ``references {step: [steps it references]}`` of its kept steps and
``root 4 exact BOOL verified BOOL`` (the root's step 4 restored with the dispatcher, bit for bit, and
every chunk checked against its CRC-32C).
PHASE ``resume``: restores the newest step through the tiers, checking CRC-32Cs (the test deleted a
process's directory first); prints ``resumed STEP exact BOOL persistent REGIONS BYTES`` (bit for bit against the state
saved at that step; the regions and bytes read from the root); then saves step 7 and prints ``then 7
references [...] exact BOOL`` (the steps its manifest references; its restore through the tiers, bit for bit).
"""

import json
import os
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io import policies

process, port, root, local, mode, phase = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], \
    sys.argv[6]
jax.distributed.initialize(f"127.0.0.1:{port}", 4, process)
mesh = jax.make_mesh((8,), ("fsdp",))
BASE = np.random.default_rng(0).standard_normal((1024, 256)).astype(np.float32)   # 1 MiB: 256 KiB a process
SOLO = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)      # 8 KiB


def sharded(value, spec):
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda i: value[i])


def solo():   # a frozen leaf on process 0's devices alone: saved whole (one chunk), kept by a peer as a copy
    devices = np.array([d for d in jax.devices() if d.process_index == 0])
    return jax.make_array_from_callback(SOLO.shape, NamedSharding(Mesh(devices, ("x",)), P("x")), lambda i: SOLO[i],
                                        dtype=SOLO.dtype)


def state(step):
    return {"base": sharded(BASE, P("fsdp", None)), "solo": solo(),
            "lora": {"a": sharded(np.full((1024, 8), step, np.float32), P("fsdp", None)),
                     "b": sharded(np.full((8, 256), -step, np.float32), P(None, "fsdp"))}}


def exact(restored, step):
    return all(np.array_equal(np.asarray(x.addressable_shards[i].data), np.asarray(y.addressable_shards[i].data))
               and x.addressable_shards[i].index == y.addressable_shards[i].index
               for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state(step)))
               for i in range(len(x.addressable_shards)))


def target():
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state(0))


tier = dio.LocalTier(local, save_policy=policies.EveryNSteps(1), keep_policy=policies.LatestN(2),
                     replicas=1 if mode == "replicas" else 0, parity=2 if mode == "parity" else 0,
                     domains=(0, 0, 1, 1), promote=True)
with dio.LocalDispatcher(barrier_timeout=60, checksums=True) as dispatcher, \
        dio.CheckpointManager(root, dispatcher, save_policy=policies.EveryNSteps(4), local=tier,
                              incremental=True) as mgr:
    mine = local.replace("{process}", str(process))
    if phase == "train":
        frozen = {k: v for k, v in state(1).items() if k != "lora"}   # the same jax.Arrays, as frozen parameters are
        for step in range(1, 7):
            mgr.save(step, {**state(step), **frozen})
            mgr.wait()
        refs = {}
        for step in mgr.local.steps():
            with open(os.path.join(mine, str(step), "manifest.json")) as f:
                refs[step] = sorted(int(r["step"]) for r in json.load(f).get("references", []))
        print(f"steps {sorted(int(s) for s in os.listdir(mine))}", flush=True)
        print(f"references {json.dumps(refs)}", flush=True)
        promoted = dispatcher.restore(os.path.join(root, "4"), target())
        print(f"root 4 exact {exact(promoted, 4)} verified {dispatcher.verify(os.path.join(root, '4')).verified}",
              flush=True)
    else:
        restored = mgr.restore(None, target(), verify=True)
        stats = mgr.last_tier_restore
        print(f"resumed {stats.step} exact {exact(restored, stats.step)} persistent {stats.persistent_regions} "
              f"{stats.bytes_read_persistent}", flush=True)
        mgr.save(7, {**state(7), "base": restored["base"]})   # the job goes on: incremental against what is left
        mgr.wait()
        with open(os.path.join(mine, "7", "manifest.json")) as f:
            print(f"then 7 references {sorted(int(r['step']) for r in json.load(f).get('references', []))} exact "
                  f"{exact(mgr.restore(7, target()), 7)}", flush=True)
jax.distributed.shutdown()
