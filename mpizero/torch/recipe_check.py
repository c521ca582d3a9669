"""Check one's own model: ``check(make_recipe)`` trains it sharded and as a single-rank reference, bit for bit.

``make_recipe()`` builds a fresh ``Recipe`` (the model, the ``torch.optim``
optimizer, optionally a scheduler, the step's micro-batches and the loss) and is
called twice on every rank: once for the sharded run at the current world size
and stage, once for the reference. The reference is plain: torch's forward and
backward on every global micro-batch in order (on every rank, so nothing is
communicated for it), the plain single-rank ``Reference`` for the exact average
and the optimizer's update, and BatchNorm's statistics replayed in order. After
every step the masters, every optimizer state and every buffer must have the
reference's raw bytes; the report names the first element that does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

import mpizero
from mpizero.core.reference import Reference
from mpizero.torch import rng
from mpizero.torch.buffers import BufferSync
from mpizero.torch.optim_bridge import TorchOptimizer
from mpizero.torch.shard import shard
from mpizero.torch.units import trainable


@dataclass
class Recipe:
    """What one training step is: ``batch(step, index)`` gives global micro-batch ``index`` of ``step``,
    ``loss(model, batch)`` its loss; ``micro_batches`` per step, split over the ranks; ``clip_norm``: clip the
    global gradient norm (``clip_grad_norm_``) before each step; ``units``: stage 3's units."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch: Callable[[int, int], object]
    loss: Callable[[torch.nn.Module, object], torch.Tensor]
    micro_batches: int
    scheduler: object = None
    clip_norm: float | None = None
    units: Callable[[torch.nn.Module], Sequence[torch.nn.Module]] | None = None


@dataclass(frozen=True)
class Report:
    """The outcome: steps compared, and the first difference (step, what, tensor, index, both values) or None."""

    steps: int
    difference: tuple | None = None
    checked: list = field(default_factory=list)  # per step: how many bytes were compared

    @property
    def bitwise(self) -> bool:
        return self.difference is None and self.steps > 0

    def __str__(self) -> str:
        if self.difference is None:
            return f"bitwise: {self.steps} steps, {sum(self.checked):,} bytes of masters, optimizer state and buffers"
        step, what, name, index, ours, theirs = self.difference
        return f"MISMATCH at step {step}: {what} {name}{list(index)} sharded {ours!r} != reference {theirs!r}"


def check(make_recipe: Callable[[], Recipe], steps: int = 3, stage: int = 2, comm=None, seed: int = 0) -> Report:
    """Train ``make_recipe()`` for ``steps`` steps sharded (collective) and as the reference; compare every step."""
    if not (isinstance(steps, int) and steps >= 0):
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    ours, theirs = make_recipe(), make_recipe()
    units = ours.units(ours.model) if ours.units else None
    zero = shard(ours.model, ours.optimizer, stage=stage, comm=comm, units=units, seed=seed)
    reference = PlainReference(theirs, seed)
    mine = list(mpizero.split_evenly(ours.micro_batches, zero.engine.comm.Get_size(), zero.engine.comm.Get_rank()))
    checked = []
    for step in range(steps):
        sharded_step(zero, ours, step, mine)
        reference.step(step)
        found, nbytes = first_difference(zero, ours, reference)
        checked.append(nbytes)
        if found is not None:
            return Report(step + 1, (step + 1, *found), checked)
    return Report(steps, None, checked)


def sharded_step(zero, recipe: Recipe, step: int, mine: list[int]) -> None:
    """One step as a user writes it: micro-batches under ``join()`` and ``micro_batch``, clip, step, schedule."""
    with zero.join():
        for index in mine:
            with zero.micro_batch(index):
                recipe.loss(recipe.model, recipe.batch(step, index)).backward()
    if recipe.clip_norm is not None:
        torch.nn.utils.clip_grad_norm_(recipe.model.parameters(), recipe.clip_norm)
    recipe.optimizer.step()
    if recipe.scheduler is not None:
        recipe.scheduler.step()
    recipe.optimizer.zero_grad()


class _Alone:
    """The collectives of a one-process reference: nothing to exchange."""

    def __init__(self) -> None:
        self.comm = _OneRank()

    def allgather_object(self, value, what: str) -> list:
        return [value]

    def allreduce_value(self, value, op, what: str):
        return value

    def bcast_object(self, value, what: str, root: int = 0):
        return value


class _OneRank:
    def Get_rank(self) -> int:  # noqa: N802 (MPI's name)
        return 0


class PlainReference:
    """The recipe trained in one process without sharding: torch's backward, the plain ``Reference``'s update."""

    def __init__(self, recipe: Recipe, seed: int) -> None:
        self.recipe, self.seed = recipe, seed
        self.params = trainable(recipe.model)
        canonical = {id(p): name for name, p in self.params.items()}
        initial = {name: p.detach().cpu().numpy().astype(np.float32) for name, p in self.params.items()}
        self.core = Reference(initial, TorchOptimizer(recipe.optimizer, canonical), clip_norm=recipe.clip_norm)
        self.buffers = BufferSync(recipe.model, _Alone(), lambda hook: hook)  # on the host: no stream to order

    def step(self, step: int) -> None:
        recipe, contributions = self.recipe, []
        device = next(iter(self.params.values())).device
        for index in range(recipe.micro_batches):
            self.buffers.index = index
            with rng.seeded(self.seed, self.core.step_count + self.core.skipped_steps + 1, index, device):
                recipe.loss(recipe.model, recipe.batch(step, index)).backward()
            contributions.append({n: p.grad.detach().cpu().numpy().astype(np.float32) for n, p in self.params.items()})
            for p in self.params.values():
                p.grad = None
        self.buffers.index = None
        self.core.step(contributions)
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(torch.from_numpy(self.core.params[name]))
        self.buffers.settle()
        recipe.optimizer._opt_called = True  # the update above is this optimizer's step, as its scheduler checks
        if recipe.scheduler is not None:
            recipe.scheduler.step()


def first_difference(zero, recipe: Recipe, reference: PlainReference) -> tuple[tuple | None, int]:
    """The first (what, tensor, index, sharded value, reference value) that differs, and the bytes compared."""
    masters = zero.master_params()  # collective
    state = zero.optimizer_state_dict()["state"]  # collective
    order = [name for members in zero.engine.bound.members for name in members]
    pairs = [("master", name, masters[name], reference.core.params[name]) for name in order]
    for number, entry in state.items():
        for key, value in entry.items():
            if key != "step":
                pairs.append((key, order[number], value.numpy(), reference.core.state[order[number]][key]))
    theirs = dict(recipe_buffers(reference.recipe.model))
    pairs += [("buffer", name, b, theirs[name]) for name, b in recipe_buffers(recipe.model)]
    checked = 0
    for what, name, ours, expected in pairs:
        ours, expected = np.asarray(ours), np.asarray(expected)
        checked += ours.nbytes
        if ours.tobytes() != expected.tobytes():
            flat = int(np.flatnonzero(ours.reshape(-1).view(np.uint8) != expected.reshape(-1).view(np.uint8))[0])
            index = np.unravel_index(flat // ours.itemsize, ours.shape) if ours.shape else ()
            return (what, name, tuple(int(i) for i in index), ours[index].item(), expected[index].item()), checked
    return None, checked


def recipe_buffers(model: torch.nn.Module) -> list[tuple[str, np.ndarray]]:
    return [(name, b.detach().cpu().numpy()) for name, b in model.named_buffers()]
