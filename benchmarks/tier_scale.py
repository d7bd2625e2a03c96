"""Scale simulation of the local tier: who reads a lost process's share back, up to 1,024 processes, on paper.

    .venv/bin/python benchmarks/tier_scale.py [--hosts 2 8 32 128] [--per-host 2 8] [--devices 8]

No devices and no data: the planners a local save and a restore after a lost process run are
called with plain descriptions of the job -- ``hosts`` x ``per-host`` processes (a host is a
failure domain), ``devices`` devices each -- and a pure-FSDP state: every leaf sharded over
every device, so each process holds 1/P of each leaf, one region per device.

* ``replicas=1``: the job's replica variants (``replica_plan.replica_variants``), each leaf's
  variant and its device places' (``replica_plan.leaf_plans``: what ``replicas.send`` moves). A
  lost process's regions then have one copy each, at the holder the plan names, which reads it
  for the restore and sends it. Per holder: the bytes it reads for the lost process, as a share
  of what it reads for itself; the busiest holder sets the restore's time on hosts of their own.
* ``parity=k``: the ring (``parity_plan.ring``) and the rounds that bring the lost process's
  pieces back (``parity_plan.transfers``). Every transfer carries one piece, 1/k of each device's
  row (its share of the protected bytes), so a process's extra bytes are counted in pieces: its
  parity rows read (holders) and the pieces it sends and receives.

Every process is lost in turn; the worst is reported. Two states: one giant leaf, and 96 leaves of
mixed sizes (the same every run). Reading the table: with ``replicas=1`` the busiest holder reads
``1 + x`` times its own share; the issue's 1.3x asks ``x`` <= 0.3 where reads bound the restore.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from dispatch_io.manager.tiers import parity_plan, replica_plan  # noqa: E402


def states() -> dict[str, list[int]]:
    """{name: the leaves' sizes in bytes}: one giant leaf, and 96 of mixed sizes (1 MiB to 1 GiB)."""
    rng = np.random.default_rng(0)
    return {"1 giant leaf": [1 << 34], "96 mixed leaves": [int(1 << b) for b in rng.integers(20, 31, 96)]}


def replicas(domains: list, devices: int, sizes: list[int]) -> dict:
    """A lost process's replicas, worst over which process is lost: {"holders": how many processes
    hold some of its share, "read": the most any holder reads in the restore / its own share (its
    own plus the lost process's regions it holds), "sent": the same holder's bytes sent / its share}."""
    count = len(domains)
    variants = replica_plan.replica_variants(domains, 1)
    shares = [{p: size // count for p in range(count)} for size in sizes]
    plans = replica_plan.leaf_plans(shares, [list(range(len(variants)))] * len(sizes), [True] * len(sizes), devices)
    own = sum(sizes) / count
    worst = {"holders": 0, "read": 0.0, "sent": 0.0}
    for lost in range(count):
        extra: collections.Counter = collections.Counter()
        for size, plan in zip(sizes, plans):
            for place in range(devices):
                extra[variants[plan[place]][0][lost]] += size / (count * devices)
        busiest = max(extra.values()) / own
        if 1 + busiest > worst["read"]:
            worst = {"holders": len(extra), "read": 1 + busiest, "sent": busiest}
    return worst


def parity(domains: list, k: int) -> dict:
    """A rebuild after one lost process, worst over which process is lost: the most any survivor
    reads (its share and the parity rows it holds), sends and receives, each / its share (a
    piece is 1/k of it), and the collective rounds."""
    order = parity_plan.ring(domains)
    worst = {"read": 0.0, "sent": 0.0, "received": 0.0, "rounds": 0}
    for lost in range(len(domains)):
        early, late = parity_plan.transfers(order, k, {lost})
        read, sent, received = collections.Counter(), collections.Counter(), collections.Counter()
        for sender, receiver, _, _, piece in (t for r in early + late for t in r):
            sent[sender] += 1
            read[sender] += piece is None    # a holder sends its parity row: read from its local step
            if receiver != lost:
                received[receiver] += 1
        worst = {"read": max(worst["read"], 1 + max(read.values()) / k),
                 "sent": max(worst["sent"], max(sent.values()) / k),
                 "received": max(worst["received"], max(received.values(), default=0) / k),
                 "rounds": max(worst["rounds"], len(early) + len(late))}
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 8, 32, 128])
    ap.add_argument("--per-host", type=int, nargs="+", default=[2, 8], help="processes per host (a failure domain)")
    ap.add_argument("--devices", type=int, default=8, help="devices per process")
    ap.add_argument("--parity", type=int, nargs="+", default=[2, 3, 4])
    a = ap.parse_args()
    print("Busiest process of the restore after one lost process, its bytes / its own share (a healthy restore: "
          "read 1, nothing sent or received)\n")
    print("| processes (hosts x per host) | state | replicas=1: holders of the lost share | read / sent | "
          + " | ".join(f"parity={k}: read / sent / received, rounds" for k in a.parity) + " |")
    print("|---|---|---|---|" + "---|" * len(a.parity))
    for hosts in a.hosts:
        for per_host in a.per_host:
            domains = [p // per_host for p in range(hosts * per_host)]
            rows = [parity(domains, k) if k < len(domains) else None for k in a.parity]   # k + 1 processes at least
            for name, sizes in states().items():
                r = replicas(domains, a.devices, sizes)
                print(f"| {len(domains)} ({hosts} x {per_host}) | {name} | {r['holders']} | "
                      f"{r['read']:.2f} / {r['sent']:.2f} | "
                      + " | ".join("-" if p is None else f"{p['read']:.2f} / {p['sent']:.2f} / {p['received']:.2f}, "
                                   f"{p['rounds']}" for p in rows) + " |", flush=True)


if __name__ == "__main__":
    main()
