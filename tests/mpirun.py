"""Run a Python program under ``mpiexec -n N`` with a timeout, killing every rank on expiry."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from mpizero.comm.job.launcher import python_under_mpiexec

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZES = (1, 2, 3, 4)


def run_mpi(n: int, args: list[str], timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python ARGS``; return the finished process (stdout, stderr, returncode)."""
    proc = start_mpi(n, args, env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"mpiexec -n {n} {args} timed out after {timeout}s\n{out}\n{err}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_python(args: list[str], timeout: float = 120, env: dict | None = None, cwd: Path = ROOT):
    """Run ``python ARGS`` as one process, no mpiexec, in ``cwd`` with ``env`` added, under a timeout."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def run_mpi_ok(n: int, args: list[str], timeout: float = 120, env: dict | None = None) -> str:
    """Run under mpiexec and assert success; return stdout."""
    done = run_mpi(n, args, timeout, env)
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout


def start_mpi(n: int, args: list[str], env: dict | None = None) -> subprocess.Popen:
    """Start ``mpiexec -n n python ARGS`` in a session of its own, so its processes can be told from others."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        python_under_mpiexec(n, *args),
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def rank_pids(proc: subprocess.Popen) -> dict[int, int]:
    """The pids of the MPI ranks that ``proc`` (from ``start_mpi``) launched, by rank: its descendants, nothing else."""
    parents, ranks = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours to read
        rank = [v.split(b"=", 1)[1] for v in environ if v.startswith(b"PMI_RANK=")]
        if rank:
            ranks[int(entry.name)] = int(rank[0])
    return {rank: pid for pid, rank in ranks.items() if _descends_from(pid, proc.pid, parents)}


def _descends_from(pid: int, ancestor: int, parents: dict[int, int]) -> bool:
    while pid in parents and pid != ancestor:
        pid = parents[pid]
    return pid == ancestor
