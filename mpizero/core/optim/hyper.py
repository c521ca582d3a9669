"""Each algorithm's hyper-parameters, under torch.optim's names, checked whenever they are read.

A parameter group's hyper-parameters are read again at every step (a learning-rate
schedule changes them), so the checks run there, and a bad value (a schedule that
made ``lr`` negative) names the group, the field and the value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


def _check(name: str, value, low: float, high: float = math.inf, closed_high: bool = False) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = number and math.isfinite(value) and (low <= value < high or (closed_high and value == high))
    if not ok:
        upper = "]" if closed_high else ")"
        raise ValueError(f"{name} must be in [{low}, {high}{upper}, got {value!r}")


def _flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


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
        _check("lr", self.lr, 0.0)
        _check("momentum", self.momentum, 0.0)
        _check("dampening", self.dampening, -math.inf)
        _check("weight_decay", self.weight_decay, 0.0)
        _flag("nesterov", self.nesterov)
        _flag("maximize", self.maximize)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov=True needs momentum > 0 and dampening = 0 (as torch.optim.SGD)")

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()


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
        _check("lr", self.lr, 0.0)
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise ValueError(f"betas must be a pair of numbers, got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(self.betas))
        _check("betas[0]", self.betas[0], 0.0, 1.0)
        _check("betas[1]", self.betas[1], 0.0, 1.0)
        _check("eps", self.eps, 0.0)
        _check("weight_decay", self.weight_decay, 0.0)
        for flag in ("amsgrad", "maximize", "decoupled_weight_decay"):
            _flag(flag, getattr(self, flag))

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if self.amsgrad else ("exp_avg", "exp_avg_sq")


def field_names(hyper_type) -> tuple[str, ...]:
    """The hyper-parameter names of ``hyper_type``, in its order."""
    return tuple(f.name for f in fields(hyper_type))


def as_dict(hyper) -> dict:
    """The hyper-parameters by name (tuples as lists: what JSON holds)."""
    values = {name: getattr(hyper, name) for name in field_names(type(hyper))}
    return {name: list(v) if isinstance(v, tuple) else v for name, v in values.items()}
