"""A torch optimizer trained through the engine: any ``core.optim.optimizers`` lists, its groups read at every step.

The optimizer the user built stays theirs. Its ``param_groups`` (learning rate,
betas, weight decay, as a scheduler sets them) are what the engine reads at
every step (``TorchOptimizer`` names each group's tensors by their canonical
names); the engine applies the listed optimizer that stands for its class (``core.optim.optimizers``,
``torch_classes``) to its shards.
``attach`` makes the object's own methods the sharded model's: ``step()``
takes the step, ``zero_grad()`` drops gradients, ``state_dict()`` and
``load_state_dict()`` move the whole optimizer state in torch's format, and a
learning-rate scheduler built on it, before or after ``shard``, sees its steps.
"""

from __future__ import annotations

import functools
import importlib
import types

import torch

from mpizero.core.optim import OPTIMIZERS


@functools.cache
def supported() -> dict:
    """Each torch optimizer class a listed optimizer stands for (``torch_classes``), where its module imports
    here, and that optimizer."""
    found = {}
    for optimizer in OPTIMIZERS.values():
        for qualified in optimizer.torch_classes:
            module, _, name = qualified.rpartition(".")
            try:
                found[getattr(importlib.import_module(module), name)] = optimizer
            except (ImportError, AttributeError):
                continue  # an optional package (or a torch) without it: nothing of it to train
    return found


def is_torch_optimizer(optimizer) -> bool:
    return isinstance(optimizer, torch.optim.Optimizer)


class TorchOptimizer:
    """The engine's view of a ``torch.optim`` optimizer: its rule, and its parameter groups by tensor name."""

    def __init__(self, optimizer: torch.optim.Optimizer, canonical: dict[int, str]) -> None:
        self.torch, self.canonical = optimizer, canonical
        self.type_name = type(optimizer).__name__
        self.kind = supported().get(type(optimizer), OPTIMIZERS["sgd"])  # unsupported: refused at the first read
        self.rule = self.kind.rule
        self.problem = _problem(optimizer, canonical)

    @property
    def param_groups(self) -> list[dict]:
        """The torch optimizer's groups as they are now, each ``params`` as canonical tensor names."""
        if self.problem is not None:
            raise ValueError(self.problem)
        for index, group in enumerate(self.torch.param_groups):
            unknown = next((p for p in group["params"] if id(p) not in self.canonical), None)
            if unknown is not None:
                raise ValueError(
                    f"parameter group {index} holds a tensor of shape {list(unknown.shape)} that was no trainable "
                    f"parameter of the model when it was sharded (added by add_param_group(), or unfrozen, after "
                    f"shard()): {FIXED_AT_SHARD}"
                )
        return [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [self.canonical[id(p)] for p in group["params"]],
            }
            for group in self.torch.param_groups
        ]


FIXED_AT_SHARD = (
    "a sharded model's trainable parameters and its optimizer's groups are fixed when it is sharded: set "
    "requires_grad and give the optimizer every parameter group before shard()"
)


def _problem(optimizer, canonical: dict[int, str]) -> str | None:
    """What keeps ``optimizer`` from training these parameters through the engine (None when nothing does)."""
    if type(optimizer) not in supported():
        torch_names = ", ".join(name for kind in OPTIMIZERS.values() for name in kind.torch_classes)
        own = ", ".join(kind.__name__ for kind in OPTIMIZERS.values())
        return (
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__} is not supported: the engine runs "
            f"{torch_names} (their exact classes, where installed), or mpizero's own {own}"
        )
    refusal = supported()[type(optimizer)].torch_refusal(optimizer)
    if refusal is not None:
        return refusal
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in canonical:
                return (
                    f"parameter group {index} holds a tensor of shape {list(p.shape)} that is not a trainable "
                    "parameter of the model (frozen, or another model's): build the optimizer on the model's "
                    "trainable parameters"
                )
    return None


def attach(optimizer: torch.optim.Optimizer, zero) -> None:
    """Make ``optimizer``'s ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` the sharded model's.

    ``step`` carries the mark torch's schedulers put on a step they track, and sets the flag they read, so a
    scheduler works whether it was built before ``shard`` or after.
    """

    def step(self, closure=None):
        self._opt_called = True  # what a scheduler's own wrapper would set
        return zero.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero.zero_grad()

    def state_dict(self) -> dict:
        return zero.optimizer_state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        zero.load_optimizer_state_dict(state_dict)

    step._wrapped_by_lr_sched = True
    for method in (step, zero_grad, state_dict, load_state_dict):
        setattr(optimizer, method.__name__, types.MethodType(method, optimizer))
