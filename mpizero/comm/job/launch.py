"""Refuse a mis-launched job: one started as N processes that each became a 1-rank MPI world.

That happens when the launcher and the MPI library mpi4py loaded do not speak
the same process-management interface, e.g. ``srun --mpi=none``, or an mpi4py
built for Open MPI started by MPICH's ``mpiexec``. Each process then believes
it is the whole job, so N copies run, each prints a verdict, and they would
write over each other's files. Launchers leave their signs in the environment.
"""

from __future__ import annotations

import os

from mpizero.errors import ZeroError

SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "PMIX_SIZE")
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
SLURM_STEP_VARIABLES = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")


def launcher_signs(environ=os.environ) -> list[str]:
    """Environment entries saying a launcher started more than one process (empty when none does)."""
    signs = [f"{v}={environ[v]}" for v in SIZE_VARIABLES if _integer(environ.get(v)) > 1]
    signs += [f"{v}={environ[v]}" for v in RANK_VARIABLES if _integer(environ.get(v)) > 0]
    if "SLURM_STEP_ID" in environ:  # inside an srun step, not the batch script itself
        signs += [f"{v}={environ[v]}" for v in SLURM_STEP_VARIABLES if _integer(environ.get(v)) > 1]
    return signs


def refuse_split_launch(allow_singleton: bool = False, environ=os.environ, world_size: int | None = None) -> None:
    """Raise a ZeroError if this process's MPI world has one rank but was started as one of several processes.

    ``world_size`` defaults to ``MPI.COMM_WORLD``'s: an engine on a 1-rank sub-communicator of a larger job is fine.
    """
    if world_size is None:
        from mpi4py import MPI

        world_size = MPI.COMM_WORLD.Get_size()
    if allow_singleton or world_size > 1:
        return
    signs = launcher_signs(environ)
    if signs:
        raise ZeroError(
            f"this process is a 1-rank MPI world, but the launcher started more ({', '.join(signs)}): "
            "mpi4py's MPI library does not match the launcher (e.g. srun --mpi=none, or MPICH's mpiexec with an "
            "mpi4py built for Open MPI). Launch with the mpiexec of the MPI mpi4py uses (python -c 'from mpi4py "
            "import MPI; print(MPI.Get_library_version())'), or srun --mpi=pmi2; pass allow_singleton=True to the "
            "engine if one rank is intended"
        )


def _integer(value: str | None) -> int:
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0
