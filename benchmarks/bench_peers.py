"""mpizero against PyTorch DDP, FSDP2 and DeepSpeed ZeRO 1-3 (gloo) on the same model, optimizer, batch and threads.

Run: python benchmarks/bench_peers.py --ranks 2 [--model gpt]   (the peers need torch and DeepSpeed: pip install -e
".[peers]" after the CPU build of torch; a configuration whose framework is not installed is skipped and says why)
Model (``peers_models``): ``--model mlp``, the stress row, ``--layers`` Linear(width, width) layers with ReLU
between and MSE loss; ``--model gpt``, the transformer row, transformers' GPT-2 from a config with next-token
loss. Adam (lr 1e-4), global batch ``--batch``, fp32, one thread per rank. Each configuration runs once per
``--micro-batches`` count (backward passes per rank and step), each run in its own ``mpiexec -n RANKS`` job; the
table gives, per count, the median step time after warm-up and its ratio to DDP's, then, for the first count, the
largest peak RSS of any rank and the largest peak RSS above that rank's RSS once torch was imported and the model
built (what the training state costs), and of that, the other ranks' shared-memory blocks an ``mpizero`` rank
maps (gradient sums during a step, stage 3's params read in place; its RSS counts those pages, but they are the
other ranks', held once on the host).
``--json PATH`` appends each run's result as one JSON line as soon as it ends.

Accumulation as each framework's users do it: DDP (``gradient_as_bucket_view=True``, its best setting) under
``no_sync()`` but for the last micro-batch; FSDP2 (each block a unit, as mpizero stage 3) reduce-scatters every
micro-batch (its default); DeepSpeed with its own ``gradient_accumulation_steps``, ``engine.backward`` and
``engine.step()`` per micro-batch; ``mpizero.torch`` streams the gradients through ``step(closure)`` (``-paired``:
two rounds summed in one pass, ``pair_contributions=True``, one more float32 gradient held); the
engine-only ``mpizero-N-*`` configurations (NumPy MLP) hand the trainer the micro-batches.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.util
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import peers_gpt2
import peers_models
import roofline
import step_profile
from bench_bandwidth import bandwidth, bandwidth_line

from mpizero.comm.job.launcher import python_under_mpiexec
from mpizero.progress import progress

HERE = Path(__file__).resolve()
CONFIGS = [
    "torch-ddp",
    "torch-fsdp2",
    "deepspeed-1",
    "deepspeed-2",
    "deepspeed-3",
    "mpizero-0-exact",
    "mpizero-1-exact",
    "mpizero-2-exact",
    "mpizero-3-exact",
    "mpizero-2-native",
    "mpizero-3-native",
    "mpizero.torch-0",
    "mpizero.torch-1",
    "mpizero.torch-2",
    "mpizero.torch-3",
    "mpizero.torch-2-paired",
    "mpizero.torch-3-paired",
    "mpizero.torch-3-kept",
    "gpt2-ddp",
    "gpt2-mpizero.torch-2",
    "gpt2-mpizero.torch-3",
]
NEEDS = {"torch": "torch", "deepspeed": "deepspeed", "mpizero.torch": "torch", "gpt2": "transformers"}  # modules
WARMUP = 2  # steps left out of the median


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", choices=sorted(peers_models.DEFAULTS), default="mlp", help="see peers_models")
    parser.add_argument("--width", type=int, default=None, help="default: 2048 (mlp), 512 (gpt)")
    parser.add_argument("--layers", type=int, default=None, help="default: 4")
    parser.add_argument("--batch", type=int, default=None, help="global rows (mlp) or sequences (gpt) a step")
    parser.add_argument("--seq", type=int, default=256, help="the GPT's sequence length")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--micro-batches", type=int, nargs="+", default=[8, 1], help="backward passes per rank and step: one run each"
    )
    parser.add_argument("--configs", nargs="*", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--json", default=None, help="append each run's result to this file as a JSON line")
    parser.add_argument("--bandwidth", action="store_true", help="also measure this machine's memory bandwidth")
    parser.add_argument("--bandwidth-mib", type=int, default=1024, help="size of each bandwidth array, MiB")
    parser.add_argument("--chart", default=None, help="also draw step time and peak RSS per configuration (PNG)")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="TOP", help="print one rank's profile of each run, TOP functions"
    )
    parser.add_argument("--profile-rank", type=int, default=0, help="the rank --profile profiles (default 0)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)  # where a worker's rank 0 writes
    args = parser.parse_args()
    for option, default in peers_models.DEFAULTS[args.model].items():
        setattr(args, option, default if getattr(args, option) is None else getattr(args, option))
    if args.steps <= WARMUP:
        parser.error(f"--steps {args.steps}: at least {WARMUP + 1} (the first {WARMUP} are warm-up)")
    if not 0 <= args.profile_rank < args.ranks:
        parser.error(f"--profile-rank {args.profile_rank}: a rank of --ranks {args.ranks} (0 to {args.ranks - 1})")
    return args


def framework(config: str) -> str:
    """The framework a configuration runs: ``torch``, ``deepspeed``, ``mpizero`` or ``mpizero.torch``."""
    return config.split("-")[0]


def missing(config: str, model: str) -> str | None:
    """Why ``config`` cannot run here on ``model`` (not built for it, or its framework not installed), or None."""
    if model != "mlp" and framework(config) == "mpizero":
        return "the engine-only configurations train the NumPy MLP only"
    if model == "gpt" and framework(config) != "gpt2" and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (the GPT row builds transformers' GPT-2 from a config)"
    module = NEEDS.get(framework(config))
    if module and importlib.util.find_spec(module) is None:
        return f'{module} is not installed (pip install -e ".[peers]" after the CPU build of torch)'
    return None


def engine_micro_batch(args, size: int, step: int, m: int):
    """Global micro-batch ``m`` of the step: piece ``m % k`` of rank ``m // k``'s batch (``k`` per rank)."""
    k = args.micro_batches
    return tuple(np.array_split(t, k)[m % k] for t in peers_models.local_batch(args, m // k, size, step))


def micro_batches(args, rank: int, size: int, step: int):
    """This rank's batch of the step as ``--micro-batches`` torch (x, y) pairs."""
    import torch

    x, y = peers_models.local_batch(args, rank, size, step)
    return [
        (torch.from_numpy(a), torch.from_numpy(b))
        for a, b in zip(*(np.array_split(t, args.micro_batches) for t in (x, y)))
    ]


def current_rss() -> int:
    """This process's resident set now, in KiB (``ru_maxrss``'s unit)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def timed_steps(args, comm_barrier, step_fn) -> list[float]:
    """Each step's seconds on this rank; with ``--profile``, rank ``--profile-rank`` profiles the steps after
    warm-up and writes the table beside the result file."""
    times = []
    rank = int(os.environ.get("PMI_RANK", "0"))
    profile = cProfile.Profile() if args.profile and rank == args.profile_rank else None
    for step in progress(range(1, args.steps + 1), args.worker, show=rank == 0):  # stderr, every 5 s
        comm_barrier()
        start = time.perf_counter()
        with profile if profile and step > WARMUP else contextlib.nullcontext():
            step_fn(step)
        times.append(time.perf_counter() - start)
    if profile:
        Path(args.result_file + ".profile").write_text(
            step_profile.table(profile, args.steps - WARMUP, args.profile, rank)
        )
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

    def step_fn(step: int) -> None:
        trainer.step(lambda m: engine_micro_batch(args, size, step, m), size * args.micro_batches)

    times = timed_steps(args, comm.Barrier, step_fn)
    slowest = np.empty(len(times))
    comm.Allreduce(np.array(times), slowest, op=MPI.MAX)
    return {
        "times": slowest.tolist(),
        "rss": comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, op=MPI.MAX),
    }


def mpizero_torch_worker(args, config: str) -> dict:
    """The torch model trained through ``mpizero.torch.shard`` (exact reduction), gradients streamed."""
    import torch
    from mpi4py import MPI

    from mpizero import Adam
    from mpizero.torch import shard

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    model = peers_models.build(args)
    baseline = current_rss()
    stage, paired = int(config.split("-")[1]), config.endswith("-paired")  # -paired: rounds two in one pass
    kept = config.endswith("-kept")  # -kept: each unit gathered once a step (``keep_gathered``)
    units = peers_models.blocks(args, model)
    settings = {"pair_contributions": paired or None, "keep_gathered": kept}
    zero = shard(model, Adam(lr=1e-4), stage=stage, units=units, comm=comm, **settings)

    def step_fn(step: int) -> None:
        def closure():
            for x, y in micro_batches(args, comm.rank, comm.size, step):
                peers_models.loss(args, model, x, y).backward()

        zero.step(closure)

    result = mpi_gathered(comm, timed_steps(args, comm.Barrier, step_fn), baseline)
    return {**result, "redone": zero.engine.redone_steps, "mapped": zero.engine.collectives.mapped_bytes >> 10}


def mpi_gathered(comm, times: list[float], baseline: int) -> dict:
    """The slowest rank's step times, the largest peak RSS and peak RSS above ``baseline`` (over ``comm``)."""
    from mpi4py import MPI

    slowest = np.empty(len(times))
    comm.Allreduce(np.array(times), slowest, op=MPI.MAX)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss, above = (comm.allreduce(v, op=MPI.MAX) for v in (peak, peak - baseline))
    return {"times": slowest.tolist(), "rss": rss, "above": above}


def gathered(times: list[float], baseline: int) -> dict:
    """The slowest rank's step times, the largest peak RSS and peak RSS above ``baseline`` (torch.distributed)."""
    import torch
    import torch.distributed as dist

    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss = torch.tensor([peak, peak - baseline], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    return {"times": slowest.tolist(), "rss": float(rss[0]), "above": float(rss[1])}


def torch_worker(args, config: str) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=size)
    model = peers_models.build(args)
    baseline = current_rss()
    if config == "torch-ddp":  # its best setting: gradients live in the buckets, no copy in or out
        model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in peers_models.blocks(args, model):
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step_fn(step: int) -> None:
        optimizer.zero_grad()
        pairs = micro_batches(args, rank, size, step)
        for m, (x, y) in enumerate(pairs):
            last = m == len(pairs) - 1
            quiet = model.no_sync() if config == "torch-ddp" and not last else contextlib.nullcontext()
            with quiet:
                (peers_models.loss(args, model, x, y) / len(pairs)).backward()
        optimizer.step()

    result = gathered(timed_steps(args, dist.barrier, step_fn), baseline)
    dist.destroy_process_group()
    return result


def deepspeed_config(args, stage: int, size: int) -> dict:
    """DeepSpeed's settings: ZeRO ``stage``, fp32, its own accumulation over ``--micro-batches``, quiet."""
    return {
        "train_micro_batch_size_per_gpu": max(1, args.batch // size // args.micro_batches),
        "gradient_accumulation_steps": args.micro_batches,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # torch.optim.Adam as the client optimizer, as the others use
        "steps_per_print": 10**9,
    }


def deepspeed_worker(args, config: str) -> dict:
    """The torch model trained by DeepSpeed's ZeRO (CPU accelerator, gloo, client ``torch.optim.Adam``)."""
    rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    local_rank = os.environ.get("MPI_LOCALRANKID", str(rank))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=local_rank, DS_ACCELERATOR="cpu")
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    deepspeed.utils.logger.setLevel(logging.WARNING)  # its INFO lines go to stdout, which carries the result
    # DeepSpeed 0.19 calls torch.distributed functions that torch 2.13 deprecates, with a warning at every call
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # else a C++ op compiles for minutes at start
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    model = peers_models.build(args)
    baseline = current_rss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    stage = int(config.split("-")[1])
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(args, stage, size))

    def step_fn(step: int) -> None:
        for x, y in micro_batches(args, rank, size, step):
            engine.backward(peers_models.loss(args, engine, x, y))  # DeepSpeed divides by the accumulation
            engine.step()  # updates at the last micro-batch only

    result = gathered(timed_steps(args, dist.barrier, step_fn), baseline)
    dist.destroy_process_group()
    return {**result, "optimizer_steps": engine.global_steps}


WORKERS = {
    "torch": torch_worker,
    "deepspeed": deepspeed_worker,
    "mpizero.torch": mpizero_torch_worker,
    "mpizero": mpizero_worker,
    "gpt2": lambda args, config: peers_gpt2.gpt2_worker(args, config, sys.modules[__name__]),
}


def run_config(args, config: str, micro_batches: int) -> dict:
    """Run ``config`` at ``micro_batches`` per rank in its own ``mpiexec`` job; return rank 0's result."""
    result_file = Path(tempfile.mkdtemp(prefix="bench_peers.")) / "result.json"
    command = [*python_under_mpiexec(args.ranks, str(HERE)), "--worker", config, "--result-file", str(result_file)]
    for option in ("model", "width", "layers", "batch", "seq", "steps", "profile", "profile_rank"):
        command += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    command += ["--micro-batches", str(micro_batches)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29517",
    }
    # the result comes in a file: a line on stdout, printed just before the worker's os._exit, was sometimes lost
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=1200, env=env)
        written = result_file.read_text() if result_file.exists() else ""
        profiled = Path(f"{result_file}.profile")
        if profiled.exists():
            print(f"{config}, {micro_batches} micro-batches: {profiled.read_text()}", flush=True)
    finally:
        shutil.rmtree(result_file.parent)
    if done.returncode != 0 or not written:
        why = f"exit {done.returncode}" + ("" if written else ", no result written")
        raise SystemExit(f"{config} failed ({why}); its error output is above; stdout:\n{done.stdout}")
    result = json.loads(written)
    median = float(np.median(result["times"][WARMUP:]))
    return {"config": config, "micro_batches": micro_batches, "median_ms": round(median * 1e3, 3), **result}


