"""The delivery tests' worker (tests/test_delivery.py): one process of a job restoring a tree of awkward shardings (overlapping
and unequal holder sets, a sub-mesh leaf, a single-device leaf, keys, packs, uneven chunks),
every byte compared. argv: pid count port path."""

from __future__ import annotations

import json
import os
import sys
import traceback

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dispatch_io as dio
from multiprocess_worker import loopback_bytes, sync
from dispatch_io.jax_compat import single_device_sharding


def shardings():
    d = jax.devices()   # process p: devices 2p, 2p + 1
    std = Mesh(np.array(d).reshape(4, 2), ("data", "model"))
    ring = Mesh(np.array([[d[0], d[2]], [d[3], d[4]], [d[5], d[6]], [d[7], d[1]]]), ("data", "model"))   # row i: i, i+1
    odd = Mesh(np.array([[d[0], d[2], d[4], d[1]], [d[3], d[5], d[6], d[7]]]), ("a", "b"))   # {0,1,2} / {1,2,3}
    sub = Mesh(np.array(d[:4]).reshape(2, 2), ("x", "y"))   # processes 0 and 1 only
    pair = Mesh(np.array([[d[0], d[4]], [d[1], d[5]]]), ("x", "y"))   # processes 0 and 2, in rows
    return {"model": NamedSharding(std, P(None, "model")), "data": NamedSharding(std, P("data")),
            "ring": NamedSharding(ring, P("data")), "odd": NamedSharding(odd, P("a")),
            "sub": NamedSharding(sub, P("x")), "sub_rep": NamedSharding(sub, P()),
            "pair": NamedSharding(pair, P(None, "x")), "single": single_device_sharding(d[3]),
            "rep": NamedSharding(std, P())}


def table():
    rng = np.random.default_rng(2627)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)   # noqa: E731
    return {
        "model": (f32(40, 64), "model"), "data": (f32(64, 24), "data"), "ring": (f32(96, 40), "ring"),
        "odd": (rng.integers(-100, 100, (50, 6), dtype=np.int8), "odd"), "sub": (f32(32, 33), "sub"),
        "sub_rep": (f32(7, 5), "sub_rep"), "pair": (f32(9, 64), "pair"), "single": (f32(6, 5), "single"),
        "rep": (f32(3), "rep"), "bf": (f32(64, 8).astype(jax.numpy.bfloat16), "ring"),
        "mask": (rng.random((12, 4)) < 0.5, "model"),
        "big": (f32(int(os.environ.get("DELIVERY_BIG", "256")), 256), "ring"), "bigsub": (f32(128, 256), "sub_rep"),
        "key": (rng.integers(0, 2**32, (8, 2), dtype=np.uint32), "key:ring"),
        "key1": (rng.integers(0, 2**32, (4, 2), dtype=np.uint32), "key:sub_rep"),
    }


def main():
    pid, count, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=pid,
                               initialization_timeout=60, shutdown_timeout_seconds=20)
    out = {"process": pid}
    try:
        sh, tab = shardings(), table()

        def concrete(host, how):
            key = how.startswith("key:")
            s = sh[how[4:] if key else how]
            if os.environ.get("DELIVERY_SAVE_HOST"):   # saved unsharded: chunks cut across the target's regions
                if not key:
                    return host
                s = sh["rep"]
            a = jax.make_array_from_callback(host.shape, s, lambda i: host[i], dtype=host.dtype)
            return jax.random.wrap_key_data(a, impl="threefry2x32") if key else a

        def target(host, how):
            if how.startswith("key:"):
                return jax.ShapeDtypeStruct(host.shape[:-1], jax.random.key(0).dtype, sharding=sh[how[4:]])
            return jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=sh[how])

        tree = {k: concrete(*v) for k, v in tab.items()}
        with dio.LocalDispatcher(host_memory_budget=1 << 20, max_chunk_bytes=4 << 10) as d:
            d.save(path, tree).wait()
        bad, checked = [], 0
        only = os.environ.get("DELIVERY_ONLY")
        if only:
            tab = {k: v for k, v in tab.items() if k in only.split(",")}
        with dio.LocalDispatcher(host_memory_budget=256 << 10, max_chunk_bytes=8 << 10, barrier_timeout=30) as d:
            sync("before")
            lo = loopback_bytes()
            got = d.restore(path, {k: target(*v) for k, v in tab.items()}, partial=bool(only)) if only else \
                d.restore(path, {k: target(*v) for k, v in tab.items()})
            sync("after")
            out["loopback"] = loopback_bytes() - lo
            stats = d.last_restore_stats
        for k, (host, how) in tab.items():
            a = got[k]
            if how.startswith("key:"):
                a = jax.random.key_data(a)
            for shard in a.addressable_shards:
                checked += 1
                if np.asarray(shard.data).tobytes() != host[shard.index].tobytes():
                    bad.append(f"{k} {shard.index}")
        out.update(checked=checked, bad=bad, read=stats.bytes_read,
                   received=getattr(stats, "bytes_received", None), sent=getattr(stats, "bytes_sent", None))
    except BaseException as exc:  # noqa: BLE001
        out.update(error=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-3000:])
    print("RESULT " + json.dumps(out), flush=True)
    if "error" not in out:   # the leader's exit takes the coordination service down with it: leave together
        jax.distributed.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
