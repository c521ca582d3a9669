"""Parameters in the param dtype as an array module holds them: bfloat16 on a device as 16-bit words.

CuPy has no full bfloat16, so on a device (CuPy, or the stand-in, which holds
no bfloat16 either) a bfloat16 parameter is its 16-bit word (uint16): the
upper half of the float32 it rounds to. Our own kernels round float32 masters
into words and widen words back, by the host's rule (ml_dtypes'): round to
nearest even, a NaN to the quiet NaN of its sign, overflow to infinity;
widening is exact (the word shifted left 16). Every other dtype, and bfloat16
on the host, is held as itself and converted by ``astype``.

The rule is written once, as a function of an ``ops`` namespace: ``NUMPY_OPS``
evaluates it on uint32 bit patterns, ``C_OPS`` spells it for CUDA.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import ml_dtypes
import numpy as np

from mpizero.arrays import array_module, is_standin, to_host

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
WORD = np.dtype(np.uint16)


def word(ops, bits):
    """The bfloat16 word of float32 bit pattern ``bits``: a NaN becomes the quiet NaN of its sign; anything else
    rounds to nearest, ties to even (adding ``0x7fff`` plus the kept part's lowest bit carries into the upper
    half exactly when the lower half is over halfway, or halfway with an odd upper half; it never overflows 32
    bits, as no float32 short of a NaN lies above ``0xff800000``)."""
    upper = ops.shift(bits, 16)
    nan = ops.greater(ops.mask(bits, 0x7FFFFFFF), 0x7F800000)
    nearest = ops.shift(ops.add(bits, ops.add(0x7FFF, ops.mask(upper, 1))), 16)
    return ops.to_word(ops.where(nan, ops.merge(ops.mask(upper, 0x8000), 0x7FC0), nearest))


def widened(ops, words):
    """The float32 bit pattern of bfloat16 ``words``: each shifted into the upper half, exactly."""
    return ops.unshift(ops.to_bits(words), 16)


NUMPY_OPS = SimpleNamespace(
    shift=lambda a, n: np.right_shift(a, np.uint32(n)),
    unshift=lambda a, n: np.left_shift(a, np.uint32(n)),
    mask=lambda a, m: np.bitwise_and(a, np.uint32(m)),
    merge=lambda a, m: np.bitwise_or(a, np.uint32(m)),
    add=lambda a, b: np.add(np.uint32(a) if isinstance(a, int) else a, b),
    greater=lambda a, b: np.greater(a, np.uint32(b)),
    where=np.where,
    to_word=lambda a: a.astype(np.uint16),
    to_bits=lambda a: a.astype(np.uint32),
)
C_OPS = SimpleNamespace(
    shift=lambda a, n: f"({a} >> {n})",
    unshift=lambda a, n: f"({a} << {n})",
    mask=lambda a, m: f"({a} & {m:#x}u)",
    merge=lambda a, m: f"({a} | {m:#x}u)",
    add=lambda a, b: f"({a:#x}u + {b})" if isinstance(a, int) else f"({a} + {b})",
    greater=lambda a, b: f"({a} > {b:#x}u)",
    where=lambda c, a, b: f"({c} ? {a} : {b})",
    to_word=lambda a: f"(unsigned short){a}",
    to_bits=lambda a: f"(unsigned int){a}",
)

ROUND_SOURCE = f"unsigned int bits = __float_as_uint(x); words = {word(C_OPS, 'bits')};"  # float32 x -> uint16 words
WIDEN_SOURCE = f"x = __uint_as_float({widened(C_OPS, 'words')});"  # uint16 words -> float32 x


ROUND_PARAMS = ("float32 x", "uint16 words")  # the kernels' (in_params, out_params), as CuPy compiles them
WIDEN_PARAMS = ("uint16 words", "float32 x")


@functools.cache
def kernels(xp) -> SimpleNamespace:
    """``round(x, words)`` and ``widen(words, x)``: compiled by CuPy (``unsigned short`` words), or the NumPy
    bodies of the same formulas, as the stand-in's launches or plain calls on the host."""

    def round_body(x, words):
        words[...] = word(NUMPY_OPS, x.view(np.uint32))

    def widen_body(words, x):
        x.view(np.uint32)[...] = widened(NUMPY_OPS, words)

    if xp is np:
        return SimpleNamespace(round=round_body, widen=widen_body)
    if is_standin(xp):
        return SimpleNamespace(round=xp.kernel(round_body, *ROUND_PARAMS), widen=xp.kernel(widen_body, *WIDEN_PARAMS))
    return SimpleNamespace(
        round=xp.ElementwiseKernel(*ROUND_PARAMS, ROUND_SOURCE, "mz_bf16_round"),
        widen=xp.ElementwiseKernel(*WIDEN_PARAMS, WIDEN_SOURCE, "mz_bf16_widen"),
    )


def held_dtype(xp, param_dtype) -> np.dtype:
    """The dtype array module ``xp`` holds parameters of ``param_dtype`` in: bfloat16 as words on a device."""
    param_dtype = np.dtype(param_dtype)
    return WORD if param_dtype == BFLOAT16 and xp is not np else param_dtype


def to_held(values, dtype: np.dtype, out=None):
    """Float32 ``values`` rounded to held ``dtype`` (``held_dtype``'s), into ``out`` if given; ``values`` itself
    where it is float32 already and no ``out`` is given."""
    if dtype == WORD:
        xp = array_module(values)
        out = xp.empty(values.shape, WORD) if out is None else out
        kernels(xp).round(values, out)
        return out
    if out is None:
        return values.astype(dtype, copy=False)
    out[...] = values
    return out


def to_float32(params, out=None):
    """Held ``params`` as float32 (exact), into ``out`` if given; float32 ``params`` themselves if no ``out``."""
    if params.dtype == WORD:
        xp = array_module(params)
        out = xp.empty(params.shape, np.float32) if out is None else out
        kernels(xp).widen(params, out)
        return out
    if out is None:
        return params.astype(np.float32, copy=False)
    out[...] = params
    return out


def on_host(params) -> np.ndarray:
    """Host ``params`` in their param dtype: words (copied from a device) viewed as bfloat16."""
    host = to_host(params)
    return host.view(BFLOAT16) if host.dtype == WORD else host
