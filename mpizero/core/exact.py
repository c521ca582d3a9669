"""Exact, order-free gradient sums in 64-bit fixed point.

Floating-point addition is not associative, and MPI combines contributions in
an order that changes with message size and rank. Integer addition is
associative, so this module turns every float32 contribution into an int64
multiple of one power of two, 2**-k, shared by all contributions to a buffer in
a step. The integer sum is then the same whatever the order, the grouping or
the number of ranks, and is turned back to float32 once.

k is chosen from the largest magnitude among all contributions (agreed across
ranks) and their count, so that the sum cannot overflow int64:
``count * max_abs * 2**k < 2**62``. Every value within 2**-(38 - ceil(log2
count)) of the largest is converted exactly; the error of any one contribution
is at most 2**-(k + 1), that is below ``max_abs * 2**(ceil(log2 count) - 62)``.
"""

from __future__ import annotations

import math

import numpy as np

from mpizero.core import fused
from mpizero.core.arrays import CHUNK, array_module

SUM_BITS = 62
FLOAT32_BITS = 24


def exponent_for(max_abs: float, count: int) -> int:
    """Return k such that ``count`` values of magnitude <= max_abs, scaled by 2**k, sum below 2**62."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if not math.isfinite(max_abs) or max_abs < 0:
        raise ValueError(f"max_abs must be finite and >= 0, got {max_abs}")
    if max_abs == 0.0:
        return 0
    headroom = (count - 1).bit_length()  # count <= 2**headroom
    if headroom > SUM_BITS - FLOAT32_BITS:
        raise OverflowError(f"{count} contributions leave no room for a float32 mantissa in int64")
    _, exponent = math.frexp(max_abs)  # max_abs < 2**exponent
    return SUM_BITS - headroom - exponent


def max_abs(x) -> float:
    """Return the largest magnitude in x as a Python float (inf if any NaN or Inf)."""
    if x.size == 0:
        return 0.0
    largest = max(float(x.max()), -float(x.min()))
    return largest if math.isfinite(largest) else math.inf


def max_abs_each(arrays) -> np.ndarray:
    """``max_abs`` of each array, as float64; device arrays cost one device-to-host copy in all, not one each."""
    xp = array_module(arrays[0]) if arrays else np
    if xp is np:
        return np.array([max_abs(a) for a in arrays], dtype=np.float64)
    largest = fused.device_max_abs(xp, arrays)
    return np.where(np.isfinite(largest), largest, np.inf)


def sum_into(total, sources, k: int) -> None:
    """Write ``sum(rint(x * 2**k) for x in sources)`` (float32 sources) into the int64 array ``total``."""
    if not sources:
        total[...] = 0
    for index, x in enumerate(sources):
        add_into(total, x, k, assign=index == 0)


def add_into(total, x, k: int, assign: bool = False) -> None:
    """Add ``rint(x * 2**k)`` (float32 ``x``, flat) to the int64 array ``total`` (``assign``: write it instead).

    ``x * 2**k`` is exact in float32: it stays below 2**62 when k comes from an
    agreed maximum, and anything small enough to underflow rounds to 0 either
    way. A value beyond the scale's range (a pass that will be redone, or a
    non-finite gradient that will be refused) may wrap; it is never decoded.
    Host arrays go in cache-sized chunks; device arrays in one fused kernel (``fused``).
    """
    xp = array_module(total)
    if xp is not np:
        fused.device_add_into(xp, total, x, k, assign)
        return
    n = total.size
    scaled = xp.empty(min(n, CHUNK), dtype=np.float32)
    as_int = xp.empty(min(n, CHUNK), dtype=np.int64)
    factor = np.float32(math.ldexp(1.0, k)) if -126 <= k <= 127 else None  # a float32 power of two: exact
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, n, CHUNK):
            stop = min(start + CHUNK, n)
            tmp, tmp_int = scaled[: stop - start], as_int[: stop - start]
            if factor is None:
                xp.ldexp(x[start:stop], k, out=tmp)
            else:
                xp.multiply(x[start:stop], factor, out=tmp)  # twice as fast as ldexp, the same bits
            xp.rint(tmp, out=tmp)
            if assign:
                total[start:stop] = tmp
            else:
                tmp_int[...] = tmp
                total[start:stop] += tmp_int


def decode(total, k: int, count: int, out) -> None:
    """Write the float32 mean ``total * 2**-k / count`` into ``out`` (same length, any shape)."""
    xp = array_module(total)
    flat_out = out.reshape(-1)
    n = total.size
    divisor = math.ldexp(float(count), k)  # exact: (S * 2**-k) / count == S / (count * 2**k)
    if xp is not np:
        fused.device_decode(xp, total, divisor, flat_out)  # one pass: the same bits (tests/test_fused.py)
        return
    power_of_two = count & (count - 1) == 0  # then multiplying by the exact reciprocal is the same division
    scaled = xp.empty(min(n, CHUNK), dtype=np.float64)
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        tmp = scaled[: stop - start]
        tmp[...] = total[start:stop]
        if power_of_two:
            tmp *= 1.0 / divisor
        else:
            tmp /= divisor
        flat_out[start:stop] = tmp
