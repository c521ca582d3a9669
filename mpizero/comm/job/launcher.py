"""Start ``mpiexec -n N python ...`` from Python, with the mpiexec that belongs to this Python."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def mpiexec() -> str:
    """The mpiexec beside this Python (the venv's mpich wheel), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec") or "mpiexec"


def python_under_mpiexec(ranks: int, *args: str) -> list[str]:
    """The command line ``mpiexec -n RANKS <this python> ARGS``."""
    return [mpiexec(), "-n", str(ranks), sys.executable, *args]
