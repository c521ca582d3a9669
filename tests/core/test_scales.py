"""The exact reduction's predicted scale: when elements are kept beyond the cap, when a step is redone, and that
the defined result never overflows and stays within its error bound (checked against exact fractions)."""

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_exact import contributions

from mpizero import SGD, Reference
from mpizero.core.reduce import exact, scales

H = scales.HEADROOM


def test_the_cap_lies_headroom_bits_above_the_last_maximum_and_the_count_doubles():
    p = scales.predict(0.75, 8)  # 0.75 < 2**0
    assert (p.cap_exponent, p.count_bits, p.k) == (H, 4, 62 - 4 - H)
    assert p.holds(31) and not p.holds(32)  # 8 contributions: sums of up to 31 cannot overflow
    assert scales.predict(0.0, 8) is None


def test_the_prediction_holds_unless_there_was_none_or_the_count_outgrew_it():
    used = scales.predict(0.75, 8)
    assert scales.settle(used, 100.0, 16) == (used, False)  # grown 2**7: elements beyond the cap are kept, no redo
    assert scales.settle(used, 0.75, 32) == (scales.predict(0.75, 32), True)  # 4x the count: predicted anew, redo
    assert scales.settle(None, 0.75, 8) == (scales.predict(0.75, 8), False)  # first step: from itself


def test_the_chosen_scale_is_coarser_only_where_elements_were_kept():
    used = scales.predict(0.75, 8)
    assert scales.chosen_scale(used, 0.5, 8, any_kept=False) == used.k
    assert scales.chosen_scale(used, 1000.0, 8, any_kept=True) == exact.exponent_for(1000.0, 8) < used.k
    assert scales.chosen_scale(used, 100.0, 8, any_kept=True) == used.k  # beyond the cap, within the count margin
    assert scales.chosen_scale(used, 0.5, 8, any_kept=True) == used.k  # never finer than what was streamed
    assert scales.chosen_scale(None, 0.0, 8, any_kept=False) == 0


def fixed(x: float, k: int) -> int:
    """``rint(x * 2**k)`` exactly: Python's round is half to even."""
    return round(Fraction(x) * Fraction(2) ** k)


def defined_total(arrays, history, headroom):
    """The rule of ``scales`` in exact integers: the total, the chosen scale and the streamed sum's largest term."""
    count, largest = len(arrays), exact.largest_magnitude(arrays)
    used = None if history is None else scales.predict(*history, headroom)
    settled, _ = scales.settle(used, largest, count, headroom)
    cap = Fraction(2) ** settled.cap_exponent
    beyond = [[abs(Fraction(float(v))) >= cap for v in a] for a in arrays]
    chosen = scales.chosen_scale(settled, largest, count, any(any(b) for b in beyond))
    totals, streamed_peak = [], 0
    for j in range(arrays[0].size):
        streamed = sum(fixed(float(a[j]), settled.k) for a, b in zip(arrays, beyond) if not b[j])
        kept = sum(fixed(float(a[j]), chosen) for a, b in zip(arrays, beyond) if b[j])
        totals.append(round(Fraction(streamed, 2 ** (settled.k - chosen))) + kept)
        streamed_peak = max(streamed_peak, abs(streamed))
    return totals, chosen, streamed_peak, settled.k != chosen


histories = st.one_of(st.none(), st.tuples(st.floats(1e-30, 1e30), st.integers(1, 40)))


@settings(max_examples=300, deadline=None)
@given(contributions(), histories, st.integers(0, 12))
def test_the_defined_sum_never_overflows_and_stays_within_its_bound(arrays, history, headroom):
    largest = exact.largest_magnitude(arrays)
    if largest == 0.0:
        return
    totals, chosen, streamed_peak, rescaled = defined_total(arrays, history, headroom)
    assert streamed_peak < 2**63 and all(abs(t) < 2**62 for t in totals)
    result = np.empty(arrays[0].size, np.float32)
    exact.decode(np.array(totals, np.int64), chosen, len(arrays), result)
    count = len(arrays)
    for j, value in enumerate(result.tolist()):
        true_mean = sum(Fraction(float(a[j])) for a in arrays) / count
        quantum = Fraction(2) ** (-chosen - 1)  # half a quantum per contribution, and once more where rescaled
        bound = quantum * (1 + Fraction(int(rescaled), count)) + abs(Fraction(value)) * Fraction(2) ** -23
        assert abs(Fraction(value) - true_mean) <= bound + Fraction(2) ** -149


@settings(max_examples=150, deadline=None)
@given(contributions(), histories, st.integers(0, 12))
def test_the_reference_computes_the_defined_sum(arrays, history, headroom):
    names = {"w": arrays[0].shape}
    reference = Reference({"w": np.zeros(names["w"], np.float32)}, SGD(lr=1.0), scale_headroom=headroom)
    if history is not None:
        reference.history["w"] = history
    if exact.largest_magnitude(arrays) == 0.0:
        return
    totals, chosen, _, _ = defined_total(arrays, history, headroom)
    expected = np.empty(arrays[0].size, np.float32)
    exact.decode(np.array(totals, np.int64), chosen, len(arrays), expected)
    assert reference.average([{"w": a} for a in arrays])["w"].tobytes() == expected.tobytes()


@pytest.mark.parametrize("growth_bits, coarser", [(H - 1, False), (H, False), (3 * H, True)])
def test_a_gradient_that_grows_beyond_the_cap_is_kept_not_redone(growth_bits, coarser):
    history = (1.0, 2)  # 1.0 < 2**1: the cap is 2**(1 + H)
    arrays = [np.array([0.5, math.ldexp(1.0, growth_bits)], np.float32), np.array([0.25, -0.125], np.float32)]
    _, chosen, _, rescaled = defined_total(arrays, history, H)
    assert rescaled == coarser and (chosen < scales.predict(*history, H).k) == coarser
    assert scales.settle(scales.predict(*history, H), 2.0**growth_bits, 2, H)[1] is False  # never a redo