def record(path: str | None, row: dict) -> None:
    """Append ``row`` to the JSON-lines file at ``path`` (when one was asked for), flushed at once."""
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")


def run_all(args) -> dict[str, dict]:
    """Every configuration at every micro-batch count: ``{config: {count: result}}``, or ``{"skipped": why}``."""
    rows = {}
    for config in progress(args.configs, "bench_peers configurations"):
        why = missing(config, args.model)
        if why:
            rows[config] = {"skipped": why}
            record(args.json, {"config": config, "skipped": why})
            continue
        rows[config] = {}
        for count in args.micro_batches:
            rows[config][count] = run_config(args, config, count)
            record(args.json, rows[config][count])
    return rows


def table(rows: dict[str, dict], args) -> list[str]:
    """The table's lines: per count the median step ms and x DDP, then the first count's RSS columns."""
    counts, first = args.micro_batches, args.micro_batches[0]
    baselines = {"torch": rows.get("torch-ddp", {}), "gpt2": rows.get("gpt2-ddp", {})}
    width = max([18, *map(len, rows)])
    header = f"{'configuration':<{width}}"
    for count in counts:
        header += f" {f'{count} mb: ms':>11} {'x DDP':>6}"
    lines = [header + f" {f'peak RSS MiB ({first})':>17} {f'above model MiB ({first})':>21} {'of it shared':>12}"]
    for config, runs in rows.items():
        if "skipped" in runs:
            lines.append(f"{config:<{width}} skipped: {runs['skipped']}")
            continue
        line, ddp = f"{config:<{width}}", baselines["gpt2" if framework(config) == "gpt2" else "torch"]
        for count in counts:
            ratio = runs[count]["median_ms"] / ddp[count]["median_ms"] if count in ddp else None
            line += f" {runs[count]['median_ms']:>11.1f} {f'{ratio:.2f}' if ratio else '-':>6}"
        above = runs[first].get("above")
        above = f"{above / 1024:>21.0f}" if above is not None else f"{'-':>21}"
        mapped = runs[first].get("mapped")
        mapped = f"{mapped / 1024:>12.0f}" if mapped is not None else f"{'-':>12}"
        lines.append(line + f" {runs[first]['rss'] / 1024:>17.0f} {above} {mapped}")
    return lines


