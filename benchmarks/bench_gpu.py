"""mpizero on one GPU against plain torch, DDP and FSDP2: step time, peak device memory, staged bytes, bandwidth.

Run (on a machine with a CUDA device, CuPy and torch): python benchmarks/bench_gpu.py
    python benchmarks/bench_gpu.py --models mlp --runs torch ddp mpizero.torch-2 --ranks 1 2
Without a CUDA device it says so and exits with status 0, measuring nothing.

Models: ``mlp``, ``--layers`` x Linear(width, width) + GELU (6 x 4096: 101M parameters), and
``transformer``, a torch.nn.TransformerEncoder; AdamW, ``--micro-batches`` backward passes of
``--rows`` rows per step, fp32, TF32 off; ``gpt2``, transformers' GPT-2 124M built from its config (no download),
under bf16 autocast, ``--micro-batches`` of 2 x 1024 tokens (default 4). ``--profile``: each mpizero.torch and
torch run takes one more step under torch.profiler and prints its top device and host operations and its counts
of kernels, copies, waits and allocations (``gpu_profile``). Runs, each in its own process (or ``mpiexec -n R`` job):
``torch`` (one process), ``ddp`` and ``fsdp2`` (NCCL, world size 1), ``mpizero.torch-S`` (stage S,
at each of ``--ranks`` on the one GPU: a plain loop, ``backward()`` per micro-batch then ``step()``),
``mpizero.closure-S`` (the same passes through ``step(closure)``, which copies no counts back per pass),
and ``train`` (``python -m mpizero train --device gpu``, the NumPy-style transformer, at each of ``--ranks``).
Step time: median after ``--warmup`` steps, slowest rank. Peak memory: torch's peak allocation plus CuPy's
pool, largest rank. Staged: bytes copied between device and host per step (``Traffic.staged``), and the rate
they moved at while blocked in collectives, beside the pinned copy peak measured first.

``--json FILE`` is rewritten (atomically) as each run ends, so a benchmark cut short keeps its rows.
``--budget SECONDS`` bounds the whole benchmark from its start: a run starts only while the time left is at
least 1.25 x the longest run so far (and at least 10 s), under ``--timeout`` cut to the time left; the others,
and a run the budget cut, are rows that say ``skipped``. Exit status 1 if a run failed (each is named), else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
STAGES = range(4)
RUNS = ["torch", "ddp", "fsdp2", *(f"mpizero.{loop}-{s}" for loop in ("torch", "closure") for s in STAGES), "train"]
NO_DEVICE = "bench_gpu: no CUDA device ({why}): nothing to measure"
SHORTEST_RUN = 10.0  # seconds: no run of a fresh process that builds a model on the GPU takes less


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"], choices=["mlp", "transformer", "gpt2"])
    parser.add_argument("--runs", nargs="+", default=RUNS, choices=RUNS)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes for mpizero runs")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--micro-batches", type=int, default=None, help="per step (default 8; GPT-2's 4)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=240, help="seconds per run")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all runs (default: no limit)")
    parser.add_argument("--json", default=None, help="also write the rows here, after each run")
    parser.add_argument("--profile", action="store_true", help="profile one more step of each run (gpu_profile)")
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
    if model_name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config()).cuda()  # 124M, from the config: no download
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
    if model_name == "gpt2":
        ids = torch.randint(0, 50257, (2, 1024), device="cuda", generator=g)
        return ids, ids
    shape = (args.rows, args.width) if model_name == "mlp" else (args.rows // 8, 128, 1024)
    x = torch.randn(shape, device="cuda", generator=g)
    return x, torch.tanh(x)


def micro_batches(args, model_name: str) -> int:
    """``--micro-batches``, or the model's default: 8, GPT-2's 4 (of 2 x 1024 tokens)."""
    return args.micro_batches or (4 if model_name == "gpt2" else 8)


def backward(args, model, step: int, micro: int) -> None:
    """One micro-batch's forward and backward (GPT-2's under bf16 autocast, its loss its own)."""
    import torch

    x, y = batch(args, args.model, 0, step, micro)
    if args.model == "gpt2":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=y).loss
    else:
        loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()


def with_profile(args, result: dict, step_fn) -> dict:
    """``result`` with one more step's profile (``gpu_profile``) where ``--profile`` asks for it."""
    if args.profile:
        from gpu_profile import profiled

        result["profile"] = profiled(step_fn, args.warmup + args.steps)
    return result


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

            units = {"transformer": lambda: model.layers, "gpt2": lambda: model.transformer.h}.get(
                args.model, lambda: [m for m in model if hasattr(m, "weight")]
            )()
            for unit in units:
                fully_shard(unit)
            fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step_fn(step: int) -> None:
        optimizer.zero_grad()
        for micro in range(micro_batches(args, args.model)):
            backward(args, model, step, micro)
        optimizer.step()

    times = timed(args, step_fn, lambda: None)
    result = {"times": times, "peak": torch.cuda.max_memory_allocated(), "staged": 0, "staged_seconds": 0.0}
    result = with_profile(args, result, step_fn)
    if run != "torch":
        dist.destroy_process_group()
    return result


