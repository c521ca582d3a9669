"""The optimizer update on the host in one pass: the rule's formula (``update``) spelled in C and compiled.

The same C spelling as the device kernel (``device_update.c_statements``), in a loop over the flat arrays,
compiled by ``mpizero.compiled`` (no fused multiply-add: each operation rounds on its own, as NumPy's do), so
it gives the bits of NumPy's chunked evaluation while reading and writing each array once. One library per
specialised formula (the rule, its boolean choices, its states); the step's constants are an argument, so a
new learning rate compiles nothing. None where no compiler works: the caller evaluates with NumPy.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from mpizero import compiled
from mpizero.core.optim.device_update import c_statements

LOOP = """MZ_CLONES
void mz_update(size_t n, const float *restrict c, const float *restrict grad_, {pointers}) {{
    {constants}
    for (size_t i = 0; i < n; i++) {{
        const float grad = grad_[i];
        {loads}
        {body}
        {stores}
    }}
}}
"""


def kernel(rule, hyper, constants: dict, states: list[str], by_formula):
    """The compiled update for this formula, called as ``(n, constants, grad, param, *states)``, or None (also
    where, at its first use, it gives other bits than ``by_formula(arrays)``, NumPy's, on probe values)."""
    numbers, body, written = c_statements(rule, hyper, constants, states)
    arrays = ["param", *states]
    source = LOOP.format(
        pointers=", ".join(f"float *restrict {name}_" for name in arrays),
        constants=" ".join(f"const float c_{name} = c[{i}];" for i, name in enumerate(numbers)),
        loads=" ".join(f"float {name} = {name}_[i];" for name in arrays),
        body=body,
        stores=" ".join(f"{name}_[i] = {name};" for name in written),  # what a phase only reads stays unwritten
    )
    function = _function(source, len(arrays))
    if function is not None and source not in _TESTED:
        _TESTED[source] = compiled.self_tested(function, "update", _self_test(function, constants, states, by_formula))
    return _TESTED.get(source)


_TESTED: dict[str, object] = {}  # source -> its function where it passed its self-test, else None


def _self_test(function, constants: dict, states: list[str], by_formula) -> str | None:
    """Whether ``function`` updates probe arrays as ``by_formula`` does, bit for bit: values over many exponents,
    signed zeros and subnormals (states non-negative, as second moments are); in words if not."""
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 1.0, -1.0, 1e18, -1e18], np.float32)

    def probe(non_negative: bool) -> np.ndarray:
        spread = (rng.standard_normal(247) * np.exp2(rng.integers(-30, 30, 247))).astype(np.float32)
        values = np.concatenate([special, spread])
        return np.abs(values) if non_negative else values

    arrays = {"param": probe(False), "grad": probe(False), **{name: probe(True) for name in states}}
    expected = {name: a.copy() for name, a in arrays.items()}
    with np.errstate(all="ignore"):
        by_formula(expected)
        host_update(function, arrays, constants)
    differs = [name for name in arrays if arrays[name].tobytes() != expected[name].tobytes()]
    return f"the update of {', '.join(differs)} on probe values" if differs else None


@functools.cache
def _function(source: str, written: int):
    library, _ = compiled.kernel_library("update", source)
    if library is None:
        return None
    function = library.mz_update
    function.argtypes = [ctypes.c_size_t, *(ctypes.c_void_p,) * (2 + written)]
    function.restype = None
    return function


def host_update(function, arrays: dict, constants: dict) -> None:
    """Run the compiled update ``function`` on host ``arrays`` (``param``, ``grad``, the states) in place."""
    numbers = np.array([value for value in constants.values() if not isinstance(value, bool)], np.float32)
    states = [arrays[name] for name in arrays if name not in ("param", "grad")]
    pointers = [a.ctypes.data for a in (numbers, arrays["grad"], arrays["param"], *states)]
    function(arrays["param"].size, *pointers)
