"""Multi-process saves under jax.distributed: real processes on one machine, CPU devices.

Each test starts N Python processes running ``tests/jobs/multiprocess_worker.py`` (one scenario,
same program everywhere, a coordinator on a free loopback port), waits for them under a hard
time limit (a hang fails the test, with every process's stderr tail, instead of blocking CI)
and checks the JSON results they print. The processes of one test run concurrently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import tensorstore as ts

import dispatch_io as dio
import storage_helpers as stored
from conftest import JOBS, ROOT, TESTS, child_env, free_port  # noqa: F401  (tests of the tiers import them from here)
from dispatch_io.storage import kvstore_spec

WORKER = os.path.join(JOBS, "multiprocess_worker.py")
HARD_LIMIT = 90.0   # seconds for every process of a test to exit; then all are killed


class Job:
    """The processes of one jax.distributed job (or one lone process) running a scenario."""

    def __init__(self, logs, scenario: str, path, processes: int, devices: int, *,
                 barrier_timeout: float | None = None, env: dict | None = None):
        self.name = f"{scenario}-{processes}x{devices}"
        self.logs = logs
        port = free_port() if processes > 1 else 0
        env = child_env(devices, barrier_timeout, env)
        self.procs, self.files = [], []
        for pid in range(processes):
            out = open(logs / f"{self.name}.{pid}.out", "w+")
            err = open(logs / f"{self.name}.{pid}.err", "w+")
            self.files += [out, err]
            self.procs.append(subprocess.Popen(
                [sys.executable, WORKER, scenario, str(pid), str(processes), str(port), str(path)],
                stdout=out, stderr=err, env=env, cwd=ROOT, stdin=subprocess.DEVNULL))
        self.killed: set[int] = set()

    def kill(self, pids=None):
        for pid, proc in enumerate(self.procs):
            if (pids is None or pid in pids) and proc.poll() is None:
                proc.kill()
                self.killed.add(pid)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def _tail(self, pid: int, kind: str, n: int = 3000) -> str:
        with open(self.logs / f"{self.name}.{pid}.{kind}") as f:
            return f.read()[-n:]

    def report(self) -> str:
        return "\n".join(f"--- {self.name} process {pid} (exit {proc.returncode}"
                         f"{', killed' if pid in self.killed else ''})\nstdout: {self._tail(pid, 'out', 1500)}\n"
                         f"stderr: {self._tail(pid, 'err')}" for pid, proc in enumerate(self.procs))

    def wait(self, deadline: float, *, needed=None, grace: float | None = None) -> list[dict | None]:
        """Wait for the processes (all, or only ``needed`` ones plus ``grace`` seconds for the
        rest, which are then killed) until ``deadline`` (time.monotonic()); return each one's
        RESULT (None for a process that printed none). Past the deadline: kill all, fail."""
        needed = range(len(self.procs)) if needed is None else needed
        give_up = None
        while any(p.poll() is None for p in self.procs):
            now = time.monotonic()
            if now > deadline:
                self.kill()
                pytest.fail(f"{self.name}: processes still running after the hard limit of {HARD_LIMIT:g} s; "
                            f"all killed\n{self.report()}")
            if give_up is None and all(self.procs[i].poll() is not None for i in needed):
                give_up = now + (grace or 0.0)
            if give_up is not None and now > give_up:
                self.kill()
                break
            time.sleep(0.05)
        results = []
        for pid in range(len(self.procs)):
            lines = [line for line in self._tail(pid, "out", 10**7).splitlines() if line.startswith("RESULT ")]
            results.append(json.loads(lines[-1][len("RESULT "):]) if lines else None)
        for pid in needed:
            if results[pid] is None or self.procs[pid].returncode != 0:
                pytest.fail(f"{self.name}: process {pid} gave no result\n{self.report()}")
        return results

    def close(self):
        self.kill()
        for f in self.files:
            f.close()


@pytest.fixture
def jobs(tmp_path):
    """Starts jobs (``jobs(scenario, path, processes, devices)``); kills whatever is left at the end."""
    started = []
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(*args, **kwargs) -> Job:
        job = Job(logs, *args, **kwargs)
        started.append(job)
        return job
    yield start
    for job in started:
        job.close()


def deadline() -> float:
    return time.monotonic() + HARD_LIMIT


def assert_restored(results, job):
    for r in results:
        assert r.get("error_type") is None, f"process {r['process']}: {r.get('traceback')}\n{job.report()}"
        assert r["mismatches"] == [], f"process {r['process']}: {r['mismatches']}"
        assert r["checked"] > 0


def assert_saved(results, job):
    for r in results:
        assert r.get("error_type") is None, f"process {r['process']}: {r.get('traceback')}\n{job.report()}"
    total = results[0]["total_bytes"]
    assert sum(r["bytes_written"] for r in results) == total  # every stored byte once, replicas once
    if len(results) > 1:
        assert all(0 < r["bytes_written"] < total for r in results)


def committed(path) -> bool:
    return os.path.isfile(os.path.join(path, "COMMITTED"))


def leftovers(parent) -> list[str]:
    return sorted(os.listdir(parent))


# ---- round trips ----------------------------------------------------------------------------------

@pytest.mark.parametrize("processes, devices", [(2, 4), (4, 2)])
def test_roundtrip(jobs, tmp_path, processes, devices):
    """Mixed shardings, PRNG keys (threefry, rbg), bfloat16 / int8 / bool, numpy, scalars."""
    job = jobs("roundtrip", tmp_path / "ckpt", processes, devices)
    results = job.wait(deadline())
    assert_saved(results, job)
    assert_restored(results, job)
    assert committed(tmp_path / "ckpt")
    # The array on jax.devices()[5] has no shard on the other processes: they restore it as a
    # global array all the same (compared for shape, dtype and sharding).
    owner = 5 // devices
    assert [r["without_local_shards"] for r in results] == [
        [] if pid == owner else ["['single']"] for pid in range(processes)]


def test_roundtrip_on_s3(jobs, s3_prefix):
    """Two processes save into one S3 prefix (each its own OCDBT database), process 0 merges and
    commits with the marker; both restore their own regions. The server is the moto fixture's."""
    path = f"{s3_prefix}/ckpt"
    job = jobs("roundtrip", path, 2, 4)
    results = job.wait(deadline())
    assert_saved(results, job)
    assert_restored(results, job)
    assert dio.metadata(path)["step"] == 1000
    keys = {k.decode() for k in ts.KvStore.open(kvstore_spec(path)).result().list().result()}
    arrays = json.loads(ts.KvStore.open(kvstore_spec(path)).result()["manifest.json"])["arrays"]  # arrays/<save id>/
    assert {"COMMITTED", "manifest.json", f"{arrays}manifest.ocdbt"} <= keys and "WRITING" not in keys, keys
    writers = {k[len(arrays):].split("/")[0] for k in keys if k.startswith(arrays) and k.count("/") >= 4}
    assert writers >= {"p0", "p1"}, keys  # one database per process, merged by process 0


