"""The exact reduction's scale for each tensor and step, predicted before any gradient is encoded.

Glossary:

- history: the previous step's agreed largest magnitude ``M`` and count ``n`` of
  contributions of a tensor.
- prediction: from the history, the cap ``2**e_cap`` with ``e_cap = e + H``
  (``M < 2**e``; ``H`` bits of headroom for growth, ``scale_headroom``) and the
  scale ``k = 62 - c - e_cap`` with ``c = bitlength(2n - 1)`` (room for twice
  as many contributions): every element below the cap scaled by ``2**k`` is
  below ``2**(62 - c)``.
- in range: an element whose magnitude is below the cap. It is encoded at ``k``
  into the int64 sum as soon as it exists (streamed), and dropped.
- kept: an element at or above the cap (it grew by more than ``H`` bits since the
  last step), held in float32 until the step's numbers are agreed. A step with no
  history keeps every element.
- chosen scale ``k_c``: ``k`` when no rank kept anything; else the smaller of ``k``
  and the per-step scale ``exact.exponent_for(M, n)``.

The step's sum is ``rescale(S, k - k_c)`` plus every kept element encoded at
``k_c`` (``S``: the streamed sum at ``k``), divided once by ``n * 2**k_c``.
``S`` cannot overflow while ``n < 2**(c + 1)``, four times the last step's
count; a step with more, or with no history, is predicted from its own agreed
``M`` and ``n`` (nothing is then out of range). Every rank and the single-rank
reference apply this rule to the same agreed numbers, so the result is the same
bits at any world size. A value is never off by more than half a quantum,
``2**-(k_c + 1)``: relative to the last step's maximum ``M``, the quantum of an
in-range element is ``2**(e + H + c - 62)``. No MPI here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpizero.core.reduce import exact

HEADROOM = 6  # bits of growth above the last step's maximum before an element is kept (docs/bitwise.md)


@dataclass(frozen=True)
class Prediction:
    """A tensor's scale ``k`` for this step, and the cap exponent below which elements are in range."""

    k: int
    cap_exponent: int
    count_bits: int

    def holds(self, count: int) -> bool:
        """Whether ``count`` contributions of in-range elements at ``k`` cannot overflow the int64 sum."""
        return count < 1 << (self.count_bits + 1)

    @property
    def cap_bits(self) -> int:
        """The cap as the bit pattern of a float32 magnitude: an element is in range iff its bits are below it."""
        return exact.float32_bits_of_power(self.cap_exponent)


def predict(largest: float, count: int, headroom: int = HEADROOM) -> Prediction | None:
    """The prediction from a step whose agreed maximum was ``largest`` over ``count`` contributions (None: no
    history, all zero)."""
    if largest == 0.0 or count < 1:
        return None
    cap_exponent = math.frexp(largest)[1] + headroom
    count_bits = (2 * count - 1).bit_length()
    return Prediction(exact.SUM_BITS - count_bits - cap_exponent, cap_exponent, count_bits)


def settle(prediction: Prediction | None, largest: float, count: int, headroom: int = HEADROOM):
    """The prediction the step's sum is defined with: the one used, unless there was none or ``count`` outgrew
    it; then the step's own (``largest``, ``count``). Return it and whether the used one failed."""
    if prediction is not None and prediction.holds(count):
        return prediction, False
    return predict(largest, count, headroom), prediction is not None


def chosen_scale(prediction: Prediction | None, largest: float, count: int, any_kept: bool) -> int:
    """``k_c``: the settled prediction's ``k``, or coarser where kept elements need it."""
    if prediction is None:  # every contribution was zero: any scale encodes it exactly
        return 0
    if not any_kept:
        return prediction.k
    return min(prediction.k, exact.exponent_for(largest, count))


class StepScales:
    """The scales of one engine's steps: what each pass encodes with, what each group's sum is defined with, and
    the history they are predicted from. ``tensors``: each group's tensor names; ``reduction``: the engine's."""

    def __init__(self, tensors: list[list[str]], reduction, headroom: int = HEADROOM) -> None:
        self.tensors, self.reduction, self.headroom = tensors, reduction, headroom
        self.history: dict[str, tuple[float, int]] = {}  # each tensor's last agreed (maximum, count)
        self.forced: dict[str, tuple[float, int]] = {}  # history a pass being redone predicts from instead
        self.redone_steps = 0
        self.kept_steps = 0  # steps taken in which some rank kept elements beyond a prediction's cap
        self.begin()

    def begin(self) -> None:
        """A pass starts: each tensor's prediction, from the history (or what a redone pass measured)."""
        history = {**self.history, **self.forced}
        predict = self.reduction.predict
        self.used = [[predict(history.get(name), self.headroom) for name in names] for names in self.tensors]
        self.chosen: list = [None] * len(self.tensors)  # per group: (chosen scales, count, kept flags) once agreed
        self.agreed: list = [None] * len(self.tensors)  # per group: (maxima, count, tensors to predict anew)
        self.redo, self.forced = False, {}

    def streams(self, index: int) -> bool:
        """Whether this pass encodes anything of group ``index`` before the scales are agreed."""
        return any(p is not None for p in self.used[index])

    def choose(self, index: int, maxima, count: int, kept, measured: bool) -> list[int]:
        """Fix group ``index``'s chosen scales from the agreed numbers; note a redo where the pass only measured,
        or where its streamed sum could have overflowed. Raises OverflowError where no scale fits."""
        maxima, kept = [float(m) for m in maxima], [bool(k) for k in kept]
        settled = [self.reduction.settle(p, m, count, self.headroom) for p, m in zip(self.used[index], maxima)]
        chosen = [self.reduction.chosen_scale(p, m, count, k) for (p, _), m, k in zip(settled, maxima, kept)]
        self.chosen[index] = (chosen, count, kept)
        anew = [failed or used is None for (_, failed), used in zip(settled, self.used[index])]
        self.agreed[index] = (maxima, count, anew)
        self.redo |= measured or any(failed for _, failed in settled)
        return chosen

    def end_for_redo(self) -> None:
        """The pass must be redone: tensors whose prediction failed (or that had none) predict from what it
        measured, as the single-rank reference does for such a step."""
        for names, (maxima, count, anew) in zip(self.tensors, self.agreed):
            self.forced.update({n: (m, count) for n, m, again in zip(names, maxima, anew) if again and m > 0})
        self.redone_steps += 1

    def learn(self) -> None:
        """The step is taken: each tensor's agreed maximum and count are what the next step predicts from."""
        beyond_cap = [
            k and p is not None for (_, _, kept), used in zip(self.chosen, self.used) for k, p in zip(kept, used)
        ]
        self.kept_steps += any(beyond_cap)
        for names, (maxima, count, _) in zip(self.tensors, self.agreed):
            self.history.update({name: (m, count) for name, m in zip(names, maxima) if m > 0})

    def saved(self, name: str) -> list | None:
        """``name``'s history as a checkpoint stores it: ``[maximum, count]``, or None."""
        found = self.history.get(name)
        return None if found is None else [found[0], found[1]]

    def restore(self, saved: dict) -> None:
        """Continue from a checkpoint's ``saved`` histories."""
        self.history = {name: (float(v[0]), int(v[1])) for name, v in saved.items() if v is not None}
