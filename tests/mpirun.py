"""Run a Python program under ``mpiexec -n N`` with a timeout, killing every rank on expiry."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from mpizero.comm.launcher import python_under_mpiexec

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZES = (1, 2, 3, 4)


def run_mpi(n: int, args: list[str], timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python ARGS``; return the finished process (stdout, stderr, returncode)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **(env or {})}
    command = python_under_mpiexec(n, *args)
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"mpiexec -n {n} {args} timed out after {timeout}s\n{out}\n{err}") from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def run_mpi_ok(n: int, args: list[str], timeout: float = 120, env: dict | None = None) -> str:
    """Run under mpiexec and assert success; return stdout."""
    done = run_mpi(n, args, timeout, env)
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout
