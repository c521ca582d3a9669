"""What a sharded model's ``p.grad`` holds: the averaged gradient, or a loud error; never a silent ``None``.

Autograd's gradients go straight into the engine (``grads``), so no ``.grad`` keeps one. Instead, from each
backward until ``zero_grad()``, every trainable parameter's ``.grad`` is its guard, so the usual
``if p.grad is not None: total += p.grad.norm() ** 2`` reads a gradient or fails, naming the way.

Glossary:

- guard: the tensor in a parameter's ``.grad`` while its gradient lives in the engine: the parameter's
  shape, dtype and device over one element of storage (``expand``), so ``p.grad is not None`` and
  ``p.grad.shape`` answer as in torch. Using its values asks the ``GradView``; writing into it raises
  (the engine's gradients change only through ``clip_grad_norm_``).
- readable: where every rank can have the whole averaged gradient (stages 0-1, the plan's
  ``keeps_local_grads``). The first use of a guard's values reduces the step's gradients and gathers
  the averaged ones for every parameter (collective and announced, as ``clip_grad_norm_`` is: every rank
  reads, or every rank gets one error); later uses take the same ones until the gradients change (a
  backward, clipping, ``step()``, ``zero_grad()``). Elsewhere (stages 2-3) a use raises, naming
  ``zero.gathered(grads=True)``, which shows them there.
- stepped: after ``step()`` the gradients are spent; a use raises at every stage.

A tensor hook on each parameter drops its guard before autograd accumulates into ``.grad``, so the next
backward starts from ``None`` as torch's own does after ``zero_grad()``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial

import torch
from torch.utils._pytree import tree_map_only

from mpizero.errors import ZeroError

WRITES_IN_PLACE = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__", "__imatmul__"}
METADATA = {
    *(getattr(torch.Tensor, name).__get__ for name in ("shape", "dtype", "device", "layout", "ndim", "is_sparse")),
    *(getattr(torch.Tensor, name).__get__ for name in ("requires_grad", "grad_fn", "is_leaf", "is_cuda")),
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.is_floating_point,
    torch.Tensor.__hash__,
    torch.Tensor.__len__,
}


class GradGuard(torch.Tensor):
    """A parameter's ``.grad`` while its gradient lives in the engine (see the glossary)."""

    owner: weakref.ref  # the GradView; weakly, as ``.grad`` lives in C++ where the collector cannot see cycles
    param_name: str  # the parameter's canonical name (not ``view``/``name``: tensors have those)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.data.__get__:
            return args[0]  # ``p.grad.data`` is the guard too: reads work, writes raise
        name = getattr(func, "__name__", "")
        if "out" in kwargs or name in WRITES_IN_PLACE or (name.endswith("_") and not name.endswith("__")):
            raise ZeroError(
                f"p.grad.{name}(...) on a sharded model: its gradients live in the engine, and writing into .grad "
                "changes nothing there; clip with torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)"
            )
        args, kwargs = tree_map_only(GradGuard, lambda guard: guard.value(), (args, kwargs))
        return func(*args, **kwargs)

    def value(self) -> torch.Tensor:
        """The averaged gradient this guard stands for (collective on the first use of a step), or raise."""
        view = self.owner()
        if view is None:
            raise ZeroError(f"the gradient of {self.param_name!r}: its sharded model is gone")
        return view.value_of(self.param_name)


class GradView:
    """Each trainable parameter's ``.grad`` of one sharded model: its guard, or ``None``."""

    def __init__(self, params: dict[str, torch.nn.Parameter], readable: bool, averaged: Callable[[], dict]) -> None:
        """``averaged``: reduce the step's gradients and return the averaged ones by name (collective)."""
        self.params, self.readable, self.averaged = params, readable, averaged
        self.stepped = False
        self.shown: dict[str, torch.Tensor] | None = None  # the averaged gradients, once used, until they change
        self.guards: dict[str, tuple[tuple, GradGuard]] = {}  # each parameter's guard, by what it was made for
        for p in params.values():
            p.register_hook(partial(_drop_guard, weakref.ref(p)))

    def guard(self, stepped: bool = False) -> None:
        """Put each parameter's guard in its ``.grad``: after a backward, ``gathered(grads=True)`` or ``step()``."""
        self.stepped, self.shown = stepped, None
        for name, p in self.params.items():
            made_for = (p.shape, p.dtype, p.device)  # stage 3's placeholders and full views differ in shape
            if self.guards.get(name, (None,))[0] != made_for:
                self.guards[name] = (made_for, self._new_guard(name, p))
            p.grad = self.guards[name][1]

    def clear(self) -> None:
        """Set every ``.grad`` to ``None`` (``zero_grad()``)."""
        self.shown = None
        for p in self.params.values():
            p.grad = None

    def changed(self) -> None:
        """The gradients changed in the engine (clipped): the next use gathers them again."""
        self.shown = None

    def value_of(self, name: str) -> torch.Tensor:
        """Parameter ``name``'s averaged gradient, or raise naming where gradients can be read."""
        if self.stepped:
            raise ZeroError(
                f"p.grad of {name!r} after step(): the step used and dropped the gradients; read them between the "
                "last backward and step() (at stages 2-3 inside `with zero.gathered(grads=True):`)"
            )
        if not self.readable:
            raise ZeroError(
                f"p.grad of {name!r} outside zero.gathered(grads=True): at stages 2-3 each rank holds only a shard "
                "of the averaged gradient; read them inside `with zero.gathered(grads=True):` (collective), or use "
                "the norm that clip_grad_norm_ returns"
            )
        if self.shown is None:
            self.shown = self.averaged()
        return self.shown[name]

    def _new_guard(self, name: str, p: torch.nn.Parameter) -> GradGuard:
        guard = torch.Tensor._make_subclass(GradGuard, torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape))
        guard.owner, guard.param_name = weakref.ref(self), name
        return guard


def _drop_guard(param_ref: weakref.ref, grad: torch.Tensor) -> None:
    """A parameter's tensor hook, before autograd accumulates its gradient: drop a guard from ``.grad``."""
    param = param_ref()
    if param is not None and isinstance(param.grad, GradGuard):
        param.grad = None
