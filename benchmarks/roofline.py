"""The memory traffic each configuration of ``bench_peers.py`` must move per parameter, and the step time it bounds.

Bytes per parameter on one rank (fp32 parameters, Adam, ``R`` ranks), read plus written, as STREAM counts them
(``bench_bandwidth.py``); ``docs/benchmarks.md`` explains each term. The floor of a step is those bytes times the
parameters over one rank's share of the machine's bandwidth (every rank streams at once). Compute, Python,
messages between ranks and the kernels' own inefficiency come on top, so a measured step is a multiple of it.
All ranks on one host, as ``bench_peers`` runs them: stage 3 reads the full params in place (across hosts it would
gather each unit twice per backward pass, 16 bytes more each), and stages 2-3 add each round straight into the
owners' shared sums.
"""

from __future__ import annotations

PRODUCE = 12  # per backward pass: the forward reads W (4), the backward reads W (4) and writes dW (4)
ADD_FLOAT32 = 12  # g += dW in float32: read 4, read 4, write 4
ENCODE_FIRST = 12  # the first contribution: read float32 dW (4), write its int64 (8)
ENCODE_ADD = 20  # every later one: read dW (4), read and write the int64 sum (16)
PAIR_FIRST = 16  # the paired encode (stages 0-1), the first two contributions: read 4 + 4, write the int64 (8)
PAIR_ADD = 24  # ... every later two: read 4 + 4, read and write the int64 sum (16)
DECODE = 12  # int64 sum to float32 gradient: read 8, write 4
ADAM = 28  # mpizero's one-pass Adam: read param, grad, m, v (16); write param, m, v (12)
# torch.optim.Adam on the CPU (its single-tensor path), one pass per operation: m.lerp_(g) 12, v.mul_ 8,
# v.addcmul_(g, g) 12, v.sqrt() 8, / bias correction 8, .add_(eps) 8, p.addcdiv_(m, denom) 16
TORCH_ADAM = 72


def ddp_allreduce(ranks: int) -> float:
    """A ring all-reduce of 4-byte gradients on one rank: reduce-scatter (send, receive, add: 5 x 4 per element of
    each of R-1 chunks) and all-gather (send, receive: 2 x 4), the chunks being 1/R of the buffer."""
    return 7 * 4 * (ranks - 1) / ranks


def backward_passes_bytes(config: str, ranks: int, passes: int) -> float:
    """Bytes per parameter of one rank's ``passes`` backward passes of a step, gradients accumulated (one host)."""
    if config == "torch-ddp":  # the first gradient is autograd's own (in DDP's bucket); later ones add into it
        return PRODUCE * passes + ADD_FLOAT32 * (passes - 1)
    stage, paired = stage_of(config), config.endswith("-paired") or stage_of(config) <= 1
    if stage <= 1:  # into this rank's own int64 sum, two contributions a pass (an odd last one alone)
        return PRODUCE * passes + _encodes(passes, ENCODE_FIRST, PAIR_FIRST)
    # stages 2-3: each rank starts its own block of the sum and adds its block for every other owner; paired, two
    # rounds at a time
    first_one, first_two = (
        (first + add * (ranks - 1)) / ranks for first, add in ((ENCODE_FIRST, ENCODE_ADD), (PAIR_FIRST, PAIR_ADD))
    )
    if not paired:
        return PRODUCE * passes + first_one + ENCODE_ADD * (passes - 1)
    return PRODUCE * passes + _encodes(passes, first_one, first_two)


def _encodes(passes: int, first_one: float, first_two: float) -> float:
    """Bytes of ``passes`` contributions encoded two in one pass (an odd last one alone), the first pass (one or
    two contributions) costing ``first_one`` or ``first_two``."""
    pairs, alone = divmod(passes, 2)
    return first_two + PAIR_ADD * (pairs - 1) + ENCODE_ADD * alone if pairs else first_one


def stage_of(config: str) -> int:
    """The ZeRO stage of an ``mpizero.torch-S`` or ``mpizero.torch-S-paired`` configuration."""
    return int(config.split("-")[1])


def per_step(config: str, ranks: int) -> float:
    """Bytes per parameter of one rank's step after the backward passes: reduction, decode, update, publish."""
    if config == "torch-ddp":
        return ddp_allreduce(ranks) + TORCH_ADAM
    stage = stage_of(config)
    # each rank sums its block out of the node-shared int64 sums (stages 0-1: read 8 a parameter in all, write
    # 8 / R; stages 2-3 summed theirs round by round) and decodes it: stage 0 into node-shared grads
    reduce = 8 + 8 / ranks if stage <= 1 else 0
    updated = 1 if stage == 0 else 1 / ranks  # stage 0 updates every parameter on every rank
    # in float32 the master is the params at every stage; 1-2 all-gather the other ranks' blocks (read and write
    # 4 bytes each through MPI's shared memory)
    publish = 8 * (ranks - 1) / ranks if stage in (1, 2) else 0
    return reduce + DECODE / ranks + ADAM * updated + publish


MODELLED = ("torch-ddp", *(f"mpizero.torch-{s}" for s in range(4)), "mpizero.torch-2-paired", "mpizero.torch-3-paired")


def step_bytes(config: str, ranks: int, backward_passes: int) -> float | None:
    """Bytes per parameter of one rank's whole step, or None for a configuration not modelled."""
    if config not in MODELLED:
        return None
    return backward_passes_bytes(config, ranks, backward_passes) + per_step(config, ranks)


def floor_ms(config: str, ranks: int, backward_passes: int, params: int, rank_bandwidth: float) -> float | None:
    """The step time the traffic alone takes at ``rank_bandwidth`` bytes per second, or None if not modelled."""
    moved = step_bytes(config, ranks, backward_passes)
    return None if moved is None else moved * params / rank_bandwidth * 1e3
