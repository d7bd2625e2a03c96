"""Save and keep policies: plain data and pure decisions, testable without IO or sleeping.

    from dispatch_io import policies as P
    save_policy = P.EveryNSteps(1000) | P.EveryNSeconds(900) | P.Preemption()
    keep_policy = P.LatestN(2) | P.EveryNSteps(10_000) | P.BestN(3, metric="eval_loss", mode="min")

A **save policy** answers ``should_save(state)`` from a :class:`SaveState` (the step, the time,
the last save, whether the job reached its preemption point). A **keep policy** answers
``keep(steps, now)`` with the steps it keeps among the committed :class:`StepRecord` s.
``a | b`` is "any": a save if either says so, kept if either keeps it. Some policies are both
(``EveryNSteps``, ``OnSteps``, ``EveryNSeconds``), some only one (``Initial``, ``Preemption``
save; ``LatestN``, ``BestN`` keep); using one where it has no meaning is a ``TypeError`` when
the manager is made. Time is whatever clock the caller passes in (UNIX seconds in the manager).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from typing import Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SaveState:
    """What a save policy decides from: ``step`` (being asked about), ``now`` (the clock),
    ``last_save`` (when the last save of this run started, or the manager was opened),
    ``last_saved_step`` (the last step saved by this run, else the latest committed one; None:
    none), ``preempted`` (the job reached its preemption point at ``step``)."""

    step: int
    now: float
    last_save: float
    last_saved_step: int | None = None
    preempted: bool = False


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What a keep policy knows of a committed step: its number, when it committed (UNIX
    seconds; None: unknown, e.g. a step written before step info existed) and its metrics."""

    step: int
    committed: float | None = None
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


class Policy:
    """A save and/or keep policy. Subclasses set ``saves`` / ``keeps`` and define the matching
    method; ``uses_clock`` says whether ``should_save`` reads ``now`` (then a multi-process
    job lets process 0 decide for everyone, so skewed clocks never split the job)."""

    saves = False
    keeps = False
    uses_clock = False

    def should_save(self, state: SaveState) -> bool:
        raise TypeError(f"{self!r} is not a save policy")

    def keep(self, steps: Sequence[StepRecord], now: float) -> set[int]:
        raise TypeError(f"{self!r} is not a keep policy")

    def __or__(self, other: "Policy") -> "AnyOf":
        if not isinstance(other, Policy):
            return NotImplemented
        parts = lambda p: p.policies if isinstance(p, AnyOf) else (p,)
        return AnyOf(parts(self) + parts(other))


def _positive(value, name: str, kind=numbers.Integral):
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0 or (
            kind is numbers.Real and not math.isfinite(value)):
        what = "a positive integer" if kind is numbers.Integral else "a positive number of seconds"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return int(value) if kind is numbers.Integral else float(value)


@dataclasses.dataclass(frozen=True)
class AnyOf(Policy):
    """``a | b | ...``: saves if any saves, keeps what any keeps."""

    policies: tuple[Policy, ...]

    @property
    def saves(self):
        return all(p.saves for p in self.policies)

    @property
    def keeps(self):
        return all(p.keeps for p in self.policies)

    @property
    def uses_clock(self):
        return any(p.uses_clock for p in self.policies)

    def should_save(self, state: SaveState) -> bool:
        return any(p.should_save(state) for p in self.policies)

    def keep(self, steps: Sequence[StepRecord], now: float) -> set[int]:
        return set().union(*(p.keep(steps, now) for p in self.policies))

    def __repr__(self):
        return " | ".join(map(repr, self.policies))


@dataclasses.dataclass(frozen=True)
class EveryNSteps(Policy):
    """Save, or keep, every step divisible by ``n``."""

    n: int
    saves = keeps = True

    def __post_init__(self):
        object.__setattr__(self, "n", _positive(self.n, "EveryNSteps(n)"))

    def should_save(self, state: SaveState) -> bool:
        return state.step % self.n == 0

    def keep(self, steps, now):
        return {r.step for r in steps if r.step % self.n == 0}


@dataclasses.dataclass(frozen=True)
class OnSteps(Policy):
    """Save, or keep, exactly these steps."""

    steps: frozenset
    saves = keeps = True

    def __init__(self, steps):
        steps = list(steps)
        bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0]
        if bad:
            raise ValueError(f"OnSteps(steps) takes non-negative integers, got {bad[0]!r}")
        object.__setattr__(self, "steps", frozenset(int(s) for s in steps))

    def should_save(self, state: SaveState) -> bool:
        return state.step in self.steps

    def keep(self, steps, now):
        return {r.step for r in steps if r.step in self.steps}


@dataclasses.dataclass(frozen=True)
class EveryNSeconds(Policy):
    """Save once ``seconds`` have passed since the last save (or since the manager opened);
    keep one step per ``seconds``-long window of commit times (the first committed in it)."""

    seconds: float
    saves = keeps = uses_clock = True

    def __post_init__(self):
        object.__setattr__(self, "seconds", _positive(self.seconds, "EveryNSeconds(seconds)", numbers.Real))

    def should_save(self, state: SaveState) -> bool:
        return state.now - state.last_save >= self.seconds

    def keep(self, steps, now):
        first: dict[int, StepRecord] = {}
        for r in steps:
            if r.committed is None:
                continue
            window = math.floor(r.committed / self.seconds)
            if window not in first or (r.committed, r.step) < (first[window].committed, first[window].step):
                first[window] = r
        return {r.step for r in first.values()}


