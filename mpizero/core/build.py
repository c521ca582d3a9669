"""Make one rank's flat groups from an initializer, agreed by every rank; and digests of what the ranks hold.

A rank asks ``fill`` only for what it holds (``FlatGroup``), so at stage 3 the
set-up holds only shards: the param shard, the master shard, the grad shard and
the optimizer state shards of every group, and one tensor piece from ``fill`` at
a time. A ``fill`` that breaks its contract, or an allocation that fails, on any
rank becomes the same error on every rank.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpizero.arrays import device_module
from mpizero.comm import agree
from mpizero.comm.shared import OneRankBlocks
from mpizero.core import digest, sharded_init
from mpizero.core.group import FlatGroup
from mpizero.core.layout import FlatLayout
from mpizero.core.partition import Partition
from mpizero.core.reduce.group_encode import DeviceStats, Spill
from mpizero.core.reduce.reduction import REDUCTIONS
from mpizero.core.stages import ShardPlan, sharding


def build_groups(
    source: sharded_init.ShardedInit, group_names, config, bound, collectives, offload_to=None
) -> list[FlatGroup]:
    """Every group's buffers on this rank, in group order (collective: the outcome is agreed). ``offload_to``: a
    directory each group's states move to as soon as it is made, so no more than one group's are ever held."""
    comm = collectives.comm
    xp, rank, size = device_module(source.device), comm.Get_rank(), comm.Get_size()
    fill, groups, problem = sharded_init.checked_fill(source, xp), [], None
    try:
        for names in group_names:
            layout = FlatLayout.from_shapes({n: source.shapes[n] for n in names})
            plan = ShardPlan(sharding(config.stage), Partition(layout.numel, size, config.align), rank)
            group = FlatGroup(layout, plan, xp, config.param_dtype, fill)
            group.init_optimizer(bound.state_names, bound.group_of)
            if offload_to is not None:
                group.offload(offload_to, len(groups), REDUCTIONS[config.reduction].wire_dtype)
            groups.append(group)
    except sharded_init.FillError as error:
        problem = str(error)
    except OSError as error:
        problem = f"offloading group {len(groups)} to {offload_to}: {error}"
    except MemoryError as error:
        held = sum(sum(group.memory().values()) for group in groups)
        problem = f"out of memory making group {len(groups)} of {len(group_names)}, holding {held} bytes ({error})"
    if problem is not None:
        groups.clear()  # free what was made before agreeing
    agree.raise_if_any(collectives, problem, "bad initial values")
    share_params(groups, collectives)
    if offload_to is None:
        share_grads(groups, collectives)
    return groups


def device_spills(groups: list[FlatGroup], reduction) -> DeviceStats | None:
    """On a device, with a reduction that spills: the engine's device stats, and each group's spill in them
    (``group_encode``); None otherwise."""
    if not reduction.spills:
        return None
    stats = DeviceStats(groups[0].xp, [len(g.layout.specs) for g in groups])
    for index, group in enumerate(groups):
        spill = Spill(stats, index, len(group.layout.specs), group.partition.padded_numel)
        group.gradients.spill = spill
    return stats


def share_params(groups: list[FlatGroup], collectives) -> None:
    """Where the stage gathers params and every rank shares this host (host arrays), hold each group's param shard
    in node-shared full params, read in place by a gather (``Collectives.node_blocks``: collective, agreed); on a
    device at one rank the shard is the full params, read in place too; elsewhere the groups gather by copying."""
    if not groups or not groups[0].plan.gathers_params:
        return
    if groups[0].xp is not np:
        made = [OneRankBlocks(g.param_shard, "params") for g in groups] if collectives.alone else []
    else:
        made = collectives.node_blocks([g.param_shard.size for g in groups], groups[0].param_dtype, "params")
    for group, blocks in zip(groups, made or []):
        group.read_in_place(blocks)


def share_grads(groups: list[FlatGroup], collectives) -> None:
    """Where every rank updates from the whole averaged gradient (stage 0), shares this host and holds its states
    in memory (host arrays), hold each group's averaged grads in node-shared blocks: each rank sums and decodes its
    block, and reads the others' in place (``Collectives.node_blocks``: collective, agreed); elsewhere every rank
    sums and decodes all of it."""
    if not groups or not groups[0].plan.shares_averaged_grads or groups[0].xp is not np:
        return
    made = collectives.node_blocks([g.partition.shard_numel for g in groups], np.float32, "grads")
    for group, blocks in zip(groups, made or []):
        group.decode_in_place(blocks)


def agree_held_params(groups: list[FlatGroup], collectives) -> None:
    """Where every rank holds the full params (stages 0-2) and ``fill`` made them on every rank, agree that every
    rank holds the same; at stage 3 each element was made once, by its owner, so there is nothing to agree."""
    if groups[0].plan.gathers_params:
        return
    held = [(s.name, 0, g.full_params[s.offset : s.stop]) for g in groups for s in g.layout.specs]
    fields = {"the initial parameter values fill made": digest.combine([digest.partial(held)])}
    agree.raise_unless_equal(collectives, fields)


def master_digest(groups: list[FlatGroup], collectives) -> str:
    """The digest of the fp32 master params, each rank digesting its shard (collective; the same at any world
    size, stage or grouping: ``digest``)."""
    pieces = [piece for g in groups for piece in g.state_pieces(*g.plan.shard_range)]
    try:
        mine = digest.partial((piece.spec.name, piece.start, piece.arrays["master"]) for piece in pieces)
    except OSError:  # an offload file deleted or cut: agreed below, once every rank has taken part
        mine = digest.partial([])
    combined = digest.combine([collectives.allreduce_array(mine, MPI.SUM, "the master digest")])
    for group in groups:
        group.place.agree_intact(collectives)  # a file cut before or while it was read: no digest of zeros
    return combined
