"""The local tier never loses the newest step whole job-wide (issue 45): a real 4-process x 2-device
pure-FSDP job (tests/jobs/job_lost_process.py) whose process 1 is SIGKILLed at step 9 while the three
survivors -- their training step has no cross-process collective -- go on training and saving.

Each survivor's local saves of steps 10 and 12 fail, naming process 1, within the barrier timeout
(their job-wide agreement cannot complete; with replicas or parity they stop before the save's
collectives), and since no later step is whole job-wide, local retention (``LatestN(2)``) deletes
nothing: step 8, the newest step every process committed, stays.
The job restarted -- with process 1's disk gone where the tier can rebuild it (replicas, parity),
with it kept where nothing else holds process 1's share (neither) -- resumes step 8 bit for bit; with
replicas, process 1's share is read back by both processes of the other host (each leaf's replica went
by one of two orders: ``replica_plan.assign_variants``), not by one."""

import json
import re
import signal

import pytest

from conftest import finish_job, kill_job, start_job, wait_for

BARRIER = 5   # seconds: the survivors' failed saves take about this long each
SHARE = (64 * 16 * 4 + 16 * 64 * 4 + 8 * 2 * 4) // 4   # w, m, k (job_states.py): a quarter each process
B, S = 32 * 4, 8 * 4 * 4                               # b (everywhere), s (process 0's)


def _train(tmp_path, mode):
    """The train phase; each survivor's output (process 1 SIGKILLed once all reached step 9)."""
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    procs = start_job("job_lost_process.py", [root, local, mode, "train"], barrier_timeout=BARRIER)
    try:
        before = wait_for(procs, "step 9", limit=240)
        procs[1].send_signal(signal.SIGKILL)
        assert procs[1].wait(timeout=60) == -signal.SIGKILL
        (tmp_path / "go").write_text("")
        after = wait_for([procs[0], procs[2], procs[3]], "trained", limit=240)
        return [before[p] + out for p, out in zip((0, 2, 3), after)]
    finally:
        kill_job(procs)


@pytest.mark.parametrize("mode", ["neither", "replicas", "parity"])
def test_survivors_of_a_killed_process_keep_the_newest_whole_step_and_resume_it(tmp_path, mode):
    outs = _train(tmp_path, mode)
    for out in outs:
        assert re.findall(r"^saved (\d+)$", out, re.M) == ["0", "2", "4", "6", "8"], out
        failed = re.findall(r"^failed (\d+) (\w+) processes (.*?):", out, re.M)
        assert [s for s, _, _ in failed] == ["10", "12"], out          # each save after the loss fails...
        assert all(who == "[1]" for _, _, who in failed), out          # ...naming the dead process
        steps = json.loads(re.search(r"^local steps (\[.*\])$", out, re.M)[1])
        # Retention kept the latest 2 while the job agreed (4 dropped), then nothing: 6 and 8 stay.
        assert steps[:2] == [6, 8] and all(s > 8 for s in steps[2:]), out
        durability = {int(s): d for s, d in
                      json.loads(re.search(r"^durability (\{.*\})$", out, re.M)[1]).items()}
        whole = {"neither": "local", "replicas": "replicated 2", "parity": "parity 2"}[mode]
        assert durability[8] == whole, out
        # A step the job never completed claims no redundancy it did not reach (with replicas or parity
        # the save stops before its collectives: all of the job is not there).
        assert all(durability[s] == "local" for s in steps[2:]) and (mode == "neither") == bool(steps[2:]), out
    if mode != "neither":   # the host is gone with its disk: the tier rebuilds process 1's share
        import shutil
        shutil.rmtree(tmp_path / "local" / "1")
    outs = finish_job(start_job("job_lost_process.py", [tmp_path / "root", tmp_path / "local" / "{process}",
                                                         mode, "resume"], barrier_timeout=30), limit=240)
    for out in outs:
        assert re.search(r"^latest 8$", out, re.M), out
        assert re.search(r"^resumed 8 exact True$", out, re.M), out
    if mode == "replicas":   # process 1's share comes back from both processes of the other host, not one
        read = [tuple(map(int, re.search(r"^read local (\d+) received (\d+)$", out, re.M).groups())) for out in outs]
        extra = [local - own for (local, _), own in zip(read, (SHARE + B + S, 0, SHARE + B, SHARE + B))]
        # process 1 receives all it holds; each of its regions is read once for it (b by a holder reading it anyway)
        assert read[1] == (0, SHARE + B) and sum(extra) == SHARE, read
        assert extra[0] == 0 and extra[2] > 0 and extra[3] > 0, read   # 2 and 3 each read a part of process 1's share


def test_parity_rows_that_fail_on_one_process_fail_the_save_everywhere_and_claim_nothing(tmp_path):
    """Nobody dies, but process 2's parity rows of step 10 fail to save (a full disk): the save of step 10
    fails on every process, naming process 2 (not logged and counted), every process's info.json of
    step 10 says "local" (its parity never completed job-wide) and the job does not list it (never
    agreed whole: one process's save of it failed) nor promotes it, while step 12, whose rows all
    committed, says "parity 2"; retention ran again only once step 12 was whole."""
    outs = finish_job(start_job("job_lost_process.py", [tmp_path / "root", tmp_path / "local" / "{process}",
                                                         "parity", "rowsfail"], barrier_timeout=BARRIER), limit=240)
    for out in outs:
        assert re.findall(r"^saved (\d+)$", out, re.M) == ["0", "2", "4", "6", "8", "12"], out
        failed = re.findall(r"^failed (\d+) (\w+) processes (.*?):", out, re.M)
        assert failed == [("10", "LocalSaveError", "[2]")], out    # process 2's own error is its cause
        durability = json.loads(re.search(r"^durability (\{.*\})$", out, re.M)[1])
        assert durability == {"10": "local", "12": "parity 2"}, out
        assert re.search(r"^steps \{0: 'persisted', 12: 'parity 2'\}$", out, re.M), out
        assert re.search(r"^promote 10 refused: .*never agreed whole by the job", out, re.M), out   # nor persisted


