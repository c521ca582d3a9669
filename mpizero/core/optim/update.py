"""One optimizer step on float32 arrays: a rule's formula as one compiled host pass, NumPy chunks, or a device kernel.

Every rule (``sgd``, ``adam``, ...) writes its update once as ``formula(ops,
arrays, c, hyper)``, elementwise and correctly rounded (add, multiply, divide,
sqrt, maximum), so updating a shard gives, element for element, the same bits
as updating the full vector. Step-dependent factors (``constants``) are
computed once per step as Python floats and rounded to float32. ``NUMPY_OPS``
evaluates a formula on host arrays in cache-sized chunks where no C compiler
works; ``host_update`` compiles it into one pass over the host arrays, and
``device_update`` spells it as one CUDA kernel. Python conditions on ``hyper`` and ``c`` choose
the terms, so a kernel generated from the same function is specialized to them.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np

from mpizero.arrays import CHUNK, array_module
from mpizero.core.optim import device_update, host_update


class Rule:
    """What every optimizer's update rule offers: ``name``, ``hyper_type``, ``constants(hyper, step)`` and
    ``formula(ops, arrays, c, hyper)``; ``whole(hyper)``: whether a group with ``hyper`` needs each tensor whole
    between two elementwise phases (Muon's, ``core/whole_matrices``), which an elementwise rule never does."""

    name = ""
    hyper_type = None

    @staticmethod
    def whole(hyper) -> bool:
        return False


NUMPY_OPS = SimpleNamespace(
    add=np.add,
    sub=np.subtract,
    mul=np.multiply,
    div=np.divide,
    sqrt=np.sqrt,
    maximum=np.maximum,
    neg=np.negative,
    sign=np.sign,
)


def apply_step(rule, hyper, step: int, param, grad, state: dict, compiled: bool = True, decoding=None) -> None:
    """Apply one step of ``rule`` in place: ``param`` and ``state`` from ``grad`` (flat float32 arrays, equal
    length); ``step`` counts the optimizer steps taken, from 1. Host arrays go through the compiled pass
    (``host_update``; not where ``compiled`` is False: the reference's NumPy), else NumPy in cache-sized chunks;
    device arrays through one fused kernel, which with ``decoding`` (the int64 sum and its segments'
    ``(lo, hi, divisor)``) first decodes the sum into ``grad``, in the same launch."""
    arrays = {"param": flat(param), "grad": flat(grad), **{k: flat(v) for k, v in state.items()}}
    constants = {k: v if isinstance(v, bool) else np.float32(v) for k, v in rule.constants(hyper, step).items()}
    xp = array_module(arrays["param"])
    if xp is not np:
        device_update.device_update(xp, rule, hyper, arrays, constants, NUMPY_OPS, decoding)
        return
    by_formula = partial(numpy_step, rule, hyper, constants)
    kernel = host_update.kernel(rule, hyper, constants, list(state), by_formula) if compiled else None
    if kernel is not None:
        host_update.host_update(kernel, arrays, constants)
        return
    by_formula(arrays)


def numpy_step(rule, hyper, constants: dict, arrays: dict) -> None:
    """``rule``'s formula evaluated by NumPy on host ``arrays`` (flat) in place, in cache-sized chunks."""
    for start in range(0, arrays["param"].size, CHUNK):
        view = {k: a[start : start + CHUNK] for k, a in arrays.items()}
        for name, value in rule.formula(NUMPY_OPS, view, constants, hyper).items():
            view[name][...] = value


def flat(a):
    """A 1-D view of a contiguous array (updates through it land in ``a``)."""
    if not a.flags.c_contiguous:
        raise ValueError(f"optimizer buffers must be contiguous, got strides {a.strides}")
    return a.reshape(-1)
