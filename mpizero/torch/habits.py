"""torch habits on a sharded model: each works as on a plain model, or fails naming the mpizero way.

- ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on a sharded
  model clips through the engine (``zero.clip_grad_norm_``: the global norm,
  exact) and returns it as a tensor; over only some of the model's trainable
  parameters, or with ``clip_grad_value_``, it raises. Other parameters go to
  torch's own function, which is kept and called unchanged.
- ``model.state_dict()`` (and what calls it: ``torch.save(model.state_dict())``,
  transformers' ``save_pretrained``) at stage 3 holds the full float32 masters,
  gathered for the call: collective there, as FSDP's full state dict is. A
  submodule's ``state_dict()`` works the same way.
- ``model.load_state_dict(sd)`` loads into the masters on every rank
  (``zero.load_state_dict``), so nothing is lost when the next step publishes
  the masters again.
- ``model.zero_grad()`` drops the step's gradients, as ``zero.zero_grad()``
  (the gradients live in the engine's sums, not in ``.grad``); a submodule's,
  which would drop only some of them, raises naming the whole model's.
"""

from __future__ import annotations

import math
import types
import weakref

import torch

from mpizero.errors import ZeroError
from mpizero.torch.sync import Operation

_owners: dict[int, tuple] = {}  # id(trainable parameter) -> (weakref to it, weakref to its ShardedModel)
_torch_clip = torch.nn.utils.clip_grad_norm_
_torch_clip_value = torch.nn.utils.clip_grad_value_


def install(zero) -> None:
    """Route ``zero``'s model's habits through it (and torch's clipping functions, once per process)."""
    for p in zero.params.values():
        _owners[id(p)] = (weakref.ref(p), weakref.ref(zero))
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        module.clip_grad_norm_ = clip_grad_norm_
        module.clip_grad_value_ = clip_grad_value_
    if zero.binder.sharded:
        FullStateDicts(zero)
    zero.model.load_state_dict = types.MethodType(_load_state_dict(zero), zero.model)
    for module in zero.model.modules():
        if any(id(p) in _owners for p in module.parameters()):
            module.zero_grad = types.MethodType(_zero_grad(zero, whole=module is zero.model), module)


def _owner(parameters) -> tuple[list, object]:
    """The parameters as a list, and the one sharded model they belong to (None if none; raise if several)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = {id(z): z for z in map(owner_of, params) if z is not None}
    if len(owners) > 1:
        raise ZeroError("clipping over the parameters of several sharded models: clip each model on its own")
    return params, next(iter(owners.values()), None)


def owner_of(param):
    """The live ShardedModel ``param`` is a trainable parameter of, or None."""
    found = _owners.get(id(param))
    return found[1]() if found is not None and found[0]() is param else None


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``: through the engine for a sharded model's parameters, else torch's."""
    params, zero = _owner(parameters)
    if zero is None:
        return _torch_clip(params, max_norm, norm_type, error_if_nonfinite, foreach)
    given = {id(p) for p in params}
    left_out = [name for name, p in zero.params.items() if id(p) not in given]
    if left_out:
        raise ZeroError(
            f"clip_grad_norm_ over some of a sharded model's trainable parameters (not {left_out[:3]}): the engine "
            "clips by the norm over all of them; pass model.parameters()"
        )
    norm = zero.clip_grad_norm_(float(max_norm), float(norm_type))
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite")
    return torch.tensor(norm)


def clip_grad_value_(parameters, clip_value, foreach=None) -> None:
    """``torch.nn.utils.clip_grad_value_``: refused for a sharded model's parameters, else torch's."""
    params, zero = _owner(parameters)
    if zero is None:
        return _torch_clip_value(params, clip_value, foreach)
    raise ZeroError(
        "clip_grad_value_ on a sharded model: its gradients go straight into the engine's exact sum, so there is "
        "no per-element gradient to clip; clip the global norm with torch.nn.utils.clip_grad_norm_ instead"
    )


class FullStateDicts:
    """Stage 3: fill the outermost ``state_dict()`` call's entries of trainable parameters with the full masters."""

    def __init__(self, zero) -> None:
        self.zero = zero
        self.calls: list[bool] = []  # keep_vars of each state_dict() call in progress, outermost first
        for module in zero.model.modules():  # plain functions: torch marks the hooks it is given
            module.register_state_dict_pre_hook(lambda *args: self._before(*args))
            module.register_state_dict_post_hook(zero.torch_stream.around(lambda *args: self._after(*args)))

    def _before(self, module, prefix: str, keep_vars: bool) -> None:
        self.calls.append(keep_vars)

    def _after(self, module, state_dict, prefix: str, local_metadata) -> None:
        keep_vars = self.calls.pop()
        if self.calls or keep_vars:  # an inner call (the outermost fills everything), or Parameters asked for
            return
        canonical = {id(p): name for name, p in self.zero.params.items()}
        entries = {
            prefix + key: canonical[id(p)]
            for key, p in module.named_parameters(remove_duplicate=False)
            if id(p) in canonical
        }
        zero, wanted = self.zero, set(entries.values())
        zero.announcer.announce(Operation.STATE_DICT)
        masters = {}
        for index, group in enumerate(zero.engine.groups):
            if wanted & set(group.layout.names):
                masters.update(zero.engine.state_group(index, "master"))
        shared = {name: torch.from_numpy(masters[name]) for name in wanted}
        for key, name in entries.items():
            state_dict[key] = shared[name]  # tied names share one tensor, as in a plain model's state dict


def _zero_grad(zero, whole: bool):
    def zero_grad(self, set_to_none: bool = True) -> None:
        """``module.zero_grad()``: the step's gradients dropped (``zero.zero_grad``; collective if any were handed
        in), on the whole model only."""
        if not whole:
            raise ZeroError(
                "zero_grad() on a submodule of a sharded model: the step's gradients are summed in the engine by "
                "group, not per module; drop them all with model.zero_grad() or optimizer.zero_grad()"
            )
        zero.zero_grad()

    return zero_grad


def _load_state_dict(zero):
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``model.load_state_dict``: into the masters, frozen parameters and buffers on every rank (collective)."""
        if not strict or assign:
            raise ZeroError(
                "load_state_dict(strict=False) or assign=True on a sharded model: every rank loads the full state "
                "dict into the masters; pass the whole state dict with strict=True"
            )
        zero.load_state_dict(state_dict)
        return torch.nn.modules.module._IncompatibleKeys([], [])

    return load_state_dict
