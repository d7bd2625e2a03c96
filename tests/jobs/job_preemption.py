"""One process of a multi-process CheckpointManager job (run by tests/test_manager_multiprocess.py).

    python job_preemption.py PROCESS_ID NUM_PROCESSES PORT ROOT STEPS CLOCK_SKEW

Trains a toy state (a global array over one CPU device per process) with a save policy that
reads the clock (every 0.5 s, this process's clock skewed by CLOCK_SKEW seconds) and
Preemption(); prints ``step N``, ``saved N`` and, when preempted, ``preempted N``. Resumes from
the latest step (printing ``resumed N`` and this process's item).
"""

import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io import policies

process, processes, port, root, steps, skew = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], \
    int(sys.argv[5]), float(sys.argv[6])
jax.distributed.initialize(f"127.0.0.1:{port}", processes, process)
mesh = jax.make_mesh((processes,), ("data",))
sharding = NamedSharding(mesh, P("data"))


def state_at(step):
    return jax.make_array_from_callback((processes * 4,), sharding,
                                        lambda index: (np.arange(processes * 4, dtype=np.float32) + step)[index])


with dio.CheckpointManager(root, save_policy=policies.EveryNSeconds(0.5) | policies.Preemption(),
                           barrier_timeout=30, clock=lambda: time.time() + skew) as mgr:
    start = mgr.latest_step()
    if start is not None:
        restored = mgr.restore(start, target=jax.ShapeDtypeStruct((processes * 4,), np.float32, sharding=sharding))
        ok = all(np.array_equal(np.asarray(s.data), np.asarray(state_at(start).addressable_data(0)))
                 for s in restored.addressable_shards)
        print(f"resumed {start} item {mgr.item(start, 'data').decode()} exact {ok}", flush=True)
    step = 0 if start is None else start + 1
    while step < steps:
        time.sleep(0.1)
        print(f"step {step}", flush=True)
        if mgr.should_save(step):
            mgr.save(step, state_at(step), items={"data": dio.PerProcess(f"p{process}-s{step}".encode())})
            print(f"saved {step}", flush=True)
        if mgr.reached_preemption(step):
            mgr.wait()
            print(f"preempted {step}", flush=True)
            break
        step += 1
print("done", flush=True)
jax.distributed.shutdown()
