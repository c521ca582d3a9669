"""The host's compiled encode gives NumPy's bytes, counts and maxima, and falls back to NumPy where it cannot."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpizero import compiled
from mpizero.core.reduce import exact, kernels

SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-40, 3e38, 0.5, -1.5, 2.5], dtype=np.float32)
needs_compiler = pytest.mark.skipif(
    not kernels.backend().startswith("compiled"), reason=f"no compiled kernel here: {kernels.backend()}"
)


def gradients(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-40, 30, n)).astype(np.float32)
    x[: min(n, SPECIAL.size)] = SPECIAL[: min(n, SPECIAL.size)]
    return rng.permutation(x)


@needs_compiler
@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(0, 3000),
    k=st.integers(-126, 127),
    lo=st.integers(0, exact.INF_BITS),
    width=st.integers(0, 2**32),
    assign=st.booleans(),
)
def test_the_compiled_encode_gives_numpys_bytes(seed, n, k, lo, width, assign):
    x = gradients(seed, n)
    hi = min(lo + width, 2**32 - 1)
    start = np.random.default_rng(seed).integers(-(2**40), 2**40, n)
    compiled, numpy = start.copy(), start.copy()
    found = kernels.encode(compiled, x, k, lo, hi, assign)
    assert found == kernels.numpy_encode(numpy, x, k, lo, hi, assign)
    bits = x.view(np.uint32) & np.uint32(0x7FFFFFFF)
    inside = (bits >= lo) & (bits < hi)
    assert found[1] == int(np.count_nonzero(~inside))
    assert found[0] == (int(bits.max()) if n else 0)
    in_reach = ~inside | (np.abs(np.ldexp(x.astype(np.float64), k)) < 2.0**62)  # beyond it: a pass to be redone
    assert compiled[in_reach].tobytes() == numpy[in_reach].tobytes()
    expected = np.where(inside, np.rint(np.ldexp(x.astype(np.float64), k)), 0.0)
    base = 0 if assign else start
    assert (compiled - base)[inside & in_reach].tolist() == expected[inside & in_reach].astype(np.int64).tolist()


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(0, 3000),
    k=st.integers(-140, 140),
    lo=st.integers(0, exact.INF_BITS),
    width=st.integers(0, 2**32),
    assign=st.booleans(),
)
def test_the_paired_encode_gives_two_single_encodes_bytes(seed, n, k, lo, width, assign):
    x, y = gradients(seed, n), gradients(seed + 1, n)
    hi = min(lo + width, 2**32 - 1)
    start = np.random.default_rng(seed).integers(-(2**40), 2**40, n)
    paired, single = start.copy(), start.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        found = kernels.encode_pair(paired, x, y, k, lo, hi, assign)
        expected = kernels.numpy_encode(single, x, k, lo, hi, assign), kernels.numpy_encode(single, y, k, lo, hi, False)
    assert found == expected  # each contribution's own maximum and left-out count
    reach = np.abs(np.ldexp(x.astype(np.float64), k)) + np.abs(np.ldexp(y.astype(np.float64), k)) < 2.0**61
    assert paired[reach].tobytes() == single[reach].tobytes()  # beyond it (NaN, inf, overflow): never decoded


def test_scales_beyond_float32s_exponents_take_numpys_ldexp():
    x = np.array([2.0**-100, -(2.0**-120), 3.0 * 2.0**-140], dtype=np.float32)
    total = np.zeros(3, np.int64)
    assert kernels.encode(total, x, 160, 0, exact.INF_BITS, True) == (int(x.view(np.uint32)[0]), 0)
    assert total.tolist() == [2**60, -(2**40), 3 * 2**20]


def test_numpy_is_used_when_asked_or_without_a_compiler(tmp_path):
    script = "from mpizero.core.reduce import kernels; print(kernels.backend())"
    for env, expected in [
        ({compiled.ENV_VAR: "numpy"}, "numpy (MPIZERO_HOST_KERNELS=numpy)"),
        ({"CC": "/nonexistent/cc"}, "numpy (/nonexistent/cc failed"),
    ]:
        full = {**os.environ, **env, compiled.CACHE_ENV_VAR: str(tmp_path)}
        done = subprocess.run([sys.executable, "-c", script], env=full, capture_output=True, text=True, timeout=120)
        assert done.stdout.startswith(expected), (done.stdout, done.stderr)


@needs_compiler
def test_the_library_is_compiled_once_into_the_cache(tmp_path):
    script = "from mpizero.core.reduce import kernels; print(kernels.backend())"
    env = {**os.environ, compiled.CACHE_ENV_VAR: str(tmp_path)}
    runs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True) for _ in range(3)
    ]
    assert all(run.communicate(timeout=300)[0].startswith("compiled") for run in runs)
    # three compiled at once: one library and its record, nothing left over
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".so"]
    library = next(tmp_path.glob("*.so"))
    first = library.stat().st_mtime_ns
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120, capture_output=True)
    assert library.stat().st_mtime_ns == first  # reused, not compiled again


def test_the_maximum_comes_back_as_a_magnitude():
    x = np.array([1.0, -7.5, 2.0], dtype=np.float32)
    top, _ = kernels.encode(np.zeros(3, np.int64), x, 0, 0, exact.INF_BITS, True)
    assert exact.magnitude_of_bits(top) == 7.5 and exact.magnitude_of_bits(exact.INF_BITS) == math.inf


def at_the_wires_edges(k: int) -> np.ndarray:
    """Float32 values whose scaled magnitudes ``|x * 2**k|`` lie at the float32 wire's edges: around 2**23 (from
    there a float32 is an integer) and 2**24 (from there only even integers are), at halves (ties to even), far
    beyond, and subnormals and zeros of both signs; each with both signs."""
    scaled = [2.0**23 + d for d in (-1.5, -1, -0.5, -0.25, 0, 0.5, 1, 1.5, 2)]
    scaled += [2.0**24 + d for d in (-2, -1, -0.5, 0, 2, 4, 6)] + [0.5, 1.5, 2.5, 0.49999997, 2.0**40 + 2**17]
    x = np.array([math.ldexp(v, -k) for v in scaled], np.float32)
    return np.concatenate([x, -x, np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39], np.float32)])


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(-140, 140), cap=st.integers(0, exact.INF_BITS))
def test_the_float32_wire_widened_gives_the_int64_encodes_bytes(seed, k, cap):
    """A round's contribution travels as float32 (``rint(x * 2**k)`` is one) and is widened at its owner: the
    same int64 bytes as encoding it into int64, and the same maxima and counts, compiled or by NumPy."""
    x = np.concatenate([at_the_wires_edges(k), gradients(seed, 500)])
    total, wire, by_numpy = np.empty(x.size, np.int64), np.empty(x.size, np.float32), np.empty(x.size, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = kernels.encode(total, x, k, 0, cap, True)
        assert kernels.encode(wire, x, k, 0, cap, True) == expected
        assert kernels.numpy_encode(by_numpy, x, k, 0, cap, True) == expected
        reach = np.abs(np.ldexp(x.astype(np.float64), k)) < 2.0**62  # beyond it: a pass to be redone
    assert wire.tobytes() == by_numpy.tobytes()
    widened = np.zeros(x.size, np.int64)
    kernels.widen(wire, widened)
    assert widened[reach].tobytes() == total[reach].tobytes()
    with pytest.raises(ValueError, match="a float32 wire buffer holds one contribution"):
        kernels.encode(wire, x, k, 0, cap, False)


@needs_compiler
@pytest.mark.parametrize("count", [1, 2, 3, 7, 8, 1000])
def test_the_compiled_decode_gives_numpys_bytes(count):
    """int64 totals across the whole range (and 0, the extremes, odd values beyond float64's 53 bits) over
    ``count * 2**k`` for scales from -140 to 140: the compiled pass and NumPy's chunks give the same float32
    bytes, subnormals and infinities included."""
    rng = np.random.default_rng(count)
    total = (rng.integers(-(2**62), 2**62, 10_000) >> rng.integers(0, 62, 10_000)).astype(np.int64)
    total[:5] = [0, 2**63 - 1, -(2**63), 2**53 + 1, -(2**60) - 3]
    for k in (-140, -40, 0, 17, 62, 100, 140):
        divisor = math.ldexp(float(count), k)
        compiled_out, numpy_out = np.empty(total.size, np.float32), np.empty(total.size, np.float32)
        assert kernels.decode(total, divisor, compiled_out)
        exact.numpy_decode(total, divisor, numpy_out)
        assert compiled_out.tobytes() == numpy_out.tobytes(), (count, k)
