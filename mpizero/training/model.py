"""What mpizero needs of a model, and one forward/backward over its units.

A model is a sequence of units. Each unit names its parameter tensors
(``param_shapes``) and has ``forward(x, params) -> (out, cache)`` and
``backward(dout, cache, params) -> (dx, grads)``; the model has
``init_rule(name, shape)`` (how ``initial`` makes each tensor's values),
``init(seed)`` and ``loss(out, target) -> (loss, dout)``. Units compute in float32 and touch
only the parameters they own, which is what lets stage 3 gather one unit at a
time (``trainer``).
"""

from __future__ import annotations

import numpy as np

from mpizero.arrays import array_module


def param_shapes(model) -> dict[str, tuple[int, ...]]:
    """All parameter shapes of a model, unit by unit, in order."""
    return {name: shape for unit in model.units for name, shape in unit.param_shapes().items()}


def unit_names(model) -> list[list[str]]:
    """Parameter names per unit: the stage 3 groups."""
    return [list(unit.param_shapes()) for unit in model.units]


def forward_backward(model, params, x, target, loss_scale: float = 1.0):
    """Return ``(loss, grads)`` for one micro-batch; the gradient is of ``loss * loss_scale``."""
    caches, out = [], x
    for unit in model.units:
        out, cache = unit.forward(out, params)
        caches.append(cache)
    loss, dout = model.loss(out, target)
    if loss_scale != 1.0:
        dout = dout * np.float32(loss_scale)
    grads = {}
    for unit, cache in zip(reversed(model.units), reversed(caches)):
        dout, unit_grads = unit.backward(dout, cache, params)
        grads.update(unit_grads)
    return loss, grads


def mean_squared_error(out, target):
    """Return the mean squared error and its gradient with respect to ``out``."""
    diff = out - target
    return float((diff * diff).mean()), diff * np.float32(2.0 / diff.size)


def softmax_cross_entropy(logits, labels):
    """Return the mean cross-entropy of integer ``labels`` and its gradient; logits (..., classes)."""
    xp = array_module(logits)
    flat = logits.reshape(-1, logits.shape[-1])  # (N, C)
    shifted = flat - flat.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    rows = xp.arange(flat.shape[0])
    labels = labels.reshape(-1)
    loss = float((xp.log(total[:, 0]) - shifted[rows, labels]).mean())
    dlogits = exp / total
    dlogits[rows, labels] -= 1
    dlogits *= np.float32(1.0 / flat.shape[0])
    return loss, dlogits.reshape(logits.shape)
