"""The local tier in real 4-process x 2-device jobs, killed for real, every restore checked byte for
byte with the bytes read per source counted. Mesh (data=2, fsdp=4), tests/jobs/job_local_tier.py: a bad
local chunk comes from the other holder; permuted process ids map copies by what they hold; a lost
process's regions come from its peers; both holders lost -> the newest persistent step, only their
regions read from it; a process that never comes makes the others raise BarrierTimeoutError naming it;
a process killed during its local save; the README's loop resumes a killed job with its root emptied;
a torn local info or processes sharing one local path. Pure FSDP with one replica per region
(tests/jobs/job_fsdp_replicas.py) survives a lost host; data-parallel copies within one host
(tests/jobs/job_replicas_in_one_host.py) do not count as surviving it."""

import json
import os
import re
import shutil
import signal

import storage_helpers as sh
from conftest import finish_job, kill_job, start_job, wait_for
from dispatch_io.storage import sealed


LIMIT = 90
HELD = 64 * 16 * 4 // 2 + 16 * 64 * 4 // 2 + 32 * 4   # bytes each process holds: half of w and m, all of b
SOLO = 8 * 4 * 4                                        # and s, process 0's alone (2 regions)


def _start(root, local, mode, barrier_timeout=None, shared=False):
    """The 4 processes of job_local_tier.py (``shared``: a state without process 0's own leaf ``s``)."""
    return start_job("job_local_tier.py", [root, local, mode], barrier_timeout=barrier_timeout,
                     extra={"DIO_TEST_TIERS_SHARED": "1"} if shared else None)


def _train_and_kill(root, local):
    """Train to step 9 (local saves 0, 2, .., 8; persistent 0, 6), then SIGKILL every process."""
    procs = _start(root, local, "train")
    try:
        for out in wait_for(procs, "step 9"):
            assert re.findall(r"^saved (\d+)$", out, re.M) == ["0", "2", "4", "6", "8"], out
    finally:
        kill_job([procs[1]] + procs)   # process 1 first, then the rest


def _resumed(outs):
    found = [re.search(r"^resumed (\d+) exact (\w+) local (\d+) persistent (\d+) received (\d+) "
                       r"peer_regions (\d+) persistent_regions (\d+)$", out, re.M) for out in outs]
    assert all(found), outs
    return [(int(m[1]), m[2] == "True", int(m[3]), int(m[4]), int(m[5]), int(m[6]), int(m[7])) for m in found]


W, M, K, BIG = 64 * 16 * 4 // 4, 16 * 64 * 4 // 4, 8 * 2 * 4 // 4, 4096 * 256 * 4 // 4   # a process's share of each
SHARE = W + M + K + BIG                                                       # w, m, k, big: a quarter each process
B, S = 32 * 4, 8 * 4 * 4                                                      # b (everywhere), s (process 0's)
B, S = 32 * 4, 8 * 4 * 4                                                      # b (everywhere), s (process 0's)


def _start_fsdp(root, local, mode, extra=None):
    """The 4 processes of job_fsdp_replicas.py (``extra``: environment, e.g. DIO_TEST_PARITY)."""
    return start_job("job_fsdp_replicas.py", [root, local, mode], extra=extra)


def train_fsdp(root, local, extra=None):
    """job_fsdp_replicas.py to step 9 (local saves 0, 2, .., 8; persistent 0, 6), then SIGKILL every process."""
    procs = _start_fsdp(root, local, "train", extra)
    try:
        for out in wait_for(procs, "step 9"):
            assert re.findall(r"^saved (\d+)$", out, re.M) == ["0", "2", "4", "6", "8"], out
    finally:
        kill_job(procs)


def _resumed_fsdp(outs):
    """Per process (step, exact, local, persistent, received, bytes read by its second restore)."""
    found = [re.search(r"^resumed (\d+) exact (\w+) local (\d+) persistent (\d+) received (\d+) rchar (\d+)$",
                       out, re.M) for out in outs]
    assert all(found), outs
    return [(int(m[1]), m[2] == "True", int(m[3]), int(m[4]), int(m[5]), int(m[6])) for m in found]


