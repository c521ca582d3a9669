"""The ZeRO engine: sharded training state over an MPI communicator.

Each step takes this rank's local gradients (one dict, or a list of dicts for
several micro-batches), averages them over all ranks through the stage's
collective, updates the owned range with the optimizer, and makes the new
parameters available again. ``group`` names every buffer; ``stages`` says
which are sharded.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
from mpi4py import MPI

from . import agree
from .arrays import array_module, to_host
from .collectives import Collectives
from .config import ZeroConfig
from .exact import max_abs
from .group import FlatGroup
from .layout import FlatLayout
from .partition import Partition
from .reduction import REDUCTIONS
from .stages import sharding

GRAD_DTYPE = np.dtype(np.float32)


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
        stage: int = 2,
        reduction: str = "exact",
        groups: Sequence[Sequence[str]] | None = None,
        align: int = 1,
    ) -> None:
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.config = ZeroConfig(stage=stage, reduction=reduction, align=align)
        self.optimizer = optimizer
        self.reduction = REDUCTIONS[self.config.reduction]
        self.collectives = Collectives(self.comm)
        self.step_count = 0
        group_names = [list(params)] if groups is None else [list(g) for g in groups]
        agree.raise_if_any(self.comm, _check_params(params, group_names), "bad parameters")
        agree.raise_unless_equal(self.comm, self._signature(params, group_names), "the model and settings")
        agree.raise_unless_equal(self.comm, _digest(params), "initial parameter values")
        xp = array_module(next(iter(params.values())))
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        plan = sharding(self.config.stage)
        self.groups = []
        for names in group_names:
            layout = FlatLayout.from_shapes({n: params[n].shape for n in names})
            partition = Partition(layout.numel, size, self.config.align)
            group = FlatGroup(layout, partition, rank, plan, xp, GRAD_DTYPE, params)
            group.init_optimizer(optimizer.state_names)
            self.groups.append(group)

    def _signature(self, params: Mapping, group_names) -> tuple:
        shapes = tuple((n, tuple(a.shape), str(a.dtype)) for n, a in params.items())
        return (shapes, tuple(map(tuple, group_names)), self.config, repr(self.optimizer))

    @contextlib.contextmanager
    def gathered(self) -> Iterator[dict]:
        """Yield the full parameters by name (read-only); at stage 3 they are freed on exit."""
        views = {}
        try:
            for group in self.groups:
                views.update(group.gather(self.collectives))
            for view in views.values():
                _make_read_only(view)
            yield views
        finally:
            for group in self.groups:
                group.release()

    def step(self, contributions: Mapping | Sequence[Mapping]) -> None:
        """Average this step's gradients over all ranks and update the parameters.

        ``contributions``: this rank's local gradients, a dict by parameter name
        (or a list of such dicts, possibly empty), float32, shaped like the
        parameters. The update uses the mean over every contribution of every rank.
        """
        if isinstance(contributions, Mapping):
            contributions = [contributions]
        self.step_count += 1
        problem = self._check_contributions(contributions)
        stats = self._agree_on_stats(contributions, problem)
        count = int(stats[:, 0].sum())
        if count == 0:
            raise agree.ZeroError(f"step {self.step_count}: no rank handed in any gradients")
        for index, group in enumerate(self.groups):
            column = stats[:, 2 + index]
            bad_ranks = [r for r, v in enumerate(column) if not np.isfinite(v)]
            if bad_ranks:
                raise agree.ZeroError(
                    f"step {self.step_count}: non-finite gradient in group {index} on ranks {bad_ranks}"
                )
            scale = self.reduction.scale_for(float(column.max()), count)
            group.reduce(self.collectives, self.reduction, contributions, scale, count)
            group.update(self.optimizer, self.step_count)
            group.publish(self.collectives)

    def _check_contributions(self, contributions) -> str | None:
        if not isinstance(contributions, Sequence):
            return f"gradients must be a dict or a list of dicts, got {type(contributions).__name__}"
        for i, grads in enumerate(contributions):
            for group in self.groups:
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

    def _agree_on_stats(self, contributions, problem: str | None) -> np.ndarray:
        """Allgather [count, problem flag, max |g| per group] from every rank."""
        local = np.zeros(2 + len(self.groups))
        local[0], local[1] = len(contributions), problem is not None
        if problem is None:
            for index, group in enumerate(self.groups):
                local[2 + index] = max(
                    (max_abs(grads[s.name]) for grads in contributions for s in group.layout.specs),
                    default=0.0,
                )
        stats = np.empty((self.comm.Get_size(), local.size))
        self.comm.Allgather(local, stats)
        if stats[:, 1].any():
            agree.raise_if_any(self.comm, problem, f"step {self.step_count}: bad gradients")
        return stats

    def master_params(self) -> dict[str, np.ndarray]:
        """Return the full float32 master parameters by name on every rank (host arrays)."""
        result = {}
        for group in self.groups:
            full = np.empty(group.partition.padded_numel, dtype=np.float32)
            start, stop = group.partition.shard_range(group.rank)
            owned_start = start - group.owned_range[0]
            shard = to_host(group.master_shard[owned_start : owned_start + stop - start])
            self.comm.Allgather(np.ascontiguousarray(shard), full)
            result.update({k: v.copy() for k, v in group.layout.views(full).items()})
        return result

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind: params, grads, master, optimizer, comm."""
        total: dict[str, int] = {}
        for group in self.groups:
            for kind, nbytes in group.memory().items():
                total[kind] = total.get(kind, 0) + nbytes
        return total


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
        if getattr(a, "dtype", None) != GRAD_DTYPE:
            return f"parameter {name!r} must be float32, got {getattr(a, 'dtype', type(a).__name__)}"
        if a.size == 0:
            return f"parameter {name!r} has no elements (shape {tuple(a.shape)})"
    return None


def _digest(params: Mapping) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in params.values():
        h.update(np.ascontiguousarray(to_host(a)).tobytes())
    return h.hexdigest()
