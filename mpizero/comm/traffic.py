"""The traffic tally: every collective a ``Collectives`` makes, counted in calls, bytes and seconds, so that
communication volume is measured, not assumed; on several nodes the bytes that leave the node are counted apart."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

from mpizero.comm.paths import inter_node_bytes


@dataclass
class Traffic:
    """Per collective: calls, bytes this rank sent and received (ring/recursive algorithms), and seconds inside.

    ``inter_node``: of the bytes sent, those sent to ranks on other nodes (``paths.inter_node_bytes``);
    counted for array collectives, not for ``agreement`` (control messages of a few bytes).
    """

    calls: Counter = field(default_factory=Counter)
    sent: Counter = field(default_factory=Counter)
    received: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)  # wall time blocked in the call (or its wait), not overlapped
    inter_node: Counter = field(default_factory=Counter)
    staged: Counter = field(default_factory=Counter)  # bytes copied between device and host, both ways

    def record(self, op: str, full_bytes: int, world_size: int, nodes: int = 1, two_level: bool = False) -> None:
        """Count one call on a full (unsharded) buffer of ``full_bytes`` over ``nodes`` nodes."""
        factor = 2 if op == "allreduce" else 1
        moved = factor * full_bytes * (world_size - 1) // world_size
        self.calls[op] += 1
        self.sent[op] += moved
        self.received[op] += moved
        self.inter_node[op] += inter_node_bytes(full_bytes, world_size, nodes, two_level, factor)

    def intra_node(self, op: str) -> int:
        """Bytes of ``op`` this rank sent to ranks on its own node."""
        return self.sent[op] - self.inter_node[op]

    def record_control(self, payload: int, received: int) -> None:
        """Count one small control call (``agreement``): the payload this rank hands in, and what it gets back.

        A reduction or broadcast gets back one payload whatever the number of ranks; a gather gets every rank's.
        """
        self.calls["agreement"] += 1
        self.sent["agreement"] += payload
        self.received["agreement"] += received

    @contextlib.contextmanager
    def timed(self, op: str):
        """Add the wall time of the ``with`` body to ``seconds[op]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[op] += time.perf_counter() - start

    def clear(self) -> None:
        for counter in (self.calls, self.sent, self.received, self.seconds, self.inter_node, self.staged):
            counter.clear()
