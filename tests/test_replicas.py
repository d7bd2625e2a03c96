"""Replicas in the local tier: a pure-FSDP job (each region on one process) survives a lost host.

A real 4-process x 2-device job (tests/replicas_job.py, ``LocalTier(replicas=1, domains=(0, 0,
1, 1))``), killed for real, every restore checked byte for byte with the bytes read per source
counted; then the pure planners of where replicas go and which leaves need them."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import storage_helpers as sh
from dispatch_io.manager.tiers import replica_plan
from dispatch_io.manager.tiers import plan as tiers_plan
from test_manager_multiprocess import _finish
from test_multiprocess import child_env, free_port
from test_tiers import _kill, _wait_for

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "replicas_job.py")
SHARE = (64 * 16 * 4 + 16 * 64 * 4 + 8 * 2 * 4) // 4                      # w, m, k: a quarter each process
B, S = 32 * 4, 8 * 4 * 4                                                      # b (everywhere), s (process 0's)


def _start(root, local, mode):
    env, port = child_env(2, None), free_port()
    return [subprocess.Popen([sys.executable, JOB, str(i), str(port), str(root), str(local), mode], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]


def _resumed(outs):
    found = [re.search(r"^resumed (\d+) exact (\w+) local (\d+) persistent (\d+) received (\d+)$", out, re.M)
             for out in outs]
    assert all(found), outs
    return [(int(m[1]), m[2] == "True", int(m[3]), int(m[4]), int(m[5])) for m in found]


def test_pure_fsdp_state_survives_a_lost_host_through_its_replicas(tmp_path):
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    procs = _start(root, local, "train")
    try:
        for out in _wait_for(procs, "step 9"):
            assert re.findall(r"^saved (\d+)$", out, re.M) == ["0", "2", "4", "6", "8"], out
    finally:
        _kill(procs)
    info = [json.loads((tmp_path / "local" / str(p) / "8" / "info.json").read_text()) for p in range(4)]
    assert [(i["copies"], i["domains"], i["durability"]) for i in info] == [(2, 2, "replicated 2")] * 4, info
    # Process 2 keeps process 0's regions (the replica goes to the other host), s (process 0's alone) too.
    assert info[2]["held"]["['w']"] == [[[0, 8], [0, 16]], [[8, 16], [0, 16]], [[32, 40], [0, 16]],
                                        [[40, 48], [0, 16]]], info[2]
    assert "['s']" in info[2]["held"] and "['s']" not in info[2]["sharded"], info[2]
    # A restart onto another mesh, (data=2, fsdp=4): each region is cut from two saved ones, all local.
    results = _resumed(_finish(_start(root, local, "reshard")))
    print("onto (data=2, fsdp=4), per process (step, exact, local, persistent, received):", results)
    assert all(r[:2] == (8, True) and r[3] == 0 for r in results), results
    # Host 0 (processes 0 and 1) is gone with its disks: everything comes from the replicas on host 1.
    for p in (0, 1):
        shutil.rmtree(str(local).replace("{process}", str(p)))
    outs = _finish(_start(root, local, "promote"))
    results = _resumed(outs)
    print("per process (step, exact, local, persistent, received):", results)
    assert all(r[:2] == (8, True) for r in results), results                 # the newest local step, bit-exact
    assert sum(r[3] for r in results) == 0, results                          # nothing from persistent storage
    assert results[0][2] == results[1][2] == 0, results                      # 0 and 1 receive all they hold:
    assert results[0][4] == SHARE + B + S and results[1][4] == SHARE + B, results
    # 2 and 3 read their own regions and the replicas of 0's and 1's (each region once; b once for both)
    assert results[2][2] + results[3][2] == 2 * (SHARE + B) + 2 * SHARE + S, results
    # ... and step 8 is then promoted to the root from 2's and 3's copies alone (theirs and the replicas),
    # each chunk written once: 0 and 1 write nothing; the root's step 8 restores exactly.
    promoted = [re.search(r"^promoted 8 exact True written (\d+)$", out, re.M) for out in outs]
    assert all(promoted), outs
    assert [int(m[1]) > 0 for m in promoted] == [False, False, True, True], outs
    assert sum(int(m[1]) for m in promoted) == 4 * SHARE + B + S, outs   # every stored byte, once
    # Process 3 lost too: process 1's regions have no local copy left -> step 8 (now persisted); only they
    # are read from the root.
    shutil.rmtree(str(local).replace("{process}", "3"))
    # and a flipped byte in process 2's replica of one of process 0's w regions (rows 0..8): a restore
    # with every own copy intact leaves replicas unchecked, but one that reads them checks them first
    sh.flip_byte(sh.chunks(tmp_path / "local" / "2" / "8", "['w']")[(0, 0)])
    results = _resumed(_finish(_start(root, local, "resume")))
    print("per process (step, exact, local, persistent, received):", results)
    assert all(r[:2] == (8, True) for r in results), results
    # from the root: processes 1's and 3's shares (no copy left), and the one bad replica region (8 x 16 x 4 B)
    assert [r[3] for r in results] == [8 * 16 * 4, SHARE, 0, SHARE], results


def test_a_clock_policy_with_replicas_takes_the_same_local_saves_everywhere(tmp_path):
    """Local saves by EveryNSeconds with clocks that disagree (process 1's runs twice as fast): each
    save sends replicas (a collective), so every process must take the same ones -- process 0
    decides for all. Every process ends with the same local steps; nothing hangs."""
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    procs = _start(root, local, "clock")
    try:
        outs = _wait_for(procs, "local steps " + "[0, 3, 6, 9]")   # process 0's clock: 10 s a step
    finally:
        _kill(procs)
    assert all("Traceback" not in out for out in outs), outs


@pytest.mark.parametrize("domains, expected", [
    ((0, 0, 1, 1), [(2, 3, 0, 1)]),                       # the other host
    (("a", "b", "a", "b"), [(1, 0, 3, 2)]),               # domains interleaved by process index
    ((0, 1, 2, 3), [(1, 2, 3, 0)]),                       # one process per host: the next one
    ((7, 7, 7, 7), [(1, 2, 3, 0)]),                       # one host: another process at least
])
def test_replica_orders_put_each_copy_in_another_domain(domains, expected):
    assert replica_plan.replica_orders(domains, 1) == expected


def test_replica_orders_for_two_replicas_use_distinct_processes_and_refuse_too_few():
    orders = replica_plan.replica_orders((0, 0, 1, 1, 2, 2), 2)
    for p in range(6):
        places = {p} | {order[p] for order in orders}
        assert len(places) == 3 and len({(0, 0, 1, 1, 2, 2)[q] for q in places}) == 3, orders
    with pytest.raises(ValueError, match="replicas=2.*3 processes.*has 2"):
        replica_plan.replica_orders((0, 1), 2)


def test_replicas_needed_counts_data_parallel_replicas():
    orders = replica_plan.replica_orders((0, 0, 1, 1), 1)
    assert replica_plan.replicas_needed([{0, 2}, {1, 3}], orders, 1) == 0      # data=2: already two holders
    assert replica_plan.replicas_needed([{0}, {1}, {2}, {3}], orders, 1) == 1  # pure FSDP: one copy each
    assert replica_plan.replicas_needed([{0, 1, 2, 3}], orders, 1) == 0        # replicated everywhere
    # A region whose only holders are swapped by the order gains nothing from it: reported, not hidden.
    assert replica_plan.replicas_needed([{0, 2}], orders, 2) == 1


def test_dispatcher_save_checks_copies_before_writing(tmp_path, mesh):
    """``Dispatcher.save(copies=)``: only with ``own=True``, only for stored array leaves, each replica
    its region's shape and dtype -- ValueError naming the key path, nothing written."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import dispatch_io as dio
    from dispatch_io.held import Replica
    w = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("data", "model")))
    device = jax.devices()[0]
    good = Replica(device, ((0, 2), (0, 4)), jax.device_put(np.zeros((2, 4), np.float32), device))
    with dio.LocalDispatcher() as dispatcher:
        with pytest.raises(ValueError, match="own=True"):
            dispatcher.save(tmp_path / "a", {"w": w}, copies={"['w']": [good]})
        with pytest.raises(ValueError, match=r"\['v'\] is not a stored array leaf"):
            dispatcher.save(tmp_path / "b", {"w": w}, own=True, copies={"['v']": [good]})
        bad = Replica(device, ((0, 2), (0, 4)), jax.device_put(np.zeros((2, 4), np.int32), device))
        with pytest.raises(ValueError, match=r"replica of \['w'\].*int32\[2, 4\], not float32\[2, 4\]"):
            dispatcher.save(tmp_path / "c", {"w": w}, own=True, copies={"['w']": [bad]})
        assert not any((tmp_path / name).exists() for name in "abc")
        # a replica of a region this process holds itself is not saved twice: its own shard is
        dispatcher.save(tmp_path / "d", {"w": w}, own=True, copies={"['w']": [good]}).wait()
        assert np.array_equal(np.asarray(dispatcher.restore(tmp_path / "d")["w"]), np.asarray(w))


def test_leaves_travel_in_rows_of_one_dtype_within_the_row_budget():
    """``replicas._groups``: one group per dtype while the row fits; a larger leaf travels alone."""
    from types import SimpleNamespace

    import numpy as np

    from dispatch_io.manager.tiers.replicas import _groups

    def leaf(name, dtype, width):
        return SimpleNamespace(keypath=name, data=SimpleNamespace(dtype=np.dtype(dtype)), width=width)

    leaves = [leaf("a", "f4", 10), leaf("b", "i4", 10), leaf("c", "f4", 10), leaf("d", "f4", 100), leaf("e", "f4", 1)]
    assert [[x.keypath for x in g] for g in _groups(leaves, row_bytes=80)] == [["a", "c"], ["d"], ["e"], ["b"]]
    assert [[x.keypath for x in g] for g in _groups(leaves, row_bytes=1 << 20)] == [["a", "c", "d", "e"], ["b"]]
