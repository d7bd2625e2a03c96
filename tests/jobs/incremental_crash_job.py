"""A process saving incremental steps that SIGKILLs itself at a chosen point (run by
tests/test_incremental_crash.py).

    python incremental_crash_job.py ROOT STEPS POINT CALL

Saves steps 0..STEPS-1 of ``state(step)`` through ``CheckpointManager(incremental=True,
keep_policy=LatestN(2))``, printing ``saved N`` once each is committed. POINT names where it
kills itself, at the CALL-th time it gets there (``none``: never): ``retire-marked`` (a step
being retired has RETAINED beside COMMITTED), ``retired`` (COMMITTED deleted), ``deleting``
(a retired step's arrays deleted, RETAINED not yet), ``commit`` (a save's arrays written, its
manifest not yet).
"""

import os
import signal
import sys

import numpy as np

import dispatch_io as dio
from dispatch_io import policies
from dispatch_io.incremental import references
from dispatch_io.manager import incremental_retention


def state(step):
    rng = np.random.default_rng(0)
    frozen = rng.standard_normal((256, 256), dtype=np.float32) + (step >= 4)   # replaced once, at step 4
    moving = rng.standard_normal((64, 256), dtype=np.float32) + step
    sparse = rng.standard_normal((256, 64), dtype=np.float32)
    sparse[(step * 37) % 256] += step       # one row (one chunk) changes per step
    return {"frozen": frozen, "moving": moving, "sparse": sparse, "step": step}


def killer(point, call):
    seen = {"n": 0}

    def maybe(here):
        if here == point:
            seen["n"] += 1
            if seen["n"] == call:
                os.kill(os.getpid(), signal.SIGKILL)
    return maybe


if __name__ == "__main__":
    root, steps, point, call = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    maybe = killer(point, call)
    delete = incremental_retention._delete

    def _delete(store, key):
        delete(store, key)
        if key == "COMMITTED":
            maybe("retired")

    incremental_retention._delete = _delete
    retire = incremental_retention.retire

    def retire_then(root_, step):
        store = incremental_retention._store(root_, step)
        store.write(references.RETAINED, store.read("COMMITTED").result().value).result()
        maybe("retire-marked")
        retire(root_, step)

    incremental_retention.retire = retire_then
    delete_retired = incremental_retention.delete_retired

    def deleting(root_, step):
        import shutil
        shutil.rmtree(os.path.join(root_.step_path(step), "arrays"), ignore_errors=True)
        maybe("deleting")
        delete_retired(root_, step)

    incremental_retention.delete_retired = deleting
    from dispatch_io.incremental import changes as incremental
    merger = incremental.merger

    def merger_then(*args):
        merged = merger(*args)

        def killing(target):
            maybe("commit")
            return merged(target)
        return killing

    incremental.merger = merger_then
    dispatcher = dio.LocalDispatcher(8 << 20, max_chunk_bytes=16 << 10, small_leaf_bytes=0, progress=False)
    with dio.CheckpointManager(root, dispatcher, keep_policy=policies.LatestN(2), incremental=True) as mgr:
        start = mgr.latest_step()
        for step in range(0 if start is None else start + 1, steps):
            mgr.save(step, state(step))
            mgr.wait()
            print(f"saved {step}", flush=True)
