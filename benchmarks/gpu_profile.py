"""One step under torch.profiler on a GPU: its top device and host operations, and what it asked of the device.

bench_gpu.py's workers call ``profiled(step_fn, step)`` after their timed steps when given ``--profile``; the row
then carries ``profile``: the ten operations with the most device time and the ten with the most host time, and
per step the kernels launched (device-side kernel records: CuPy's and torch's alike), copies and fills, and the
host API calls that wait (stream, event and device synchronisations), make a stream wait on an event, or allocate
device memory. ``lines(profile)`` prints them. The counts the stand-in gives for the same step
(``bench_device_counts.py``) are what these should match, launch for launch, where torch's own work is left out.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

TOP = 10
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize")
STREAM_WAITS = ("cudaStreamWaitEvent", "cuStreamWaitEvent")
ALLOCATIONS = ("cudaMalloc", "cuMemAlloc")


def profiled(step_fn, step: int) -> dict:
    """Run ``step_fn(step)`` once under the profiler (CPU and CUDA activities); its summary (see the docstring)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        step_fn(step)
        torch.cuda.synchronize()
    return summary(trace.events())


def summary(events) -> dict:
    """The profile's summary from its events (``name``, ``device_type``, ``self_device_time_total`` or
    ``self_cuda_time_total``, ``self_cpu_time_total``)."""
    device_time, host_time, counts = Counter(), Counter(), Counter()
    for event in events:
        name = event.name
        on_device = "CUDA" in str(event.device_type)
        if on_device:
            device_time[name] += _device_us(event)
            kind = "copies" if name.startswith(("Memcpy", "Memset")) else "kernels"
            counts[kind] += 1
            continue
        host_time[name] += event.self_cpu_time_total
        for kind, names in (("waits", WAITS), ("stream_waits", STREAM_WAITS), ("allocations", ALLOCATIONS)):
            if name.startswith(names):
                counts[kind] += 1
    return {
        "device_top": [[n, round(us / 1e3, 3)] for n, us in device_time.most_common(TOP)],
        "host_top": [[n, round(us / 1e3, 3)] for n, us in host_time.most_common(TOP)],
        "counts": {k: counts[k] for k in ("kernels", "copies", "waits", "stream_waits", "allocations")},
    }


def _device_us(event) -> float:
    for attribute in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attribute, None)
        if value is not None:
            return float(value)
    return 0.0


def lines(label: str, profile: dict) -> list[str]:
    """The summary as lines to print under the run's row."""
    counts = ", ".join(f"{k} {v}" for k, v in profile["counts"].items())
    out = [f"  {label} profile, one step: {counts}"]
    for title, key in (("device ms", "device_top"), ("host ms", "host_top")):
        out.append(f"    top {title}: " + "; ".join(f"{name[:48]} {ms:g}" for name, ms in profile[key]))
    return out


def print_standin_counts(models: list[str], micro_batches: int) -> None:
    """Print what the stand-in counts for a step of the same loop (``bench_device_counts.py``), to set beside the
    profiles: the engine's device work alone, torch's left out."""
    counted = [m for m in models if m in ("mlp", "gpt2")]
    if not counted:
        return
    command = [sys.executable, str(Path(__file__).with_name("bench_device_counts.py")), "--models", *counted]
    command += ["--micro-batches", str(max(2, micro_batches - micro_batches % 2))]
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the stand-in needs no GPU and takes none
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    print("the stand-in's counts of the same loop (bench_device_counts.py):", flush=True)
    print(done.stdout.strip() if done.returncode == 0 else f"failed: {done.stderr.strip()[-300:]}", flush=True)
