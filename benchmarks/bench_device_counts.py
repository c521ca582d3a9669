"""What one mpizero.torch step asks of a GPU, counted on the CPU stand-in: launches, host waits, allocations, MPI calls.

Run (no GPU needed): python benchmarks/bench_device_counts.py
    python benchmarks/bench_device_counts.py --models mlp --width 64 --stages 0 3
    mpiexec -n 2 python benchmarks/bench_device_counts.py --models mlp
The counts are rank 0's (MPI calls at one rank should be none), printed by rank 0. Models: ``mlp``, the 101M MLP's
shape (6 x Linear(width, width) + GELU, 12 tensors; width 4096 makes it the 101M one), and ``gpt2``, transformers'
GPT-2 built from a config (12 blocks, tied embedding and head) at a small width. AdamW, a plain loop
(``backward()`` per micro-batch, then ``step()`` and ``zero_grad()``), ``MPIZERO_STANDIN=1``: torch's CPU tensors
stand for CUDA ones, and every launch, copy, host wait and allocation the engine makes is the stand-in's to count
(``mpizero.standin.bus``, ``cuda.LAUNCHES``); MPI calls are counted on the communicator the engine is handed.

After ``--warmup`` steps (the run's first step has no scale prediction and is not counted), one step of
``--micro-batches`` passes and one of half as many are counted. The difference gives the launches a micro-batch
adds (L); the rest of the first is the step's fixed launches (F). Per model a line ``<model> (...): N groups``, then per
stage ``stage S: launches/micro-batch L, fixed launches/step F, syncs/step Y, allocations/step A, mpi calls/step M``
(Y, A, M of the longer step).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from dataclasses import dataclass

os.environ["MPIZERO_STANDIN"] = "1"  # before mpizero.torch is imported: CPU tensors stand for CUDA ones

COMMUNICATING = (  # mpi4py communicator methods that communicate (the rest only read the handle)
    "Allgather Allgatherv Allreduce Alltoall Alltoallv Barrier Bcast Gather Iallgather Iallreduce Ialltoall "
    "Ibarrier Ibcast Irecv Ireduce_scatter_block Isend Recv Reduce Reduce_scatter Reduce_scatter_block Scatter "
    "Send Sendrecv allgather allreduce alltoall barrier bcast gather recv reduce scatter send sendrecv"
).split()


@dataclass(frozen=True)
class Counts:
    """One stage's figures (see the module's docstring)."""

    launches_per_micro_batch: float
    fixed_launches: float
    syncs: int
    allocations: int
    mpi_calls: int

    def line(self, stage: int) -> str:
        return (
            f"stage {stage}: launches/micro-batch {self.launches_per_micro_batch:g}, fixed launches/step "
            f"{self.fixed_launches:g}, syncs/step {self.syncs}, allocations/step {self.allocations}, "
            f"mpi calls/step {self.mpi_calls}"
        )


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt2"], choices=["mlp", "gpt2"])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=range(4))
    parser.add_argument("--width", type=int, default=256, help="the MLP's width (4096: the 101M model)")
    parser.add_argument("--micro-batches", type=int, default=8, help="of the longer counted step (even)")
    parser.add_argument("--warmup", type=int, default=2)
    return parser.parse_args(argv)


def counting_comm():
    """COMM_WORLD as a communicator that counts every communicating call (``MPI_CALLS``), its children too."""
    from mpi4py import MPI

    calls = Counter()

    class CountingComm(MPI.Intracomm):
        pass

    def counted(name: str):
        method = getattr(MPI.Intracomm, name)

        def call(self, *args, **kwargs):
            calls[name] += 1
            return method(self, *args, **kwargs)

        return call

    for name in COMMUNICATING:
        setattr(CountingComm, name, counted(name))
    for name in ("Split", "Split_type", "Dup", "Create"):  # what they return counts too
        made = getattr(MPI.Intracomm, name)
        setattr(CountingComm, name, lambda self, *a, _made=made, **k: CountingComm(_made(self, *a, **k)))
    return CountingComm(MPI.COMM_WORLD), calls


def build(name: str, width: int):
    """The model and a function making micro-batch ``i`` of step ``s`` and its loss."""
    import torch

    torch.manual_seed(0)
    if name == "mlp":
        model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])

        def loss(step: int, micro: int):
            x = torch.randn(4, width, generator=torch.Generator().manual_seed(1000 * step + micro))
            return torch.nn.functional.mse_loss(model(x), torch.tanh(x))

        return model, loss
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=12, n_head=4, n_embd=64, n_positions=64, vocab_size=512, bos_token_id=0, eos_token_id=0)
    config.attn_pdrop = config.embd_pdrop = config.resid_pdrop = 0.0
    model = GPT2LMHeadModel(config)

    def loss(step: int, micro: int):
        ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1000 * step + micro))
        return model(input_ids=ids, labels=ids).loss

    return model, loss


def count_stage(name: str, stage: int, args) -> tuple[int, Counts]:
    """Build, warm up and count one stage (a fresh model and engine)."""
    import mpizero
    from mpizero.standin import bus, cuda
    from mpizero.torch import shard

    model, loss = build(name, args.width)
    comm, calls = counting_comm()
    zero = shard(model, mpizero.AdamW(lr=1e-4), stage=stage, comm=comm)

    def run(step: int, micro_batches: int) -> Counter:
        bus.COUNTS.clear()
        cuda.LAUNCHES.clear()
        calls.clear()
        for micro in range(micro_batches):
            loss(step, micro).backward()
        zero.step()
        zero.zero_grad()
        return Counter(launches=sum(cuda.LAUNCHES.values()), mpi=sum(calls.values()), **bus.COUNTS)

    for step in range(args.warmup):
        run(step, args.micro_batches)
    longer = run(args.warmup, args.micro_batches)
    shorter = run(args.warmup + 1, args.micro_batches // 2)
    per_micro = (longer["launches"] - shorter["launches"]) / (args.micro_batches - args.micro_batches // 2)
    fixed = longer["launches"] - per_micro * args.micro_batches
    groups = len(zero.engine.groups)
    return groups, Counts(per_micro, fixed, longer["sync"], longer["alloc"], longer["mpi"])


def main(argv=None) -> int:
    args = parse(argv)
    if args.micro_batches < 2 or args.micro_batches % 2:
        sys.exit("bench_device_counts: --micro-batches must be even and at least 2")
    from mpi4py import MPI

    rank, ranks = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    for name in args.models:
        lines, groups = [], 0
        for stage in args.stages:
            groups, counts = count_stage(name, stage, args)
            lines.append(counts.line(stage))
        shape = f"width {args.width}" if name == "mlp" else "12 blocks, from a transformers config"
        if rank == 0:
            world = f"{ranks} rank{'s' if ranks > 1 else ''}"
            print(f"{name} ({shape}, {world}), {args.micro_batches} micro-batches: {groups} groups", flush=True)
            for line in lines:
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