def _run_in_one_host(root, local, mode):
    """Run job_replicas_in_one_host.py to its end; each process's output."""
    return finish_job(start_job("job_replicas_in_one_host.py", [root, local, mode]))

def test_a_lost_process_resumes_from_its_peers_and_both_holders_lost_from_persistent(tmp_path):
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    _train_and_kill(root, local)
    info = json.loads((tmp_path / "local" / "2" / "8" / "info.json").read_text())
    assert (info["tier"], info["process"], info["copies"]) == ("local", 2, 1), info   # s: on process 0 alone
    assert info["held"]["['w']"] == [[[0, 16], [0, 16]], [[16, 32], [0, 16]]] and "['s']" not in info["held"], info
    # A flipped byte in process 0's copy of w's region 0 (step 8): that region comes from process 2's copy.
    bad = sh.chunks(tmp_path / "local" / "0" / "8", "['w']")[(0, 0)]
    sh.flip_byte(bad)
    results = _resumed(finish_job(_start(root, local, "resume")))
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
    results = _resumed(finish_job(_start(root, local, "resume")))
    print("per process (step, exact, local, persistent, received, peer regions, persistent regions):", results)
    assert all(r[:2] == (8, True) and r[3] == 0 and r[5:] == (10, 0) for r in results), results
    assert [r[2] for r in results] == [128, 128 + SOLO, HELD, HELD], results
    assert [r[4] for r in results] == [4096 + SOLO, 4096, 0, 0], results
    for a, b in ((0, 2), (1, 0), (2, 1)):
        os.rename(swap[a], swap[b])
    shutil.rmtree(str(local).replace("{process}", "1"))       # process 1's host is gone with its disk
    results = _resumed(finish_job(_start(root, local, "resume")))
    print("per process (step, exact, local, persistent, received, peer regions, persistent regions):", results)
    assert all(r[:2] == (8, True) for r in results), results                  # the newest local step, bit-exact
    assert sum(r[3] for r in results) == 0, results                           # nothing from persistent storage
    assert results[1][2] == 0 and results[1][4] == HELD, results              # process 1: all from its peers
    assert [r[2] for r in results] == [HELD + SOLO, 0, HELD, HELD], results   # each other's own bytes, once
    assert all(r[5:] == (5, 0) for r in results), results     # w's and m's regions 2, 3 and b came from peers
    # Both holders of fsdp regions 0 and 1 lost (and s): step 6 (persisted), those regions from the root only.
    for p in (0, 2):
        shutil.rmtree(str(local).replace("{process}", str(p)))
    results = _resumed(finish_job(_start(root, local, "resume")))
    print("per process (step, exact, local, persistent, received, peer regions, persistent regions):", results)
    assert all(r[:2] == (6, True) for r in results), results
    lost = 64 * 16 * 4 // 2 + 16 * 64 * 4 // 2 + SOLO                   # w's and m's regions 0 and 1, s
    assert sum(r[3] for r in results) == lost and results[1][3] == results[3][3] == 0, results
    assert all(r[5:] == (5, 6) for r in results), results
    # A process that never comes to the restore: the others raise BarrierTimeoutError naming it.
    procs = _start(root, local, "stall", barrier_timeout=3)
    try:
        wait_for(procs[:3], "timed out waiting for [3]")
    finally:
        kill_job(procs)


