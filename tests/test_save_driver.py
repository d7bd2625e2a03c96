"""The save driver on its own: a fake runner and a fake commit, no storage and no dispatcher.

The driver (``dispatch_io.save.driver.SaveRun``) is given everything it works with; these tests hand it
fakes that record what it asks for, and check the protocol: every batch copied and written once,
staging released, the agree -> manifest -> commit -> end order, failures agreed on and never
committed, and the completion callback called once whatever happens.
"""

import concurrent.futures
import json
import threading
import time

import jax
import numpy as np
import pytest

import dispatch_io as dio
from dispatch_io import manifest as manifest_lib
from dispatch_io.plan.batches import make_batches
from dispatch_io.plan.save_plan import plan_tree
from dispatch_io.runner import IOThreads, copy_chunks_to_host
from dispatch_io.save.driver import SaveRun
from dispatch_io.save.job import SaveJob
from dispatch_io.save.staging import StagingRing
from dispatch_io.workers import IOSettings

TIMEOUT = 60


class FakeWriter:
    def __init__(self, runner):
        self.runner = runner

    def write(self, regions, buffers):
        if self.runner.fail_keypath in [r.keypath for r in regions]:
            failed = concurrent.futures.Future()
            failed.set_exception(OSError(28, "No space left on device"))
            return failed
        for region, buf in zip(regions, buffers):   # copy: the staging slice is reused afterwards
            self.runner.written[(region.keypath, region.bounds)] = np.array(buf).tobytes()
        done = concurrent.futures.Future()
        done.set_result([None] * len(regions))
        return done

    def close(self):
        self.runner.closed += 1


class FakeRunner:
    host_staging = True

    def __init__(self, fail_keypath=None):
        self.threads = IOThreads(1, "fake")
        self.written, self.fail_keypath, self.closed = {}, fail_keypath, 0

    def open_writer(self, target):
        return FakeWriter(self)

    def copy_to_host(self, plan, chunks, sources, staging):
        return copy_chunks_to_host(plan, chunks, sources, staging)


class FakeCommit:
    leader = True
    target = type("Target", (), {"kvstore": {"driver": "memory", "path": "fake/"}, "context": None,
                                 "arrays": "arrays/"})()  # the arrays' metadata goes there

    def __init__(self):
        self.calls = []

    def peer_failed(self):
        return False

    def progress(self, nbytes):
        self.calls.append(("progress", nbytes))

    def agree(self, error, checksums):
        self.calls.append(("agree", error))
        if error is not None:
            raise error
        return checksums

    def fail(self, error):
        self.calls.append(("fail", error))
        raise error

    def commit(self, manifest, fsync, files=None):
        self.calls.append(("commit", json.loads(manifest)))

    def end(self):
        self.calls.append(("end",))


def run_save(tree, runner, commit, budget=4096, **callbacks):
    plan = plan_tree(tree, chunk_limit=budget // 4)
    leaves = jax.tree_util.tree_leaves(tree)
    batches = make_batches(plan, [dio.Priority.SYNC] * len(plan.leaves), budget // 2)
    job = SaveJob(plan, manifest_lib.scalar_values(plan, leaves), batches, "fake",
                  started=time.perf_counter(), progress=False, **callbacks)
    ring = StagingRing(budget)
    done = []
    run = SaveRun(job, leaves, runner, commit, ring, IOSettings(layout="files"), done.append)
    run.start()
    run.wait_until_sync_copied()
    run.join()
    return run, ring, done, plan


def test_the_driver_copies_writes_and_commits_each_chunk_once():
    tree = {"a": np.arange(1000, dtype=np.float32), "b": np.ones((16, 16), np.int8), "step": 7}
    runner, commit = FakeRunner(), FakeCommit()
    ends = []
    run, ring, done, plan = run_save(tree, runner, commit, on_write_end=ends.append)
    stats = run.future.result(TIMEOUT)
    assert stats.bytes_written == 1000 * 4 + 256 and stats.batches > 1
    assert done == [run] and runner.closed == 1 and ring.in_use == 0 and stats.peak_host_bytes <= 4096
    assert sorted(ends) == ["['a']", "['b']"]
    # Every chunk of the plan written once, with its bytes.
    assert sorted(runner.written) == sorted((plan.leaves[c.leaf].keypath, c.region) for c in plan.chunks)
    a = b"".join(v for (k, _), v in sorted(runner.written.items()) if k == "['a']")
    assert a == tree["a"].tobytes()
    # agree, then the manifest (built by the driver, with the scalar), then commit, then end.
    kinds = [c[0] for c in commit.calls if c[0] != "progress"]
    assert kinds == ["agree", "commit", "end"], kinds
    manifest = next(c[1] for c in commit.calls if c[0] == "commit")
    assert [leaf["keypath"] for leaf in manifest["leaves"]] == ["['a']", "['b']", "['step']"]
    assert manifest["leaves"][2]["value"] is not None


def test_a_failed_write_is_agreed_on_and_never_committed():
    tree = {"a": np.arange(1000, dtype=np.float32), "b": np.ones((16, 16), np.int8)}
    runner, commit = FakeRunner(fail_keypath="['b']"), FakeCommit()
    transferred = []
    run, ring, done, _ = run_save(tree, runner, commit, on_transfer_end=transferred.append)
    with pytest.raises(dio.WorkerError, match=r"\['b'\].*No space left") as info:
        run.future.result(TIMEOUT)
    assert info.value.keypath == "['b']"
    kinds = [c[0] for c in commit.calls if c[0] != "progress"]
    assert kinds == ["agree"], kinds                       # no manifest, no commit
    assert done == [run] and runner.closed == 1 and ring.in_use == 0
    assert sorted(transferred) == ["['a']", "['b']"]      # every leaf released, once


def test_the_callback_thread_is_one_of_the_runners():
    """Callbacks run on threads the runner's IOThreads know (so a dispatcher can refuse calls from them)."""
    runner, commit = FakeRunner(), FakeCommit()
    seen = []
    run, *_ = run_save({"a": np.zeros(8, np.float32)}, runner, commit,
                       on_transfer_end=lambda k: seen.append(runner.threads.is_current()))
    run.future.result(TIMEOUT)
    assert seen == [True] and not runner.threads.is_current()
    assert threading.current_thread() is threading.main_thread()


def test_save_batches_share_staging_between_the_writers_and_one_copy():
    """A batch per write thread plus one being copied; half the staging where a share would be
    under 8 MiB (a commit per batch would cost more than the overlap gains)."""
    MiB = 1 << 20
    assert dio.Options(host_memory_budget=256 * MiB, write_threads=2).batch_bytes == 256 * MiB // 3
    assert dio.Options(host_memory_budget=256 * MiB, write_threads=3).batch_bytes == 64 * MiB
    assert dio.Options(host_memory_budget=256 * MiB, write_threads=1).batch_bytes == 128 * MiB
    assert dio.Options(host_memory_budget=256 * MiB, compression="zstd", write_threads=2).batch_bytes == 64 * MiB // 3
    assert dio.Options(host_memory_budget=4 * MiB).batch_bytes == 2 * MiB
