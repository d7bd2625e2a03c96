"""One training loop for both tiers: ``latest_step()`` / ``all_steps()`` list the steps restorable whole
from any tier, ``restore(step, target)`` reads a step through the tiers whether or not the root holds it,
so the README's loop, unchanged but for ``local=``, resumes from a local-only step. A real 4-process job
killed with SIGKILL, its root emptied, resumes and ends bit-exact at the uninterrupted run's state."""

import os
import re
import shutil

import jax
import numpy as np
import pytest

import dispatch_io as dio
from dispatch_io import policies
from dispatch_io.manager.tiers import plan as tiers_plan
from test_manager_multiprocess import _finish
from test_tiers import _kill, _start, _wait_for
from test_tiers_edges import _exact, _setup


def test_the_readme_loop_resumes_a_killed_job_from_local_steps_with_the_root_emptied(tmp_path):
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    procs = _start(root, local, "loop9", shared=True)   # local saves every 2 steps, persistent every 6
    try:
        _wait_for(procs, "step 9")
    finally:
        _kill(procs)                                      # SIGKILL, every process
    assert sorted(os.listdir(root)) == ["0", "6"], os.listdir(root)
    for name in os.listdir(root):                         # the root emptied: only local steps 4, 6, 8 are left
        shutil.rmtree(root / name)
    outs = _finish(_start(root, local, "loop", shared=True))
    for out in outs:
        # the same listing on every process: each region on the 2 processes of its data-parallel group
        assert "steps {4: 'replicated 2', 6: 'replicated 2', 8: 'replicated 2'}\n" in out, out
        assert "resumed 8 from root 0\n" in out, out                # the newest local step, nothing from the root
        assert re.findall(r"^step (\d+)$", out, re.M) == ["9", "10", "11", "12"], out
        assert "final 12 exact True\n" in out, out                  # the uninterrupted run's bytes


def test_one_process_lists_and_restores_steps_of_either_tier(tmp_path, mesh):
    target, state = _setup(mesh)
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    d = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True)
    with dio.CheckpointManager(tmp_path / "root", d, save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        for step in range(5):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
        assert mgr.persistent_steps() == [0, 3] and mgr.all_steps() == [0, 2, 3, 4] and mgr.latest_step() == 4
        assert mgr.steps() == {0: "persisted", 2: "local", 3: "persisted", 4: "local"}   # one process: one copy
        assert [mgr.durability(s) for s in mgr.all_steps()] == list(mgr.steps().values())
        for step in (2, 3, 4):     # a local-only step, a persistent one (read from the local copy), the newest
            assert _exact(mgr.restore(step, target), state(step)), step
            stats = mgr.last_tier_restore
            assert (stats.step, stats.bytes_read_persistent) == (step, 0 if step != 3 else 256 * 64 * 4), stats
        with pytest.raises(FileNotFoundError, match="at step 1, neither"):
            mgr.restore(1, target)
        assert mgr.best_step("loss", "min") is None        # persistent steps only, as before
    shutil.rmtree(tmp_path / "local" / "0" / "4")   # the only copy of step 4 lost: not restorable whole
    with dio.CheckpointManager(tmp_path / "root", d, save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        assert mgr.all_steps() == [0, 2, 3] and mgr.latest_step() == 3
    d.close()


def test_whole_steps_are_those_every_region_of_which_some_process_holds():
    half = lambda lo, hi: {"held": {"w": [[[lo, hi], [0, 4]]]}, "shapes": {"w": [8, 4]}}  # noqa: E731
    reports = {0: {5: half(0, 4), 7: half(0, 4), 9: half(0, 4)}, 1: {5: half(4, 8), 9: {"held": {}}},
               2: {7: {"held": {"w": [[[4, 6], [0, 4]], [[6, 8], [0, 4]]]}}}}   # 7: regions of two meshes
    assert tiers_plan.whole_steps(reports, [3]) == {3: "persisted", 5: "local", 7: "local"}
    assert tiers_plan.whole_steps({0: {4: {"held": {"w": [[[0, 8], [0, 4]]]}}}}, []) == {}   # no shapes recorded
    assert tiers_plan.whole_steps({0: {4: {**half(0, 8), "shapes": {"w": ["8", 4]}}}}, [1]) == {1: "persisted"}
    copied = {p: {4: {**half(0, 8), "copies": n}} for p, n in ((0, 2), (1, 3))}   # the fewest copies recorded
    assert tiers_plan.whole_steps(copied, []) == {4: "replicated 2"}


def test_a_local_step_records_its_leaves_shapes(mesh):
    target, state = _setup(mesh)
    record = tiers_plan.local_record(state(0), 0, 1)
    assert record["shapes"] == {"['w']": [256, 64]}
    assert jax.tree_util.tree_structure(target) == jax.tree_util.tree_structure(state(0))
    assert isinstance(record["held"]["['w']"], list) and np.prod(record["shapes"]["['w']"]) == 256 * 64