def test_a_process_killed_during_its_local_save_leaves_the_step_unagreed_and_the_job_resumes_the_one_before(
        tmp_path):
    """Process 1 is SIGKILLed mid local save of step 10 (the others commit theirs, and their save fails
    naming process 1: the job never agreed the step, so their retention keeps what they had): its step 10
    never commits and its leftovers are removed on restart. Step 10's regions are all held between the
    survivors' copies (process 1's through process 3), but the job never agreed it whole: their infos
    say so ("agreed": false, "local"), and the restart resumes step 8, the newest step the job agreed,
    each process from its own copy, nothing from the root; step 8 is then promoted, every chunk once."""
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    procs = _start(root, local, "die", barrier_timeout=10)   # the survivors wait that long for process 1
    try:
        assert procs[1].wait(timeout=LIMIT) == -signal.SIGKILL
        wait_for([procs[i] for i in (0, 2, 3)], "failed 10 processes [1]")
    finally:
        kill_job(procs)
    out = procs[1].stdout.read()
    assert "saved 8" in out and "saved 10" not in out, out
    assert 10 not in [int(n) for n in os.listdir(tmp_path / "local" / "1") if n.isdigit()]
    for p in (0, 2, 3):
        info = json.loads((tmp_path / "local" / str(p) / "10" / "info.json").read_text())
        assert (info["agreed"], info["copies"], info["durability"]) == (False, 1, "local"), info
        assert json.loads((tmp_path / "local" / str(p) / "8" / "info.json").read_text())["agreed"] is True
    for step in (0, 6):   # LocalTier(promote=True): the persistent steps were promoted from the local ones
        assert json.loads((root / str(step) / "info.json").read_text())["promoted"] == "local"
    assert sh.chunks(root / "6", "['w']")[(0, 0)].read() == sh.chunks(tmp_path / "local" / "0" / "6", "['w']")[(0, 0)].read()
    outs = finish_job(_start(root, local, "promote"))
    results = _resumed(outs)
    print("per process (step, exact, local, persistent, received, peer regions, persistent regions):", results)
    assert all(r[:2] == (8, True) and r[3] == 0 and r[4] == 0 for r in results), results
    assert sorted(os.listdir(tmp_path / "local" / "1")) == ["4", "6", "8"], "leftovers of the killed save remain"
    # Promoted from the local copies: every chunk written once job-wide, by a holder, its bytes those of
    # the local copies; the root's step 8 restores exactly, with its item.
    promoted = [re.search(r"^promoted 8 exact True written (\d+) cfg 8$", out, re.M) for out in outs]
    assert all(promoted), outs
    assert sum(int(m[1]) for m in promoted) == 2 * 4096 + 2 * 128, outs
    for keypath in ("['w']", "['m']", "['b']", "['s']"):
        stored = sh.chunks(root / "8", keypath)
        copies = [sh.chunks(tmp_path / "local" / str(p) / "8", keypath) for p in range(4)]
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
        for out in wait_for(procs, "step 9"):
            assert re.findall(r"^saved (\d+)$", out, re.M) == ["0", "2", "4", "6", "8"], out
        procs[0].send_signal(signal.SIGKILL)
        assert procs[0].wait(timeout=LIMIT) == -signal.SIGKILL
    finally:
        kill_job(procs)
    shutil.rmtree(str(local).replace("{process}", "0"))
    results = _resumed(finish_job(_start(root, local, "resume", shared=True)))
    print("per process (step, exact, local, persistent, received, peer regions, persistent regions):", results)
    assert all(r[:2] == (8, True) for r in results), results
    assert sum(r[3] for r in results) == 0, results                            # nothing from persistent storage
    assert [r[2] for r in results] == [0, HELD, HELD, HELD], results           # each survivor its own, once
    assert [r[4] for r in results] == [HELD, 0, 0, 0], results                 # process 0: all from a peer
    assert all(r[5:] == (5, 0) for r in results), results    # w's and m's regions 0, 1 and b came from peers


