"""Bytes a rank holds, by kind, now and at the peak of a step; and the process's peak RSS.

Kinds: ``params`` (full params at stages 0-2, the param shard at stage 3),
``gathered`` (stage 3's transient full params of gathered units), ``grads``
(the grad shard), ``master`` (the fp32 master shard; 0 where it is the param
shard itself, at stage 3 in float32), ``optimizer`` (the optimizer state
shard), ``comm`` (local grads and reduce buffers in the reduction's wire
dtype). Model states are params + grads + master + optimizer.
"""

from __future__ import annotations

import math
import resource
import sys

KINDS = ("params", "gathered", "grads", "master", "optimizer", "comm")


class MemoryLog:
    """The largest bytes seen per kind, and the largest total, over every sample taken.

    It keeps each group's bytes as last noted and their sum, so that a sample after one group changed (a gather, a
    release, a reduction) costs that group, not the model: a step samples once per group, not once per group pair.
    """

    def __init__(self) -> None:
        self.peak = dict.fromkeys(KINDS, 0)
        self.peak_total = 0
        self._by_group: dict[int, dict[str, int]] = {}
        self._held = dict.fromkeys(KINDS, 0)

    def note(self, index: int, held: dict[str, int]) -> None:
        """Group ``index`` holds ``held`` now (by kind)."""
        before = self._by_group.get(index, {})
        for kind, nbytes in held.items():
            self._held[kind] += nbytes - before.get(kind, 0)
        self._by_group[index] = held

    def sample(self, outside: dict[str, int]) -> None:
        """Take the groups' bytes as noted, plus ``outside`` them (by kind), as one sample."""
        held = {kind: nbytes + outside.get(kind, 0) for kind, nbytes in self._held.items()}
        for kind, nbytes in held.items():
            self.peak[kind] = max(self.peak[kind], nbytes)
        self.peak_total = max(self.peak_total, sum(held.values()))


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def format_bytes(nbytes: float) -> str:
    """``1536`` -> ``1.5 KiB``; whole bytes below 1 KiB."""
    if abs(nbytes) < 1024:
        return f"{nbytes:.0f} B"
    power = min(int(math.log(abs(nbytes), 1024)), 3)
    return f"{nbytes / 1024**power:.1f} {('KiB', 'MiB', 'GiB')[power - 1]}"
