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

import functools
import math

import numpy as np

from mpizero.arrays import CHUNK, array_module, is_standin, read_back
from mpizero.core.reduce import arithmetic, kernels

SUM_BITS = 62
FLOAT32_BITS = 24
INF_BITS = 0x7F800000  # float32 inf with the sign cleared: every finite magnitude's bits are below it


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


def largest_magnitude(pieces) -> float:
    """The largest magnitude over every element of ``pieces`` as a Python float (inf if any is NaN or Inf); on a
    device the pieces' extremes are read back in one copy."""
    ends = np.array(read_back([end for x in pieces if x.size for end in (x.max(), x.min())]), dtype=np.float64)
    if ends.size == 0:
        return 0.0
    largest = max(float(ends.max()), -float(ends.min()))
    return largest if math.isfinite(largest) else math.inf


def magnitude_of_bits(bits: int) -> float:
    """The float32 magnitude whose bit pattern (sign cleared) is ``bits``; inf for NaN and Inf patterns."""
    return math.inf if bits >= INF_BITS else float(np.uint32(bits).view(np.float32))


def float32_bits_of_power(exponent: int) -> int:
    """The bit pattern of the float32 ``2**exponent``: inf's above float32's range, 0 below its smallest subnormal."""
    if exponent > 127:
        return INF_BITS
    if exponent < -149:
        return 0
    return int(np.float32(math.ldexp(1.0, exponent)).view(np.uint32))


def rescale(total, shift: int) -> None:
    """Divide the int64 array ``total`` by ``2**shift`` in place, rounding half to even (a coarser scale)."""
    if shift <= 0:
        return
    if shift >= 64:  # |total| < 2**63: below half of 2**shift
        total[...] = 0
        return
    floor = total >> np.int64(shift)
    remainder = total - (floor << np.int64(shift))  # in [0, 2**shift)
    half = np.int64(1) << np.int64(shift - 1)
    up = (remainder > half) | ((remainder == half) & (floor & 1 == 1))
    total[...] = floor + up


def rescale_segments(total, segments) -> None:
    """``rescale`` each segment ``(lo, hi, shift)`` of ``total`` (sorted by ``lo``); on a device in one launch per
    ``arithmetic.MAX_SEGMENTS`` segments that move (a step whose chosen scales differ from the prediction)."""
    moved = [segment for segment in segments if segment[2] > 0]
    xp = array_module(total)
    if xp is np:
        _rescaled_parts(moved, total)
        return
    for first in range(0, len(moved), arithmetic.MAX_SEGMENTS):
        part = moved[first : first + arithmetic.MAX_SEGMENTS]
        start, stop = part[0][0], part[-1][1]
        _rescale_kernel(xp, len(part))(total[start:stop], [(lo - start, hi - start, s) for lo, hi, s in part])


@functools.cache
def _rescale_kernel(cupy, count: int):
    """``launch(total, segments)`` for ``count`` segments: CuPy's kernel, or ``rescale`` on the stand-in."""
    if is_standin(cupy):  # the segments bound to each launch, as CuPy passes scalars by value
        return lambda total, segments: cupy.kernel(functools.partial(_rescaled_parts, segments), "", "int64 total")(
            total
        )
    kernel = cupy.ElementwiseKernel(
        arithmetic.rescale_params(count), "int64 total", arithmetic.rescaled_statement(count, "total"), "mz_rescale"
    )
    return lambda total, segments: kernel(*(np.int64(v) for segment in segments for v in segment), total)


def _rescaled_parts(segments, total) -> None:
    """``rescale`` of each segment of ``total`` (host memory: the host's way, and the stand-in's kernel body)."""
    for lo, hi, shift in segments:
        rescale(total[lo:hi], shift)


def decode(total, k: int, count: int, out, compiled: bool = True) -> None:
    """Write the float32 mean ``total * 2**-k / count`` into ``out`` (same length, any shape); on the host by the
    compiled pass unless ``compiled`` is False (the reference's NumPy)."""
    xp = array_module(total)
    flat_out = out.reshape(-1)
    divisor = math.ldexp(float(count), k)  # exact: (S * 2**-k) / count == S / (count * 2**k)
    if xp is not np:
        arithmetic.device_decode(xp, total, divisor, flat_out)  # one pass: the same bits (tests/test_fused.py)
        return
    if compiled and kernels.decode(total, divisor, flat_out):  # one pass, the same bits (tests/core/test_kernels.py)
        return
    numpy_decode(total, divisor, flat_out)


def numpy_decode(total, divisor: float, flat_out) -> None:
    """``decode``'s formula evaluated by NumPy in cache-sized chunks (the fallback, and what tests compare with)."""
    n = total.size
    power_of_two = math.frexp(divisor)[0] == 0.5  # then multiplying by the exact reciprocal is the same division
    scaled = np.empty(min(n, CHUNK), dtype=np.float64)
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        tmp = scaled[: stop - start]
        tmp[...] = total[start:stop]
        if power_of_two:
            tmp *= 1.0 / divisor
        else:
            tmp /= divisor
        flat_out[start:stop] = tmp