def test_the_readme_loop_resumes_a_killed_job_from_local_steps_with_the_root_emptied(tmp_path):
    """The README's loop (resume the newest step, read its Json item ``cfg``, train on) after every
    process was killed, the root emptied and process 1's local disk lost: the job resumes local step 8
    from the surviving copies, and process 1 reads ``cfg`` too -- a peer shares the step's Json items at
    the restore (before, ``item()`` raised FileNotFoundError there and the loop died on process 1)."""
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    procs = _start(root, local, "loop9", shared=True)   # local saves every 2 steps, persistent every 6
    try:
        wait_for(procs, "step 9")
    finally:
        kill_job(procs)                                      # SIGKILL, every process
    assert sorted(os.listdir(root)) == ["0", "6"], os.listdir(root)
    for name in os.listdir(root):                         # the root emptied: only local steps 4, 6, 8 are left
        shutil.rmtree(root / name)
    shutil.rmtree(tmp_path / "local" / "1")               # and process 1's disk lost
    outs = finish_job(_start(root, local, "loop", shared=True))
    for out in outs:
        # the same listing on every process: each region on the 2 processes of its data-parallel group
        assert "steps {4: 'replicated 2', 6: 'replicated 2', 8: 'replicated 2'}\n" in out, out
        assert "resumed 8 from root 0\n" in out, out                # the newest local step, nothing from the root
        assert re.findall(r"^step (\d+)$", out, re.M) == ["9", "10", "11", "12"], out
        assert "final 12 exact True\n" in out, out                  # the uninterrupted run's bytes


def test_one_process_with_a_torn_local_info_does_not_fail_the_job_restore(tmp_path):
    """4 processes; process 1's local step 8 has a torn info.json (a full RAM disk, a crash while the OS
    wrote it back). Its regions are also held by process 3: the job resumes step 8 (bit-exact), process
    1's copy treated as lost -- as a wiped directory is -- rather than process 1 raising a bare
    JSONDecodeError before the gather while the three others wait out the barrier timeout."""
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    _train_and_kill(root, local)
    (tmp_path / "local" / "1" / "8" / "info.json").write_text('{"step": 8, "tier": "lo')
    procs = _start(root, local, "resume", barrier_timeout=10)
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    report = "\n".join(f"process {i}: rc {p.returncode} {o[-300:]!r} {e[-600:]!r}"
                       for i, (p, (o, e)) in enumerate(zip(procs, outs)))
    assert all(p.returncode == 0 for p in procs), report
    assert all(r[:2] == (8, True) for r in _resumed([o for o, _ in outs])), report


def test_processes_sharing_one_local_path_are_told_or_kept_apart(tmp_path):
    """4 processes on one host, LocalTier path without {process} (the docs say it is needed there;
    nothing checks it): every process saves its local steps into the same <local>/<step>/ with
    overwrite=True, replacing the others' commits. Either the manager refuses (naming {process}) or
    the job still resumes the newest local step bit-exact."""
    import subprocess
    from conftest import kill_job, wait_for
    root, local = tmp_path / "root", tmp_path / "local"
    procs = _start(root, local, "train")
    try:
        outs = wait_for(procs, "step 9")
    except AssertionError as exc:
        kill_job(procs)
        assert "{process}" in str(exc), exc     # refused, naming the fix
        return
    kill_job(procs)
    procs = _start(root, local, "resume", barrier_timeout=10)
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    except subprocess.TimeoutExpired:
        outs = [("", "timeout")] * 4
    finally:
        kill_job(procs)
    report = "\n".join(f"process {i}: rc {p.returncode} {o[-300:]!r} {e[-600:]!r}"
                       for i, (p, (o, e)) in enumerate(zip(procs, outs)))
    assert all(p.returncode == 0 for p in procs), report
    results = _resumed([o for o, _ in outs])
    assert all(r[:2] == (8, True) for r in results), (results, sorted(os.listdir(local)))


def test_pure_fsdp_state_survives_a_lost_host_through_its_replicas(tmp_path, capsys):
    from dispatch_io import cli

    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    train_fsdp(root, local)
    info = [json.loads((tmp_path / "local" / str(p) / "8" / "info.json").read_text()) for p in range(4)]
    assert [(i["copies"], i["domains"], i["durability"]) for i in info] == [(2, 2, "replicated 2")] * 4, info
    # One process's local step holds its share and its replicas, not the whole state: a verify of it
    # checks what it holds (sound), and finds a flipped bit in one of its chunks, naming the leaf.
    step = str(tmp_path / "local" / "2" / "8")
    assert cli.main(["verify", step]) == 0, capsys.readouterr().err
    chunk = next(iter(sh.chunks(step, "['w']").values()))
    sh.flip_byte(chunk)
    assert cli.main(["verify", step]) == 1
    assert "NOT sound" in (err := capsys.readouterr().err) and "['w']" in err, err
    sh.flip_byte(chunk)   # back as saved: the copy serves the restores below
    # Each process's replicas are spread over both processes of the other host, leaf by leaf (bytes
    # balanced: big, 4 MiB, by the first variant (p + 2) % 4; w, m, k and s by the second, 0 <-> 3,
    # 1 <-> 2) and within each leaf by device place (replica_plan.by_place): a process's second
    # device sends by the other variant, so even one giant leaf is read back by two holders (s, on
    # process 0's devices alone, is stored as one chunk: it goes whole).
    for p in range(4):   # the peers holding copies of regions p alone holds (not b's, held by all)
        for keypath in ("['big']", "['w']"):
            peers = {q for q in range(4) if q != p for region in info[p]["sharded"][keypath]
                     if region in info[q]["held"][keypath] and region not in info[q]["sharded"][keypath]}
            assert peers == ({2, 3} if p < 2 else {0, 1}), (p, keypath, peers)
    # w on process 2: process 1's first device's rows (3 - p), process 0's second's ((p + 2) % 4), its own.
    assert info[2]["held"]["['w']"] == [[[8, 16], [0, 16]], [[16, 24], [0, 16]], [[32, 40], [0, 16]],
                                        [[40, 48], [0, 16]]], info[2]
    assert info[2]["held"]["['big']"][:2] == [[[0, 512], [0, 256]], [[1536, 2048], [0, 256]]], info[2]
    assert "['s']" in info[3]["held"] and "['s']" not in info[3]["sharded"], info[3]
    # Process 2 died after the job agreed step 8 but before its info said so: the others' word is the
    # job's agreement, so its copy still counts (the restores below read it).
    path = tmp_path / "local" / "2" / "8" / "info.json"
    agreed = path.read_text()
    path.write_text(json.dumps({**sealed.loads(agreed), "agreed": False, "copies": 1, "durability": "local"}))
    # A restart onto another mesh, (data=2, fsdp=4): each region is cut from two saved ones, all local.
    # It requires durability "replicated": the infos that say agreed count, not process 2's "local".
    results = _resumed_fsdp(finish_job(_start_fsdp(root, local, "reshard", {"DIO_TEST_DURABILITY": "replicated"})))
    print("onto (data=2, fsdp=4), per process (step, exact, local, persistent, received):", results)
    assert all(r[:2] == (8, True) and r[3] == 0 for r in results), results
    assert results[2][2] > 0, results   # process 2's copy read
    path.write_text(agreed)
    # Host 0 (processes 0 and 1) is gone with its disks: everything comes from the replicas on host 1.
    for p in (0, 1):
        shutil.rmtree(str(local).replace("{process}", str(p)))
    outs = finish_job(_start_fsdp(root, local, "promote"))
    results = _resumed_fsdp(outs)
    print("per process (step, exact, local, persistent, received):", results)
    assert all(r[:2] == (8, True) for r in results), results                 # the newest local step, bit-exact
    assert sum(r[3] for r in results) == 0, results                          # nothing from persistent storage
    assert results[0][2] == results[1][2] == 0, results                      # 0 and 1 receive all they hold:
    assert results[0][4] == SHARE + B + S and results[1][4] == SHARE + B, results
    # 2 and 3 read their own regions and the replicas of 0's and 1's (each region once; b once for both),
    # each byte once: the replicas read for 0 and 1 are checked in memory as they are read (from /proc/self/io)
    assert results[2][2] + results[3][2] == 2 * (SHARE + B) + 2 * SHARE + S, results
    assert all(0.95 * r[2] <= r[5] <= 1.05 * r[2] for r in results[2:]), results
    # ... and step 8 is then promoted to the root from 2's and 3's copies alone (theirs and the replicas),
    # each chunk written once: 0 and 1 write nothing; the root's step 8 restores exactly.
    promoted = [re.search(r"^promoted 8 exact True written (\d+)$", out, re.M) for out in outs]
    assert all(promoted), outs
    assert [int(m[1]) > 0 for m in promoted] == [False, False, True, True], outs
    assert sum(int(m[1]) for m in promoted) == 4 * SHARE + B + S, outs   # every stored byte, once
    # Process 3 lost too: only process 2's copy is left (its own regions, and of 0's and 1's each leaf's
    # regions on one of their two devices) -> step 8 (now persisted); the rest is read from the root.
    shutil.rmtree(str(local).replace("{process}", "3"))
    # and a flipped byte in process 2's replica of one of process 1's w regions (rows 16..24): a restore
    # with every own copy intact leaves replicas unchecked; one that reads them checks them as it reads them
    # for process 1 (in memory: no pass before) and does not send the bad one
    sh.flip_byte(sh.chunks(tmp_path / "local" / "2" / "8", "['w']")[(2, 0)])
    results = _resumed_fsdp(finish_job(_start_fsdp(root, local, "resume")))
    print("per process (step, exact, local, persistent, received):", results)
    assert all(r[:2] == (8, True) for r in results), results
    # from the root: the half of 0's and 1's regions whose copies were on 3 (and s, process 0's alone: one
    # chunk, kept whole by 3), 3's share (no copy left), and the one bad replica region
    assert [r[3] for r in results] == [SHARE // 2 + S, SHARE // 2 + 8 * 16 * 4, 0, SHARE], results
    assert results[2][2] == 2 * SHARE + B and 0.95 * results[2][2] <= results[2][5] <= 1.05 * results[2][2], \
        results   # process 2 read its copy once: its own regions, b and its replicas (half of 0's and of 1's)


def test_a_clock_policy_with_replicas_takes_the_same_local_saves_everywhere(tmp_path):
    """Local saves by EveryNSeconds with clocks that disagree (process 1's runs twice as fast): each
    save sends replicas (a collective), so every process must take the same ones -- process 0
    decides for all. Every process ends with the same local steps; nothing hangs."""
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    procs = _start_fsdp(root, local, "clock")
    try:
        outs = wait_for(procs, "local steps " + "[0, 3, 6, 9]")   # process 0's clock: 10 s a step
    finally:
        kill_job(procs)
    assert all("Traceback" not in out for out in outs), outs


def test_data_parallel_copies_within_one_host_do_not_survive_that_host(tmp_path):
    """LocalTier(replicas=1, domains=hosts) keeps its promise that a lost host loses nothing (design.md
    "Failure model": "any `replicas` lost processes (in different domains: a lost host) lose nothing";
    manager.md: regions are sent "to a peer in another failure domain") when the data axis lies inside a
    host: mesh (fsdp=2 across hosts, data=2 within a host, model=2), a usual layout with one process per
    GPU, where every region is held by the two processes of one host. Holders are counted per failure
    domain, so each region is sent to the other host and the step records 2 domains; with host 0 lost
    (its two local directories wiped) the job still resumes the step from the other host, not from
    persistent storage (here: nothing)."""
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    outs = _run_in_one_host(root, local, "save")
    saved = [re.search(r"^saved 2 copies (\d+) domains (\d+)$", out, re.M) for out in outs]
    assert all(saved), outs
    for p in (0, 1):                     # host 0 is gone with its disks
        shutil.rmtree(str(local).replace("{process}", str(p)))
    outs = _run_in_one_host(root, local, "resume")
    assert all(re.search(r"^resumed 2 exact True$", out, re.M) for out in outs), outs
    assert [int(m[2]) for m in saved] == [2] * 4, outs   # every region in both hosts
