"""SGD (torch.optim.SGD): momentum (the buffer starts at the first gradient), dampening, Nesterov, L2 decay.

One optimizer, one file: its hyper-parameters, its update formula (``update``
evaluates it on shards, bit for bit as on the full vector), the class users
build, and torch's documented algorithm in float64, written apart from the
formula, for ``verify``'s semantics check (``oracle``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpizero.core.optim.hyper import check, flag
from mpizero.core.optim.optimizer import Optimizer
from mpizero.core.optim.update import Rule


@dataclass(frozen=True)
class SGDHyper:
    """torch.optim.SGD's hyper-parameters."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        check("lr", self.lr, 0.0)
        check("momentum", self.momentum, 0.0)
        check("dampening", self.dampening, -math.inf)
        check("weight_decay", self.weight_decay, 0.0)
        flag("nesterov", self.nesterov)
        flag("maximize", self.maximize)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov=True needs momentum > 0 and dampening = 0 (as torch.optim.SGD)")

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()


class SGDRule(Rule):
    """torch.optim.SGD: momentum (the buffer starts at the first gradient), dampening, Nesterov, L2 decay."""

    name = "SGD"
    hyper_type = SGDHyper

    @staticmethod
    def constants(hyper: SGDHyper, step: int) -> dict:
        c = {"lr": hyper.lr, "weight_decay": hyper.weight_decay, "momentum": hyper.momentum, "first": step == 1}
        return {**c, "one_minus_dampening": 1.0 - hyper.dampening}

    @staticmethod
    def formula(ops, a: dict, c: dict, h: SGDHyper) -> dict:
        g = ops.neg(a["grad"]) if h.maximize else a["grad"]
        if h.weight_decay:
            g = ops.add(g, ops.mul(a["param"], c["weight_decay"]))
        out = {}
        if h.momentum:
            if c["first"]:
                buf = g
            else:
                fresh = ops.mul(g, c["one_minus_dampening"]) if h.dampening else g
                buf = ops.add(ops.mul(a["momentum_buffer"], c["momentum"]), fresh)
            out["momentum_buffer"] = buf
            g = ops.add(g, ops.mul(buf, c["momentum"])) if h.nesterov else buf
        out["param"] = ops.sub(a["param"], ops.mul(g, c["lr"]))
        return out


def documented_sgd(
    theta, g, state: dict, t: int, *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False
):
    """One step of torch.optim.SGD's documented algorithm (float64)."""
    g = -g if maximize else g
    if weight_decay:
        g = g + weight_decay * theta
    if momentum:
        b = g.copy() if t == 1 else momentum * state["b"] + (1.0 - dampening) * g
        state["b"] = b
        g = g + momentum * b if nesterov else b
    return theta - lr * g


class SGD(Optimizer):
    """torch.optim.SGD: ``lr``, ``momentum``, ``dampening``, ``weight_decay``, ``nesterov``, ``maximize``."""

    rule = SGDRule
    documented = staticmethod(documented_sgd)
    torch_classes = ("torch.optim.SGD",)
    verify_settings = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
