"""What one rank hands in for one group during a step: its contributions, their largest magnitudes, any problem.

Gradients are folded into the sum as they come and then dropped, so the few
numbers ranks must agree on at the end of the step (the count, one maximum per
tensor, and whether anything was wrong) are kept here as they pass.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mpizero.core.exact import max_abs_each

GRAD_DTYPE = np.dtype(np.float32)


class GroupTally:
    """This rank's count of contributions, largest magnitude per tensor, and first problem, for one group."""

    def __init__(self, specs) -> None:
        self.specs = specs
        self.count = self.seen = 0
        self.maxima = np.zeros(len(specs))
        self.problem: str | None = None

    def add(self, grads, known_names) -> bool:
        """Record one contribution; return whether it may be encoded (False once any problem was seen)."""
        problem = contribution_problem(grads, self.specs, known_names, self.seen)
        self.seen += 1
        self.problem = self.problem or problem
        if self.problem is not None:
            return False
        self.count += 1
        np.maximum(self.maxima, max_abs_each([grads[spec.name] for spec in self.specs]), out=self.maxima)
        return True

    def note(self, problem: str) -> None:
        """Record a problem found outside any one contribution (e.g. gradients that are not a list)."""
        self.problem = self.problem or problem

    def agreement_row(self, encoded_early: bool) -> np.ndarray:
        """``(count, problem flag, encoded-early flag, one maximum per tensor)``: what ``Collectives.agree``
        sums (the count) and maxes (the rest)."""
        return np.array([self.count, self.problem is not None, encoded_early, *self.maxima], dtype=np.float64)


def contribution_problem(grads, specs, known_names, index: int) -> str | None:
    """What is wrong with one contribution for these tensors (None when nothing is)."""
    if not isinstance(grads, Mapping):
        return f"contribution {index} is a {type(grads).__name__}, not a dict of gradients"
    unknown = sorted(set(grads) - set(known_names))
    if unknown:
        return f"contribution {index} has gradients for unknown parameters {unknown[:3]}"
    for spec in specs:
        g = grads.get(spec.name)
        if g is None:
            return f"contribution {index} has no gradient for {spec.name!r}"
        if not hasattr(g, "dtype") or not hasattr(g, "shape"):
            return f"contribution {index}: gradient {spec.name!r} is a {type(g).__name__}, not an array"
        if tuple(g.shape) != spec.shape or g.dtype != GRAD_DTYPE:
            return (
                f"contribution {index}: gradient {spec.name!r} is {g.dtype}{list(g.shape)}, "
                f"expected {GRAD_DTYPE}{list(spec.shape)}"
            )
    return None
