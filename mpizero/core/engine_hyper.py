"""The optimizer's hyper-parameters of a step, read once and agreed by every rank (``ZeroEngine``'s part that a
learning-rate schedule meets)."""

from __future__ import annotations

from mpizero.comm import agree
from mpizero.core.optim import OPTIMIZERS, BoundOptimizer, binding
from mpizero.core.sharded_init import ShardedInit


class HyperAgreement:
    """Reading a step's hyper-parameters from ``ZeroEngine``'s bound optimizer, and naming the ranks whose differ
    (a part of the engine)."""

    def read_hyper(self) -> tuple[tuple | None, int, str | None]:
        """The optimizer's hyper-parameters now, checked: (them, their digest, None), or (None, -1, the problem)."""
        try:
            hyper = self.bound.snapshot()
        except ValueError as error:
            return None, -1, f"optimizer: {error}"
        return hyper, binding.digest(hyper), None

    def _read_hyper(self, tally) -> float:
        """Read this step's hyper-parameters once (a problem is noted on ``tally``); return their digest."""
        if self._hyper is None:
            self._hyper, self._hyper_digest, problem = self.read_hyper()
            if problem is not None:
                tally.note(problem)
        return float(self._hyper_digest)

    def raise_hyper_disagreement(self, hyper: tuple | None, problem: str | None) -> None:
        """Name the ranks whose hyper-parameters could not be read, or the first that differs from rank 0's, on
        every rank (collective)."""
        everyone = self.collectives.allgather_object(problem or self.bound.record(hyper), "the hyper-parameters")
        said = agree.by_rank(everyone)
        if said:
            raise agree.ZeroError(f"step {self.step_number}: {said}")
        rank, group, name = next(
            (r, g, n)
            for r, record in enumerate(everyone)
            for g, (ours, theirs) in enumerate(zip(everyone[0]["groups"], record["groups"]))
            for n in ours["hyper"]
            if ours["hyper"][n] != theirs["hyper"][n]
        )
        values = everyone[0]["groups"][group]["hyper"][name], everyone[rank]["groups"][group]["hyper"][name]
        raise agree.ZeroError(
            f"step {self.step_number}: parameter group {group}'s {name} is {values[0]!r} on rank 0 but {values[1]!r} "
            f"on rank {rank}: every rank must set the same hyper-parameters (the same learning-rate schedule)"
        )


def bind_optimizer(optimizer, params) -> tuple[BoundOptimizer | None, str | None]:
    """The optimizer bound to the tensors of ``params``, or the problem (another kind of object, parameter groups
    that do not cover the tensors exactly once, a Muon group holding a tensor that is not a matrix)."""
    shapes = params.shapes if isinstance(params, ShardedInit) else {n: tuple(a.shape) for n, a in params.items()}
    try:
        return BoundOptimizer(optimizer, shapes), None
    except AttributeError:
        kind = type(optimizer).__name__
        own = ", ".join(f"mpizero.{o.__name__}" for o in OPTIMIZERS.values())
        return None, f"optimizer must be one of {own} (torch's through mpizero.torch), got {kind}"
    except (ValueError, TypeError) as error:
        return None, f"optimizer: {error}"
