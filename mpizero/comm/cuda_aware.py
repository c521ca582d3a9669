"""Is the loaded MPI library CUDA-aware? A three-state switch, as in mpi4jax.

``MPIZERO_CUDA_AWARE=1``: device buffers go straight to MPI.
``MPIZERO_CUDA_AWARE=0``: device buffers are staged through host memory.
unset: ask the MPI library (``MPIX_Query_cuda_support`` or the MPI-4.1 info key
``mpi_memory_alloc_kinds``); if it is not CUDA-aware, stage and warn once.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings

ENV_VAR = "MPIZERO_CUDA_AWARE"


def loaded_mpi_libraries() -> list[str]:
    """Return the paths of the libmpi shared objects this process has loaded."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


def query_cuda_support() -> bool:
    """Ask the loaded MPI library whether it accepts CUDA device buffers."""
    from mpi4py import MPI

    for path in loaded_mpi_libraries():
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
        query = getattr(lib, "MPIX_Query_cuda_support", None)
        if query is not None:
            query.restype = ctypes.c_int
            return bool(query())
    kinds = MPI.COMM_WORLD.Get_info().Get("mpi_memory_alloc_kinds") or ""
    return "cuda" in kinds


def parse_setting(value: str | None) -> bool | None:
    """Map the environment variable to True, False or None (unset), rejecting anything else."""
    if value is None or value == "":
        return None
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"{ENV_VAR} must be 0, 1 or unset, got {value!r}")


@functools.lru_cache(maxsize=1)
def cuda_aware() -> bool:
    """Decide once per process whether device buffers go straight to MPI."""
    setting = parse_setting(os.environ.get(ENV_VAR))
    if setting is not None:
        return setting
    if query_cuda_support():
        return True
    warnings.warn(
        f"MPI is not CUDA-aware: staging GPU buffers through host memory "
        f"(set {ENV_VAR}=0 to silence, or 1 to force device buffers)",
        stacklevel=3,
    )
    return False
