"""The ZeRO stage table, and the plan one rank follows for one flat group.

``STAGES`` says which training state each stage shards. ``ShardPlan`` answers
every question the engine, the byte formulas, checkpoints and the command line
ask about one group on one rank: what it owns, what it holds and keeps between
steps, which gradient collective runs, how the new parameters are published and
how many all-gathers a step makes. No other module tests a stage number or a
sharding flag. No MPI here: plain pytest checks it at any world size.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mpizero.core.partition import Partition


@dataclass(frozen=True)
class Sharding:
    """What one ZeRO stage keeps as a per-rank shard instead of a full replica."""

    optimizer: bool
    grads: bool
    params: bool

    def shards(self, kind: str) -> bool:
        """Whether training state ``kind`` (``optimizer``, ``grads`` or ``params``) is sharded."""
        return getattr(self, kind)


STAGES: dict[int, Sharding] = {
    0: Sharding(optimizer=False, grads=False, params=False),
    1: Sharding(optimizer=True, grads=False, params=False),
    2: Sharding(optimizer=True, grads=True, params=False),
    3: Sharding(optimizer=True, grads=True, params=True),
}


def sharding(stage: int) -> Sharding:
    """Return the stage's row of the table, or raise naming the valid stages."""
    try:
        return STAGES[stage]
    except (KeyError, TypeError):
        raise ValueError(f"stage must be one of {sorted(STAGES)}, got {stage!r}") from None


def groups_by_unit(stage: int) -> bool:
    """Whether the stage gathers parameters unit by unit, so each model unit is its own flat group."""
    return sharding(stage).params


def reduce_scatters(stage: int) -> bool:
    """Whether the stage's gradients meet in a reduce-scatter (each rank keeps only its shard of the mean)."""
    return sharding(stage).optimizer


class GradientCollective(enum.Enum):
    """How local gradients become the averaged gradient this rank updates from."""

    ALLREDUCE = "allreduce"  # every rank gets the whole averaged gradient
    REDUCE_SCATTER = "reduce_scatter"  # every rank gets only its shard of it


class Publish(enum.Enum):
    """How the updated master shard reaches the parameters every rank computes with."""

    COPY_FULL = "copy the whole master into the full params"
    COPY_THEN_ALLGATHER = "copy the shard into the full params (none in float32), then all-gather them"
    COPY_SHARD = "copy the shard into the param shard; full params are gathered when used"


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` does with one flat group at one stage."""

    sharding: Sharding
    partition: Partition
    rank: int

    @property
    def shard_range(self) -> tuple[int, int]:
        """This rank's block of the padded flat buffer."""
        return self.partition.shard_range(self.rank)

    @property
    def owns_shard(self) -> bool:
        """Whether this rank updates only its block (grad, master and optimizer state shards), not all of it."""
        return self.sharding.optimizer

    @property
    def owned_range(self) -> tuple[int, int]:
        """What this rank updates (grad, master and optimizer state shards): its block, or all at stage 0."""
        return self.shard_range if self.owns_shard else (0, self.partition.padded_numel)

    @property
    def params_range(self) -> tuple[int, int]:
        """The parameters this rank holds between steps: its param shard at stage 3, the full params otherwise."""
        return self.shard_range if self.sharding.params else (0, self.partition.padded_numel)

    @property
    def keeps_local_grads(self) -> bool:
        """Whether the full local gradient buffer is kept between steps (unsharded gradients)."""
        return not self.sharding.grads

    @property
    def pairs_contributions(self) -> bool:
        """Whether contributions are encoded two in one pass by default: where full local grads are kept anyway,
        the held float32 gradient costs half of them; beside a shard it would be a whole gradient more."""
        return self.keeps_local_grads

    @property
    def reduces_each_round(self) -> bool:
        """Whether a layer-wise trainer reduce-scatters every round of micro-batches at once (sharded gradients:
        DeepSpeed's and FSDP's default), instead of folding rounds into the local grads and reducing once."""
        return self.sharding.grads

    @property
    def gathers_params(self) -> bool:
        """Whether full params exist only between a gather and a release."""
        return self.sharding.params

    def master_is_params(self, param_bytes: int) -> bool:
        """Whether the master is the float32 params this rank holds over its owned range: the full params where
        the optimizer is not sharded (stage 0), this rank's block of them at stages 1-2 (the all-gather in place
        sends it and rewrites only the others'), the param shard at stage 3. Both would hold the same values
        after every publish, so one buffer serves as both and the optimizer updates the params in place."""
        return param_bytes == 4

    @property
    def shares_averaged_grads(self) -> bool:
        """Whether, where every rank shares one host, the averaged gradient every rank needs whole (the optimizer
        not sharded: stage 0) is node-shared: each rank sums and decodes only its block of it and reads the others'
        in place, instead of every rank summing and decoding all of it."""
        return not self.sharding.optimizer

    @property
    def gradient_collective(self) -> GradientCollective:
        """Reduce-scatter when only a shard of the averaged gradient is needed."""
        return GradientCollective.REDUCE_SCATTER if self.sharding.optimizer else GradientCollective.ALLREDUCE

    @property
    def publish(self) -> Publish:
        if self.sharding.params:
            return Publish.COPY_SHARD
        return Publish.COPY_THEN_ALLGATHER if self.sharding.optimizer else Publish.COPY_FULL

    @property
    def norm_needs_all_ranks(self) -> bool:
        """Whether the global gradient norm must be summed over ranks (each holds only its grad shard)."""
        return self.sharding.optimizer

    def allgathers_per_step(self, rounds: int, kept: bool = False) -> int:
        """All-gathers of this group per step: twice per micro-batch round at stage 3, or once where its units are
        kept gathered through the step (``kept``), one publish at 1-2."""
        if self.gathers_params:
            return 1 if kept else 2 * rounds
        return 1 if self.publish is Publish.COPY_THEN_ALLGATHER else 0


def span(numel_range: tuple[int, int]) -> int:
    """The number of elements in a ``(start, stop)`` range."""
    return numel_range[1] - numel_range[0]