def test_checkpoints_move_between_process_counts(jobs, tmp_path):
    """Saved by 2 processes x 4 devices -> restored by 1 process x 8, and the reverse. The saves
    store per-chunk checksums (each process its own chunks'; the manifest holds all of them) and
    the restores verify every chunk they read."""
    by_two, by_one = tmp_path / "by_two", tmp_path / "by_one"
    limit = deadline()
    save_two, save_one = jobs("save", by_two, 2, 4), jobs("save", by_one, 1, 8)
    assert_saved(save_two.wait(limit), save_two)
    assert_saved(save_one.wait(limit), save_one)
    for path, processes in ((by_two, 2), (by_one, 1)):
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["layout"] == "ocdbt"   # the default: one database merged from each process's
        writers = set()
        for leaf in manifest["leaves"]:
            if leaf.get("stored") and "pack" in leaf["stored"]:   # one chunk: the leaf, in its pack
                assert leaf["stored"]["pack"] in stored.array_names(path) and len(leaf["stored"]["crc32c"]) == 1
            elif leaf.get("stored"):
                chunks = stored.chunks(path, leaf["keypath"])   # keys of the merged database
                assert len(chunks) >= 1, leaf["keypath"]
                assert len(leaf["stored"]["crc32c"]) == len(chunks), leaf["keypath"]
                assert {",".join(map(str, grid)) for grid in chunks} == set(leaf["stored"]["crc32c"]), leaf["keypath"]
                writers |= {os.path.relpath(v.file, path / "arrays").split(os.sep)[0]
                            for v in chunks.values() if v.file is not None}
        assert writers == {f"p{k}" for k in range(processes)}, writers   # every process's chunks merged
    restore_one, restore_two = jobs("restore", by_two, 1, 8), jobs("restore", by_one, 2, 4)
    assert_restored(restore_one.wait(limit), restore_one)
    assert_restored(restore_two.wait(limit), restore_two)


