"""Full state dicts of a sharded torch module: what ``model.state_dict()`` would give unsharded, and back.

Trainable parameters come from the engine's float32 masters (gathered one
group at a time); frozen parameters and buffers, which every rank holds whole,
from the module. Tied parameters appear under each of their names, as in
``model.state_dict()``. Values are CPU tensors, so the dict saves with
``torch.save`` and loads into a plain torch model.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
import torch

from mpizero.arrays import to_host
from mpizero.comm import agree
from mpizero.torch.tensors import as_array


def full_state_dict(zero, to_all_ranks: bool) -> dict | None:
    """The module's full state dict on rank 0 (None elsewhere), or on every rank (collective)."""
    local = zero.model.state_dict(keep_vars=True)
    canonical = {id(p): name for name, p in zero.params.items()}
    masters: dict[str, np.ndarray] = {}
    for index in range(len(zero.engine.groups)):
        group = zero.engine.state_group(index, "master")
        if to_all_ranks or zero.engine.comm.Get_rank() == 0:
            masters.update(group)
    if not (to_all_ranks or zero.engine.comm.Get_rank() == 0):
        return None
    result = OrderedDict()
    result._metadata = getattr(local, "_metadata", None)
    for key, value in local.items():
        name = canonical.get(id(value))
        result[key] = torch.from_numpy(masters[name]) if name else value.detach().to("cpu", copy=True)
    return result


def load_full_state_dict(zero, state_dict) -> None:
    """Load a full state dict (the same on every rank) into the masters, frozen parameters and buffers."""
    expected = zero.model.state_dict(keep_vars=True)
    canonical = {id(p): name for name, p in zero.params.items()}
    shapes = zero.engine.tensor_shapes()
    full_shapes = {
        key: shapes[canonical[id(v)]] if id(v) in canonical else tuple(v.shape) for key, v in expected.items()
    }
    problem = _problem(state_dict, expected, full_shapes)
    agree.raise_if_any(zero.engine.collectives, problem, "load_state_dict")
    tensors = (state_dict[key] for key in sorted(state_dict))
    agree.raise_unless_equal(zero.engine.collectives, {"the state dict's values": digest(tensors)})
    key_of = {}
    for key, value in expected.items():
        key_of.setdefault(canonical.get(id(value)), key)
    for index, group in enumerate(zero.engine.groups):
        zero.engine.set_state(index, "master", {n: _host32(state_dict[key_of[n]]) for n in group.layout.names})
    with torch.no_grad():
        for key, value in expected.items():
            if id(value) not in canonical:
                value.copy_(state_dict[key])
    zero.engine.publish()
    zero.edits.loaded()
    zero.show_masters()


def write_back(zero) -> None:
    """Set the masters from the full parameters the module shows (inside ``gathered``), the same on every rank."""
    tensors = [zero.binder.full_tensors(index) for index in range(len(zero.engine.groups))]
    shown = (t for group in tensors for t in group.values())
    agree.raise_unless_equal(zero.engine.collectives, {"the parameters after gathered(writeback=True)": digest(shown)})
    for index, group in enumerate(tensors):
        zero.engine.set_state(index, "master", {name: to_host(as_array(t)) for name, t in group.items()})


def _problem(state_dict, expected, full_shapes: dict) -> str | None:
    """What keeps ``state_dict`` from loading into this module (None when nothing does)."""
    if not hasattr(state_dict, "keys"):
        return f"a state dict must be a dict of tensors, got {type(state_dict).__name__}"
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        return f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}"
    for key, shape in full_shapes.items():
        given = state_dict[key]
        if not isinstance(given, torch.Tensor):
            return f"{key!r} is a {type(given).__name__}, not a tensor"
        if tuple(given.shape) != shape:
            return f"{key!r} has shape {list(given.shape)}, the model's is {list(shape)}"
    tied: dict[int, list[str]] = {}
    for key, value in expected.items():
        tied.setdefault(id(value), []).append(key)
    for keys in tied.values():
        for other in keys[1:]:
            if not torch.equal(state_dict[keys[0]], state_dict[other]):
                return f"{keys[0]!r} and {other!r} are tied in the model but differ in the state dict"
    return None


def _host32(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32).contiguous().numpy()


def digest(tensors) -> str:
    """A digest of the tensors' bytes, so ranks can check they hold the same values."""
    h = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        h.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def averaged_grads(zero) -> dict[str, torch.Tensor]:
    """A copy of each trainable parameter's averaged gradient, gathered, by name (collective)."""
    grads = {}
    for index in range(len(zero.engine.groups)):
        for name, full in zero.engine.state_group(index, "grad").items():
            grads[name] = torch.from_numpy(full).to(zero.params[name].device)
    return grads


def show_grads(zero) -> None:
    """Set each trainable parameter's ``.grad`` to a copy of its averaged gradient, gathered (collective)."""
    for name, grad in averaged_grads(zero).items():
        zero.params[name].grad = grad
