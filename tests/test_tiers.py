"""The local tier in a real 4-process x 2-device job (mesh data=2, fsdp=4), killed for real, every
restore checked byte for byte with the bytes read per source counted: a bad local chunk comes from
the other holder; permuted process ids map copies by what they hold; a lost process's regions come
from its peers; both holders lost -> the newest persistent step, only their regions read from it; a
process that never comes makes the others raise BarrierTimeoutError naming it; a process killed
during its local save. Then one process: the local tier beside the root, and the root alone."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
import storage_helpers as sh
from dispatch_io import policies
from test_manager_multiprocess import _finish
from test_multiprocess import child_env, free_port

TESTS = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(TESTS, "tiers_job.py")
LIMIT = 90
HELD = 64 * 16 * 4 // 2 + 16 * 64 * 4 // 2 + 32 * 4   # bytes each process holds: half of w and m, all of b
SOLO = 8 * 4 * 4                                        # and s, process 0's alone (2 regions)


def _start(root, local, mode, barrier_timeout=None, shared=False):
    """The 4 processes of tiers_job.py (``shared``: a state without process 0's own leaf ``s``)."""
    env, port = child_env(2, barrier_timeout, {"DIO_TEST_TIERS_SHARED": "1"} if shared else None), free_port()
    return [subprocess.Popen([sys.executable, JOB, str(i), str(port), str(root), str(local), mode], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait()


def _wait_for(procs, text: str) -> list[str]:
    """Each process's output up to the line ``text`` (failing, with its output, if it ends first)."""
    deadline, outs = time.monotonic() + LIMIT, []
    for i, p in enumerate(procs):
        lines = []
        while text + "\n" not in lines:
            line = p.stdout.readline()
            assert line and time.monotonic() < deadline, \
                f"process {i} ended before {text!r}:\n{''.join(lines)}\n{p.stderr.read()[-4000:]}"
            lines.append(line)
        outs.append("".join(lines))
    return outs


def _train_and_kill(root, local):
    """Train to step 9 (local saves 0, 2, .., 8; persistent 0, 6), then SIGKILL every process."""
    procs = _start(root, local, "train")
    try:
        for out in _wait_for(procs, "step 9"):
            assert re.findall(r"^saved (\d+)$", out, re.M) == ["0", "2", "4", "6", "8"], out
    finally:
        _kill([procs[1]] + procs)   # process 1 first, then the rest


def _resumed(outs):
    found = [re.search(r"^resumed (\d+) exact (\w+) local (\d+) persistent (\d+) received (\d+) "
                       r"peer_regions (\d+) persistent_regions (\d+)$", out, re.M) for out in outs]
    assert all(found), outs
    return [(int(m[1]), m[2] == "True", int(m[3]), int(m[4]), int(m[5]), int(m[6]), int(m[7])) for m in found]


def test_a_lost_process_resumes_from_its_peers_and_both_holders_lost_from_persistent(tmp_path):
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    _train_and_kill(root, local)
    info = json.loads((tmp_path / "local" / "2" / "8" / "info.json").read_text())
    assert (info["tier"], info["process"], info["copies"]) == ("local", 2, 1), info   # s: on process 0 alone
    assert info["held"]["['w']"] == [[[0, 16], [0, 16]], [[16, 32], [0, 16]]] and "['s']" not in info["held"], info
    # A flipped byte in process 0's copy of w's region 0 (step 8): that region comes from process 2's copy.
    bad = sh.chunks(tmp_path / "local" / "0" / "8", "['w']")[(0, 0)]
    sh.flip_byte(bad)
    results = _resumed(_finish(_start(root, local, "resume")))
    print("per process (step, exact, local, persistent, received, peer regions, persistent regions):", results)
    assert all(r[:2] == (8, True) and r[3] == 0 and r[5:] == (1, 0) for r in results), results
    # process 0 read its copy once (the bad region caught in memory as it was read), then that region alone
    # again, from process 2, which read it for process 0 once more
    assert results[0][4] == 1024 and results[0][2] == HELD + SOLO and results[2][2] == HELD + 1024, results
    sh.flip_byte(bad)                                           # mended (the flip is an XOR)
    # Processes 0 and 1 restart on each other's hosts (ids permuted): each copy is mapped by the
    # regions it holds, so 0 and 1 get their w and m regions from 2 and 3 (holders), and 0 its s
    # from 1, which has 0's old copy though it does not hold s now; b is everywhere.
    swap = [tmp_path / "local" / name for name in ("0", "1", "swap")]
    for a, b in ((0, 2), (1, 0), (2, 1)):
        os.rename(swap[a], swap[b])
    results = _resumed(_finish(_start(root, local, "resume")))
    print("per process (step, exact, local, persistent, received, peer regions, persistent regions):", results)
    assert all(r[:2] == (8, True) and r[3] == 0 and r[5:] == (10, 0) for r in results), results
    assert [r[2] for r in results] == [128, 128 + SOLO, HELD, HELD], results
    assert [r[4] for r in results] == [4096 + SOLO, 4096, 0, 0], results
    for a, b in ((0, 2), (1, 0), (2, 1)):
        os.rename(swap[a], swap[b])
    shutil.rmtree(str(local).replace("{process}", "1"))       # process 1's host is gone with its disk
    results = _resumed(_finish(_start(root, local, "resume")))
    print("per process (step, exact, local, persistent, received, peer regions, persistent regions):", results)
    assert all(r[:2] == (8, True) for r in results), results                  # the newest local step, bit-exact
    assert sum(r[3] for r in results) == 0, results                           # nothing from persistent storage
    assert results[1][2] == 0 and results[1][4] == HELD, results              # process 1: all from its peers
    assert [r[2] for r in results] == [HELD + SOLO, 0, HELD, HELD], results   # each other's own bytes, once
    assert all(r[5:] == (5, 0) for r in results), results     # w's and m's regions 2, 3 and b came from peers
    # Both holders of fsdp regions 0 and 1 lost (and s): step 6 (persisted), those regions from the root only.
    for p in (0, 2):
        shutil.rmtree(str(local).replace("{process}", str(p)))
    results = _resumed(_finish(_start(root, local, "resume")))
    print("per process (step, exact, local, persistent, received, peer regions, persistent regions):", results)
    assert all(r[:2] == (6, True) for r in results), results
    lost = 64 * 16 * 4 // 2 + 16 * 64 * 4 // 2 + SOLO                   # w's and m's regions 0 and 1, s
    assert sum(r[3] for r in results) == lost and results[1][3] == results[3][3] == 0, results
    assert all(r[5:] == (5, 6) for r in results), results
    # A process that never comes to the restore: the others raise BarrierTimeoutError naming it.
    procs = _start(root, local, "stall", barrier_timeout=3)
    try:
        _wait_for(procs[:3], "timed out waiting for [3]")
    finally:
        _kill(procs)


def test_a_process_killed_during_its_local_save_is_restored_from_its_peer(tmp_path):
    """Process 1 is SIGKILLed mid local save of step 10 (the others commit theirs): its step 10 never
    commits and its leftovers are removed on restart; step 10 is still whole through process 3."""
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    procs = _start(root, local, "die")
    try:
        assert procs[1].wait(timeout=LIMIT) == -signal.SIGKILL
        _wait_for([procs[i] for i in (0, 2, 3)], "saved 10")
    finally:
        _kill(procs)
    out = procs[1].stdout.read()
    assert "saved 8" in out and "saved 10" not in out, out
    assert 10 not in [int(n) for n in os.listdir(tmp_path / "local" / "1") if n.isdigit()]
    for step in (0, 6):   # LocalTier(promote=True): the persistent steps were promoted from the local ones
        assert json.loads((root / str(step) / "info.json").read_text())["promoted"] == "local"
    assert sh.chunks(root / "6", "['w']")[(0, 0)].read() == sh.chunks(tmp_path / "local" / "0" / "6", "['w']")[(0, 0)].read()
    outs = _finish(_start(root, local, "promote"))
    results = _resumed(outs)
    print("per process (step, exact, local, persistent, received, peer regions, persistent regions):", results)
    assert all(r[:2] == (10, True) and r[3] == 0 for r in results), results
    assert results[1][2] == 0 and results[1][4] == HELD, results
    assert sorted(os.listdir(tmp_path / "local" / "1")) == ["4", "6", "8"], "leftovers of the killed save remain"
    # Promoted from the copies of 0, 2 and 3 (1 has none): every chunk written once job-wide, by a
    # holder, its bytes those of the local copies; the root's step 10 restores exactly, with its item.
    promoted = [re.search(r"^promoted 10 exact True written (\d+) cfg 10$", out, re.M) for out in outs]
    assert all(promoted), outs
    assert int(promoted[1][1]) == 0 and sum(int(m[1]) for m in promoted) == 2 * 4096 + 2 * 128, outs
    for keypath in ("['w']", "['m']", "['b']", "['s']"):
        stored = sh.chunks(root / "10", keypath)
        copies = [sh.chunks(tmp_path / "local" / str(p) / "10", keypath) for p in (0, 2, 3)]
        assert stored and set(stored) == set().union(*copies), keypath
        for grid, value in stored.items():
            assert all(c[grid].read() == value.read() for c in copies if grid in c), (keypath, grid)


def test_the_coordinator_killed_with_its_disk_resumes_from_its_peers_with_nothing_from_persistent(tmp_path):
    """Process 0 -- the jax.distributed coordinator, and the leader of the restore's rooms (it lists
    the root for everyone) -- is SIGKILLed at step 9, the others stopped, its local directory lost.
    Restarted, the job resumes step 8 bit-exact (twice in a row) with no byte read from the root:
    process 0's regions come from process 2, the other process of its data replica group."""
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    procs = _start(root, local, "train", shared=True)
    try:
        for out in _wait_for(procs, "step 9"):
            assert re.findall(r"^saved (\d+)$", out, re.M) == ["0", "2", "4", "6", "8"], out
        procs[0].send_signal(signal.SIGKILL)
        assert procs[0].wait(timeout=LIMIT) == -signal.SIGKILL
    finally:
        _kill(procs)
    shutil.rmtree(str(local).replace("{process}", "0"))
    results = _resumed(_finish(_start(root, local, "resume", shared=True)))
    print("per process (step, exact, local, persistent, received, peer regions, persistent regions):", results)
    assert all(r[:2] == (8, True) for r in results), results
    assert sum(r[3] for r in results) == 0, results                            # nothing from persistent storage
    assert [r[2] for r in results] == [0, HELD, HELD, HELD], results           # each survivor its own, once
    assert [r[4] for r in results] == [HELD, 0, 0, 0], results                 # process 0: all from a peer
    assert all(r[5:] == (5, 0) for r in results), results    # w's and m's regions 0, 1 and b came from peers


def test_one_process_saves_locally_between_persistent_steps_and_restores_from_either(tmp_path, mesh):
    """One process (8 devices): local steps hold every region once; a wiped local tier -> the root.
    A manager without ``local=`` sees only the persistent steps, as before."""
    sharding, replicated = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P())
    target = {"w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=sharding),
              "r": jax.ShapeDtypeStruct((64,), np.int32, sharding=replicated)}

    def state(step):
        return {"w": jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8) + step, sharding),
                "r": jax.device_put(np.arange(64, dtype=np.int32) * step, replicated)}

    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0)   # leaves stored by region, not whole
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        for step in range(5):
            assert mgr.should_save(step) == (step % 2 == 0 or step % 3 == 0)
            mgr.save(step, state(step))
        mgr.wait()
        assert mgr.local.steps() == [0, 2, 4] and mgr.persistent_steps() == [0, 3]
        assert mgr.all_steps() == [0, 2, 3, 4] and mgr.latest_step() == 4   # restorable whole, from either tier
        # r is on all 8 devices: its one region is stored once (w: one chunk per device's region)
        assert len(sh.chunks(tmp_path / "local" / "0" / "4", "['r']")) == 1
        assert len(sh.chunks(tmp_path / "local" / "0" / "4", "['w']")) == 8
        restored = mgr.restore(None, target)
        stats = mgr.last_tier_restore
        assert (stats.step, stats.bytes_read_local, stats.bytes_read_persistent) == (4, 512 + 256, 0), stats
        assert all(np.array_equal(np.asarray(restored[k]), np.asarray(state(4)[k])) for k in target)
        # One process: one copy of each region -- "local"; a restore that requires more picks step 3.
        assert [mgr.durability(s) for s in (0, 2, 3, 4, 5)] == ["persisted", "local", "persisted", "local", None]
        assert mgr.step_info(3).durability == "persisted"
        restored = mgr.restore(None, target, durability="replicated")
        assert mgr.last_tier_restore.step == 3 and np.array_equal(np.asarray(restored["w"]), np.asarray(state(3)["w"]))
        with pytest.raises(ValueError, match="durability='safe'"):
            mgr.restore(None, target, durability="safe")
    shutil.rmtree(tmp_path / "local" / "0")
    with dio.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        restored = mgr.restore(None, target)
        stats = mgr.last_tier_restore
        assert (stats.step, stats.bytes_read_local, stats.bytes_read_persistent) == (3, 0, 512 + 256), stats
        assert all(np.array_equal(np.asarray(restored[k]), np.asarray(state(3)[k])) for k in target)
    dispatcher.close()
    with dio.CheckpointManager(tmp_path / "root") as mgr:
        assert mgr.latest_step() == 3 and mgr.local is None
    with dio.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        with pytest.raises(ValueError, match="needs a target"):
            mgr.restore(None)
        assert mgr.restore(3)["w"].shape == (16, 8)                     # a step named: the root, as before
    shutil.rmtree(tmp_path / "root")
    with dio.CheckpointManager(tmp_path / "root", local=tier) as mgr, pytest.raises(FileNotFoundError):
        mgr.restore(None, target)


