"""``shard(model, optimizer, stage=...)``: a torch module trained by the ZeRO engine.

As autograd finishes each parameter's gradient (``register_post_accumulate_grad_hook``)
it is taken from ``.grad`` (zero-copy, as a NumPy or CuPy array); after the backward
``.grad`` holds a guard (``grad_guard``). ``grads`` says where the gradient goes: kept
per backward until ``step()``, or streamed into the engine's sum by ``step(closure)``.
Every collective the bridge starts is announced first (``sync``), so ranks that make
different calls get the same error instead of waiting for each other; ``join()`` lets
ranks run different numbers of backward passes in a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import numpy as np
import torch
from mpi4py import MPI

from mpizero import heap
from mpizero.arrays import array_module
from mpizero.comm import agree
from mpizero.core.engine import ZeroEngine
from mpizero.core.step import StepOrderError, StepResult
from mpizero.errors import ZeroError
from mpizero.torch import checkpoints, habits, optim_state, rng, state
from mpizero.torch.buffers import BufferSync
from mpizero.torch.edits import GATHERED_RAISED, EditWatch
from mpizero.torch.grad_guard import GradView
from mpizero.torch.grads import GradientIntake
from mpizero.torch.hooks import UnitHooks, output_tensors, outside_graphs, recomputing
from mpizero.torch.meta import MetaInit, is_meta_model
from mpizero.torch.optim_bridge import TorchOptimizer, attach, is_torch_optimizer
from mpizero.torch.params import Binder
from mpizero.torch.streams import TorchStream, on_torch_stream
from mpizero.torch.sync import Announcer, Operation
from mpizero.torch.tensors import as_array
from mpizero.torch.units import default_units, lopsided, plan_units, trainable

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
    seed: int | None = None,
    keep_gathered: bool = False,
    **settings,
) -> ShardedModel:
    """Train ``model``'s parameters with ZeRO ``stage`` over ``comm`` (default COMM_WORLD).

    ``model`` must have the same parameters (names, shapes, values) on every rank. ``units``: the submodules
    gathered together at stage 3 (default: the repeated blocks, ``units.default_units``; a unit owning over half
    the parameters is warned of). A model built on the meta device (``with torch.device("meta"):``) is
    materialized one module at a time, each rank keeping only what it holds, by each module's
    ``reset_parameters()`` or by ``init(module)`` (see ``meta``). ``trim_heap``: hand the C heap's free pages back
    to the OS when it grew, and keep glibc from doing so on every ``free`` (see ``heap``; not where the
    parameters live on a GPU). ``seed``: what ``micro_batch(i)`` seeds torch's generators from, with the step
    and ``i`` (default: ``torch.initial_seed()``, the same on every rank). ``keep_gathered`` (stage 3): keep each
    unit's full params from its first gather in a step until the step's update (or a call that reads or sets the
    params, ``state_dict()``, ``gathered()``, a load), as FSDP2's ``reshard_after_forward=False`` with resharding
    after backward off: one all-gather of each a step instead of two a micro-batch, for the whole model's params
    held through the step; what pays across hosts. ``settings`` are the engine's
    (``reduction``, ``param_dtype``, ``clip_norm``, ``on_nonfinite``, ...); ``watchdog`` defaults to 600 seconds
    (None turns it off).
    """
    if any(habits.owner_of(p) is not None for p in model.parameters()):
        raise ZeroError("this model is sharded already (shard() was called on it): shard a model once")
    settings.setdefault("watchdog", WATCHDOG_SECONDS)
    modules = default_units(model) if units is None else list(units)
    seed = torch.initial_seed() if seed is None else seed
    return ShardedModel(model, optimizer, stage, comm, modules, settings, init, trim_heap, seed, keep_gathered)


def _grad_ready_of(zero_ref: weakref.ref, name: str, param: torch.nn.Parameter) -> None:
    """A parameter's gradient hook: hand the gradient to its sharded model, if that still exists. Torch keeps
    tensor hooks in C++, where Python's collector cannot see the cycle back through them; a strong reference
    here kept every sharded model (its engine, masters and shared-memory windows) alive until exit. The model
    holds its sharded model strongly (``ShardedModel.__init__``), so while the model is in use the hook finds it."""
    zero = zero_ref()
    if zero is not None:
        zero._grad_ready(name, param)


class ShardedModel:
    """The engine behind a torch module: ``step()``, ``join()``, ``gathered()``, ``state_dict()``, ``save()``, ..."""

    def __init__(
        self,
        model,
        optimizer,
        stage: int,
        comm,
        modules,
        settings: dict,
        init=None,
        trim_heap=True,
        seed=0,
        keep_gathered=False,
    ):
        self.model, self.trim_heap, self.seed = model, trim_heap, seed
        self.units = [u for u in plan_units(model, modules) if u.needed]
        owning = [u for u in self.units if u.owned]
        groups = [list(u.owned) for u in owning]
        group_of = {name: g for g, u in enumerate(owning) for name in u.owned}
        lopsided_warning = lopsided(self.units, trainable(model)) if stage == 3 else None  # before any placeholder
        on_meta = is_meta_model(trainable(model))
        meta = MetaInit(model, group_of, init) if on_meta else None  # first: it swaps the model's parameters
        self.params = trainable(model)
        source = meta.sharded_init() if meta else {name: as_array(p) for name, p in self.params.items()}
        self.device = torch.device("cpu") if on_meta else next(iter(self.params.values())).device
        self.torch_stream = TorchStream(array_module(as_array(torch.empty(0, device=self.device))), self.device)
        with self.torch_stream():  # the set-up's device work, as every later entry's (``streams``)
            self.optimizer = optimizer
            held_state = None
            if is_torch_optimizer(optimizer):
                held_state = torch.optim.Optimizer.state_dict(optimizer) if optimizer.state else None
                optimizer = TorchOptimizer(optimizer, {id(p): name for name, p in self.params.items()})
            self.engine = ZeroEngine(source, optimizer, comm=comm, groups=groups, stage=stage, **settings)
            if meta:
                meta.finish()
            self.run = checkpoints.run_identity(self.engine)
            if self._trims_heap:
                heap.keep_freed_blocks()
            agree.raise_unless_equal(self.engine.collectives, {"the seed micro_batch() keys randomness to": seed})
            self.engine.agree_keep_gathered(keep_gathered)
            self.announcer = Announcer(self.engine.collectives)
            self.buffers = BufferSync(model, self.engine.collectives, self.torch_stream.around)
            self.binder = Binder(self.engine, self.params, self.device, self.announcer, keep_gathered)
            self.announcer.leaving_passes = self._drop_kept_gathered
            self.torch_stream.order_forward(model, outside_graphs)
            self.hooks = None
            if self.binder.sharded:
                self.hooks = UnitHooks(
                    model, self.units, group_of, self.binder, self._backward_started, self.torch_stream.around
                )
            model.register_forward_hook(outside_graphs(self._hook_outputs))
            if lopsided_warning:  # now the engine agreed on the groups it is made from: the same on every rank
                warnings.warn(lopsided_warning, stacklevel=3)
            for name, p in self.params.items():  # weakly: see ``_grad_ready_of``
                hook = partial(_grad_ready_of, weakref.ref(self), name)
                p.register_post_accumulate_grad_hook(self.torch_stream.around(hook))
            self.grads = GradientIntake(self.engine, group_of, self.announcer.announce)
            readable = self.engine.groups[0].plan.keeps_local_grads  # every rank can have the whole gradient
            self.grad_view = GradView(self.params, readable, self._averaged_grads)
            self._in_backward = self._joining = False
            self._reduced = False  # this step's gradients were reduced before step() (clip_grad_norm_, gathered)
            self._grad_norm: float | None = None  # ... and clip_grad_norm_() clipped them to this norm
            self._ended: StepResult | None = None  # ... or the step ended there (skipped)
            model._mpizero_sharded = self  # the model holds its sharded model; the gradient hooks, weakly
            habits.install(self)
            if is_torch_optimizer(self.optimizer):
                attach(self.optimizer, self)
                if held_state is not None:  # built from a plain torch checkpoint: it stays this run's state
                    self.load_optimizer_state_dict(held_state)
            self.edits = EditWatch(model, self.binder, self.engine.device_stats)
            self.edits.record()

    # Backward -------------------------------------------------------------

    def _backward_started(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.torch_stream.around(self._backward_done))

    def _hook_outputs(self, module, args, output) -> None:
        """A backward through the model's outputs starts (``_backward_started``) when it reaches them: in its
        outermost graph task, so that its end is that task's, not a reentrant checkpoint's nested backward's,
        which may finish gradients first."""
        if torch.is_grad_enabled() and not recomputing():
            for tensor in output_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._output_reached)

    def _output_reached(self, grad) -> None:
        self._backward_started()

    def _grad_ready(self, name: str, param: torch.nn.Parameter) -> None:
        self._backward_started()
        grad, param.grad = param.grad.contiguous(), None
        self.grads.take(name, self.torch_stream.lend(grad, as_array(grad)))
        if self.hooks is not None:
            self.hooks.grad_ready(name)

    def _backward_done(self) -> None:
        self._in_backward = False
        if self.hooks is not None:
            self.hooks.backward_done()
        self.grads.backward_done()
        self.grad_view.guard()
        self._trim()

    @property
    def _trims_heap(self) -> bool:
        """Whether this model hands the C heap's free pages back (``trim_heap``, gradients and params on the host)."""
        return self.trim_heap and self.engine.groups[0].xp is np

    def _drop_kept_gathered(self) -> None:
        """Free what stage 3 keeps gathered (``Binder.drop_kept_gathered``); an edit found in it spoils only
        gradients computed meanwhile: none where no backward has handed any in yet (an evaluation's edit)."""
        self.binder.drop_kept_gathered()
        if not self.grads.handed_in:
            self.binder.edited_kept_gathered.clear()

    def _trim(self) -> None:
        """Hand the C heap's free pages back when it grew."""
        if self._trims_heap:
            heap.release_if_grown()

    def last_backward(self) -> None:
        """Say that the next backward is this step's last: each group's reduction starts as soon as it is done.

        Ignored inside ``join()``, where ranks run different numbers of backward passes.
        """
        self.grads.reduce_in_backward = not self._joining

    @contextlib.contextmanager
    def not_counted(self) -> Iterator[None]:
        """Run forward and backward passes whose gradients (and BatchNorm statistics) are dropped; they still
        join stage 3's gathers and stages 2-3's reductions."""
        self.grads.counted = self.buffers.counted = False
        try:
            yield
        finally:
            self.grads.counted = self.buffers.counted = True

    @contextlib.contextmanager
    def micro_batch(self, index: int) -> Iterator[None]:
        """Run micro-batch ``index`` (its position in the step's global batch) with randomness keyed to it.

        torch's generators are seeded from the seed, the step and ``index`` inside, and restored after (``rng``),
        so dropout draws the same numbers at any world size; BatchNorm's statistics are replayed in ``index``
        order at the step (``buffers``). Run the forward (and backward) inside.
        """
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(
                f"micro_batch() takes the micro-batch's index in the global batch (an int >= 0), got {index!r}"
            )
        self.buffers.index = index
        try:
            with rng.seeded(self.seed, self.engine.step_number, index, self.device):
                yield
        finally:
            self.buffers.index = None

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
        with self.torch_stream():
            self.announcer.serve_joined(
                {
                    Operation.GATHER: self.binder.take_part,
                    Operation.EVAL_GATHER: self.binder.take_part,
                    Operation.REDUCE_ROUND: self._shadow_round,
                }
            )

    def _shadow_round(self, index: int) -> None:
        self.engine.reduce_round(index, None)

    # Step -----------------------------------------------------------------

    @on_torch_stream
    def step(self, closure: Callable[[], object] | None = None) -> StepResult:
        """Average every contribution of every rank, update, and publish (collective).

        Without ``closure``: the gradients of the backward passes run since the last step (streamed into the
        engine's sum as autograd made them; the run's first step holds them, ``grads``). With ``closure`` (which
        runs this rank's forward and backward passes, as for ``torch.optim.LBFGS``): inside ``join()``; a step
        that must be redone (the run's first measures its scales) runs the closure again. The result's ``loss``
        is what it returned.
        """
        if self._in_backward:
            raise StepOrderError("step() called during a backward pass; call it after loss.backward() returns")
        try:
            result = self._finish_step() if closure is None else self._step_streamed(closure)
            self.buffers.settle()
            return result
        finally:
            self.grads.reset()
            self._reduced, self._grad_norm, self._ended = False, None, None
            self.grad_view.guard(stepped=True)
            self.binder.refresh()
            self.edits.after_step()
            self.torch_stream.step_over = True
            self._trim()

    def _step_streamed(self, closure) -> StepResult:
        self.announcer.announce(Operation.STEP)
        problem = _before_closure(self.grads.handed_in, self._reduced)
        agree.raise_if_any(self.engine.collectives, problem, "step(closure)")
        self.grads.streaming = True
        try:
            while True:
                with self.join():
                    loss = closure()
                result = self._finish_step()
                if not result.redo:
                    return dataclasses.replace(result, loss=loss)
                self.grads.reset()
                self.buffers.forget()
                self._reduced, self._ended = False, None  # the pass that ends in a redo is forgotten
        finally:
            self.grads.streaming = False

    def _reduce(self) -> StepResult | None:
        """Reduce this step's gradients (the step's result instead, if it ends there: skipped or redo)."""
        self.grads.start_all()
        ended = self.engine.finish_reduction()
        if ended is not None and ended.redo and not self.grads.streaming:  # every rank: the redo is agreed
            raise ZeroError(
                f"step {ended.step + 1}: its gradients outgrew the scales predicted from the last step (more than "
                "about 4x as many backward passes, or, on a device, more elements beyond the predicted range than "
                "the group's spill holds), and without a closure they cannot be handed in again: take such a step "
                "with zero.step(closure)"
            )
        return ended

    def _finish_step(self) -> StepResult:
        self._drop_kept_gathered()  # before the update changes the params; what changed in them is the check's
        try:
            edited, ended = self._checked_reduction()
        finally:
            self.edits.end_check()
        if ended is not None:
            agree.raise_if_any(self.engine.collectives, edited, "step")  # a skipped step is no announced one
            return ended
        clip = self.engine.config.clip_norm
        grad_norm = self._grad_norm
        if grad_norm is None and clip is not None:
            grad_norm = self.engine.clip_grad_norm(clip)
        hyper, fingerprint, problem = self.engine.read_hyper()  # as torch reads them: at the step
        problem = edited or problem
        fingerprint = -1 if problem is not None else fingerprint  # every rank then learns of it from the same one
        if not self.announcer.announce(Operation.STEP, fingerprint=fingerprint) or problem is not None:
            self.engine.raise_hyper_disagreement(hyper, problem)
        return self.engine.apply_update(grad_norm, hyper)

    def _checked_reduction(self) -> tuple[str | None, StepResult | None]:
        """Check for edits, then reduce; return what the check found and the step's result if it ended there. An
        edit found before the reduction's agreement is refused there, on every rank (on a device the check's
        fingerprints come back with the agreement's device stats, in one copy, and the check is asked there)."""
        if self._reduced or self._ended is not None:
            return self.edits.problem(), self._reduce_early()
        if self.edits.check_with_step():
            found: list = []
            self.engine.note_problem_at_agreement(lambda: found.append(self.edits.problem()) or found[0])
            ended = self._reduce_early()
            return (found[0] if found else self.edits.problem()), ended
        edited = self.edits.problem()
        if edited is not None:
            self.engine.note_problem(edited)  # refused at the reduction's agreement, still to come
        return edited, self._reduce_early()

    def _reduce_early(self) -> StepResult | None:
        """Reduce this step's gradients unless they were already; the step's result if it ended there (skipped)."""
        if not self._reduced and self._ended is None:
            self._ended = self._reduce()
            self._reduced = self._ended is None
        return self._ended

    @on_torch_stream
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Reduce this step's gradients now and clip them to global L2 norm ``max_norm``; return the norm before.

        ``max_norm=math.inf`` measures the norm without clipping, as torch's ``clip_grad_norm_`` does.

        As FSDP's: call it after the backward passes and before ``step()`` (collective). With ``step(closure)``
        pass ``clip_norm=`` to ``shard()`` instead; the step's ``grad_norm`` reports the norm.
        """
        self.announcer.announce(Operation.CLIP)
        problem = _clip_problem(max_norm, norm_type, self.grads.streaming, self._grad_norm)
        agree.raise_if_any(self.engine.collectives, problem, "clip_grad_norm_")
        if self._reduce_early() is not None:
            return math.inf
        self._grad_norm = self.engine.clip_grad_norm(float(max_norm))
        self.grad_view.changed()
        return self._grad_norm

    def _averaged_grads(self) -> dict[str, torch.Tensor]:
        """Reduce this step's gradients now and gather the averaged ones (stages 0-1's use of a ``.grad``)."""
        with self.torch_stream():
            self.announcer.announce(Operation.READ_GRADS)
            ended = self._reduce_early()
            if ended is not None:
                raise ZeroError("this step's gradients are not finite, so it is skipped: there are none to read")
            return state.averaged_grads(self)

    @on_torch_stream
    def zero_grad(self) -> None:
        """Drop the gradients not yet stepped with, on every rank (collective if backward passes ran since the last
        step: they are in the engine's sum already); every ``.grad`` is None after it (``grad_guard``)."""
        if self.grads.started_reducing or self._reduced:
            raise StepOrderError("zero_grad() after this step's reductions started; call step() first")
        if self.grads.handed_in and not self.grads.streaming:
            self.announcer.announce(Operation.DISCARD)
            self.engine.discard_step()
            self.grads.reset()
            self.edits.gradients_dropped()
        self.grad_view.clear()

    # State ----------------------------------------------------------------

    @contextlib.contextmanager
    def gathered(self, writeback: bool = False, grads: bool = False) -> Iterator[torch.nn.Module]:
        """Show the full parameters in the module's own tensors inside the block (FSDP's ``summon_full_params``).

        ``writeback=True``: changes made inside go back into the masters on leaving; every rank must make the
        same changes (checked). Without it, or when the block raises, they are dropped at every stage: the module
        shows and computes with the parameters as before the block, or as a step or a load inside it left them.
        At stages 0-2 in float32 the module's tensors hold the masters: an edit made before the block is refused on
        entry, or, with ``writeback=True``, kept if every rank wrote back the same (``edits``). ``grads=True``:
        after this step's backward passes, reduce their gradients now (as ``clip_grad_norm_`` does) and show each
        parameter's averaged gradient in its ``.grad`` inside the block (copies, for reading: ``step()`` uses the
        engine's). Collective.
        """
        with self.torch_stream():
            self.announcer.announce(Operation.GATHERED)
            if writeback:  # an edit of the masters made before the block is kept if every rank writes it back
                self.edits.masters_edited()
            else:
                self._refuse_edited_masters("gathered()")
            computed_with = None  # an edit this step's backward passes computed with (the module shows it)
            if self.grads.handed_in and not self.binder.sharded:
                computed_with = self.edits.unseen_edit()
            if grads:
                self._reduce_early()
            held = range(len(self.engine.groups)) if self.binder.sharded else range(0)
            for index in held:
                self.binder.acquire(index, private=True)
            self.edits.open_block()
        left_normally = written = False
        try:
            if grads and self._ended is None:
                with self.torch_stream():
                    state.show_grads(self)
            yield self.model  # the block: the caller's own stream
            left_normally = True
            if writeback:
                with self.torch_stream():
                    state.write_back(self)  # agreed: refused on every rank or on none
                written = True
                self.edits.written_back()
        finally:
            kept = self.edits.close_block()
            with self.torch_stream():
                if grads:
                    self.grad_view.guard()
                for index in held:
                    self.binder.release(index)
                if not left_normally or (not written and self.binder.shows_masters):
                    self.binder.put_back(kept)  # the block's edit is dropped (publishing does it where it copies)
                if computed_with is not None and not written and self.grads.handed_in:  # still this step's
                    self.edits.spoil_gradients(computed_with)
                if left_normally:  # every rank is here: the masters are shown again
                    if not (writeback and self._masters_edited_anywhere()):  # the same test on every rank
                        self.engine.publish()
                    self.show_masters()
                else:  # this rank alone may be here: no collective; the next step is refused
                    self.edits.refuse(GATHERED_RAISED)

    def _masters_edited_anywhere(self) -> bool:
        """Where the module's tensors hold the masters (stages 0-2 in float32), whether some rank's are still
        edited after a writeback (refused, or failed there; collective there): publishing would spread that rank's
        edit into every rank's copy of its block, and a writeback tried again would find every rank alike."""
        if not self.binder.shows_masters:
            return False
        return agree.said_by_any(self.engine.collectives, self.edits.in_masters, "gathered()") is not None

    def _refuse_edited_masters(self, context: str) -> None:
        """Where the module's tensors hold the masters themselves (stages 0-2 in float32), refuse on every rank to read
        them out, or to show them as they are, while some rank's were edited outside the documented ways: they
        are not the masters the other ranks hold (collective there)."""
        if self.binder.shows_masters:
            agree.raise_if_any(self.engine.collectives, self.edits.masters_edited(), context)

    @on_torch_stream
    def state_dict(self, all_ranks: bool = False) -> dict | None:
        """The module's full ``state_dict()`` (CPU tensors, tied names included) on rank 0, None on the others;
        on every rank with ``all_ranks=True``. Collective."""
        self.announcer.announce(Operation.STATE_DICT)
        self._refuse_edited_masters("state_dict()")
        return state.full_state_dict(self, all_ranks)

    @on_torch_stream
    def show_masters(self) -> None:
        """Make the module's parameters show the engine's current ones, as the only edits allowed until the next
        (``edits``)."""
        self.binder.refresh()
        self.edits.record()

    @on_torch_stream
    def load_state_dict(self, state_dict) -> None:
        """Load a full state dict (from ``state_dict()`` or plain torch, any stage and world size) on every rank.

        Every rank passes the same dict (checked). The optimizer state is kept, as ``model.load_state_dict`` does.
        """
        self.announcer.announce(Operation.LOAD_STATE_DICT)
        state.load_full_state_dict(self, state_dict)

    @on_torch_stream
    def reshard(self) -> None:
        """Free the units stage 3 keeps gathered (``keep_gathered``) now, as FSDP2's ``model.reshard()`` does after
        an evaluation; else they stay until the next step or a call that reads or sets the params. Collective."""
        self.announcer.announce(Operation.RESHARD)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds, by kind: the engine's (held gradients among its grads), plus torch-side float32
        copies of bf16/fp16 parameters."""
        held = self.engine.memory()
        held["torch_params"] = self.binder.torch_bytes()
        return held

    @on_torch_stream
    def master_params(self) -> dict:
        """The full float32 master parameters by name, on every rank (collective)."""
        self.announcer.announce(Operation.MASTER_PARAMS)
        self._refuse_edited_masters("master_params()")
        return self.engine.master_params()

    @on_torch_stream
    def save(self, directory: str, data: dict | None = None, keep: int | None = None, scheduler=None) -> str:
        """Write a sharded checkpoint (collective, ``mpizero.checkpoint.store`` format); return its path.

        ``data``: JSON values of your own (a data position, a seed), returned by ``load`` as ``["data"]``.
        ``scheduler``: a learning-rate scheduler whose ``state_dict()`` is saved with it (``checkpoints``).
        """
        self.announcer.announce(Operation.SAVE)
        self._refuse_edited_masters("save()")
        return checkpoints.save(self, directory, data, keep, scheduler)

    @on_torch_stream
    def load(self, path: str, overrides: Sequence[str] = (), scheduler=None) -> dict:
        """Restore a checkpoint saved at any world size and stage (collective); return its training state.

        ``path``: a checkpoint, or the directory ``save`` was given (its newest complete checkpoint). A
        ``torch.optim`` optimizer gets its saved hyper-parameters back, and ``scheduler`` its saved state.
        ``overrides``: hyper-parameters of mpizero's own optimizers that may differ from the checkpoint's.
        """
        self.announcer.announce(Operation.LOAD)
        return checkpoints.load(self, path, overrides, scheduler)

    @on_torch_stream
    def optimizer_state_dict(self) -> dict:
        """The optimizer's whole state in torch's format, on every rank (``optimizer.state_dict()``; collective)."""
        self.announcer.announce(Operation.OPTIMIZER_STATE_DICT)
        return optim_state.full_optimizer_state(self)

    @on_torch_stream
    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        """Load a torch-format optimizer state dict, the same on every rank (``optimizer.load_state_dict``)."""
        self.announcer.announce(Operation.LOAD_OPTIMIZER_STATE_DICT)
        optim_state.load_optimizer_state(self, state_dict)


def _before_closure(handed_in: bool, reduced: bool) -> str | None:
    if handed_in:
        return "backward passes ran before step(closure); run them inside the closure, or call step() for them"
    if reduced:
        return "clip_grad_norm_() or gathered(grads=True) before step(closure); pass clip_norm= to shard() instead"
    return None


def _clip_problem(max_norm, norm_type, streaming: bool, grad_norm) -> str | None:
    if streaming:
        return "clip_grad_norm_() inside step(closure); pass clip_norm= to shard() instead"
    if grad_norm is not None:
        return "clip_grad_norm_() twice in one step"
    if norm_type != 2.0:
        return f"only the L2 norm (norm_type=2.0) is supported, got norm_type={norm_type!r}"
    if not (isinstance(max_norm, (int, float)) and max_norm > 0):  # NaN is not; inf measures without clipping
        return f"max_norm must be a positive number (inf: measure the norm only), got {max_norm!r}"
    return None
