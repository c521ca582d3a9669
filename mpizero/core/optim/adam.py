"""Adam and AdamW (torch.optim.Adam, torch.optim.AdamW): bias-corrected moments, L2 or decoupled weight decay,
AMSGrad, maximize.

One optimizer family, one file: its hyper-parameters, its update formula
(``update`` evaluates it on shards, bit for bit as on the full vector), the
classes users build, and torch's documented algorithms in float64, written
apart from the formula, for ``verify``'s semantics check (``oracle``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from mpizero.core.optim.hyper import check, check_betas, flag
from mpizero.core.optim.optimizer import Optimizer
from mpizero.core.optim.update import Rule


@dataclass(frozen=True)
class AdamHyper:
    """torch.optim.Adam's hyper-parameters; AdamW is Adam with ``decoupled_weight_decay=True``."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    maximize: bool = False
    decoupled_weight_decay: bool = False

    def __post_init__(self) -> None:
        check("lr", self.lr, 0.0)
        check_betas(self)
        check("eps", self.eps, 0.0)
        check("weight_decay", self.weight_decay, 0.0)
        for name in ("amsgrad", "maximize", "decoupled_weight_decay"):
            flag(name, getattr(self, name))

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if self.amsgrad else ("exp_avg", "exp_avg_sq")


class AdamRule(Rule):
    """torch.optim.Adam and AdamW: bias-corrected moments, L2 or decoupled weight decay, AMSGrad, maximize."""

    name = "Adam"
    hyper_type = AdamHyper

    @staticmethod
    def constants(hyper: AdamHyper, step: int) -> dict:
        beta1, beta2 = hyper.betas
        return {
            "beta1": beta1,
            "beta2": beta2,
            "one_minus_beta1": 1.0 - beta1,
            "one_minus_beta2": 1.0 - beta2,
            "weight_decay": hyper.weight_decay,
            "decay": 1.0 - hyper.lr * hyper.weight_decay,
            "step_size": hyper.lr / (1.0 - beta1**step),
            "bias_correction2_sqrt": math.sqrt(1.0 - beta2**step),
            "eps": hyper.eps,
        }

    @staticmethod
    def formula(ops, a: dict, c: dict, h: AdamHyper) -> dict:
        p, g = a["param"], ops.neg(a["grad"]) if h.maximize else a["grad"]
        if h.weight_decay and h.decoupled_weight_decay:
            p = ops.mul(p, c["decay"])
        elif h.weight_decay:
            g = ops.add(g, ops.mul(p, c["weight_decay"]))
        m = ops.add(ops.mul(a["exp_avg"], c["beta1"]), ops.mul(g, c["one_minus_beta1"]))
        v = ops.add(ops.mul(a["exp_avg_sq"], c["beta2"]), ops.mul(ops.mul(g, g), c["one_minus_beta2"]))
        out = {"exp_avg": m, "exp_avg_sq": v}
        second = v
        if h.amsgrad:
            second = out["max_exp_avg_sq"] = ops.maximum(a["max_exp_avg_sq"], v)
        denom = ops.add(ops.div(ops.sqrt(second), c["bias_correction2_sqrt"]), c["eps"])
        out["param"] = ops.sub(p, ops.mul(ops.div(m, denom), c["step_size"]))
        return out


def documented_adam(
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
    """One step of torch.optim.Adam's documented algorithm (float64): L2 weight decay, or decoupled."""
    g = -g if maximize else g
    if decoupled_weight_decay:
        theta = theta - lr * weight_decay * theta
    elif weight_decay:
        g = g + weight_decay * theta
    return theta - lr * _adam_direction(g, state, t, betas, eps, amsgrad)


def documented_adamw(theta, g, state: dict, t: int, *, weight_decay=1e-2, **hyper):
    """One step of torch.optim.AdamW's documented algorithm: decoupled weight decay."""
    return documented_adam(theta, g, state, t, weight_decay=weight_decay, **{**hyper, "decoupled_weight_decay": True})


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


class Adam(Optimizer):
    """torch.optim.Adam: ``lr``, ``betas``, ``eps``, ``weight_decay`` (L2), ``amsgrad``, ``maximize``."""

    rule = AdamRule
    fixed = {"decoupled_weight_decay": False}
    documented = staticmethod(documented_adam)
    torch_classes = ("torch.optim.Adam",)
    torch_counts_steps = True  # torch's state dict keeps each parameter's ``step``
    verify_settings = {"lr": 1e-2}


class AdamW(Adam):
    """torch.optim.AdamW: Adam with decoupled weight decay (default 1e-2)."""

    fixed = {"decoupled_weight_decay": True}
    documented = staticmethod(documented_adamw)
    torch_classes = ("torch.optim.AdamW",)

    def __init__(self, params: Iterable | None = None, **defaults) -> None:
        super().__init__(params, **{"weight_decay": 1e-2, **defaults})