@dataclasses.dataclass(frozen=True)
class Initial(Policy):
    """Save when nothing is saved yet: no committed step and no save in this run."""

    saves = True

    def should_save(self, state: SaveState) -> bool:
        return state.last_saved_step is None


@dataclasses.dataclass(frozen=True)
class Preemption(Policy):
    """Save at the step where the job reached its preemption point (every process the same)."""

    saves = True

    def should_save(self, state: SaveState) -> bool:
        return state.preempted


@dataclasses.dataclass(frozen=True)
class LatestN(Policy):
    """Keep the ``n`` most recent steps."""

    n: int
    keeps = True

    def __post_init__(self):
        object.__setattr__(self, "n", _positive(self.n, "LatestN(n)"))

    def keep(self, steps, now):
        return set(sorted(r.step for r in steps)[-self.n:])


@dataclasses.dataclass(frozen=True)
class BestN(Policy):
    """Keep the ``n`` steps with the best ``metric`` (``mode`` ``"min"``: lowest; ``"max"``:
    highest; ties: the newer step). Steps without the metric (or with NaN) are kept if
    ``keep_without_metric``. The manager always keeps the latest step besides (a run resumes
    from it), so ``BestN`` alone never loses the newest work."""

    n: int
    metric: str
    mode: str = "min"
    keep_without_metric: bool = True
    keeps = True

    def __post_init__(self):
        object.__setattr__(self, "n", _positive(self.n, "BestN(n)"))
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"BestN(metric) must be a metric's name, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"BestN(mode) must be 'min' or 'max', got {self.mode!r}")

    def keep(self, steps, now):
        scored, unscored = [], set()
        for r in steps:
            value = r.metrics.get(self.metric)
            if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
                scored.append((value if self.mode == "min" else -value, -r.step))
            else:
                unscored.add(r.step)
        best = {-negated for _, negated in sorted(scored)[:self.n]}
        return best | (unscored if self.keep_without_metric else set())


def integer(value, name: str, minimum: int, expected: str) -> int:
    """``value`` as a Python int of at least ``minimum`` (numpy / JAX integer scalars accepted;
    not bool, nor a float); ``ValueError`` saying ``name`` must be ``expected`` otherwise."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return number


def keep_policy(policy: Policy | None, max_to_keep, keep_every_n_steps) -> tuple[Policy | None, int | None, int | None]:
    """The keep policy from ``policy`` or its shorthands (not both): ``LatestN(max_to_keep) |
    EveryNSteps(keep_every_n_steps)``; ``keep_every_n_steps`` alone keeps everything. Returns it
    with the shorthands as integers. ``ValueError`` for bad numbers or both given."""
    if max_to_keep is not None:
        max_to_keep = integer(max_to_keep, "max_to_keep", 1, "a positive integer or None")
    if keep_every_n_steps is not None:
        keep_every_n_steps = integer(keep_every_n_steps, "keep_every_n_steps", 1, "a positive integer or None")
    if policy is not None:
        if max_to_keep is not None or keep_every_n_steps is not None:
            raise ValueError("pass keep_policy or its shorthands max_to_keep / keep_every_n_steps, not both "
                             "(LatestN(n) | EveryNSteps(k) is what the shorthands mean)")
        return check(policy, "keep"), None, None
    if max_to_keep is not None:
        policy = LatestN(max_to_keep)
        if keep_every_n_steps is not None:
            policy = policy | EveryNSteps(keep_every_n_steps)
    return policy, max_to_keep, keep_every_n_steps


def check(policy: Policy | None, role: str) -> Policy | None:
    """``policy`` if it can serve as a ``role`` (``"save"`` / ``"keep"``) policy (None: the
    default); ``TypeError`` naming the policy otherwise."""
    if policy is None:
        return None
    if not isinstance(policy, Policy):
        raise TypeError(f"{role}_policy must be a dispatch_io.policies policy (or None), got {policy!r}")
    if not (policy.saves if role == "save" else policy.keeps):
        parts = policy.policies if isinstance(policy, AnyOf) else (policy,)
        wrong = [p for p in parts if not (p.saves if role == "save" else p.keeps)]
        raise TypeError(f"{', '.join(map(repr, wrong))} cannot be part of a {role}_policy "
                        f"({'it only decides what is kept' if role == 'save' else 'it only decides when to save'})")
    return policy


def check_barrier_timeout(dispatcher, barrier_timeout: float | None):
    """ValueError for a manager given both a ``dispatcher`` and a ``barrier_timeout``: the
    timeout would not apply to a dispatcher made elsewhere (it is one of its options)."""
    if dispatcher is not None and barrier_timeout is not None:
        raise ValueError(
            f"barrier_timeout={barrier_timeout!r} would not apply to the dispatcher you passed (its "
            f"Options.barrier_timeout is {dispatcher.options.barrier_timeout:g} s): create the dispatcher with "
            f"barrier_timeout={barrier_timeout!r} (e.g. LocalDispatcher(..., barrier_timeout={barrier_timeout!r})) "
            "and leave it out here")
