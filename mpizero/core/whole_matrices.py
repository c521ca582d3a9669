"""An update that needs each matrix whole (Muon's orthogonalisation), on a group whose ranks each own a range.

The elementwise phases run on the owned range as any update does (``optim.update``);
between them each matrix's direction is needed whole. Every rank gathers the
group's direction (stages 1-3: an all-gather of the owned shards; stage 0 owns it
all), each matrix is orthogonalised by one rank (``owners``: whole matrices,
largest first to the least loaded rank), and one all-gather hands every rank the
results, from which it takes its owned range. No rank orthogonalises part of a
matrix, and each matrix is computed by the same code on the same bytes whichever
rank owns it, so the result is the single-rank reference's at any world size and
stage. Counted as the ``optimizer`` collective.
"""

from __future__ import annotations

import numpy as np

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
    whole = [(i, spec) for i, spec in enumerate(group.layout.specs) if rule.whole(hyper[group.tensor_groups[i]])]
    xp, master, grad, states = group.xp, group.master_shard, group.grad_shard, group.optimizer_state
    start, stop = group.owned_range
    direction = xp.zeros(stop - start, np.float32)
    for g, lo, hi in group.optimizer_runs:
        arrays = {name: a[lo:hi] for name, a in states.items()}
        if rule.whole(hyper[g]):
            arrays["direction"] = direction[lo:hi]
            apply_step(rule.momentum_phase, hyper[g], step, master[lo:hi], grad[lo:hi], arrays)
        else:
            apply_step(rule, hyper[g], step, master[lo:hi], grad[lo:hi], arrays)
    if not whole:
        return
    orthogonal = _orthogonalized(
        group, rule, hyper, whole, _whole_direction(group, direction, collectives), collectives
    )
    for g, lo, hi in group.optimizer_runs:
        if rule.whole(hyper[g]):
            apply_step(rule.apply_phase, hyper[g], step, master[lo:hi], grad[lo:hi], {"orthogonal": orthogonal[lo:hi]})


def _whole_direction(group, direction, collectives):
    """The group's whole direction (padded): the owned range itself at stage 0, else every rank's owned shard."""
    padded = group.partition.padded_numel
    if group.owned_range == (0, padded):
        return direction
    full = group.xp.empty(padded, np.float32)
    collectives.allgather(direction, full, counted_as="optimizer")
    return full


def _orthogonalized(group, rule, hyper: tuple, whole: list, full, collectives):
    """The orthogonalised directions over the owned range (zero outside whole-matrix tensors): each rank computes
    its matrices', and one all-gather of equal blocks (each rank's, padded) hands them to every rank."""
    xp, ranks, rank = group.xp, collectives.comm.Get_size(), collectives.comm.Get_rank()
    owner = owners([spec.numel for _, spec in whole], ranks)
    place, used = [0] * len(whole), [0] * ranks  # each matrix's offset in its owner's block
    for k, (_, spec) in enumerate(whole):
        place[k], used[owner[k]] = used[owner[k]], used[owner[k]] + spec.numel
    block = max(used)
    mine = xp.zeros(block, np.float32)
    for k, (i, spec) in enumerate(whole):
        if owner[k] == rank:
            matrix = full[spec.offset : spec.stop].reshape(spec.shape)
            mine[place[k] : place[k] + spec.numel] = rule.orthogonalize(matrix, hyper[group.tensor_groups[i]]).reshape(
                -1
            )
    every = xp.empty(ranks * block, np.float32)
    collectives.allgather(mine, every, counted_as="optimizer")
    start, stop = group.owned_range
    orthogonal = xp.zeros(stop - start, np.float32)
    for k, (_, spec) in enumerate(whole):
        lo, hi = max(spec.offset, start), min(spec.stop, stop)
        if lo < hi:
            source = owner[k] * block + place[k] + lo - spec.offset
            orthogonal[lo - start : hi - start] = every[source : source + hi - lo]
    return orthogonal
