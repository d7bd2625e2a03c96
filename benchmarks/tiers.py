"""Multi-tier benchmark: a real multi-process job with a local tier beside a persistent root.

    python benchmarks/tiers.py --mib 1024 --reps 3 [--mesh 2,4] [--replicas 0 | --parity K] [--priority sync]
        [--root-store gcs]     # the persistent root on the tests' GCS server on loopback, not a directory

A ``jax.distributed`` job of ``--processes`` processes x 2 CPU devices on this machine, mesh
(data, fsdp) (``--mesh``; default 2,4: each region is held by the 2 processes of its data
replica group), a deterministic state of ``--mib`` MiB (``--large`` large float32 matrices, default 4,
alternately sharded by rows and by columns, plus small sharded and replicated leaves and a step). Per repetition,
interleaved (the first of each pair alternates), every process lined up on the coordination
service before each timed call (after one untimed save of each kind):

1. **save**: ``mgr.save(step, state, local=True)`` (the local tier only: each process writes the
   regions its devices hold and commits alone) against ``mgr.save(step, state, local=False,
   force=True)`` (the persistent root only: every region once, one job-wide commit). "blocked"
   is the time inside ``save()``, "wall" until ``mgr.wait()`` returns (committed).
2. **restore**: a step saved in both tiers; every process opens a new manager and restores
   ``mgr.restore(None, target)`` through the tiers (own copies, peers' copies, the root only for
   regions no process kept) with every local copy there, then with process 1's local directory
   gone (moved away, put back after), against the same call with an empty local tier
   (everything from the root); the order rotates per repetition. Saved with checksums (unless
   ``--no-checksums``), so a restore through the tiers first checks each process's newest local
   step against its CRC-32Cs (a read of the copy), as it always does. Page cache dropped before
   each (cold; needs root), every restored shard compared with the saved state, the bytes per
   source of ``mgr.last_tier_restore`` summed over the processes.
3. **storage**: ``du`` of each process's local step and of the persistent step.
4. **moving bytes** (this machine's limit, before the restores): 32 MiB rows sent from process 2
   to process 1 the way a restore after a lost process sends them (``rows.Sender``, gloo on CPU),
   each side's CPU per MiB; with the lost restore's received bytes, what moving them alone adds to
   a healthy restore's CPU -- on cores the processes share, the lost restore cannot beat that ratio.

``--replicas N`` passes ``replicas=N`` and ``domains=`` (``--domains``; default: hosts of 2
processes, 0,0,1,1, so process 1's copies go to the other host) to ``LocalTier``, only when N > 0;
a build that refuses them is reported and nothing is run. ``--parity K`` passes ``parity=K``
(and ``domains=``) instead: with ``--mesh 1,8`` (pure FSDP, every region on one process) it
compares the storage, save and restore after a lost process of parity with ``--replicas 1``
(parity needs K + 1 processes: K = 4 needs ``--processes 5``). The processes share this machine's
disk and cores, so the local tier's advantage of independent disks per host does not show here:
the bytes per source are what carries over to a cluster, the seconds are this machine's. A
restore's "CPU s" is every process's CPU time in it (``time.process_time``: all its threads)
summed, and the busiest process's: with fewer cores than processes, a restore that needs more CPU
cannot take less wall time than its CPU over the cores, whatever it overlaps; on hosts of their
own, each process's work is done on its own cores. Raw per-process results go to stdout as JSON
lines, medians [min-max] over the repetitions (wall: the slowest process's) as Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

import harness
from harness import ROOT, MiB, free_port, interleaved, results_of
from harness import median_range as _median

COLS = 4096  # columns of the large matrices


def leaf_specs(mib: int, large: int = 4) -> dict:
    """{name: (shape, dtype, partition spec as a tuple)} of a state of about ``mib`` MiB, in ``large``
    large matrices (alternately sharded by rows and by columns) and small leaves."""
    small = {f"norm{i}": ((COLS,), "float32", ()) for i in range(8)}                     # replicated, 16 KiB
    small |= {f"emb{i}": ((512, 256), "float32", ("fsdp", None)) for i in range(8)}      # sharded, 512 KiB
    small["step"] = ((), "int32", ())
    rows = max(64, (mib * MiB - 8 * 512 * 1024) // large // (COLS * 4) // 64 * 64)
    matrices = {f"layer{i}/w": (((rows, COLS), "float32", ("fsdp", None)) if i % 2 == 0 else
                                ((COLS, rows), "float32", (None, "fsdp"))) for i in range(large)}
    return matrices | small


def value(seed: int, shape, index, dtype):
    """The deterministic value of a leaf's region ``index``: exact small integers, distinct per leaf."""
    import numpy as np
    if not shape:
        return np.asarray(seed, dtype)
    grids = np.ix_(*[np.arange(n)[i] for n, i in zip(shape, index)])
    flat = grids[0].astype(np.int64) * (shape[1] if len(shape) > 1 else 1) + (grids[1] if len(shape) > 1 else 0)
    return ((flat * 7 + seed * 1009) % 1000003).astype(dtype)


