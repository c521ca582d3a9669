"""benchmarks/bench_gpu.py where there is no GPU: it parses its arguments, says why it measures nothing, exits 0."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"


def test_without_a_cuda_device_it_says_so_and_exits_cleanly():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the benchmark would run for minutes")
    done = subprocess.run(
        [sys.executable, str(BENCH), "--models", "mlp", "--ranks", "1"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "bench_gpu: no CUDA device (torch.cuda.is_available() is False): nothing to measure"


def test_bad_arguments_are_refused_by_name():
    done = subprocess.run([sys.executable, str(BENCH), "--runs", "nccl"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "invalid choice: 'nccl'" in done.stderr


def test_a_profiles_summary_counts_kernels_copies_waits_and_allocations():
    """``gpu_profile.summary`` on profiler events as torch gives them: device records are kernels or copies, host
    API calls are waits, stream waits or allocations; the top operations by time, and the lines printed."""
    sys.path.insert(0, str(BENCH.parent))
    from types import SimpleNamespace as Event

    import gpu_profile

    events = [
        Event(name="mz_group_encode", device_type="DeviceType.CUDA", self_device_time_total=120.0),
        Event(name="mz_update", device_type="DeviceType.CUDA", self_device_time_total=80.0),
        Event(name="Memcpy DtoH (Device -> Pinned)", device_type="DeviceType.CUDA", self_device_time_total=5.0),
        Event(name="cudaStreamSynchronize", device_type="DeviceType.CPU", self_cpu_time_total=30.0),
        Event(name="cudaStreamWaitEvent", device_type="DeviceType.CPU", self_cpu_time_total=1.0),
        Event(name="cudaMalloc", device_type="DeviceType.CPU", self_cpu_time_total=3.0),
        Event(name="aten::mm", device_type="DeviceType.CPU", self_cpu_time_total=50.0),
    ]
    summary = gpu_profile.summary(events)
    assert summary["counts"] == {"kernels": 2, "copies": 1, "waits": 1, "stream_waits": 1, "allocations": 1}
    assert summary["device_top"][0] == ["mz_group_encode", 0.12] and summary["host_top"][0] == ["aten::mm", 0.05]
    lines = gpu_profile.lines("mpizero.torch-0 -n 1", summary)
    assert lines[0] == (
        "  mpizero.torch-0 -n 1 profile, one step: kernels 2, copies 1, waits 1, stream_waits 1, allocations 1"
    )
