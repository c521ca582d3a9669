"""``verify --device standin --against cpu``: the engine on the stand-in's device against the engine on the host,
bit for bit, and a deliberately wrong device kernel that the reference on the device cannot see but this can."""

from mpirun import run_mpi, run_python


def test_the_device_gives_the_hosts_bytes_at_every_stage_and_precision():
    done = run_mpi(
        2,
        ["-m", "mpizero", "verify", "--device", "standin", "--against", "cpu", "--precision", "all", "--steps", "3"],
        timeout=120,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    for precision in ("fp32", "fp16", "bf16"):
        assert out.count(f"{precision}  standin against cpu: bitwise (params, masters and optimizer states") == 4, out
    assert out.count("the full params of every gather") == 3  # stage 3, each precision


def test_a_wrong_device_update_passes_against_the_device_reference_and_fails_against_the_host():
    done = run_mpi(1, ["-m", "mpi4py", "tests/device/check_against_cpu.py", "update"], timeout=60)
    out = done.stdout
    assert "exit on the device: 0" in out and ": bitwise;" in out, out + done.stderr  # the reference shares the kernel
    assert "exit against cpu: 1" in out and "standin against cpu: MISMATCH at step 1" in out, out + done.stderr
    assert "params l0.w[0, 0] device" in out


def test_a_wrong_group_decode_fails_against_the_device_reference_and_against_the_host():
    """The engine decodes a group's segments in one launch; the reference decodes each tensor by the one-tensor
    kernel, so a wrong group decode is caught by ``verify`` on the device as well as ``--against cpu``."""
    done = run_mpi(1, ["-m", "mpi4py", "tests/device/check_against_cpu.py", "decode"], timeout=60)
    out = done.stdout
    assert "exit on the device: 1" in out and ": MISMATCH at step 1 on rank 0: params" in out, out + done.stderr
    assert "exit against cpu: 1" in out and "(redo, skipped, norm) device" in out, out + done.stderr


def test_against_cpu_refuses_a_host_run_and_native_sums():
    done = run_python(["-m", "mpizero", "verify", "--against", "cpu", "--reduction", "native"], timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--against cpu compares a device with the host: give --device gpu or standin" in done.stderr
    assert "--against cpu needs --reduction exact: native sums differ between paths" in done.stderr
