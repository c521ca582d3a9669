"""The host's encode and decode kernels: one pass per tensor, built from ``arithmetic``'s formulas by the system C
compiler.

The encode reads each float32 element once, keeps the int64 total in the same
pass, and returns the largest magnitude and how many elements it left out, so
no second pass over the gradient finds its maximum. The paired encode adds two
contributions in one pass over the total (12 bytes an element and contribution,
not 20): each is rounded on its own and int64 addition is associative, so its
bytes are two single encodes'. The wire encode writes one contribution's
rounded values as float32 (``arithmetic.rounded``), which the owner widens into
its int64 sum (``widen``). The decode reads the int64 total once and writes
float32 once. They are compiled at first use (``mpizero.compiled``). Where no
compiler works, or ``MPIZERO_HOST_KERNELS=numpy`` is set, NumPy evaluates the
same formulas chunk by chunk: the same bits
(``tests/core/test_kernels.py``), slower. Scales outside float32's exponent range,
which need ``ldexp``, always take the NumPy path.
"""

from __future__ import annotations

import ctypes
import functools
import math

import numpy as np

from mpizero import compiled
from mpizero.arrays import CHUNK
from mpizero.core.reduce import arithmetic

LOOP = """    for (size_t i = 0; i < n; i++) {{
        float v = x[i];
        uint32_t b;
        memcpy(&b, &v, 4);
        b &= 0x7fffffffu;
        top = b > top ? b : top;
        int inside = (b >= lo) & (b < hi);
        outside += !inside;
        {target}[i] = {statement};
    }}
"""
PAIR_LOOP = """    for (size_t i = 0; i < n; i++) {{
        float v = x[i], w = y[i];
        uint32_t b, c;
        memcpy(&b, &v, 4);
        memcpy(&c, &w, 4);
        b &= 0x7fffffffu;
        c &= 0x7fffffffu;
        top = b > top ? b : top;
        top_y = c > top_y ? c : top_y;
        int inside = (b >= lo) & (b < hi);
        int inside_y = (c >= lo) & (c < hi);
        outside += !inside;
        outside_y += !inside_y;
        total[i] = {statement};
    }}
"""
SECOND_OPS = arithmetic.masked_ops(arithmetic.HOST_C_OPS, "inside_y")


def _pair_statement(total: str) -> str:
    """``total + rint(x * f) + rint(y * f)``, each rounded where its own element is inside."""
    return arithmetic.encode(SECOND_OPS, arithmetic.encode(arithmetic.HOST_C_OPS, total, "v", "f"), "w", "f")


SOURCE = (
    """MZ_CLONES
int64_t mz_encode(int64_t *restrict total, const float *restrict x, size_t n, float f, uint32_t lo, uint32_t hi,
                  int assign, uint32_t *top_out) {
    uint32_t top = 0;
    int64_t outside = 0;
    if (assign) {
"""
    + LOOP.format(target="total", statement=arithmetic.encode(arithmetic.HOST_C_OPS, "0", "v", "f"))
    + "    } else {\n"
    + LOOP.format(target="total", statement=arithmetic.encode(arithmetic.HOST_C_OPS, "total[i]", "v", "f"))
    + """    }
    *top_out = top;
    return outside;
}

MZ_CLONES
int64_t mz_encode_wire(float *restrict out, const float *restrict x, size_t n, float f, uint32_t lo, uint32_t hi,
                       uint32_t *top_out) {
    uint32_t top = 0;
    int64_t outside = 0;
"""
    + LOOP.format(target="out", statement=arithmetic.rounded(arithmetic.HOST_C_OPS, "v", "f"))
    + """    *top_out = top;
    return outside;
}

MZ_CLONES
void mz_decode(const int64_t *restrict total, size_t n, double divisor, float *restrict out) {
    for (size_t i = 0; i < n; i++) {
        out[i] = """
    + arithmetic.decode(arithmetic.HOST_C_OPS, "total[i]", "divisor")
    + """;
    }
}

MZ_CLONES
void mz_encode_pair(int64_t *restrict total, const float *restrict x, const float *restrict y, size_t n, float f,
                    uint32_t lo, uint32_t hi, int assign, uint32_t *tops, int64_t *outsides) {
    uint32_t top = 0, top_y = 0;
    int64_t outside = 0, outside_y = 0;
    if (assign) {
"""
    + PAIR_LOOP.format(statement=_pair_statement("0"))
    + "    } else {\n"
    + PAIR_LOOP.format(statement=_pair_statement("total[i]"))
    + """    }
    tops[0] = top;
    tops[1] = top_y;
    outsides[0] = outside;
    outsides[1] = outside_y;
}
"""
)


