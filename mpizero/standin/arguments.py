"""An ``ElementwiseKernel``'s parameters, and CuPy's checks of a launch's arguments against them.

``"float32 x, int32 k"``: a parameter is a type and a name (``raw`` before them: indexed by hand). A type of one
letter (``T``) stands for whatever dtype its first device argument has, and every other argument of that letter
must have the same; any other type is a dtype, which a device argument must have exactly (CuPy casts nothing for a
kernel). Scalars are passed by value and cast to the parameter's type, as CuPy does, so they are not checked;
host arrays (0-d ones too) are refused elsewhere (``device.on_device``).
"""

from __future__ import annotations

import numpy as np

from mpizero.standin.device import ndarray


def parse(params: str) -> list[tuple[str, np.dtype | None, str]]:
    """``(type, dtype or None for a type letter, name)`` of each parameter of a list such as ``"float32 x, T y"``."""
    parsed = []
    for param in filter(None, (p.strip() for p in params.split(","))):
        kind, name = param.split()[-2:]
        parsed.append((kind, None if len(kind) == 1 else np.dtype(kind), name))
    return parsed


def check(body, ins: list, outs: list, args: tuple) -> None:
    """Raise CuPy's ``TypeError`` where ``args`` (inputs, then outputs) do not fit the parameters ``ins``, ``outs``."""
    name = getattr(body, "__name__", None) or getattr(getattr(body, "func", None), "__name__", "kernel")
    if len(args) != len(ins) + len(outs):
        raise TypeError(
            f"Wrong number of arguments for {name!r}. It must be {len(ins) + len(outs)} (with outputs: the stand-in "
            f"allocates none), but given {len(args)}."
        )
    letters: dict[str, np.dtype] = {}
    for (kind, dtype, param), arg in zip(outs, args[len(ins) :]):
        if not isinstance(arg, ndarray):
            raise TypeError("Output arguments must be cupy.ndarray")
        _check_one(letters, kind, dtype, param, arg.dtype)
    for (kind, dtype, param), arg in zip(ins, args):
        if isinstance(arg, ndarray):
            _check_one(letters, kind, dtype, param, arg.dtype)


def _check_one(letters: dict, kind: str, dtype: np.dtype | None, param: str, given: np.dtype) -> None:
    if dtype is not None and given != dtype:
        raise TypeError(f"Type is mismatched. {param} {given} {dtype}")
    if dtype is None and letters.setdefault(kind, given) != given:
        raise TypeError(f"Type is mismatched. {param} {given} {letters[kind]} {kind}")
