"""mpizero: ZeRO training-state partitioning (stages 0-3) over MPI, bitwise-verified."""

from .agree import ZeroError
from .config import ZeroConfig
from .engine import ZeroEngine
from .layout import FlatLayout, TensorSpec
from .optim import SGD, Adam, AdamW
from .partition import Partition, split_evenly
from .reference import Reference
from .stages import STAGES, Sharding

__all__ = [
    "STAGES",
    "SGD",
    "Adam",
    "AdamW",
    "FlatLayout",
    "Partition",
    "Reference",
    "Sharding",
    "TensorSpec",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroError",
    "split_evenly",
]
