"""Hand-written backward of every unit against central finite differences (float64)."""

import numpy as np
import pytest

from mpizero.training.mlp import MLP, regression_batch
from mpizero.training.model import forward_backward, param_shapes
from mpizero.training.transformer import Transformer


def finite_difference_check(model, params, x, y, samples_per_tensor=6, h=1e-6):
    params = {k: v.astype(np.float64) for k, v in params.items()}
    _, grads = forward_backward(model, params, x, y)
    rng = np.random.default_rng(0)
    for name, p in params.items():
        assert grads[name].shape == p.shape, name
        for i in rng.choice(p.size, size=min(samples_per_tensor, p.size), replace=False):
            saved = p.flat[i]
            p.flat[i] = saved + h
            up, _ = forward_backward(model, params, x, y)
            p.flat[i] = saved - h
            down, _ = forward_backward(model, params, x, y)
            p.flat[i] = saved
            numeric = (up - down) / (2 * h)
            assert abs(numeric - grads[name].flat[i]) <= 1e-5 * max(1.0, abs(numeric)), (name, i)


def test_mlp_regression_backward():
    model = MLP((5, 7, 6, 3))
    params = {k: v + 0.01 for k, v in model.init(3).items()}  # nonzero biases, away from ReLU kinks
    x, y = (a.astype(np.float64) for a in regression_batch(model.widths, 0, 1, 0, 4))
    finite_difference_check(model, params, x, y, samples_per_tensor=50)


def test_mlp_classification_backward():
    model = MLP((8, 9, 4), objective="xent")
    x = np.random.default_rng(1).standard_normal((5, 8))
    finite_difference_check(model, model.init(2), x, np.array([0, 3, 1, 2, 3]), samples_per_tensor=50)


def test_transformer_backward():
    model = Transformer(vocab=11, block_size=6, width=8, heads=2, n_layer=2)
    rng = np.random.default_rng(4)
    params = {k: v + rng.standard_normal(v.shape).astype(np.float32) * 0.1 for k, v in model.init(5).items()}
    tokens = rng.integers(0, 11, size=(3, 6))
    targets = rng.integers(0, 11, size=(3, 6))
    finite_difference_check(model, params, tokens, targets)


def test_gradients_are_float32_and_shaped_like_params():
    for model, x, y in [
        (MLP((13, 31, 5)), *regression_batch((13, 31, 5), 0, 1, 0, 8)),
        (Transformer(vocab=7, block_size=5), np.zeros((2, 5), int), np.ones((2, 5), int)),
    ]:
        params = model.init(0)
        assert set(params) == set(param_shapes(model))
        loss, grads = forward_backward(model, params, x, y)
        assert loss > 0
        assert {k: (g.shape, g.dtype) for k, g in grads.items()} == {
            k: (p.shape, np.float32) for k, p in params.items()
        }


def test_batches_are_keyed_by_step_and_micro_batch_not_rank():
    a = regression_batch((4, 2), 7, 3, 5, 6)
    b = regression_batch((4, 2), 7, 3, 5, 6)
    c = regression_batch((4, 2), 7, 3, 6, 6)
    assert a[0].tobytes() == b[0].tobytes() and a[0].tobytes() != c[0].tobytes()


def test_transformer_rejects_uneven_heads():
    with pytest.raises(ValueError, match="width 10 is not divisible by heads 4"):
        Transformer(vocab=5, width=10, heads=4)
