"""The memory traffic each configuration of ``bench_peers.py`` must move per parameter, and the step time it bounds.

Bytes per parameter on one rank (fp32 parameters, Adam, ``R`` ranks), read plus written, as STREAM counts them
(``bench_bandwidth.py``); ``docs/benchmarks.md`` explains each term. The floor of a step is those bytes times the
parameters over one rank's share of the machine's bandwidth (every rank streams at once). Compute, Python,
messages between ranks and the kernels' own inefficiency come on top, so a measured step is a multiple of it.
"""

from __future__ import annotations

PRODUCE = 12  # per backward pass: the forward reads W (4), the backward reads W (4) and writes dW (4)
GATHER = 16  # stage 3, per backward pass: gather a unit's full params twice (forward, backward): read 4, write 4
ADD_FLOAT32 = 12  # g += dW in float32: read 4, read 4, write 4
ENCODE_FIRST = 12  # the first contribution: read float32 dW (4), write its int64 (8)
ENCODE_ADD = 20  # every later one: read dW (4), read and write the int64 sum (16)
DECODE = 12  # int64 sum to float32 gradient: read 8, write 4
ADAM = 28  # read param, grad, m, v (16); write param, m, v (12)


def ddp_allreduce(ranks: int) -> float:
    """A ring all-reduce of 4-byte gradients on one rank: reduce-scatter (send, receive, add: 5 x 4 per element of
    each of R-1 chunks) and all-gather (send, receive: 2 x 4), the chunks being 1/R of the buffer."""
    return 7 * 4 * (ranks - 1) / ranks


def per_backward(config: str, ranks: int) -> tuple[float, float]:
    """Bytes per parameter of one rank's first backward pass of a step, and of each later one."""
    if config == "torch-ddp":
        return PRODUCE, PRODUCE + ADD_FLOAT32  # the first gradient is autograd's own; later ones add into it
    stage = int(config.rsplit("-", 1)[1])
    produce = PRODUCE + (GATHER if stage == 3 else 0)
    if stage <= 1:
        return produce + ENCODE_FIRST, produce + ENCODE_ADD  # into this rank's own int64 sum
    # stages 2-3: each rank starts its own block of the sum and adds its block for every other owner
    first = (ENCODE_FIRST + ENCODE_ADD * (ranks - 1)) / ranks
    return produce + first, produce + ENCODE_ADD


def per_step(config: str, ranks: int) -> float:
    """Bytes per parameter of one rank's step after the backward passes: reduction, decode, update, publish."""
    if config == "torch-ddp":
        return ddp_allreduce(ranks) + ADAM
    stage = int(config.rsplit("-", 1)[1])
    reduce = {0: 8 * ranks + 8, 1: 8 + 8 / ranks, 2: 0, 3: 0}[stage]  # out of the node-shared int64 sums
    owned = 1 if stage == 0 else 1 / ranks  # stage 0 decodes and updates every parameter on every rank
    publish = {0: 8, 1: 8, 2: 8, 3: 0}[stage]  # stage 0 copies the master into the params; 1-2 all-gather them
    return reduce + (DECODE + ADAM) * owned + publish


MODELLED = ("torch-ddp", "mpizero.torch-0", "mpizero.torch-1", "mpizero.torch-2", "mpizero.torch-3")


def step_bytes(config: str, ranks: int, backward_passes: int) -> float | None:
    """Bytes per parameter of one rank's whole step, or None for a configuration not modelled."""
    if config not in MODELLED:
        return None
    first, later = per_backward(config, ranks)
    return first + later * (backward_passes - 1) + per_step(config, ranks)


def floor_ms(config: str, ranks: int, backward_passes: int, params: int, rank_bandwidth: float) -> float | None:
    """The step time the traffic alone takes at ``rank_bandwidth`` bytes per second, or None if not modelled."""
    moved = step_bytes(config, ranks, backward_passes)
    return None if moved is None else moved * params / rank_bandwidth * 1e3
