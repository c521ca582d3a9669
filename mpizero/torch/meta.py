"""Models built on the meta device: each rank makes the values it keeps, one unit at a time.

As FSDP2 does with ``to_empty()`` and ``reset_parameters()``: every rank runs
every module's initialization, children before their parent (the order in which
torch modules' constructors run them), on real memory for that module's own
tensors only. The engine asks, group by group, for the pieces this rank holds
(``ShardedInit``); a unit's values are dropped once the engine has moved past
its group. Running every initialization on every rank keeps torch's random
generator in step across ranks, and with a model built normally from the same
seed, so the values equal that model's wherever its modules initialize
themselves through ``reset_parameters()``.

Frozen parameters and buffers, which every rank holds whole, stay materialized.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from mpizero.arrays import device_of
from mpizero.core.sharded_init import ShardedInit
from mpizero.torch.tensors import as_array
from mpizero.torch.units import trainable

Initializer = Callable[[torch.nn.Module], None]


def reset(module: torch.nn.Module) -> None:
    """The default initializer: the module's own ``reset_parameters()``, where it has one."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def is_meta_model(params: dict) -> bool:
    """Whether the trainable parameters are on the meta device (all of them, or the model is refused)."""
    on_meta = [name for name, p in params.items() if p.is_meta]
    if on_meta and len(on_meta) != len(params):
        elsewhere = [name for name in params if name not in on_meta]
        raise ValueError(f"parameters {elsewhere[:3]} are not on the meta device while {on_meta[:3]} are")
    return bool(on_meta)


class MetaInit:
    """Materialize a meta-device model module by module; hand the engine the values it asks for.

    Made before anything else touches the model: it swaps every meta parameter for an empty CPU one (the same
    object wherever the parameter is shared, so ties hold), since torch cannot move a meta tensor's data.
    """

    def __init__(self, model: torch.nn.Module, group_of: dict[str, int], init: Initializer | None):
        self.group_of = group_of
        self.init = init or reset
        self.order = _children_first(model)
        self.done = 0
        self.values: dict[str, torch.Tensor] = {}
        self.captured: set[str] = set()  # a tied parameter keeps its first initialization, as tying after it does
        self.full_shape: dict[int, tuple[torch.Size, torch.dtype]] = {}
        swapped: dict[int, torch.nn.Parameter] = {}
        for module in self.order:
            for key, p in module._parameters.items():
                if p is not None and p.is_meta:
                    if id(p) not in swapped:
                        swapped[id(p)] = torch.nn.Parameter(torch.empty(0, dtype=p.dtype), p.requires_grad)
                        self.full_shape[id(swapped[id(p)])] = (p.shape, p.dtype)
                    module._parameters[key] = swapped[id(p)]
        self.params = trainable(model)
        self.canonical = {id(p): name for name, p in self.params.items()}
        if init is None:
            covered = {id(p) for m in self.order if hasattr(m, "reset_parameters") for p in m.parameters(recurse=False)}
            left = [name for name, p in self.params.items() if id(p) not in covered]
            if left:
                raise ValueError(
                    f"meta-device parameters {left[:5]} belong to no module with reset_parameters(), so nothing "
                    "would initialize them: pass init=fn to shard(), where fn(module) initializes a module's "
                    "own parameters"
                )

    def sharded_init(self) -> ShardedInit:
        """The engine's initializer; its identity includes torch's random state, which ranks must share."""
        state = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=8).hexdigest()
        how = getattr(self.init, "__qualname__", repr(self.init))
        shapes = {name: tuple(self.full_shape[id(p)][0]) for name, p in self.params.items()}
        described = f"meta-device torch model, {how}, torch random state {state}"
        return ShardedInit(shapes, self.fill, described, device_of(as_array(torch.empty(0))))  # where CPU tensors go

    def fill(self, name: str, start: int, stop: int):
        """Elements ``[start, stop)`` of ``name``; drop the values of groups the engine has moved past."""
        group = self.group_of[name]
        for done in [n for n in self.values if self.group_of[n] < group]:
            del self.values[done]
        while name not in self.values:
            self._initialize_next()
        return as_array(self.values[name].reshape(-1)[start:stop])

    def finish(self) -> None:
        """Run the initializations left (every rank ends with the same random state); drop every value."""
        while self.done < len(self.order):
            self._initialize_next()
        self.values.clear()

    def _initialize_next(self) -> None:
        """Initialize the next module on real memory; keep its trainable parameters' values, free their memory."""
        module = self.order[self.done]
        self.done += 1
        for p in module._parameters.values():
            if p is not None and id(p) in self.full_shape and (id(p) in self.canonical or p.numel() == 0):
                shape, dtype = self.full_shape[id(p)]
                p.data = torch.empty(shape, dtype=dtype)
        for key, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[key] = torch.empty_like(b, device="cpu")
        with torch.no_grad():
            self.init(module)
        for p in module._parameters.values():
            name = None if p is None else self.canonical.get(id(p))
            if name is None:
                continue
            if name not in self.captured:
                self.values[name] = p.detach().clone()
                self.captured.add(name)
            p.data = torch.empty(0)


def _children_first(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module once, each after its children (the order constructors initialize them in)."""
    seen, order = set(), []

    def visit(module):
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        order.append(module)

    visit(model)
    return order
