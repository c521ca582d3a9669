"""How local gradients become the averaged gradient: ``exact`` or ``native``.

``exact`` sums int64 fixed-point values (see ``exact``) with one power-of-two
scale per tensor and step: the result is the same bits whatever order MPI adds
in, however tensors are grouped into buckets or units, and whatever the number
of ranks. ``native`` sums float32 with MPI's own SUM: fastest, but MPI's order
of additions changes the low bits, so it is checked with a tolerance.
"""

from __future__ import annotations

import numpy as np

from mpizero.core import exact


class ExactReduction:
    """Fixed-point sum with one power-of-two scale per tensor and step."""

    wire_dtype = np.dtype(np.int64)
    bitwise = True
    result_can_overflow = False  # the mean of values below the agreed maximum is below it

    def scale_for(self, max_abs: float, count: int) -> int:
        return exact.exponent_for(max_abs, count)

    def encode(self, local, contributions, specs, scales) -> None:
        """Write the sum of this rank's fixed-point contributions into ``local``."""
        local[specs[-1].stop :] = 0
        for spec, scale in zip(specs, scales):
            sources = [grads[spec.name].reshape(-1) for grads in contributions]
            exact.sum_into(local[spec.offset : spec.stop], sources, scale)

    def decode(self, reduced, scale: int, count: int, out) -> None:
        exact.decode(reduced, scale, count, out)


class NativeReduction:
    """Float32 sum by MPI's own SUM; divided by the count afterwards."""

    wire_dtype = np.dtype(np.float32)
    bitwise = False
    result_can_overflow = True  # a float32 sum of finite values can reach inf

    def scale_for(self, max_abs: float, count: int) -> int:
        return 0

    def encode(self, local, contributions, specs, scales) -> None:
        local[specs[-1].stop :] = 0
        for spec in specs:
            view = local[spec.offset : spec.stop]
            view[...] = contributions[0][spec.name].reshape(-1) if contributions else 0
            with np.errstate(over="ignore"):  # an overflow becomes inf, which the engine agrees on after the sum
                for grads in contributions[1:]:
                    view += grads[spec.name].reshape(-1)

    def decode(self, reduced, scale: int, count: int, out) -> None:
        out[...] = reduced / np.float32(count)


REDUCTIONS = {"exact": ExactReduction(), "native": NativeReduction()}
