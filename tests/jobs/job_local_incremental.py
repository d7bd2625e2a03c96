"""One process of a 2-process x 1-CPU-device job (run by tests/test_tier_incremental.py): a LoRA-shaped
state (a frozen base sharded over both processes, small adapters that change every step) saved every
step to a local tier with ``CheckpointManager(incremental=True)``, each process in its own directory.

    python job_local_incremental.py PROCESS PORT ROOT LOCAL

Prints ``stored <bytes under this process's local directory> steps [...] exact <bool>`` after step 7
(``exact``: the restore of local step 7 through the tiers equals what was saved)."""

import os
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io import policies

process, port, root, local = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", 2, process)
mesh = jax.make_mesh((2,), ("x",))
BASE = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)   # 2 MiB: 1 MiB a process


def sharded(value):
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, P("x")), lambda i: value[i])


def state(step):
    return {"base": sharded(BASE), "lora": {"a": sharded(np.full((512, 8), step, np.float32)),
                                            "b": sharded(np.full((8, 1024), -step, np.float32))}}


tier = dio.LocalTier(local, save_policy=policies.EveryNSteps(1), keep_policy=policies.LatestN(2))
with dio.LocalDispatcher(barrier_timeout=60, checksums=True) as dispatcher, \
        dio.CheckpointManager(root, dispatcher, save_policy=policies.EveryNSteps(1000), local=tier,
                              incremental=True) as mgr:
    for step in range(1, 8):
        mgr.save(step, state(step))
        mgr.wait()
    restored = mgr.restore(7, state(0))
    exact = all(np.array_equal(np.asarray(x.addressable_shards[0].data), np.asarray(y.addressable_shards[0].data))
                for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state(7))))
    mine = local.replace("{process}", str(process))
    stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(mine) for f in files)
    print(f"stored {stored} steps {sorted(os.listdir(mine))} exact {exact}", flush=True)
jax.distributed.shutdown()
