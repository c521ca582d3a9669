"""mpizero against PyTorch DDP and FSDP2 (gloo) on the same MLP, optimizer, batch and threads.

Run: python benchmarks/bench_peers.py --ranks 2   (needs torch: pip install -e ".[peers]")
Model: ``--layers`` Linear(width, width) layers with ReLU between, MSE loss, Adam,
global batch ``--batch`` in ``--micro-batches`` backward passes per rank, fp32,
one thread per rank. Every configuration runs in its own ``mpiexec -n RANKS``
job; the table gives the median step time after warm-up, its ratio to DDP, the
largest peak RSS of any rank, and the largest peak RSS above that rank's RSS
once torch was imported and the model built (what the training state costs).

Accumulation as each framework's users do it: DDP under ``no_sync()`` but for
the last micro-batch; FSDP2 reduce-scatters every micro-batch (its default);
``mpizero.torch`` streams the gradients through ``step(closure)``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import time
from pathlib import Path

import numpy as np

from mpizero.comm.launcher import python_under_mpiexec
from mpizero.progress import progress

HERE = Path(__file__).resolve()
CONFIGS = [
    "torch-ddp",
    "torch-fsdp2",
    "mpizero-0-exact",
    "mpizero-1-exact",
    "mpizero-2-exact",
    "mpizero-3-exact",
    "mpizero-2-native",
    "mpizero-3-native",
    "mpizero.torch-2",
    "mpizero.torch-3",
]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=8, help="backward passes per rank and step")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--chart", default=None, help="also draw step time and peak RSS per configuration (PNG)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def local_batch(args, rank: int, size: int, step: int):
    rng = np.random.default_rng([step, rank])
    per_rank = args.batch // size
    x = rng.standard_normal((per_rank, args.width)).astype(np.float32)
    return x, np.tanh(x[:, ::-1]).copy()


def micro_batches(args, rank: int, size: int, step: int):
    """This rank's batch of the step as ``--micro-batches`` torch (x, y) pairs."""
    import torch

    x, y = local_batch(args, rank, size, step)
    return [
        (torch.from_numpy(a), torch.from_numpy(b))
        for a, b in zip(*(np.array_split(t, args.micro_batches) for t in (x, y)))
    ]


