"""mpizero on one GPU against plain torch, DDP and FSDP2: step time, peak device memory, staged bytes, bandwidth.

Run (on a machine with a CUDA device, CuPy and torch): python benchmarks/bench_gpu.py
    python benchmarks/bench_gpu.py --models mlp --runs torch ddp mpizero.torch-2 --ranks 1 2
Without a CUDA device it says so and exits with status 0, measuring nothing.

Models: ``mlp``, ``--layers`` x Linear(width, width) + GELU (6 x 4096: 101M parameters), and
``transformer``, a torch.nn.TransformerEncoder; AdamW, ``--micro-batches`` backward passes of
``--rows`` rows per step, fp32, TF32 off. Runs, each in its own process (or ``mpiexec -n R`` job):
``torch`` (one process), ``ddp`` and ``fsdp2`` (NCCL, world size 1), ``mpizero.torch-S`` (stage S,
at each of ``--ranks`` on the one GPU), and ``train`` (``python -m mpizero train --device gpu``, the
NumPy-style transformer, at each of ``--ranks``). Step time: median after ``--warmup`` steps, slowest
rank. Peak memory: torch's peak allocation plus CuPy's pool, largest rank. Staged: bytes copied between
device and host per step (``Traffic.staged``), and the rate they moved at while blocked in collectives,
beside the pinned copy peak measured first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
RUNS = ["torch", "ddp", "fsdp2", "mpizero.torch-0", "mpizero.torch-1", "mpizero.torch-2", "mpizero.torch-3", "train"]
NO_DEVICE = "bench_gpu: no CUDA device ({why}): nothing to measure"


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"], choices=["mlp", "transformer"])
    parser.add_argument("--runs", nargs="+", default=RUNS, choices=RUNS)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes for mpizero runs")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=240, help="seconds per run")
    parser.add_argument("--json", default=None, help="also write every row here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="mlp", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def no_device_reason() -> str | None:
    """Why no CUDA device can be used here (None: one can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed"
    return None


def build(args, model_name: str):
    """The model on the GPU, the same initial values in every process."""
    import torch

    torch.manual_seed(0)
    if model_name == "mlp":
        layers = [m for _ in range(args.layers) for m in (torch.nn.Linear(args.width, args.width), torch.nn.GELU())]
        model = torch.nn.Sequential(*layers)
    else:
        layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    return model.cuda()


def batch(args, model_name: str, rank: int, step: int, micro: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(100_000 * step + 100 * rank + micro)
    shape = (args.rows, args.width) if model_name == "mlp" else (args.rows // 8, 128, 1024)
    x = torch.randn(shape, device="cuda", generator=g)
    return x, torch.tanh(x)


def timed(args, step_fn, barrier) -> list[float]:
    import torch

    times = []
    for step in range(args.warmup + args.steps):
        barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step_fn(step)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[args.warmup :]


def peak_device_bytes() -> int:
    import cupy
    import torch

    return torch.cuda.max_memory_allocated() + cupy.get_default_memory_pool().total_bytes()


def torch_worker(args, run: str) -> dict:
    """Plain torch, DDP or FSDP2 at world size 1 (NCCL)."""
    import torch
    import torch.distributed as dist

    model = build(args, args.model)
    if run != "torch":
        dist.init_process_group("nccl", rank=0, world_size=1)
        if run == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            units = model.layers if args.model == "transformer" else [m for m in model if hasattr(m, "weight")]
            for unit in units:
                fully_shard(unit)
            fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step_fn(step: int) -> None:
        optimizer.zero_grad()
        for micro in range(args.micro_batches):
            x, y = batch(args, args.model, 0, step, micro)
            torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    times = timed(args, step_fn, lambda: None)
    if run != "torch":
        dist.destroy_process_group()
    return {"times": times, "peak": torch.cuda.max_memory_allocated(), "staged": 0, "staged_seconds": 0.0}


def mpizero_worker(args, run: str) -> dict:
    """``mpizero.torch.shard`` at one stage; this rank's share of the micro-batches."""
    import numpy as np
    import torch
    from mpi4py import MPI

    import mpizero
    from mpizero.torch import shard

    comm = MPI.COMM_WORLD
    model = build(args, args.model)
    zero = shard(model, mpizero.AdamW(lr=1e-4), stage=int(run.rsplit("-", 1)[1]), comm=comm)
    mine = mpizero.split_evenly(args.micro_batches, comm.size, comm.rank)

    def step_fn(step: int) -> None:
        for micro in mine:
            x, y = batch(args, args.model, 0, step, micro)
            torch.nn.functional.mse_loss(model(x), y).backward()
        zero.step()
        zero.zero_grad()

    traffic = zero.engine.collectives.traffic
    times = timed(args, step_fn, comm.Barrier)  # the warm-up's staging counts too: divided by all steps below
    slowest = np.empty(len(times))
    comm.Allreduce(np.array(times), slowest, op=MPI.MAX)
    staged = sum(traffic.staged.values()) / (args.warmup + args.steps)
    seconds = sum(traffic.seconds[op] for op in traffic.staged) / (args.warmup + args.steps)
    return {
        "times": slowest.tolist(),
        "peak": comm.allreduce(peak_device_bytes(), op=MPI.MAX),
        "staged": comm.allreduce(staged, op=MPI.MAX),
        "staged_seconds": comm.allreduce(seconds, op=MPI.MAX),
    }


def pinned_peak() -> tuple[float, float]:
    """Bytes per second of one 256 MiB copy, device to host and host to device, through pinned memory."""
    import cupy
    import cupyx

    device = cupy.ones(1 << 25, cupy.float64)
    host = cupyx.empty_pinned(device.shape, device.dtype)
    rates = []
    for direction in ("d2h", "h2d"):
        best = 0.0
        for _ in range(3):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            if direction == "d2h":
                device.get(out=host, blocking=False)
            else:
                device.set(host)
            stop.record()
            stop.synchronize()
            best = max(best, device.nbytes / (cupy.cuda.get_elapsed_time(start, stop) / 1e3))
        rates.append(best)
    return rates[0], rates[1]


def run_one(args, run: str, model: str, ranks: int) -> dict:
    """One run in its own process or mpiexec job; its row, or why it failed."""
    from mpizero.comm.launcher import python_under_mpiexec

    if run == "train":
        command = python_under_mpiexec(ranks, "-m", "mpizero", "train", "--device", "gpu", "--model", "transformer")
        command += ["--width", "256", "--layers", "4", "--stage", "3", "--steps", str(args.warmup + args.steps)]
        command += ["--log-every", "1"]
    else:
        worker = [
            str(HERE),
            "--worker",
            run,
            "--model",
            model,
            "--width",
            str(args.width),
            "--layers",
            str(args.layers),
        ]
        worker += ["--micro-batches", str(args.micro_batches), "--rows", str(args.rows)]
        worker += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        command = python_under_mpiexec(ranks, *worker) if run.startswith("mpizero") else [sys.executable, *worker]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531", "MPIZERO_CUDA_AWARE": "0"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {args.timeout:.0f} s"}
    if done.returncode != 0:
        return {"failed": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:160]}
    if run == "train":
        steps = [line for line in done.stdout.splitlines() if line.startswith("step")]
        ms = sorted(float(line.split(" ms")[0].split()[-1]) for line in steps[args.warmup :])
        return {"times": [m / 1e3 for m in ms], "peak": None, "staged": None, "staged_seconds": None}
    return json.loads(done.stdout.strip().splitlines()[-1])


def row_text(label: str, row: dict, plain: float | None) -> str:
    if "failed" in row:
        return f"{label:<26} failed: {row['failed']}"
    median = sorted(row["times"])[len(row["times"]) // 2]
    ratio = f"{median / plain:8.2f}" if plain else f"{'-':>8}"
    peak = f"{row['peak'] / 2**20:10.0f}" if row.get("peak") else f"{'-':>10}"
    staged = row.get("staged") or 0
    rate = f"{staged / row['staged_seconds'] / 1e9:8.1f}" if staged and row.get("staged_seconds") else f"{'-':>8}"
    return f"{label:<26} {median * 1e3:9.1f} {ratio} {peak} {staged / 2**20:11.1f} {rate}"


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker = torch_worker if args.worker in ("torch", "ddp", "fsdp2") else mpizero_worker
        tf32_off()
        result = worker(args, args.worker)
        if int(os.environ.get("PMI_RANK", "0")) == 0:
            print(json.dumps(result), flush=True)
        return 0
    why = no_device_reason()
    if why is not None:
        print(NO_DEVICE.format(why=why), flush=True)
        return 0
    d2h, h2d = pinned_peak()
    print(f"pinned copy peak: device to host {d2h / 1e9:.1f} GB/s, host to device {h2d / 1e9:.1f} GB/s", flush=True)
    rows = []
    for model in args.models:
        print(f"\n{model}: step ms (median), x plain torch, peak device MiB, staged MiB/step, staged GB/s")
        plain = None
        for run in args.runs:
            for ranks in args.ranks if run.startswith("mpizero") or run == "train" else [1]:
                if run == "train" and model != args.models[0]:
                    continue  # the CLI trains its own model: once is enough
                row = run_one(args, run, model, ranks)
                if run == "torch" and "times" in row:
                    plain = sorted(row["times"])[len(row["times"]) // 2]
                print(row_text(f"{run} -n {ranks}", row, plain), flush=True)
                rows.append({"model": model, "run": run, "ranks": ranks, **row})
    if args.json:
        Path(args.json).write_text(json.dumps({"pinned": [d2h, h2d], "rows": rows}, indent=1))
    return 0


def tf32_off() -> None:
    """TF32 off, as in issue 20's measurements: fp32 matrix products in fp32."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


if __name__ == "__main__":
    raise SystemExit(main())
