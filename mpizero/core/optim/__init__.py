"""The optimizer: torch.optim's algorithms (``rules``), their hyper-parameters (``hyper``), parameter groups
(``optimizers``, ``binding``), and the float64 oracle of what they mean (``oracle``)."""

from mpizero.core.optim.binding import BoundOptimizer
from mpizero.core.optim.optimizers import OPTIMIZERS, SGD, Adam, AdamW, Optimizer

__all__ = ["OPTIMIZERS", "SGD", "Adam", "AdamW", "BoundOptimizer", "Optimizer"]
