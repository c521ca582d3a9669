"""Every collective the PyTorch bridge starts is announced first, so ranks that do different things find out.

Glossary:

- operation: what a rank is about to do collectively (``Operation``): gather a
  group's parameters for a forward or backward at stage 3, take a step, read or
  load a state dict, ...
- announcement: one small all-reduce, the same size whatever the operation,
  made before the operation's own collectives. When every rank announces the
  same operation on the same group, it goes ahead. When ranks differ (one calls
  ``step()`` while the others still gather for a forward), every rank learns so
  from the same announcement and raises the same error, naming what each rank
  did and the fix; no rank is left waiting in a mismatched collective.
- joined: a rank that has left ``join()`` (DDP's ``Join``): it has no more
  backward passes this step, and it takes part in the gathers and per-round
  reductions of the ranks that still have, until every rank has joined. Its
  part in a gather ends at once, so a gather announced while some rank has
  joined ends at once on every rank (``others_joined``): a prefetch left in
  flight would end later, out of step with the joined ranks' (the two-level
  all-gather ends with a node-wide copy every rank of the node takes part in).
- leaving the passes: an announced operation outside ``KEPT_THROUGH`` (or a
  mismatch) ends what stage 3 keeps gathered (``params.Binder.drop_kept_gathered``),
  on every rank at the same announcement, before the operation reads or sets
  the params.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from mpizero.errors import ZeroError

NOTHING = -(1 << 40)  # what a joined rank announces in the fields it has no value for (below any real one)


class Operation(enum.IntEnum):
    """Collective operations of the bridge, as announced."""

    JOINED = 0
    GATHER = 1
    STEP = 2
    CLIP = 3
    STATE_DICT = 4
    LOAD_STATE_DICT = 5
    GATHERED = 6
    SAVE = 7
    LOAD = 8
    MASTER_PARAMS = 9
    REDUCE_ROUND = 10
    REDUCE = 11
    DISCARD = 12
    OPTIMIZER_STATE_DICT = 13
    LOAD_OPTIMIZER_STATE_DICT = 14
    READ_GRADS = 15
    EVAL_GATHER = 16
    RESHARD = 17


DESCRIBED = {
    Operation.JOINED: "left zero.join() (no more backward passes this step)",
    Operation.GATHER: "gathered parameters for a forward or backward",
    Operation.STEP: "called step()",
    Operation.CLIP: "called clip_grad_norm_()",
    Operation.STATE_DICT: "called state_dict()",
    Operation.LOAD_STATE_DICT: "called load_state_dict()",
    Operation.GATHERED: "entered gathered()",
    Operation.SAVE: "called save()",
    Operation.LOAD: "called load()",
    Operation.MASTER_PARAMS: "called master_params()",
    Operation.REDUCE_ROUND: "reduce-scattered a backward's gradients",
    Operation.REDUCE: "called step() or clip_grad_norm_(), reducing the step's gradients",
    Operation.DISCARD: "called zero_grad() after backward passes, dropping them",
    Operation.OPTIMIZER_STATE_DICT: "called optimizer.state_dict()",
    Operation.LOAD_OPTIMIZER_STATE_DICT: "called optimizer.load_state_dict()",
    Operation.READ_GRADS: "read a parameter's .grad (reducing the step's gradients)",
    Operation.EVAL_GATHER: "gathered parameters for a forward without gradients (evaluation, torch.no_grad())",
    Operation.RESHARD: "called reshard()",
}
SHADOWED = (Operation.GATHER, Operation.EVAL_GATHER, Operation.REDUCE_ROUND)  # what joined ranks take part in
# what uneven training passes mismatch; an evaluation's gathers are told apart from training's, so that one
# run on some ranks only (``if rank == 0: evaluate()``) is named as a call those ranks alone made
PASSES = (Operation.GATHER, Operation.REDUCE_ROUND, Operation.JOINED, Operation.STEP, Operation.REDUCE)
BY_GROUP = (*SHADOWED, Operation.REDUCE)  # operations on one group, named with it
# what stage 3's kept groups stay gathered through: the passes, and what reads or drops only their gradients
KEPT_THROUGH = (*SHADOWED, Operation.REDUCE, Operation.CLIP, Operation.READ_GRADS, Operation.DISCARD)


class Announcer:
    """Announce each collective operation to every rank; check they match; serve joined ranks' shadow gathers."""

    def __init__(self, collectives) -> None:
        self.collectives = collectives
        self.leaving_passes: Callable[[], None] = lambda: None  # see the glossary (``Binder.drop_kept_gathered``)
        self.others_joined = False  # whether some rank had joined at the last announcement

    def announce(self, operation: Operation, detail: int = 0, fingerprint: int = 0) -> bool:
        """Announce ``operation`` (on group ``detail``) to every rank; raise on every rank if ranks differ.

        ``fingerprint``: a value every rank should hold the same (a digest); return whether every rank did.
        """
        return self._exchange(operation, detail, fingerprint)[3]

    def _exchange(self, operation: Operation, detail: int, fingerprint: int = 0):
        """One announcement: (any rank joined, the active ranks' operation or None if all joined, its detail,
        whether the active ranks' fingerprints are equal)."""
        active = operation is not Operation.JOINED
        fields = (int(operation), detail, fingerprint)
        mine = [v for field in fields for v in (field, -field)] if active else [NOTHING] * 6
        row = np.array([not active, *mine], dtype=np.int64)
        any_joined, high, low, detail_high, detail_low, print_high, print_low = self.collectives.allreduce_array(
            row, MPI.MAX, "announcement of the next collective operation"
        ).tolist()
        if high == NOTHING:
            return True, None, 0, True
        mismatch = high != -low or detail_high != -detail_low or (any_joined and high not in SHADOWED)
        if mismatch or high not in KEPT_THROUGH:
            self.leaving_passes()
        if mismatch:
            self._raise_mismatch(operation, detail)
        self.others_joined = bool(any_joined)
        return self.others_joined, Operation(high), detail_high, print_high == -print_low

    def _raise_mismatch(self, operation: Operation, detail: int) -> None:
        """Name what every rank announced; raise the same error on every rank."""
        everyone = self.collectives.allgather_object((int(operation), detail), "the announced operations")
        by_what: dict[str, list[int]] = {}
        for rank, (op, group) in enumerate(everyone):
            what = DESCRIBED[Operation(op)] + (f" (group {group})" if op in BY_GROUP else "")
            by_what.setdefault(what, []).append(rank)
        seen = "; ".join(f"ranks {ranks} {what}" for what, ranks in by_what.items())
        if {Operation(op) for op, _ in everyone} - set(PASSES):  # the usual cause: `if rank == 0:` around a call
            fix = (
                "a call only some ranks made must be made on every rank, not under `if rank == 0:` (each is "
                "collective, as FSDP's full state dict is; use its result on one rank)"
            )
        else:
            fix = (
                "where ranks run different numbers of forward and backward passes in a step, run them inside "
                "`with zero.join():` (or step(closure), which does), and call step() on every rank after it"
            )
        raise ZeroError(
            f"ranks started different collective operations: {seen}. Every rank must make the same "
            f"calls in the same order: {fix}"
        )

    def serve_joined(self, shadows: dict) -> None:
        """As a joined rank: take part in the other ranks' gathers and reductions (``shadows[operation](group)``)
        until every rank has joined."""
        while True:
            _, operation, group, _ = self._exchange(Operation.JOINED, 0)
            if operation is None:
                return
            shadows[operation](group)
