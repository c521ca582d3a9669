"""The ZeRO engine: sharded training state over an MPI communicator.

A step averages this rank's local gradients (one dict, or a list of dicts for
several micro-batches) over all ranks, group by group, through the stage's
collective; optionally clips by the global norm; updates the owned range with
the optimizer; and publishes the new parameters. ``group`` names every buffer;
``stages`` says which are sharded. Layer-wise callers (``trainer``) drive the
same steps one group at a time: ``gather``/``release`` parameters, then
``start_reduce`` per group and ``finish_step``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from mpi4py import MPI

from mpizero.arrays import array_module
from mpizero.comm import agree
from mpizero.comm.collectives import Collectives
from mpizero.comm.job import launch
from mpizero.core import build, faults, states
from mpizero.core.config import ZeroConfig
from mpizero.core.engine_hyper import HyperAgreement, bind_optimizer
from mpizero.core.engine_params import ParamAccess
from mpizero.core.engine_state import StateAccess
from mpizero.core.gradients import Keep
from mpizero.core.group import FlatGroup
from mpizero.core.memory import MemoryLog
from mpizero.core.reduce import norm, scales
from mpizero.core.reduce.reduction import REDUCTIONS
from mpizero.core.reduce.tally import FIXED_FIELDS, GroupTally, settle_pending
from mpizero.core.sharded_init import ShardedInit, from_arrays
from mpizero.core.signature import params_problem, setup_signature
from mpizero.core.stages import GradientCollective
from mpizero.core.step import StepOrderError, StepResult, StepState, StepTracker

IN_FLIGHT = 2  # gradient collectives left running at once; older ones are finished to free their buffers


class ZeroEngine(ParamAccess, StateAccess, HyperAgreement):
    """ZeRO stages 0-3 for named float32 parameters, bitwise equal to the single-rank reference.

    ``params``: the full arrays, with the same names, shapes, dtypes and values on
    every rank; or a ``ShardedInit`` (``sharded_init``), from which each rank makes only
    the values it holds, so that at stage 3 no rank ever holds the whole model.
    ``groups`` lists parameter names per flat group (default: one group).
    ``initial_digest`` tells runs apart by their initial values, at any world size.
    """

    def __init__(
        self,
        params: Mapping | ShardedInit,
        optimizer,
        *,
        comm: MPI.Comm | None = None,
        groups: Sequence[Sequence[str]] | None = None,
        **settings,
    ) -> None:
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.config = ZeroConfig(**settings)
        launch.refuse_split_launch(self.config.allow_singleton)
        self.optimizer = optimizer
        self.reduction = REDUCTIONS[self.config.reduction]
        sharded = isinstance(params, ShardedInit)
        self.names = list(params.shapes if sharded else params)
        group_names = [self.names] if groups is None else [list(g) for g in groups]
        problem = params_problem(params, group_names)
        self.bound, bind_problem = bind_optimizer(optimizer, params) if problem is None else (None, None)
        problem = problem or bind_problem
        source = params if sharded or problem is not None else from_arrays(params)  # what fill makes values from
        offloaded, offload_problem = (
            states.rank_directory(self.config, source.device, self.comm.Get_rank(), self)
            if problem is None
            else (None, None)
        )
        problem = problem or offload_problem
        on_device = problem is None and source.device != "cpu"
        self.on_device = on_device
        self.collectives = Collectives(self.comm, self.config.watchdog, on_device)
        self.step_count = self.skipped_steps = 0
        self.peak_gathered_groups = 0
        self._gathered: set[int] = set()  # stage 3's groups whose full params exist (or are being gathered)
        self.memory_log = MemoryLog()
        self._pending: list[int] = []  # groups whose gradient collective is in flight, oldest first
        self._reduced = False  # finish_reduction() left averaged grads for apply_update()
        self._hyper: tuple | None = None  # this step's optimizer hyper-parameters, read at its first reduction
        self._holding = self._hold_next_pass = False  # a pass run again because a rank held nothing (Keep.REDO)
        self._checks: list = []  # callers' checks asked for at the next agreement (``note_problem_at_agreement``)
        agree.raise_if_any(self.collectives, problem, "bad parameters")
        signature = setup_signature(params, group_names, self.config, self.collectives, self.bound.describe())
        agree.raise_unless_equal(self.collectives, signature)
        self.groups: list[FlatGroup] = build.build_groups(
            source, group_names, self.config, self.bound, self.collectives, offloaded and offloaded.path
        )
        self.numel = sum(g.layout.numel for g in self.groups)
        self.pairs = self.config.pairs(self.groups[0].plan)
        if sharded:
            build.agree_held_params(self.groups, self.collectives)
        self.initial_digest = self.master_digest()
        for group in self.groups:
            group.gradients.keep_local_grads(self.collectives, self.reduction)
        self.device_stats = build.device_spills(self.groups, self.reduction) if on_device else None
        self._tracker = StepTracker(len(self.groups))
        tensors = [[s.name for s in g.layout.specs] for g in self.groups]
        self.scales = scales.StepScales(tensors, self.reduction, self.config.scale_headroom)
        self._sample_after()

    # Gradients and updates ------------------------------------------------

    def step(self, contributions: Mapping | Sequence[Mapping] | None = None) -> StepResult:
        """Average this step's gradients over all ranks and update the parameters.

        ``contributions``: this rank's local gradients, a dict by parameter name
        (or a list of such dicts, possibly empty), float32, shaped like the
        parameters, besides any handed in with ``accumulate``. The update uses the
        mean over every contribution of every rank. Gradients given here are held
        until the step ends, and a step that must be redone (``scales``) is redone
        here. After ``accumulate`` the step may say ``redo``: then hand all of its
        gradients in again, those accumulated and those given here.
        """
        listed = [contributions] if isinstance(contributions, Mapping) else contributions
        accumulated = self._tracker.state is not StepState.IDLE  # handed in before this call: only the caller has them
        while True:
            self._begin_step()
            if listed is not None and not isinstance(listed, Sequence):
                for tally in self._tallies:
                    tally.note(f"gradients must be a dict or a list of dicts, got {type(listed).__name__}")
            in_hand = listed if isinstance(listed, Sequence) else ()
            self._sample_handing_in(range(len(self.groups)), *in_hand)
            for index in range(len(self.groups)):
                self.start_reduce(index, in_hand)
            result = self.finish_step()
            if not result.redo or listed is None or accumulated:
                return result

    def accumulate(
        self, grads: Mapping, groups: Sequence[int] | None = None, keep: str = "copy", can_redo: bool = False
    ) -> None:
        """Fold one contribution (this rank's gradients of one micro-batch) into the step; no communication.

        ``groups``: only these groups' tensors, for layer-wise callers that hand a
        group in as soon as backward completes it. Elements within the predicted
        range go into the int64 sum now; the few beyond it are held until the
        step's scales are agreed (``scales``), as copies (``keep="copy"``: the
        caller may reuse its arrays) or as the arrays themselves
        (``"reference"``). ``can_redo``: the caller can hand the step's gradients
        in again (as ``step(closure)`` and the trainer can), so a step with no
        prediction yet only measures them, holding nothing, and says ``redo``; on a
        device such a caller holds nothing at all (``_keep_mode``).
        End the step with ``start_reduce`` for every group and ``finish_step``,
        or with ``step()``.
        """
        self._begin_step()
        indices = range(len(self.groups)) if groups is None else list(groups)
        self._sample_handing_in(indices, grads)
        for index in indices:
            self._hand_in(index, grads, self._keep_mode(keep, can_redo), can_redo, given_up=keep == "reference")
        self._sample_after(indices)

    def _keep_mode(self, keep: str, can_redo: bool) -> Keep:
        """How to hold what a contribution's stream leaves out: as the caller says, except that on a device a caller
        that can redo the step holds nothing (``Keep.REDO``), so that no backward copies its left-out counts back;
        a pass with elements left out then runs again with the same scales, holding them, for the same bits."""
        redo = self.on_device and can_redo and not self._holding
        return Keep.REDO if redo else Keep(keep)

    def _hand_in(self, index: int, grads: Mapping, keep: Keep, can_redo: bool, given_up: bool) -> None:
        """Stream one contribution's tensors of group ``index`` into its local grads, and tally them (those
        encoded now: a contribution whose arrays the caller ``given_up`` may wait to be encoded with the next)."""
        tally = self._tallies[index]
        if self.groups[index].gradients.rounds_reduced or self.groups[index].gradients.rounds_waiting:
            tally.note(f"group {index} was reduced round by round: its gradients cannot also be accumulated")
        if tally.check(grads, self.names):
            gradients = self.groups[index].gradients
            predictions, pairs = self.scales.used[index], given_up and self.pairs
            encoded = gradients.accumulate(self.reduction, grads, predictions, keep, can_redo, pairs)
            self._record_encoded(tally, index, encoded)

    def _record_encoded(self, tally, index: int, encoded) -> None:
        for contribution, found in encoded:
            self._record(tally, index, found, contribution.measure, contribution.keep)

    def _record(self, tally, index: int, found, can_redo: bool, keep: Keep) -> None:
        tally.record(*found)
        tally.measured |= can_redo and not self.scales.streams(index)
        spill = self.groups[index].gradients.active_spill
        spilled = spill is not None and all(p is not None for p in self.scales.used[index])
        tally.unheld |= keep is Keep.REDO and not spilled  # a spill holds what a prediction's cap left out

    def streams(self, index: int) -> bool:
        """Whether this step's pass encodes group ``index`` before the scales are agreed, so that its rounds are
        collective (the same on every rank). Begins the step: before that, the scales are the last step's."""
        self._begin_step()
        return self.scales.streams(index)

    def reduce_round(self, index: int, grads: Mapping | None, keep: str = "copy", can_redo: bool = False) -> None:
        """Reduce-scatter one round of group ``index`` into its streamed sum now, as DeepSpeed and FSDP do.

        Collective: every rank calls it once per round of micro-batches, with its
        contribution or None. No full-size gradient buffer outlives the call.
        Stages with a reduce-scatter only (1-3). ``keep`` and ``can_redo`` as for ``accumulate``.
        """
        self._begin_step()
        if not self._tracker.reduce_round(index, self.step_number):
            return
        group = self.groups[index]
        if group.plan.gradient_collective is not GradientCollective.REDUCE_SCATTER:
            raise StepOrderError(f"reduce_round({index}): stage {self.config.stage} all-reduces; use accumulate")
        tally = self._tallies[index]
        if group.gradients.accumulated or (group.gradients.waiting is not None and not group.gradients.rounds_waiting):
            tally.note(f"reduce_round({index}) after accumulate for that group in the same step")
        if not group.place.keeps_sums:  # offloaded: one group's streamed sum in memory between rounds, and started ones
            for other in set(range(len(self.groups))) - self._tracker.started - {index}:
                self.groups[other].gradients.put_sums_away()
        usable = grads is not None and tally.check(grads, self.names)
        self.collectives.watchdog.context = f"step {self.step_number}, round of group {index}"
        mode = self._keep_mode(keep, can_redo)
        if usable:
            self._sample_handing_in([index], grads)
        encoded = group.gradients.reduce_round(
            self.collectives,
            self.reduction,
            grads if usable else None,
            self.scales.used[index],
            mode,
            can_redo,
            self.pairs,
            keep == "copy",
        )
        self._record_encoded(tally, index, encoded)
        self._sample_after([index])

    def start_reduce(self, index: int, contributions: Sequence[Mapping] = ()) -> None:
        """End group ``index``'s part of the step: agree with every rank on its count, maxima, kept elements and
        problems, choose its scales, and start its gradient collective.

        ``contributions`` given here are held (not copied) until the step ends.
        """
        self._begin_step()
        if not self._tracker.start(index, self.step_number):
            return
        tally = self._tallies[index]
        for grads in contributions:
            self._hand_in(index, grads, Keep.REFERENCE, can_redo=False, given_up=True)
        self._record_encoded(
            tally, index, self.groups[index].gradients.flush(self.collectives, self.reduction, self.scales.used[index])
        )
        self.collectives.watchdog.context = f"step {self.step_number}, group {index}"
        settle_pending(self._tallies)  # every group's device maxima so far, in one copy
        checks, self._checks = self._checks, []
        for problem in filter(None, (check() for check in checks)):
            self.note_problem(problem)
        agreed = self.collectives.agree(tally.agreement_row(self._read_hyper(tally)))
        count, problem, measured, digest, negated = agreed[:FIXED_FIELDS]
        kept, maxima = agreed[FIXED_FIELDS:].reshape(2, -1)  # per tensor: any rank kept elements (2: not held)
        if problem:
            self._end_step()
            agree.raise_if_any(self.collectives, tally.problem, f"step {self.step_number}")
        if digest != -negated:
            self._end_step()
            self.raise_hyper_disagreement(self._hyper, None)
        if count == 0:
            self._end_step()
            raise agree.ZeroError(f"step {self.step_number}: no rank handed in any gradients")
        if not np.isfinite(maxima).all():  # only now find out which ranks: the normal path gathers nothing
            flags = self.collectives.allgather_object(not np.isfinite(tally.maxima).all(), "non-finite flags")
            self._skip(f"non-finite gradient in group {index} on ranks {[r for r, bad in enumerate(flags) if bad]}")
            return
        unheld = bool((kept > 1).any())  # left out where a rank held nothing (Keep.REDO): again, holding
        self._hold_next_pass |= unheld
        try:
            self.scales.choose(index, maxima, int(count), kept > 0, bool(measured) or unheld)
        except OverflowError as error:  # every rank computes the same scales, so every rank gets here
            self._end_step()
            raise agree.ZeroError(f"step {self.step_number}: {error}") from None
        if self.scales.redo:
            return  # every rank knows: no collective for a pass that will be redone
        gradients = self.groups[index].gradients
        gradients.start_reduce(self.collectives, self.reduction, not self.config.overlap, self.scales.streams(index))
        self._pending.append(index)
        self._sample_after([index])
        while len(self._pending) > IN_FLIGHT:  # finish the oldest: its int64 buffers go before the next arrive
            self._finish_reduce(self._pending.pop(0))

    def _finish_reduce(self, index: int) -> None:
        chosen, count, kept = self.scales.chosen[index]
        used = self.scales.used[index]
        self.groups[index].gradients.finish_reduce(self.collectives, self.reduction, used, chosen, count, kept)
        self._note_held([index])

    def _skip(self, problem: str) -> None:
        """Apply ``on_nonfinite`` to an agreed problem: raise it on every rank, or skip the step on every rank."""
        if self.config.on_nonfinite == "raise":
            self._end_step()
            raise agree.ZeroError(f"step {self.step_number}: {problem}")
        self._tracker.skip()
        for group in self.groups:
            group.gradients.end_step()
        self._note_held()

    def finish_step(self) -> StepResult:
        """Finish every group's reduction, clip, update and publish; or skip or redo the step if agreed."""
        ended = self.finish_reduction()
        if ended is not None:
            return ended
        grad_norm = self.clip_grad_norm(self.config.clip_norm) if self.config.clip_norm is not None else None
        return self.apply_update(grad_norm)

    def finish_reduction(self) -> StepResult | None:
        """Finish the step's gradient collectives so the averaged grad shards are ready for ``apply_update``.

        Returns the step's result instead when it ends here: skipped (a non-finite gradient, agreed) or to be
        redone (the scale prediction failed).
        """
        missing = self._tracker.missing()
        if self._tracker.finish(self.step_number):
            self._end_step()
            self.skipped_steps += 1
            return StepResult(self.step_count, skipped=True)
        if missing:
            self._end_step()
            raise agree.ZeroError(f"step {self.step_number}: groups {missing} were never reduced")
        if self.scales.redo:
            self.scales.end_for_redo()
            self._end_step()
            return StepResult(self.step_count, skipped=False, redo=True)
        for index in range(len(self.groups)):
            self._finish_reduce(index)
        self.scales.learn()
        self._end_step()
        if self.reduction.result_can_overflow and self._nonfinite_result():
            self.skipped_steps += 1
            return StepResult(self.step_count, skipped=True)
        self._reduced = True
        return None

    def apply_update(self, grad_norm: float | None = None, hyper: tuple | None = None) -> StepResult:
        """Update the owned range with the averaged gradients of ``finish_reduction`` and publish (collective).

        ``hyper``: the optimizer's hyper-parameters for this update, read and agreed by the caller (default: those
        read and agreed at the step's first reduction).
        """
        if not self._reduced:
            raise StepOrderError("apply_update() needs a finish_reduction() that returned None first")
        self._reduced = False
        self.step_count += 1
        problem = self._update_in_turn(self._hyper if hyper is None else hyper)
        if self.config.offload is not None:
            agree.raise_if_any(self.collectives, problem, f"step {self.step_number - 1}")
        self._note_held()
        return StepResult(self.step_count, skipped=False, grad_norm=grad_norm)

    def _update_in_turn(self, hyper: tuple) -> str | None:
        """Update and publish every group in turn, offloaded ones with their states read in (``states.in_turn``);
        return what failed on disk, if anything (every group is still updated and published)."""
        try:
            for index, group in enumerate(states.in_turn(self.groups)):
                if index == 1:  # the first group written back, the others not yet
                    faults.maybe_kill("update", self.step_count, self.comm.Get_rank())
                group.update(self.bound.rule, hyper, self.step_count, self.collectives)
                group.publish(self.collectives)
                if group.place.reads_in:  # its states read in, the group before's dropped: count both
                    self._sample_after(range(max(index - 1, 0), index + 1))
        except OSError as error:
            return f"offloaded training state: {error}; resume from the last checkpoint"
        return None

    def _begin_step(self) -> None:
        """At a step's first call: fresh tallies, and the scales this pass encodes with (predicted, or forced)."""
        if not self._tracker.begin():
            return
        self._holding, self._hold_next_pass = self._hold_next_pass, False
        if self.device_stats is not None:  # a pass run again to hold what a spill could not holds it on the host
            self.device_stats.clear()
            for group in self.groups:
                group.gradients.decode_deferred()  # a step's sum no update decoded (it ended before it): decoded now
                group.gradients.spilling = not self._holding
        self._tallies = [GroupTally(g.layout.specs, g.xp, g.gradients.active_spill) for g in self.groups]
        self._hyper = None
        self.scales.begin()

    def note_problem(self, problem: str) -> None:
        """End this step with the same error on every rank, naming ``problem``, at its next agreement (the first
        group reduction still to start)."""
        self._begin_step()
        for tally in self._tallies:
            tally.note(problem)

    def note_problem_at_agreement(self, check) -> None:
        """As ``note_problem`` with ``check()``'s problem, if any, asked for at the step's next agreement, once the
        device stats are read back (a check whose numbers come back with them: ``DeviceStats.attach``)."""
        self._begin_step()
        self._checks.append(check)

    def discard_step(self) -> None:
        """Forget every gradient handed in this step, on every rank that calls it (all must: sums are shared)."""
        self._end_step()

    def _end_step(self) -> None:
        """Forget this step's gradients, collectives and checks on every group; the next call starts a new step."""
        self._checks = []
        for group in self.groups:
            group.gradients.end_step()
        self._note_held()
        self._pending.clear()
        self._tracker.reset()

    def _nonfinite_result(self) -> bool:
        """Agree whether any averaged gradient overflowed (MPI's float32 sum can); raise or skip as configured."""
        local = not all(bool(array_module(g.grad_shard).isfinite(g.grad_shard).all()) for g in self.groups)
        if not self.collectives.allreduce_value(local, MPI.LOR, "whether any averaged gradient overflowed"):
            return False
        bad = [r for r, flag in enumerate(self.collectives.allgather_object(local, "overflowed results")) if flag]
        if self.config.on_nonfinite == "raise":
            raise agree.ZeroError(
                f"step {self.step_number}: non-finite averaged gradient (the float32 sum overflowed) on ranks {bad}"
            )
        return True

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale every grad shard so the global gradient norm is at most ``max_norm``; return the norm before.

        Between ``finish_reduction`` and ``apply_update``; collective where the grads are sharded (the norm's sum)
        or node-shared (stage 0 on one host: each rank scales its block between two waits), so every rank calls it.
        """
        if not self._reduced:
            raise StepOrderError("clip_grad_norm() needs the step's gradients reduced first (finish_reduction)")
        pieces = [g.grad_shard for g in self.groups]
        across_ranks = self.groups[0].plan.norm_needs_all_ranks
        grad_norm = norm.global_norm(pieces, self.numel, self.collectives if across_ranks else None)
        factor = norm.clip_factor(grad_norm, max_norm)
        if factor is not None:
            for group in self.groups:
                group.scale_grads(np.float32(factor), self.collectives)
        return grad_norm
