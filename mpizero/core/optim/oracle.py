"""Each optimizer's documented algorithm in float64 NumPy: an oracle for what the optimizer means.

``verify`` compares the engine with the single-rank reference bit for bit, but
both evaluate the same formula (each optimizer's ``rule``), so a wrong formula
(a bias correction off by one step, weight decay coupled where it should be
decoupled) would pass that comparison. The independent check: each optimizer's
file also writes its algorithm from the pseudo-code in the ``torch.optim``
documentation (or, for Lion, its paper), in float64, sharing no code with its formula (``documented``);
this module runs it with ``torch.nn.utils.clip_grad_norm_``'s clipping. Only
the hyperparameter values are read from the optimizer under test.

Torch's names: ``lr`` is gamma, ``weight_decay`` lambda, ``momentum`` mu,
``dampening`` tau, ``betas`` (beta1, beta2), ``eps`` epsilon; ``t`` counts the
optimizer steps taken, from 1 (a step skipped for fp16 overflow is not taken).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from mpizero.core.optim.binding import BoundOptimizer
from mpizero.core.optim.hyper import as_dict

CLIP_EPS = 1e-6  # clip_grad_norm_: clip_coef = max_norm / (total_norm + 1e-6)


def clip_coefficient(grads: Mapping, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor over all gradients together (L2 norm), clamped to 1."""
    total_norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
    return min(max_norm / (total_norm + CLIP_EPS), 1.0)


class DocumentedOptimizer:
    """Float64 parameters trained by the optimizer's documented algorithm from given averaged gradients."""

    def __init__(self, optimizer, params: Mapping, clip_norm: float | None) -> None:
        """``optimizer``: the engine's optimizer, whose class's ``documented`` algorithm this runs with each tensor's
        hyper-parameters (its parameter group's, as they are now)."""
        kind = type(optimizer)
        if kind.documented is None:
            raise ValueError(f"{kind.__name__} has no documented algorithm to check against")
        self.algorithm, self.name, self.clip_norm = kind.documented, kind.__name__, clip_norm
        bound = BoundOptimizer(optimizer, {n: np.shape(p) for n, p in params.items()})  # each tensor's group
        hyper = bound.read()
        self.hyperparameters = {n: as_dict(hyper[bound.group_of[n]]) for n in params}
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
            hyper = self.hyperparameters[name]
            self.params[name] = self.algorithm(theta, grads[name], self.state[name], self.t, **hyper)
