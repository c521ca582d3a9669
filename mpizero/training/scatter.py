"""Row sums by index whose bits do not depend on the order of the rows: the embedding backward's scatter-add.

``add.at`` (NumPy) adds rows in the order they come; on CuPy it is an atomic
scatter, so rows with the same index land in a different order on each run
and the float32 sums differ in the last bits. Here the result is a function
of the multiset of (index, row) pairs alone, on NumPy and CuPy alike:

1. every column's values are sorted by (index, value), with the value's bits
   mapped to an unsigned key of the same order, so rows of one index come
   together, in an order set by their values and not by where they were
   (float64 rows, used by the finite-difference checks, are keyed by their
   float32 rounding: values equal in float32 keep the sort's order);
2. each run of one index is summed pairwise, neighbours first, in a tree
   fixed by the run's length (``run_sums``).

No atomics and no order-dependent reduction, so the same bits on every run,
on every device, and whatever order the batch's rows are in.
"""

from __future__ import annotations

import numpy as np

from mpizero.arrays import array_module

SIGN = np.uint64(0x80000000)
LOW_BITS = np.uint64(0xFFFFFFFF)  # a negative value's key: every bit flipped


def float_key(x):
    """Map float32 bits to uint64 keys in the same order as the values (-0.0 just before +0.0)."""
    xp = array_module(x)
    bits = x.view(np.uint32).astype(np.uint64)
    return bits ^ xp.where((bits & SIGN) != 0, LOW_BITS, SIGN)


def sum_rows_by_index(rows, index, count: int):
    """Return ``out`` (count, D) with ``out[i]`` the sum of ``rows[j]`` over ``index[j] == i``, in no row's order.

    ``rows``: float32 (N, D); ``index``: integers in [0, count), N of them.
    """
    xp = array_module(rows)
    index = xp.asarray(index).reshape(-1).astype(np.int64)
    keys = (index.astype(np.uint64)[:, None] << np.uint64(32)) | float_key(rows.astype(np.float32, copy=False))
    ordered = xp.take_along_axis(rows, xp.argsort(keys, axis=0), axis=0)  # (N, D): each column by (index, value)
    lengths = xp.bincount(index, minlength=count)  # integer counts: exact in any order
    present = xp.nonzero(lengths)[0]
    out = xp.zeros((count, rows.shape[1]), dtype=rows.dtype)
    out[present] = run_sums(ordered, lengths[present])
    return out


def run_sums(values, lengths):
    """Sum each run of consecutive rows of ``values`` (run j: ``lengths[j]`` rows, in order) into one row.

    Pairwise: at each level row 2p of a run becomes row 2p + row 2p+1 (a last odd row stays as it is), until
    every run is one row. The tree depends only on the run's length, so the sum is fixed by the rows' order.
    """
    xp = array_module(values)
    starts = xp.zeros(values.shape[0], np.int64)
    starts[(xp.cumsum(lengths) - lengths)[1:]] = 1
    run = xp.cumsum(starts)  # each row's run
    while values.shape[0] > lengths.size:
        first = xp.cumsum(lengths) - lengths
        position = xp.arange(values.shape[0]) - first[run]
        left = xp.nonzero(position % 2 == 0)[0]
        paired = xp.nonzero(position[left] + 1 < lengths[run[left]])[0]
        summed = values[left]
        summed[paired] += values[left[paired] + 1]
        values, run, lengths = summed, run[left], (lengths + 1) // 2
    return values
