"""Training frameworks on mpizero: ``ZeroTrainer``, transformers' ``Trainer`` under ``mpiexec`` (needs transformers)."""

from mpizero.integrations.hf_trainer import ZeroTrainer

__all__ = ["ZeroTrainer"]
