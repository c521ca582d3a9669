"""The optimizer update on a device in one kernel: the rule's formula (``update``) spelled in CUDA C.

The formula is the one NumPy evaluates on the host: ``C_OPS`` spells each
operation as a C expression on float32 values, the step's constants are
kernel arguments (so a new learning rate compiles nothing), and the kernel is
compiled with ``--fmad=false``, so that no multiply and add is contracted into
one fused multiply-add: each rounds on its own, as NumPy's do, and the update
gives the host's bits. Division and ``sqrtf`` are correctly rounded (NVRTC's
defaults, ``--prec-div=true --prec-sqrt=true``). One launch per run of a
parameter group, reading and writing each array once. On the stand-in
(``mpizero.standin``) the kernel is the NumPy evaluation itself.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np

from mpizero.arrays import is_standin

C_OPS = SimpleNamespace(
    add=lambda a, b: f"({a} + {b})",
    sub=lambda a, b: f"({a} - {b})",
    mul=lambda a, b: f"({a} * {b})",
    div=lambda a, b: f"({a} / {b})",
    sqrt=lambda a: f"sqrtf({a})",
    maximum=lambda a, b: f"(({a} >= {b} || isnan({a})) ? {a} : {b})",  # numpy.maximum's: a NaN wins
    neg=lambda a: f"(-{a})",
    sign=lambda a: f"(({a}) > 0.0f ? 1.0f : (({a}) < 0.0f ? -1.0f : (({a}) == 0.0f ? 0.0f : ({a}))))",  # numpy.sign's
)
OPTIONS = ("--fmad=false",)


def c_statements(rule, hyper, constants: dict, states: list[str]) -> tuple[list[str], str, list[str]]:
    """The float constants' names, the C statements of one element's update (``float new_X = ...;`` for each
    array the formula writes, then ``X = new_X;``; the inputs are the float values ``param``, ``grad``, the states
    and ``c_NAME``) and the names it writes; Python conditions on ``hyper`` and on boolean constants choose the
    terms."""
    numbers = [name for name, value in constants.items() if not isinstance(value, bool)]
    symbols = {name: value if isinstance(value, bool) else f"c_{name}" for name, value in constants.items()}
    results = rule.formula(C_OPS, {name: name for name in ["param", "grad", *states]}, symbols, hyper)
    body = " ".join(f"float new_{name} = {expression};" for name, expression in results.items())
    return numbers, body + " " + " ".join(f"{name} = new_{name};" for name in results), list(results)


def kernel_source(rule, hyper, constants: dict, states: list[str], decoding=None) -> tuple[str, str, str]:
    """The CUDA kernel's ``(inputs, outputs, body)``: ``grad`` and the float constants in, ``param`` and the
    states read and written. With ``decoding`` (``reduce.arithmetic.Decoding``): the int64 sum and its segments'
    scalars in instead, and ``grad`` written first, each element decoded, then updated from it."""
    numbers, body, _ = c_statements(rule, hyper, constants, states)
    constants_in = [f"float32 c_{name}" for name in numbers]
    outputs = ", ".join(f"float32 {name}" for name in ["param", *states])
    if decoding is None:
        return ", ".join(["float32 grad", *constants_in]), outputs, body
    inputs = ", ".join(["int64 total", *([decoding.params] if decoding.params else []), *constants_in])
    return inputs, f"float32 grad, {outputs}", f"{decoding.statement('grad')} {body}"


@functools.cache
def _compiled(cupy, inputs: str, outputs: str, body: str):
    return cupy.ElementwiseKernel(inputs, outputs, body, "mz_update", options=OPTIONS)


def device_update(xp, rule, hyper, arrays: dict, constants: dict, numpy_ops, decoding=None) -> None:
    """Apply ``rule`` to device ``arrays`` (``param``, ``grad`` and the states) in place, in one launch
    (``numpy_ops``: how NumPy spells the operations, for the stand-in); with ``decoding`` (the int64 sum still to
    decode, ``reduce.arithmetic.Decoding``) the same launch first decodes it into ``grad`` (a launch per chunk of
    its segments)."""
    if decoding is None:
        _launch(xp, rule, hyper, arrays, constants, numpy_ops, None)
        return
    for start, stop, part in decoding.chunks():
        _launch(xp, rule, hyper, {name: a[start:stop] for name, a in arrays.items()}, constants, numpy_ops, part)


def _launch(xp, rule, hyper, arrays: dict, constants: dict, numpy_ops, decoding) -> None:
    states = [name for name in arrays if name not in ("param", "grad")]
    numbers = [np.float32(value) for value in constants.values() if not isinstance(value, bool)]
    outputs = [arrays["param"], *(arrays[name] for name in states)]
    inputs, outs, body = kernel_source(rule, hyper, constants, states, decoding)
    if is_standin(xp):  # the formula as NumPy evaluates it, on the memory underneath; the segments bound to it
        run = functools.partial(_numpy_body, numpy_ops, rule, hyper, constants, states, decoding)
        first = arrays["grad"] if decoding is None else decoding.total
        extra = [] if decoding is None else [arrays["grad"]]
        first_param = "float32 grad" if decoding is None else "int64 total"
        params = ", ".join([first_param, *(f"float32 c_{i}" for i in range(len(numbers)))])
        xp.kernel(run, params, outs)(first, *numbers, *extra, *outputs)
        return
    if decoding is None:
        _compiled(xp, inputs, outs, body)(arrays["grad"], *numbers, *outputs)
    else:
        _compiled(xp, inputs, outs, body)(decoding.total, *decoding.scalars, *numbers, arrays["grad"], *outputs)


def _numpy_body(ops, rule, hyper, constants: dict, states: list[str], decoding, first, *rest) -> None:
    """The stand-in's update kernel: with ``decoding``, ``first`` is the int64 sum, decoded into ``grad`` (the
    first output) before the formula; else ``first`` is ``grad``."""
    param, state = rest[-1 - len(states)], rest[len(rest) - len(states) :]
    grad = first
    if decoding is not None:
        grad = rest[-2 - len(states)]
        decoding.numpy(first, grad)
    arrays = {"param": param, "grad": grad, **dict(zip(states, state))}
    for name, value in rule.formula(ops, arrays, constants, hyper).items():
        arrays[name][...] = value
