"""Stage 3's module hooks: gather a unit's parameters before its forward and its backward, free them after.

Forward: the pre-hook acquires the unit's needed groups and prefetches the
next unit's (in the order the last forward ran them); the post-hook releases
them and, when autograd records, hooks the outputs so the unit's backward
acquires them again first (prefetching the unit before it). Backward: the unit
is released as soon as autograd has finished every parameter it owns, and
whatever is still held at the end of the backward is released then.
"""

from __future__ import annotations

from functools import partial

import torch

from mpizero.torch.units import Unit


class UnitHooks:
    """Acquire and release units' groups through a ``Binder`` around forward and backward."""

    def __init__(self, model: torch.nn.Module, units: list[Unit], group_of: dict[str, int], binder, on_backward):
        self.binder, self.on_backward = binder, on_backward
        self.needs = [sorted({group_of[n] for n in u.needed}) for u in units]
        self.owner = {name: u for u, unit in enumerate(units) for name in unit.owned}
        self.owned = [set(u.owned) for u in units]
        self.order = list(range(len(units)))  # the last forward's unit order: what prefetching follows
        self.seen: list[int] = []
        self.pending = [set(s) for s in self.owned]  # owned parameters autograd has not finished this backward
        self.backward_holds = [0] * len(units)
        model.register_forward_pre_hook(self._model_starts)
        model.register_forward_hook(self._model_ends)
        for u, unit in enumerate(units):
            unit.module.register_forward_pre_hook(partial(self._before_forward, u))
            unit.module.register_forward_hook(partial(self._after_forward, u))

    def _model_starts(self, module, args) -> None:
        self.seen = []

    def _model_ends(self, module, args, output) -> None:
        if self.seen:
            self.order = list(dict.fromkeys(self.seen))
        self.binder.drop_prefetched()

    def _acquire(self, u: int) -> None:
        for g in self.needs[u]:
            self.binder.acquire(g)

    def _release(self, u: int) -> None:
        for g in self.needs[u]:
            self.binder.release(g)

    def _prefetch(self, u: int, step: int) -> None:
        """Prefetch the unit ``step`` places from ``u`` in the last forward's order."""
        if u in self.order:
            at = self.order.index(u) + step
            if 0 <= at < len(self.order):
                for g in self.needs[self.order[at]]:
                    self.binder.prefetch(g)

    def _before_forward(self, u: int, module, args) -> None:
        self.seen.append(u)
        self._acquire(u)
        self._prefetch(u, +1)

    def _after_forward(self, u: int, module, args, output) -> None:
        self._release(u)
        if torch.is_grad_enabled():
            call = {"started": False}
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(partial(self._before_backward, u, call))

    def _before_backward(self, u: int, call: dict, grad) -> None:
        if call["started"]:
            return
        call["started"] = True
        self.on_backward()
        self._acquire(u)
        self.backward_holds[u] += 1
        self._prefetch(u, -1)

    def grad_ready(self, name: str) -> None:
        """Autograd finished ``name``: release its unit once every parameter it owns is finished."""
        u = self.owner[name]
        self.pending[u].discard(name)
        if not self.pending[u]:
            self._release_backward(u)

    def _release_backward(self, u: int) -> None:
        for _ in range(self.backward_holds[u]):
            self._release(u)
        self.backward_holds[u] = 0

    def backward_done(self) -> None:
        """End of a backward: release every unit still held, drop unused prefetches, reset."""
        for u in range(len(self.needs)):
            self._release_backward(u)
        self.binder.drop_prefetched()
        self.pending = [set(s) for s in self.owned]


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