def child(args):
    """One process: the save pairs of every repetition, the storage, the restore pairs."""
    import jax

    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.processes, process_id=args.pid)
    import numpy as np
    from jax._src.distributed import global_state
    from jax.sharding import NamedSharding, PartitionSpec as P

    import dispatch_io as dio
    from dispatch_io import policies

    def sync(name, drop=False):
        """Line every process up; with ``drop``, process 0 drops the page cache first (root only)."""
        if drop and args.pid == 0:
            harness.drop_caches()
        global_state.client.wait_at_barrier(f"bench/{name}", 600_000)

    def emit(**result):
        harness.emit(process=args.pid, **result)

    data, fsdp = args.mesh
    mesh = jax.make_mesh((data, fsdp), ("data", "fsdp"))
    specs = leaf_specs(args.mib, args.large)
    shardings = {name: NamedSharding(mesh, P(*spec)) for name, (_, _, spec) in specs.items()}
    state = {name: jax.make_array_from_callback(shape, shardings[name],
                                                lambda i, s=seed, sh=shape, d=dtype: value(s, sh, i, d))
             for seed, (name, (shape, dtype, _)) in enumerate(specs.items())}
    target = {name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for name, a in state.items()}
    dispatcher = dio.LocalDispatcher(checksums=args.checksums, host_memory_budget=args.budget_mib * MiB,
                                     barrier_timeout=600, progress=False)
    local_path = os.path.join(args.local_dir, "{process}")
    root = args.root_url or os.path.join(args.dir, "root")
    extra = {"replicas": args.replicas, "domains": args.domains} if args.replicas > 0 else {}
    extra = {"parity": args.parity, "domains": args.domains} if args.parity > 0 else extra
    persist_never = policies.EveryNSteps(10 ** 9)   # steps 1..: only force=True saves persistently

    def manager(local):
        tier = dio.LocalTier(local, keep_policy=policies.LatestN(2), **extra)
        return dio.CheckpointManager(root, dispatcher, save_policy=persist_never,
                                     local=tier)

    priority = (lambda keypath, spec: dio.Priority.LOW) if args.priority == "low" else None
    mgr = manager(local_path)
    step = 0
    for kind in ("local", "persistent"):   # warm-up, not timed: first-use costs
        step += 1
        mgr.save(step, state, local=kind == "local", force=kind == "persistent", priority=priority)
        mgr.wait()
    for rep, kind in interleaved(args.reps, ("local", "persistent")):
        step += 1
        sync(f"save/{step}", drop=False)
        start = time.perf_counter()
        mgr.save(step, state, local=kind == "local", force=kind == "persistent", priority=priority)
        blocked = time.perf_counter() - start
        mgr.wait()
        emit(phase="save", kind=kind, rep=rep, blocked=blocked, wall=time.perf_counter() - start)
    step += 1   # the step the restores read: in both tiers
    mgr.save(step, state, local=True, force=True, priority=priority)
    mgr.wait()
    mgr.close()
    sync("saved")
    du = lambda path: int(subprocess.run(["du", "-sb", path], capture_output=True, text=True, check=True)  # noqa: E731
                          .stdout.split()[0])
    emit(phase="storage", local=du(os.path.join(local_path.replace("{process}", str(args.pid)), str(step))),
         persistent=du(os.path.join(root, str(step))) if args.pid == 0 and not args.root_url else 0)
    sync("measured")
    if args.processes > 2:
        transfer(args, emit)
    mine = local_path.replace("{process}", str(args.pid))
    for rep, kind in interleaved(args.reps, ("tiers_whole", "tiers", "persistent")):
        local = local_path if kind != "persistent" else os.path.join(args.local_dir, f"empty{rep}", "{process}")
        lost = kind == "tiers" and args.pid == 1
        if lost:   # its host is gone with its disk (its copy is put back after this restore)
            os.rename(mine, mine + ".gone")
        with manager(local) as restoring:
            sync(f"restore/{rep}/{kind}", drop=True)
            start, cpu = time.perf_counter(), time.process_time()
            restored = restoring.restore(None, target)
            jax.block_until_ready(restored)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            s = restoring.last_tier_restore
            exact = all(np.array_equal(np.asarray(got.data), np.asarray(want.data))
                        for name in state for got, want in zip(restored[name].addressable_shards,
                                                                state[name].addressable_shards))
            del restored
        if lost:
            shutil.rmtree(mine)
            os.rename(mine + ".gone", mine)
        emit(phase="restore", kind=kind, rep=rep, wall=wall, cpu=cpu, step=s.step, exact=exact,
             local=s.bytes_read_local, persistent=s.bytes_read_persistent, received=s.bytes_received,
             peer_regions=s.peer_regions, persistent_regions=s.persistent_regions)
        sync(f"restored/{rep}/{kind}")
    dispatcher.close()
    jax.distributed.shutdown()


