"""Gradients from autograd into the engine, group by group, as soon as a backward pass completes them.

Each backward pass is one contribution. When autograd has finished every
gradient of a group in a backward, the group's gradients go to the engine and
are dropped: reduce-scattered into the streamed sum at once where gradients are
sharded (stages 2-3, one announced ``reduce_round`` per group and backward, as
DeepSpeed and FSDP do), folded into the local grads otherwise (stages 0-1,
``accumulate``). Elements beyond the step's predicted range (rare; ``scales``)
are held until the step's scales are agreed, so no step is redone for them.

Glossary:

- streamed (``step(closure)``): the closure can run again, so a step with no
  prediction yet (the run's first) only measures, and runs again; nothing is
  held.
- kept (``loss.backward(); zero.step()``): nothing can run again, so the first
  step holds each backward's gradients until its scales are agreed; later steps
  hold only elements beyond the prediction.
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
        self.reset()

    def reset(self) -> None:
        """Forget this step's progress (after a step, or ``zero_grad``)."""
        self.handed_in = False  # any backward of this step reached the engine
        self.next_group = len(self.engine.groups) - 1  # the next group to start reducing (descending)
        self._reset_backward()

    def _reset_backward(self) -> None:
        self.current: dict = {}
        self.delivered = False  # this backward produced a counted gradient
        self.taken = False  # ... or any gradient (a backward may reach the outputs and no parameter)
        self.missing = [set(g.layout.names) for g in self.engine.groups]
        self.pending = set(range(len(self.engine.groups)))  # groups not yet handed in this backward

    @property
    def started_reducing(self) -> bool:
        return self.next_group != len(self.engine.groups) - 1

    def take(self, name: str, grad) -> None:
        """Autograd finished ``name``'s gradient of this backward (an array, zero-copy)."""
        group = self.group_of[name]
        self.taken = True
        if self.counted:
            self.current[name], self.delivered = grad, True
        self.missing[group].discard(name)
        if not self.missing[group]:
            self._hand_in(group)
        if self.reduce_in_backward:
            self.start_ready()

    def _hand_in(self, group: int) -> None:
        """Give group ``group``'s gradients of this backward (complete or not) to the engine; drop them."""
        self.pending.discard(group)
        names = self.engine.groups[group].layout.names
        grads = {n: self.current.pop(n) for n in names if n in self.current}
        contribution = grads if self.delivered else None  # partial or empty: the engine names what is missing
        # autograd made these arrays, and nobody writes them again; a closure can run again, a plain loop cannot
        hand_in = {"keep": "reference", "can_redo": self.streaming}
        if self.per_round:
            if self.engine.streams(group):  # the same on every rank: only then is there a collective
                self.announce(Operation.REDUCE_ROUND, group)
            self.engine.reduce_round(group, contribution, **hand_in)
        elif contribution is not None:
            self.engine.accumulate(contribution, groups=[group], **hand_in)
        self.handed_in |= contribution is not None

    def start_ready(self) -> None:
        """Start the reduction of every group this backward has handed in, in descending order (the same on
        every rank)."""
        while self.next_group >= 0 and self.next_group not in self.pending:
            self._start(self.next_group)

    def backward_done(self) -> None:
        """End of one backward: hand in the groups it left incomplete (the engine names the missing tensors); a
        backward that reached no parameter (``torch.autograd.grad`` of the inputs) hands in nothing."""
        if self.taken and (self.delivered or self.per_round):
            for group in sorted(self.pending, reverse=True):
                self._hand_in(group)
        self.reduce_in_backward = False
        self._reset_backward()

    def start_all(self) -> None:
        """Start every group's reduction not yet started (``step()``)."""
        while self.next_group >= 0:
            self._start(self.next_group)

    def _start(self, index: int) -> None:
        """Announce, then start group ``index``'s reduction for the step (the next, in descending order)."""
        self.announce(Operation.REDUCE, index)
        self.engine.start_reduce(index)
        self.next_group = index - 1
