"""One flat parameter group's lifecycle on one rank: its buffers and their states.

Glossary (these names and no others):

- full params: the group's padded flat parameter buffer (padded numel), in the
  param dtype (float32, bfloat16 or float16), as its array module holds it: the
  held dtype (``held``: bfloat16 as 16-bit words on a device).
- param shard: this rank's block of the full params. At stages 0-2 it is a view
  into the full params; at stage 3 it is the only parameter buffer kept, and the
  full params exist only between ``gather`` and ``release``: gathered into a
  buffer of their own, or, where every rank shares one host, read in place (the
  param shard is this rank's block of node-shared full params: ``node params``).
- owned range: what this rank updates: the whole padded buffer when the
  optimizer is not sharded (stage 0), its shard otherwise.
- gradients: this step's local grads, streamed sum, kept elements and the
  averaged grad shard over the owned range (``gradients.GroupGradients``). At
  stage 0 on one host the averaged grads are node-shared (``grad blocks``):
  each rank decodes its block, and reads every rank's in place.
- master shard: float32 parameters over the owned range; the optimizer's copy.
  With float32 params it is the params themselves (one buffer,
  ``ShardPlan.master_is_params``): the full params at stage 0, the param shard
  at stages 1-3; the update writes the params directly.
- optimizer state shard: the optimizer's buffers over the owned range.
- padding: the zeros after the last tensor; they stay zero through every update.
- place (``states``): where the master, optimizer state and grad shards live,
  in memory or in the group's file (offloaded: read in for the update, mapped
  otherwise); the group asks it, whichever it is.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from mpizero.arrays import to_host
from mpizero.core import whole_matrices
from mpizero.core.gradients import GroupGradients
from mpizero.core.held import held_dtype, to_held
from mpizero.core.layout import FlatLayout, TensorSpec
from mpizero.core.optim.update import apply_step
from mpizero.core.stages import Publish, ShardPlan
from mpizero.core.states import GRAD, InMemory


class ParamState(enum.Enum):
    """Whether this group's full params exist on this rank right now."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


@dataclass(frozen=True)
class StatePiece:
    """Elements ``[start, stop)`` of one tensor (flat, unpadded) and this rank's buffers of them, by state name."""

    spec: TensorSpec
    start: int
    stop: int
    arrays: Mapping


class Slices(Mapping):
    """Elements ``[lo, hi)`` of each of ``states``, sliced when first asked for (a mapped state is then mapped)."""

    def __init__(self, states: Mapping, lo: int, hi: int) -> None:
        self._states, self._lo, self._hi, self._sliced = states, lo, hi, {}

    def __getitem__(self, name: str):
        if name not in self._sliced:
            self._sliced[name] = self._states[name][self._lo : self._hi]
        return self._sliced[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)