def mpizero_worker(args, run: str) -> dict:
    """``mpizero.torch.shard`` at one stage; this rank's share of the micro-batches, in a plain loop or through
    ``step(closure)``."""
    import numpy as np
    from mpi4py import MPI

    import mpizero
    from mpizero.torch import shard

    comm = MPI.COMM_WORLD
    model = build(args, args.model)
    zero = shard(model, mpizero.AdamW(lr=1e-4), stage=int(run.rsplit("-", 1)[1]), comm=comm)
    mine = mpizero.split_evenly(micro_batches(args, args.model), comm.size, comm.rank)

    def passes(step: int) -> None:
        for micro in mine:
            backward(args, model, step, micro)

    def step_fn(step: int) -> None:
        if run.startswith("mpizero.closure"):
            zero.step(lambda: passes(step))
        else:
            passes(step)
            zero.step()
        zero.zero_grad()

    traffic = zero.engine.collectives.traffic
    times = timed(args, step_fn, comm.Barrier)  # the warm-up's staging counts too: divided by all steps below
    slowest = np.empty(len(times))
    comm.Allreduce(np.array(times), slowest, op=MPI.MAX)
    staged = sum(traffic.staged.values()) / (args.warmup + args.steps)
    seconds = sum(traffic.seconds[op] for op in traffic.staged) / (args.warmup + args.steps)
    result = {
        "times": slowest.tolist(),
        "peak": comm.allreduce(peak_device_bytes(), op=MPI.MAX),
        "staged": comm.allreduce(staged, op=MPI.MAX),
        "staged_seconds": comm.allreduce(seconds, op=MPI.MAX),
    }
    return with_profile(args, result, step_fn)


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


def run_one(args, run: str, model: str, ranks: int, timeout: float) -> dict:
    """One run in its own process or mpiexec job, killed with all its ranks after ``timeout`` s; its row or why it
    failed."""
    from mpizero.comm.job.launcher import python_under_mpiexec

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
        worker += ["--micro-batches", str(micro_batches(args, model)), "--rows", str(args.rows)]
        worker += ["--steps", str(args.steps), "--warmup", str(args.warmup), *(["--profile"] if args.profile else [])]
        command = python_under_mpiexec(ranks, *worker) if run.startswith("mpizero") else [sys.executable, *worker]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531", "MPIZERO_CUDA_AWARE": "0"}
    # A session of its own: on a timeout every rank is killed, not only mpiexec (a rank left behind holds the GPU).
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"failed": f"timed out after {timeout:.0f} s", "timed_out": True}
    if proc.returncode != 0:
        return {"failed": (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:160]}
    if run == "train":
        steps = [line for line in stdout.splitlines() if line.startswith("step")]
        ms = sorted(float(line.split(" ms")[0].split()[-1]) for line in steps[args.warmup :])
        return {"times": [m / 1e3 for m in ms], "peak": None, "staged": None, "staged_seconds": None}
    return json.loads(stdout.strip().splitlines()[-1])


