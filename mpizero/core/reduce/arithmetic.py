"""The exact encode and decode, each one formula: compiled into CuPy and host C kernels, or evaluated by NumPy.

The encode reads a float32 gradient and the int64 total once and writes the
total once; elements whose magnitude lies outside a range of float32 bit
patterns ``[lo, hi)`` are left out (``scales``: kept, or beyond the cap), and
each call also returns the largest magnitude's bit pattern and how many were
left out. The decode reads the total and writes float32 once. One call per
tensor (or owned piece of one), since each has its own scale. One
contribution's rounded values alone (``rounded``) are float32 integers: the
wire encode writes them as float32, for a reduce-scatter of 4 bytes an element
that the owner widens into its int64 sum (``widen``).

The arithmetic is written once, as a function of an ``ops`` namespace:
``NUMPY_OPS`` evaluates it on host arrays, ``C_OPS`` spells it for CUDA and
``HOST_C_OPS`` for the host's C compiler (``kernels``). The CPU tests hold
every evaluation to the same bytes: float32 ``ldexp`` (or a multiply by the
float32 ``2**k``) is exact for a power of two, ``rint``/``nearbyintf`` round
half to even, and the casts and the float64 division round to nearest.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from mpizero.arrays import is_standin


def rounded(ops, x, k):
    """``rint(x * 2**k)`` in float32, ``x`` float32: exact, as ``x * 2**k`` is (a power of two) and so is its
    rounding (from 2**23 on a float32 is an integer already, and every smaller integer is a float32)."""
    return ops.rint(ops.ldexp(x, k))


def widen(ops, total, wire):
    """``total + wire`` in int64, ``wire`` a float32 integer from ``rounded``."""
    return ops.add(total, ops.to_int64(wire))


def encode(ops, total, x, k):
    """``total + rint(x * 2**k)`` in int64, ``x`` float32."""
    return widen(ops, total, rounded(ops, x, k))


def decode(ops, total, divisor):
    """``total / divisor`` in float64, rounded once to float32."""
    return ops.to_float32(ops.divide(ops.to_float64(total), divisor))


NUMPY_OPS = SimpleNamespace(
    add=np.add,
    to_int64=lambda a: np.asarray(a).astype(np.int64),
    rint=np.rint,
    ldexp=np.ldexp,
    to_float64=lambda a: np.asarray(a).astype(np.float64),
    divide=np.divide,
    to_float32=lambda a: np.asarray(a).astype(np.float32),
)


def numpy_ops(k: int) -> SimpleNamespace:
    """``NUMPY_OPS`` for scale ``k``: within float32's exponent range ``ldexp`` is a multiply by the float32
    ``2**k`` (the same bits, twice as fast)."""
    if not -126 <= k <= 127:
        return NUMPY_OPS
    factor = np.float32(math.ldexp(1.0, k))
    return SimpleNamespace(**{**vars(NUMPY_OPS), "ldexp": lambda a, _: np.multiply(a, factor)})


C_OPS = SimpleNamespace(
    add=lambda a, b: f"{a} + {b}",
    to_int64=lambda a: f"(long long){a}",
    rint=lambda a: f"rintf({a})",
    ldexp=lambda a, b: f"ldexpf({a}, {b})",
    to_float64=lambda a: f"(double){a}",
    divide=lambda a, b: f"{a} / {b}",
    to_float32=lambda a: f"(float)({a})",
)


def masked_ops(ops, mask: str) -> SimpleNamespace:
    """``ops`` whose rounding gives 0 where the C expression ``mask`` is false (``HOST_C_OPS``'s, for another
    input's mask)."""
    return SimpleNamespace(**{**vars(ops), "rint": lambda a: f"({mask} ? nearbyintf({a}) : 0.0f)"})


# The host kernel multiplies by the float32 2**k (exact, as ldexp is) and rounds with nearbyintf; the element's
# mask selects between the rounded value and 0 there, which keeps GCC from folding the rounding and the cast into
# a scalar llrintf, so the loop vectorizes. The int64 add wraps (-fwrapv) where a pass that will be redone overflows.
HOST_C_OPS = masked_ops(
    SimpleNamespace(**{**vars(C_OPS), "ldexp": lambda a, b: f"{a} * {b}", "to_int64": lambda a: f"(int64_t){a}"}),
    "inside",
)


def masked(total: str, ops, assign: bool) -> str:
    """A kernel's statement: the encode of ``x`` where ``inside``, of 0 elsewhere (the total stays as it was)."""
    return f"{total} = {encode(ops, '0' if assign else total, 'inside ? x : 0.0f', 'k')}"


def masked_wire(out: str, ops) -> str:
    """The wire kernel's statement: ``rounded`` of ``x`` where ``inside``, 0 elsewhere, as float32."""
    return f"{out} = {rounded(ops, 'inside ? x : 0.0f', 'k')}"


def masked_pair(total: str, ops, assign: bool) -> str:
    """The paired kernel's statement: ``masked`` of ``x`` (where ``inside``), then of ``y`` (where ``inside_y``)."""
    first = encode(ops, "0" if assign else total, "inside ? x : 0.0f", "k")
    return f"{total} = {encode(ops, first, 'inside_y ? y : 0.0f', 'k')}"


ENCODE_IN = "float32 x, int32 k, uint32 lo, uint32 hi"  # the device kernels' parameters, CuPy's and the stand-in's
PAIR_IN = "float32 x, float32 y, int32 k, uint32 lo, uint32 hi"
TOTAL = "int64 total"
WIRE_OUT = "float32 out"
WIDEN_IN = "float32 wire"
DECODE_IN = "int64 total, float64 divisor"


def numpy_kernels(kernel) -> SimpleNamespace:
    """The same kernels as NumPy bodies, each made a device launch by ``kernel`` (the stand-in's, which runs them
    on the memory underneath its device arrays: ``mpizero.standin``)."""

    def masked_encode(assign: bool):
        def body(x, k, lo, hi, total):
            bits = x.view(np.uint32) & np.uint32(0x7FFFFFFF)
            kept_in = np.where((bits >= lo) & (bits < hi), x, np.float32(0))  # the C kernel's ``inside ? x : 0``
            total[...] = encode(numpy_ops(int(k)), np.int64(0) if assign else total, kept_in, int(k))

        return kernel(body, ENCODE_IN, TOTAL)

    def masked_rounded(x, k, lo, hi, out):
        bits = x.view(np.uint32) & np.uint32(0x7FFFFFFF)
        out[...] = rounded(numpy_ops(int(k)), np.where((bits >= lo) & (bits < hi), x, np.float32(0)), int(k))

    def widen_into(wire, total):
        total[...] = widen(NUMPY_OPS, total, wire)

    def masked_encode_pair(assign: bool):
        def body(x, y, k, lo, hi, total):
            for operand, first in ((x, assign), (y, False)):
                bits = operand.view(np.uint32) & np.uint32(0x7FFFFFFF)
                kept_in = np.where((bits >= lo) & (bits < hi), operand, np.float32(0))
                total[...] = encode(numpy_ops(int(k)), np.int64(0) if first else total, kept_in, int(k))

        return kernel(body, PAIR_IN, TOTAL)

    def decode_into(total, divisor, out):
        out[...] = decode(NUMPY_OPS, total, divisor)

    return SimpleNamespace(
        add=masked_encode(False),
        assign=masked_encode(True),
        add_pair=masked_encode_pair(False),
        assign_pair=masked_encode_pair(True),
        wire=kernel(masked_rounded, ENCODE_IN, WIRE_OUT),
        widen=kernel(widen_into, WIDEN_IN, TOTAL),
        decode=kernel(decode_into, DECODE_IN, WIRE_OUT),
    )


@functools.cache
def kernels(cupy) -> SimpleNamespace:
    """The device kernels (built on first use): ``add``, ``assign`` (masked encodes), their ``_pair`` forms (two
    contributions in one pass), ``wire`` (the masked encode's float32 values) and ``widen`` (their int64 sum),
    ``decode``; compiled by CuPy, or evaluated by NumPy on the stand-in."""
    if is_standin(cupy):
        return numpy_kernels(cupy.kernel)
    make = cupy.ElementwiseKernel
    bits = "unsigned int b = __float_as_uint(x) & 0x7fffffffu; bool inside = b >= lo && b < hi;"
    bits_y = "unsigned int c = __float_as_uint(y) & 0x7fffffffu; bool inside_y = c >= lo && c < hi;"
    pair = f"{bits} {bits_y}"
    return SimpleNamespace(
        add=make(ENCODE_IN, TOTAL, f"{bits} {masked('total', C_OPS, False)};", "mz_add"),
        assign=make(ENCODE_IN, TOTAL, f"{bits} {masked('total', C_OPS, True)};", "mz_assign"),
        add_pair=make(PAIR_IN, TOTAL, f"{pair} {masked_pair('total', C_OPS, False)};", "mz_add_pair"),
        assign_pair=make(PAIR_IN, TOTAL, f"{pair} {masked_pair('total', C_OPS, True)};", "mz_assign_pair"),
        wire=make(ENCODE_IN, WIRE_OUT, f"{bits} {masked_wire('out', C_OPS)};", "mz_wire"),
        widen=make(WIDEN_IN, TOTAL, f"total = {widen(C_OPS, 'total', 'wire')}", "mz_widen"),
        decode=make(DECODE_IN, WIRE_OUT, f"out = {decode(C_OPS, 'total', 'divisor')}", "mz_decode"),
    )


def device_encode(cupy, total, x, k: int, lo: int, hi: int, assign: bool):
    """The masked encode on the GPU in one pass; return (the largest bit pattern, the count outside) as device
    scalars, so no host synchronisation happens here. A float32 ``total`` is a wire buffer: written (``assign``)
    with the rounded values, to be widened at the owner (``device_widen``)."""
    if total.dtype == np.float32:
        if not assign:
            raise ValueError("a float32 wire buffer holds one contribution: it is written, never added to")
        kernels(cupy).wire(x, k, lo, hi, total)
    else:
        (kernels(cupy).assign if assign else kernels(cupy).add)(x, k, lo, hi, total)
    return device_top_and_outside(cupy, x, lo, hi)


def device_widen(cupy, wire, total) -> None:
    """``total += wire`` in int64 on the GPU, ``wire`` float32 integers (``rounded``), in one pass."""
    kernels(cupy).widen(wire, total)


def device_encode_pair(cupy, total, x, y, k: int, lo: int, hi: int, assign: bool):
    """``device_encode`` of ``x`` then ``y`` in one pass over ``total``; each one's (top, outside) device scalars."""
    (kernels(cupy).assign_pair if assign else kernels(cupy).add_pair)(x, y, k, lo, hi, total)
    return [device_top_and_outside(cupy, x, lo, hi), device_top_and_outside(cupy, y, lo, hi)]


def device_top_and_outside(cupy, x, lo: int, hi: int):
    """The largest magnitude's bit pattern and the number of elements outside ``[lo, hi)``, as device scalars."""
    if x.size == 0:
        return cupy.zeros((), cupy.uint32), cupy.zeros((), cupy.int64)
    bits = x.view(cupy.uint32) & np.uint32(0x7FFFFFFF)
    return bits.max(), ((bits < lo) | (bits >= hi)).sum(dtype=cupy.int64)


def device_decode(cupy, total, divisor: float, out) -> None:
    """``exact.decode`` on the GPU, in one pass (``out`` flat, same length)."""
    kernels(cupy).decode(total, divisor, out)


MAX_SEGMENTS = 32  # segments one decode launch takes (three scalars each)


def device_decode_segments(cupy, total, segments, out) -> None:
    """Decode each segment ``(lo, hi, divisor)`` of ``total`` into ``out`` (same length) and write 0 elsewhere, in one
    launch per ``MAX_SEGMENTS`` segments (sorted by ``lo``), each over its own part of ``out``."""
    for start, stop, part in Decoding(total, tuple(segments)).chunks():
        _segments_kernel(cupy, len(part.segments))(part.total, part.segments, out[start:stop])


def segment_pick(count: int) -> str:
    """C statements setting ``divisor`` and ``inside`` for element ``i`` from ``count`` segments' scalars."""
    pick = " else ".join(f"if (i >= lo{s} && i < hi{s}) {{ divisor = d{s}; inside = true; }}" for s in range(count))
    return f"double divisor = 1.0; bool inside = false; {pick}"


def segment_params(count: int) -> str:
    """The kernel parameters of ``count`` segments (``lo``, ``hi``, ``d``: a decode's divisor)."""
    return ", ".join(f"int64 lo{s}, int64 hi{s}, float64 d{s}" for s in range(count))


def segment_scalars(segments) -> list:
    """The kernel arguments of ``segments``, typed as ``segment_params`` declares them."""
    return [v for lo, hi, d in segments for v in (np.int64(lo), np.int64(hi), np.float64(d))]


def decode_segments_numpy(total, segments, out) -> None:
    """``out`` = each segment's decode of ``total`` (host arrays), 0 elsewhere: the stand-in's kernel bodies."""
    out[...] = 0
    for lo, hi, divisor in segments:
        out[lo:hi] = decode(NUMPY_OPS, total[lo:hi], divisor)


def decoded_statement(target: str) -> str:
    """The C statement writing element ``i``'s decode into ``target`` (0 outside every segment)."""
    return f"{target} = inside ? {decode(C_OPS, 'total', 'divisor')} : 0.0f;"


def rescale_params(count: int) -> str:
    """The kernel parameters of ``count`` segments of a rescale (``lo``, ``hi``, ``s``: the shift)."""
    return ", ".join(f"int64 lo{s}, int64 hi{s}, int64 s{s}" for s in range(count))


def rescaled_statement(count: int, target: str) -> str:
    """C statements dividing element ``i`` of the int64 ``target`` by ``2**shift`` in place, ``shift`` its
    segment's (0 outside every one), rounding half to even: ``exact.rescale``'s formula."""
    pick = " else ".join(f"if (i >= lo{s} && i < hi{s}) shift = s{s};" for s in range(count))
    return (
        f"long long shift = 0; {pick} if (shift >= 64) {{ {target} = 0; }} else if (shift > 0) {{ "
        f"long long f = {target} >> shift; long long r = {target} - (long long)((unsigned long long)f << shift); "
        f"long long h = 1LL << (shift - 1); {target} = f + ((r > h || (r == h && (f & 1))) ? 1 : 0); }}"
    )


@dataclass(frozen=True)
class Decoding:
    """An int64 sum still to decode and its segments' ``(lo, hi, divisor)``: what a device's update decodes as it
    reads it (``optim.device_update``), in the same launch; ``NUMPY_OPS`` and ``C_OPS`` spell it alike."""

    total: object
    segments: tuple

    def within(self, lo: int, hi: int) -> Decoding:
        """Its part over ``[lo, hi)``, relative to ``lo``."""
        parts = tuple((max(a, lo) - lo, min(b, hi) - lo, d) for a, b, d in self.segments if a < hi and b > lo)
        return Decoding(self.total[lo:hi], parts)

    def chunks(self):
        """``(start, stop, part)`` covering the sum, each part of at most ``MAX_SEGMENTS`` segments."""
        size = self.total.size
        bounds = [0, *(self.segments[i][0] for i in range(MAX_SEGMENTS, len(self.segments), MAX_SEGMENTS)), size]
        for start, stop in zip(bounds[:-1], bounds[1:]):
            if stop > start:
                yield start, stop, self.within(start, stop)

    @property
    def params(self) -> str:
        return segment_params(len(self.segments))

    @property
    def scalars(self) -> list:
        return segment_scalars(self.segments)

    def statement(self, target: str) -> str:
        """C statements decoding element ``i`` of ``total`` into ``target``."""
        return f"{segment_pick(len(self.segments))} {decoded_statement(target)}"

    def numpy(self, total, out) -> None:
        """The decode evaluated by NumPy on host arrays (the stand-in's body)."""
        decode_segments_numpy(total, self.segments, out)


@functools.cache
def _segments_kernel(cupy, count: int):
    """``launch(total, segments, out)`` for ``count`` segments: CuPy's kernel, or NumPy's body on the stand-in."""
    params = segment_params(count)
    inputs = f"int64 total{', ' if params else ''}{params}"
    if is_standin(cupy):  # the segments bound to each launch, as CuPy passes scalars by value
        return lambda total, segments, out: cupy.kernel(
            functools.partial(mz_decode_segments, segments), "int64 total", WIRE_OUT
        )(total, out)
    body = f"{segment_pick(count)} {decoded_statement('out')}"
    kernel = cupy.ElementwiseKernel(inputs, WIRE_OUT, body, "mz_decode_segments")
    return lambda total, segments, out: kernel(total, *segment_scalars(segments), out)


def mz_decode_segments(segments: list, total, out) -> None:
    """The stand-in's decode kernel: ``decode_segments_numpy`` on the memory underneath."""
    decode_segments_numpy(total, segments, out)
