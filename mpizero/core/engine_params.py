"""The engine's parameters as callers use them: gathered whole, group by group, and released; and the memory log
told what each group holds after each change (``ZeroEngine``'s part that the forward and backward passes call)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from mpizero.comm import agree
from mpizero.core.group import ParamState


class ParamAccess:
    """Gathering and releasing ``ZeroEngine``'s full parameters (a part of the engine: it uses its groups,
    collectives, config and memory log)."""

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
        if group.plan.gathers_params:
            self._gathered.add(index)
            self.peak_gathered_groups = max(self.peak_gathered_groups, len(self._gathered))
        self._sample_after([index])
        return group.views() if group.state is ParamState.UNSHARDED else {}

    def agree_keep_gathered(self, keep: bool) -> None:
        """Check a trainer's ``keep_gathered`` (keep stage 3's units gathered through a step's passes) on every rank:
        the same on all of them (else each would wait in gathers the others skip), a bool, and only at stage 3."""
        agree.raise_unless_equal(self.collectives, {"keep_gathered": keep})
        if not isinstance(keep, bool):
            raise TypeError(f"keep_gathered must be True or False, got {keep!r}")
        if keep and not self.groups[0].plan.gathers_params:
            raise ValueError(
                f"keep_gathered keeps stage 3's units gathered through a step; at stage {self.config.stage} every "
                "rank holds the full params anyway: leave it False"
            )

    def full_params(self, index: int):
        """Group ``index``'s full params, flat and padded (every rank's, at stages 0-2; at 3 while gathered)."""
        return self.groups[index].full_params

    def release(self, index: int) -> None:
        """Free group ``index``'s full params if the stage keeps only shards."""
        self.groups[index].release()
        self._gathered.discard(index)
        self._note_held([index])

    @property
    def step_number(self) -> int:
        """The step being taken now (counting skipped steps), for messages."""
        return self.step_count + self.skipped_steps + 1

    def _note_held(self, indices: Iterable[int] | None = None) -> None:
        """Tell the memory log what groups ``indices`` (default: all) hold now; each call after a group changes."""
        for index in range(len(self.groups)) if indices is None else indices:
            self.memory_log.note(index, self.groups[index].memory())

    def _sample_handing_in(self, indices: Iterable[int], *contributions) -> None:
        """One sample as ``contributions`` (dicts by name) are handed in for groups ``indices``: the groups as
        noted, plus the caller's gradients among the grads. They are alive while the engine reads them (a
        layer-wise trainer's unit gradient, autograd's ``.grad``) and gone by the sample after."""
        names = [name for index in indices for name in self.groups[index].layout.names]
        handed = sum(
            getattr(grads[name], "nbytes", 0)
            for grads in contributions
            if isinstance(grads, Mapping)
            for name in names
            if name in grads
        )
        self.memory_log.sample({"comm": self.collectives.held_bytes, "grads": handed})

    def _sample_after(self, indices: Iterable[int] | None = None) -> None:
        """``_note_held(indices)``, then one sample of the bytes held now: the groups' as noted, and the
        communicator's."""
        self._note_held(indices)
        self.memory_log.sample({"comm": self.collectives.held_bytes})


def _make_read_only(view) -> None:
    if isinstance(view, np.ndarray):
        view.flags.writeable = False