def test_an_orbax_checkpoint_restores_on_several_processes(jobs, tmp_path):
    """Orbax (one process, 8 devices) writes the table; 2 processes x 4 devices restore it."""
    import jax
    import orbax.checkpoint as ocp

    import multiprocess_worker as worker

    path = tmp_path / "orbax"
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        ckptr.save(path, args=ocp.args.PyTreeSave(worker.build(jax.make_mesh((4, 2), ("data", "model")),
                                                               worker.entries())))
    job = jobs("restore_orbax", path, 2, 4)
    assert_restored(job.wait(deadline()), job)


# ---- who writes what ---------------------------------------------------------------------------

def test_each_process_writes_only_its_share(jobs, tmp_path):
    job = jobs("shares", tmp_path / "ckpt", 2, 4)
    results = job.wait(deadline())
    assert_saved(results, job)
    assert_restored(results, job)
    total = results[0]["total_bytes"]
    assert total >= 4 << 20
    for r in results:
        # dispatch_io's count is what went through write_regions, leaf by leaf
        assert sum(r["per_keypath"].values()) == r["bytes_written"]
        # The OS saw at least those bytes written, and far fewer than the whole checkpoint
        # (each process wrote about half; the rest is metadata, manifest and RPC traffic).
        assert r["bytes_written"] <= r["os_written"] < 0.75 * total, r
    sizes = results[0]["array_bytes"]
    for keypath in ["['w']", "['emb']", "['proj']", "['rep']"]:  # sharded, or replicated, 1 MiB each
        per_process = [r["per_keypath"].get(keypath, 0) for r in results]
        assert sum(per_process) == sizes[keypath], (keypath, per_process)
        assert all(n > 0 for n in per_process), (keypath, per_process)
    # the replicated array is split (its 64 chunks of 16 KiB spread over both processes)
    rep = [r["per_keypath"]["['rep']"] for r in results]
    assert abs(rep[0] - rep[1]) <= sizes["['rep']"] // 4, rep
    # host (numpy) data and the array on device 5 are written by their one owner
    assert [("['host_stats']" in r["per_keypath"]) for r in results] == [True, False]
    assert [("['single']" in r["per_keypath"]) for r in results] == [False, True]


def test_processes_that_planned_different_saves_all_refuse_it(jobs, tmp_path):
    """A leaf that is not a global array (jnp.ones: on each process's own device) makes the plans
    differ; every process refuses the save, naming the leaf, before anything is written."""
    job = jobs("process_local_leaf", tmp_path / "ckpt", 2, 4)
    results = job.wait(deadline())
    for r in results:
        assert r.get("save_error", "").startswith("ValueError"), results
        assert "first at ['a_local']" in r["save_error"] and "process(es) [1]" in r["save_error"], r["save_error"]
    assert not committed(tmp_path / "ckpt") and leftovers(tmp_path) == ["logs"], leftovers(tmp_path)


def test_processes_that_store_a_save_differently_all_refuse_it(jobs, tmp_path):
    """Processes whose options store chunks differently (here compression) would commit metadata
    that describes some chunks wrongly: every process refuses, naming the options, before writing."""
    job = jobs("different_compression", tmp_path / "ckpt", 2, 4)
    results = job.wait(deadline())
    for r in results:
        error = r.get("save_error", "")
        assert error.startswith("ValueError") and "different options" in error and "process(es) [1]" in error, results
        assert "'compression': ['zstd', 3]" in error and "'compression': None" in error, error
    assert not committed(tmp_path / "ckpt") and leftovers(tmp_path) == ["logs"], leftovers(tmp_path)


# ---- failures ------------------------------------------------------------------------------------

