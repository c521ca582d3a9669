"""Train a unit-structured model with the engine, one step at a time.

Every rank walks the same rounds of micro-batches (ranks with no micro-batch
in a round still join its collectives), unit by unit. At stage 3 each unit's
full parameters are gathered just before it runs and released right after,
while the next unit's gather is already in flight (or, with ``keep_gathered``,
kept until the step's update: one gather a step instead of two a round, for
the whole model's full params held); at stages 0-2 they stay.
Gradients go to the engine group by group (stage 3: per unit; stages 0-2:
buckets) as soon as a round's backward has produced them, and are dropped:
at stages 2-3 each round is reduce-scattered at once into the grad shard, at
stages 0-1 it is folded into the local grads, reduced once after the last
round. Nothing per micro-batch is kept until the step ends, and the heap's
free pages go back to the OS after each unit (``heap``). If the engine's
scale prediction fails, the step runs again on the same micro-batches.

The single-rank counterpart is ``reference_step``: the same unit calls on the
same micro-batches, without MPI, and the reference's own ``contribution``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpizero import heap
from mpizero.comm import agree
from mpizero.core.held import to_float32
from mpizero.core.partition import split_evenly
from mpizero.core.precision import LossScaler, Precision
from mpizero.core.reference import contribution
from mpizero.core.stages import groups_by_unit
from mpizero.training.model import forward_backward, param_shapes, unit_names

DEFAULT_BUCKET_ELEMS = 1 << 21  # 8 MiB of float32; see README for the measurement behind it


def make_groups(model, stage: int, bucket_elems: int) -> list[list[str]]:
    """One group per unit at stage 3 (gathered unit by unit); else buckets of ``bucket_elems``, backward order."""
    if groups_by_unit(stage):
        return unit_names(model)
    shapes = param_shapes(model)
    buckets, current, size = [], [], 0
    for names in reversed(unit_names(model)):
        for name in names:
            numel = math.prod(shapes[name])
            if current and size + numel > bucket_elems:
                buckets.append(current)
                current, size = [], 0
            current.append(name)
            size += numel
    return [*buckets, current] if current else buckets


def groups_of_units(units: list, groups: list) -> list[list[int]]:
    """For each unit, the indices of the engine groups that hold any of its parameters, in order."""
    names_of_unit = [set(unit.param_shapes()) for unit in units]
    return [sorted({i for i, g in enumerate(groups) if names & set(g.layout.names)}) for names in names_of_unit]


def as_contribution(grads: dict, precision: Precision, loss_scale: float) -> dict:
    """Store gradients in the precision's grad dtype, then unscale to float32 for the reduction."""
    if precision.grad_dtype == np.float32 and loss_scale == 1.0:
        return grads
    inverse = np.float32(1.0 / loss_scale)
    with np.errstate(over="ignore"):  # an overflow becomes inf, which the engine agrees to skip
        return {k: g.astype(precision.grad_dtype).astype(np.float32) * inverse for k, g in grads.items()}


@dataclass(frozen=True)
class StepReport:
    """One training step as rank 0 reports it."""

    loss: float
    skipped: bool
    loss_scale: float
    grad_norm: float | None
    redone: bool = False  # the step ran twice: its scale prediction failed (``core/scales.py``)


