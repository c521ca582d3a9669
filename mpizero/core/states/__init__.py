"""Where a group's states live: in memory (``InMemory``) or in a file of the rank's own (``InFile``, the disk tier).

A group's states are the fp32 master shard (unless it is the param shard
itself), each optimizer state shard and the averaged grad shard, ``owned
numel`` elements each. The group and its gradients ask the group's place for
them through one interface and never ask which place it is; the engine chooses
the place once, at set-up (``offload``).

The disk tier (ZeRO-Infinity's NVMe offload, on any file system), with
``offload=DiskOffload(directory)``: each rank keeps, per group, one file (``GroupFile``) of the
states, back to back, and room for the streamed sum between rounds of
micro-batches (``SUMS``). The grad shard is written as soon as it is decoded;
the update reads a group's states whole, updates them and writes them back
(``in_turn``); the kernel reads the next group's ahead and writes the last
one's back beside the update, so one group's states are in memory at once.
Other readers and writers of the states (checkpoints, digests, loads) map the
file. The arithmetic is the engine's in either case, so offloaded and
in-memory runs give the same bytes.

Each rank's files live in a directory of its own, made inside that directory
(``mpizero-offload-*``, never a checkpoint's name) and removed with the
engine, or at exit; one a killed process left is removed by the next engine on
its host.
"""

from mpizero.core.states.group_file import GRAD, STATE_DTYPE, SUMS, GroupFile, MappedStates
from mpizero.core.states.in_file import InFile
from mpizero.core.states.in_memory import InMemory
from mpizero.core.states.offload_directory import PREFIX, RankDirectory, owners_prefix, rank_directory
from mpizero.core.states.turn import in_turn

__all__ = [
    "GRAD",
    "PREFIX",
    "STATE_DTYPE",
    "SUMS",
    "GroupFile",
    "InFile",
    "InMemory",
    "MappedStates",
    "RankDirectory",
    "in_turn",
    "owners_prefix",
    "rank_directory",
]
