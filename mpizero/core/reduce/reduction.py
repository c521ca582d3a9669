"""How local gradients become the averaged gradient: ``exact`` or ``native``.

``exact`` sums int64 fixed-point values (see ``exact``) with one power-of-two
scale per tensor and step, predicted from the last step (``scales``): the result
is the same bits whatever order MPI adds in, however tensors are grouped into
buckets or units, and whatever the number of ranks. ``native`` sums float32 with
MPI's own SUM: fastest, but MPI's order of additions changes the low bits, so it
is checked with a tolerance.

``encode(total, grads, layout, predictions, assign, start)`` folds one
contribution's elements ``[start, start + total.size)`` of the group's padded
buffer into ``total`` and returns, per tensor, the largest magnitude's float32
bit pattern and how many elements it left out (beyond the prediction's cap, or
every element of a tensor with no prediction): those are the caller's to keep.
Where the reduction ``pairs``, ``encode_pair`` folds two contributions in one
pass over ``total``, with the bytes of two ``encode`` calls.

A round of one contribution per rank may travel narrower than the sum: into a
``round_dtype`` buffer ``encode`` writes that contribution's values alone, every
rank's block goes whole to its owner (an all-to-all), and ``widen`` sums them
there in ``wire_dtype``. For ``exact`` that is float32 on the wire, half of
int64's bytes, with the same sum (``arithmetic.rounded``).
"""

from __future__ import annotations

import math

import numpy as np

from mpizero.arrays import array_module
from mpizero.core.reduce import arithmetic, exact, group_encode, kernels, scales

EVERY_FINITE = (0, exact.INF_BITS)  # the magnitude range of every finite float32


class ExactReduction:
    """Fixed-point sum with one power-of-two scale per tensor and step (see ``scales`` for how it is chosen)."""

    wire_dtype = np.dtype(np.int64)
    round_dtype = np.dtype(np.float32)  # one contribution's rounded values are float32 integers
    bitwise = True
    result_can_overflow = False  # the mean of values below the agreed maximum is below it
    pairs = True  # integer sums are associative: two contributions may be added in one pass
    spills = True  # on a device, what a pass leaves out may wait in a spill (``group_encode``): added exactly later
    fuses_decode = True  # on a device the update decodes the sum as it reads it (``divisors``)

    def predict(self, history: tuple[float, int] | None, headroom: int) -> scales.Prediction | None:
        return None if history is None else scales.predict(*history, headroom)

    def settle(self, prediction, largest: float, count: int, headroom: int):
        return scales.settle(prediction, largest, count, headroom)

    def chosen_scale(self, prediction, largest: float, count: int, any_kept: bool) -> int:
        return scales.chosen_scale(prediction, largest, count, any_kept)

    def encode(self, total, grads, layout, predictions, assign: bool, start: int = 0, spill=None) -> tuple[list, list]:
        """Fold one contribution into ``total`` (elements ``start`` on) at each tensor's predicted scale, below
        its cap; with ``assign``, write the span (zeros beyond the tensors) instead of adding to it. With a device
        ``spill`` (``group_encode``), the whole group in a launch per 32 tensors: its maxima and counts go to the
        device stats, and the contribution's are ``(None, None)``."""
        return self._encode(total, [grads], layout, predictions, assign, start, spill)[0]

    def encode_pair(self, total, grads, second, layout, predictions, assign: bool, start: int = 0, spill=None) -> list:
        """``encode`` of ``grads`` then of ``second`` in one pass over ``total``; each one's (maxima, left out)."""
        return self._encode(total, [grads, second], layout, predictions, assign, start, spill)

    def _encode(self, total, contributions, layout, predictions, assign: bool, start: int, spill) -> list:
        if spill is not None:
            if start:  # what a spill holds is the whole group's: a span from elsewhere would lose elements
                raise ValueError(f"a group encode with a spill covers the group from 0, not from {start}")
            tensors = []
            for index, spec, _, _ in layout.overlaps(0, total.size):
                prediction = predictions[index]  # None: every element left out and held whole, never spilled
                k, cap = (0, 0) if prediction is None else (prediction.k, prediction.cap_bits)
                pieces = [grads[spec.name].reshape(-1) for grads in contributions]
                tensors.append((index, spec.offset, pieces, k, cap, prediction is not None))
            group_encode.encode_group(total, tensors, assign, layout.numel, spill)
            return [(None, None)] * len(contributions)

        def encode_one(view, pieces, index: int, first: bool):
            prediction = predictions[index]  # None: nothing is in range, every element is left out
            k, cap = (0, 0) if prediction is None else (prediction.k, prediction.cap_bits)
            if len(pieces) == 1:
                return [encode_range(view, pieces[0], k, 0, cap, first)]
            return encode_pair_range(view, *pieces, k, 0, cap, first)

        return _spans(total, contributions, layout, start, assign, encode_one)

    def measure(self, grads, specs) -> tuple[list, list]:
        """One contribution's largest magnitudes, every element left out (a pass that encodes nothing)."""
        flats = [grads[spec.name].reshape(-1) for spec in specs]
        return [top_bits(x) for x in flats], [x.size for x in flats]

    def encode_kept(self, local, kept, specs, chosen, highest: int) -> None:
        """Write every kept element into ``local`` at its tensor's chosen scale: ``kept[index]`` lists
        ``(array, lowest)``, whose elements with magnitude bits in ``[lowest, highest)`` were left out."""
        local[...] = 0
        xp = array_module(local)
        for index, arrays in kept.items():
            view = local[specs[index].offset : specs[index].stop]
            for x, lowest in arrays:  # on a device, held in host memory (``GroupGradients._keep``): moved back
                encode_range(view, xp.asarray(x).reshape(-1), chosen[index], lowest, highest, False)

    def rescale(self, reduced, segments, shifts) -> None:
        """Bring each owned segment of the streamed sum from its predicted scale to its chosen one."""
        exact.rescale_segments(reduced, [(lo, hi, shifts[index]) for index, lo, hi in segments])

    def widen(self, blocks, total, assign: bool) -> None:
        """Sum every rank's block of one round's rounded values (float32 rows of ``blocks``) into the int64
        ``total``, which it starts where ``assign``: exact, in any order."""
        if assign:
            total[...] = 0
        xp = array_module(total)
        for block in blocks:
            if xp is np:
                kernels.widen(block, total)
            else:
                arithmetic.device_widen(xp, block, total)

    def decode(self, reduced, scale: int, count: int, out) -> None:
        exact.decode(reduced, scale, count, out)

    def divisors(self, segments, chosen, count: int) -> list[tuple[int, int, float]]:
        """Each segment ``(tensor index, lo, hi)`` as ``(lo, hi, divisor)``: its mean is its sum over the divisor
        (exact: ``(S * 2**-k) / count == S / (count * 2**k)``)."""
        return [(lo, hi, math.ldexp(float(count), chosen[index])) for index, lo, hi in segments]


def _spans(total, contributions, layout, start: int, assign: bool, encode_one) -> list[tuple[list, list]]:
    """Run ``encode_one(view, pieces, tensor index, assign)`` on each tensor's pieces (one per contribution) of
    ``[start, start + size)``, which returns each piece's (largest magnitude's bits, count left out); return per
    contribution and tensor those two (0 for tensors outside the span)."""
    stop = start + total.size
    if assign:
        total[max(layout.numel, start) - start :] = 0  # the padding
    found = [([0] * len(layout.specs), [0] * len(layout.specs)) for _ in contributions]
    for index, spec, lo, hi in layout.overlaps(start, stop):
        pieces = [grads[spec.name].reshape(-1)[lo - spec.offset : hi - spec.offset] for grads in contributions]
        for (tops, outside), (top, left) in zip(
            found, encode_one(total[lo - start : hi - start], pieces, index, assign)
        ):
            tops[index], outside[index] = top, left
    return found


def encode_range(total, x, k: int, lo: int, hi: int, assign: bool):
    """One tensor's masked encode on the host kernel or the GPU: (largest magnitude's bits, elements left out)."""
    xp = array_module(total)
    if xp is np:
        return kernels.encode(total, x, k, lo, hi, assign)
    return arithmetic.device_encode(xp, total, x, k, lo, hi, assign)


def encode_pair_range(total, x, y, k: int, lo: int, hi: int, assign: bool):
    """``encode_range`` of ``x`` then ``y`` in one pass over ``total``: each one's (maxima's bits, left out)."""
    xp = array_module(total)
    if xp is np:
        return kernels.encode_pair(total, x, y, k, lo, hi, assign)
    return arithmetic.device_encode_pair(xp, total, x, y, k, lo, hi, assign)


def top_bits(x):
    """The largest magnitude's float32 bits of a flat array (a device scalar for device arrays)."""
    xp = array_module(x)
    return kernels.top_bits(x) if xp is np else arithmetic.device_top_and_outside(xp, x, *EVERY_FINITE)[0]


class NativeReduction:
    """Float32 sum by MPI's own SUM; divided by the count afterwards. No scales, so nothing is kept or redone."""

    wire_dtype = np.dtype(np.float32)
    round_dtype = wire_dtype  # rounds are summed by MPI, as every other reduction is
    bitwise = False
    result_can_overflow = True  # a float32 sum of finite values can reach inf
    pairs = False  # a float32 sum's bits depend on the order of its additions
    spills = False
    fuses_decode = False
    EVERYTHING = scales.Prediction(0, 1 << 20, 0)

    def predict(self, history, headroom: int) -> scales.Prediction:
        return self.EVERYTHING

    def settle(self, prediction, largest: float, count: int, headroom: int):
        return self.EVERYTHING, False

    def chosen_scale(self, prediction, largest: float, count: int, any_kept: bool) -> int:
        return 0

    def encode(self, total, grads, layout, predictions, assign: bool, start: int = 0, spill=None) -> tuple[list, list]:
        def add_one(view, pieces, index: int, first: bool):
            (x,) = pieces
            with np.errstate(over="ignore"):  # an overflow becomes inf, which the engine agrees on after the sum
                if first:
                    view[...] = x
                else:
                    view += x
            return [(top_bits(x), 0)]

        return _spans(total, [grads], layout, start, assign, add_one)[0]

    def measure(self, grads, specs) -> tuple[list, list]:
        return [top_bits(grads[spec.name].reshape(-1)) for spec in specs], [0] * len(specs)

    def encode_kept(self, local, kept, specs, chosen, highest: int) -> None:
        raise AssertionError("the native reduction keeps nothing")

    def rescale(self, reduced, segments, shifts) -> None:
        return None

    def decode(self, reduced, scale: int, count: int, out) -> None:
        out[...] = reduced / np.float32(count)


REDUCTIONS = {"exact": ExactReduction(), "native": NativeReduction()}
