"""The trained model read out one unit at a time, so that evaluating or saving it never holds the whole model.

``unit_masters`` walks the model's units in order and yields each unit's full
fp32 master params, gathering an engine group when the first unit that needs it
comes and dropping it after the last. Every rank walks every unit (each gather
is a collective); a rank that does not use the values still takes them and
lets them go (``drain``). At stage 3 a rank then holds at most one group's full
master besides its shards. ``save_flat`` writes ``train --save-params`` so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import numpy as np

from mpizero import files
from mpizero.training.trainer import groups_of_units


def unit_masters(engine, units: list) -> Iterator[dict]:
    """Yield each unit's full fp32 master params by name, in model order (collective: every rank walks all)."""
    owners = groups_of_units(units, engine.groups)
    last_user = {g: u for u, groups in enumerate(owners) for g in groups}
    held: dict[int, dict] = {}
    for u, unit in enumerate(units):
        for g in owners[u]:
            if g not in held:
                held[g] = engine.state_group(g, "master")
        values = {name: tensor for g in owners[u] for name, tensor in held[g].items()}
        yield {name: values[name] for name in unit.param_shapes()}
        for g in owners[u]:
            if last_user[g] == u:
                del held[g]


def forward(units: list, x, params_by_unit: Iterable[dict]):
    """Run ``x`` through every unit, each with its own params (one unit's at a time); return the output."""
    out = x
    for unit, params in zip(units, params_by_unit, strict=True):
        out, _ = unit.forward(out, params)
    return out


def drain(walk: Iterator) -> None:
    """Finish a walk this rank does not use (or stopped using), so it joins every collective left in it."""
    for _ in walk:
        pass


def save_flat(path: str, engine, units: list, writes: bool) -> None:
    """Write the fp32 master params in model order as one flat float32 ``.npy`` (on the rank that ``writes``),
    gathered unit by unit (collective: every rank walks every unit, even after a failed write)."""
    walk = unit_masters(engine, units)
    try:
        if writes:
            numel = sum(math.prod(shape) for unit in units for shape in unit.param_shapes().values())
            tensors = (tensor for params in walk for tensor in params.values())
            files.write(path, lambda f: write_flat(f, numel, tensors))
    finally:
        drain(walk)


def write_flat(f, numel: int, tensors: Iterable) -> None:
    """Write ``numel`` float32 values, given tensor by tensor, as the bytes ``np.save`` makes of their concatenation."""
    np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (numel,)})
    for tensor in tensors:
        f.write(np.ascontiguousarray(tensor, dtype="<f4").tobytes())
