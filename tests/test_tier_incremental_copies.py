"""Incremental local saves with replicas or parity (issue 45): a real 4-process x 2-CPU-device
pure-FSDP job (tests/jobs/job_local_incremental_copies.py) saves a LoRA-shaped state (a frozen base,
small adapters that change every step) every step with ``CheckpointManager(incremental=True)`` to a
local tier with ``replicas=1`` or ``parity=2``, ``LatestN(2)`` and ``promote=True`` (the root saves step 4):

* each process stores its share of the base once -- and with replicas, the peer's share it keeps
  once too -- however many steps it keeps (measured on disk); parity rows are stored whole in each
  kept step (half a process's share here, k = 2), and deleted from a step retention retired;
  a frozen leaf on process 0 alone (saved whole, one chunk) is referenced there and in its peer's copy;
* step 4, which promotion copies, is stored whole locally (the base of the steps after it); the root's
  step 4 is complete on its own and bit-exact;
* retention keeps the base's step (retired: unlisted, its bytes kept) while the kept steps reference
  it, and deletes step 1 (the first base) once none does;
* with one process's local directory deleted (a lost host), the restarted job restores the newest
  step bit for bit through the tiers (``verify=True``: every chunk read, referenced ones too, checked
  against its CRC-32C) -- the lost share read from a peer's copy, or rebuilt from parity -- reading
  nothing from the root; the job then goes on saving incrementally, each process against its own base.
"""

import json
import os
import re
import shutil

import pytest

from conftest import finish_job, start_job

SHARE = 1024 * 256 * 4 // 4                               # a process's quarter of the 1 MiB base
ADAPTERS = (1024 * 8 * 4 + 8 * 256 * 4) // 4              # a process's quarter of the adapters
SLACK = 96 * 1024                                         # manifests, infos, markers of 3 steps


def stored(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def frozen_chunks(step_dir) -> dict:
    """{key path: (chunks stored, chunks by reference)} of the frozen leaves in a step's manifest."""
    with open(os.path.join(step_dir, "manifest.json")) as f:
        leaves = json.load(f)["leaves"]
    return {e["keypath"]: (sorted(e["stored"]["digests"]), sorted(g for gs in e["stored"].get("refs", {}).values()
                                                                  for g in gs))
            for e in leaves if e["keypath"] in ("['base']", "['solo']") and (e.get("stored") or {}).get("digests")}


@pytest.mark.parametrize("mode", ["replicas", "parity"])
def test_a_lora_state_is_saved_incrementally_with_copies_and_restored_after_a_lost_process(tmp_path, mode):
    root, local = tmp_path / "root", tmp_path / "local"
    outs = finish_job(start_job("job_local_incremental_copies.py", [root, local / "{process}", mode, "train"]),
                      limit=240)
    solo_kept = [False] * 4
    for process, out in enumerate(outs):
        steps = json.loads(re.search(r"^steps (\[.*\])$", out, re.M)[1])
        refs = {int(s): r for s, r in json.loads(re.search(r"^references (\{.*\})$", out, re.M)[1]).items()}
        # step 4 (promoted): stored whole, the base of 5 and 6 (retired: kept while they reference it)
        assert steps == [4, 5, 6] and refs == {5: [4], 6: [4]}, out
        assert re.search(r"^root 4 exact True verified True$", out, re.M), out
        for step in (5, 6):   # every chunk of the frozen leaves it keeps, its own and its peer's, by reference
            for keypath, chunks in frozen_chunks(local / str(process) / str(step)).items():
                assert chunks and chunks[0] == chunks[1], (process, step, keypath, chunks)
                solo_kept[process] |= keypath == "['solo']"
        size = stored(local / str(process))
        if mode == "replicas":   # its own share and the peer's it keeps, once each; 3 steps' adapters
            assert 2 * SHARE < size < 2 * SHARE + 3 * 2 * ADAPTERS + SLACK, (process, size)
        else:   # its share once; each kept step's parity rows whole (k = 2: half a share each), the retired's deleted
            assert [(local / str(process) / str(s) / "parity").is_dir() for s in steps] == [False, True, True]
            assert SHARE + 2 * SHARE // 2 < size < SHARE + 3 * ADAPTERS + 2 * (SHARE + ADAPTERS) // 2 + SLACK, \
                (process, size)
    # process 0's leaf, and its copy on one peer (parity: in process 0's parity group's rows instead)
    assert solo_kept[0] and sum(solo_kept) == (2 if mode == "replicas" else 1), solo_kept
    # a verify of one process's incremental local step checks the regions it holds, through its base
    from dispatch_io import cli
    assert cli.main(["verify", str(local / "2" / "6")]) == 0
    shutil.rmtree(local / "1")   # process 1's host is gone with its disk
    outs = finish_job(start_job("job_local_incremental_copies.py", [root, local / "{process}", mode, "resume"]),
                      limit=240)
    for process, out in enumerate(outs):   # the newest step from the local tier, though the root holds step 4
        assert re.search(r"^resumed 6 exact True persistent 0 0$", out, re.M), out
        # then each goes on against its own base; process 1, its directory new, writes step 7 whole
        assert f"\nthen 7 references {[] if process == 1 else [4]} exact True\n" in out, out
    assert sorted(os.listdir(root)) == ["4"]