def test_local_tier_arguments_are_checked():
    with pytest.raises(TypeError, match="cannot be part of a save_policy"):
        dio.LocalTier("/tmp/x", save_policy=policies.LatestN(2))
    with pytest.raises(ValueError, match="replicas"):
        dio.LocalTier("/tmp/x", replicas=-1)
    with pytest.raises(TypeError, match="domains"):
        dio.LocalTier("/tmp/x", replicas=1, domains="host-a")
    with pytest.raises(TypeError, match="directory path"):
        dio.LocalTier(None)


def test_replicas_need_peers_and_one_domain_per_process(tmp_path, mesh):
    """One process has no peer to keep a replica: refused when the manager opens, naming the count;
    so are domains that are not one per process."""
    with pytest.raises(ValueError, match="replicas=1.*2 processes.*has 1"):
        dio.CheckpointManager(tmp_path / "root", local=dio.LocalTier(tmp_path / "local", replicas=1))
    with pytest.raises(ValueError, match="2 failure domains for a job of 1"):
        dio.CheckpointManager(tmp_path / "root", local=dio.LocalTier(tmp_path / "local", domains=("a", "b")))


def test_an_unreadable_newest_local_step_is_lost_not_fatal(tmp_path, mesh):
    """The newest local step's manifest torn (a full RAM disk): that copy is lost to the restore,
    as a wiped one is; the next source serves (here the older local step 2 or persistent 3)."""
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=sharding)}

    def state(step):
        return {"w": jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8) + step, sharding)}

    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    dispatcher = dio.LocalDispatcher(checksums=True)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        for step in range(5):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
        (tmp_path / "local" / "0" / "4" / "manifest.json").write_text('{"format": "dispatch_')
        restored = mgr.restore(None, target)
        step = mgr.last_tier_restore.step
        assert step == 3 and np.array_equal(np.asarray(restored["w"]), np.asarray(state(3)["w"]))
    dispatcher.close()


