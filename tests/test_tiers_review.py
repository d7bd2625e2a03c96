"""The local tier: findings of an adversarial review (round 3). Each test fails before its fix."""

import shutil

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io import policies
from dispatch_io.manager.tiers import plan as tiers_plan
from test_tiers_edges import _setup


def test_explicit_rollback_with_names_resumes_like_without(tmp_path, mesh):
    """Finding: ``restore(4, target, names=...)`` (an explicit rollback onto the training sharding,
    the target's leaves named differently from the saved ones) never counts as resuming step 4:
    ``LocalTiers.resumed`` compares the target's regions by the *target's* key paths
    (``['weights']``) with the local step's ``"sharded"``, recorded by *saved* key path (``['w']``),
    so they never match. docs/manager.md: a restore that resumes an older step "lets local saves go
    on after it, and the first save ... then deletes the local steps from that step on"; with
    names= the local policy instead refuses steps 5..8 (not newer than the abandoned 8), and the
    first save of step 8 keeps the abandoned local step 8 (it counts as "the local step of this
    history"): a restart resumes it over the new history. The same rollback without names= works.
    Fix: map the target's key paths through names= (as ``TierRestore._saved_keypaths`` does)
    before comparing, in ``resumed``."""
    target, state = _setup(mesh)
    renamed = {"weights": target["w"]}
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        for step in range(9):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
    shutil.rmtree(tmp_path / "root" / "8")
    answers = {}
    for how, args in {"plain": (target, {}), "names=": (renamed, {"names": lambda path: "w"})}.items():
        with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
            restored = mgr.restore(4, args[0], **args[1])
            assert np.asarray(jax.tree.leaves(restored)[0]).tobytes() == np.asarray(state(4)["w"]).tobytes()
            answers[how] = [step for step in range(5, 10) if mgr.local.should_save(step)]
    assert answers["names="] == answers["plain"], f"local saves after the rollback to 4: {answers}"


def test_a_job_resumed_on_another_mesh_never_mixes_in_the_abandoned_local_step(tmp_path, mesh):
    """Finding: a restore through the tiers onto another mesh is taken for an eval copy
    (``same_layout`` False: no ``LocalTiers.resume``), even when the job resumes training there --
    the restart on another mesh that docs/design.md "Onto another mesh" supports. Train on mesh A
    (local steps 0..8, persistent 0, 4, 8; the persistent save of 8 killed before its commit);
    restart on mesh B with ``restore(None, target_b, durability="persisted")``: step 4. The new
    history then: the local policy refuses 6 and 8 (not newer than the abandoned 8), and the
    persistent save of 8 keeps the abandoned local step 8 (``drop_from`` spares "the local step
    of this history"). The next restart's restore through the tiers picks step 8 and reads it from
    the abandoned local copy, not from the new history's persistent step 8: silently the wrong
    history. Fix: a restore that picks a step older than the local tier's last step must make
    the newer local steps unusable whatever the target's layout (or resume on every layout and
    let an eval copy say so explicitly)."""
    target, state = _setup(mesh)
    mesh_b = jax.make_mesh((2, 4), ("data", "model"))
    sharding_b = NamedSharding(mesh_b, P("data", "model"))
    target_b = {"w": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=sharding_b)}
    base = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        for step in range(9):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
    shutil.rmtree(tmp_path / "root" / "8")   # its persistent save killed before its commit
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        mgr.restore(None, target_b, durability="persisted")
        assert mgr.last_tier_restore.step == 4
        saved = []
        for step in range(5, 10):      # the new history, on mesh B: + 100
            if mgr.should_save(step):
                mgr.save(step, {"w": jax.device_put(base + step + 100, sharding_b)})
                saved.append(step)
        mgr.wait()
        info = f"saves of the new history: {saved}, local steps {mgr.local.steps()}"
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        restored = mgr.restore(None, target_b)
        step = mgr.last_tier_restore.step
        assert np.asarray(restored["w"]).tobytes() == (base + step + 100).tobytes(), \
            f"step {step} restored from the abandoned history ({info})"


def test_restore_of_a_named_step_onto_another_mesh_resumes_alike_in_every_process(tmp_path, mesh):
    """Finding: ``LocalTiers.resumed`` (after ``restore(step, target)`` of a named step) decides
    per process, so processes disagree. Onto another sharding (the job restarted on another mesh
    and resumes step 4 there; or an eval copy) a process whose local directory is gone resumes
    step 4 (``mine and not infos``: "it follows the job"), while its peers, which still have their
    steps, compare layouts and do not. In a job the process that lost its disk opened with the
    others' last local step (8, agreed in ``check_apart``); here one process opens with steps up to
    8 and then loses its directory, the same state. It then answers ``should_save(6)`` True where
    every peer answers False: different local saves on different processes -- with replicas a
    ``replicas.send`` collective (and a ``SharedDecisions`` round) only some processes enter (a
    hang), without them a local step 6 on one process only. Fix: the decision must be the job's,
    not each process's (compare the target with the layout the peers report, or share process
    0's answer), as ``tier_restore`` does with ``same_layout`` over the gathered reports."""
    target, state = _setup(mesh)
    eval_sharding = NamedSharding(jax.make_mesh((2, 4), ("data", "model")), P("data", "model"))
    eval_target = {"w": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=eval_sharding)}
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        for step in range(9):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
    answers = {}
    for lost in (False, True):
        with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
            if lost:   # the disk of this process is gone (its peers keep theirs)
                for entry in (tmp_path / "local" / "0").iterdir():
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            mgr.restore(4, eval_target)   # step 4 onto another mesh
            answers[lost] = [step for step in range(5, 10) if mgr.local.should_save(step)]
    assert answers[True] == answers[False], f"local saves after restoring 4 onto another mesh: with its steps {answers[False]}, " \
                                            f"without them {answers[True]}"


# The planner's fixture of tests/test_tiers_plan.py: a leaf of 4 regions over (data=2, fsdp=4) on
# 4 processes (regions 0, 1 held by {0, 2}; 2, 3 by {1, 3}) and a replicated leaf.
R = [((i * 16, i * 16 + 16), (0, 16)) for i in range(4)]
WANTED = {"['w']": {R[0]: (0, 2), R[1]: (0, 2), R[2]: (1, 3), R[3]: (1, 3)},
          "['b']": {((0, 32),): (0, 1, 2, 3)}}


def _held(process):
    own = [list(map(list, r)) for r, holders in WANTED["['w']"].items() if process in holders]
    return tiers_plan.as_regions({"['w']": own, "['b']": [[[0, 32]]]})


def test_resuming_a_step_partly_read_from_persistent_storage_counts_as_resuming_it(tmp_path, mesh):
    """Finding: a restore that resumed a step partly from the root (both holders of some regions
    lost their disks) was not counted as resuming it when the layout check compared the target with
    the surviving copies only: the abandoned local step 8 survived the next save of 8 and a later
    restore mixed two histories. Now every restore resumes its step: here step 4 is restored with
    local step 8 present, and the first save of step 6 (either tier) drops local step 8 -- whatever
    the copies report."""
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=sharding)}

    def state(step):
        return {"w": jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8) + step, sharding)}
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        for step in range(9):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(100), local=tier) as mgr:
        mgr.restore(None, target, durability="persisted")      # step 8 is persisted: resumed
        assert mgr.last_tier_restore.step == 8
        shutil.rmtree(tmp_path / "root" / "8")                 # a rollback to 4: the root's newer step goes
        mgr.restore(4, target)
        assert mgr.should_save(6) and not mgr.should_save(4)
        mgr.save(6, state(6 + 1000))
        mgr.wait()
        assert 8 not in mgr.local.steps(), mgr.local.steps()
