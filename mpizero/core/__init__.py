"""The engine's core: shard arithmetic, the stage table, flat groups, reductions, optimizers, the engine."""
