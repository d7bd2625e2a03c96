"""One process of a 2-process x 1-CPU-device job (run by tests/test_tier_retention.py): local saves
every 2 steps, kept by ``LocalTier(keep_policy=EveryNSeconds(100))``, each process's commit times 2 s
apart (process 0's clock 1 s behind, process 1's 1 s ahead: one save a little slower than the other).

    python job_local_retention.py PROCESS PORT ROOT LOCAL

Prints ``local steps [...]`` once steps 0..13 are saved (or ``refused: ...`` where the manager refuses the
tier: a build that refuses a clock-reading local keep policy in a multi-process job)."""

import sys

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io import policies

process, port, root, local = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", 2, process)
mesh = jax.make_mesh((2,), ("x",))
now = [0.0]
tier = dio.LocalTier(local, save_policy=policies.EveryNSteps(2), keep_policy=policies.EveryNSeconds(100))
dispatcher = dio.LocalDispatcher(barrier_timeout=30)
try:
    mgr = dio.CheckpointManager(root, dispatcher, save_policy=policies.EveryNSteps(1000), local=tier,
                                clock=lambda: now[0])
except ValueError as exc:   # a clock-reading local keep policy in a multi-process job: refused alike everywhere
    print(f"refused: {exc}", flush=True)
else:
    with mgr:
        for step in range(14):
            now[0] = 1000 + 10 * step + (1 if process == 1 else -1)
            if mgr.should_save(step):
                mgr.save(step, {"w": jax.make_array_from_callback(
                    (8, 4), NamedSharding(mesh, P("x")), lambda i, s=step: (np.arange(32.0).reshape(8, 4) + s)[i])})
                mgr.wait()
        print(f"local steps {mgr.local.steps()}", flush=True)
dispatcher.close()
jax.distributed.shutdown()
