"""torch.optim's documented algorithms in float64 NumPy: an oracle for what the optimizer means.

``verify`` compares the engine with the single-rank reference bit for bit, but
both call ``mpizero.core.optim.rules``, so a wrong formula there (a bias correction
off by one step, weight decay coupled where it should be decoupled) would pass
that comparison. This module is the independent check: it is written from the
pseudo-code in the ``torch.optim`` documentation (SGD, Adam, AdamW) and from
``torch.nn.utils.clip_grad_norm_``, in float64, and shares no code with
``optim``. Only the hyperparameter values are read from the optimizer under test.

Torch's names: ``lr`` is gamma, ``weight_decay`` lambda, ``momentum`` mu,
``dampening`` tau, ``betas`` (beta1, beta2), ``eps`` epsilon; ``t`` counts the
optimizer steps taken, from 1 (a step skipped for fp16 overflow is not taken).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

NAMES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
CLIP_EPS = 1e-6  # clip_grad_norm_: clip_coef = max_norm / (total_norm + 1e-6)


def sgd(
    theta, g, state: dict, t: int, *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False
):
    """One step of torch.optim.SGD's documented algorithm."""
    g = -g if maximize else g
    if weight_decay:
        g = g + weight_decay * theta
    if momentum:
        b = g.copy() if t == 1 else momentum * state["b"] + (1.0 - dampening) * g
        state["b"] = b
        g = g + momentum * b if nesterov else b
    return theta - lr * g


def adam(
    theta,
    g,
    state: dict,
    t: int,
    *,
    lr,
    betas,
    eps,
    weight_decay=0.0,
    amsgrad=False,
    maximize=False,
    decoupled_weight_decay=False,
):
    """One step of torch.optim.Adam's documented algorithm: L2 weight decay added to the gradient, or decoupled."""
    g = -g if maximize else g
    if decoupled_weight_decay:
        theta = theta - lr * weight_decay * theta
    elif weight_decay:
        g = g + weight_decay * theta
    return theta - lr * _adam_direction(g, state, t, betas, eps, amsgrad)


def adamw(theta, g, state: dict, t: int, *, weight_decay=1e-2, **hyper):
    """One step of torch.optim.AdamW's documented algorithm: decoupled weight decay."""
    return adam(theta, g, state, t, weight_decay=weight_decay, **{**hyper, "decoupled_weight_decay": True})


def _adam_direction(g, state: dict, t: int, betas, eps, amsgrad: bool):
    """Update the moments and return m_hat / (sqrt(v_hat) + eps), v_hat from the largest v so far with amsgrad."""
    beta1, beta2 = betas
    state["m"] = beta1 * state.get("m", 0.0) + (1.0 - beta1) * g
    state["v"] = beta2 * state.get("v", 0.0) + (1.0 - beta2) * g * g
    if amsgrad:
        state["v_max"] = np.maximum(state.get("v_max", 0.0), state["v"])
    m_hat = state["m"] / (1.0 - beta1**t)
    v_hat = state["v_max" if amsgrad else "v"] / (1.0 - beta2**t)
    return m_hat / (np.sqrt(v_hat) + eps)


ALGORITHMS = {"sgd": sgd, "adam": adam, "adamw": adamw}


def clip_coefficient(grads: Mapping, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor over all gradients together (L2 norm), clamped to 1."""
    total_norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
    return min(max_norm / (total_norm + CLIP_EPS), 1.0)


class DocumentedOptimizer:
    """Float64 parameters trained by torch.optim's documented algorithm from given averaged gradients."""

    def __init__(self, algorithm: str, params: Mapping, hyperparameters: Mapping, clip_norm: float | None) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
        self.algorithm, self.name = ALGORITHMS[algorithm], NAMES[algorithm]
        self.hyperparameters, self.clip_norm = dict(hyperparameters), clip_norm
        self.params = {n: np.array(p, dtype=np.float64) for n, p in params.items()}
        self.state: dict[str, dict] = {n: {} for n in self.params}
        self.t = 0

    def step(self, grads: Mapping) -> None:
        """Clip ``grads`` (averaged, before clipping) as torch would, then take one optimizer step."""
        grads = {n: np.asarray(g, dtype=np.float64) for n, g in grads.items()}
        if self.clip_norm is not None:
            coefficient = clip_coefficient(grads, self.clip_norm)
            grads = {n: g * coefficient for n, g in grads.items()}
        self.t += 1
        for name, theta in self.params.items():
            self.params[name] = self.algorithm(theta, grads[name], self.state[name], self.t, **self.hyperparameters)
