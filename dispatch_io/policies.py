"""Save and keep policies of :class:`dispatch_io.CheckpointManager` (``from dispatch_io import
policies as P``); defined in :mod:`dispatch_io.manager.step_policies`, which documents them."""

from dispatch_io.manager.step_policies import (AnyOf, BestN, EveryNSeconds, EveryNSteps, Initial, LatestN, OnSteps,
                                          Policy, Preemption, SaveState, StepRecord)

__all__ = ["AnyOf", "BestN", "EveryNSeconds", "EveryNSteps", "Initial", "LatestN", "OnSteps", "Policy", "Preemption",
           "SaveState", "StepRecord"]