def current_rss() -> int:
    """This process's resident set now, in KiB (``ru_maxrss``'s unit)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def timed_steps(args, comm_barrier, step_fn) -> list[float]:
    times = []
    rank0 = int(os.environ.get("PMI_RANK", "0")) == 0
    for step in progress(range(1, args.steps + 1), args.worker, show=rank0):  # stderr, every 5 s
        comm_barrier()
        start = time.perf_counter()
        step_fn(step)
        times.append(time.perf_counter() - start)
    return times


def mpizero_worker(args, config: str) -> dict:
    from mpi4py import MPI

    from mpizero import Adam, ZeroEngine
    from mpizero.core.precision import PRECISIONS
    from mpizero.training.mlp import MLP
    from mpizero.training.trainer import DEFAULT_BUCKET_ELEMS, Trainer, make_groups

    comm = MPI.COMM_WORLD
    _, stage, reduction = config.split("-")
    stage = int(stage)
    model = MLP((args.width,) * (args.layers + 1))
    engine = ZeroEngine(
        model.init(0),
        Adam(lr=1e-4),
        comm=comm,
        stage=stage,
        reduction=reduction,
        groups=make_groups(model, stage, DEFAULT_BUCKET_ELEMS),
    )
    trainer = Trainer(model, engine, PRECISIONS["fp32"])
    size = comm.Get_size()
    times = timed_steps(args, comm.Barrier, lambda step: trainer.step(lambda m: local_batch(args, m, size, step), size))
    slowest = np.empty(len(times))
    comm.Allreduce(np.array(times), slowest, op=MPI.MAX)
    return {
        "times": slowest.tolist(),
        "rss": comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, op=MPI.MAX),
    }


def torch_mlp(args):
    import torch

    torch.manual_seed(0)
    layers = []
    for i in range(args.layers):
        layers.append(torch.nn.Linear(args.width, args.width))
        if i < args.layers - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def mpizero_torch_worker(args, config: str) -> dict:
    """The torch model trained through ``mpizero.torch.shard`` (exact reduction), gradients streamed."""
    import torch
    from mpi4py import MPI

    from mpizero import Adam
    from mpizero.torch import shard

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    model = torch_mlp(args)
    baseline = current_rss()
    zero = shard(model, Adam(lr=1e-4), stage=int(config.split("-")[1]), comm=comm)

    def step_fn(step: int) -> None:
        def closure():
            for x, y in micro_batches(args, comm.rank, comm.size, step):
                torch.nn.functional.mse_loss(model(x), y).backward()

        zero.step(closure)

    times = timed_steps(args, comm.Barrier, step_fn)
    slowest = np.empty(len(times))
    comm.Allreduce(np.array(times), slowest, op=MPI.MAX)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss, above = (comm.allreduce(v, op=MPI.MAX) for v in (peak, peak - baseline))
    return {"times": slowest.tolist(), "rss": rss, "above": above, "redone": zero.engine.redone_steps}


def torch_worker(args, config: str) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=size)
    model = torch_mlp(args)
    baseline = current_rss()
    if config == "torch-ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step_fn(step: int) -> None:
        optimizer.zero_grad()
        pairs = micro_batches(args, rank, size, step)
        for m, (x, y) in enumerate(pairs):
            last = m == len(pairs) - 1
            quiet = model.no_sync() if config == "torch-ddp" and not last else contextlib.nullcontext()
            with quiet:
                (torch.nn.functional.mse_loss(model(x), y) / len(pairs)).backward()
        optimizer.step()

    times = timed_steps(args, dist.barrier, step_fn)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss = torch.tensor([peak, peak - baseline], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return {"times": slowest.tolist(), "rss": float(rss[0]), "above": float(rss[1])}


def run_config(args, config: str) -> dict:
    command = [
        *python_under_mpiexec(args.ranks, str(HERE)),
        "--worker",
        config,
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--micro-batches",
        str(args.micro_batches),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29517",
    }
    # stdout carries the result; stderr is left to the terminal, for the worker's progress lines
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=1200, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{config} failed (exit {done.returncode}); its error output is above")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse()
    if args.worker:
        workers = {"torch": torch_worker, "mpizero.torch": mpizero_torch_worker, "mpizero": mpizero_worker}
        result = workers[args.worker.split("-")[0]](args, args.worker)
        if int(os.environ.get("PMI_RANK", "0")) == 0:
            print(json.dumps(result), flush=True)
        if args.worker.startswith("torch"):
            os._exit(0)  # torch+gloo sometimes aborts in its exit-time destructors ("terminate called ...")
        return
    from threadpoolctl import threadpool_info

    blas = {i.get("internal_api") for i in threadpool_info()}
    rows = {config: run_config(args, config) for config in progress(args.configs, "bench_peers configurations")}
    params = args.layers * (args.width * args.width + args.width)
    print(
        f"{args.layers}-layer {args.width}x{args.width} ReLU MLP ({params:,} parameters), Adam, global batch "
        f"{args.batch} in {args.micro_batches} micro-batches per rank (torch configurations), fp32, {args.ranks} "
        f"ranks, 1 thread per rank ({', '.join(sorted(blas))})"
    )
    print(f"{'configuration':<18} {'step ms':>9} {'x DDP':>7} {'peak RSS MiB':>13} {'above model MiB':>16}")
    ddp = np.median(rows["torch-ddp"]["times"][2:]) if "torch-ddp" in rows else None
    for config, row in rows.items():
        median = float(np.median(row["times"][2:]))
        ratio = f"{median / ddp:7.2f}" if ddp else f"{'-':>7}"
        above = f"{row['above'] / 1024:>16.0f}" if "above" in row else f"{'-':>16}"
        print(f"{config:<18} {median * 1e3:>9.1f} {ratio} {row['rss'] / 1024:>13.0f} {above}")
    if args.chart:
        draw(rows, args, args.chart)


def draw(rows: dict, args, path: str) -> None:
    """Two bar charts side by side: median step time and peak RSS per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    colours = ["#d62728" if n.startswith("torch") else "#1f77b4" for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.barh(names, [np.median(rows[n]["times"][2:]) * 1e3 for n in names], color=colours)
    left.set_xlabel("median step time, ms (lower is better)")
    right.barh(names, [rows[n]["rss"] / 1024 for n in names], color=colours)
    right.set_xlabel("peak RSS per rank, MiB (lower is better)")
    right.set_yticklabels([])
    for ax in (left, right):
        ax.invert_yaxis()
    fig.suptitle(f"{args.layers}-layer {args.width}-wide MLP, Adam, batch {args.batch}, fp32, {args.ranks} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