def test_write_failure_in_one_process_fails_every_process(jobs, tmp_path):
    path = tmp_path / "ckpt"
    job = jobs("write_fails", path, 2, 4, barrier_timeout=30)
    results = job.wait(deadline())
    failing, other = results[1], results[0]
    assert failing["is_worker_error"] and failing["worker"] == 1 and failing["keypath"] == "['w']", failing
    assert "['w']" in failing["error_message"] and "injected" in failing["error_message"], failing
    assert other["is_worker_error"], other
    assert other["error_message"].startswith(f"process 1 failed, so the save to {path} was not committed"), other
    assert "injected" in other["error_message"]
    assert other["worker"] == 1 and other["keypath"] == "['w']", other
    for r in results:  # a failure is reported at once, not after a barrier timeout
        assert r["elapsed"] < 10, r
    assert leftovers(tmp_path) == ["logs"]  # nothing committed, no temporary directory left


def test_checkpoint_manager_survives_a_failed_step_on_one_process(jobs, tmp_path):
    """Two processes share a CheckpointManager root (max_to_keep=1). Step 2 fails with ENOSPC in
    process 1's write of ['w']: both raise from wait() (process 0 naming process 1 and the
    leaf), once more from the manager, and step 2 is not committed; step 1 restores bit-exact
    on both; step 3 succeeds and retention (process 0 alone) leaves only step 3."""
    root = tmp_path / "root"
    job = jobs("manager_write_fails", root, 2, 4, barrier_timeout=30)
    results = job.wait(deadline())
    for r in results:
        assert r.get("traceback") is None, f"process {r['process']}: {r.get('traceback')}\n{job.report()}"
    failing, other = results[1], results[0]
    step2 = os.path.join(root, "2")
    assert failing["step_2"]["is_worker_error"], failing
    assert failing["step_2"]["worker"] == 1 and failing["step_2"]["keypath"] == "['w']", failing
    assert "worker 1 failed writing ['w']" in failing["step_2"]["error_message"], failing
    assert other["step_2"]["is_worker_error"], other
    assert other["step_2"]["error_message"].startswith(
        f"process 1 failed, so the save to {step2} was not committed"), other
    assert other["step_2"]["worker"] == 1 and other["step_2"]["keypath"] == "['w']", other
    for r in results:
        where = f"process {r['process']}: {r}"
        assert r["steps_after_1"] == [1], where
        message = r["step_2"]["error_message"]
        assert "['w']" in message and "No space left on device" in message and "[Errno 28]" in message, where
        assert r["elapsed"] < 10, where                      # at once, not after a barrier timeout
        assert r["manager_wait"] == r["step_2"], where       # the manager raises it once more...
        assert r["manager_wait_again"] is None, where        # ...and only once
        assert r["steps_after_2"] == [1] and not r["step_2_exists"], where
        checked, mismatches = r["restore_1"]
        assert checked > 0 and mismatches == [], where
        assert r["step_3"] is None and r["manager_wait_3"] is None, where   # no errors, process 1 included
        assert r["steps_after_3"] == [3], where
        checked, mismatches = r["restore_latest"]
        assert checked > 0 and mismatches == [], where
        assert "retention" not in job._tail(r["process"], "err", 10**6), job.report()   # nothing logged
    assert leftovers(root) == ["3"]


@pytest.mark.parametrize("where", ["sleep_before_save", "sleep_in_write"])
def test_stalled_process_times_out(jobs, tmp_path, where):
    """Process 1 stalls for barrier_timeout + 3 s (before save(), or in an on_write_end
    callback): process 0 raises BarrierTimeoutError naming it after about the timeout."""
    timeout = 3.0
    path = tmp_path / "ckpt"
    job = jobs(where, path, 2, 4, barrier_timeout=timeout)
    # Process 1 is left to fail however it does once it wakes (its coordinator is gone); it is
    # killed if it has not exited 15 s after process 0.
    results = job.wait(deadline(), needed=[0], grace=15)
    leader = results[0]
    assert leader["is_barrier_timeout"], leader
    assert leader["processes"] == [1], leader
    assert "process(es) [1]" in leader["error_message"], leader
    assert timeout * 0.9 <= leader["elapsed"] < timeout + 7, leader
    assert all(p.poll() is not None for p in job.procs)
    assert not committed(path)
    assert [n for n in leftovers(tmp_path) if n != "logs"] == []


