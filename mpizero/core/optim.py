"""SGD, Adam and AdamW as elementwise float32 updates.

Every operation is elementwise and correctly rounded (add, multiply, divide,
sqrt), so updating a shard gives, element for element, the same bits as
updating the full vector. Step-dependent factors are computed once as Python
floats. The formulas follow ``torch.optim``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mpizero.core.arrays import CHUNK, array_module


def chunks(param):
    """Yield slices covering a flat host buffer in cache-sized pieces (device buffers: one slice)."""
    n = param.size
    step = CHUNK if array_module(param) is np else max(n, 1)
    for start in range(0, n, step):
        yield slice(start, min(start + step, n))


def flat(a):
    """A 1-D view of a contiguous array (updates through it land in ``a``)."""
    if not a.flags.c_contiguous:
        raise ValueError(f"optimizer buffers must be contiguous, got strides {a.strides}")
    return a.reshape(-1)


def _check(name: str, value: float, low: float, high: float = math.inf, closed_high=False) -> None:
    ok = low <= value < high or (closed_high and value == high)
    if not (isinstance(value, (int, float)) and math.isfinite(value) and ok):
        upper = "]" if closed_high else ")"
        raise ValueError(f"{name} must be in [{low}, {high}{upper}, got {value!r}")


@dataclass(frozen=True)
class SGD:
    """SGD with optional momentum and L2 weight decay."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check("lr", self.lr, 0.0)
        _check("momentum", self.momentum, 0.0, 1.0)
        _check("weight_decay", self.weight_decay, 0.0)

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()

    def update(self, param, grad, state: dict, step: int) -> None:
        """Update ``param`` in place from ``grad``; ``step`` counts from 1."""
        param, grad, state = flat(param), flat(grad), {k: flat(v) for k, v in state.items()}
        for part in chunks(param):
            self._update(param[part], grad[part], {k: v[part] for k, v in state.items()})

    def _update(self, param, grad, state: dict) -> None:
        if self.weight_decay:
            grad = grad + self.weight_decay * param
        if self.momentum:
            buf = state["momentum_buffer"]
            buf *= self.momentum
            buf += grad
            grad = buf
        param -= self.lr * grad


@dataclass(frozen=True)
class Adam:
    """Adam (Kingma and Ba) with L2 weight decay added to the gradient."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    decoupled = False

    def __post_init__(self) -> None:
        _check("lr", self.lr, 0.0)
        _check("betas[0]", self.betas[0], 0.0, 1.0)
        _check("betas[1]", self.betas[1], 0.0, 1.0)
        _check("eps", self.eps, 0.0)
        _check("weight_decay", self.weight_decay, 0.0)

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def update(self, param, grad, state: dict, step: int) -> None:
        """Update ``param`` in place from ``grad``; ``step`` counts from 1."""
        param, grad, state = flat(param), flat(grad), {k: flat(v) for k, v in state.items()}
        for part in chunks(param):
            self._update(param[part], grad[part], {k: v[part] for k, v in state.items()}, step)

    def _update(self, param, grad, state: dict, step: int) -> None:
        xp = array_module(param)
        beta1, beta2 = self.betas
        if self.weight_decay and self.decoupled:
            param *= 1.0 - self.lr * self.weight_decay
        elif self.weight_decay:
            grad = grad + self.weight_decay * param
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg *= beta1
        exp_avg += (1.0 - beta1) * grad
        exp_avg_sq *= beta2
        exp_avg_sq += (1.0 - beta2) * (grad * grad)
        step_size = self.lr / (1.0 - beta1**step)
        denom = xp.sqrt(exp_avg_sq)
        denom /= math.sqrt(1.0 - beta2**step)
        denom += self.eps
        param -= step_size * (exp_avg / denom)


@dataclass(frozen=True)
class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov and Hutter)."""

    weight_decay: float = 1e-2

    decoupled = True


OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": AdamW}
