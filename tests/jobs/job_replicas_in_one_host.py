"""One process of a 4-process x 2-CPU-device job (run by tests/test_tier_multiprocess.py) whose data
parallelism stays within a host: hosts ``domains=(0, 0, 1, 1)``; mesh (fsdp=2, data=2, model=2)
laid out host, process in host, device in process, so each region of ``w`` (sharded over fsdp and
model, replicated over data) is held by the two processes of one host.

    python job_replicas_in_one_host.py PROCESS PORT ROOT LOCAL MODE

MODE ``save``: one local save (step 2) with ``LocalTier(replicas=1, domains=(0, 0, 1, 1))``;
prints ``saved 2 copies C domains D``. MODE ``resume``: restores through the tiers and prints
``resumed STEP exact BOOL``, or ``missing ERROR`` if no step holds every region.
"""

import os
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io import policies

process, port, root, local, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
jax.distributed.initialize(f"127.0.0.1:{port}", 4, process)
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
mesh = Mesh(np.array(devices).reshape(2, 2, 2), ("fsdp", "data", "model"))
sharding = NamedSharding(mesh, P(("fsdp", "model")))
VALUES = {"w": np.arange(16 * 8, dtype=np.float32).reshape(16, 8) * 3 + 1}
target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in VALUES.items()}
tier = dio.LocalTier(local, save_policy=policies.EveryNSteps(2), replicas=1, domains=(0, 0, 1, 1))
dispatcher = dio.LocalDispatcher(barrier_timeout=float(os.environ.get("DIO_TEST_BARRIER_TIMEOUT", 30)))
with dio.CheckpointManager(root, dispatcher, save_policy=policies.EveryNSteps(1000), local=tier) as mgr:
    if mode == "save":
        state = {k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i]) for k, v in VALUES.items()}
        mgr.save(2, state)
        mgr.wait()
        info = mgr.local.infos()[0][2]
        print(f"saved 2 copies {info['copies']} domains {info['domains']}", flush=True)
    else:
        try:
            restored = mgr.restore(None, target)
        except FileNotFoundError as exc:
            print(f"missing {exc}", flush=True)
        else:
            exact = all(np.asarray(s.data).tobytes() == VALUES[k][s.index].tobytes()
                        for k, array in restored.items() for s in array.addressable_shards)
            print(f"resumed {mgr.last_tier_restore.step} exact {exact}", flush=True)
dispatcher.close()
