"""What every rank checks and agrees on before the engine's first data collective.

The parameters are checked at the door (``params_problem``); then every rank's
set-up signature, field by field, must equal rank 0's (``setup_signature``):
same tensors, groups, settings, communication paths, optimizer, checkpoint key
(compared by a salted digest: ``checkpoint_key``) and initial values. Full arrays exist on
every rank, so their values are hashed whole; a ``ShardedInit`` holds no
values, so its ``identity`` stands for them (the engine then digests the
shards each rank made: ``digest``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from math import prod

import numpy as np

from mpizero import checkpoint_key
from mpizero.arrays import device_module, to_host
from mpizero.core.sharded_init import ShardedInit
from mpizero.errors import ZeroError

PARAM_DTYPE = np.dtype(np.float32)


def params_problem(params: Mapping | ShardedInit, group_names) -> str | None:
    """What is wrong with the parameters or their grouping on this rank (None when nothing is)."""
    if isinstance(params, ShardedInit):
        return _groups_problem(list(params.shapes), group_names) or _device_problem(params.device)
    if not isinstance(params, Mapping) or not params:
        return "params must be a non-empty dict of arrays, or a ShardedInit"
    problem = _groups_problem(list(params), group_names)
    if problem is not None:
        return problem
    for name, a in params.items():
        if getattr(a, "dtype", None) != PARAM_DTYPE:
            return f"parameter {name!r} must be float32, got {getattr(a, 'dtype', type(a).__name__)}"
        if a.size == 0:
            return f"parameter {name!r} has no elements (shape {tuple(a.shape)})"
    return None


def _groups_problem(names: list[str], group_names) -> str | None:
    listed = [n for group in group_names for n in group]
    if sorted(listed) != sorted(names):
        return f"groups must list every parameter exactly once, got {listed} for {names}"
    return None


def _device_problem(device: str) -> str | None:
    try:
        device_module(device)
    except ZeroError as error:
        return str(error)
    return None


def setup_signature(params: Mapping | ShardedInit, group_names, config, collectives, optimizer: str) -> dict:
    """The fields every rank must agree on, by the name an error shows (collective: the key's salt)."""
    if isinstance(params, ShardedInit):
        shapes, dtypes = params.shapes, (str(PARAM_DTYPE),) * len(params.shapes)
        values = {"the initializer": params.identity}
    else:
        shapes, dtypes = {n: tuple(a.shape) for n, a in params.items()}, tuple(str(a.dtype) for a in params.values())
        values = {"the initial parameter values": _digest(params)}
    return {
        "the parameter count": sum(prod(shape) for shape in shapes.values()),
        "the parameter names": tuple(shapes),
        "the parameter shapes": tuple(shapes.values()),
        "the parameter dtypes": dtypes,
        "the groups": tuple(map(tuple, group_names)),
        "the settings": settings(config),
        "the communication paths": collectives.paths,
        "the optimizer": optimizer,
        "the checkpoint key": checkpoint_key.compared(collectives),
        **values,
    }


def settings(config) -> dict:
    """``config``'s fields as every rank must agree on them: an offload's directory is each rank's own."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {**fields, "offload": type(config.offload).__name__ if config.offload else None}


def _digest(params: Mapping) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in params.values():
        h.update(np.ascontiguousarray(to_host(a)).tobytes())
    return h.hexdigest()