def encode(total, x, k: int, lo: int, hi: int, assign: bool) -> tuple[int, int]:
    """``total (+)= rint(x * 2**k)`` where ``x``'s magnitude bits lie in ``[lo, hi)`` (flat float32 ``x``, int64
    ``total``); return the largest magnitude's bits and how many elements lay outside. A float32 ``total`` is a
    wire buffer: written (``assign`` only) with the rounded values, which ``widen`` adds at the owner."""
    wire = total.dtype == np.float32
    if wire and not assign:
        raise ValueError("a float32 wire buffer holds one contribution: it is written, never added to")
    library = _library()[0]
    if library is None or not -126 <= k <= 127 or x.size == 0:
        return numpy_encode(total, x, k, lo, hi, assign)
    top, factor = ctypes.c_uint32(), np.float32(math.ldexp(1.0, k))
    if wire:
        outside = library.mz_encode_wire(_address(total), _address(x), x.size, factor, lo, hi, ctypes.byref(top))
    else:
        outside = library.mz_encode(
            _address(total), _address(x), x.size, factor, lo, hi, int(assign), ctypes.byref(top)
        )
    return top.value, outside


def widen(wire, total) -> None:
    """``total += wire`` in int64, ``wire`` float32 integers from the wire encode, chunk by chunk (exact; a value
    beyond int64, from a pass to be redone, wraps as the encode's own add does)."""
    whole = np.empty(min(wire.size, CHUNK), np.int64)
    with np.errstate(invalid="ignore"):
        for start in range(0, wire.size, CHUNK):
            stop = min(start + CHUNK, wire.size)
            piece = whole[: stop - start]
            piece[...] = wire[start:stop]
            total[start:stop] += piece


def decode(total, divisor: float, out) -> bool:
    """``out = total / divisor`` rounded once to float32 (``arithmetic.decode``; flat int64 ``total``, flat float32
    ``out``) in one compiled pass; False, writing nothing, where there is no compiled kernel."""
    library = _library()[0]
    if library is None or not out.flags.c_contiguous:
        return False
    library.mz_decode(_address(total), total.size, divisor, out.ctypes.data)
    return True


def encode_pair(total, x, y, k: int, lo: int, hi: int, assign: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """``encode`` of ``x`` then of ``y`` (same length) in one pass over ``total``: the same bytes; return each
    one's (largest magnitude's bits, elements outside)."""
    library = _library()[0]
    if library is None or not -126 <= k <= 127 or x.size == 0:
        return numpy_encode(total, x, k, lo, hi, assign), numpy_encode(total, y, k, lo, hi, False)
    tops, outsides = (ctypes.c_uint32 * 2)(), (ctypes.c_int64 * 2)()
    factor = np.float32(math.ldexp(1.0, k))
    library.mz_encode_pair(
        _address(total), _address(x), _address(y), x.size, factor, lo, hi, int(assign), tops, outsides
    )
    return (tops[0], outsides[0]), (tops[1], outsides[1])


def numpy_encode(total, x, k: int, lo: int, hi: int, assign: bool) -> tuple[int, int]:
    """``encode``'s formula evaluated by NumPy in cache-sized chunks (the fallback, and what tests compare with)."""
    n, top, outside = x.size, 0, 0
    size = min(n, CHUNK)
    bits, left_out, scaled, whole = (np.empty(size, t) for t in (np.uint32, bool, np.float32, np.int64))
    ops = arithmetic.numpy_ops(k)
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, n, CHUNK):
            stop = min(start + CHUNK, n)
            m = stop - start
            piece, b, out, tmp, tmp_int = x[start:stop], bits[:m], left_out[:m], scaled[:m], whole[:m]
            np.bitwise_and(piece.view(np.uint32), np.uint32(0x7FFFFFFF), out=b)
            top = max(top, int(b.max()))
            np.greater_equal(b, hi, out=out)
            if lo:
                out |= b < lo
            left = int(np.count_nonzero(out))
            outside += left
            np.rint(ops.ldexp(piece, k), out=tmp)
            if left:
                np.copyto(tmp, 0.0, where=out)
            if assign:
                total[start:stop] = tmp
            else:
                tmp_int[...] = tmp
                total[start:stop] += tmp_int
    return top, outside


def top_bits(x) -> int:
    """The largest magnitude's bit pattern of a flat float32 array (NaN's above inf's)."""
    pieces = (x[start : start + CHUNK].view(np.uint32) & np.uint32(0x7FFFFFFF) for start in range(0, x.size, CHUNK))
    return max((int(bits.max()) for bits in pieces), default=0)


