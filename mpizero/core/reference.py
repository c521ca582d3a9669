"""The single-rank reference: plain data-parallel training, no MPI, no sharding.

It receives every contribution of every simulated rank, averages each tensor
the way the chosen reduction defines the average, optionally clips by the
global norm, and applies the optimizer to each full tensor. Every distributed
result is compared with it bit for bit.

On the host it evaluates the update and the decode with NumPy (``compiled=False``), so every comparison with
the engine also checks the engine's compiled passes against the formulas as NumPy evaluates them.

It shares no mixed-precision code with the engine's trainer: ``contribution``
is written here again, plainly, from the definition (store in the grad dtype,
divide by the loss scale), so a bug in the trainer's ``as_contribution`` (a
gradient never unscaled, stored in the wrong dtype) makes ``verify`` fail
instead of being copied into the reference.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from mpizero.arrays import array_module, to_host
from mpizero.core.optim import BoundOptimizer
from mpizero.core.optim.update import apply_step
from mpizero.core.reduce import exact, norm, scales


def contribution(grads: Mapping, grad_dtype, loss_scale: float) -> dict[str, np.ndarray]:
    """One micro-batch's gradients as the reduction receives them: each rounded to ``grad_dtype`` (where fp16 can
    overflow to inf), then divided by ``loss_scale`` in float32. The scale is a power of two, so this division is
    exact wherever the quotient is a normal float32."""
    result = {}
    for name, grad in grads.items():
        with np.errstate(over="ignore"):
            stored = grad.astype(grad_dtype)
        result[name] = stored.astype(np.float32) / np.float32(loss_scale)
    return result


class Reference:
    """Full float32 master parameters and optimizer state, updated one tensor at a time."""

    def __init__(
        self,
        params: Mapping,
        optimizer,
        reduction: str = "exact",
        *,
        param_dtype: str = "float32",
        clip_norm: float | None = None,
        on_nonfinite: str = "raise",
        scale_headroom: int = scales.HEADROOM,
    ) -> None:
        self.xp = array_module(next(iter(params.values())))
        self.params = {name: self.xp.array(a, dtype=np.float32) for name, a in params.items()}
        self.optimizer, self.reduction = (
            BoundOptimizer(optimizer, {n: p.shape for n, p in self.params.items()}),
            reduction,
        )
        self.param_dtype, self.clip_norm, self.on_nonfinite = np.dtype(param_dtype), clip_norm, on_nonfinite
        names = self.optimizer.state_names
        self.state = {n: {s: self.xp.zeros_like(p) for s in names} for n, p in self.params.items()}
        self.step_count = self.skipped_steps = 0
        self.scale_headroom = scale_headroom
        self.history: dict[str, tuple[float, int]] = {}  # each tensor's last agreed (maximum, count) (``scales``)

    def compute_params(self) -> dict[str, np.ndarray]:
        """The parameters every rank computes with: the master rounded to the param dtype, as float32."""
        return {n: self._rounded(p) for n, p in self.params.items()}

    def _rounded(self, master):
        """``master`` rounded to the param dtype, as float32; bfloat16 on a device by way of the host, whose
        ml_dtypes has it (CuPy has not), and not by the engine's word kernels (``held``)."""
        if self.xp is np or self.param_dtype.name != "bfloat16":
            return master.astype(self.param_dtype).astype(np.float32)
        return self.xp.asarray(to_host(master).astype(self.param_dtype).astype(np.float32))

    def step(self, contributions: Sequence[Mapping]) -> bool:
        """Average all ranks' contributions and update every tensor; return False if the step was skipped."""
        if not all(bool(self.xp.isfinite(c[n]).all()) for c in contributions for n in self.params):
            if self.on_nonfinite == "raise":
                raise FloatingPointError("non-finite gradient")
            self.skipped_steps += 1
            return False
        grads = self.average(contributions)
        self._learn_scales(contributions)
        if self.clip_norm is not None:
            grad_norm = norm.global_norm(list(grads.values()), sum(g.size for g in grads.values()))
            factor = norm.clip_factor(grad_norm, self.clip_norm)
            for g in grads.values():
                g *= np.float32(1.0 if factor is None else factor)
        self.step_count += 1
        hyper = self.optimizer.snapshot()
        for name, grad in grads.items():
            group, rule = hyper[self.optimizer.group_of[name]], self.optimizer.rule
            if rule.whole(group):  # Muon: the matrix is whole here already
                rule.whole_step(group, self.step_count, self.params[name], grad, self.state[name])
            else:
                apply_step(rule, group, self.step_count, self.params[name], grad, self.state[name], compiled=False)
        return True

    def _learn_scales(self, contributions: Sequence[Mapping]) -> None:
        for name in self.params:
            largest = exact.largest_magnitude([c[name] for c in contributions])
            if largest > 0:
                self.history[name] = (largest, len(contributions))

    def average(self, contributions: Sequence[Mapping]) -> dict[str, np.ndarray]:
        """Return each tensor's mean gradient over all contributions, as ``scales`` defines it: elements below the
        cap summed at the predicted scale, the rest at the chosen one, the sum rescaled to it and divided once."""
        count = len(contributions)
        result = {}
        for name, param in self.params.items():
            sources = [self.xp.asarray(c[name], dtype=np.float32).reshape(-1) for c in contributions]
            if self.reduction == "native":
                result[name] = (_fold(sources) / np.float32(count)).reshape(param.shape)
                continue
            history = self.history.get(name)
            used = None if history is None else scales.predict(*history, self.scale_headroom)
            largest = exact.largest_magnitude(sources)
            settled, _ = scales.settle(used, largest, count, self.scale_headroom)
            result[name] = self.xp.zeros(param.shape, dtype=np.float32)
            if settled is None:  # every contribution is zero
                continue
            cap = math.ldexp(1.0, settled.cap_exponent)
            beyond = [self.xp.abs(s.astype(np.float64)) >= cap for s in sources]
            chosen = scales.chosen_scale(settled, largest, count, any(bool(b.any()) for b in beyond))
            streamed = sum(_fixed(self.xp.where(b, 0.0, s), settled.k) for s, b in zip(sources, beyond))
            exact.rescale(streamed, settled.k - chosen)
            total = streamed + sum(_fixed(self.xp.where(b, s, 0.0), chosen) for s, b in zip(sources, beyond))
            exact.decode(total, chosen, count, result[name], compiled=False)
        return result


def _fixed(x, k: int):
    """``rint(x * 2**k)`` as int64: one contribution in fixed point, plainly."""
    return np.rint(np.ldexp(x.astype(np.float64), k)).astype(np.int64)


def _fold(arrays) -> np.ndarray:
    """Sum float32 arrays left to right: ((a0 + a1) + a2) + ..."""
    arrays = iter(arrays)
    first = next(arrays)
    total = array_module(first).array(first, dtype=np.float32)
    for a in arrays:
        total += a
    return total
