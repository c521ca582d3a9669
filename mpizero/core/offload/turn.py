"""The update's turn through the groups: each one's states read in, updated, written back; the next read ahead."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import numpy as np

from mpizero.core.offload.files import GRAD, STATE_DTYPE, SUMS


def in_turn(groups) -> Iterator:
    """Yield each group in order with its states in memory, written back after; groups not offloaded as they are.

    While the caller updates one group, the kernel reads the next one's states ahead (``prefetch``) and writes the
    last one's back from its page cache: the overlap of a reader thread without its thread, whose memory arena
    alone would cost 64 MiB of address space. A read or write that fails does not end the turn: every group is
    still yielded (one whose states could not be read, with zeros), so that every rank takes part in every
    group's collectives; the first error is raised after the last group, for the caller to agree on.
    """
    stored = list(groups)
    if not stored or stored[0].store is None:  # the engine offloads every group or none
        yield from stored
        return
    failures: list[OSError] = []
    for position, group in enumerate(stored):
        if position + 1 < len(stored):
            _attempt(stored[position + 1].store.prefetch, failures)
        store = group.store
        arrays = _attempt(store.read, failures)
        group.hold(arrays or {n: np.zeros(store.numel, STATE_DTYPE) for n in store.names if n != SUMS})
        try:
            yield group
        finally:  # whatever ends the caller's loop, the group reads its file again from now on
            group.drop()
        if arrays is not None:  # never zeros over the states a failed read left on disk
            _attempt(partial(store.write, {n: a for n, a in arrays.items() if n != GRAD}), failures)
        arrays = None  # freed before the next group's are read: one group's states in memory at a time
    if failures:
        raise failures[0]


def _attempt(action, failures: list[OSError]):
    """``action()``, or None with its OSError added to ``failures``."""
    try:
        return action()
    except OSError as error:
        failures.append(error)
        return None
