"""The global gradient norm, computed exactly so it does not depend on sharding.

Each squared element (exact in float64) is turned into int64 fixed point with
one power-of-two scale chosen from the largest square and the element count,
and the integers are summed: the same total however the vector is split over
ranks. Used for clipping by global norm.
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from mpizero.arrays import array_module, read_back
from mpizero.core.reduce import exact


def squares_exponent(max_abs: float, numel: int) -> int:
    """Return k such that ``numel`` squares of magnitude <= max_abs**2, scaled by 2**k, sum below 2**62."""
    return exact.exponent_for(max_abs * max_abs, max(numel, 1))


def fixed_point_squares(pieces, k: int) -> int:
    """Return ``sum(rint(x**2 * 2**k))`` over every element of ``pieces`` as a Python int (each piece's int64 sum
    read back in one copy)."""
    partials = []
    for x in pieces:
        wide = x.astype(np.float64)
        wide *= wide
        wide *= math.ldexp(1.0, k)
        partials.append(array_module(x).rint(wide).astype(np.int64).sum())
    return sum(int(v) for v in read_back(partials))


def global_norm(pieces, numel: int, collectives=None) -> float:
    """Return the L2 norm of the vector whose pieces are spread over ``collectives``' ranks (None: all here)."""
    largest = exact.largest_magnitude(pieces)
    if collectives is not None:
        largest = collectives.allreduce_value(largest, MPI.MAX, "the largest gradient for the norm")
    if not math.isfinite(largest):
        return math.inf
    k = squares_exponent(largest, numel)
    total = fixed_point_squares(pieces, k)
    if collectives is not None:
        total = collectives.allreduce_value(total, MPI.SUM, "the squared gradient norm")
    return math.sqrt(math.ldexp(float(total), -k))


def clip_factor(norm: float, max_norm: float) -> float | None:
    """Return the factor that brings ``norm`` down to ``max_norm`` (as torch does), or None if within."""
    factor = max_norm / (norm + 1e-6)
    return factor if factor < 1.0 else None