def test_a_local_save_of_a_rolled_back_history_replaces_the_abandoned_local_steps(tmp_path, mesh):
    """A restore onto another sharding changes nothing. restore(0) onto the training sharding after
    local steps 2..6: nothing is deleted by the restore (an inspection may follow), local saves go
    on after 0, and the new history's first save (step 1, persistent) deletes local steps 2..6."""
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=sharding)}
    other = {"w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=NamedSharding(mesh, P()))}

    def state(step):
        return {"w": jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8) + step, sharding)}

    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        for step in (0, 2, 4, 6):
            mgr.save(step, state(step), local=True)                                # 0 persisted too
        mgr.wait()
        assert mgr.persistent_steps() == [0]
        mgr.restore(None, other)
        assert mgr.local.steps() == [0, 2, 4, 6] and not mgr.should_save(4)     # an eval copy: nothing changes
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        mgr.restore(0, target)
        assert mgr.local.steps() == [0, 2, 4, 6] and mgr.should_save(2)
        with pytest.raises(TypeError, match="bogus"):
            mgr.save(3, state(3), bogus=1)                                        # checked, though nothing is saved
        assert mgr.local.steps() == [0, 2, 4, 6]
        mgr.save(1, state(1), force=True)                                         # the new history's first save
        mgr.wait()
        assert mgr.local.steps() == [0] and mgr.should_save(2)
