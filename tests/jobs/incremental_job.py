"""One process of a 2-process incremental job (run by tests/test_incremental_processes.py).

    python incremental_job.py PROCESS_ID NUM_PROCESSES PORT ROOT

Saves 4 steps of a state sharded over one CPU device per process through
``CheckpointManager(incremental=True, keep_policy=LatestN(2))``: ``frozen`` never changes,
``half`` changes only in process 1's rows at odd steps, ``moving`` at every step. Prints
``wrote STEP BYTES`` (this process's bytes written) and, after the run, ``exact STEP True|False``
for the two kept steps restored.
"""

import sys

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io import policies

process, processes, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", processes, process)
mesh = jax.make_mesh((processes,), ("data",))
sharding = NamedSharding(mesh, P("data"))
ROWS = 64 * processes


def global_array(values):
    return jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])


def host_state(step):
    rng = np.random.default_rng(0)
    frozen = rng.standard_normal((ROWS, 256), dtype=np.float32)
    half = rng.standard_normal((ROWS, 256), dtype=np.float32)
    half[ROWS // 2:] += (step + 1) // 2          # process 1's rows: changed at odd steps
    moving = rng.standard_normal((ROWS, 128), dtype=np.float32) + step
    return {"frozen": frozen, "half": half, "moving": moving}


dispatcher = dio.LocalDispatcher(16 << 20, max_chunk_bytes=16 << 10, small_leaf_bytes=0, checksums=True,
                                 progress=False, barrier_timeout=60)
with dio.CheckpointManager(root, dispatcher, keep_policy=policies.LatestN(2), incremental=True) as mgr:
    frozen = global_array(host_state(0)["frozen"])
    for step in range(4):
        state = {**{k: global_array(v) for k, v in host_state(step).items()}, "frozen": frozen}
        print(f"wrote {step} {mgr.save(step, state).wait().bytes_written}", flush=True)
        mgr.wait()
    for step in (2, 3):  # the two kept (process 0's retention may still be running: all_steps() can differ)
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in host_state(step).items()}
        restored = mgr.restore(step, target=target)
        expected = host_state(step)
        ok = all(np.array_equal(np.asarray(s.data), expected[k][s.index]) for k in expected
                 for s in restored[k].addressable_shards)
        dispatcher.verify(mgr.step_path(step))
        print(f"exact {step} {ok}", flush=True)
jax.distributed.shutdown()
