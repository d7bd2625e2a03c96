"""No slow request holds the job: an object-store request that is never answered, or answered at
2 KiB/s, is abandoned and sent again (workers/deadlines.py), on the real GCS and S3 test servers
behind a proxy that slows exactly one request (tests/servers/fault_proxy.py).

The saves and restores run in processes of their own (tests/jobs/slow_store_job.py): TensorStore
reads its request deadline once per process. In one, a 2 s deadline and no hedged reads (what
ends a slow request is the deadline); in the other, a 60 s deadline and hedged reads (what ends
a slow read soon is its hedge, workers/hedged.py). Each slowed case must finish within
max(20 s, 5x) the same restore with nothing slow, bit-exact; a store that never answers ends
the call with a CheckpointError naming the path and the object, in bounded time.
"""

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import JOBS, SUPPORT
from fault_proxy import Fault, SlowProxy, object_name


def start_job(scheme: str, upstream_port: int, prefix: str, mode: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and "LOW_SPEED" not in k}
    env["PYTHONPATH"] = os.pathsep.join(SUPPORT + [env.get("PYTHONPATH", "")])
    job = os.path.join(JOBS, "slow_store_job.py")
    return subprocess.Popen([sys.executable, job, scheme, str(upstream_port), prefix, mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def job_results(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, out[-3000:] + err[-5000:]
    results = json.loads(lines[-1][len("RESULT "):])
    results["stragglers logged"] = [line for line in err.splitlines() if "dispatch_io: straggler:" in line]
    return results


@pytest.fixture(scope="module")
def jobs(gcs_server, s3_server):
    """{(scheme, mode): the job's results}: the four jobs run at once (each spends most of its time
    waiting for a deadline or a hedge), each against its own proxy and prefix."""
    import uuid
    ports = {"gs": gcs_server.port, "s3": s3_server.port}
    started = {(scheme, mode): start_job(scheme, port, f"{scheme}://ckpts/slow-{mode}-{uuid.uuid4().hex[:6]}", mode)
               for scheme, port in ports.items() for mode in ("deadline", "hedge")}
    try:
        return {key: job_results(proc) for key, proc in started.items()}
    finally:
        for proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(params=["gs", "s3"])
def deadline_job(request, jobs):
    """The job's results with a 2 s request deadline and no hedged reads, on each store."""
    return request.param, jobs[(request.param, "deadline")]


@pytest.fixture(params=["gs", "s3"])
def hedge_job(request, jobs):
    """The job's results with hedged reads and a 60 s request deadline, on each store."""
    return request.param, jobs[(request.param, "hedge")]


def bound(cases) -> float:
    return max(20.0, 5 * cases["restore"]["seconds"])


def check_slow_read(cases: dict, name: str):
    case = cases[name]
    assert "error" not in case, case
    assert len(case["hit"]) == 1 and "/d/" in case["hit"][0][1], case      # one data read was slowed
    assert case["exact"], f"{name}: restored tree differs"
    assert case["seconds"] <= bound(cases), (case["seconds"], cases["restore"]["seconds"])


@pytest.mark.parametrize("name", ["restore_stalled_read", "restore_trickled_read"])
def test_the_deadline_ends_a_slow_data_read_soon_and_the_restore_is_bit_exact(deadline_job, name):
    check_slow_read(deadline_job[1], name)


@pytest.mark.parametrize("name", ["restore_stalled_read", "restore_trickled_read"])
def test_a_hedge_ends_a_slow_data_read_soon_and_the_restore_is_bit_exact(hedge_job, name):
    """The deadline is 60 s here: a restore done within 20 s had its slow read hedged."""
    check_slow_read(hedge_job[1], name)
    assert hedge_job[1][name]["data_gets"] > hedge_job[1]["restore"]["data_gets"]   # the hedge's read


def test_a_hedged_straggler_is_named_in_the_log(hedge_job):
    logged = hedge_job[1]["stragglers logged"]
    assert logged and all("['w']" in line or "['e']" in line for line in logged), logged


def test_hedged_reads_cost_few_bytes_on_a_healthy_store(hedge_job):
    """The same restore with hedging on and off, nothing slow: at most 5 % more bytes read."""
    on, off = hedge_job[1]["restore_with_hedging"], hedge_job[1]["restore_without_hedging"]
    assert on["exact"] and off["exact"]
    assert on["get_bytes"] <= 1.05 * off["get_bytes"], (on["get_bytes"], off["get_bytes"])


def test_a_save_with_one_stalled_upload_finishes_soon_and_restores_bit_exact(deadline_job):
    scheme, cases = deadline_job
    save, restored = cases["save_stalled_upload"], cases["restore_after_stalled_upload"]
    assert "error" not in save and "error" not in restored, (save, restored)
    assert len(save["hit"]) == 1 and save["hit"][0][0] == ("POST" if scheme == "gs" else "PUT"), save
    assert save["seconds"] <= max(20.0, 5 * cases["save"]["seconds"]), (save["seconds"], cases["save"]["seconds"])
    assert restored["exact"]


def test_a_commit_whose_answer_is_lost_still_commits_once(deadline_job):
    """The conditional write of COMMITTED reaches the server, its answer never comes back: the
    deadline abandons it, TensorStore sends it again, the server refuses it (the marker exists
    now) -- and the save finds its own marker there, so it committed, once, and restores."""
    scheme, cases = deadline_job
    save, restored = cases["save_commit_answer_lost"], cases["restore_after_commit_answer_lost"]
    assert "error" not in save and "error" not in restored, (save, restored)
    assert len(save["hit"]) == 1 and save["hit"][0][1].endswith("/c/COMMITTED"), save
    assert restored["exact"]


def test_a_store_that_never_answers_ends_the_call_with_a_checkpoint_error(deadline_job):
    """Every GET accepted and never answered: each attempt is abandoned after the deadline,
    the (3) attempts are spent, and the restore raises a CheckpointError naming the checkpoint
    and the object it could not read -- in bounded time."""
    scheme, cases = deadline_job
    case = cases["restore_nothing_answers"]
    assert case.get("error") == "CheckpointError", case
    assert "/a: could not read COMMITTED" in case["message"], case["message"]
    assert "retry attempts" in case["message"] and "abandoned and retried after 2 s" in case["message"], case["message"]
    assert len(case["hit"]) >= 3, case["hit"]     # the first read and its retries, each abandoned
    assert case["seconds"] < 60, case["seconds"]


def test_data_that_never_comes_ends_the_restore_naming_the_leaf(deadline_job):
    """Every data read accepted and never answered: the restore fails with a CheckpointError
    (WorkerError) naming a leaf's key path and what was tried, in bounded time."""
    scheme, cases = deadline_job
    case = cases["restore_no_data_answers"]
    assert case.get("checkpoint_error") and case["error"] == "WorkerError", case
    assert any(f"['{leaf}']" in case["message"] for leaf in "wbe"), case["message"]
    assert "retry attempts failed" in case["message"] and "/d/" in case["message"], case["message"]
    assert case["seconds"] < 60, case["seconds"]


def test_the_proxy_stalls_and_trickles_only_the_chosen_request(gcs_server, gcs_prefix):
    """The fault layer itself: the 2nd GET of an object under ``arrays/`` trickles at 2 KiB/s
    (4 KiB in about 2 s), the rest are answered at once and counted, and one stalled request
    holds nothing but its own connection."""
    proxy = SlowProxy(gcs_server.port)
    try:
        bucket_path = gcs_prefix[len("gs://ckpts/"):]
        for i in range(3):
            request = urllib.request.Request(
                f"{proxy.endpoint}/upload/storage/v1/b/ckpts/o?uploadType=media&name={bucket_path}/arrays/{i}",
                data=bytes([i]) * 4096, method="POST")
            urllib.request.urlopen(request, timeout=30).close()
        trickle = proxy.add(Fault("trickle", "GET", "arrays/", nth=2))
        stall = proxy.add(Fault("stall", "GET", "arrays/2"))

        def get(i, timeout=30):
            url = f"{proxy.endpoint}/storage/v1/b/ckpts/o/{bucket_path}%2Farrays%2F{i}?alt=media"
            start = time.monotonic()
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return response.read(), time.monotonic() - start

        assert get(0) [0] == bytes([0]) * 4096
        data, seconds = get(1)
        assert data == bytes([1]) * 4096 and 1.2 < seconds < 6, seconds
        with pytest.raises(OSError):     # a timeout: never answered
            get(2, timeout=1)
        assert trickle.hit == [("GET", f"{bucket_path}/arrays/1")] and stall.hit == [("GET", f"{bucket_path}/arrays/2")]
        assert proxy.count("GET") == 3 and proxy.count("POST") == 3
        assert proxy.bytes_sent["GET"] == 2 * 4096
    finally:
        proxy.stop()


def test_object_names_of_gcs_and_s3_requests():
    assert object_name("GET", "/storage/v1/b/ckpts/o/run%2Farrays%2Fd%2Fx?alt=media") == "run/arrays/d/x"
    assert object_name("POST", "/upload/storage/v1/b/ckpts/o?uploadType=media&name=run%2FCOMMITTED") == "run/COMMITTED"
    assert object_name("PUT", "/ckpts/run/arrays/d/x") == "run/arrays/d/x"
    assert object_name("GET", "/ckpts?list-type=2&prefix=run%2F") is None
    assert object_name("GET", "/storage/v1/b/ckpts/o?prefix=run%2F") is None