def backend() -> str:
    """Which encode the host runs: the compiled kernel (and its compiler), or NumPy and why."""
    return _library()[1]


def _address(array) -> int:
    if not array.flags.c_contiguous:
        raise ValueError(f"the encode kernel needs contiguous arrays, got strides {array.strides}")
    return array.__array_interface__["data"][0]


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel library and a description, or None and the reason NumPy is used."""
    library, description = compiled.kernel_library("encode", SOURCE)
    if library is None:
        return None, description
    library.mz_encode.restype = ctypes.c_int64
    library.mz_encode.argtypes = [
        *(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_float),
        *(ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int, ctypes.POINTER(ctypes.c_uint32)),
    ]
    library.mz_encode_wire.restype = ctypes.c_int64
    library.mz_encode_wire.argtypes = [
        *(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_float),
        *(ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)),
    ]
    library.mz_decode.restype = None
    library.mz_decode.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_double, ctypes.c_void_p]
    library.mz_encode_pair.restype = None
    library.mz_encode_pair.argtypes = [
        *(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_float),
        *(ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int, ctypes.POINTER(ctypes.c_uint32)),
        ctypes.POINTER(ctypes.c_int64),
    ]
    problem = self_test(library)
    if compiled.self_tested(library, "encode", problem) is None:
        return None, f"numpy (the compiled kernel failed its self-test: {problem})"
    return library, description


PROBE_SCALES = (0, 1, -3, 24, -60)  # 2**k: at 1, small and large
PROBE_DIVISORS = (1.0, 3.0, 10.0, 2.0**-5, 7.0 * 2**40)


def probe_values(k: int) -> np.ndarray:
    """Float32 values the encode at scale ``k`` must round as NumPy does: halfway ties either side, subnormals,
    signed zeros, the largest magnitudes, inf and NaN (left out), and random ones over many exponents."""
    ties = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 1.5000001, 1e6 + 0.5], np.float64)
    special = [1e-45, -1e-45, 1.1754942e-38, 0.0, -0.0, 1.0, -7.0, 3.4028235e38, -3.4028235e38, np.inf, np.nan]
    rng = np.random.default_rng(k & 0xFFFF)
    spread = rng.standard_normal(200) * np.exp2(rng.integers(-40, 40, 200))
    return np.concatenate([np.ldexp(ties, -k), special, spread]).astype(np.float32)


def self_test(library) -> str | None:
    """What the compiled kernels compute otherwise than NumPy's formulas (``numpy_encode``, ``arithmetic.decode``)
    on the probe values, in words; None where every bit agrees."""
    for k in PROBE_SCALES:
        x = probe_values(k)
        y = x[::-1].copy()
        lo, hi = int(np.float32(2.0**-30).view(np.uint32)), int(np.float32(2.0 ** (60 - k)).view(np.uint32))
        factor, top = np.float32(math.ldexp(1.0, k)), ctypes.c_uint32()
        start = np.random.default_rng(1).integers(-(2**40), 2**40, x.size)
        for assign in (True, False):
            ours, theirs = start.copy(), start.copy()
            outside = library.mz_encode(_address(ours), _address(x), x.size, factor, lo, hi, int(assign), top)
            if (top.value, outside) != numpy_encode(theirs, x, k, lo, hi, assign) or not np.array_equal(ours, theirs):
                return f"the encode at 2**{k}"
            tops, outsides = (ctypes.c_uint32 * 2)(), (ctypes.c_int64 * 2)()
            ours = start.copy()
            library.mz_encode_pair(
                _address(ours), _address(x), _address(y), x.size, factor, lo, hi, int(assign), tops, outsides
            )
            numpy_encode(theirs, y, k, lo, hi, False)
            if not np.array_equal(ours, theirs):
                return f"the paired encode at 2**{k}"
        wire, expected = np.empty(x.size, np.float32), np.empty(x.size, np.float32)
        library.mz_encode_wire(_address(wire), _address(x), x.size, factor, lo, hi, top)
        numpy_encode(expected, x, k, lo, hi, True)
        if wire.tobytes() != expected.tobytes():
            return f"the wire encode at 2**{k}"
    totals = np.random.default_rng(2).integers(-(2**62), 2**62, 256)
    for divisor in PROBE_DIVISORS:
        out = np.empty(totals.size, np.float32)
        library.mz_decode(_address(totals), totals.size, divisor, out.ctypes.data)
        if out.tobytes() != arithmetic.decode(arithmetic.NUMPY_OPS, totals, divisor).tobytes():
            return f"the decode by {divisor!r}"
    return None
