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
