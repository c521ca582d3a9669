"""The disk tier (ZeRO-Infinity's NVMe offload, on any file system): a group's fp32 states in a file.

With ``offload="disk"`` each rank keeps, per group, one file of the float32
states it updates: the master shard (unless it is the param shard itself),
each optimizer state shard and the averaged grad shard (``GRAD``), ``owned
numel`` elements each, back to back, and room for the streamed sum between
rounds of micro-batches (``SUMS``). The grad shard is written as soon as it is
decoded; the update reads a group's states whole, updates them and writes them
back (``in_turn``); the kernel reads the next group's ahead and writes the last
one's back beside the update, so one group's states are in memory at once.
Other readers and writers of the states (checkpoints, digests, loads) map the
file. The arithmetic is the engine's in either case, so offloaded and
in-memory runs give the same bytes.

Each rank's files live in a directory of its own, made inside ``offload_dir``
(``mpizero-offload-*``, never a checkpoint's name) and removed with the
engine, or at exit; one a killed process left is removed by the next engine on
its host.
"""

from mpizero.core.offload.directory import OFFLOADS, PREFIX, RankDirectory, owners_prefix, rank_directory
from mpizero.core.offload.files import GRAD, STATE_DTYPE, SUMS, GroupFile, MappedStates
from mpizero.core.offload.turn import in_turn

__all__ = [
    "GRAD",
    "OFFLOADS",
    "PREFIX",
    "STATE_DTYPE",
    "SUMS",
    "GroupFile",
    "MappedStates",
    "RankDirectory",
    "in_turn",
    "owners_prefix",
    "rank_directory",
]
