"""The local tier: findings of an adversarial review (round 3). Each test fails before its fix."""

import shutil

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io import policies, tiers_plan


def _setup(mesh):
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=sharding)}

    def state(step):
        return {"w": jax.device_put(np.arange(256 * 64, dtype=np.float32).reshape(256, 64) + step, sharding)}
    return target, state


def test_explicit_rollback_with_names_resumes_like_without(tmp_path, mesh):
    """Finding: ``restore(4, target, names=...)`` (an explicit rollback onto the training sharding,
    the target's leaves renamed) never counts as resuming step 4: ``LocalTiers.resumed`` compares
    the target's regions by the *target's* key paths (``{"weights": ...}``) with the local step's
    ``"sharded"``, recorded by *saved* key path (``['w']``), so they never match. The local policy
    then refuses steps up to the abandoned history's newest (8), the first save of step 8 keeps
    the abandoned local step 8 (it counts as "the local step of this history"), and the next
    restart's restore through the tiers silently resumes the abandoned history's values. Without
    names= the same rollback works (test_tiers_edges). Fix: map the target's key paths through
    names= (as ``TierRestore._saved_keypaths`` does) before comparing, in ``resumed``."""
    target, state = _setup(mesh)
    renamed = {"weights": target["w"]}

    def names(path):
        return "w"
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        for step in range(9):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
    shutil.rmtree(tmp_path / "root" / "8")
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        mgr.restore(4, renamed, names=names)
        saved = []
        for step in range(5, 10):      # the new history: state + 100
            if mgr.should_save(step):
                mgr.save(step, jax.tree.map(lambda x: x + 100, state(step)))
                saved.append(step)
        mgr.wait()
        info = f"saves of the new history: {saved}, local steps {mgr.local.steps()}"
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        restored = mgr.restore(None, target)
        step = mgr.last_tier_restore.step
        expected = np.arange(256 * 64, dtype=np.float32).reshape(256, 64) + step + 100
        assert np.asarray(restored["w"]).tobytes() == expected.tobytes(), \
            f"step {step} restored from the abandoned history ({info})"
