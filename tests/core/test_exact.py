"""The fixed-point reduction: order-free, accurate to its stated bound, never overflowing."""

import math
import random
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpizero import compiled
from mpizero.core.reduce import exact, kernels

float32s = st.floats(width=32, allow_nan=False, allow_infinity=False)
special = st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 3.4028235e38, -3.4028235e38, 1.0, -1.0])
values = st.one_of(float32s, special)


def contributions():
    """Lists of 1-12 float32 arrays of one length (1-6)."""
    return st.tuples(st.integers(1, 12), st.integers(1, 6)).flatmap(
        lambda cl: st.lists(
            st.lists(values, min_size=cl[1], max_size=cl[1]).map(lambda v: np.array(v, dtype=np.float32)),
            min_size=cl[0],
            max_size=cl[0],
        )
    )


def sum_into(total, sources, k: int) -> None:
    """``sum(rint(x * 2**k))`` over ``sources`` into ``total``, through the host encode (every element in range)."""
    total[...] = 0
    for x in sources:
        kernels.encode(total, x, k, 0, exact.INF_BITS, assign=False)


def reduce_in_groups(arrays, groups):
    """Sum fixed-point contributions in the given grouping, then decode the mean."""
    largest = exact.largest_magnitude(arrays)
    k = exact.exponent_for(largest, len(arrays))
    partials = []
    for group in groups:
        total = np.empty(arrays[0].size, dtype=np.int64)
        sum_into(total, [arrays[i] for i in group], k)
        partials.append(total)
    out = np.empty(arrays[0].size, dtype=np.float32)
    exact.decode(sum(partials), k, len(arrays), out)
    return out, k


@settings(max_examples=300, deadline=None)
@given(contributions(), st.randoms(use_true_random=False))
def test_result_does_not_depend_on_order_or_grouping(arrays, rnd):
    order = list(range(len(arrays)))
    rnd.shuffle(order)
    cut = sorted(rnd.sample(range(1, len(arrays)), min(len(arrays) - 1, rnd.randint(0, 3)))) if len(arrays) > 1 else []
    groups = [order[a:b] for a, b in zip([0, *cut], [*cut, len(arrays)])]
    one_by_one, _ = reduce_in_groups(arrays, [[i] for i in range(len(arrays))])
    grouped, _ = reduce_in_groups(arrays, groups)
    assert one_by_one.tobytes() == grouped.tobytes()


@settings(max_examples=300, deadline=None)
@given(contributions())
def test_error_within_the_readme_bound(arrays):
    result, k = reduce_in_groups(arrays, [list(range(len(arrays)))])
    count = len(arrays)
    for j in range(arrays[0].size):
        true_mean = sum(Fraction(float(a[j])) for a in arrays) / count
        # fixed-point error (2**-(k+1) per contribution, averaged) + the float32 rounding of the result
        bound = Fraction(2) ** (-k - 1) + Fraction(abs(float(result[j]))) * Fraction(2) ** -23 + Fraction(2) ** -149
        assert abs(Fraction(float(result[j])) - true_mean) <= bound


def test_chunked_sum_equals_one_pass(monkeypatch):
    rng = np.random.default_rng(5)
    arrays = [(rng.standard_normal(1000) * 10.0 ** rng.integers(-30, 30, 1000)).astype(np.float32) for _ in range(3)]
    k = exact.exponent_for(exact.largest_magnitude(arrays), 3)
    whole, chunked = np.empty(1000, np.int64), np.empty(1000, np.int64)
    sum_into(whole, arrays, k)
    monkeypatch.setattr(kernels, "CHUNK", 7)
    monkeypatch.setenv(compiled.ENV_VAR, "numpy")
    kernels._library.cache_clear()
    sum_into(chunked, arrays, k)
    kernels._library.cache_clear()
    assert whole.tolist() == chunked.tolist()
    monkeypatch.undo()
    out_whole, out_chunked = np.empty(1000, np.float32), np.empty(1000, np.float32)
    monkeypatch.setattr(exact, "CHUNK", 7)
    exact.decode(whole, k, 3, out_chunked)
    monkeypatch.undo()
    exact.decode(whole, k, 3, out_whole)
    assert out_whole.tobytes() == out_chunked.tobytes()