# ---- scale-out restore ------------------------------------------------------------------------------

@pytest.mark.parametrize("processes, devices", [(2, 4), (4, 2)])
def test_restore_reads_every_stored_byte_once_per_job(jobs, tmp_path, processes, devices):
    """With the broadcast on, the regions several processes hold (replicated, model-sharded,
    numpy) are read by one of them and received by the others: the bytes read, summed over
    the processes, are the stored bytes -- by dispatch_io's count and by the OS's -- and no
    process reads much more than its share. Off, each process reads all it holds."""
    job = jobs("scaleout", tmp_path / "ckpt", processes, devices)
    results = job.wait(deadline())
    for r in results:
        assert r.get("error_type") is None, f"process {r['process']}: {r.get('traceback')}\n{job.report()}"
        for mode in ("on", "off"):
            assert r[mode]["mismatches"] == [] and r[mode]["checked"] > 0, (mode, r[mode]["mismatches"])
        assert r["verified"]["mismatches"] == [], r["verified"]
        assert r["replicated"]["mismatches"] == [] and r["replicated"]["checked"] > 0, r["replicated"]
    # onto a target replicated everywhere (a different replica structure), still read once in all
    replicated = [r["replicated"] for r in results]
    for r in replicated:
        assert sum(x["bytes_read"] for x in replicated) == r["bytes_read"] + r["bytes_broadcast"], replicated
    total = results[0]["total_bytes"]
    on = [r["on"] for r in results]
    off = [r["off"] for r in results]
    assert sum(r["bytes_read"] for r in on) == total, [r["bytes_read"] for r in on]
    for r in on:
        assert sum(r["per_keypath"].values()) == r["bytes_read"]
        assert r["bytes_read"] < 1.5 * total / processes, [x["bytes_read"] for x in on]   # about its share
        assert r["bytes_broadcast"] > 0
    # what each process received is what the others read of the regions it holds
    assert sum(r["bytes_read"] for r in off) > 1.4 * total, [r["bytes_read"] for r in off]   # rep, proj: twice+
    for r, r_off in zip(on, off):
        assert r["bytes_read"] + r["bytes_broadcast"] == r_off["bytes_read"], (r, r_off)
        assert r_off["bytes_broadcast"] == 0
    # the OS agrees: the files were read about once in all (plus manifests and RPCs), N times without
    os_on, os_off = sum(r["os_read"] for r in on), sum(r["os_read"] for r in off)
    assert total <= os_on < 1.3 * total, (os_on, total)
    assert os_off > 1.4 * total, (os_off, total)
    sizes = results[0]["array_bytes"]
    for keypath in ["['rep']", "['proj']"]:    # held by every process: split between them
        per_process = [r["per_keypath"].get(keypath, 0) for r in on]
        assert sum(per_process) == sizes[keypath] and min(per_process) > 0, (keypath, per_process)


def test_fsdp_restore_sends_each_piece_only_to_its_holders(jobs, tmp_path):
    """8 processes x 1 device, mesh ("data", "fsdp") = (2, 4), a 32 MiB state sharded over fsdp
    and replicated over data (each region held by 2 processes): bit-exact; every stored byte
    read once in the job; each process receives about the part of its regions it did not read
    itself (RestoreStats), and the loopback interface carries about the stored bytes once --
    not the all-gather's 7x (every process receiving every row)."""
    job = jobs("scaleout_fsdp", tmp_path / "ckpt", 8, 1)
    results = job.wait(time.monotonic() + 2 * HARD_LIMIT)
    assert_restored(results, job)
    total = results[0]["total_bytes"]
    assert sum(r["bytes_read"] for r in results) == total, [r["bytes_read"] for r in results]
    for r in results:
        assert r["held"] == total // 4, r
        missing = r["held"] - r["bytes_read"]
        assert 0.9 * missing <= r["bytes_received"] <= 1.1 * missing, (r["bytes_received"], missing)
        assert 0.9 * r["bytes_read"] <= r["bytes_sent"] <= 1.1 * r["bytes_read"], (r["bytes_sent"], r["bytes_read"])
    assert total <= results[0]["loopback"] <= 2 * total, (results[0]["loopback"], total)


