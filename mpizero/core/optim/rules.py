"""SGD and Adam as elementwise float32 updates, each formula written once against an ``ops`` namespace.

Every operation is elementwise and correctly rounded (add, multiply, divide,
sqrt, maximum), so updating a shard gives, element for element, the same bits
as updating the full vector. Step-dependent factors are computed once per step
as Python floats (``constants``) and rounded to float32. The formulas follow
torch.optim's documented algorithms (``oracle`` checks them in float64).

``formula(ops, arrays, c, hyper)`` maps the current ``param``, ``grad`` and
state arrays to the new param and states; ``NUMPY_OPS`` evaluates it on host
arrays in cache-sized chunks, and ``device_update`` spells it as one CUDA kernel.
Python conditions on ``hyper`` and ``c`` choose the terms, so a kernel
generated from the same function is specialized to them.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from mpizero.arrays import CHUNK, array_module
from mpizero.core.optim import device_update
from mpizero.core.optim.hyper import AdamHyper, SGDHyper

NUMPY_OPS = SimpleNamespace(
    add=np.add, sub=np.subtract, mul=np.multiply, div=np.divide, sqrt=np.sqrt, maximum=np.maximum, neg=np.negative
)


class SGDRule:
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


class AdamRule:
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


def update(rule, hyper, step: int, param, grad, state: dict) -> None:
    """Apply one step of ``rule`` in place: ``param`` and ``state`` from ``grad`` (flat float32 arrays, equal
    length); ``step`` counts the optimizer steps taken, from 1. Host arrays go in cache-sized chunks, device
    arrays in one fused kernel (``device_update``)."""
    arrays = {"param": flat(param), "grad": flat(grad), **{k: flat(v) for k, v in state.items()}}
    constants = {k: v if isinstance(v, bool) else np.float32(v) for k, v in rule.constants(hyper, step).items()}
    xp = array_module(arrays["param"])
    if xp is not np:
        device_update.device_update(xp, rule, hyper, arrays, constants, NUMPY_OPS)
        return
    for start in range(0, arrays["param"].size, CHUNK):
        view = {k: a[start : start + CHUNK] for k, a in arrays.items()}
        for name, value in rule.formula(NUMPY_OPS, view, constants, hyper).items():
            view[name][...] = value


def flat(a):
    """A 1-D view of a contiguous array (updates through it land in ``a``)."""
    if not a.flags.c_contiguous:
        raise ValueError(f"optimizer buffers must be contiguous, got strides {a.strides}")
    return a.reshape(-1)
