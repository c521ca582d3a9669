"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"; ``lion_pytorch.Lion``): the sign of an
interpolated momentum, decoupled weight decay, one state.

One optimizer, one file: its hyper-parameters, its update formula (``update``
evaluates it on shards, bit for bit as on the full vector: every operation,
the sign included, is elementwise and exact or correctly rounded), the class
users build, and the published algorithm in float64, written apart from the
formula, for ``verify``'s semantics check (``oracle``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpizero.core.optim.hyper import check, check_betas, flag
from mpizero.core.optim.optimizer import Optimizer
from mpizero.core.optim.update import Rule


@dataclass(frozen=True)
class LionHyper:
    """``lion_pytorch.Lion``'s hyper-parameters (its defaults)."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    maximize: bool = False

    def __post_init__(self) -> None:
        check("lr", self.lr, 0.0)
        check_betas(self, closed_high=True)  # lion_pytorch allows 1
        check("weight_decay", self.weight_decay, 0.0)
        flag("maximize", self.maximize)

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg",)


class LionRule(Rule):
    """``p = p * (1 - lr * wd) - lr * sign(beta1 * m + (1 - beta1) * g)``, then ``m = beta2 * m + (1 - beta2) * g``."""

    name = "Lion"
    hyper_type = LionHyper

    @staticmethod
    def constants(hyper: LionHyper, step: int) -> dict:
        beta1, beta2 = hyper.betas
        return {
            "lr": hyper.lr,
            "decay": 1.0 - hyper.lr * hyper.weight_decay,
            "beta1": beta1,
            "beta2": beta2,
            "one_minus_beta1": 1.0 - beta1,
            "one_minus_beta2": 1.0 - beta2,
        }

    @staticmethod
    def formula(ops, a: dict, c: dict, h: LionHyper) -> dict:
        g = ops.neg(a["grad"]) if h.maximize else a["grad"]
        p = ops.mul(a["param"], c["decay"]) if h.weight_decay else a["param"]
        direction = ops.sign(ops.add(ops.mul(a["exp_avg"], c["beta1"]), ops.mul(g, c["one_minus_beta1"])))
        m = ops.add(ops.mul(a["exp_avg"], c["beta2"]), ops.mul(g, c["one_minus_beta2"]))
        return {"param": ops.sub(p, ops.mul(direction, c["lr"])), "exp_avg": m}


def documented_lion(theta, g, state: dict, t: int, *, lr, betas=(0.9, 0.99), weight_decay=0.0, maximize=False):
    """One step of Lion as the paper's Program 1 writes it (float64), weight decay decoupled."""
    beta1, beta2 = betas
    g = -g if maximize else g
    m = state.get("m", np.zeros_like(theta))
    update = np.sign(beta1 * m + (1.0 - beta1) * g)
    state["m"] = beta2 * m + (1.0 - beta2) * g
    return theta - lr * (update + weight_decay * theta)


class Lion(Optimizer):
    """Lion: ``lr``, ``betas``, ``weight_decay`` (decoupled), ``maximize``."""

    rule = LionRule
    documented = staticmethod(documented_lion)
    torch_classes = ("lion_pytorch.Lion",)
    verify_settings = {"lr": 1e-3, "weight_decay": 0.1}

    @staticmethod
    def torch_refusal(torch_optimizer) -> str | None:
        if getattr(torch_optimizer, "decoupled_wd", False):
            return (
                "lion_pytorch.Lion(decoupled_weight_decay=True) divides weight_decay by the initial lr, outside its "
                "parameter groups: give the decay to use as weight_decay, with decoupled_weight_decay=False"
            )
        return None
