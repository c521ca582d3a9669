"""Errors every rank agrees on, so no rank is left waiting in a collective.

A problem one rank can see (a bad shape, a NaN) is shared with all ranks by a
small collective before anyone enters the next data collective; then every
rank raises the same ``ZeroError``, naming the ranks and their values.

The normal path costs each rank the same at any world size: one small
reduction (a flag, or a digest of the fields). Only once that shows something
is wrong are the details gathered from every rank, to name them exactly.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Hashable

from mpi4py import MPI

from mpizero.errors import ZeroError


def raise_if_any(collectives, problem: str | None, context: str) -> None:
    """Collectively check ``problem`` (None when fine); raise on every rank if any rank has one."""
    said = said_by_any(collectives, problem, context)
    if said:
        raise ZeroError(f"{context}: {said}")


def said_by_any(collectives, problem: str | None, context: str) -> str | None:
    """Every rank's ``problem`` in words (``by_rank``), the same on every rank, or None if no rank has one
    (collective: one flag all-reduce, and the texts gathered only when some rank has one)."""
    if not collectives.allreduce_value(problem is not None, MPI.LOR, f"whether any rank has a problem ({context})"):
        return None
    return by_rank(collectives.allgather_object(problem, context))


def by_rank(found: list) -> str | None:
    """Every rank's problem (a string; anything else is none) in words, each said once with the ranks that have
    it (``rank 3: ...; ranks [0, 1]: ...``); None if no rank has one."""
    ranks_by_text: dict[str, list[int]] = {}
    for rank, text in enumerate(found):
        if isinstance(text, str) and text:
            ranks_by_text.setdefault(text, []).append(rank)
    said = [f"rank {r[0]}: {text}" if len(r) == 1 else f"ranks {r}: {text}" for text, r in ranks_by_text.items()]
    return "; ".join(said) or None


def raise_unless_equal(collectives, fields: dict[str, Hashable]) -> None:
    """Raise on every rank unless all ranks hold the same value of every field, naming field, ranks and values."""
    mine = _digest(fields)
    differs = collectives.bcast_object(mine, "rank 0's set-up digest") != mine
    if not collectives.allreduce_value(differs, MPI.LOR, "whether any rank's set-up differs"):
        return
    everyone = collectives.allgather_object(fields, "the set-up signature")
    for name in fields:
        values = [rank_fields.get(name) for rank_fields in everyone]
        differing = [rank for rank, v in enumerate(values) if v != values[0]]
        if differing:
            shown = "; ".join(f"rank {r}: {_short(values[r])}" for r in [0, *differing[:3]])
            raise ZeroError(f"ranks disagree on {name} (ranks {differing} differ from rank 0): {shown}")


def _short(value, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _digest(fields: dict) -> str:
    """A digest of every field's value, equal on two ranks exactly when their ``repr``s (a ``Concealed`` value's
    digest besides) are."""
    shown = [(name, (v.shown, v.digest.hex()) if isinstance(v, Concealed) else v) for name, v in fields.items()]
    return hashlib.blake2b(repr(sorted(shown)).encode(), digest_size=16).hexdigest()


class Concealed:
    """A value ranks must agree on but no message may show (a salted digest of a secret): shown as ``shown``,
    equal to another only where both ``digest``s are, compared in constant time."""

    def __init__(self, shown: str, digest: bytes) -> None:
        self.shown, self.digest = shown, digest

    def __repr__(self) -> str:
        return repr(self.shown)

    def __eq__(self, other) -> bool:
        same_shown = isinstance(other, Concealed) and other.shown == self.shown
        return same_shown and hmac.compare_digest(self.digest, other.digest)

    def __hash__(self) -> int:
        return hash(self.shown)
