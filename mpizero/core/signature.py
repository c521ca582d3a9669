"""What every rank checks and agrees on before the engine's first data collective.

The parameters are checked at the door (``params_problem``); then every rank's
set-up signature, field by field, must equal rank 0's (``setup_signature``):
same tensors, groups, settings, communication paths, optimizer and initial values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

from mpizero.core.arrays import to_host

PARAM_DTYPE = np.dtype(np.float32)


def params_problem(params: Mapping, group_names) -> str | None:
    """What is wrong with the parameters or their grouping on this rank (None when nothing is)."""
    if not isinstance(params, Mapping) or not params:
        return "params must be a non-empty dict of arrays"
    listed = [n for names in group_names for n in names]
    if sorted(listed) != sorted(params):
        return f"groups must list every parameter exactly once, got {listed} for {list(params)}"
    for name, a in params.items():
        if getattr(a, "dtype", None) != PARAM_DTYPE:
            return f"parameter {name!r} must be float32, got {getattr(a, 'dtype', type(a).__name__)}"
        if a.size == 0:
            return f"parameter {name!r} has no elements (shape {tuple(a.shape)})"
    return None


def setup_signature(params: Mapping, group_names, config, paths, optimizer) -> dict:
    """The fields every rank must agree on, by the name an error shows."""
    return {
        "the parameter count": sum(int(a.size) for a in params.values()),
        "the parameter names": tuple(params),
        "the parameter shapes": tuple(tuple(a.shape) for a in params.values()),
        "the parameter dtypes": tuple(str(a.dtype) for a in params.values()),
        "the groups": tuple(map(tuple, group_names)),
        "the settings": config,
        "the communication paths": paths,
        "the optimizer": repr(optimizer),
        "the initial parameter values": _digest(params),
    }


def _digest(params: Mapping) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in params.values():
        h.update(np.ascontiguousarray(to_host(a)).tobytes())
    return h.hexdigest()
