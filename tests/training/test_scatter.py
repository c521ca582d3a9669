"""The embedding backward's row sums: the same bytes whatever order the rows come in (STYLE point 20)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpizero.training.scatter import float_key, sum_rows_by_index
from mpizero.training.transformer import Embedding


def test_float_key_keeps_the_order():
    values = np.array([-np.inf, -2.5, -1e-45, -0.0, 0.0, 1e-45, 3.0, np.inf], np.float32)
    keys = float_key(values)
    assert (np.diff(keys.astype(np.float64)) > 0).all()


@settings(max_examples=40, deadline=None)
@given(
    n=st.sampled_from([1, 2, 3, 17, 257]),
    width=st.sampled_from([1, 5, 17]),
    vocab=st.integers(1, 20),
    seed=st.integers(0, 2**16),
)
def test_a_shuffled_batch_gives_the_same_bytes(n, width, vocab, seed):
    rng = np.random.default_rng(seed)
    index = rng.integers(0, vocab, n)
    rows = (rng.standard_normal((n, width)) * 10.0 ** rng.integers(-6, 6, (n, 1))).astype(np.float32)
    got = sum_rows_by_index(rows, index, vocab)
    order = rng.permutation(n)
    assert sum_rows_by_index(rows[order], index[order], vocab).tobytes() == got.tobytes()
    exact = np.zeros((vocab, width))
    np.add.at(exact, index, rows.astype(np.float64))
    bound = n * np.finfo(np.float32).eps * np.abs(exact).max(initial=0.0) + 1e-45
    assert np.abs(got - exact).max() <= bound
    assert (got[np.bincount(index, minlength=vocab) == 0] == 0).all()


def test_add_at_would_fail_the_same_check():
    """The check bites: rows in another order change add.at's float32 sums."""
    rng = np.random.default_rng(0)
    index, rows = np.zeros(257, np.int64), rng.standard_normal((257, 4)).astype(np.float32)
    summed = []
    for order in (np.arange(257), rng.permutation(257)):
        out = np.zeros((1, 4), np.float32)
        np.add.at(out, index[order], rows[order])
        summed.append(out.tobytes())
    assert summed[0] != summed[1]
    assert sum_rows_by_index(rows, index, 1).tobytes() == sum_rows_by_index(rows[::-1], index, 1).tobytes()


def test_signed_zeros_and_a_lone_row_pass_through():
    rows = np.array([[-0.0, 1.5], [-0.0, -0.0], [2.0, 0.0]], np.float32)
    got = sum_rows_by_index(rows, np.array([0, 0, 2]), 3)
    assert np.signbit(got[0, 0]) and got[0, 1] == 1.5
    assert got[2].tobytes() == rows[2].tobytes() and not np.signbit(got[1]).any()


@pytest.mark.parametrize("batch", [1, 3])
def test_embedding_backward_does_not_depend_on_where_tokens_sit(batch):
    emb = Embedding("emb", vocab=5, block_size=8, width=17)
    rng = np.random.default_rng(batch)
    tokens = rng.integers(0, 5, (batch, 8))
    dout = rng.standard_normal((batch, 8, 17)).astype(np.float32)
    order = rng.permutation(batch * 8)
    shuffled = (dout.reshape(-1, 17)[order].reshape(dout.shape), tokens.reshape(-1)[order].reshape(tokens.shape))
    first = emb.backward(dout, tokens, {})[1]["emb.tok"]
    again = emb.backward(*shuffled, {})[1]["emb.tok"]
    assert first.tobytes() == again.tobytes()
