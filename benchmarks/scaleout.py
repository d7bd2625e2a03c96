"""Scale-out restore benchmark: a multi-process job restoring a replicated state, with
``Options(restore_broadcast=True)`` (every stored byte read once per job, the replicas filled by
an all-gather over gloo) against ``restore_broadcast=False`` (every process reads all it holds).

    python benchmarks/scaleout.py --processes 2 --mib 1024 --reps 3 [--s3-mib 128]

Each process holds every byte of the state (8 float32 leaves, replicated over all devices: data
parallelism across hosts). The job saves it once, then per repetition restores it with the
broadcast on and off, interleaved, the page cache dropped before each (cold; needs root) and
the processes lined up on the coordination service. Per mode: wall seconds (slowest process),
stored bytes read per process (dispatch_io's count and the OS's ``rchar``), bytes received by
broadcast, peak RSS growth (VmHWM, reset before each restore). With ``--s3-mib`` the same on a
moto S3 server on loopback, behind a proxy counting GET requests and bytes. Medians are
printed as a Markdown table; the raw per-process results go to stdout as JSON lines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import harness
from harness import ROOT, MiB, emit, free_port, median_range, rchar, results_of, status_bytes

LEAVES = 8


def child(args):
    """One process of the job: save once, then the restores of every repetition."""
    import jax

    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.processes, process_id=args.pid)
    import numpy as np
    from jax._src.distributed import global_state
    from jax.sharding import NamedSharding, PartitionSpec

    import dispatch_io as dio

    def sync(name):
        global_state.client.wait_at_barrier(f"bench/{name}", 600_000)

    mesh = jax.make_mesh((jax.device_count(),), ("replica",))
    replicated = NamedSharding(mesh, PartitionSpec())
    rows = args.mib * MiB // LEAVES // (4 * 1024)
    host = np.random.default_rng(0).standard_normal((rows, 1024), dtype=np.float32)
    tree = {f"w{i}": jax.make_array_from_callback(host.shape, replicated, lambda index: host[index])
            for i in range(LEAVES)}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    options = dict(host_memory_budget=args.budget_mib * MiB, barrier_timeout=600, progress=False)
    paths = [(args.path, args.reps)] + ([(args.s3_path, 1)] if args.s3_path else [])
    for path, reps in paths:
        if path == args.s3_path:  # a smaller state: moto is slow
            tree = {k: v for k, v in list(tree.items())[:max(1, LEAVES * args.s3_mib // args.mib)]}
            target = {k: target[k] for k in tree}
        with dio.LocalDispatcher(**options) as d:
            d.save(path, tree).wait()
        if path == paths[-1][0]:
            tree = None  # not needed any more: the restores have the memory to themselves
        for rep in range(reps):
            for broadcast in (True, False):
                with dio.LocalDispatcher(**options, restore_broadcast=broadcast) as d:
                    if args.pid == 0 and path == args.path:
                        harness.drop_caches()
                    sync(f"{path}/{rep}/{broadcast}/start")
                    if args.pid == 0:  # the parent reads the S3 proxy's counters now (and after "end")
                        print("MARK", flush=True)
                        time.sleep(1)
                    sync(f"{path}/{rep}/{broadcast}/go")
                    harness.reset_peak_rss()
                    rss, io_before, start = status_bytes("VmRSS"), rchar(), time.perf_counter()
                    restored = d.restore(path, target)
                    jax.block_until_ready(restored)
                    wall = time.perf_counter() - start
                    stats = d.last_restore_stats
                    sync(f"{path}/{rep}/{broadcast}/end")
                    if args.pid == 0:
                        print("MARK", flush=True)
                        time.sleep(1)
                    sync(f"{path}/{rep}/{broadcast}/marked")
                    emit(storage="s3" if path == args.s3_path else "dir", rep=rep, broadcast=broadcast,
                         process=args.pid, wall=wall, bytes_read=stats.bytes_read,
                         bytes_broadcast=stats.bytes_broadcast, os_read=rchar() - io_before,
                         peak_rss_plus=status_bytes("VmHWM") - rss)
                    del restored
    jax.distributed.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--mib", type=int, default=1024, help="state size (every process holds all of it)")
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--s3-mib", type=int, default=0, help="also restore this much from a moto S3 server")
    parser.add_argument("--dir", default="/tmp/dio_scaleout_bench")
    parser.add_argument("--quick", action="store_true", help="that it runs: 64 MiB, 1 rep (with --s3-mib: 16 MiB)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pid", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--s3-path", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.mib, args.reps, args.s3_mib = 64, 1, min(args.s3_mib, 16)
    if args.child:
        return child(args)

    import shutil
    shutil.rmtree(args.dir, ignore_errors=True)
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    proxy = server = None
    s3_path = ""
    if args.s3_mib:
        sys.path.insert(0, os.path.join(ROOT, "tests", "servers"))
        from s3_server import FaultyProxy, MotoServer, s3_environment
        server = MotoServer()
        server.create_bucket("bench")
        proxy = FaultyProxy(server.port)
        env.update(s3_environment(proxy.endpoint))
        s3_path = "s3://bench/scaleout"
    port = free_port()
    command = [sys.executable, __file__, "--child", "--processes", str(args.processes), "--port", str(port),
               "--mib", str(args.mib), "--budget-mib", str(args.budget_mib), "--reps", str(args.reps),
               "--s3-mib", str(args.s3_mib), "--path", os.path.join(args.dir, "ckpt"), "--s3-path", s3_path]
    procs = [subprocess.Popen(command[:2] + ["--pid", str(pid)] + command[2:], env=env, stdout=subprocess.PIPE,
                              text=True) for pid in range(args.processes)]
    results, marks = [], []
    counters = lambda: (sum(1 for m, _ in proxy.requests if m == "GET"), proxy.bytes_sent.get("GET", 0))  # noqa: E731
    for proc in procs:
        for line in proc.stdout:
            if line.startswith("MARK") and proxy is not None:
                marks.append(counters())
            if (result := results_of(line)) is not None:
                results.append(result)
                print(line.strip(), flush=True)
        proc.wait()
    gets = {}
    if proxy is not None:
        s3_marks = marks[-4:]   # the last two restores (on, off) are the S3 ones
        gets = {mode: (end[0] - begin[0], end[1] - begin[1])
                for mode, (begin, end) in zip(("on", "off"), (s3_marks[0:2], s3_marks[2:4]))}
        proxy.stop()
        server.stop()
    report(results, args, gets)


def report(results, args, gets):
    print(f"\n{args.processes} processes x {args.devices} CPU devices, replicated state, budget {args.budget_mib} MiB")
    print("| storage | broadcast | wall s (slowest process) | read / process MiB | received / process MiB "
          "| OS rchar / process MiB | peak RSS + MiB |")
    print("|---|---|---|---|---|---|---|")
    for storage in ("dir", "s3"):
        for broadcast in (True, False):
            rows = [r for r in results if r["storage"] == storage and r["broadcast"] == broadcast]
            if not rows:
                continue
            walls = [max(r["wall"] for r in rows if r["rep"] == rep) for rep in sorted({r["rep"] for r in rows})]
            med = lambda key: statistics.median(r[key] for r in rows) / MiB  # noqa: E731
            print(f"| {storage} | {'on' if broadcast else 'off'} | {median_range(walls)} | {med('bytes_read'):.0f} | {med('bytes_broadcast'):.0f} "
                  f"| {med('os_read'):.0f} | {med('peak_rss_plus'):.0f} |")
    for mode, (requests, nbytes) in gets.items():
        print(f"S3 restore, broadcast {mode}: {requests} GET requests, {nbytes / MiB:.1f} MiB sent by the server "
              "(both processes)")


if __name__ == "__main__":
    main()
