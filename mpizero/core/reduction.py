"""How local gradients become the averaged gradient: ``exact`` or ``native``.

``exact`` sums int64 fixed-point values (see ``exact``) with one power-of-two
scale per tensor and step: the result is the same bits whatever order MPI adds
in, however tensors are grouped into buckets or units, and whatever the number
of ranks. ``native`` sums float32 with MPI's own SUM: fastest, but MPI's order
of additions changes the low bits, so it is checked with a tolerance.
"""

from __future__ import annotations

import numpy as np

from mpizero.core import exact, scales


class ExactReduction:
    """Fixed-point sum with one power-of-two scale per tensor and step (see ``scales`` for how it is chosen)."""

    wire_dtype = np.dtype(np.int64)
    bitwise = True
    result_can_overflow = False  # the mean of values below the agreed maximum is below it

    def choose(self, predicted_k: int | None, true_max: float, count: int, headroom: int) -> int:
        return scales.choose(predicted_k, true_max, count, headroom)

    def predict(self, previous_k: int | None, headroom: int) -> int | None:
        return scales.predicted(previous_k, headroom)

    def add(self, local, grads, specs, step_scales, first: bool) -> None:
        """Fold one contribution into ``local`` (``first``: ``local`` holds nothing of this step yet).

        A tensor whose scale is None (no prediction yet: the step is being measured) adds nothing.
        """
        if first:
            local[specs[-1].stop :] = 0
        for spec, k in zip(specs, step_scales):
            view = local[spec.offset : spec.stop]
            if k is not None:
                exact.add_into(view, grads[spec.name].reshape(-1), k, assign=first)
            elif first:
                view[...] = 0

    def decode(self, reduced, scale: int, count: int, out) -> None:
        exact.decode(reduced, scale, count, out)


class NativeReduction:
    """Float32 sum by MPI's own SUM; divided by the count afterwards. No scales, so nothing is ever redone."""

    wire_dtype = np.dtype(np.float32)
    bitwise = False
    result_can_overflow = True  # a float32 sum of finite values can reach inf

    def choose(self, predicted_k: int | None, true_max: float, count: int, headroom: int) -> int:
        return 0

    def predict(self, previous_k: int | None, headroom: int) -> int:
        return 0

    def add(self, local, grads, specs, step_scales, first: bool) -> None:
        if first:
            local[specs[-1].stop :] = 0
        with np.errstate(over="ignore"):  # an overflow becomes inf, which the engine agrees on after the sum
            for spec in specs:
                view, g = local[spec.offset : spec.stop], grads[spec.name].reshape(-1)
                if first:
                    view[...] = g
                else:
                    view += g

    def decode(self, reduced, scale: int, count: int, out) -> None:
        out[...] = reduced / np.float32(count)


REDUCTIONS = {"exact": ExactReduction(), "native": NativeReduction()}
