"""The update's turn through the groups: each one's states read in, updated, written back; the next read ahead."""

from __future__ import annotations

from collections.abc import Iterator


def in_turn(groups) -> Iterator:
    """Yield each group in order with its states in memory (``place.read_in``), written back after.

    While the caller updates one group, the kernel reads the next one's states ahead (``prefetch``) and writes the
    last one's back from its page cache: the overlap of a reader thread without its thread, whose memory arena
    alone would cost 64 MiB of address space. A read or write that fails does not end the turn: every group is
    still yielded (one whose states could not be read, with zeros), so that every rank takes part in every
    group's collectives; the first error is raised after the last group, for the caller to agree on.
    """
    stored = list(groups)
    failures: list[OSError] = []
    for position, group in enumerate(stored):
        if position + 1 < len(stored):
            stored[position + 1].place.prefetch(failures)
        with group.place.read_in(failures):
            yield group
    if failures:
        raise failures[0]
