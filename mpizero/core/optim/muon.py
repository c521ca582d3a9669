"""Muon (torch.optim.Muon; Keller Jordan's reference): momentum orthogonalised by Newton-Schulz on whole weight
matrices, with AdamW for the tensors a recipe keeps off Muon (``use_muon=False`` groups: embeddings, heads,
biases, norms).

One optimizer, one file: its hyper-parameters, its update (two elementwise
phases around the orthogonalisation of each whole matrix: ``update`` evaluates
the phases on shards, bit for bit as on the full vector, and the engine has
each matrix orthogonalised whole by one rank, ``core/whole_matrices``), the class
users build, and the documented algorithm in float64, written apart from the
formula, for ``verify``'s semantics check (``oracle``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mpizero.arrays import array_module
from mpizero.core.optim.adam import AdamHyper, AdamRule, documented_adamw
from mpizero.core.optim.hyper import check, check_betas, flag
from mpizero.core.optim.optimizer import Optimizer
from mpizero.core.optim.update import Rule, apply_step

COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the published quintic's (a, b, c)
ADJUSTMENTS = (None, "original", "match_rms_adamw")


@dataclass(frozen=True)
class MuonHyper:
    """torch.optim.Muon's hyper-parameters, and ``use_muon`` with AdamW's ``betas`` and ``adam_eps`` for the
    groups that take AdamW instead (as Keller Jordan's ``MuonWithAuxAdam``)."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = COEFFICIENTS
    eps: float = 1e-7
    ns_steps: int = 5
    adjust_lr_fn: str | None = None
    use_muon: bool = True
    betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-10

    def __post_init__(self) -> None:
        check("lr", self.lr, 0.0)
        check("weight_decay", self.weight_decay, 0.0)
        check("momentum", self.momentum, 0.0, 1.0)
        check("eps", self.eps, 0.0)
        check("adam_eps", self.adam_eps, 0.0)
        flag("nesterov", self.nesterov)
        flag("use_muon", self.use_muon)
        check_betas(self)
        if not (isinstance(self.ns_coefficients, (tuple, list)) and len(self.ns_coefficients) == 3):
            raise ValueError(f"ns_coefficients must be three numbers, got {self.ns_coefficients!r}")
        object.__setattr__(self, "ns_coefficients", tuple(self.ns_coefficients))
        for index, value in enumerate(self.ns_coefficients):
            check(f"ns_coefficients[{index}]", value, -math.inf)
        if not (isinstance(self.ns_steps, int) and not isinstance(self.ns_steps, bool) and 1 <= self.ns_steps < 100):
            raise ValueError(f"ns_steps must be an int in [1, 100), got {self.ns_steps!r}")
        if self.adjust_lr_fn not in ADJUSTMENTS:
            raise ValueError(f"adjust_lr_fn must be one of {ADJUSTMENTS}, got {self.adjust_lr_fn!r}")

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.use_muon else ("exp_avg", "exp_avg_sq")

    @property
    def adam(self) -> AdamHyper:
        """The AdamW a ``use_muon=False`` group takes."""
        return AdamHyper(self.lr, self.betas, self.adam_eps, self.weight_decay, decoupled_weight_decay=True)

    def adjusted_lr(self, shape) -> float:
        """torch.optim.Muon's learning rate for a matrix of ``shape``."""
        rows, columns = shape[:2]
        if self.adjust_lr_fn == "match_rms_adamw":
            return self.lr * 0.2 * math.sqrt(max(rows, columns))
        return self.lr * math.sqrt(max(1.0, rows / columns))


class MomentumPhase:
    """Muon's first elementwise phase, as torch.optim.Muon's code (and Keller Jordan's) keeps its buffer, a running
    average: ``B = momentum * B + (1 - momentum) * g``; the direction ``(1 - momentum) * g + momentum * B``
    (Nesterov) or ``B``. (torch's documentation writes the sum ``momentum * B + g``: Newton-Schulz's
    normalisation makes the same update of both, and the state dict holds torch's average.)"""

    @staticmethod
    def constants(hyper: MuonHyper, step: int) -> dict:
        return {"momentum": hyper.momentum, "one_minus_momentum": 1.0 - hyper.momentum}

    @staticmethod
    def formula(ops, a: dict, c: dict, h: MuonHyper) -> dict:
        fresh = ops.mul(a["grad"], c["one_minus_momentum"])
        buf = ops.add(ops.mul(a["momentum_buffer"], c["momentum"]), fresh)
        direction = ops.add(fresh, ops.mul(buf, c["momentum"])) if h.nesterov else buf
        return {"momentum_buffer": buf, "direction": direction}


class ApplyPhase:
    """Muon's last elementwise phase: decoupled weight decay, then the orthogonalised direction (already scaled by
    the matrix's adjusted learning rate, ``orthogonalize``) subtracted."""

    @staticmethod
    def constants(hyper: MuonHyper, step: int) -> dict:
        return {"decay": 1.0 - hyper.lr * hyper.weight_decay}

    @staticmethod
    def formula(ops, a: dict, c: dict, h: MuonHyper) -> dict:
        p = ops.mul(a["param"], c["decay"]) if h.weight_decay else a["param"]
        return {"param": ops.sub(p, a["orthogonal"])}


class MuonRule(Rule):
    """Muon on ``use_muon`` groups (each 2-D tensor's momentum orthogonalised whole), AdamW on the others."""

    name = "Muon"
    hyper_type = MuonHyper
    momentum_phase, apply_phase = MomentumPhase, ApplyPhase

    @staticmethod
    def whole(hyper: MuonHyper) -> bool:
        """Whether ``hyper``'s group needs each tensor whole between its phases (a Muon group)."""
        return hyper.use_muon

    @staticmethod
    def constants(hyper: MuonHyper, step: int) -> dict:
        return AdamRule.constants(hyper.adam, step)

    @staticmethod
    def formula(ops, a: dict, c: dict, h: MuonHyper) -> dict:
        """The elementwise update of a ``use_muon=False`` group: AdamW."""
        return AdamRule.formula(ops, a, c, h.adam)

    @staticmethod
    def orthogonalize(direction, hyper: MuonHyper):
        """One matrix's direction orthogonalised (``newton_schulz``), times its adjusted learning rate, float32."""
        scale = np.float32(hyper.adjusted_lr(direction.shape))
        ortho = newton_schulz(direction, hyper.ns_coefficients, hyper.ns_steps, hyper.eps)
        return ortho * scale

    @classmethod
    def whole_step(cls, hyper: MuonHyper, step: int, param, grad, state: dict) -> None:
        """One Muon step of a whole 2-D tensor (the single-rank reference's, so its phases are NumPy's on the host):
        the phases around ``orthogonalize``."""
        xp = array_module(param)
        direction = xp.empty(param.shape, np.float32)
        apply_step(cls.momentum_phase, hyper, step, param, grad, {**state, "direction": direction}, compiled=False)
        orthogonal = cls.orthogonalize(direction, hyper)
        apply_step(cls.apply_phase, hyper, step, param, grad, {"orthogonal": orthogonal}, compiled=False)


def newton_schulz(g, coefficients, steps: int, eps: float):
    """The quintic Newton-Schulz iteration of torch.optim.Muon (after Keller Jordan), in ``g``'s dtype (float32 in
    the engine): ``g`` scaled to unit Frobenius norm (at least ``eps``), made wide, then ``steps`` times
    ``X = aX + (bA + cA^2)X`` with ``A = XX^T``. The same bytes for the same matrix on any rank."""
    xp, real = array_module(g), g.dtype.type
    a, b, c = (real(v) for v in coefficients)
    tall = g.shape[0] > g.shape[1]
    x = g.T if tall else g
    x = x / real(max(float(xp.sqrt((x * x).sum())), eps))
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return xp.ascontiguousarray(x.T if tall else x)


def documented_muon(theta, g, state: dict, t: int, *, use_muon=True, **hyper):
    """One step of torch.optim.Muon's algorithm (float64; its buffer the running average its code keeps), or
    AdamW's for a ``use_muon=False`` group."""
    if not use_muon:
        adam = {"lr": hyper["lr"], "betas": hyper["betas"], "eps": hyper["adam_eps"]}
        return documented_adamw(theta, g, state, t, weight_decay=hyper["weight_decay"], **adam)
    momentum, lr = hyper["momentum"], hyper["lr"]
    state["b"] = momentum * state.get("b", 0.0) + (1.0 - momentum) * g  # torch's code: buf.lerp_(grad, 1 - momentum)
    b_tilde = (1.0 - momentum) * g + momentum * state["b"] if hyper["nesterov"] else state["b"]
    a, b, c = hyper["ns_coefficients"]
    x = b_tilde.T if b_tilde.shape[0] > b_tilde.shape[1] else b_tilde
    x = x / max(np.sqrt(np.sum(x * x)), hyper["eps"])
    for _ in range(hyper["ns_steps"]):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    orthogonal = x.T if b_tilde.shape[0] > b_tilde.shape[1] else x
    rows, columns = theta.shape
    ratio = (
        0.2 * math.sqrt(max(rows, columns))
        if hyper["adjust_lr_fn"] == "match_rms_adamw"
        else math.sqrt(max(1.0, rows / columns))
    )
    return theta * (1.0 - lr * hyper["weight_decay"]) - lr * ratio * orthogonal


class Muon(Optimizer):
    """Muon: ``lr``, ``weight_decay`` (decoupled), ``momentum``, ``nesterov``, ``ns_coefficients``, ``eps``,
    ``ns_steps``, ``adjust_lr_fn``; groups with ``use_muon=False`` take AdamW (``lr``, ``betas``, ``adam_eps``,
    ``weight_decay``)."""

    rule = MuonRule
    documented = staticmethod(documented_muon)
    torch_classes = ("torch.optim.Muon",)
    verify_settings = {"lr": 0.02, "weight_decay": 0.01}

    @classmethod
    def for_shapes(cls, shapes: dict, **defaults) -> Muon:
        """Muon on every 2-D tensor, AdamW (``use_muon=False``) on the rest: what ``train`` and ``verify`` use.
        Reference recipes also keep embeddings and heads on AdamW: give such groups by name yourself."""
        matrices = [n for n, shape in shapes.items() if len(shape) == 2]
        rest = [n for n, shape in shapes.items() if len(shape) != 2]
        groups = [{"params": matrices}] + ([{"params": rest, "use_muon": False}] if rest else [])
        return cls(groups, **defaults)
