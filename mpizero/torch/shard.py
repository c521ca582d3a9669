"""``shard(model, optimizer, stage=...)``: a torch module trained by the ZeRO engine.

As autograd finishes each parameter's gradient (``register_post_accumulate_grad_hook``)
it is taken from ``.grad`` (zero-copy, as a NumPy or CuPy array) and ``.grad``
is left None; ``grads`` says where it goes: kept per backward until ``step()``,
or streamed into the engine's sum by ``step(closure)``. Every collective the
bridge starts is announced first (``sync``), so ranks that make different
calls get the same error instead of waiting for each other; ``join()`` lets
ranks run different numbers of backward passes in a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch
from mpi4py import MPI

from mpizero.checkpoint import store
from mpizero.comm import agree
from mpizero.core.engine import StepResult, ZeroEngine
from mpizero.core.step import StepOrderError
from mpizero.torch import heap, state
from mpizero.torch.grads import GradientIntake
from mpizero.torch.hooks import UnitHooks
from mpizero.torch.meta import MetaInit, is_meta_model
from mpizero.torch.params import Binder
from mpizero.torch.sync import Announcer, Operation
from mpizero.torch.tensors import as_array
from mpizero.torch.units import default_units, plan_units, trainable

WATCHDOG_SECONDS = 600.0  # torch.distributed's default timeout: a collective that waits longer ends the job


def shard(
    model: torch.nn.Module,
    optimizer,
    *,
    stage: int = 2,
    comm: MPI.Comm | None = None,
    units: Sequence[torch.nn.Module] | None = None,
    init: Callable[[torch.nn.Module], None] | None = None,
    trim_heap: bool = True,
    **settings,
) -> ShardedModel:
    """Train ``model``'s parameters with ZeRO ``stage`` over ``comm`` (default COMM_WORLD).

    ``model`` must have the same parameters (names, shapes, values) on every
    rank. ``units``: the submodules gathered together at stage 3 (default:
    each child holding parameters). A model built on the meta device
    (``with torch.device("meta"):``) is materialized one module at a time,
    each rank keeping only what it holds, by each module's ``reset_parameters()``
    or by ``init(module)`` (see ``meta``). ``trim_heap``: after each backward pass and step, hand the C
    heap's free pages back to the OS (see ``heap``). ``settings`` are the engine's
    (``reduction``, ``param_dtype``, ``clip_norm``, ``on_nonfinite``, ...);
    ``watchdog`` defaults to 600 seconds (None turns it off).
    """
    settings.setdefault("watchdog", WATCHDOG_SECONDS)
    modules = default_units(model) if units is None else list(units)
    return ShardedModel(model, optimizer, stage, comm, modules, settings, init, trim_heap)


class ShardedModel:
    """The engine behind a torch module: ``step()``, ``join()``, ``gathered()``, ``state_dict()``, ``save()``, ..."""

    def __init__(self, model, optimizer, stage: int, comm, modules, settings: dict, init=None, trim_heap=True):
        self.model, self.trim_heap = model, trim_heap
        self.units = [u for u in plan_units(model, modules) if u.needed]
        owning = [u for u in self.units if u.owned]
        groups = [list(u.owned) for u in owning]
        group_of = {name: g for g, u in enumerate(owning) for name in u.owned}
        on_meta = is_meta_model(trainable(model))
        meta = MetaInit(model, group_of, init) if on_meta else None  # first: it swaps the model's parameters
        self.params = trainable(model)
        source = meta.sharded_init() if meta else {name: as_array(p) for name, p in self.params.items()}
        self.engine = ZeroEngine(source, optimizer, comm=comm, groups=groups, stage=stage, **settings)
        if meta:
            meta.finish()
        self.announcer = Announcer(self.engine.collectives)
        device = torch.device("cpu") if on_meta else next(iter(self.params.values())).device
        self.binder = Binder(self.engine, self.params, device, self.announcer)
        self.hooks = None
        if self.binder.sharded:
            self.hooks = UnitHooks(model, self.units, group_of, self.binder, self._backward_started)
        for name, p in self.params.items():
            p.register_post_accumulate_grad_hook(partial(self._grad_ready, name))
        self.grads = GradientIntake(self.engine, group_of, self.announcer.announce)
        self._in_backward = self._joining = False
        self._grad_norm: float | None = None  # clip_grad_norm_() reduced this step's gradients already
        self._ended: StepResult | None = None  # ... and the step ended there (skipped)

    # Backward -------------------------------------------------------------

    def _backward_started(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _grad_ready(self, name: str, param: torch.nn.Parameter) -> None:
        self._backward_started()
        grad, param.grad = param.grad, None
        self.grads.take(name, as_array(grad.contiguous()))
        if self.hooks is not None:
            self.hooks.grad_ready(name)

    def _backward_done(self) -> None:
        self._in_backward = False
        if self.hooks is not None:
            self.hooks.backward_done()
        self.grads.backward_done()
        self._trim()

    def _trim(self) -> None:
        if self.trim_heap:
            heap.release_free_pages()

    def last_backward(self) -> None:
        """Say that the next backward is this step's last: each group's reduction starts as soon as it is done.

        Ignored inside ``join()``, where ranks run different numbers of backward passes.
        """
        self.grads.reduce_in_backward = not self._joining

    @contextlib.contextmanager
    def not_counted(self) -> Iterator[None]:
        """Run forward and backward passes whose gradients are dropped (they still join stage 3's gathers)."""
        self.grads.counted = False
        try:
            yield
        finally:
            self.grads.counted = True

    @contextlib.contextmanager
    def join(self) -> Iterator[ShardedModel]:
        """Let ranks run different numbers of forward and backward passes inside (DDP's ``Join``).

        A rank that leaves the block takes part in the other ranks' stage 3 gathers until every rank has left
        it; then call ``step()`` on every rank. Collective on leaving (not when an exception leaves it).
        """
        if self._joining:
            raise StepOrderError("join() inside join()")
        self._joining = True
        try:
            yield self
        finally:
            self._joining = False
        self.announcer.serve_joined({Operation.GATHER: self._shadow_gather, Operation.REDUCE_ROUND: self._shadow_round})

    def _shadow_gather(self, index: int) -> None:
        self.engine.gather(index)
        self.engine.release(index)

    def _shadow_round(self, index: int) -> None:
        self.engine.reduce_round(index, None)

    # Step -----------------------------------------------------------------

    def step(self, closure: Callable[[], object] | None = None) -> StepResult:
        """Average every contribution of every rank, update, and publish (collective).

        Without ``closure``: the gradients of the backward passes run since the last step, kept per backward.
        With ``closure`` (which runs this rank's forward and backward passes, as for ``torch.optim.LBFGS``):
        gradients stream into the engine's sum as autograd makes them, inside ``join()``; the rare step whose
        predicted scales were too small runs the closure again. The result's ``loss`` is what it returned.
        """
        if self._in_backward:
            raise StepOrderError("step() called during a backward pass; call it after loss.backward() returns")
        try:
            if closure is None:
                return self._finish_step()
            return self._step_streamed(closure)
        finally:
            self.grads.reset()
            self._grad_norm, self._ended = None, None
            self.binder.refresh()
            self._trim()

    def _step_streamed(self, closure) -> StepResult:
        self.announcer.announce(Operation.STEP)
        kept = self.grads.kept_bytes() > 0
        agree.raise_if_any(self.engine.collectives, _before_closure(kept, self._grad_norm), "step(closure)")
        self.grads.streaming = True
        try:
            while True:
                with self.join():
                    loss = closure()
                result = self._finish_step()
                if not result.redo:
                    return dataclasses.replace(result, loss=loss)
                self.grads.reset()
        finally:
            self.grads.streaming = False

    def _reduce(self) -> StepResult | None:
        """Reduce this step's gradients (the step's result instead, if it ends there: skipped or redo)."""
        self.grads.start_all()
        return self.engine.finish_reduction()

    def _finish_step(self) -> StepResult:
        if self._grad_norm is None and self._ended is None:
            ended = self._reduce()
            if ended is not None:
                return ended
            clip = self.engine.config.clip_norm
            grad_norm = self.engine.clip_grad_norm(clip) if clip is not None else None
        else:
            if self._ended is not None:
                return self._ended
            grad_norm = self._grad_norm
        self.announcer.announce(Operation.STEP)
        return self.engine.apply_update(grad_norm)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Reduce this step's gradients now and clip them to global L2 norm ``max_norm``; return the norm before.

        As FSDP's: call it after the backward passes and before ``step()`` (collective). With ``step(closure)``
        pass ``clip_norm=`` to ``shard()`` instead; the step's ``grad_norm`` reports the norm.
        """
        self.announcer.announce(Operation.CLIP)
        problem = _clip_problem(max_norm, norm_type, self.grads.streaming, self._grad_norm)
        agree.raise_if_any(self.engine.collectives, problem, "clip_grad_norm_")
        ended = self._reduce()
        if ended is not None:
            self._ended = ended
            return math.inf
        self._grad_norm = self.engine.clip_grad_norm(float(max_norm))
        return self._grad_norm

    def zero_grad(self) -> None:
        """Drop this rank's gradients not yet stepped with (``.grad`` is always None: gradients go to the engine)."""
        if self.grads.started_reducing or self._grad_norm is not None:
            raise StepOrderError("zero_grad() after this step's reductions started; call step() first")
        if not self.grads.streaming:
            self.grads.reset()
        for p in self.params.values():
            p.grad = None

    # State ----------------------------------------------------------------

    @contextlib.contextmanager
    def gathered(self, writeback: bool = False) -> Iterator[torch.nn.Module]:
        """Show the full parameters in the module's own tensors inside the block (FSDP's ``summon_full_params``).

        ``writeback=True``: changes made inside go back into the masters on leaving; every rank must make the
        same changes (checked). Without it they are dropped. Collective.
        """
        self.announcer.announce(Operation.GATHERED)
        held = range(len(self.engine.groups)) if self.binder.sharded else range(0)
        for index in held:
            self.binder.acquire(index)
        try:
            yield self.model
            if writeback:
                state.write_back(self)
        finally:
            for index in held:
                self.binder.release(index)
        self.engine.publish()
        self.binder.refresh()

    def state_dict(self, all_ranks: bool = False) -> dict | None:
        """The module's full ``state_dict()`` (CPU tensors, tied names included) on rank 0, None on the others;
        on every rank with ``all_ranks=True``. Collective."""
        self.announcer.announce(Operation.STATE_DICT)
        return state.full_state_dict(self, all_ranks)

    def load_state_dict(self, state_dict) -> None:
        """Load a full state dict (from ``state_dict()`` or plain torch, any stage and world size) on every rank.

        Every rank passes the same dict (checked). The optimizer state is kept, as ``model.load_state_dict`` does.
        """
        self.announcer.announce(Operation.LOAD_STATE_DICT)
        state.load_full_state_dict(self, state_dict)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds, by kind: the engine's, plus torch-side float32 copies and kept gradients."""
        held = self.engine.memory()
        held["torch_params"] = self.binder.torch_bytes()
        held["kept_grads"] = self.grads.kept_bytes()
        return held

    def master_params(self) -> dict:
        """The full float32 master parameters by name, on every rank (collective)."""
        self.announcer.announce(Operation.MASTER_PARAMS)
        return self.engine.master_params()

    def save(self, directory: str, data: dict | None = None, keep: int | None = None) -> str:
        """Write a sharded checkpoint (collective, ``mpizero.checkpoint.store`` format); return its path.

        ``data``: JSON values of your own (a data position, a seed), returned by ``load`` as ``["data"]``.
        """
        self.announcer.announce(Operation.SAVE)
        training = {
            "data": dict(data or {}),
            "step": self.engine.step_count + self.engine.skipped_steps,
            "optimizer_steps": self.engine.step_count,
            "skipped_steps": self.engine.skipped_steps,
        }
        return store.save(self.engine, directory, training, keep)

    def load(self, path: str) -> dict:
        """Restore a checkpoint saved at any world size and stage (collective); return its training state."""
        self.announcer.announce(Operation.LOAD)
        training = store.load(self.engine, path).training
        self.engine.step_count, self.engine.skipped_steps = training["optimizer_steps"], training["skipped_steps"]
        self.binder.refresh()
        return training


def _before_closure(kept: bool, grad_norm: float | None) -> str | None:
    if kept:
        return "backward passes ran before step(closure); run them inside the closure, or call step() for them"
    if grad_norm is not None:
        return "clip_grad_norm_() before step(closure); pass clip_norm= to shard() instead"
    return None


def _clip_problem(max_norm, norm_type, streaming: bool, grad_norm) -> str | None:
    if streaming:
        return "clip_grad_norm_() inside step(closure); pass clip_norm= to shard() instead"
    if grad_norm is not None:
        return "clip_grad_norm_() twice in one step"
    if norm_type != 2.0:
        return f"only the L2 norm (norm_type=2.0) is supported, got norm_type={norm_type!r}"
    if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
        return f"max_norm must be a positive number, got {max_norm!r}"
    return None