def roofline_table(rows: dict[str, dict], args, params: int, rank_rate: float) -> list[str]:
    """Per modelled configuration and count: bytes per parameter a rank moves in a step, the step time they take
    at one rank's share of the bandwidth (``roofline``), and the measured median as a multiple of it."""
    lines = [
        f"roofline: bytes per parameter and step on one rank (read + written, benchmarks/roofline.py) at "
        f"{rank_rate / 1e9:.1f} GB/s per rank ('add' with {args.ranks} processes at once, divided among them)",
        f"{'configuration':<18}"
        + "".join(f" {f'{c} mb: B':>9} {'floor ms':>9} {'x floor':>8}" for c in args.micro_batches),
    ]
    for config, runs in rows.items():
        if "skipped" in runs or roofline.step_bytes(config, args.ranks, 1) is None:
            continue
        line = f"{config:<18}"
        for count in args.micro_batches:
            floor = roofline.floor_ms(config, args.ranks, count, params, rank_rate)
            moved = roofline.step_bytes(config, args.ranks, count)
            line += f" {moved:>9.0f} {floor:>9.3g} {runs[count]['median_ms'] / floor:>8.3g}"
        lines.append(line)
    return lines


def main() -> None:
    args = parse()
    if args.worker:
        (args.micro_batches,) = args.micro_batches  # one count per worker
        result = WORKERS[framework(args.worker)](args, args.worker)
        if int(os.environ.get("PMI_RANK", "0")) == 0:
            Path(args.result_file).write_text(json.dumps(result))
        if framework(args.worker) in ("torch", "deepspeed", "gpt2"):
            os._exit(0)  # torch+gloo sometimes aborts in its exit-time destructors ("terminate called ...")
        return
    from threadpoolctl import threadpool_info

    blas = {i.get("internal_api") for i in threadpool_info()}
    rank_rate = None
    if args.bandwidth:
        print(bandwidth_line(args.bandwidth_mib), flush=True)
        rank_rate = bandwidth(args.ranks, args.bandwidth_mib, 5)["add"] / args.ranks
    rows = run_all(args)
    params = peers_models.parameter_count(args)
    print(
        f"{peers_models.describe(args, params)}, Adam, {' and '.join(map(str, args.micro_batches))} micro-batches "
        f"(mb) per rank, fp32, {args.ranks} ranks, 1 thread per rank ({', '.join(sorted(blas))}), median of steps "
        f"{WARMUP + 1}-{args.steps}"
    )
    print("\n".join(table(rows, args)))
    if rank_rate is not None:
        print("\n".join(roofline_table(rows, args, params, rank_rate)))
    if args.chart:
        draw(rows, args, args.chart)


def draw(rows: dict, args, path: str) -> None:
    """Two bar charts side by side: median step time and peak RSS per configuration, at the first count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = args.micro_batches[0]
    names = [n for n in rows if "skipped" not in rows[n]]
    colours = ["#1f77b4" if n.startswith("mpizero") else "#d62728" for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.barh(names, [rows[n][first]["median_ms"] for n in names], color=colours)
    left.set_xlabel("median step time, ms (lower is better)")
    right.barh(names, [rows[n][first]["rss"] / 1024 for n in names], color=colours)
    right.set_xlabel("peak RSS per rank, MiB (lower is better)")
    right.set_yticklabels([])
    for ax in (left, right):
        ax.invert_yaxis()
    fig.suptitle(
        f"{peers_models.describe(args, peers_models.parameter_count(args))}, Adam, {first} micro-batches per rank, "
        f"fp32, {args.ranks} ranks"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
