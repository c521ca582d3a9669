"""One flat group's gradients during a step: streamed into the int64 sum, kept beyond the cap, reduced, decoded.

Glossary (with ``group``'s, these names and no others):

- local grads: this rank's contributions summed in the reduction's wire dtype
  (int64 for ``exact``), padded numel; kept between steps unless gradients are
  sharded (stages 0-1).
- round: one backward pass's contribution of the group, summed over ranks at
  once (stages 2-3 when gradients stream in round by round). On one host each
  rank adds its encoded block for each owner straight into that owner's
  accumulator (``OwnerSums``); elsewhere it is encoded into a round buffer and
  reduce-scattered by MPI.
- streamed sum: the sum over ranks of the encoded contributions over this rank's
  owned range, at the step's predicted scales (``reduced``; on one host, this
  rank's accumulator of the owner sums).
- waiting: a contribution whose arrays the caller gave up, held (not copied)
  until the next one arrives, so that the two are encoded into the local grads
  in one pass (``encode_pair``: the bytes of two encodes, 12 bytes an element
  and contribution instead of 20); the last one alone is encoded before the
  step's agreement (``flush``).
- kept: elements the stream left out (beyond the cap, or a tensor with no
  prediction), held as float32 arrays until the step's scales are agreed, then
  encoded at the chosen scales and reduced in one more collective.
- spill: on a device, where a pass puts the elements it leaves out of tensors
  that have a prediction, so that no backward waits to learn what to hold
  (``group_encode``); encoded with the kept elements once the scales are agreed.
- grad shard: the averaged float32 gradient over the owned range, where the
  group's place keeps it (on a device decoded by the update as it reads the
  sum: ``defers_decode``) (``states``; offloaded: written to the group's file
  once decoded, and read in again for the update).
- grad blocks: stage 0 on one host, the grad shard as node-shared blocks
  (``decode_block``): each rank reduces, rescales and decodes only its block,
  whose segments are ``decoded_segments``, and reads every rank's in place.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np

from mpizero.arrays import read_back, to_host
from mpizero.core.reduce import arithmetic, exact
from mpizero.core.stages import GradientCollective


class Keep(enum.Enum):
    """How to hold the arrays whose elements a contribution's stream left out, until the step's scales are agreed."""

    COPY = "copy"  # the caller may write its arrays again: hold a copy
    REFERENCE = "reference"  # the caller gives its arrays up: hold them
    REDO = "redo"  # hold nothing: an element left out makes the step run again, holding (the caller can redo)


class Waiting(NamedTuple):
    """A contribution handed in but not yet encoded, and how to hold what its encode leaves out."""

    grads: dict  # this group's arrays by name (the caller's dict may change)
    keep: Keep
    measure: bool


class GroupGradients:
    """The gradient buffers of one flat group on one rank, through one step."""

    def __init__(self, layout, plan, xp, segments, place) -> None:
        self.layout, self.plan, self.partition, self.xp = layout, plan, plan.partition, xp
        start, stop = plan.owned_range
        self.owned_numel = stop - start
        self.place = place  # where the grad shard lives (``states``), and the streamed sum between rounds
        self.local_grads = self.reduced = self.pending_reduce = self.pending_result = None
        self.sums = None  # on one host: the node-shared accumulators rounds are summed into (the communicator's)
        self.grad_blocks = None  # stage 0 on one host: the node-shared averaged grads (``decode_block``)
        # (tensor index, start, stop) of each tensor's piece this rank sums and decodes: of the owned range
        # (owned-relative), or of its block of the node-shared grads (``decode_block``)
        self.decoded_segments = segments
        self.kept: dict[int, list] = {}  # tensor index -> [(array, lowest magnitude bits left out)]
        self.waiting: Waiting | None = None
        self.spill = None  # on a device with the exact reduction: the group's spill (``group_encode.Spill``)
        self.spilling = True  # False in a pass run again to hold what an overflowed spill could not
        self.device_buffers: dict = {}  # on a device: the step's buffers, kept between steps (``_made_once``)
        self.deferred = None  # the step's sum and divisors, where the update decodes (``defers_decode``)
        self.rounds_waiting = False  # the one waiting is a round's: it is summed over ranks, not into local grads
        self.accumulated, self.rounds_reduced, self.decoded = False, 0, False  # this step's progress

    def decode_block(self, blocks, segments) -> None:
        """Sum and decode only this rank's block of the averaged gradient (``segments``, block-relative) into its
        block of ``blocks``, node-shared averaged grads every rank reads whole once all are written: the owners'
        all-reduce, each element summed and decoded once on the host instead of once on every rank."""
        self.grad_blocks, self.decoded_segments = blocks, segments

    @property
    def _averaged_numel(self) -> int:
        """The elements this rank sums and decodes: its block of node-shared grads, else its owned range."""
        return self.grad_blocks.own.size if self.grad_blocks is not None else self.owned_numel

    @property
    def scatters(self) -> bool:
        return self.plan.gradient_collective is GradientCollective.REDUCE_SCATTER

    def _on_arena(self, collectives) -> bool:
        """Whether this group's gradients are summed out of a node-shared arena (host buffers, one host)."""
        return collectives.shared and self.xp is np

    def keep_local_grads(self, collectives, reduction) -> None:
        """Allocate the local grads kept between steps (stages 0-1; collective where shared: at set-up)."""
        if self.plan.keeps_local_grads:
            padded, wire = self.partition.padded_numel, reduction.wire_dtype
            on_arena = self._on_arena(collectives)
            self.local_grads = (
                collectives.shared_buffer(padded, wire, id(self)) if on_arena else self.xp.zeros(padded, dtype=wire)
            )

    def accumulate(self, reduction, grads, predictions, keep: Keep, measure: bool, may_wait: bool) -> list:
        """Fold one contribution into the local grads (no communication); return each contribution encoded now
        with its maxima and left-out counts, ``[(Waiting, (tops, outside))]``. ``may_wait``: the caller will not
        write these arrays again and pairing is on, so where the reduction pairs they may wait, unencoded, for the
        next contribution (none encoded now, or both). A pass's ``predictions`` are the same for every
        contribution, and ``end_step`` drops one still waiting, so a pair is always encoded at the scales of both."""
        arrived = Waiting({spec.name: grads[spec.name] for spec in self.layout.specs}, keep, measure)
        # a round waiting (a misuse the engine has noted) is left to the collective every rank makes for it
        pair = [arrived] if self.rounds_waiting else self._pair(arrived, may_wait and reduction.pairs)
        if not pair:
            return []
        if self.local_grads is None:
            self.local_grads = self.xp.empty(self.partition.padded_numel, dtype=reduction.wire_dtype)
        found = self._encode(reduction, self.local_grads, [c.grads for c in pair], predictions, not self.accumulated)
        self.accumulated = True
        return self._kept_and_found(pair, found, predictions)

    def _pair(self, arrived: Waiting, may_wait: bool) -> list[Waiting]:
        """The contributions to encode now: none (``arrived`` waits for a partner), the one waiting and
        ``arrived``, or ``arrived`` alone."""
        if self.waiting is None and may_wait:
            self.waiting = arrived
            return []
        pair = [arrived] if self.waiting is None else [self.waiting, arrived]
        self.waiting = None
        return pair

    def _encode(self, reduction, total, contributions: list, predictions, assign: bool, start: int = 0) -> list:
        """Encode one or two contributions' arrays into ``total`` in one pass; each one's (maxima, left out)."""
        spill = self.active_spill
        if len(contributions) == 1:
            return [reduction.encode(total, contributions[0], self.layout, predictions, assign, start, spill)]
        return reduction.encode_pair(total, *contributions, self.layout, predictions, assign, start, spill)

    @property
    def active_spill(self):
        """The spill this pass encodes with (None: the encode reports each contribution's maxima and counts)."""
        return self.spill if self.spilling else None

    def _kept_and_found(self, pair: list[Waiting], found: list, predictions) -> list:
        """Hold what each encoded contribution left out; return ``[(Waiting, (tops, outside))]`` for those with
        arrays (a round's missing contribution has none: ``found`` None)."""
        encoded = [(c, f) for c, f in zip(pair, found) if f is not None]
        for contribution, (_, outside) in encoded:
            self._keep(contribution.grads, predictions, outside, contribution.keep, contribution.measure)
        return encoded

    def flush(self, collectives, reduction, predictions) -> list:
        """Encode the contribution waiting for a partner, if any, alone, at this pass's ``predictions``: into the
        local grads, or a round's summed over ranks (collective: every rank holds one after the same rounds);
        return its maxima and counts (as ``accumulate``)."""
        if self.waiting is None:
            return []
        if self.rounds_waiting:
            return self._reduce_rounds(collectives, reduction, [self.waiting], predictions)
        grads, keep, measure = self.waiting
        self.waiting = None
        return self.accumulate(reduction, grads, predictions, keep, measure, may_wait=False)

    def reduce_round(
        self, collectives, reduction, grads, predictions, keep: Keep, measure: bool, pairs: bool, copy: bool
    ):
        """Sum one round's contribution (or zeros) over ranks into the streamed sum (collective where anything
        streams: every rank computes the same ``predictions``); return each contribution summed now with its
        maxima and left-out counts (as ``accumulate``). With ``pairs`` (the engine's setting, the same on every
        rank) a round waits for the next, and the two are summed in one pass: a contribution the caller gave up as
        it is, one it may write again (``copy``) as a copy."""
        if not any(p is not None for p in predictions):  # nothing to sum this pass: measure or keep only
            if grads is None:
                return []
            found = reduction.measure(grads, self.layout.specs)
            return self._kept_and_found([Waiting(grads, keep, measure)], [found], predictions)
        pairs = pairs and reduction.pairs
        if self.waiting is not None and not self.rounds_waiting:  # a misuse the engine has noted: no collective
            self.flush(collectives, reduction, predictions)
        if grads is not None and pairs and copy and self.waiting is None:  # it will wait: the caller may write it
            grads, keep = {spec.name: grads[spec.name].copy() for spec in self.layout.specs}, Keep.REFERENCE
        pair = self._pair(Waiting(grads, keep, measure), pairs)
        self.rounds_waiting = self.waiting is not None
        return self._reduce_rounds(collectives, reduction, pair, predictions) if pair else []

    def _reduce_rounds(self, collectives, reduction, pair: list[Waiting], predictions) -> list:
        """Sum one or two rounds' contributions over ranks in one collective."""
        self.waiting, self.rounds_waiting = None, False
        shared = self.xp is np and self.place.keeps_sums
        sums = collectives.owner_sums(id(self), self.owned_numel, reduction.wire_dtype) if shared else None
        round_ = self._push_round if sums is not None else self._scatter_round
        present = [c.grads for c in pair if c.grads is not None]
        found = iter(round_(collectives, reduction, present, predictions, sums, len(pair)))
        self.rounds_reduced += 1
        return self._kept_and_found(pair, [None if c.grads is None else next(found) for c in pair], predictions)

    def _push_round(self, collectives, reduction, present: list, predictions, sums, _) -> list:
        """Add this rank's block of the contributions for each owner into that owner's accumulator (one host:
        ``OwnerSums``); return each contribution's (maxima, left out) over the whole buffer."""
        count = len(self.layout.specs)
        found = [([0] * count, [0] * count) for _ in present]
        first = self.rounds_reduced == 0

        def add_block(owner: int, accumulator) -> None:
            start, _ = self.partition.shard_range(owner)
            assign = first and owner == self.plan.rank  # each owner starts its sum, before anyone adds to it
            if not present:
                if assign:
                    accumulator[...] = 0
                return
            blocks = self._encode(reduction, accumulator, present, predictions, assign, start)
            for (tops, outside), (block_tops, block_outside) in zip(found, blocks):
                for index, (top, left) in enumerate(zip(block_tops, block_outside)):
                    tops[index], outside[index] = max(tops[index], top), outside[index] + left

        full_bytes = self.partition.padded_numel * reduction.wire_dtype.itemsize
        collectives.push_reduce(sums, add_block, full_bytes)
        self.sums, self.reduced = sums, sums.own
        return found

    def put_sums_away(self) -> None:
        """Let the place keep the streamed sum until the group's next round or its finish (offloaded: in the file,
        freed here)."""
        self.reduced = self.place.park_sums(self.reduced)

    def _bring_sums_back(self) -> None:
        parked = self.place.unpark_sums()
        if parked is not None:
            self.reduced = parked

    def _scatter_round(self, collectives, reduction, present: list, predictions, _, rounds: int) -> list:
        """Encode this rank's contributions into a round buffer and reduce-scatter it: out of each node's shared
        arena in two levels where the paths say so, else by MPI; narrow where the reduction's rounds are and one
        round travels (``rounds``: the same on every rank, whatever each hands in; ``reduction.round_dtype``:
        every block goes whole to its owner, which widens the blocks into its sum)."""
        self._bring_sums_back()
        padded, wire = self.partition.padded_numel, reduction.wire_dtype
        on_arena = self._on_arena(collectives)
        if collectives.alone and not on_arena:  # the sum over one rank is its own: encoded straight into it
            return self._encode_alone(reduction, present, predictions)
        narrow = reduction.round_dtype if not on_arena and reduction.round_dtype != wire else None
        narrow = narrow if rounds < 2 else None  # a pair's sum need not be a float32 (``rounds``: alike on all ranks)
        if on_arena:
            buffer = collectives.shared_buffer(padded, wire)
        else:
            buffer = collectives.scratch(self.xp, padded, narrow or wire, "round")
        found = []
        if present:
            found = self._encode(reduction, buffer, present, predictions, True)
        else:
            buffer[...] = 0
        first = self.reduced is None
        if first:
            self.reduced = self._made_once("sum", self.owned_numel, wire)
        if narrow is not None:
            blocks = collectives.scratch(self.xp, buffer.size, buffer.dtype, "round blocks")
            collectives.alltoall(buffer, blocks, counted_as="reduce_scatter")
            reduction.widen(blocks.reshape(-1, self.owned_numel), self.reduced, first)
        elif first:
            collectives.reduce_scatter(buffer, self.reduced)
        else:
            collectives.reduce_scatter_add(buffer, self.reduced)
        return found

    def _encode_alone(self, reduction, present: list, predictions) -> list:
        """One rank's round: its contributions encoded into the streamed sum itself (its whole padded range), no
        round buffer and no collective; the same integers as a round buffer reduce-scattered over one rank. On a
        device the sum's buffer is made once (``_made_once``)."""
        first = self.reduced is None
        if first:
            self.reduced = self._made_once("sum", self.owned_numel, reduction.wire_dtype)
        if present:
            return self._encode(reduction, self.reduced, present, predictions, first)
        if first:
            self.reduced[...] = 0
        return []

    def _made_once(self, role: str, numel: int, dtype):
        """A buffer of this group's step (``role``: the streamed sum, or a reduction's result): on a device the one
        kept between steps (made at the first), so that no step allocates it; on the host a new one (freed with
        the step)."""
        if self.xp is np:
            return np.empty(numel, dtype=dtype)
        if role not in self.device_buffers:
            self.device_buffers[role] = self.xp.empty(numel, dtype=dtype)
        return self.device_buffers[role]

    def _keep(self, grads, predictions, outside, keep: Keep, measure: bool) -> None:
        """Hold the arrays whose elements the stream left out (only those elements are encoded from them later);
        with ``measure``, a tensor with no prediction is only measured (the step will be redone). With a spill a
        tensor with a prediction left nothing to hold (its spill has it), and one with none left out everything:
        nothing is read back. On a device what is held is held in host memory (the run's first step holds every
        contribution, which the device's memory is not sized for); without a spill the counts come back in one
        copy. ``Keep.REDO`` holds nothing and copies nothing back."""
        if keep is Keep.REDO:
            return
        on_device = self.xp is not np
        if self.active_spill is not None:  # tensors with a prediction spilled what they left out; the rest left out all
            outside = [spec.numel if p is None else 0 for spec, p in zip(self.layout.specs, predictions)]
        elif on_device:
            outside = read_back(outside)
        for index, (spec, prediction, left_out) in enumerate(zip(self.layout.specs, predictions, outside)):
            if int(left_out) and not (measure and prediction is None):
                x = grads[spec.name].reshape(-1)
                held = to_host(x) if on_device else x if keep is Keep.REFERENCE else x.copy()
                lowest = 0 if prediction is None else prediction.cap_bits
                self.kept.setdefault(index, []).append((held, lowest))

    def start_reduce(self, collectives, reduction, blocking: bool, streams: bool) -> None:
        """Start the one gradient collective of the local grads, unless the sum was reduced round by round or
        nothing streamed. Every rank calls this for the same groups in the same order."""
        if self.rounds_reduced or not streams:
            return
        padded, wire = self.partition.padded_numel, reduction.wire_dtype
        local = self.local_grads
        if self._on_arena(collectives) and not self.plan.keeps_local_grads:
            local = collectives.shared_buffer(padded, wire)  # the arena's zero-copy sum beats MPI's by far
            if self.accumulated:
                local[...] = self.local_grads
            self.local_grads = None
        elif local is None:
            local = self.local_grads = self.xp.empty(padded, dtype=wire)
        if not self.accumulated:
            local[...] = 0
        alone = collectives.alone and not self._on_arena(collectives)  # one rank's sum is its own: no copy
        result = local if alone else self._made_once("result", self._averaged_numel, wire)
        self.pending_reduce = self._collective(collectives, local, result, blocking)
        self.pending_result = result

    def _collective(self, collectives, local, result, blocking: bool):
        if self.scatters:
            return collectives.reduce_scatter(local, result, blocking)
        if self.grad_blocks is not None:  # the owners' all-reduce: this rank's block now, the rest read in place
            return collectives.reduce_scatter(local, result, blocking, counted_as="allreduce")
        return collectives.allreduce(local, result, blocking)

    def finish_reduce(self, collectives, reduction, used, chosen, count: int, any_kept) -> None:
        """Complete the streamed sum, bring it to the chosen scales, add the kept elements (one more collective
        where any rank kept some), and decode the averaged grad shard (once a step)."""
        if self.decoded:
            return
        self._bring_sums_back()
        if self.pending_reduce is not None:
            self.pending_reduce.wait()
            self._add_reduced(self.pending_result)
        wire = reduction.wire_dtype
        total = self.reduced if self.reduced is not None else self.xp.zeros(self._averaged_numel, dtype=wire)
        shifts = [0 if p is None else p.k - k for p, k in zip(used, chosen)]
        reduction.rescale(total, self.decoded_segments, shifts)
        if any(any_kept):
            buffer = self.xp.empty(self.partition.padded_numel, dtype=wire)
            reduction.encode_kept(buffer, self.kept, self.layout.specs, chosen, exact.INF_BITS)
            if self.active_spill is not None:
                self.spill.encode_into(buffer, [spec.offset for spec in self.layout.specs], chosen)
            kept_sum = self.xp.empty(self._averaged_numel, dtype=wire)
            self._collective(collectives, buffer, kept_sum, True)
            total += kept_sum
        if reduction.fuses_decode and self.defers_decode:  # the update decodes as it reads, or whoever reads first
            self.deferred = arithmetic.Decoding(total, tuple(reduction.divisors(self.decoded_segments, chosen, count)))
            self._free_step_buffers()
            self.decoded = True
            return
        shard = self.place.decode_target()
        decoded = shard if self.grad_blocks is None else self.grad_blocks.own
        decoded[...] = 0
        for index, lo, hi in self.decoded_segments:
            reduction.decode(total[lo:hi], chosen[index], count, decoded[lo:hi])
        if self.grad_blocks is not None:
            collectives.decoded_in_place(self.grad_blocks)
        self.place.decoded(shard)
        self._free_step_buffers()
        self.decoded = True

    @property
    def defers_decode(self) -> bool:
        """Whether the step's decode may wait for the update, which then decodes as it reads (a device's sum, not
        node-shared; the reduction's ``fuses_decode`` says whether it does): one launch a group for both."""
        return self.xp is not np and self.grad_blocks is None

    def take_deferred(self) -> arithmetic.Decoding | None:
        """The step's sum still to decode (``arithmetic.Decoding``), handed to the update (None when decoded
        already)."""
        deferred, self.deferred = self.deferred, None
        return deferred

    def decode_deferred(self) -> None:
        """Decode the step's sum into the grad shard now, if the update has not (a read of the grads before it)."""
        deferred = self.take_deferred()
        if deferred is not None:
            arithmetic.device_decode_segments(self.xp, deferred.total, deferred.segments, self.place.grad_shard)

    def _add_reduced(self, shard) -> None:
        if self.reduced is None:
            self.reduced = shard
        else:
            self.reduced += shard

    def end_step(self) -> None:
        """Complete any collective in flight and forget this step's gradients (used, skipped or to be redone)."""
        if self.pending_reduce is not None:
            self.pending_reduce.wait()
        if self.sums is not None:
            self.sums.unmap_others()
        self._free_step_buffers()
        self.place.forget_step()
        self.accumulated, self.rounds_reduced, self.decoded = False, 0, False

    def _free_step_buffers(self) -> None:
        self.reduced = self.pending_reduce = self.pending_result = self.waiting = None
        self.rounds_waiting = False
        self.kept = {}
        if not self.plan.keeps_local_grads:
            self.local_grads = None

    def held_bytes(self) -> int:
        """Bytes of the caller's gradients held: elements kept beyond the cap, and a contribution waiting."""
        grads = {} if self.waiting is None else self.waiting.grads or {}
        waiting = sum(int(g.nbytes) for g in grads.values())
        return waiting + sum(int(a.nbytes) for arrays in self.kept.values() for a, _ in arrays)

    def comm_bytes(self) -> int:
        """Bytes of this step's gradient buffers (an owner sums accumulator is the communicator's: not counted), and
        of the spill and its device stats, made once."""
        made_once = list(self.device_buffers.values())
        private = None if self.sums is not None and self.reduced is self.sums.own else self.reduced
        private = None if any(private is b for b in (self.local_grads, *made_once)) else private
        result = None if any(self.pending_result is b for b in (self.local_grads, *made_once)) else self.pending_result
        kept = sum(0 if b is None else b.nbytes for b in (self.spill, *made_once))
        return kept + sum(0 if b is None else b.nbytes for b in (self.local_grads, private, result))
