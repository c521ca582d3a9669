"""The engine's step as a named state machine: which calls may come next, and a clear error when not.

A step goes IDLE -> REDUCING (``start_reduce`` per group) -> IDLE (``finish_step``).
When every rank has agreed to skip the step (a non-finite gradient under
``on_nonfinite="skip"``), it goes to SKIPPING: the remaining groups'
``start_reduce`` calls of that step are accepted and do nothing, and
``finish_step`` ends the step as skipped.
"""

from __future__ import annotations

import enum


class StepState(enum.Enum):
    """Where the engine is within one optimizer step."""

    IDLE = "idle: no gradients handed in this step"
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

    def start(self, index: int, step: int) -> bool:
        """Record ``start_reduce(index)``; return False if the step is being skipped (nothing to do)."""
        if not 0 <= index < self.groups:
            raise StepOrderError(f"step {step}: no group {index}; the engine has groups 0-{self.groups - 1}")
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

    def skip(self) -> None:
        """Every rank agreed to skip this step."""
        self.state = StepState.SKIPPING

    def reset(self) -> None:
        """Forget this step (its gradients were refused on every rank); the next call starts a new step."""
        self.state, self.started = StepState.IDLE, set()

    def missing(self) -> list[int]:
        """Groups whose reduction was not started this step."""
        return sorted(set(range(self.groups)) - self.started)

    def finish(self, step: int) -> bool:
        """Record ``finish_step``; return True if the step was skipped. Resets for the next step."""
        if self.state is StepState.IDLE:
            raise StepOrderError(
                f"step {step}: finish_step() called with no start_reduce() this step ({self.state.value})"
            )
        skipped = self.state is StepState.SKIPPING
        self.reset()
        return skipped
