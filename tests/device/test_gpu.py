"""The GPU path: CuPy arrays through every stage, staged or CUDA-aware, bitwise against a GPU reference.

Skips cleanly without CuPy or a CUDA device (CI has neither). What can be tested on the CPU is:
staging and the one-rank path with a stand-in device array (tests/comm/test_staging.py,
tests/comm/check_transport.py), the order-free embedding backward (tests/training/test_scatter.py), the
fused kernels' formulas (tests/core/test_arithmetic.py). launch/gpu_check.sh runs this file and more on a GPU.
"""

import os

import numpy as np
import pytest
from mpirun import run_mpi, run_mpi_ok


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA device")


def cuda_aware_settings() -> list[str]:
    """Host staging always; straight device buffers too when the loaded MPI says it is CUDA-aware."""
    from mpizero.comm.cuda_aware import query_cuda_support

    return ["0", "1"] if query_cuda_support() else ["0"]


@pytest.mark.parametrize("model", ["mlp", "transformer"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_verify_on_the_gpu_is_bitwise_at_every_stage(model, precision):
    for aware in cuda_aware_settings():
        out = run_mpi_ok(
            2,
            [
                "-m",
                "mpizero",
                "verify",
                "--device",
                "gpu",
                "--model",
                model,
                "--precision",
                precision,
                "--micro-batches",
                "3",
                "--steps",
                "4",
            ],
            env={"MPIZERO_CUDA_AWARE": aware},
            timeout=300,
        )
        assert out.count(": bitwise") == 4, out


def test_train_on_the_gpu_is_byte_identical_across_ranks_and_stages(tmp_path):
    files = []
    for n, stage in [(1, 0), (2, 3), (2, 1)]:
        path = tmp_path / f"{n}-{stage}.npy"
        run_mpi_ok(
            n,
            [
                "-m",
                "mpizero",
                "train",
                "--device",
                "gpu",
                "--model",
                "transformer",
                "--stage",
                str(stage),
                "--steps",
                "4",
                "--global-batch",
                "8",
                "--micro-batches",
                "2",
                "--save-params",
                str(path),
            ],
            env={"MPIZERO_CUDA_AWARE": "0"},
            timeout=300,
        )
        files.append(path.read_bytes())
    assert all(f == files[0] for f in files)
    assert np.load(tmp_path / "1-0.npy").dtype == np.float32


def test_bf16_on_the_gpu_verifies_and_trains_to_one_set_of_bytes(tmp_path):
    """bfloat16 held as 16-bit words by our CUDA kernels: verify bitwise at every stage, the engine's bytes the
    host's (``--against cpu``: the same gradients through both), and train's bytes one set across rank counts
    and stages. Train's bytes are not the host's: its model's matrix products run on the device, which sums in
    another order than the host's BLAS (docs/gpus.md; the first H200 run showed one bf16 word a unit apart)."""
    settings = ["--precision", "bf16", "--model", "mlp"]
    out = run_mpi_ok(2, ["-m", "mpizero", "verify", "--device", "gpu", *settings, "--steps", "3"], timeout=120)
    assert out.count(": bitwise") == 4, out
    against = ["verify", "--device", "gpu", "--against", "cpu", *settings, "--steps", "2"]
    out = run_mpi_ok(2, ["-m", "mpizero", *against], env={"MPIZERO_CUDA_AWARE": "0"}, timeout=120)
    assert out.count("gpu against cpu: bitwise") == 4, out
    files = []
    for n, stage in [(1, 0), (2, 3)]:
        path = tmp_path / f"{n}-{stage}.npy"
        train = ["train", "--device", "gpu", *settings, "--stage", str(stage), "--steps", "2", "--global-batch", "8"]
        run_mpi_ok(n, ["-m", "mpizero", *train, "--save-params", str(path)], timeout=120)
        files.append(path.read_bytes())
    assert files[0] == files[1]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_forward_and_backward_on_users_streams_give_the_default_streams_bytes(stage):
    """``torch.cuda.stream(s)`` around each micro-batch's forward and backward, two streams in turn, ``step()``
    on the default stream behind a busy kernel (``torch.cuda._sleep``), so its update runs late: the masters are
    the bytes of the same loop on the default stream alone (``mpizero/torch/streams.py``: events between the
    streams the engine is entered on, ``order_forward``, and ``record_stream`` for gradients the engine holds,
    paired at stage 2). On the stand-in: ``tests/device/test_standin.py``."""
    import torch

    from mpizero.torch import shard

    def trained(streams: list) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
        settings = {"pair_contributions": True} if stage == 2 else {}
        zero = shard(model.cuda(), torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage, **settings)
        x = torch.randn(256, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        torch.cuda.synchronize()  # x, made on the default stream, is read on the others
        for _ in range(3):
            for i in range(4):
                with torch.cuda.stream(streams[i % len(streams)]):
                    model(x * (i + 1)).square().mean().backward()
            torch.cuda._sleep(50_000_000)
            zero.step()
        return {name: a.tobytes() for name, a in zero.master_params().items()}

    assert trained([torch.cuda.Stream(), torch.cuda.Stream()]) == trained([torch.cuda.current_stream()])


def test_unset_switch_warns_once_when_staging():
    if "1" in cuda_aware_settings():
        pytest.skip("this MPI is CUDA-aware: nothing to warn about")
    env = {k: v for k, v in os.environ.items() if k != "MPIZERO_CUDA_AWARE"}
    done = run_mpi(1, ["-m", "mpizero", "verify", "--device", "gpu", "--stage", "3", "--steps", "1"], env=env)
    assert done.returncode == 0 and done.stderr.count("MPI is not CUDA-aware: staging GPU buffers") == 1