def row_text(label: str, row: dict, plain: float | None) -> str:
    for outcome in ("failed", "skipped"):
        if outcome in row:
            return f"{label:<26} {outcome}: {row[outcome]}"
    median = sorted(row["times"])[len(row["times"]) // 2]
    ratio = f"{median / plain:8.2f}" if plain else f"{'-':>8}"
    peak = f"{row['peak'] / 2**20:10.0f}" if row.get("peak") else f"{'-':>10}"
    staged = row.get("staged") or 0
    rate = f"{staged / row['staged_seconds'] / 1e9:8.1f}" if staged and row.get("staged_seconds") else f"{'-':>8}"
    return f"{label:<26} {median * 1e3:9.1f} {ratio} {peak} {staged / 2**20:11.1f} {rate}"


def planned(args) -> list[tuple[str, str, int]]:
    """(model, run, ranks) in the order they run: ``--runs`` order, each at ``--ranks``; ``train`` once."""
    order = []
    for model in args.models:
        for run in args.runs:
            if run == "train" and model != args.models[0]:
                continue  # the CLI trains its own model: once is enough
            for ranks in args.ranks if run.startswith("mpizero") or run == "train" else [1]:
                order.append((model, run, ranks))
    return order


def measure(args, save, started: float) -> list[dict]:
    """Run each planned run that fits in ``--budget`` from ``started``; print its row and ``save(rows, done)`` as each
    ends."""
    rows, plain, longest, model_shown = [], None, 0.0, None
    save(rows, False)
    for model, run, ranks in planned(args):
        if model != model_shown:
            print(f"\n{model}: step ms (median), x plain torch, peak device MiB, staged MiB/step, staged GB/s")
            model_shown, plain = model, None
        left = None if args.budget is None else args.budget - (time.monotonic() - started)
        if left is not None and left < max(1.25 * longest, SHORTEST_RUN):
            row = {
                "skipped": f"out of time: {left:.0f} s of --budget {args.budget:.0f} left, longest run {longest:.0f} s"
            }
        else:
            began, timeout = time.monotonic(), args.timeout if left is None else min(args.timeout, left)
            row = run_one(args, run, model, ranks, timeout)
            if row.pop("timed_out", False) and timeout < args.timeout:  # the budget ended it, not --timeout
                row = {"skipped": f"out of time: cut at the end of --budget after {timeout:.0f} s"}
            row["wall_s"] = round(time.monotonic() - began, 1)
            longest = max(longest, row["wall_s"])
        if run == "torch" and "times" in row:
            plain = sorted(row["times"])[len(row["times"]) // 2]
        print(row_text(f"{run} -n {ranks}", row, plain), flush=True)
        if "profile" in row:
            from gpu_profile import lines  # beside this file, on the path of a script run

            print("\n".join(lines(f"{run} -n {ranks}", row["profile"])), flush=True)
        rows.append({"model": model, "run": run, "ranks": ranks, **row})
        save(rows, False)
    save(rows, True)
    return rows


def write_json(path: str | None, document: dict) -> None:
    """Replace ``path`` with ``document`` in one rename: a reader never sees half a file."""
    if path is None:
        return
    partial = Path(f"{path}.partial")
    partial.write_text(json.dumps(document, indent=1))
    os.replace(partial, path)


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker = torch_worker if args.worker in ("torch", "ddp", "fsdp2") else mpizero_worker
        tf32_off()
        result = worker(args, args.worker)
        if int(os.environ.get("PMI_RANK", "0")) == 0:
            print(json.dumps(result), flush=True)
        return 0
    started = time.monotonic()  # --budget counts from here: the pinned copy and the imports are in it
    why = no_device_reason()
    if why is not None:
        print(NO_DEVICE.format(why=why), flush=True)
        return 0
    d2h, h2d = pinned_peak()
    print(f"pinned copy peak: device to host {d2h / 1e9:.1f} GB/s, host to device {h2d / 1e9:.1f} GB/s", flush=True)
    if args.profile:
        from gpu_profile import print_standin_counts

        print_standin_counts(args.models, micro_batches(args, "mlp"))

    def save(rows: list[dict], done: bool) -> None:
        write_json(args.json, {"pinned": [d2h, h2d], "rows": rows, "done": done})

    rows = measure(args, save, started)
    failed = [f"{r['run']} -n {r['ranks']} ({r['model']})" for r in rows if "failed" in r]
    skipped = sum("skipped" in r for r in rows)
    print(f"\nbench_gpu: {len(rows) - len(failed) - skipped} runs measured, {skipped} skipped for time", flush=True)
    if failed:
        print(f"bench_gpu: FAILED: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


def tf32_off() -> None:
    """TF32 off, as in issue 20's measurements: fp32 matrix products in fp32."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


if __name__ == "__main__":
    raise SystemExit(main())