def test_a_process_late_to_a_local_save_the_others_gave_up_fails_it_too_and_the_job_goes_on(tmp_path):
    """Process 1 comes to its local save of step 4 (replicas) only after the others gave it up (their
    wait timed out, naming it): the job decided the step once, so process 1 fails it too, naming
    itself -- rather than finding every process's arrival recorded, entering the replica exchange
    alone and hanging there. Likewise it reports its committed save of step 8 only after the others
    gave the agreement up: it fails step 8 too, rather than counting it whole alone (and running its
    retention on that word). Every process saves steps 6, 10 and 12 together; after a rollback to
    step 0, step 4 is saved again, asked afresh (not answered by its first save's decision). Then a
    save of step 6 fails on process 2 alone (every process fails it, naming process 2; the save policy
    then says the same everywhere: the step was taken) and is forced again: every process saves it --
    the retry is not answered by the failed attempt's reports. A save that process 3 fails before it
    even comes to its local save fails everywhere, and the next one is saved by all."""
    procs = start_job("job_lost_process.py", [tmp_path / "root", tmp_path / "local" / "{process}", "replicas", "stall"],
                      barrier_timeout=BARRIER)
    before = {0: "", 2: "", 3: ""}
    try:
        for step in (4, 8):
            outs = wait_for([procs[0], procs[2], procs[3]], f"gave up {step}", limit=240)
            for p, out in zip((0, 2, 3), outs):
                before[p] += out
            (tmp_path / f"go{step}").write_text("")
    except BaseException:
        kill_job(procs)
        raise
    outs = finish_job(procs, limit=240)
    for p, out in before.items():
        outs[p] = out + outs[p]
    for out in outs:
        assert re.findall(r"^saved (\d+)$", out, re.M) == ["0", "2", "6", "10", "12"], out
        failed = re.findall(r"^failed (\d+) (\w+) processes (.*?):", out, re.M)
        assert failed == [("4", "BarrierTimeoutError", "[1]"), ("8", "BarrierTimeoutError", "[1]")], out
        assert re.search(r"^steps \{0: 'persisted', 10: 'replicated 2', 12: 'replicated 2'\}$", out, re.M), out
        assert re.search(r"^again 4 saved\nsteps \{0: 'persisted', 4: 'replicated 2'\}$", out, re.M), out
        assert re.search(r"^again 6 saved\nsteps \{0: 'persisted', 4: 'replicated 2', 6: 'replicated 2'\}$",
                         out, re.M), out
    assert [re.search(r"^first 6 failed (\w+) processes (.*)\npolicy saves 6 again: (\w+)$", out, re.M).groups()
            for out in outs] == [("LocalSaveError", "[2]", "False")] * 2 + [("ValueError", "None", "False"),
                                                                           ("LocalSaveError", "[2]", "False")], outs
    # A save process 3 fails before its local save begins (its item is no JSON) fails everywhere, naming
    # it, and the next local save is taken by every process: the keys did not drift apart.
    assert [re.findall(r"^then (\d+) (\w+)(?: (\w+) processes (.*))?$", out, re.M) for out in outs] == \
        [[("8", "failed", "BarrierTimeoutError", "[3]"), ("10", "saved", "", "")]] * 3 + \
        [[("8", "failed", "ValueError", "None"), ("10", "saved", "", "")]], outs


def test_a_step_a_process_died_before_the_job_agreed_is_neither_whole_nor_replicated(tmp_path):
    """Process 1 is SIGKILLed once its local save of step 10 committed (the replicas exchanged), before it
    reports to the job's agreement: the survivors commit their step 10 (their own shares and the
    replicas they received -- together every region) but the job never agreed it. Their save fails naming process 1, their info of step 10 says
    "local" (not "replicated 2": process 1's copy and the replicas it held are gone), and the job
    restarted without process 1's disk resumes step 8, the newest step it agreed whole -- not
    step 10 from what the survivors' directories hold."""
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    procs = start_job("job_lost_process.py", [root, local, "replicas", "diesaving"], barrier_timeout=BARRIER)
    try:
        assert procs[1].wait(timeout=240) == -signal.SIGKILL
        outs = wait_for([procs[0], procs[2], procs[3]], "trained", limit=240)
    finally:
        kill_job(procs)
    for out in outs:
        assert re.findall(r"^saved (\d+)$", out, re.M) == ["0", "2", "4", "6", "8"], out
        failed = re.findall(r"^failed (\d+) (\w+) processes (.*?):", out, re.M)
        assert [(s, who) for s, _, who in failed] == [("10", "[1]"), ("12", "[1]")], out
        durability = json.loads(re.search(r"^durability (\{.*\})$", out, re.M)[1])
        assert durability == {"6": "replicated 2", "8": "replicated 2", "10": "local"}, out
    for p in (0, 2, 3):
        info = json.loads((tmp_path / "local" / str(p) / "10" / "info.json").read_text())
        assert (info["agreed"], info["copies"], info["durability"]) == (False, 1, "local"), info
    import shutil
    shutil.rmtree(tmp_path / "local" / "1")
    outs = finish_job(start_job("job_lost_process.py", [root, local, "replicas", "resume"], barrier_timeout=30),
                      limit=240)
    for out in outs:
        assert re.search(r"^latest 8$", out, re.M), out
        assert re.search(r"^resumed 8 exact True$", out, re.M), out
