"""Save and restore a sharded train state from several JAX processes (``jax.distributed``).

    python examples/multiprocess_save.py [CHECKPOINT_DIR]    # default: ./demo_ckpt/multiprocess

This demo runs a two-process job on one machine: it starts itself twice (process ids 0 and 1),
each process with 4 simulated CPU devices, so the (4, 2) ('data', 'model') mesh spans both.

On a real cluster, run the same program on every host, each with its own process id and the
address of process 0 (the coordinator)::

    python examples/multiprocess_save.py CKPT --coordinator host0:1234 --num-processes 8 --process-id $RANK

which calls ``jax.distributed.initialize("host0:1234", num_processes=8, process_id=RANK)``
before anything else touches JAX (on Cloud TPU, SLURM, Open MPI or Kubernetes JobSets a bare
``jax.distributed.initialize()`` finds these itself). The checkpoint directory must be storage
that every host sees (a shared file system, or an object store URL).

What each process does -- the same calls as in a single-process program:

* builds the state as *global* arrays (here with ``jax.jit(..., out_shardings=...)``; arrays
  created without a sharding live on one process only and must not be saved this way);
* ``dio.LocalDispatcher(...).save(path, state).wait()``: every process writes only the shards it
  holds, replicated arrays are split between the processes that hold them, numpy leaves and Python
  scalars are written by process 0, and process 0 commits once every process has succeeded.
  A failure anywhere makes ``wait()`` raise on every process, and nothing is committed; a process
  that stops making progress for ``barrier_timeout`` seconds makes the others raise
  ``dio.BarrierTimeoutError`` naming it;
* ``dispatcher.restore(path, target)`` reads only the shards this process needs.
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dispatch_io as dio

DEVICES_PER_PROCESS = 4


def launch_local_job(path: str, num_processes: int = 2) -> int:
    """Start ``num_processes`` copies of this script on this machine and wait for them."""
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join([f for f in env.get("XLA_FLAGS", "").split()
                                 if "xla_force_host_platform_device_count" not in f]
                                + [f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"])
    logs = [tempfile.TemporaryFile("w+") for _ in range(num_processes)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), path, "--coordinator", coordinator,
                               "--num-processes", str(num_processes), "--process-id", str(i)],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
             for i, log in enumerate(logs)]
    try:
        codes = [proc.wait(timeout=240) for proc in procs]
    finally:
        for proc in procs:  # none is left behind, e.g. hanging because its peer died
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for i, log in enumerate(logs):
            log.seek(0)
            print("".join(f"[process {i}] {line}" for line in log), end="")
    if any(codes):
        print(f"FAILED: exit codes {codes}")
        return 1
    print("OK")
    return 0


def stored(leaf):
    """What a checkpoint stores for an array leaf: PRNG keys as their key data."""
    return jax.random.key_data(leaf) if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf


def run_process(path: str, coordinator: str, num_processes: int, process_id: int):
    """One process of the job: the program every host runs."""
    # First, before any other JAX call: join the job.
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)

    # A mesh over the devices of *all* processes; each process holds some shards of every array.
    mesh = jax.make_mesh((jax.device_count() // 2, 2), ("data", "model"))
    shardings = {
        "params": {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", None), "b2": P()},
        "rng": P(),
    }

    def init(key):
        k1, k2, rng = jax.random.split(key, 3)
        params = {"w1": jax.random.normal(k1, (512, 256)) / 16, "b1": jnp.zeros(256, jnp.bfloat16),
                  "w2": jax.random.normal(k2, (256, 64)) / 16, "b2": jnp.zeros(64)}
        return {"params": params, "rng": rng}

    out_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), shardings)
    state = jax.jit(init, out_shardings=out_shardings)(jax.random.key(0))
    state["opt_state"] = {"mu": jax.tree.map(jnp.zeros_like, state["params"]), "count": 0}
    state["step"] = 1000                                 # Python scalars: saved by process 0
    state["data_order"] = np.arange(16, dtype=np.int32)  # numpy leaves too (the same on every process)

    with dio.LocalDispatcher(host_memory_budget=64 << 20, barrier_timeout=60) as dispatcher:
        stats = dispatcher.save(path, state, overwrite=True).wait()  # every process calls it
        total = sum(stored(leaf).nbytes for leaf in jax.tree.leaves(state) if hasattr(leaf, "dtype"))
        print(f"process {process_id} of {num_processes}: {len(jax.local_devices())} local devices of "
              f"{jax.device_count()}; wrote {stats.bytes_written} of the checkpoint's {total} bytes "
              f"in {stats.total_seconds * 1000:.0f} ms")

        # Restore onto the same shardings: the state itself can serve as the target (or
        # ShapeDtypeStructs with shardings, e.g. from jax.eval_shape, without any state in memory).
        restored = dispatcher.restore(path, state)

    def local_bytes(x):
        x = stored(x)
        if isinstance(x, np.ndarray):
            return [x.tobytes()]
        return [np.asarray(shard.data).tobytes() for shard in x.addressable_shards]

    same = jax.tree.map(lambda a, b: local_bytes(a) == local_bytes(b) if hasattr(a, "dtype") else a == b,
                        state, restored)
    if not all(jax.tree.leaves(same)):
        raise SystemExit(f"process {process_id}: restored state differs: {same}")
    print(f"process {process_id}: restored {len(jax.tree.leaves(restored))} leaves; "
          f"every local shard is bit-exact")
    jax.distributed.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", nargs="?", default="./demo_ckpt/multiprocess")
    parser.add_argument("--coordinator", help="host:port of process 0 (omit to launch a local 2-process demo)")
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--process-id", type=int)
    args = parser.parse_args()
    if args.process_id is None:
        sys.exit(launch_local_job(os.path.abspath(args.path), args.num_processes))
    run_process(args.path, args.coordinator, args.num_processes, args.process_id)


if __name__ == "__main__":
    main()
