"""Saves and restores against an object store with one slow request (run by tests/test_slow_requests.py).

    python slow_store_job.py SCHEME UPSTREAM_PORT PREFIX MODE

A process of its own: TensorStore reads its request deadline once per process (workers/deadlines.py).
MODE ``deadline``: a short one (``request_timeout=2``, which the rest of the suite must not get)
and no hedged reads, so what ends a slow request is the deadline alone. MODE ``hedge``: a long
deadline (60 s) and hedged reads, so a slow read that ends soon was ended by its hedge.
A :class:`fault_proxy.SlowProxy` in this process forwards to the server on ``UPSTREAM_PORT``
(``gs``: the fixture's precondition layer; ``s3``: moto) and slows one chosen request per case.
Prints one line ``RESULT {json}``: per case, its seconds, whether the tree came back bit-exact,
the requests the proxy slowed, and (for the case where nothing answers) the error raised.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np
from absl import logging as absl_logging

import dispatch_io as dio
import dispatch_io.storage.objectstore as objectstore
from fault_proxy import Fault, SlowProxy
from gcs_server import gcs_environment
from s3_server import s3_environment

MiB = 1 << 20
OPTIONS = dict(host_memory_budget=MiB, min_request_rate=64 << 10, data_file_bytes=256 << 10)
MODES = {"deadline": dict(request_timeout=2, hedge_reads=False), "hedge": dict(request_timeout=60, hedge_after=0.5)}


def tree() -> dict:
    rng = np.random.default_rng(7)
    return {"w": jax.numpy.asarray(rng.standard_normal((1024, 768), dtype=np.float32)),   # 3 MiB
            "b": jax.numpy.asarray(rng.integers(0, 1 << 30, (4096,), dtype=np.int32)),
            "e": jax.numpy.asarray(rng.standard_normal((256, 256), dtype=np.float32))}


def bit_exact(got: dict, want: dict) -> bool:
    def same(a, b):
        return np.asarray(a).dtype == np.asarray(b).dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)


def timed(fn):
    start = time.monotonic()
    value = fn()
    return time.monotonic() - start, value


def main(scheme: str, upstream_port: int, prefix: str, mode: str) -> dict:
    absl_logging.set_verbosity(absl_logging.INFO)   # the straggler lines (hedged reads)
    proxy = SlowProxy(upstream_port)
    os.environ.update(gcs_environment(proxy.endpoint) if scheme == "gs" else s3_environment(proxy.endpoint))
    # 3 attempts per request, quickly: the case where nothing answers ends in seconds.
    objectstore.OBJECT_STORE_RETRIES = {"max_retries": 2, "initial_delay": "50ms", "max_delay": "200ms"}
    upload = "POST" if scheme == "gs" else "PUT"
    data = "/d/"                            # an OCDBT data file: arrays/<save>/<writer>/d/<name>
    want, results = tree(), {}
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), want)

    def case(name, fault, fn):
        hit = proxy.add(fault).hit if fault is not None else []
        proxy.reset_counts()
        start = time.monotonic()
        try:
            seconds, value = timed(fn)
            results[name] = {"seconds": seconds, "exact": value is None or bit_exact(value, want), "hit": list(hit)}
        except dio.CheckpointError as exc:
            results[name] = {"error": type(exc).__name__, "checkpoint_error": True, "message": str(exc),
                             "seconds": time.monotonic() - start, "hit": list(hit)}
        finally:
            with proxy.lock:
                proxy.faults.clear()
        results[name]["data_gets"] = proxy.count("GET", data)
        results[name]["get_bytes"] = proxy.bytes_sent.get("GET", 0)

    try:
        with dio.LocalDispatcher(**OPTIONS, **MODES[mode]) as d:
            case("save", None, lambda: d.save(f"{prefix}/a", want).wait() and None)
            for _ in range(2):   # the second is the baseline: TensorStore and the connections warm
                case("restore", None, lambda: d.restore(f"{prefix}/a", like))
            case("restore_stalled_read", Fault("stall", "GET", data, min_bytes=64 << 10),
                 lambda: d.restore(f"{prefix}/a", like))
            case("restore_trickled_read", Fault("trickle", "GET", data, min_bytes=64 << 10),
                 lambda: d.restore(f"{prefix}/a", like))
            if mode == "hedge":
                with dio.LocalDispatcher(**OPTIONS, **MODES[mode], hedge_reads=False) as plain:
                    case("restore_without_hedging", None, lambda: plain.restore(f"{prefix}/a", like))
                case("restore_with_hedging", None, lambda: d.restore(f"{prefix}/a", like))
                return results
            case("save_stalled_upload", Fault("stall", upload, data),
                 lambda: d.save(f"{prefix}/b", want).wait() and None)
            case("restore_after_stalled_upload", None, lambda: d.restore(f"{prefix}/b", like))
            case("save_commit_answer_lost", Fault("lose", upload, "COMMITTED"),
                 lambda: d.save(f"{prefix}/c", want).wait() and None)
            case("restore_after_commit_answer_lost", None, lambda: d.restore(f"{prefix}/c", like))
            case("restore_no_data_answers", Fault("stall", "GET", data, count=1 << 30),
                 lambda: d.restore(f"{prefix}/a", like))
            case("restore_nothing_answers", Fault("stall", "GET", "", count=1 << 30),
                 lambda: d.restore(f"{prefix}/a", like))
    finally:
        proxy.stop()
    return results


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])), flush=True)
