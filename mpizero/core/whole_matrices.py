"""An update that needs each matrix whole (Muon's orthogonalisation), on a group whose ranks each own a range.

Glossary:

- direction: the elementwise first phase's output, per element of a matrix (Muon: its momentum, Nesterov's or
  not), computed on the owned range like any update (``optim.update``).
- owner: the one rank that orthogonalises a matrix, chosen by ``owners`` (whole matrices, largest first to
  the least loaded rank).
- orthogonal: an owner's result for its matrix, already scaled by the matrix's learning rate; the last
  elementwise phase subtracts it on the owned range.

Where the optimizer states are sharded (stages 1-3) every rank all-gathers the group's directions; an owner
writes its matrices' results into a zeroed buffer of the group's size, and a reduce-scatter of those buffers,
read as int32 bit patterns, hands every rank its owned range: each element has one writer and int32 addition
of zeros is exact, so the bytes arrive as written, signed zeros too (at stage 0, where each rank owns
everything, an all-reduce). No rank orthogonalises part of a matrix, and each is computed by the same code on
the same bytes whichever rank owns it, so the result is the single-rank reference's at any world size and
stage (given a BLAS that gives one matrix product the same bits in every process, as it does for the same
library, shapes and threads). An owner that fails says so to every rank before the results travel. Both
collectives are counted as the ``optimizer``'s; each rank holds two of the group's float32 buffers meanwhile.
"""

from __future__ import annotations

import numpy as np

from mpizero.comm import agree
from mpizero.core.optim.update import apply_step


def owners(sizes: list[int], ranks: int) -> list[int]:
    """The rank that orthogonalises each matrix: the largest first, each to the least loaded rank (the lowest on a
    tie), so every rank computes about the same number of elements."""
    load, owner = [0] * ranks, [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[index], load[rank] = rank, load[rank] + sizes[index]
    return owner


def update(group, rule, hyper: tuple, step: int, collectives) -> None:
    """One step of ``rule`` on ``group``'s owned range: tensors of whole-matrix parameter groups through the
    phases around ``rule.orthogonalize``, the others through ``rule``'s elementwise formula (collective)."""
    xp, master, grad, states = group.xp, group.master_shard, group.grad_shard, group.optimizer_state
    start, stop = group.owned_range
    direction = xp.zeros(stop - start, np.float32)
    for g, lo, hi in group.optimizer_runs:
        if rule.whole(hyper[g]):
            arrays = {name: a[lo:hi] for name, a in states.items()}
            arrays["direction"] = direction[lo:hi]
            apply_step(rule.momentum_phase, hyper[g], step, master[lo:hi], grad[lo:hi], arrays)
    whole = [(i, spec) for i, spec in enumerate(group.layout.specs) if rule.whole(hyper[group.tensor_groups[i]])]
    orthogonal = whole and _orthogonalized(
        group, rule, hyper, whole, _whole_direction(group, direction, collectives), collectives
    )
    # no master is written before every owner has orthogonalised (agreed): at stages 1-2 the master is this rank's
    # block of the params, and a failure after a write would leave the ranks computing with different params
    for g, lo, hi in group.optimizer_runs:
        if rule.whole(hyper[g]):
            apply_step(rule.apply_phase, hyper[g], step, master[lo:hi], grad[lo:hi], {"orthogonal": orthogonal[lo:hi]})
        else:
            arrays = {name: a[lo:hi] for name, a in states.items()}
            apply_step(rule, hyper[g], step, master[lo:hi], grad[lo:hi], arrays)


def _whole_direction(group, direction, collectives):
    """The group's whole direction (padded): every rank's owned shard, or, unsharded, the owned range itself."""
    if not group.plan.sharding.optimizer:
        return direction
    full = group.xp.empty(group.partition.padded_numel, np.float32)
    collectives.allgather(direction, full, counted_as="optimizer")
    return full


def _orthogonalized(group, rule, hyper: tuple, whole: list, full, collectives):
    """The orthogonalised directions over the owned range (zero outside whole-matrix tensors): each owner writes
    its matrices' into a zeroed buffer, and the buffers' bit patterns are summed to each rank's owned range."""
    xp = group.xp
    owner = owners([spec.numel for _, spec in whole], group.partition.world_size)
    written = xp.zeros(group.partition.padded_numel, np.float32)
    problem = None
    try:
        for k, (i, spec) in enumerate(whole):
            if owner[k] == group.rank:
                result = rule.orthogonalize(
                    full[spec.offset : spec.stop].reshape(spec.shape), hyper[group.tensor_groups[i]]
                )
                written[spec.offset : spec.stop] = result.reshape(-1)
    except Exception as error:  # whatever stops an owner (a device out of memory), agreed: nobody is left waiting
        problem = f"orthogonalising {spec.name!r}: {type(error).__name__}: {error}"
    agree.raise_if_any(collectives, problem, f"{rule.name}'s update")
    bits = written.view(np.int32)
    if not group.plan.sharding.optimizer:
        collectives.allreduce(bits.copy(), bits, counted_as="optimizer")
        return written
    start, stop = group.owned_range
    orthogonal = xp.empty(stop - start, np.float32)
    collectives.reduce_scatter(bits, orthogonal.view(np.int32), counted_as="optimizer")
    return orthogonal
