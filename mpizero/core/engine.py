"""The ZeRO engine: sharded training state over an MPI communicator.

A step averages this rank's local gradients (one dict, or a list of dicts for
several micro-batches) over all ranks, group by group, through the stage's
collective; optionally clips by the global norm; updates the owned range with
the optimizer; and publishes the new parameters. ``group`` names every buffer;
``stages`` says which are sharded. Layer-wise callers (``trainer``) drive the
same steps one group at a time: ``gather``/``release`` parameters, then
``start_reduce`` per group and ``finish_step``.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpizero.comm import agree, launch
from mpizero.comm.collectives import Collectives
from mpizero.core import norm
from mpizero.core.arrays import array_module, is_device_array, to_host
from mpizero.core.config import ZeroConfig
from mpizero.core.exact import max_abs
from mpizero.core.group import FlatGroup, ParamState, StatePiece
from mpizero.core.layout import FlatLayout
from mpizero.core.memory import KINDS, MemoryLog, peak_rss_bytes
from mpizero.core.partition import Partition
from mpizero.core.reduction import REDUCTIONS
from mpizero.core.stages import ShardPlan, sharding
from mpizero.core.step import StepTracker

GRAD_DTYPE = np.dtype(np.float32)
IN_FLIGHT = 2  # gradient collectives left running at once; older ones are finished to free their buffers
PARAM_DTYPE = np.dtype(np.float32)


@dataclass(frozen=True)
class StepResult:
    """What one step did: the optimizer steps taken so far, whether it was skipped, the gradient norm."""

    step: int
    skipped: bool
    grad_norm: float | None = None


class ZeroEngine:
    """ZeRO stages 0-3 for named float32 parameters, bitwise equal to the single-rank reference.

    ``params`` must have the same names, shapes, dtypes and values on every
    rank; ``groups`` lists parameter names per flat group (default: one group).
    """

    def __init__(
        self,
        params: Mapping,
        optimizer,
        *,
        comm: MPI.Comm | None = None,
        groups: Sequence[Sequence[str]] | None = None,
        **settings,
    ) -> None:
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.config = ZeroConfig(**settings)
        launch.refuse_split_launch(self.config.allow_singleton)
        self.optimizer = optimizer
        self.reduction = REDUCTIONS[self.config.reduction]
        self.names = list(params)
        group_names = [self.names] if groups is None else [list(g) for g in groups]
        problem = _check_params(params, group_names)
        on_device = problem is None and is_device_array(next(iter(params.values())))
        self.collectives = Collectives(self.comm, self.config.watchdog, on_device)
        self.step_count = self.skipped_steps = 0
        self.peak_gathered_groups = 0
        self.memory_log = MemoryLog()
        self._pending: dict[int, tuple[list[int], int]] = {}  # groups with a collective in flight: scales, count
        agree.raise_if_any(self.collectives, problem, "bad parameters")
        agree.raise_unless_equal(self.collectives, self._signature(params, group_names))
        xp = array_module(next(iter(params.values())))
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        self.groups: list[FlatGroup] = []
        for names in group_names:
            layout = FlatLayout.from_shapes({n: params[n].shape for n in names})
            plan = ShardPlan(sharding(self.config.stage), Partition(layout.numel, size, self.config.align), rank)
            group = FlatGroup(layout, plan, xp, self.config.param_dtype, params)
            group.init_optimizer(optimizer.state_names)
            self.groups.append(group)
        self.numel = sum(g.layout.numel for g in self.groups)
        self._tracker = StepTracker(len(self.groups))
        self._note_gathered()

    def _signature(self, params: Mapping, group_names) -> dict:
        """What every rank must agree on before the first collective, field by field."""
        return {
            "the parameter count": sum(int(a.size) for a in params.values()),
            "the parameter names": tuple(params),
            "the parameter shapes": tuple(tuple(a.shape) for a in params.values()),
            "the parameter dtypes": tuple(str(a.dtype) for a in params.values()),
            "the groups": tuple(map(tuple, group_names)),
            "the settings": self.config,
            "the communication paths": self.collectives.paths,
            "the optimizer": repr(self.optimizer),
            "the initial parameter values": _digest(params),
        }

    # Parameters -----------------------------------------------------------

    @contextlib.contextmanager
    def gathered(self) -> Iterator[dict]:
        """Yield the full parameters by name (read-only); at stage 3 they are freed on exit."""
        try:
            views = {}
            for index in range(len(self.groups)):
                views.update(self.gather(index))
            for view in views.values():
                _make_read_only(view)
            yield {name: views[name] for name in self.names}
        finally:
            for index in range(len(self.groups)):
                self.release(index)

    def gather(self, index: int, blocking: bool = True, out=None) -> dict:
        """Gather group ``index``'s full params (stage 3); return its views by name once complete.

        ``out``: a buffer of the group's padded numel in the param dtype to gather into (zero-copy callers).
        """
        group = self.groups[index]
        self.collectives.watchdog.context = f"step {self.step_number}, gathering group {index}"
        group.gather(self.collectives, blocking=blocking or not self.config.overlap, out=out)
        self._note_gathered()
        return group.views() if group.state is ParamState.UNSHARDED else {}

    def release(self, index: int) -> None:
        """Free group ``index``'s full params if the stage keeps only shards."""
        self.groups[index].release()

    @property
    def step_number(self) -> int:
        """The step being taken now (counting skipped steps), for messages."""
        return self.step_count + self.skipped_steps + 1

    def _note_gathered(self) -> None:
        gathered = sum(g.state is not ParamState.SHARDED for g in self.groups if g.plan.gathers_params)
        self.peak_gathered_groups = max(self.peak_gathered_groups, gathered)
        self.memory_log.sample(self.memory())

    # Gradients and updates ------------------------------------------------

    def step(self, contributions: Mapping | Sequence[Mapping]) -> StepResult:
        """Average this step's gradients over all ranks and update the parameters.

        ``contributions``: this rank's local gradients, a dict by parameter name
        (or a list of such dicts, possibly empty), float32, shaped like the
        parameters. The update uses the mean over every contribution of every rank.
        """
        if isinstance(contributions, Mapping):
            contributions = [contributions]
        for index in range(len(self.groups)):
            self.start_reduce(index, contributions)
        return self.finish_step()

    def start_reduce(self, index: int, contributions: Sequence[Mapping]) -> None:
        """Agree on group ``index``'s scales with all ranks, encode, and start its gradient collective."""
        if not self._tracker.start(index, self.step_number):
            return
        group = self.groups[index]
        problem = self._check_contributions(group, contributions)
        local = np.zeros(2 + len(group.layout.specs))
        local[0], local[1] = len(contributions), problem is not None
        if problem is None:
            for column, spec in enumerate(group.layout.specs, start=2):
                local[column] = max((max_abs(grads[spec.name]) for grads in contributions), default=0.0)
        stats = np.empty((self.comm.Get_size(), local.size))
        self.collectives.watchdog.context = f"step {self.step_number}, group {index}"
        self.collectives.agree(local, stats)
        if stats[:, 1].any():
            self._abandon()
            agree.raise_if_any(self.collectives, problem, f"step {self.step_number}: bad gradients")
        count = int(stats[:, 0].sum())
        if count == 0:
            self._abandon()
            raise agree.ZeroError(f"step {self.step_number}: no rank handed in any gradients")
        bad_ranks = [r for r in range(stats.shape[0]) if not np.isfinite(stats[r, 2:]).all()]
        if bad_ranks:
            self._abandon(keep_step=True)
            self._tracker.skip()
            self._skip_or_raise(f"non-finite gradient in group {index} on ranks {bad_ranks}")
            return
        try:
            scales = [self.reduction.scale_for(float(m), count) for m in stats[:, 2:].max(axis=0)]
        except OverflowError as error:  # every rank computes the same scales, so every rank gets here
            self._abandon()
            raise agree.ZeroError(f"step {self.step_number}: {error}") from None
        group.start_reduce(self.collectives, self.reduction, contributions, scales, blocking=not self.config.overlap)
        self._pending[index] = (scales, count)
        self.memory_log.sample(self.memory())
        while len(self._pending) > IN_FLIGHT:  # finish the oldest: its int64 buffers go before the next arrive
            self._finish_reduce(next(iter(self._pending)))

    def _finish_reduce(self, index: int) -> None:
        scales, count = self._pending.pop(index)
        self.groups[index].finish_reduce(self.reduction, scales, count)

    def _skip_or_raise(self, problem: str) -> None:
        """Apply ``on_nonfinite`` to an agreed problem: raise it on every rank, or let the step be skipped."""
        if self.config.on_nonfinite == "raise":
            self._tracker.reset()
            raise agree.ZeroError(f"step {self.step_number}: {problem}")

    def _abandon(self, keep_step: bool = False) -> None:
        """Complete every in-flight gradient collective without using it; forget the step's reductions."""
        for index in self._pending:
            self.groups[index].abandon_reduce()
        self._pending.clear()
        if not keep_step:
            self._tracker.reset()

    def finish_step(self) -> StepResult:
        """Finish every group's reduction, clip, update and publish; or skip the step if agreed."""
        missing = self._tracker.missing()
        if self._tracker.finish(self.step_number):
            self.skipped_steps += 1
            return StepResult(self.step_count, skipped=True)
        for index in list(self._pending):
            self._finish_reduce(index)
        if missing:
            raise agree.ZeroError(f"step {self.step_number}: groups {missing} were never reduced")
        if self.reduction.result_can_overflow and self._nonfinite_result():
            self.skipped_steps += 1
            return StepResult(self.step_count, skipped=True)
        grad_norm = self._clip() if self.config.clip_norm is not None else None
        self.step_count += 1
        for group in self.groups:
            group.update(self.optimizer, self.step_count)
            group.publish(self.collectives)
        return StepResult(self.step_count, skipped=False, grad_norm=grad_norm)

    def _nonfinite_result(self) -> bool:
        """Agree whether any averaged gradient overflowed (MPI's float32 sum can); raise or skip as configured."""
        local = not all(bool(array_module(g.grad_shard).isfinite(g.grad_shard).all()) for g in self.groups)
        if not self.collectives.allreduce_value(local, MPI.LOR, "whether any averaged gradient overflowed"):
            return False
        bad = [r for r, flag in enumerate(self.collectives.allgather_object(local, "overflowed results")) if flag]
        self._skip_or_raise(f"non-finite averaged gradient (the float32 sum overflowed) on ranks {bad}")
        return True

    def _clip(self) -> float:
        """Scale every grad shard so the global gradient norm is at most ``clip_norm``; return the norm."""
        pieces = [g.grad_shard for g in self.groups]
        across_ranks = self.groups[0].plan.norm_needs_all_ranks
        grad_norm = norm.global_norm(pieces, self.numel, self.collectives if across_ranks else None)
        factor = norm.clip_factor(grad_norm, self.config.clip_norm)
        if factor is not None:
            for piece in pieces:
                piece *= np.float32(factor)
        return grad_norm

    def _check_contributions(self, group: FlatGroup, contributions) -> str | None:
        if not isinstance(contributions, Sequence):
            return f"gradients must be a dict or a list of dicts, got {type(contributions).__name__}"
        for i, grads in enumerate(contributions):
            unknown = sorted(set(grads) - set(self.names)) if isinstance(grads, Mapping) else []
            if unknown:
                return f"contribution {i} has gradients for unknown parameters {unknown[:3]}"
            for spec in group.layout.specs:
                g = grads.get(spec.name) if isinstance(grads, Mapping) else None
                if g is None:
                    return f"contribution {i} has no gradient for {spec.name!r}"
                if not hasattr(g, "dtype") or not hasattr(g, "shape"):
                    return f"contribution {i}: gradient {spec.name!r} is a {type(g).__name__}, not an array"
                if tuple(g.shape) != spec.shape or g.dtype != GRAD_DTYPE:
                    return (
                        f"contribution {i}: gradient {spec.name!r} is {g.dtype}{list(g.shape)}, "
                        f"expected {GRAD_DTYPE}{list(spec.shape)}"
                    )
        return None

    # Training state by tensor piece (checkpoints) -------------------------

    def shard_pieces(self) -> list[StatePiece]:
        """This rank's shard of the training state, padding stripped: each element is in exactly one rank's pieces."""
        return [piece for g in self.groups for piece in g.state_pieces(*g.plan.shard_range)]

    def owned_pieces(self) -> list[StatePiece]:
        """All training state this rank updates (everything at stage 0): what a load must fill."""
        return [piece for g in self.groups for piece in g.state_pieces(*g.plan.owned_range)]

    def publish(self) -> None:
        """Make the parameters every rank computes with equal to the master again (after the state was set)."""
        for group in self.groups:
            group.publish(self.collectives)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's shape by name, in the model's order."""
        shapes = {s.name: s.shape for g in self.groups for s in g.layout.specs}
        return {name: shapes[name] for name in self.names}

    # Reports --------------------------------------------------------------

    def master_params(self) -> dict[str, np.ndarray]:
        """Return the full float32 master parameters by name on every rank (host arrays)."""
        result = {}
        for group in self.groups:
            full = np.empty(group.partition.padded_numel, dtype=np.float32)
            start, stop = group.partition.shard_range(group.rank)
            owned_start = start - group.owned_range[0]
            shard = to_host(group.master_shard[owned_start : owned_start + stop - start])
            self.collectives.allgather(np.ascontiguousarray(shard), full, counted_as="report")
            result.update({k: v.copy() for k, v in group.layout.views(full).items()})
        return {name: result[name] for name in self.names}

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind (``memory.KINDS``), read from the buffers themselves."""
        total = dict.fromkeys(KINDS, 0)
        for group in self.groups:
            for kind, nbytes in group.memory().items():
                total[kind] += nbytes
        total["comm"] += self.collectives.bucket_bytes
        return total

    def memory_report(self) -> dict:
        """Bytes held now and at the peak so far, by kind; the peak total; the process's peak RSS."""
        log = self.memory_log
        return {"now": self.memory(), "peak": dict(log.peak), "peak_total": log.peak_total, "rss": peak_rss_bytes()}


def _make_read_only(view) -> None:
    if isinstance(view, np.ndarray):
        view.flags.writeable = False


def _check_params(params: Mapping, group_names) -> str | None:
    if not isinstance(params, Mapping) or not params:
        return "params must be a non-empty dict of arrays"
    listed = [n for names in group_names for n in names]
    if sorted(listed) != sorted(params):
        return f"groups must list every parameter exactly once, got {listed} for {list(params)}"
    for name, a in params.items():
        if getattr(a, "dtype", None) != PARAM_DTYPE:
            return f"parameter {name!r} must be float32, got {getattr(a, 'dtype', type(a).__name__)}"
        if a.size == 0:
            return f"parameter {name!r} has no elements (shape {tuple(a.shape)})"
    return None


def _digest(params: Mapping) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in params.values():
        h.update(np.ascontiguousarray(to_host(a)).tobytes())
    return h.hexdigest()
