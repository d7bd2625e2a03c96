"""Incremental saves in the local tier (``CheckpointManager(incremental=True, local=LocalTier(...))``):
a LoRA-shaped state (a large frozen base, small adapters that change every step) saved every step
stores the base once under the local path; every kept step restores bit-exact; local retention
retires a step still referenced and deletes it once nothing kept references it; a step promotion
copies is stored whole, so the promoted step is complete on its own; each process of a real job
stores its share of the base once (with replicas or parity: tests/test_tier_incremental_copies.py).

Stored bytes are measured on disk (every file under the local path).
"""

import json
import os
import re

import numpy as np
import pytest

import dispatch_io as dio
from conftest import assert_trees_bit_equal, finish_job, start_job
from dispatch_io import policies as P

BASE = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)   # 2 MiB, frozen
ADAPTERS = 512 * 8 * 4 + 8 * 1024 * 4                                                # 48 KiB, changing


def lora(step, base=BASE):
    return {"base": base, "lora": {"a": np.full((512, 8), step, np.float32),
                                   "b": np.full((8, 1024), -step, np.float32)}}


def stored(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def references(step_dir) -> list:
    with open(os.path.join(step_dir, "manifest.json")) as f:
        return sorted(int(r["step"]) for r in json.load(f).get("references") or [])


def test_a_lora_state_saved_every_step_stores_its_base_once(tmp_path):
    root, local = tmp_path / "root", tmp_path / "local"
    tier = dio.LocalTier(str(local), save_policy=P.EveryNSteps(1), keep_policy=P.LatestN(2))
    with dio.LocalDispatcher(checksums=True) as d, \
            dio.CheckpointManager(root, d, incremental=True, save_policy=P.EveryNSteps(5), local=tier) as mgr:
        for step in range(1, 9):
            mgr.save(step, lora(step)).wait()
            mgr.wait()
        # one base (in step 1, retired: unlisted, kept while referenced) + each kept step's adapters
        assert sorted(os.listdir(local)) == ["1", "7", "8"] and sorted(mgr.steps()) == [5, 7, 8]
        assert BASE.nbytes < stored(local) < BASE.nbytes + 8 * ADAPTERS + 256 * 1024, stored(local)
        assert references(local / "8") == [1]
        for step in (7, 8):
            assert_trees_bit_equal(mgr.restore(step, lora(0)), lora(step))
            d.verify(local / str(step))   # referenced chunks checked against their carried CRC-32Cs
        assert_trees_bit_equal(mgr.restore(5, lora(0)), lora(5))   # the root's own (incremental) save

        merged = BASE + 1   # the adapters merged into the base: a new base, stored once more
        for step in (9, 10):
            mgr.save(step, lora(step, merged)).wait()
            mgr.wait()
        assert sorted(os.listdir(local)) == ["10", "9"]   # step 1 referenced by no kept step: deleted
        assert references(local / "10") == [9]
        assert stored(local) < merged.nbytes + 2 * ADAPTERS + 256 * 1024
        assert_trees_bit_equal(mgr.restore(10, lora(0)), lora(10, merged))


def test_a_promoted_step_is_stored_whole_and_complete_in_the_root(tmp_path):
    root, local = tmp_path / "root", tmp_path / "local"
    tier = dio.LocalTier(str(local), save_policy=P.EveryNSteps(1), keep_policy=P.LatestN(3), promote=True)
    with dio.LocalDispatcher(checksums=True) as d, \
            dio.CheckpointManager(root, d, incremental=True, save_policy=P.EveryNSteps(3), local=tier) as mgr:
        for step in range(1, 6):
            mgr.save(step, lora(step)).wait()
            mgr.wait()
        assert references(local / "3") == []             # promoted: whole in the local tier ...
        assert references(local / "5") == [3]          # ... and the base of the steps after it
        assert references(root / "3") == []             # the promoted step is complete on its own
        assert sorted(os.listdir(root)) == ["3"]
        assert_trees_bit_equal(dio.LocalDispatcher().restore(root / "3", lora(0)), lora(3))
        assert d.verify(root / "3").verified
        with pytest.raises(ValueError, match=r"local step 5 .* saved incrementally .*references local step\(s\) 3\)"):
            mgr.promote(5)
        assert sorted(os.listdir(root)) == ["3"]         # nothing written
        assert_trees_bit_equal(mgr.restore(5, lora(0)), lora(5))


def test_each_process_of_a_job_stores_its_share_of_the_base_once(tmp_path):
    """A real 2-process job (tests/jobs/job_local_incremental.py): each process's local directory
    holds its half of the base once, however many steps it keeps, and restores bit-exact."""
    procs = start_job("job_local_incremental.py", [tmp_path / "root", tmp_path / "local" / "{process}"],
                      processes=2, devices=1)
    for out in finish_job(procs, limit=240):
        found = re.search(r"^stored (\d+) steps (.*) exact (\w+)$", out, re.M)
        assert found and found[3] == "True", out
        assert found[2] == "['1', '6', '7']", out   # the base's step: retired, kept while referenced
        assert BASE.nbytes // 2 < int(found[1]) < BASE.nbytes // 2 + 7 * ADAPTERS // 2 + 256 * 1024, out


def test_a_saves_own_incremental_is_the_local_tiers_too(tmp_path):
    """``save(..., incremental=True)`` on a manager built without it saves the local step incrementally
    too (replicas and parity: tests/test_tier_incremental_copies.py)."""
    local = tmp_path / "local"
    tier = dio.LocalTier(str(local), save_policy=P.EveryNSteps(1))
    with dio.CheckpointManager(tmp_path / "root", save_policy=P.EveryNSteps(5), local=tier) as mgr:
        mgr.save(1, lora(1), incremental=True).wait()
        mgr.save(2, lora(2), incremental=True).wait()
        mgr.wait()
        assert references(local / "2") == [1] and stored(local / "2") < 2 * ADAPTERS + 64 * 1024
        assert_trees_bit_equal(mgr.restore(2, lora(0)), lora(2))
