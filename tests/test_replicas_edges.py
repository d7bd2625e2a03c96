"""Local tier replicas, durability and restore policy: edge cases from an adversarial review.

Each test fails on the code it was written against (review-r1) and says what a fix should do."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io import policies
from test_manager_multiprocess import _finish
from test_multiprocess import child_env, free_port
from test_tiers_edges import _setup

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "replicas_edges_job.py")


def _train(tmp_path, state):
    """Local steps 0, 2, 4 (every 2), persistent steps 0, 3 (every 3); returns the manager's arguments."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        for step in range(5):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
        assert mgr.local.steps() == [0, 2, 4] and mgr.persistent_steps() == [0, 3]
    return tier


def _edit_info(tmp_path, step, edit):
    path = tmp_path / "local" / "0" / str(step) / "info.json"
    info = json.loads(path.read_text())
    edit(info)
    path.write_text(json.dumps(info))


@pytest.mark.parametrize("held", [5, [["a"]], [None], [[[0, 1, 2]]]], ids=["int", "strings", "null", "triple"])
def test_malformed_held_regions_in_a_local_info_crash_the_restore(tmp_path, mesh, held):
    """A local step's info.json whose "held" is valid JSON but not a list of regions (a bit flip on
    a RAM disk, a hand edit, a future format) makes restore(None, target) raise a bare TypeError /
    ValueError ("'int' object is not iterable", "not enough values to unpack") from deep inside
    the planner, instead of treating that step as lost the way an unreadable info.json is
    (local_steps.read_info: "never reported as held"). In a multi-process job the malformed info of
    one process crashes every process's restore (as_regions runs on every report gathered), so one
    bad file on one host of a 1,000-host job blocks resuming at all. Fix: validate "held" when the
    info is read (a dict of key path -> list of [[start, stop], ...] int pairs) and treat a step that
    fails as unreadable (logged, not used): the restore then picks the next step, bit-exact."""
    target, state = _setup(mesh)
    tier = _train(tmp_path, state)
    _edit_info(tmp_path, 4, lambda info: info.__setitem__("held", {"['w']": held}))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        restored = mgr.restore(None, target)
        step = mgr.last_tier_restore.step
        assert step in (2, 3), step        # step 4's copy is unusable: the next newest step serves
        assert np.asarray(restored["w"]).tobytes() == np.asarray(state(step)["w"]).tobytes()


def test_a_local_step_without_recorded_copies_is_skipped_by_a_default_restore(tmp_path, mesh):
    """restore(None, target) (durability="local": "all" local steps, tiers_plan.eligible's doc)
    silently skips every local step whose info.json has no integer "copies" -- local steps written
    before durability was recorded (dispatch_io before the replicas commit: a job restarted on the
    upgraded library), or whose "copies" is anything but an int. TierRestore._held only reports
    steps with an int "copies" to eligible(), which only lets through the steps it was told about.
    The job then resumes the older persistent step 3 instead of local step 4, with no warning: a
    silent loss of training progress. Fix: with durability="local" every usable local step is a
    candidate whatever its "copies" (a missing / malformed value counts as 1 copy for "replicated")."""
    target, state = _setup(mesh)
    tier = _train(tmp_path, state)
    _edit_info(tmp_path, 4, lambda info: [info.pop(k, None) for k in ("copies", "domains", "durability")])
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        restored = mgr.restore(None, target)
        assert mgr.last_tier_restore.step == 4, mgr.last_tier_restore   # is 3 (the persistent step)
        assert np.asarray(restored["w"]).tobytes() == np.asarray(state(4)["w"]).tobytes()


