"""The exact reduction's scale for each tensor and step, fixed before any gradient is encoded.

Folding each micro-batch's gradients into the int64 sum as soon as they exist
needs the power of two ``2**k`` before the step's largest gradient is known.
So ``k`` is predicted from the previous step: its ``k`` (from its agreed
maximum and count) minus ``HEADROOM`` bits. When the step's own agreed maximum
shows the prediction was wrong, the step is redone with the true ``k``:

- too fine (``k_pred > k_true``): the sum could overflow int64;
- too coarse (``k_pred < k_true - 2 * HEADROOM``): more than ``2 * HEADROOM``
  bits of precision would be lost.

So a step uses ``k_pred`` when the largest gradient's exponent moved by at most
``HEADROOM`` bits since the previous step (for an equal count), and the true
``k`` otherwise; the first step has no prediction and always uses the true
``k``. Every rank, and the single-rank reference, applies this rule to the same
agreed numbers, so the result is the same bits at any world size. Each value is
exact down to ``2**(2 * HEADROOM)`` times the finest quantum of the per-step
rule, ``2**-(62 - ceil(log2 count))`` of the maximum: 12 bits of the 38-ish
that float32 gradients never use. No MPI here.
"""

from __future__ import annotations

from mpizero.core import exact

HEADROOM = 6  # bits; measured: no step of 300 needed a redo on either model (shared/reference/accumulation-scale.md)


def predicted(previous_k: int | None, headroom: int = HEADROOM) -> int | None:
    """This step's predicted ``k`` from the previous step's (None: no prediction, the step will be measured)."""
    return None if previous_k is None else previous_k - headroom


def choose(predicted_k: int | None, true_max: float, count: int, headroom: int = HEADROOM) -> int:
    """The ``k`` this step's result is defined with, given the agreed maximum and count."""
    if true_max == 0.0:  # every contribution is zero: any scale encodes it exactly
        return 0 if predicted_k is None else predicted_k
    true_k = exact.exponent_for(true_max, count)
    if predicted_k is not None and true_k - 2 * headroom <= predicted_k <= true_k:
        return predicted_k
    return true_k


def following(previous_k: int | None, true_max: float, count: int) -> int | None:
    """The ``k`` the next step predicts from: this step's true ``k``, or the last one if all gradients were zero."""
    return previous_k if true_max == 0.0 else exact.exponent_for(true_max, count)


class StepScales:
    """The scales of one engine's steps: what each pass encodes with, what the step is defined with, and history.

    ``tensors``: each group's tensor names. ``reduction``: the engine's reduction (``predict`` and ``choose``).
    """

    def __init__(self, tensors: list[list[str]], reduction, headroom: int = HEADROOM) -> None:
        self.tensors, self.reduction, self.headroom = tensors, reduction, headroom
        self.previous_k: dict[str, int | None] = {}  # each tensor's last true k
        self.forced: list | None = None  # the chosen scales a pass being redone must use
        self.redone_steps = 0
        self.begin()

    def begin(self) -> None:
        """A pass starts: predict from the history, and encode with the prediction or the forced scales."""
        predict = self.reduction.predict
        self.predicted = [
            [predict(self.previous_k.get(name), self.headroom) for name in names] for names in self.tensors
        ]
        self.used = self.forced if self.forced is not None else self.predicted
        self.chosen: list = [None] * len(self.tensors)  # per group: (scales, count, maxima) once agreed
        self.redo, self.forced = False, None

    def measuring(self, index: int) -> bool:
        """Whether this pass encodes nothing for group ``index``: no scale predicted yet."""
        return all(k is None for k in self.used[index])

    def choose(self, index: int, maxima, count: int, any_early: bool) -> list:
        """Fix group ``index``'s scales from the agreed numbers; note a redo if some rank encoded at other scales.

        Raises OverflowError where no scale fits (every rank alike).
        """
        maxima = [float(m) for m in maxima]
        chosen = [self.reduction.choose(k, m, count, self.headroom) for k, m in zip(self.predicted[index], maxima)]
        self.chosen[index] = (chosen, count, maxima)
        used = self.used[index]
        wrong = any(u != k and not (u is None and m == 0) for u, k, m in zip(used, chosen, maxima))
        self.redo |= any_early and wrong
        return chosen

    def end_for_redo(self) -> None:
        """The pass must be redone: the next one encodes at the scales this one chose."""
        self.forced = [chosen for chosen, _, _ in self.chosen]
        self.redone_steps += 1

    def learn(self) -> None:
        """The step is taken: each tensor's true k of this step is what the next one predicts from."""
        for names, (_, count, maxima) in zip(self.tensors, self.chosen):
            for name, m in zip(names, maxima):
                self.previous_k[name] = following(self.previous_k.get(name), m, count)