def transfer(args, emit, sends: int = 8, row_mib: int = 32):
    """The machine's cost of moving bytes between processes, the way a restore after a lost process
    moves them: ``rows.Sender`` (a collective permute, gloo on CPU) of a fresh ``row_mib`` MiB row,
    as a round's, from process 2 to process 1 (the other two wait); each side's CPU and the wall
    per send, after two untimed sends (the first compiles)."""
    import numpy as np
    from jax._src.distributed import global_state
    from dispatch_io.multihost import rows
    from dispatch_io.workers import aligned_empty

    global_state.client.wait_at_barrier("bench/transfer", 600_000)
    if args.pid in (1, 2):
        sender = rows.Sender(((2, 1),), rows.carriers(args.processes), ((0, 1),), row_mib * MiB)
        for n in range(2 + sends):
            row = aligned_empty((row_mib * MiB,), np.uint8)
            row[:] = n % 251   # written as a round's row is, before it is sent
            start, cpu = time.perf_counter(), time.process_time()
            got = sender(row)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            if args.pid == 1 and not (got[:16] == n % 251).all():
                raise SystemExit("transfer: the row that came is not the one sent")
            if n >= 2:
                emit(phase="transfer", send=n - 2, mib=row_mib, wall=wall, cpu=cpu)
    global_state.client.wait_at_barrier("bench/transferred", 600_000)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--mesh", default="2,4", help="data,fsdp (their product: processes x devices)")
    parser.add_argument("--replicas", type=int, default=0, help="LocalTier(replicas=N), passed only when N > 0")
    parser.add_argument("--parity", type=int, default=0, help="LocalTier(parity=K), passed only when K > 0")
    parser.add_argument("--domains", default="", help="with --replicas / --parity: the failure domain of each process, "
                        "comma-separated (default: hosts of 2 processes, 0,0,1,1)")
    parser.add_argument("--mib", type=int, default=1024, help="state size (logical, every region once)")
    parser.add_argument("--large", type=int, default=4, help="large matrices the state is mostly made of "
                        "(1: one giant leaf)")
    parser.add_argument("--budget-mib", type=int, default=256, help="host memory budget of each process")
    parser.add_argument("--priority", choices=("sync", "low"), default="sync",
                        help="every leaf's save priority: sync (copied before save() returns) or low (async)")
    parser.add_argument("--checksums", action=argparse.BooleanOptionalAction, default=True,
                        help="Options(checksums=): a restore through the tiers checks the newest local step first")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/dio_tiers_bench", help="scratch: root/, local/<process>/")
    parser.add_argument("--local-dir", default="", help="the local tier's directory (default: <dir>/local; "
                        "/dev/shm/...: a RAM disk)")
    parser.add_argument("--root-store", choices=("dir", "gcs"), default="dir",
                        help="where the persistent root is: a directory under --dir, or gs:// on the tests' GCS server "
                        "(fake-gcs-server on loopback, behind the generation-precondition layer): the tier against a root "
                        "on an object store, as users keep it")
    parser.add_argument("--quick", action="store_true", help="that it runs: 64 MiB, 1 rep")
    parser.add_argument("--root-url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pid", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.mib, args.reps = 64, 1
    args.mesh = tuple(int(n) for n in args.mesh.split(","))
    args.local_dir = args.local_dir or os.path.join(args.dir, "local")
    args.domains = tuple(args.domains.split(",")) if args.domains else tuple(str(p // 2) for p in range(args.processes))
    if args.child:
        return child(args)
    if len(args.mesh) != 2 or args.mesh[0] * args.mesh[1] != args.processes * args.devices:
        parser.error(f"--mesh {args.mesh}: data x fsdp must be processes x devices = {args.processes * args.devices}")
    if args.replicas > 0 or args.parity > 0:
        sys.path.insert(0, ROOT)
        import dispatch_io as dio
        chosen = {"replicas": args.replicas} if args.replicas > 0 else {"parity": args.parity}
        try:
            dio.LocalTier(os.path.join(args.dir, "local", "{process}"), domains=args.domains, **chosen)
        except (TypeError, ValueError) as exc:
            print(f"{chosen}: skipped, this build refuses it: {exc}")
            return
    for scratch in (args.dir, args.local_dir):
        shutil.rmtree(scratch, ignore_errors=True)
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    servers = []
    if args.root_store == "gcs":
        sys.path.insert(0, os.path.join(ROOT, "tests", "servers"))
        from gcs_server import FakeGcsServer, GcsPreconditions, gcs_environment
        servers.append(FakeGcsServer())
        servers.append(GcsPreconditions(servers[0].port))
        servers[0].create_bucket("bench")
        env.update(gcs_environment(servers[1].endpoint))
        args.root_url = f"gs://bench/tiers-{os.getpid()}"
    command = [sys.executable, __file__, "--child", "--port", str(free_port()),
               "--checksums" if args.checksums else "--no-checksums"] + [
        a for name in ("processes", "devices", "replicas", "parity", "mib", "large", "budget_mib", "priority", "reps",
                                  "dir", "local_dir")
        for a in (f"--{name.replace('_', '-')}", str(getattr(args, name)))] + [
        "--mesh", ",".join(map(str, args.mesh)), "--domains", ",".join(args.domains), "--root-url", args.root_url]
    started = time.monotonic()
    procs = [subprocess.Popen(command + ["--pid", str(pid)], env=env, stdout=subprocess.PIPE, text=True)
             for pid in range(args.processes)]
    results = []
    try:
        for proc in procs:
            for line in proc.stdout:
                if (result := results_of(line)) is not None:
                    results.append(result)
                    print(line.strip(), flush=True)
            if proc.wait() != 0:
                raise SystemExit(f"a process of the job failed (exit {proc.returncode})")
    finally:
        for server in reversed(servers):
            server.stop()
    report(results, args, time.monotonic() - started)


LABELS = {"tiers_whole": "through the tiers, no copy lost", "tiers": "through the tiers, process 1's copy lost",
          "persistent": "all from the root (empty local tier)"}


def report(results, args, seconds):
    data, fsdp = args.mesh
    print(f"\n{args.processes} processes x {args.devices} CPU devices, mesh (data={data}, fsdp={fsdp}), "
          f"{args.mib} MiB state ({args.large} large leaves), root {args.root_url or 'a directory'}, replicas={args.replicas}, parity={args.parity}"
          f"{' domains ' + ','.join(args.domains) if args.replicas or args.parity else ''}, budget {args.budget_mib} MiB/process, "
          f"priority {args.priority}, checksums {args.checksums}, {args.reps} reps, {seconds:.0f} s in all")
    print("\n| save | blocked s (slowest process) | wall s to committed (slowest process) |\n|---|---|---|")
    for kind in ("local", "persistent"):
        rows = [r for r in results if r["phase"] == "save" and r["kind"] == kind]
        per_rep = lambda key: [max(r[key] for r in rows if r["rep"] == rep) for rep in range(args.reps)]  # noqa: E731
        print(f"| {kind} | {_median(per_rep('blocked'), '{:.3f}')} | {_median(per_rep('wall'))} |")
    print(f"\n| restore, cold | wall s (slowest process) | CPU s: all processes ({os.cpu_count()} cores) / busiest | local MiB "
          "| persistent MiB | received MiB | regions from peers / root | bit-exact |\n|---|---|---|---|---|---|---|---|")
    for kind in ("tiers_whole", "tiers", "persistent"):
        rows = [r for r in results if r["phase"] == "restore" and r["kind"] == kind]
        walls = [max(r["wall"] for r in rows if r["rep"] == rep) for rep in range(args.reps)]
        cpu = [sum(r["cpu"] for r in rows if r["rep"] == rep) for rep in range(args.reps)]
        busiest = [max(r["cpu"] for r in rows if r["rep"] == rep) for rep in range(args.reps)]
        total = lambda key: sum(r[key] for r in rows if r["rep"] == 0) / MiB  # noqa: E731
        print(f"| {LABELS[kind]} | {_median(walls)} | {_median(cpu)} / {_median(busiest)} | {total('local'):.0f} "
              f"| {total('persistent'):.0f} "
              f"| {total('received'):.0f} | {rows[0]['peer_regions']} / {rows[0]['persistent_regions']} "
              f"| {all(r['exact'] for r in rows)} |")
    wall = {kind: [max(r["wall"] for r in results if r["phase"] == "restore" and r["kind"] == kind and r["rep"] == rep)
                   for rep in range(args.reps)] for kind in LABELS}
    # Each repetition's restores ran one after the other: their ratio is steadier than the medians' on a shared machine.
    ratio = lambda other: _median([a / b for a, b in zip(wall["tiers"], wall[other])], "{:.2f}")  # noqa: E731
    print(f"\nrestore after a lost process, per repetition: {ratio('tiers_whole')}x the one with nothing lost, "
          f"{ratio('persistent')}x the one all from the root")
    moved = [r for r in results if r["phase"] == "transfer"]
    if moved:   # what moving the received bytes alone costs here, beside a healthy restore's CPU
        per = lambda pid, key: sorted(r[key] / r["mib"] for r in moved if r["process"] == pid)[len(moved) // 4]  # noqa: E731
        cost = per(2, "cpu") + per(1, "cpu")
        healthy = [sum(r["cpu"] for r in results if r["phase"] == "restore" and r["kind"] == "tiers_whole"
                       and r["rep"] == rep) for rep in range(args.reps)]
        received = sum(r["received"] for r in results if r["phase"] == "restore" and r["kind"] == "tiers"
                       and r["rep"] == 0) / MiB
        healthy_cpu = sorted(healthy)[len(healthy) // 2]   # the median healthy restore's CPU
        print(f"\nmoving bytes between processes here (gloo over loopback, {moved[0]['mib']} MiB rows, process 2 -> 1): "
              f"{per(2, 'wall') * 1e3 * moved[0]['mib']:.0f} ms a row, {per(2, 'cpu') * 1e3:.2f} CPU-ms per MiB sent + "
              f"{per(1, 'cpu') * 1e3:.2f} received; the lost restore's {received:.0f} MiB received cost "
              f"{received * cost:.2f} CPU-s on top of a healthy restore's {healthy_cpu:.2f}: at least "
              f"{(healthy_cpu + received * cost) / healthy_cpu:.2f}x its CPU on this machine's {os.cpu_count()} shared cores")
    storage = sorted((r for r in results if r["phase"] == "storage"), key=lambda r: r["process"])
    print("\nlocal step on disk per process (du -sb): "
          + ", ".join(f"{r['process']}: {r['local'] / MiB:.1f} MiB" for r in storage)
          + ("" if args.root_url else f"; the persistent step: {sum(r['persistent'] for r in storage) / MiB:.1f} MiB"))


if __name__ == "__main__":
    main()
