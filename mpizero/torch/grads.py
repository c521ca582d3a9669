"""Gradients from autograd into the engine: kept per backward until ``step()``, or streamed group by group.

Glossary:

- kept: each backward's gradients are kept as a dict (one float32 gradient per
  parameter and backward) until ``step()``, which encodes them once every rank
  agreed on the step's scales: never redone, but the memory grows with the
  micro-batches. What ``loss.backward(); zero.step()`` does.
- streamed: as soon as autograd has finished every gradient of a group, the
  group's gradients are encoded at the scales the engine predicted and dropped:
  reduce-scattered into the grad shard at once where gradients are sharded
  (stages 2-3, as DeepSpeed and FSDP do: one announced ``reduce_round`` per
  group and backward), folded into the local grads otherwise (``accumulate``).
  The memory after backward is the same at any number of micro-batches. A step
  whose prediction failed is redone by running the caller's closure again.
  What ``zero.step(closure)`` does.
"""

from __future__ import annotations

from mpizero.torch.sync import Operation


class GradientIntake:
    """This rank's gradients of the step so far, from autograd's post-accumulate hooks."""

    def __init__(self, engine, group_of: dict[str, int], announce) -> None:
        self.engine, self.group_of, self.announce = engine, group_of, announce
        self.per_round = engine.groups[0].plan.reduces_each_round
        self.streaming = False
        self.counted = True  # False inside ``not_counted()``: gradients are dropped
        self.reduce_in_backward = False  # ``last_backward()``: start each group's reduction once it is complete
        self.kept: list[dict] = []  # kept mode: this step's finished backwards
        self.reset()

    def reset(self) -> None:
        """Forget this step's gradients and progress (after a step, or ``zero_grad``)."""
        self.kept = []
        self.next_group = len(self.engine.groups) - 1  # the next group to start reducing (descending)
        self._reset_backward()

    def _reset_backward(self) -> None:
        self.current, self.delivered = {}, False
        self.missing = [set(g.layout.names) for g in self.engine.groups]

    @property
    def started_reducing(self) -> bool:
        return self.next_group != len(self.engine.groups) - 1

    def take(self, name: str, grad) -> None:
        """Autograd finished ``name``'s gradient of this backward (an array, zero-copy)."""
        group = self.group_of[name]
        if self.counted:
            self.current[name], self.delivered = grad, True
        self.missing[group].discard(name)
        if self.streaming and self.counted and not self.missing[group]:
            self._accumulate(group)
        if self.reduce_in_backward:
            self.start_ready()

    def _accumulate(self, group: int) -> None:
        """Hand group ``group``'s gradients of this backward (complete or not) to the engine; drop them."""
        names = self.engine.groups[group].layout.names
        grads = {n: self.current.pop(n) for n in names if n in self.current}
        if self.per_round:
            self.announce(Operation.REDUCE_ROUND, group)
            self.engine.reduce_round(group, grads)
        else:
            self.engine.accumulate(grads, groups=[group])

    def start_ready(self) -> None:
        """Start the reduction of every complete group, in descending order (the same on every rank)."""
        in_hand = () if self.streaming else [*self.kept, self.current] if self.counted else self.kept
        while self.next_group >= 0 and not self.missing[self.next_group]:
            self._start(self.next_group, in_hand)

    def backward_done(self) -> None:
        """End of one backward: keep its dict, or hand in the groups it left incomplete (the engine names them)."""
        if self.streaming and self.delivered:
            for group, names in enumerate(self.missing):
                if names:
                    self._accumulate(group)
        elif self.current:
            self.kept.append(self.current)
        self.reduce_in_backward = False
        self._reset_backward()

    def start_all(self) -> None:
        """Start every group's reduction not yet started (``step()``), with the kept gradients if kept."""
        in_hand = () if self.streaming else self.kept
        while self.next_group >= 0:
            self._start(self.next_group, in_hand)

    def _start(self, index: int, in_hand) -> None:
        """Announce, then start group ``index``'s reduction for the step (the next, in descending order)."""
        self.announce(Operation.REDUCE, index)
        self.engine.start_reduce(index, in_hand)
        self.next_group = index - 1

    def kept_bytes(self) -> int:
        """Bytes of gradients held here now (kept dicts, and a streamed backward's incomplete groups)."""
        return sum(int(a.nbytes) for grads in [*self.kept, self.current] for a in grads.values())
