"""Stage 3's module hooks: gather a unit's parameters before its forward and its backward, free them after.

Forward: the pre-hook acquires the unit's needed groups and prefetches the
next unit's (in the order the last forward ran them); the post-hook releases
them and, when autograd records, hooks the outputs so the unit's backward
acquires them again first (prefetching the unit before it). Backward: the unit
is released as soon as autograd has finished every parameter it owns, and
whatever is still held at the end of the backward is released then.

Activation checkpointing runs a unit's forward again inside the backward (``torch.utils.checkpoint``, either
``use_reentrant``): that recompute's gathers are held as the backward's (``recomputing``), released when the unit's
gradients are finished, since a non-reentrant recompute stops as soon as it has what the backward needs, so its
forward post-hook may never run.

Every other module holding trainable parameters is a lazy unit: called while
its groups are held (inside its unit's forward) its hooks do nothing; called on
its own (a tied ``lm_head`` outside the model's forward) it gathers its groups
for its forward and its backward as a unit does. Every hook is left out of
``torch.compile``'s graphs (a graph break at each unit), since it talks to MPI;
so a model compiled whole fuses otherwise than at stages 0-2, which a warning
says once (``compiled_across_units``).
"""

from __future__ import annotations

import sys
import warnings
from functools import partial

import torch

from mpizero.torch.sync import Operation
from mpizero.torch.units import Unit

COMPILED_WHOLE = (
    "torch.compile compiled this model across its stage 3 units, and stage 3 breaks the graph at each unit, so "
    "inductor fuses otherwise than at stages 0-2 and the bytes differ from theirs (they are the same at any world "
    "size): compile each repeated block instead (`block.compile()`) for one digest at every stage"
)


def compiled_across_units(module: torch.nn.Module) -> bool:
    """Whether ``module`` (a unit, in its pre-forward hook) runs inside another module's call that torch.compile
    compiled (its entry, ``compile_wrapper`` in torch 2.x, is on the stack above that module's call): an ancestor
    was compiled as a whole. Where torch names its entry otherwise, nothing is found and nothing said."""
    frame, inside_another = sys._getframe(1), False
    while frame is not None:
        name = frame.f_code.co_name
        if name == "compile_wrapper":
            return inside_another
        caller = frame.f_locals.get("self") if name in ("_call_impl", "forward") else None
        inside_another |= isinstance(caller, torch.nn.Module) and caller is not module
        frame = frame.f_back
    return False


class UnitHooks:
    """Acquire and release units' groups through a ``Binder`` around forward and backward."""

    def __init__(
        self, model: torch.nn.Module, units: list[Unit], group_of: dict[str, int], binder, on_backward, around
    ):
        """``around(hook)``: the hook as torch must call it (on its current stream: ``streams.TorchStream``)."""
        self.binder, self.on_backward, self.around = binder, on_backward, around
        lazy = _lazy_units(model, units, group_of)
        self.needs = [sorted({group_of[n] for n in u.needed}) for u in units] + [needs for _, needs in lazy]
        self.lazy = [False] * len(units) + [True] * len(lazy)
        self.owner = {name: u for u, unit in enumerate(units) for name in unit.owned}
        self.owned = [set(u.owned) for u in units] + [set() for _ in lazy]
        self.order = list(range(len(units)))  # the last forward's unit order: what prefetching follows
        self.seen: list[int] = []
        self.pending = [set(s) for s in self.owned]  # owned parameters autograd has not finished this backward
        self.backward_holds = [0] * len(self.needs)
        self.acquired: list[bool] = []  # for each lazy unit's forward in progress: whether it gathered
        self.warned = False  # whether COMPILED_WHOLE was said
        self.root, self.look_for_compile = model, False  # whether this model forward's first unit is to come
        model.register_forward_pre_hook(outside_graphs(self._model_starts))  # it does not reach the engine
        model.register_forward_hook(outside_graphs(around(self._model_ends)))
        modules = [unit.module for unit in units] + [module for module, _ in lazy]
        for u, module in enumerate(modules):
            module.register_forward_pre_hook(outside_graphs(around(partial(self._before_forward, u))))
            module.register_forward_hook(outside_graphs(around(partial(self._after_forward, u))))

    def _model_starts(self, module, args) -> None:
        self.seen = []
        self.look_for_compile = not self.warned

    def _model_ends(self, module, args, output) -> None:
        if self.seen:
            self.order = list(dict.fromkeys(self.seen))
        self.binder.end_prefetches()

    def _acquire(self, u: int, gather: Operation = Operation.GATHER) -> None:
        for g in self.needs[u]:
            self.binder.acquire(g, gather)

    def _release(self, u: int) -> None:
        for g in self.needs[u]:
            self.binder.release(g)

    def _prefetch(self, u: int, step: int, gather: Operation = Operation.GATHER) -> None:
        """Prefetch the unit ``step`` places from ``u`` in the last forward's order."""
        if u in self.order:
            at = self.order.index(u) + step
            if 0 <= at < len(self.order):
                for g in self.needs[self.order[at]]:
                    self.binder.prefetch(g, gather)

    def _before_forward(self, u: int, module, args) -> None:
        gather = Operation.GATHER if torch.is_grad_enabled() else Operation.EVAL_GATHER  # told apart: see sync
        if recomputing():  # held as the backward's: the post-hook may never run
            self._acquire(u)
            self.backward_holds[u] += 1
            return
        if self.lazy[u]:
            needed = any(self.binder.holders[g] == 0 for g in self.needs[u])
            self.acquired.append(needed)
            if needed:
                self._acquire(u, gather)
            return
        if self.look_for_compile and module is not self.root:  # the forward's first unit inside the model
            self.look_for_compile = False
            if compiled_across_units(module):
                self.warned = True
                warnings.warn(COMPILED_WHOLE, stacklevel=2)
        self.seen.append(u)
        self._acquire(u, gather)
        self._prefetch(u, +1, gather)

    def _after_forward(self, u: int, module, args, output) -> None:
        if recomputing():
            if not self.lazy[u]:
                self._hook_backward(u, output)  # a reentrant recompute's backward runs through these outputs
            return
        if self.lazy[u] and not self.acquired.pop():
            return
        self._release(u)
        self._hook_backward(u, output)

    def _hook_backward(self, u: int, output) -> None:
        """Where autograd records, make the unit's backward acquire its groups first (``_before_backward``)."""
        if torch.is_grad_enabled():
            call = {"started": False}
            for tensor in output_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self.around(partial(self._before_backward, u, call)))

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
        self.binder.end_prefetches()
        self.pending = [set(s) for s in self.owned]


def _lazy_units(model: torch.nn.Module, units: list[Unit], group_of: dict[str, int]) -> list[tuple]:
    """Every module outside ``units`` holding trainable parameters itself, with the groups those are in."""
    canonical = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    chosen = {id(unit.module) for unit in units}
    lazy = []
    for module in model.modules():
        names = {canonical[id(p)] for p in module.parameters(recurse=False) if id(p) in canonical}
        if names and id(module) not in chosen:
            lazy.append((module, sorted({group_of[n] for n in names})))
    return lazy


def recomputing() -> bool:
    """Whether a module's forward runs inside autograd's backward: activation checkpointing's recompute."""
    return torch._C._current_graph_task_id() != -1


def outside_graphs(hook):
    """``hook`` run eagerly, not traced, under ``torch.compile`` (a graph break where it is called)."""
    return torch.compiler.disable(hook, recursive=True)


def output_tensors(value) -> list[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in output_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in output_tensors(v)]
    return []