class Trainer:
    """Drive the engine layer-wise over a model's units for one step at a time."""

    def __init__(
        self,
        model,
        engine,
        precision: Precision,
        initial_loss_scale: float = 2.0**16,
        reduce_each_round: bool | None = None,
        keep_gathered: bool = False,
    ) -> None:
        """``reduce_each_round``: reduce-scatter every round's gradients at once into the int64 grad-shard
        accumulator (more messages, no full-size buffer: DeepSpeed's and FSDP's default), or fold the rounds into
        one full local buffer and reduce it once (one message: stage 1's shape, and ``no_sync``'s). Default: each
        round where the stage shards gradients (2-3). ``keep_gathered`` (stage 3, the same on every rank): keep
        each unit's full params from its first gather until the step's update (FSDP2's
        ``reshard_after_forward=False`` with resharding after backward off), for one all-gather of each a step
        instead of two a round: what pays across hosts, where the gathers cross the links."""
        self.model, self.engine, self.precision = model, engine, precision
        engine.agree_keep_gathered(keep_gathered)
        self.keep_gathered = keep_gathered
        by_plan = engine.groups[0].plan.reduces_each_round
        self.reduce_each_round = by_plan if reduce_each_round is None else reduce_each_round
        self.units = model.units  # built once: a model's ``units`` may construct them on every access
        self.names_of_unit = [set(unit.param_shapes()) for unit in self.units]
        self.scaler = LossScaler(initial_loss_scale) if precision.loss_scaling else None
        self.groups_of_unit = groups_of_units(self.units, engine.groups)
        # backward runs units in reverse, so a group is complete after the lowest unit it holds
        self.last_unit_of_group = {
            g: min(u for u, owned in enumerate(self.groups_of_unit) if g in owned) for g in range(len(engine.groups))
        }

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.scaler is None else self.scaler.scale

    def step(self, micro_batches: Callable[[int], tuple], total: int) -> StepReport:
        """Train on this rank's share of ``total`` global micro-batches; ``micro_batches[m]`` gives batch m."""
        comm = self.engine.comm
        mine = list(split_evenly(total, comm.Get_size(), comm.Get_rank()))
        rounds = -(-total // comm.Get_size())
        loaded, problem = {}, None
        try:
            loaded = {m: micro_batches(m) for m in mine}
        except Exception as error:  # a failed load stops every rank, not just this one
            problem = f"micro-batch failed to load: {type(error).__name__}: {error}"
        agree.raise_if_any(self.engine.collectives, problem, f"step {self.engine.step_number}: loading data")
        redone = False
        while True:  # twice only when the engine's scale prediction failed: the same micro-batches again
            losses = np.zeros(total)  # one slot per global micro-batch; only its rank fills it
            for r in range(rounds):
                batch = loaded[mine[r]] if r < len(mine) else None
                loss = self._forward_backward(batch, last_round=r == rounds - 1)
                if batch is not None:
                    losses[mine[r]] = loss
            if self.keep_gathered:  # freed before the update changes the params they were gathered from
                for unit in range(len(self.units)):
                    self._free(unit)
            result = self.engine.finish_step()
            if not result.redo:
                break
            redone = True
        if self.scaler is not None:
            self.scaler.update(result.skipped)
        everyone = self.engine.collectives.allreduce_array(losses, MPI.SUM, "losses")  # x + 0.0 is exactly x
        loss = sum(float(everyone[m]) for m in range(total)) / total
        return StepReport(loss, result.skipped, self.loss_scale, result.grad_norm, redone)

    def _forward_backward(self, batch, last_round: bool) -> float | None:
        """One micro-batch (or, with ``batch`` None, only the collectives) through every unit."""
        units = self.units
        caches, out = [], None if batch is None else batch[0]
        self._prefetch(0)
        for u, unit in enumerate(units):
            params = self._unit_params(u)
            if u + 1 < len(units):
                self._prefetch(u + 1)
            if batch is not None:
                out, cache = unit.forward(out, params)
                caches.append(cache)
            self._release(u)
            heap.release_if_grown()  # this unit's gathered params, freed (unless kept)
        loss, grads, dout = None, {}, None
        if batch is not None:
            loss, dout = self.model.loss(out, batch[1])
            dout = dout * np.float32(self.loss_scale) if self.loss_scale != 1.0 else dout
        for u in reversed(range(len(units))):
            params = self._unit_params(u)
            if u > 0:
                self._prefetch(u - 1)
            if batch is not None:
                dout, unit_grads = units[u].backward(dout, caches[u], params)
                grads.update(as_contribution(unit_grads, self.precision, self.loss_scale))
                del unit_grads  # else the next unit's backward runs beside this unit's gradients, handed in by then
            self._release(u)
            for g in self.groups_of_unit[u]:
                if self.last_unit_of_group[g] == u:
                    self._hand_in(g, grads if batch is not None else None, last_round)
                    for name in self.engine.groups[g].layout.names:  # handed in: no rank keeps the whole gradient
                        grads.pop(name, None)
            heap.release_if_grown()  # this unit's gathered params and handed-in gradients, freed
        return loss

    def _hand_in(self, group: int, grads: dict | None, last_round: bool) -> None:
        """Give a group's gradients of this round to the engine as soon as backward has completed them."""
        if self.reduce_each_round:
            self.engine.reduce_round(group, grads, keep="reference", can_redo=True)  # the step can run again
        elif grads is not None:
            self.engine.accumulate(grads, groups=[group], keep="reference", can_redo=True)
        if last_round:
            self.engine.start_reduce(group)

    def _prefetch(self, unit: int) -> None:
        for g in self.groups_of_unit[unit]:
            self.engine.gather(g, blocking=False)

    def _unit_params(self, unit: int) -> dict:
        names = self.names_of_unit[unit]
        params = {}
        for g in self.groups_of_unit[unit]:
            params.update({k: to_float32(v) for k, v in self.engine.gather(g).items() if k in names})
        return params

    def _release(self, unit: int) -> None:
        """The unit's pass is done: free its full params, unless they are kept through the step."""
        if not self.keep_gathered:
            self._free(unit)

    def _free(self, unit: int) -> None:
        for g in self.groups_of_unit[unit]:
            self.engine.release(g)


def reference_step(model, reference, micro_batches: Sequence, precision: Precision, scaler: LossScaler | None):
    """The same step on one process: every micro-batch in order, then the reference update."""
    params = reference.compute_params()
    scale = 1.0 if scaler is None else scaler.scale
    contributions, losses = [], []
    for x, y in micro_batches:
        loss, grads = forward_backward(model, params, x, y, scale)
        contributions.append(contribution(grads, precision.grad_dtype, scale))
        losses.append(loss)
    updated = reference.step(contributions)
    if scaler is not None:
        scaler.update(not updated)
    return sum(losses) / len(losses)
