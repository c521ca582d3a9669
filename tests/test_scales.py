"""The predicted scale of the exact reduction: when it is used, when a step is redone, and its accuracy bound."""

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_exact import contributions

from mpizero.core import exact, scales

H = scales.HEADROOM


@pytest.mark.parametrize(
    "previous_shift, used",
    [(0, "predicted"), (H, "predicted"), (-H, "predicted"), (H + 1, "true"), (-H - 1, "true"), (None, "true")],
)
def test_the_prediction_is_used_while_the_maximum_moved_at_most_headroom_bits(previous_shift, used):
    true_k = exact.exponent_for(0.75, 8)
    previous = None if previous_shift is None else true_k + previous_shift
    predicted = scales.predicted(previous)
    chosen = scales.choose(predicted, 0.75, 8)
    assert chosen == (predicted if used == "predicted" else true_k)


def test_all_zero_gradients_need_no_redo_and_keep_the_history():
    assert scales.choose(None, 0.0, 4) == 0 and scales.choose(17, 0.0, 4) == 17
    assert scales.following(23, 0.0, 4) == 23 and scales.following(None, 0.5, 4) == exact.exponent_for(0.5, 4)


@settings(max_examples=300, deadline=None)
@given(contributions(), st.integers(-2 * H, 2 * H))
def test_error_within_the_bound_at_the_chosen_scale_and_never_an_overflow(arrays, shift):
    count, largest = len(arrays), max(exact.max_abs(a) for a in arrays)
    true_k = exact.exponent_for(largest, count)
    k = scales.choose(scales.predicted(true_k + shift), largest, count)
    assert largest == 0 or true_k - 2 * H <= k <= true_k  # at most 2 * HEADROOM bits coarser than per-step
    assert count * Fraction(largest) * Fraction(2) ** k < 2**62  # the int64 sum cannot overflow
    total = np.empty(arrays[0].size, dtype=np.int64)
    exact.sum_into(total, arrays, k)
    result = np.empty(arrays[0].size, dtype=np.float32)
    exact.decode(total, k, count, result)
    for j in range(arrays[0].size):
        true_mean = sum(Fraction(float(a[j])) for a in arrays) / count
        bound = Fraction(2) ** (-k - 1) + Fraction(abs(float(result[j]))) * Fraction(2) ** -23 + Fraction(2) ** -149
        assert abs(Fraction(float(result[j])) - true_mean) <= bound