class FlatGroup:
    """Buffers of one parameter group on one rank, for one stage."""

    def __init__(self, layout: FlatLayout, plan: ShardPlan, xp, param_dtype, fill):
        """``fill(name, start, stop)``: elements ``[start, stop)`` of tensor ``name`` flattened, float32 on ``xp``.

        It is asked only for the params this rank holds (``plan.params_range``: the
        param shard at stage 3), tensor by tensor in layout order, so no buffer of
        the full params is ever made where the stage keeps only the shard.
        """
        self.layout, self.plan = layout, plan
        self.partition, self.rank = plan.partition, plan.rank
        self.xp, self.param_dtype = xp, np.dtype(param_dtype)
        self.held_dtype = held_dtype(xp, param_dtype)
        held_start, held_stop = plan.params_range
        held = xp.zeros(held_stop - held_start, dtype=np.float32)  # the padding stays zero
        for _, spec, lo, hi in layout.overlaps(held_start, held_stop):
            held[lo - held_start : hi - held_start] = fill(spec.name, lo - spec.offset, hi - spec.offset)
        start, stop = plan.owned_range
        self.pending_gather = self.node_params = None
        if plan.gathers_params:
            self.full_params = None
            self.param_shard = to_held(held, self.held_dtype)
            self.state = ParamState.SHARDED
        else:
            shard_start, shard_stop = plan.shard_range
            self.full_params = to_held(held, self.held_dtype)
            self.param_shard = self.full_params[shard_start:shard_stop]
            self.state = ParamState.UNSHARDED
        self.shares_master = plan.master_is_params(self.param_dtype.itemsize)
        owned = held[start - held_start : stop - held_start]
        states = {} if self.shares_master else {"master": owned.copy()}  # fp32, over the owned range
        self.place = InMemory(states, xp.zeros(stop - start, dtype=np.float32))
        self.gradients = GroupGradients(layout, plan, xp, self.owned_segments(), self.place)

    @property
    def owned_range(self) -> tuple[int, int]:
        return self.plan.owned_range

    def read_in_place(self, blocks) -> None:
        """Hold the param shard as this rank's block of ``blocks``, node-shared full params (stage 3 on one host:
        ``build.share_params``), so that a gather reads every rank's block in place instead of copying them."""
        if blocks.own is not self.param_shard:
            blocks.own[...] = self.param_shard
        self.param_shard, self.node_params = blocks.own, blocks

    def decode_in_place(self, blocks) -> None:
        """Hold the averaged grads as ``blocks``, node-shared (stage 0 on one host: ``build.share_grads``): this
        rank sums and decodes its block of them, and its update reads every rank's in place."""
        self.place.grad_shard = blocks.whole
        start, stop = self.plan.shard_range
        self.gradients.decode_block(blocks, self._segments(start, stop))

    def scale_grads(self, factor, collectives) -> None:
        """Multiply the averaged grad shard by ``factor`` (clipping); node-shared grads each rank scales its block
        of, between two waits for every rank (collective there): reads of the unscaled grads end before the first,
        writes before the second."""
        blocks = self.gradients.grad_blocks
        if blocks is None:
            grad = self.grad_shard
            grad *= factor
            return
        collectives.end_reads_in_place(blocks)
        blocks.own *= factor
        collectives.decoded_in_place(blocks)

    def states(self) -> Mapping:
        """The master shard (``master``) and each optimizer state shard, by name: in memory, read in for an update,
        or mapped from the offload file as each is used."""
        return self.place.states({"master": self._owned_params} if self.shares_master else {})

    @property
    def _owned_params(self):
        """The params this rank holds over its owned range, where they are the master (``shares_master``): the
        full params at stage 0, the param shard (a view of them at stages 1-2) where the owned range is it."""
        return self.param_shard if self.plan.owns_shard else self.full_params

    @property
    def master_shard(self):
        """The fp32 master params over the owned range (the params themselves where ``shares_master``)."""
        return self.states()["master"]

    @property
    def optimizer_state(self) -> dict:
        """The optimizer's state shards by name."""
        return {name: a for name, a in self.states().items() if name != "master"}

    def offload(self, directory: str, index: int, wire_dtype) -> None:
        """Move the states and the grad shard to a file of their own in ``directory`` (host groups only), freeing
        them here; the file has room for the streamed sums in ``wire_dtype`` too."""
        self.place = self.gradients.place = self.place.to_file(directory, index, wire_dtype)

    @property
    def grad_shard(self):
        """The averaged float32 gradient over the owned range, wherever it lives (``place``), decoded."""
        self.gradients.decode_deferred()
        return self.place.grad_shard

    def owned_segments(self) -> list[tuple[int, int, int]]:
        """Return ``(tensor index, start, stop)`` of each tensor's piece of the owned range (owned-relative)."""
        return self._segments(*self.owned_range)

    def _segments(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """``(tensor index, start, stop)`` of each tensor's piece of ``[start, stop)``, relative to ``start``."""
        return [(index, lo - start, hi - start) for index, _, lo, hi in self.layout.overlaps(start, stop)]

    def held_buffers(self) -> list[tuple[str, int, object]]:
        """``(what, flat start, buffer)`` for the params this rank holds (full or shard), the master shard and
        each optimizer state shard: what a check compares with a reference, without knowing the stage."""
        start = self.plan.owned_range[0]
        return [("params", *self._params_held())] + [(name, start, a) for name, a in self.states().items()]

    def _params_held(self) -> tuple[int, object]:
        if self.full_params is not None and self.state is ParamState.UNSHARDED:
            return 0, self.full_params
        return self.plan.shard_range[0], self.param_shard

    def state_pieces(self, start: int, stop: int) -> list[StatePiece]:
        """The fp32 master and optimizer state of flat range ``[start, stop)`` (within the owned range), by tensor."""
        owned_start, states = self.plan.owned_range[0], self.states()
        return [
            StatePiece(spec, lo - spec.offset, hi - spec.offset, Slices(states, lo - owned_start, hi - owned_start))
            for _, spec, lo, hi in self.layout.overlaps(start, stop)
        ]

    def state_buffer(self, name: str):
        """The owned-range buffer of training state ``name``: ``master``, ``grad`` (the averaged grad shard, once
        reduced) or an optimizer state."""
        return self.grad_shard if name == GRAD else self.states()[name]

    def set_state(self, name: str, values) -> None:
        """Set state ``name`` (the master or an optimizer state; the grad shard is the step's own) over the owned
        range from full float32 host tensors by name (copied to the device explicitly where the group lives
        there)."""
        if name == GRAD:
            raise ValueError("the averaged grad shard is set by the step's reduction, not by set_state")
        start, stop = self.owned_range
        target = self.state_buffer(name)
        for _, spec, lo, hi in self.layout.overlaps(start, stop):
            piece = np.asarray(values[spec.name], dtype=np.float32).reshape(-1)[lo - spec.offset : hi - spec.offset]
            target[lo - start : hi - start] = piece if self.xp is np else self.xp.asarray(piece)

    def full_state(self, collectives, name: str) -> dict:
        """State ``name`` of every tensor, whole, on every rank, as host arrays (all-gather, counted as report)."""
        full = np.empty(self.partition.padded_numel, dtype=np.float32)
        start, stop = self.partition.shard_range(self.rank)
        owned_start = start - self.owned_range[0]
        try:
            shard = to_host(self.state_buffer(name)[owned_start : owned_start + stop - start])
        except OSError:  # an offload file deleted or cut: agreed below, once every rank has taken part
            shard = np.zeros(stop - start, np.float32)
        collectives.allgather(np.ascontiguousarray(shard), full, counted_as="report")
        self.place.agree_intact(collectives)  # a file cut before or while it was read: nothing read is kept
        return {k: v.copy() for k, v in self.layout.views(full).items()}

    def init_optimizer(self, state_names, param_group_of: dict[str, int]) -> None:
        """Zero every optimizer state shard; note which parameter group updates each run of the owned range."""
        start, stop = self.owned_range
        self.place.add({n: self.xp.zeros(stop - start, dtype=np.float32) for n in state_names})
        runs: list[list[int]] = []
        for index, lo, hi in self.owned_segments():
            group = param_group_of[self.layout.specs[index].name]
            if runs and runs[-1][0] == group and runs[-1][2] == lo:
                runs[-1][2] = hi
            else:
                runs.append([group, lo, hi])
        self.optimizer_runs = [tuple(run) for run in runs]  # (parameter group, start, stop), owned-relative
        self.tensor_groups = [param_group_of[spec.name] for spec in self.layout.specs]

    def gather(self, collectives, blocking: bool = True, out=None) -> None:
        """Start making the full params exist (all-gather at stage 3); finish at once if blocking.

        ``out``: a caller's buffer (padded numel, held dtype) to gather into instead of a new one.
        """
        if self.state is ParamState.SHARDED and self.node_params is not None:
            collectives.read_in_place(self.node_params, self.node_params.whole.nbytes)
            self.full_params = self.node_params.whole if out is None else self._checked(out)
            if out is not None:
                out[...] = self.node_params.whole
            self.state = ParamState.UNSHARDED
        if self.state is ParamState.SHARDED:
            numel = self.partition.padded_numel
            self.full_params = self.xp.empty(numel, dtype=self.held_dtype) if out is None else self._checked(out)
            self.pending_gather = collectives.allgather(self.param_shard, self.full_params, blocking=False)
            self.state = ParamState.GATHERING
        if blocking:
            self._finish_gather()

    def _checked(self, out):
        expected = (self.partition.padded_numel,)
        if tuple(out.shape) != expected or out.dtype != self.held_dtype:
            raise ValueError(f"out must be {self.held_dtype}{list(expected)}, got {out.dtype}{list(out.shape)}")
        return out

    def _finish_gather(self) -> None:
        if self.state is ParamState.GATHERING:
            self.pending_gather.wait()
            self.pending_gather = None
            self.state = ParamState.UNSHARDED

    def views(self) -> dict:
        """Return the full params by tensor name; they must have been gathered."""
        if self.state is not ParamState.UNSHARDED:
            raise RuntimeError(f"full params are {self.state.value}, not gathered")
        return self.layout.views(self.full_params)

    def release(self) -> None:
        """Free the full params again when only the shard is to be kept (stage 3)."""
        if self.plan.gathers_params and self.state is not ParamState.SHARDED:
            self._finish_gather()  # MPI may still be writing into the buffer
            self.full_params = None
            self.state = ParamState.SHARDED

    def update(self, rule, hyper: tuple, step: int, collectives) -> None:
        """Apply one optimizer step to the master shard, each run with its parameter group's ``hyper``; a rule
        that needs whole matrices (Muon) goes through ``whole_matrices`` (collective). Params read in place wait
        for every rank's reads first (collective)."""
        if self.node_params is not None:
            collectives.end_reads_in_place(self.node_params)
        if any(rule.whole(h) for h in hyper):
            whole_matrices.update(self, rule, hyper, step, collectives)
            return
        master, optimizer_state = self.master_shard, self.optimizer_state
        deferred = self.gradients.take_deferred()  # on a device: decoded by the update as it reads (one launch)
        grad = self.place.grad_shard
        for group, lo, hi in self.optimizer_runs:
            state = {name: a[lo:hi] for name, a in optimizer_state.items()}
            decoding = None if deferred is None else deferred.within(lo, hi)
            apply_step(rule, hyper[group], step, master[lo:hi], grad[lo:hi], state, decoding=decoding)

    def publish(self, collectives) -> None:
        """Copy the master shard into the parameters every rank will use next."""
        publish = self.plan.publish
        if not self.shares_master:  # else the update wrote the params themselves
            out = self.full_params if publish is Publish.COPY_FULL else self.param_shard
            to_held(self.master_shard, self.held_dtype, out=out)
        if publish is Publish.COPY_THEN_ALLGATHER:
            collectives.allgather_in_place(self.full_params)

    def _grad_bytes(self, in_memory: dict) -> int:
        """The averaged grad shard's bytes on this rank: its block of node-shared grads (the rest are the other
        ranks', mapped: ``Collectives.mapped_bytes``), else the shard in memory, if any."""
        if self.gradients.grad_blocks is not None:
            return self.gradients.grad_blocks.own.nbytes
        return in_memory[GRAD].nbytes if GRAD in in_memory else 0

    def memory(self) -> dict[str, int]:
        """Bytes this group holds now, by kind (see ``memory.KINDS``)."""
        in_place = self.node_params is not None and self.full_params is self.node_params.whole
        transient_full = self.plan.gathers_params and self.full_params is not None and not in_place  # a copy
        in_memory = self.place.in_memory()  # offloaded: what is read in for the update, if anything
        return {
            "params": self.param_shard.nbytes if self.plan.gathers_params else self.full_params.nbytes,
            "gathered": self.full_params.nbytes if transient_full else 0,
            "grads": self._grad_bytes(in_memory) + self.gradients.held_bytes(),
            "master": in_memory["master"].nbytes if "master" in in_memory else 0,  # shared: counted as params
            "optimizer": sum(a.nbytes for name, a in in_memory.items() if name not in ("master", GRAD)),
            "comm": self.gradients.comm_bytes(),
        }
