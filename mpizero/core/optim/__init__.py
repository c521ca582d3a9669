"""The optimizers (one file each, named in ``optimizers``), their binding to an engine's tensors, and their update."""

from mpizero.core.optim.adam import Adam, AdamW
from mpizero.core.optim.binding import BoundOptimizer
from mpizero.core.optim.lion import Lion
from mpizero.core.optim.muon import Muon
from mpizero.core.optim.optimizer import Optimizer
from mpizero.core.optim.optimizers import OPTIMIZERS
from mpizero.core.optim.sgd import SGD

__all__ = ["OPTIMIZERS", "SGD", "Adam", "AdamW", "BoundOptimizer", "Lion", "Muon", "Optimizer"]
