"""The engine's settings, validated when made."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from mpizero.core.precision import PRECISIONS
from mpizero.core.reduce.reduction import REDUCTIONS
from mpizero.core.reduce.scales import HEADROOM
from mpizero.core.stages import STAGES

NONFINITE_POLICIES = ("raise", "skip")
MAX_HEADROOM = 16  # more would leave fewer bits than float32's mantissa between the quantum and the maximum


@dataclass(frozen=True)
class DiskOffload:
    """Keep the master, optimizer and grad shards (and the streamed sums between rounds) in files of the rank's
    own, made inside ``directory`` (ZeRO-Infinity's NVMe offload on any file system; ``core/states``)."""

    directory: str

    def __post_init__(self) -> None:
        if isinstance(self.directory, os.PathLike):
            object.__setattr__(self, "directory", os.fspath(self.directory))
        if not isinstance(self.directory, str) or not self.directory:
            raise ValueError(f"DiskOffload needs a directory's path, got {self.directory!r}")


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO stage, reduction mode, shard alignment and the step's numerical policies.

    - reduction: ``exact`` (bitwise, order-free) or ``native`` (MPI's float SUM).
    - align: shard length is a multiple of this many elements.
    - param_dtype: dtype parameters are held and gathered in (float32, bfloat16, float16).
    - clip_norm: clip the global gradient norm to this, or None.
    - on_nonfinite: a NaN/Inf gradient on any rank ``raise``s on every rank, or ``skip``s the step.
    - overlap: start collectives nonblocking so they overlap computation.
    - watchdog: seconds one collective may wait before the job is ended with a report, or None.
    - allow_singleton: run as a 1-rank world even where a launcher says it started more processes.
    - scale_headroom: bits between the predicted and the largest expected gradient (``scales``); a step whose
      largest gradient moved by more is redone.
    - pair_contributions: hold a contribution whose arrays the caller gave up until the next arrives, and encode
      the two in one pass (the same bytes, 12 bytes an element and contribution instead of 20, one held float32
      gradient); rounds (``reduce_round``) likewise, two summed over ranks in one collective; None: where the
      stage keeps full local grads anyway (0-1, ``ShardPlan.pairs_contributions``).
    - offload: where the states live besides memory: ``DiskOffload(directory)``, or None (in memory).
    """

    stage: int = 2
    reduction: str = "exact"
    align: int = 1
    param_dtype: str = "float32"
    clip_norm: float | None = None
    on_nonfinite: str = "raise"
    overlap: bool = True
    watchdog: float | None = None
    allow_singleton: bool = False
    scale_headroom: int = HEADROOM
    pair_contributions: bool | None = None
    offload: DiskOffload | None = None

    def __post_init__(self) -> None:
        if self.stage not in STAGES or isinstance(self.stage, bool):
            raise ValueError(f"stage must be one of {sorted(STAGES)}, got {self.stage!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {sorted(REDUCTIONS)}, got {self.reduction!r}")
        if not isinstance(self.align, int) or self.align < 1:
            raise ValueError(f"align must be an int >= 1, got {self.align!r}")
        dtypes = sorted(p.param_dtype.name for p in PRECISIONS.values())
        if np.dtype(self.param_dtype).name not in dtypes:
            raise ValueError(f"param_dtype must be one of {dtypes}, got {self.param_dtype!r}")
        if self.clip_norm is not None and not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ValueError(f"clip_norm must be a positive number or None, got {self.clip_norm!r}")
        if self.watchdog is not None and not (math.isfinite(self.watchdog) and self.watchdog > 0):
            raise ValueError(f"watchdog must be a positive number of seconds or None, got {self.watchdog!r}")
        if not isinstance(self.scale_headroom, int) or not 0 <= self.scale_headroom <= MAX_HEADROOM:
            raise ValueError(f"scale_headroom must be an int in [0, {MAX_HEADROOM}], got {self.scale_headroom!r}")
        if self.pair_contributions not in (None, True, False):
            raise ValueError(f"pair_contributions must be True, False or None, got {self.pair_contributions!r}")
        if not isinstance(self.offload, (DiskOffload, type(None))):
            raise ValueError(f"offload must be DiskOffload(directory) or None, got {self.offload!r}")
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_POLICIES}, got {self.on_nonfinite!r}")

    def pairs(self, plan) -> bool:
        """Whether contributions are encoded two in one pass: as ``pair_contributions`` says, else as ``plan``'s
        stage does by default."""
        return plan.pairs_contributions if self.pair_contributions is None else self.pair_contributions
