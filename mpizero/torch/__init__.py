"""mpizero for PyTorch modules: ``shard(model, optimizer, stage=...)`` (needs ``pip install mpizero[torch]``)."""

from mpizero.torch.data import StepSampler
from mpizero.torch.recipe_check import Recipe, Report, check
from mpizero.torch.shard import ShardedModel, shard
from mpizero.torch.units import default_units

__all__ = ["Recipe", "Report", "ShardedModel", "StepSampler", "check", "default_units", "shard"]
