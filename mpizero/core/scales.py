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
