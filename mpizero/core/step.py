"""The engine's step as a named state machine: which calls may come next, and a clear error when not.

A step goes IDLE -> ACCUMULATING (``accumulate``, ``reduce_round``) -> REDUCING
(``start_reduce`` per group) -> IDLE (``finish_step``). When every rank has
agreed to skip the step (a non-finite gradient under ``on_nonfinite="skip"``),
it goes to SKIPPING: the remaining calls of that step are accepted and do
nothing, and ``finish_step`` ends the step as skipped. A step whose scale
prediction failed ends like any other and the next pass starts at IDLE again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StepState(enum.Enum):
    """Where the engine is within one optimizer step."""

    IDLE = "idle: no gradients handed in this step"
    ACCUMULATING = "accumulating: gradients handed in, no group's reduction ended yet"
    REDUCING = "reducing: gradient collectives started for some groups"
    SKIPPING = "skipping: every rank agreed to skip this step"


class StepOrderError(RuntimeError):
    """An engine method called out of order (a programming error, the same on every rank of an SPMD program)."""


class StepTracker:
    """The step's state and the groups whose reduction was started in it."""

    def __init__(self, groups: int) -> None:
        self.groups = groups
        self.state = StepState.IDLE
        self.started: set[int] = set()

    def begin(self) -> bool:
        """Note a call that hands gradients in; return True if it begins a new step."""
        if self.state is not StepState.IDLE:
            return False
        self.state = StepState.ACCUMULATING
        return True

    def reduce_round(self, index: int, step: int) -> bool:
        """Record ``reduce_round(index)``; return False if the step is being skipped (nothing to do)."""
        self._check_group(index, step)
        if index in self.started:
            raise StepOrderError(f"step {step}: reduce_round({index}) after start_reduce({index}) in the same step")
        return self.state is not StepState.SKIPPING

    def start(self, index: int, step: int) -> bool:
        """Record ``start_reduce(index)``; return False if the step is being skipped (nothing to do)."""
        self._check_group(index, step)
        if index in self.started:
            raise StepOrderError(
                f"step {step}: start_reduce({index}) called twice in one step ({self.state.value}); "
                "call finish_step() first"
            )
        self.started.add(index)
        if self.state is StepState.SKIPPING:
            return False
        self.state = StepState.REDUCING
        return True

    def _check_group(self, index: int, step: int) -> None:
        if not 0 <= index < self.groups:
            raise StepOrderError(f"step {step}: no group {index}; the engine has groups 0-{self.groups - 1}")

    def skip(self) -> None:
        """Every rank agreed to skip this step."""
        self.state = StepState.SKIPPING

    def reset(self) -> None:
        """Forget this step; the next call starts a new one."""
        self.state, self.started = StepState.IDLE, set()

    def missing(self) -> list[int]:
        """Groups whose reduction was not started this step."""
        return sorted(set(range(self.groups)) - self.started)

    def finish(self, step: int) -> bool:
        """Check ``finish_step`` may come now; return True if the step was skipped."""
        if self.state is StepState.IDLE:
            raise StepOrderError(
                f"step {step}: finish_step() called with no start_reduce() this step ({self.state.value})"
            )
        return self.state is StepState.SKIPPING


@dataclass(frozen=True)
class StepResult:
    """What one step did: the optimizer steps taken so far, whether it was skipped, the gradient norm."""

    step: int
    skipped: bool
    grad_norm: float | None = None
    redo: bool = False  # the scale prediction failed: hand the same gradients in again (see ``scales``)
    loss: object = None  # what a caller's closure returned (``mpizero.torch``'s ``step(closure)``)
