"""The one-pass exact encode and decode (core/reduce/arithmetic.py), checked on the CPU through their one formula.

The CUDA kernels cannot compile here; what they compute is ``arithmetic.encode``/``arithmetic.decode`` spelled in C,
so the NumPy evaluation of the same functions must give the host kernel's bytes, and the C spelling is pinned.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpizero import standin
from mpizero.core.reduce import arithmetic, exact, kernels


def gradients(seed: int, n: int = 1000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 8, n)).astype(np.float32)
    x[:8] = [0.0, -0.0, 0.5, -0.5, 1.5, -2.5, 1e-45, -3e38]  # ties to even, signed zeros, a subnormal, a giant
    return x


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(-140, 200), assign=st.booleans())
def test_the_encode_formula_gives_the_host_paths_bytes(seed, k, assign):
    x = gradients(seed)
    total = np.random.default_rng(seed).integers(-(2**40), 2**40, x.size)
    host = total.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        kernels.encode(host, x, k, 0, exact.INF_BITS + 1, assign=assign)
        formula = arithmetic.encode(arithmetic.NUMPY_OPS, 0 if assign else total, x, k)
        finite = np.isfinite(np.ldexp(x, k)) & (np.abs(np.ldexp(x.astype(np.float64), k)) < 2.0**62)
    assert formula[finite].tobytes() == host[finite].tobytes()  # beyond the scale's range: never decoded


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(0, 100), count=st.sampled_from([1, 2, 3, 4, 7, 8, 12, 1000]))
def test_the_decode_formula_gives_the_host_paths_bytes(seed, k, count):
    total = np.random.default_rng(seed).integers(-(2**62), 2**62, 999)
    host = np.empty(total.size, np.float32)
    exact.decode(total, k, count, host)
    formula = arithmetic.decode(arithmetic.NUMPY_OPS, total, np.ldexp(float(count), k))
    assert formula.dtype == np.float32 and formula.tobytes() == host.tobytes()


def test_the_kernels_c_expressions():
    assert arithmetic.encode(arithmetic.C_OPS, "total", "x", "k") == "total + (long long)rintf(ldexpf(x, k))"
    assert arithmetic.decode(arithmetic.C_OPS, "total", "divisor") == "(float)((double)total / divisor)"
    assert (
        arithmetic.masked("total", arithmetic.C_OPS, True)
        == "total = 0 + (long long)rintf(ldexpf(inside ? x : 0.0f, k))"
    )
    host = arithmetic.encode(arithmetic.HOST_C_OPS, "total[i]", "v", "f")
    assert host == "total[i] + (int64_t)(inside ? nearbyintf(v * f) : 0.0f)" and host in kernels.SOURCE
    assert arithmetic.masked_pair("total", arithmetic.C_OPS, False) == (
        "total = total + (long long)rintf(ldexpf(inside ? x : 0.0f, k)) + (long long)rintf(ldexpf(inside_y ? y : "
        "0.0f, k))"
    )
    paired = f"{host} + (int64_t)(inside_y ? nearbyintf(w * f) : 0.0f)"
    assert f"total[i] = {paired};" in kernels.SOURCE
    assert arithmetic.masked_wire("out", arithmetic.C_OPS) == "out = rintf(ldexpf(inside ? x : 0.0f, k))"
    assert "out[i] = (inside ? nearbyintf(v * f) : 0.0f);" in kernels.SOURCE
    assert arithmetic.widen(arithmetic.C_OPS, "total", "wire") == "total + (long long)wire"


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(-140, 140), cap=st.integers(0, exact.INF_BITS), assign=st.booleans())
def test_the_device_paired_encode_gives_the_hosts_bytes(seed, k, cap, assign):
    """The stand-in evaluates the device's paired kernel (``arithmetic.numpy_kernels``): the host's paired bytes, counts
    and maxima, each contribution's own."""
    x, y = gradients(seed), gradients(seed + 7)[::-1].copy()
    total = np.random.default_rng(seed).integers(-(2**40), 2**40, x.size)
    host = total.copy()
    device = standin.asarray(total)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = kernels.encode_pair(host, x, y, k, 0, cap, assign)
        found = arithmetic.device_encode_pair(
            standin, device, standin.asarray(x), standin.asarray(y), k, 0, cap, assign
        )
    assert [tuple(int(v) for v in standin.asnumpy(standin.stack(list(f)))) for f in found] == [*expected]
    reach = np.abs(np.ldexp(x.astype(np.float64), k)) + np.abs(np.ldexp(y.astype(np.float64), k)) < 2.0**61
    assert standin.asnumpy(device)[reach].tobytes() == host[reach].tobytes()


@pytest.mark.parametrize("arrays", [[], [np.zeros(0, np.float32)], [np.array([1.0, -3.0, np.nan], np.float32)]])
def test_top_bits_is_the_largest_magnitude(arrays):
    for a in arrays:
        assert exact.magnitude_of_bits(kernels.top_bits(a)) == exact.largest_magnitude([a])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(-140, 140), cap=st.integers(0, exact.INF_BITS))
def test_the_device_wire_encode_and_widen_give_the_hosts_bytes(seed, k, cap):
    """The stand-in evaluates the device's wire kernel and its widening (``arithmetic.numpy_kernels``): the host's
    float32 values, counts and maxima, and the host's widened int64 sum."""
    x = gradients(seed)
    host, device = np.empty(x.size, np.float32), standin.asarray(np.empty(x.size, np.float32))
    with np.errstate(over="ignore", invalid="ignore"):
        expected = kernels.encode(host, x, k, 0, cap, True)
        found = arithmetic.device_encode(standin, device, standin.asarray(x), k, 0, cap, True)
        assert tuple(int(v) for v in standin.asnumpy(standin.stack(list(found)))) == expected
        assert standin.asnumpy(device).tobytes() == host.tobytes()
        start = np.random.default_rng(seed).integers(-(2**40), 2**40, x.size)
        widened, on_device = start.copy(), standin.asarray(start)
        kernels.widen(host, widened)
        arithmetic.device_widen(standin, device, on_device)
    reach = np.abs(np.ldexp(x.astype(np.float64), k)) < 2.0**61
    assert standin.asnumpy(on_device)[reach].tobytes() == widened[reach].tobytes()
