"""launch/gpu_check.sh and benchmarks/bench_gpu.py on the CPU: the device code paths through the whole check on the
stand-in for CuPy (GPU_CHECK_DEVICE=standin), and the check's bookkeeping: what is named failed, skipped, compared.
"""

import base64
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
from mpirun import ROOT

SCRIPT = ROOT / "launch" / "gpu_check.sh"


def gpu_check(tmp_path, *parts: str, cwd: Path = ROOT, **variables) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        "PYTHON": sys.executable,
        "GPU_CHECK_DEVICE": "cpu",
        "OUT": str(tmp_path / "out"),
        "TMPDIR": str(tmp_path),
        **variables,
    }
    return subprocess.run(
        ["bash", str(cwd / "launch" / "gpu_check.sh"), *parts],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_failed_train_run_is_named_and_left_out_of_the_comparison(tmp_path):
    python = tmp_path / "python"  # fails every train at stage 3, as a crash on the GPU would
    python.write_text(
        "#!/usr/bin/env bash\n"
        'case " $* " in *" train "*"--stage 3 "*) echo "a deliberate failure" >&2; exit 3 ;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    done = gpu_check(tmp_path, "quick", PYTHON=str(python), GPU_CHECK_DEVICE="standin")
    out = done.stdout
    assert done.returncode == 1, out
    assert "!! train-0-2-3-pinned failed (exit" in out
    assert "train bytes: train-0-1-0-pinned compared; not compared (failed or skipped): train-0-2-3-pinned" in out
    assert "differ" not in out
    assert out.rstrip().splitlines()[-1].startswith("gpu_check: FAILED: train-0-2-3-pinned")
    assert "same bytes" in out  # the round trip (torch on the stand-in's device path) still ran, and passed
    assert out.count("mlp  optimizer adam  fp32  standin against cpu: bitwise (") == 4  # the device against the host
    assert "-- bridge-2: every digest the device printed is the CPU's" in out  # mpizero.torch, the same
    assert (tmp_path / "out" / "gpu_check-quick.log").read_text() == out


def test_commands_past_the_deadline_are_named_skipped(tmp_path):
    done = gpu_check(tmp_path, GPU_CHECK_DEADLINE="0")
    last = done.stdout.rstrip().splitlines()[-1]
    assert done.returncode == 2, done.stdout
    assert last.startswith(
        "gpu_check: INCOMPLETE: nothing failed; skipped: versions against-2-mlp bridge-2-device verify-0-2-mlp-fp32"
    )
    assert "verify-0-1-transformer-fp16" in last and "train-0-2-3-pageable" in last and last.endswith("bench_gpu")


def test_an_unknown_part_or_device_is_refused_by_name(tmp_path):
    done = gpu_check(tmp_path, "quick", "bitwse")
    assert done.returncode == 1 and "gpu_check: unknown part 'bitwse': quick, bitwise or bench" in done.stdout
    done = gpu_check(tmp_path, "quick", GPU_CHECK_DEVICE="tpu")
    assert done.returncode == 1 and "GPU_CHECK_DEVICE=tpu: expected gpu, standin or cpu" in done.stdout


def test_the_device_paths_pass_bitwise_on_the_standin(tmp_path):
    """The full matrix through the device code paths, on the CPU stand-in for CuPy (``mpizero.standin``)."""
    # the MLP against the CPU at -n 3 only (-n 2: test_against_cpu.py), verify at -n 4 only (-n 2 and 3 through
    # the device paths: test_against_cpu.py and the -n 3 comparison; -n 1's bytes: test_standin.py), the users'
    # models' tied one only (all of them: test_torch_users.py), to keep the suite's time
    limits = {"GPU_CHECK_AGAINST_RANKS": "3", "GPU_CHECK_VERIFY_RANKS": "4", "GPU_CHECK_USERS": "tied"}
    done = gpu_check(tmp_path, "bitwise", GPU_CHECK_DEVICE="standin", GPU_CHECK_DEADLINE="600", **limits)
    out = done.stdout
    verdict = out.rstrip().splitlines()[-1]
    assert done.returncode == 0 and verdict == "gpu_check: PASSED", out[-3000:]
    assert "pinned buffers" in out  # the stand-in's buffers took the staged device path, not the host's
    assert out.count(": bitwise;") == 4 * 4  # stages 0-3 at -n 4, both models, fp32 and fp16 (no warm-up off a GPU)
    assert out.count("standin against cpu: bitwise (") == 4 * 2 * 3  # stages, runs (-n 3 mlp, transformer), precisions
    assert "-- users: every model one digest at stages 0-3, 3 kept, and -n 2 1" in out
    assert "train-0-2-3-pageable resumed-0 compared" in out and "-- one sha256 for 6 runs" in out


def toy_wheel(folder: Path) -> Path:
    """A wheel laid out as the mpich wheel is: a module, a program (scripts) and a library (data/lib)."""
    files = {
        "toy.py": b"X = 1\n",
        "toy-1.0.data/scripts/toyexec": b"#!/bin/sh\necho toy\n",
        "toy-1.0.data/data/lib/libtoy.so": b"not a library\n",
        "toy-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: toy\nVersion: 1.0\n",
        "toy-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    digest = {n: base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b"=").decode() for n, b in files.items()}
    record = "".join(f"{n},sha256={digest[n]},{len(b)}\n" for n, b in files.items()) + "toy-1.0.dist-info/RECORD,,\n"
    path = folder / "toy-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in {**files, "toy-1.0.dist-info/RECORD": record.encode()}.items():
            wheel.writestr(name, data)
    return path


def pythons_with_pip() -> list[str]:
    found = [sys.executable]
    system = shutil.which("python3", path="/usr/bin")
    if system and subprocess.run([system, "-m", "pip", "--version"], capture_output=True).returncode == 0:
        found.append(system)  # Debian's: pip --prefix writes local/lib/pythonX.Y/dist-packages and local/bin
    return found


@pytest.mark.parametrize("python", pythons_with_pip())
def test_carried_wheels_are_found_where_this_python_s_pip_put_them(tmp_path, python):
    repo = tmp_path / "repo"  # the script and the one module it imports before any command: no .whl/ in the real tree
    (repo / "launch").mkdir(parents=True)
    (repo / ".whl").mkdir()
    (repo / "mpizero" / "comm" / "job").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "launch")
    shutil.copy(ROOT / "mpizero" / "comm" / "job" / "launcher.py", repo / "mpizero" / "comm" / "job")
    for package in ("", "comm", "comm/job"):
        (repo / "mpizero" / package / "__init__.py").touch()
    toy_wheel(repo / ".whl")
    done = gpu_check(tmp_path, "quick", cwd=repo, PYTHON=python, GPU_CHECK_DEADLINE="0")
    line = next(x for x in done.stdout.splitlines() if x.startswith("gpu_check: .whl/ installed"))
    modules, programs, libraries = (Path(p.split(" in ")[1]) for p in line.split(": ", 1)[1].split(", "))
    assert (modules / "toy.py").is_file() and (programs / "toyexec").is_file() and (libraries / "libtoy.so").is_file()
    assert modules.is_relative_to(tmp_path / "gpu_check-site")
    assert done.returncode == 2, done.stdout  # nothing else had time to run


def load_bench() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_writes_each_row_as_it_ends_and_skips_what_does_not_fit(tmp_path, monkeypatch):
    bench, path, clock = load_bench(), tmp_path / "rows.json", [0.0]
    on_disk, timeouts = [], []

    def run_one(args, run, model, ranks, timeout):  # every run takes 20 s of the fake clock
        on_disk.append(len(json.loads(path.read_text())["rows"]))
        timeouts.append(timeout)
        clock[0] += 20
        if run == "ddp":
            return {"failed": "NCCL error"}
        if run == "mpizero.torch-3":
            return {"failed": f"timed out after {timeout:.0f} s", "timed_out": True}
        return {"times": [0.3, 0.1, 0.2], "peak": 2**20, "staged": 0, "staged_seconds": 0.0}

    monkeypatch.setattr(bench, "run_one", run_one)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(bench, "no_device_reason", lambda: None)
    monkeypatch.setattr(bench, "pinned_peak", lambda: (2e10, 3e10))
    runs = ["torch", "ddp", "mpizero.torch-3", "train"]
    code = bench.main(["--ranks", "1", "2", "--runs", *runs, "--budget", "70", "--timeout", "60", "--json", str(path)])
    document = json.loads(path.read_text())
    rows = [
        (r["model"], r["run"], r["ranks"], next(k for k in ("times", "failed", "skipped") if k in r))
        for r in document["rows"]
    ]
    assert code == 1  # ddp failed
    assert on_disk == [0, 1, 2] and timeouts == [60, 50, 30] and document["done"] and document["pinned"] == [2e10, 3e10]
    assert [r[1:] for r in rows] == [
        ("torch", 1, "times"),
        ("ddp", 1, "failed"),
        ("mpizero.torch-3", 1, "skipped"),  # cut by the budget, not by --timeout: out of time, not failed
        ("mpizero.torch-3", 2, "skipped"),
        ("train", 1, "skipped"),
        ("train", 2, "skipped"),
        ("torch", 1, "skipped"),  # the transformer's runs
        ("ddp", 1, "skipped"),
        ("mpizero.torch-3", 1, "skipped"),
        ("mpizero.torch-3", 2, "skipped"),
    ]
    assert document["rows"][2]["skipped"] == "out of time: cut at the end of --budget after 30 s"
    assert not path.with_name("rows.json.partial").exists()