def _run_job(root, local, mode):
    env, port = child_env(2, None), free_port()
    procs = [subprocess.Popen([sys.executable, JOB, str(i), str(port), str(root), str(local), mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    return _finish(procs)


def test_data_parallel_copies_within_one_host_do_not_survive_that_host(tmp_path):
    """LocalTier(replicas=1, domains=hosts) promises that a lost host loses nothing (design.md
    "Failure model": "any `replicas` lost processes (in different domains: a lost host) lose
    nothing"; manager.md: regions are sent "to a peer in another failure domain"). But
    replica_plan.replicas_needed counts data-parallel copies without looking at domains: with the
    data axis inside a host (2 processes per host, mesh (fsdp=2 across hosts, data=2 within a host,
    model=2), a usual layout with one process per GPU) every region is held by the two processes of
    one host, so nothing is sent; the step's info even records "domains": 1 while calling itself
    "replicated 2". Host 0 lost (its two local directories wiped), restore finds no step: the job
    falls back to persistent storage (here: nothing). Fix: count holders per failure domain when
    deciding which leaves need replicas (replicas_needed / send / spread with domains): every
    region in replicas + 1 domains while the domains allow it."""
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    outs = _run_job(root, local, "save")
    saved = [re.search(r"^saved 2 copies (\d+) domains (\d+)$", out, re.M) for out in outs]
    assert all(saved), outs
    for p in (0, 1):                     # host 0 is gone with its disks
        shutil.rmtree(str(local).replace("{process}", str(p)))
    outs = _run_job(root, local, "resume")
    assert all(re.search(r"^resumed 2 exact True$", out, re.M) for out in outs), outs
    assert [int(m[2]) for m in saved] == [2] * 4, outs   # every region in both hosts


def test_a_restore_through_the_tiers_with_names_ignores_the_local_steps(tmp_path, mesh):
    """restore(None, target, names=...) (Dispatcher.restore's keyword: the target read under other
    names, e.g. a train state's params restored into {"params": {...}}) plans by the *target's* key
    paths (tiers_plan.wanted_regions) against the regions local steps record under the *saved* key
    paths, so no local step ever matches: the restore silently resumes the older persistent step 3
    (or, with none, raises FileNotFoundError) although local step 4 holds every region. tier_restore
    claims the case ("a leaf read under another name, names=, too"); mgr.restore(3, target, names=)
    of the root works. Fix: map each target leaf to its saved key path (manifest.saved_leaf with
    tensor_names) before planning, or plan wanted regions under the saved names."""
    _, state = _setup(mesh)
    tier = _train(tmp_path, state)
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"params": {"w": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=sharding)}}
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(3), local=tier) as mgr:
        from_root = mgr.restore(3, target, names=lambda path: "w")
        assert np.asarray(from_root["params"]["w"]).tobytes() == np.asarray(state(3)["w"]).tobytes()
        restored = mgr.restore(None, target, names=lambda path: "w")
        assert mgr.last_tier_restore.step == 4, mgr.last_tier_restore      # is 3: the local steps are unused
        assert np.asarray(restored["params"]["w"]).tobytes() == np.asarray(state(4)["w"]).tobytes()


def test_should_save_of_the_restored_step_depends_on_whether_this_host_kept_its_local_dir(tmp_path, mesh):
    """After restore(None, target) resumes step 8, should_save(8) ("a resumed loop asks again about the
    step it restored": the persistent policy answers False) is False on a process that kept its local
    steps but True on a process whose local directory was wiped (a replaced host: LocalTiers._last_step
    is None there, and resumed() only ever lowers it). should_save promises "Identical on every process
    of a job": in the job replicas are for (host 0 replaced, hosts 1.. keep local step 8, restored
    from the replicas), the new host's processes take a local save of step 8 and enter
    replicas.send's collective alone -- mismatched collectives, a hang -- while the others skip it.
    (The loop in docs/manager.md starts at step + 1, so it meets this only when it asks about a step at
    or before a kept local step: here the restored one; after a resume onto another mesh, which
    resumed() leaves alone, any step up to the newest kept local step.)
    Fix: a resume of step S sets the local tier's last step to S on every process (whether or not it
    had local steps), so the local policy's answer depends on the step only."""
    _, state = _setup(mesh)
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=sharding)}
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        for step in range(9):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
    answers = {}
    for wiped in (False, True):
        if wiped:
            shutil.rmtree(tmp_path / "local" / "0")     # this host was replaced
        with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
            mgr.restore(None, target)
            assert mgr.last_tier_restore.step == 8
            answers[wiped] = mgr.should_save(8)
    assert answers == {False: False, True: False}, answers   # {False: False, True: True}


