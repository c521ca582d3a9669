"""``shard(model, optimizer, stage=...)``: a torch module trained by the ZeRO engine.

One backward is one contribution: as autograd finishes each parameter's
gradient (``register_post_accumulate_grad_hook``) it is taken from ``.grad``
(zero-copy, as a NumPy or CuPy array) into this backward's gradient dict, and
``.grad`` is left None. ``step()`` hands this rank's dicts to the engine, which
averages over every contribution of every rank, updates and publishes. After
``last_backward()``, the next backward starts each group's reduction as soon as
autograd has finished its gradients (groups start in descending order, the
same on every rank). Until then the dicts are kept: one float32 gradient per
parameter and backward (see the README's memory note).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from functools import partial

import torch
from mpi4py import MPI

from mpizero.checkpoint import store
from mpizero.core.engine import StepResult, ZeroEngine
from mpizero.core.step import StepOrderError
from mpizero.torch.hooks import UnitHooks
from mpizero.torch.params import Binder
from mpizero.torch.tensors import as_array
from mpizero.torch.units import default_units, plan_units, trainable


def shard(
    model: torch.nn.Module,
    optimizer,
    *,
    stage: int = 2,
    comm: MPI.Comm | None = None,
    units: Sequence[torch.nn.Module] | None = None,
    **settings,
) -> ShardedModel:
    """Train ``model``'s parameters with ZeRO ``stage`` over ``comm`` (default COMM_WORLD).

    ``model`` must have the same parameters (names, shapes, values) on every
    rank. ``units``: the submodules gathered together at stage 3 (default:
    each child holding parameters). ``settings`` are the engine's
    (``reduction``, ``param_dtype``, ``clip_norm``, ``on_nonfinite``, ...).
    """
    return ShardedModel(model, optimizer, stage, comm, default_units(model) if units is None else list(units), settings)


class ShardedModel:
    """The engine behind a torch module: ``step()``, ``zero_grad()``, ``memory()``, ``save()``, ``load()``."""

    def __init__(self, model, optimizer, stage: int, comm, modules, settings: dict) -> None:
        self.model = model
        self.units = [u for u in plan_units(model, modules) if u.needed]
        self.params = trainable(model)
        owning = [u for u in self.units if u.owned]
        arrays = {name: as_array(p) for name, p in self.params.items()}
        groups = [list(u.owned) for u in owning]
        self.engine = ZeroEngine(arrays, optimizer, comm=comm, groups=groups, stage=stage, **settings)
        self.group_of = {name: g for g, u in enumerate(owning) for name in u.owned}
        self.binder = Binder(self.engine, self.params, next(iter(self.params.values())).device)
        self.hooks = None
        if self.binder.sharded:
            self.hooks = UnitHooks(model, self.units, self.group_of, self.binder, self._backward_started)
        for name, p in self.params.items():
            p.register_post_accumulate_grad_hook(partial(self._grad_ready, name))
        self.contributions: list[dict] = []  # this rank's finished backwards' gradients, this step
        self._current: dict = {}
        self._counted, self._in_backward, self._reduce_in_backward = True, False, False
        self._reset_progress()

    def _reset_progress(self) -> None:
        self._next = len(self.engine.groups) - 1  # the next group to start reducing (descending)
        self._missing = [set(g.layout.names) for g in self.engine.groups]

    # Backward -------------------------------------------------------------

    def _backward_started(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _grad_ready(self, name: str, param: torch.nn.Parameter) -> None:
        self._backward_started()
        grad, param.grad = param.grad, None
        if self._counted:
            self._current[name] = as_array(grad.contiguous())
        if self.hooks is not None:
            self.hooks.grad_ready(name)
        group = self.group_of[name]
        self._missing[group].discard(name)
        if self._reduce_in_backward:
            self._start_ready(self._reduced_contributions())

    def _reduced_contributions(self) -> list[dict]:
        return [*self.contributions, self._current] if self._counted else self.contributions

    def _start_ready(self, contributions: list[dict]) -> None:
        while self._next >= 0 and not self._missing[self._next]:
            self.engine.start_reduce(self._next, contributions)
            self._next -= 1

    def _backward_done(self) -> None:
        self._in_backward = self._reduce_in_backward = False
        if self.hooks is not None:
            self.hooks.backward_done()
        if self._current:
            self.contributions.append(self._current)
        self._current = {}
        self._missing = [set(g.layout.names) for g in self.engine.groups]

    def last_backward(self) -> None:
        """Say that the next backward is this step's last: each group's reduction starts as soon as it is done."""
        self._reduce_in_backward = True

    @contextlib.contextmanager
    def not_counted(self) -> Iterator[None]:
        """Run forward and backward passes whose gradients are dropped (stage 3: a rank with fewer micro-batches
        runs them so that every rank joins every gather)."""
        self._counted = False
        try:
            yield
        finally:
            self._counted = True

    # Step -----------------------------------------------------------------

    def step(self) -> StepResult:
        """Average every contribution of every rank, update, and publish (collective)."""
        if self._in_backward:
            raise StepOrderError("step() called during a backward pass; call it after loss.backward() returns")
        try:
            for index in range(self._next, -1, -1):
                self.engine.start_reduce(index, self.contributions)
            result = self.engine.finish_step()
        finally:
            self.contributions = []
            self._reset_progress()
        self.binder.refresh()
        return result

    def zero_grad(self) -> None:
        """Drop this rank's gradients not yet stepped with (``.grad`` is always None: gradients go to the engine)."""
        if self._next != len(self.engine.groups) - 1:
            raise StepOrderError("zero_grad() after last_backward()'s reductions started; call step() first")
        self.contributions, self._current = [], {}
        for p in self.params.values():
            p.grad = None

    # State ----------------------------------------------------------------

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds, by kind: the engine's, plus torch-side float32 copies and kept gradients."""
        held = self.engine.memory()
        held["torch_params"] = self.binder.torch_bytes()
        kept = [*self.contributions, self._current]
        held["kept_grads"] = sum(int(a.nbytes) for grads in kept for a in grads.values())
        return held

    def master_params(self) -> dict:
        """The full float32 master parameters by name, on every rank (collective)."""
        return self.engine.master_params()

    def save(self, directory: str, data: dict | None = None, keep: int | None = None) -> str:
        """Write a sharded checkpoint (collective, ``mpizero.checkpoint.store`` format); return its path.

        ``data``: JSON values of your own (a data position, a seed), returned by ``load`` as ``["data"]``.
        """
        state = {
            "data": dict(data or {}),
            "step": self.engine.step_count + self.engine.skipped_steps,
            "optimizer_steps": self.engine.step_count,
            "skipped_steps": self.engine.skipped_steps,
        }
        return store.save(self.engine, directory, state, keep)

    def load(self, path: str) -> dict:
        """Restore a checkpoint saved at any world size and stage (collective); return its training state."""
        state = store.load(self.engine, path)
        self.engine.step_count, self.engine.skipped_steps = state["optimizer_steps"], state["skipped_steps"]
        self.binder.refresh()
        return state