@settings(max_examples=300, deadline=None)
@given(contributions())
def test_int64_sum_never_overflows(arrays):
    largest = exact.largest_magnitude(arrays)
    k = exact.exponent_for(largest, len(arrays))
    exact_total = [sum(round(Fraction(float(a[j])) * Fraction(2) ** k) for a in arrays) for j in range(arrays[0].size)]
    assert all(abs(t) < 2**62 for t in exact_total)
    total = np.empty(arrays[0].size, dtype=np.int64)
    sum_into(total, arrays, k)
    assert total.tolist() == exact_total


def test_values_near_the_largest_are_converted_exactly():
    x = np.array([3.0, 1.0 + 2.0**-23, 2.0**-20], dtype=np.float32)
    k = exact.exponent_for(3.0, 2)
    total = np.empty(3, dtype=np.int64)
    sum_into(total, [x], k)
    assert [Fraction(int(t)) / 2**k for t in total] == [Fraction(float(v)) for v in x]


def test_non_finite_and_too_many_contributions_are_refused():
    assert exact.largest_magnitude([np.array([1.0, np.nan], dtype=np.float32)]) == math.inf
    with pytest.raises(ValueError, match="inf"):
        exact.exponent_for(math.inf, 2)
    with pytest.raises(OverflowError, match="contributions"):
        exact.exponent_for(1.0, 2**40)
    with pytest.raises(ValueError, match="count"):
        exact.exponent_for(1.0, 0)


def test_rank_order_float_sum_is_not_associative_but_exact_is():
    rng = random.Random(0)
    arrays = [
        np.array([rng.uniform(-1, 1) * 10 ** rng.randint(-8, 8) for _ in range(1000)], dtype=np.float32)
        for _ in range(4)
    ]
    left = ((arrays[0] + arrays[1]) + arrays[2]) + arrays[3]
    paired = (arrays[0] + arrays[1]) + (arrays[2] + arrays[3])
    assert left.tobytes() != paired.tobytes()
    a, _ = reduce_in_groups(arrays, [[0, 1, 2, 3]])
    b, _ = reduce_in_groups(arrays, [[0, 1], [2, 3]])
    assert a.tobytes() == b.tobytes()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-(2**62), 2**62), min_size=1, max_size=8), st.integers(0, 70))
def test_rescale_rounds_half_to_even(values, shift):
    total = np.array(values, dtype=np.int64)
    exact.rescale(total, shift)
    expected = [round(Fraction(v, 2**shift)) for v in values]  # Python's round: half to even
    assert total.tolist() == expected


@pytest.mark.parametrize("exponent", [-160, -149, -140, -126, -1, 0, 1, 23, 127, 128, 300])
def test_the_cap_bits_order_magnitudes_as_floats(exponent):
    cap = exact.float32_bits_of_power(exponent)
    below = np.array([math.ldexp(1.0, exponent - 1), math.ldexp(0.75, exponent)], dtype=np.float32)
    at = np.array([math.ldexp(1.0, exponent)], dtype=np.float32)
    bits = lambda a: (a.view(np.uint32) & 0x7FFFFFFF).astype(np.int64)  # noqa: E731
    if -126 <= exponent <= 127:
        assert (bits(below) < cap).all() and (bits(at) >= cap).all()
    expected = {-160: 0, -149: 1, 128: exact.INF_BITS, 300: exact.INF_BITS}  # nothing, the least subnormal, inf
    assert cap == expected.get(exponent, cap)
    assert exact.magnitude_of_bits(exact.INF_BITS + 5) == math.inf
