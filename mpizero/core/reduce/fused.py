"""The exact encode and decode, each one formula: compiled into CuPy and host C kernels, or evaluated by NumPy.

The encode reads a float32 gradient and the int64 total once and writes the
total once; elements whose magnitude lies outside a range of float32 bit
patterns ``[lo, hi)`` are left out (``scales``: kept, or beyond the cap), and
each call also returns the largest magnitude's bit pattern and how many were
left out. The decode reads the total and writes float32 once. One call per
tensor (or owned piece of one), since each has its own scale.

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
from types import SimpleNamespace

import numpy as np

from mpizero.arrays import is_standin


def encode(ops, total, x, k):
    """``total + rint(x * 2**k)`` in int64, ``x`` float32."""
    return ops.add(total, ops.to_int64(ops.rint(ops.ldexp(x, k))))


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

# The host kernel multiplies by the float32 2**k (exact, as ldexp is) and rounds with nearbyintf; the element's
# mask selects between the rounded value and 0 there, which keeps GCC from folding the rounding and the cast into
# a scalar llrintf, so the loop vectorizes. The int64 add wraps (-fwrapv) where a pass that will be redone overflows.
HOST_C_OPS = SimpleNamespace(
    **{
        **vars(C_OPS),
        "rint": lambda a: f"(inside ? nearbyintf({a}) : 0.0f)",
        "ldexp": lambda a, b: f"{a} * {b}",
        "to_int64": lambda a: f"(int64_t){a}",
    }
)


def masked(total: str, ops, assign: bool) -> str:
    """A kernel's statement: the encode of ``x`` where ``inside``, of 0 elsewhere (the total stays as it was)."""
    return f"{total} = {encode(ops, '0' if assign else total, 'inside ? x : 0.0f', 'k')}"


def numpy_kernels(kernel) -> SimpleNamespace:
    """The same kernels as NumPy bodies, each made a device launch by ``kernel`` (the stand-in's, which runs them
    on the memory underneath its device arrays: ``mpizero.standin``)."""

    def masked_encode(assign: bool):
        def body(x, k, lo, hi, total):
            bits = x.view(np.uint32) & np.uint32(0x7FFFFFFF)
            kept_in = np.where((bits >= lo) & (bits < hi), x, np.float32(0))  # the C kernel's ``inside ? x : 0``
            total[...] = encode(numpy_ops(int(k)), np.int64(0) if assign else total, kept_in, int(k))

        return kernel(body)

    def decode_into(total, divisor, out):
        out[...] = decode(NUMPY_OPS, total, divisor)

    return SimpleNamespace(add=masked_encode(False), assign=masked_encode(True), decode=kernel(decode_into))


@functools.cache
def kernels(cupy) -> SimpleNamespace:
    """The device kernels (built on first use): ``add``, ``assign`` (masked encodes), ``decode``; compiled by CuPy,
    or evaluated by NumPy on the stand-in."""
    if is_standin(cupy):
        return numpy_kernels(cupy.kernel)
    make = cupy.ElementwiseKernel
    inputs = "float32 x, int32 k, uint32 lo, uint32 hi"
    bits = "unsigned int b = __float_as_uint(x) & 0x7fffffffu; bool inside = b >= lo && b < hi;"
    return SimpleNamespace(
        add=make(inputs, "int64 total", f"{bits} {masked('total', C_OPS, False)};", "mz_add"),
        assign=make(inputs, "int64 total", f"{bits} {masked('total', C_OPS, True)};", "mz_assign"),
        decode=make(
            "int64 total, float64 divisor", "float32 out", f"out = {decode(C_OPS, 'total', 'divisor')}", "mz_decode"
        ),
    )


def device_encode(cupy, total, x, k: int, lo: int, hi: int, assign: bool):
    """The masked encode on the GPU in one pass; return (the largest bit pattern, the count outside) as device
    scalars, so no host synchronisation happens here."""
    (kernels(cupy).assign if assign else kernels(cupy).add)(x, k, lo, hi, total)
    return device_top_and_outside(cupy, x, lo, hi)


def device_top_and_outside(cupy, x, lo: int, hi: int):
    """The largest magnitude's bit pattern and the number of elements outside ``[lo, hi)``, as device scalars."""
    if x.size == 0:
        return cupy.zeros((), cupy.uint32), cupy.zeros((), cupy.int64)
    bits = x.view(cupy.uint32) & np.uint32(0x7FFFFFFF)
    return bits.max(), ((bits < lo) | (bits >= hi)).sum(dtype=cupy.int64)


def device_decode(cupy, total, divisor: float, out) -> None:
    """``exact.decode`` on the GPU, in one pass (``out`` flat, same length)."""
    kernels(cupy).decode(total, divisor, out)
