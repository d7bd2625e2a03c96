"""The checkpoint manager of a training job, one job per module:

* ``step_policies``: when to save, what to keep (plain data, pure decisions);
* ``items``: what a step holds besides the state (``Json``, ``PerProcess``);
* ``info``: each step's info (times, metrics, metadata, items);
* ``decisions``: one save decision for every process of a job;
* ``preemption``: the step at which a preempted job stops;
* ``retention``: which committed steps go (pure), and deleting them;
* ``orbax_items``: the items of steps Orbax's CheckpointManager wrote;
* ``root_steps``: what a committed step of the root holds (ours or Orbax's), read from its files;
* ``tiers/``: the local tier (:class:`LocalTier`): its plans, saves, steps, restores and promotions;
* ``manager``: :class:`CheckpointManager`, which puts them to work.
"""

from dispatch_io.manager import step_policies as policies  # dispatch_io.policies is the public name
from dispatch_io.manager.info import StepInfo
from dispatch_io.manager.items import Json, PerProcess
from dispatch_io.manager.manager import CheckpointManager
from dispatch_io.manager.tiers import LocalTier

__all__ = ["CheckpointManager", "Json", "LocalTier", "PerProcess", "StepInfo", "policies"]
