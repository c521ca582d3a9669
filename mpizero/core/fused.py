"""The exact encode and decode, each one formula: compiled into one CuPy kernel, or evaluated by NumPy.

On the GPU each is one pass (``cupy.ElementwiseKernel``): the encode reads a
float32 gradient and the int64 total once and writes the total once, against
four launches and two temporaries for the same steps one array operation at a
time; the decode reads the total and writes float32 once. One launch per
tensor (or owned piece of one), since each has its own scale.

The arithmetic is written once, as a function of an ``ops`` namespace:
``NUMPY_OPS`` evaluates it on host arrays, ``C_OPS`` spells it as the
kernel's C expression. The CPU tests hold the NumPy evaluation to
``exact.add_into``'s and ``exact.decode``'s bytes, so the kernel computes what
the host path computes: float32 ``ldexp`` is exact (a power-of-two scale),
``rint`` rounds half to even in both, and the int64-to-float64,
float64-to-float32 casts and the float64 division round to nearest in both.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np


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

C_OPS = SimpleNamespace(
    add=lambda a, b: f"{a} + {b}",
    to_int64=lambda a: f"(long long){a}",
    rint=lambda a: f"rintf({a})",
    ldexp=lambda a, b: f"ldexpf({a}, {b})",
    to_float64=lambda a: f"(double){a}",
    divide=lambda a, b: f"{a} / {b}",
    to_float32=lambda a: f"(float)({a})",
)


@functools.cache
def kernels(cupy) -> SimpleNamespace:
    """The compiled kernels (built on first use): ``add(x, k, total)``, ``assign(x, k, total)``, ``decode``."""
    make = cupy.ElementwiseKernel
    return SimpleNamespace(
        add=make("float32 x, int32 k", "int64 total", f"total = {encode(C_OPS, 'total', 'x', 'k')}", "mz_add"),
        assign=make("float32 x, int32 k", "int64 total", f"total = {encode(C_OPS, '0', 'x', 'k')}", "mz_assign"),
        decode=make(
            "int64 total, float64 divisor", "float32 out", f"out = {decode(C_OPS, 'total', 'divisor')}", "mz_decode"
        ),
    )


def device_add_into(cupy, total, x, k: int, assign: bool) -> None:
    """``exact.add_into`` on the GPU, in one pass."""
    (kernels(cupy).assign if assign else kernels(cupy).add)(x, k, total)


def device_decode(cupy, total, divisor: float, out) -> None:
    """``exact.decode`` on the GPU, in one pass (``out`` flat, same length)."""
    kernels(cupy).decode(total, divisor, out)


def device_max_abs(cupy, arrays) -> np.ndarray:
    """The largest magnitude of each array as float64 on the host, after one device-to-host copy in all."""
    largest = [cupy.maximum(a.max(), -a.min()) if a.size else cupy.zeros((), a.dtype) for a in arrays]
    return cupy.stack(largest).astype(np.float64).get() if largest else np.zeros(0)
