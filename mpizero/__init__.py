"""mpizero: ZeRO training-state partitioning (stages 0-3) over MPI, bitwise-verified."""

from mpizero.core.config import DiskOffload, ZeroConfig
from mpizero.core.engine import ZeroEngine
from mpizero.core.layout import FlatLayout, TensorSpec
from mpizero.core.optim import SGD, Adam, AdamW, Lion, Muon
from mpizero.core.partition import Partition, split_evenly
from mpizero.core.reference import Reference
from mpizero.core.sharded_init import ShardedInit, philox_normal
from mpizero.core.stages import STAGES, Sharding
from mpizero.errors import ZeroError

__all__ = [
    "STAGES",
    "SGD",
    "Adam",
    "AdamW",
    "DiskOffload",
    "FlatLayout",
    "Lion",
    "Muon",
    "Partition",
    "Reference",
    "ShardedInit",
    "Sharding",
    "TensorSpec",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroError",
    "philox_normal",
    "split_evenly",
]