@pytest.mark.parametrize("region", [((1, 3), (0, 4)), ((0, 8), (0, 8))], ids=["straddles-two-shards", "whole-leaf"])
def test_a_replica_overlapping_own_regions_silently_overwrites_them(tmp_path, mesh, region):
    """Dispatcher.save(own=True, copies=...) checks each Replica's shape and dtype (copies_by_leaf:
    "checks them against the plan") but not that its region is one of the leaf's shard regions. A
    replica whose region overlaps this process's own shards without being one of them (rows 1..3 of
    a leaf sharded in 2-row shards, or the whole leaf) is planned as one more region (own_plan only
    skips an *equal* region), its chunks overlap the own ones, and the saved step returns the
    replica's values (-1 here) in place of the process's real data: silent corruption, no error.
    Fix: ValueError (naming the key path and region) for a replica region that is not a region of the
    leaf's sharding, or that overlaps a region this process holds without being equal to it."""
    from dispatch_io.held import Replica
    w = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("data", "model")))
    device = jax.devices()[0]
    shape = tuple(hi - lo for lo, hi in region)
    replica = Replica(device, region, jax.device_put(np.full(shape, -1, np.float32), device))
    with dio.LocalDispatcher() as dispatcher:
        try:
            dispatcher.save(tmp_path / "s", {"w": w}, own=True, copies={"['w']": [replica]}).wait()
        except ValueError:
            return                                                   # refused: fine
        restored = np.asarray(dispatcher.restore(tmp_path / "s")["w"])
    assert np.array_equal(restored, np.asarray(w)), f"{int((restored == -1).sum())} values replaced by the replica's"


def test_local_tier_domains_given_as_a_mapping_become_one_domain_per_process():
    """LocalTier(domains=...) is documented as "domains[process]: its host" -- which a mapping
    {process: host} satisfies literally. LocalTier keeps tuple(domains): a dict's *keys*, (0, 1, 2,
    3), so every process is its own failure domain and the replica of process 0's regions goes to
    process 1 -- on the same host -- with no error or warning (a lost host then loses them). Fix:
    take a mapping's values by process (domains[p] for p in range(len)) or refuse it (TypeError)."""
    hosts = {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}
    try:
        tier = dio.LocalTier("/tmp/unused/{process}", replicas=1, domains=hosts)
    except (TypeError, ValueError):
        return                                                          # refused: fine
    assert tier.domains == ("host-a", "host-a", "host-b", "host-b"), tier.domains   # is (0, 1, 2, 3)


def test_local_tier_domains_as_lists_pass_validation_then_crash_when_the_job_opens():
    """LocalTier(domains=[["rack-0", "host-0"], ...]) (a (rack, host) pair per process, e.g. read from a
    JSON config) is accepted by LocalTier's validation, then the manager's open in a multi-process job
    fails with a bare "TypeError: unhashable type: 'list'" from replica_orders' Counter (after the
    processes already met in the tiers-paths room). Fix: convert each domain to a hashable value
    (lists to tuples) or refuse unhashable domains in LocalTier itself, naming domains."""
    from dispatch_io.manager.tiers import replica_plan
    domains = [["rack-0", "host-0"], ["rack-0", "host-0"], ["rack-1", "host-1"], ["rack-1", "host-1"]]
    try:
        tier = dio.LocalTier("/tmp/unused/{process}", replicas=1, domains=domains)
    except (TypeError, ValueError) as exc:
        assert "domains" in str(exc), exc                               # refused up front, naming domains
        return
    assert replica_plan.replica_orders(list(tier.domains), 1) == [(2, 3, 0, 1)]
