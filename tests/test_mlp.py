"""Hand-written MLP backward against central finite differences (float64)."""

import numpy as np

from mpizero.mlp import MLP, regression_batch


def test_backward_matches_finite_differences():
    model = MLP((5, 7, 6, 3))
    params = {k: v.astype(np.float64) for k, v in model.init(3).items()}
    params = {k: v + 0.01 for k, v in params.items()}  # nonzero biases, away from ReLU kinks
    x, y = (a.astype(np.float64) for a in regression_batch(model.widths, 0, 1, 0, 4))
    _, grads = model.loss_and_grads(params, x, y)
    h = 1e-6
    for name, p in params.items():
        for i in range(p.size):
            saved = p.flat[i]
            p.flat[i] = saved + h
            up, _ = model.loss_and_grads(params, x, y)
            p.flat[i] = saved - h
            down, _ = model.loss_and_grads(params, x, y)
            p.flat[i] = saved
            numeric = (up - down) / (2 * h)
            assert abs(numeric - grads[name].flat[i]) <= 1e-6 * max(1.0, abs(numeric)), (name, i)


def test_gradients_are_float32_and_shaped_like_params():
    model = MLP((13, 31, 5))
    params = model.init(0)
    loss, grads = model.loss_and_grads(params, *regression_batch(model.widths, 0, 1, 0, 8))
    assert loss > 0
    assert {k: (g.shape, g.dtype) for k, g in grads.items()} == {k: (p.shape, np.float32) for k, p in params.items()}


def test_batches_are_keyed_by_step_and_micro_batch_not_rank():
    a = regression_batch((4, 2), 7, 3, 5, 6)
    b = regression_batch((4, 2), 7, 3, 5, 6)
    c = regression_batch((4, 2), 7, 3, 6, 6)
    assert a[0].tobytes() == b[0].tobytes() and a[0].tobytes() != c[0].tobytes()