@pytest.mark.parametrize("scenario, failing", [("scaleout_fails", 1), ("scaleout_leader_fails", 0)])
def test_a_failed_read_in_one_process_fails_every_process(jobs, tmp_path, scenario, failing):
    """One process's read of ['rep'] (a region both processes hold, broadcast) fails: both raise
    WorkerError naming that process and the key path, at once (not after a timeout); a retry
    without the fault then restores everything on both."""
    job = jobs(scenario, tmp_path / "ckpt", 2, 4, barrier_timeout=30)
    results = job.wait(deadline())
    for r in results:
        assert r["is_worker_error"] and r["worker"] == failing and r["keypath"] == "['rep']", r
        assert "['rep']" in r["error_message"] and "injected" in r["error_message"], r
        assert r["elapsed"] < 10, r
        assert r["retry"].get("mismatches") == [] and r["retry"]["checked"] > 0, r["retry"]
    other = results[1 - failing]
    assert other["error_message"].startswith(f"process {failing} failed reading ['rep']"), other


def test_a_stalled_reader_times_out_every_process(jobs, tmp_path):
    """Process 1 stalls in its read of ['rep'] for barrier_timeout + 3 s: process 0 raises
    BarrierTimeoutError naming it after about the timeout; process 1, once awake, raises too
    instead of entering the round's collective alone; then a retry restores everything."""
    timeout = 3.0
    job = jobs("scaleout_stalls", tmp_path / "ckpt", 2, 4, barrier_timeout=timeout)
    results = job.wait(deadline())
    leader, stalled = results
    assert leader["is_barrier_timeout"] and leader["processes"] == [1], leader
    assert "process(es) [1]" in leader["error_message"], leader
    assert timeout * 0.9 <= leader["elapsed"] < timeout + 7, leader
    assert stalled["is_barrier_timeout"] and stalled["processes"] == [1], stalled
    assert stalled["elapsed"] < 2 * timeout + 10, stalled
    for r in results:
        assert r["retry"].get("mismatches") == [] and r["retry"]["checked"] > 0, r["retry"]


def test_a_stalled_leader_times_out_every_process(jobs, tmp_path):
    """Process 0 -- which watches the rounds while the others wait on the coordination service
    for its decision -- stalls in its read of ['rep'] for twice the timeout + 3 s: process 1
    waits on the service for a timeout, then watches itself and raises BarrierTimeoutError
    naming process 0 a timeout later; process 0, once awake, raises too; then a retry
    restores everything."""
    timeout = 3.0
    job = jobs("scaleout_leader_stalls", tmp_path / "ckpt", 2, 4, barrier_timeout=timeout)
    leader, other = job.wait(deadline())
    assert other.get("is_barrier_timeout") and other["processes"] == [0], other
    assert 2 * timeout * 0.9 <= other["elapsed"] < 2 * timeout + 7, other
    assert leader.get("is_barrier_timeout") and leader["processes"] == [0], leader
    for r in (leader, other):
        assert r["retry"].get("mismatches") == [] and r["retry"]["checked"] > 0, r["retry"]


def test_crossing_restores_never_swap_data(jobs, tmp_path):
    """Two restores at once in each process (two dispatchers, two threads): each gives its own
    checkpoint's bytes or raises; neither returns the other's data."""
    job = jobs("scaleout_crossing", tmp_path / "ckpt", 2, 4, barrier_timeout=5)
    results = job.wait(deadline())
    for r in results:
        assert r.get("error_type") is None, r.get("traceback")
        assert set(r["outcomes"]) == {"a", "b"} and "wrong" not in r["outcomes"].values(), r["outcomes"]


def test_restore_from_s3_gets_every_stored_byte_once_per_job(jobs, s3_prefix, s3_server):
    """On an object store, through a proxy counting what the server sent: two processes
    restoring with the broadcast GET about the stored bytes once; without it, far more."""
    from s3_server import FaultyProxy

    path = f"{s3_prefix}/ckpt"
    saved = jobs("save_big", path, 2, 4)
    total = saved.wait(deadline())[0]["total_bytes"]
    proxy = FaultyProxy(s3_server.port)
    try:
        sent = {}
        for broadcast in ("1", "0"):
            before = proxy.bytes_sent.get("GET", 0)
            job = jobs("restore_big", path, 2, 4, env={"AWS_ENDPOINT_URL_S3": proxy.endpoint,
                                                       "DIO_TEST_BROADCAST": broadcast})
            results = job.wait(deadline())
            assert_restored(results, job)
            sent[broadcast] = proxy.bytes_sent.get("GET", 0) - before
            if broadcast == "1":
                assert sum(r["bytes_read"] for r in results) == total
    finally:
        proxy.stop()
    assert total <= sent["1"] < 1.3 * total, (sent, total)
    assert sent["0"] > 1.4 * total, (sent, total)


def test_a_colocated_dispatcher_restores_once_per_job(jobs, tmp_path):
    """The same split with the worker code run through colocated_python."""
    job = jobs("restore_colocated", tmp_path / "ckpt", 2, 4)
    results = job.wait(deadline())
    assert_restored(results, job)
    assert sum(r["bytes_read"] for r in results) == results[0]["total_bytes"]


def test_verify_in_a_job_checks_each_chunk_once_and_every_process_raises_what_any_found(jobs, tmp_path):
    """Dispatcher.verify on 2 processes: each checks about half of the stored chunks (its own
    count and the OS's), together all of them once; after two chunks of different leaves are
    corrupted, both processes raise the same CorruptCheckpointError naming both; where a chunk
    cannot be read, both raise for it."""
    path = tmp_path / "ckpt"
    saved = jobs("save_big", path, 2, 4, env={"DIO_TEST_CHECKSUMS": "1"})
    assert_saved(saved.wait(deadline()), saved)
    job = jobs("verify", path, 2, 4)
    results = job.wait(deadline())
    for r in results:
        assert r.get("error_type") is None, f"process {r['process']}: {r.get('traceback')}\n{job.report()}"
        assert r["verified"] and 0.3 * r["total_bytes"] < r["bytes_read"] < 0.7 * r["total_bytes"], r
        assert r["os_read"] < 0.75 * r["total_bytes"], r
    assert sum(r["bytes_read"] for r in results) == results[0]["total_bytes"]

    stored.flip_byte(stored.chunks(path, "['w']")[(0, 0)])
    stored.flip_byte(stored.chunks(path, "['rep']")[(0, 0)], offset=100)
    job = jobs("verify", path, 2, 4)
    results = job.wait(deadline())
    assert [r.get("error_type") for r in results] == ["CorruptCheckpointError"] * 2, job.report()
    assert results[0]["error_message"] == results[1]["error_message"]
    assert all(r["chunk_is_tuple"] for r in results)   # as with one process, though it came through JSON
    message = results[0]["error_message"]
    assert "2 chunk(s) do not match" in message and "['w'] chunk [0, 0]" in message and "['rep'] chunk [0, 0]" in message

    stored.remove_chunk(path, "['emb']", (1, 0))   # unreadable: its process fails, so does the other
    job = jobs("verify", path, 2, 4)
    results = job.wait(deadline())
    assert [(r.get("error_type"), r.get("keypath")) for r in results] == [("CorruptCheckpointError", "['emb']")] * 2, \
        job.report()
    assert sum("could not verify its part" in r["error_message"] for r in results) == 1, results


def test_a_verify_that_times_out_fails_everywhere_and_the_next_one_passes(jobs, tmp_path):
    """Process 1's verify stalls past the barrier timeout: process 0 names it in a
    BarrierTimeoutError and leaves word, so process 1, coming late, fails too rather than wait
    for process 0 at the end; both then verify again, and pass (no barrier left out of step)."""
    path = tmp_path / "ckpt"
    saved = jobs("save_big", path, 2, 4, env={"DIO_TEST_CHECKSUMS": "1"})
    assert_saved(saved.wait(deadline()), saved)
    job = jobs("verify_stalls", path, 2, 4, barrier_timeout=3)
    first, second = job.wait(deadline())
    assert (first.get("error_type"), first.get("processes")) == ("BarrierTimeoutError", [1]), job.report()
    assert second.get("error_type") == "CheckpointError" and "process 0 gave up waiting" in second["error_message"], \
        job.report()
    assert first["retry"] is True and second["retry"] is True
