"""One device per rank: the rank's place among the ranks on its host, modulo the devices that host shows it.

CUDA numbers only the devices ``CUDA_VISIBLE_DEVICES`` leaves visible, so a launcher that gives each rank its
own (SLURM's ``--gpus-per-task=1``) leaves every rank one device, 0, and that is the one used; with more ranks
on a host than devices, the ranks share them in turn (several ranks on one GPU). The choice is made current
(``cupy.cuda.Device(i).use()``) before anything is allocated, and every rank's is said on rank 0.
"""

from __future__ import annotations

from mpi4py import MPI

from mpizero.arrays import device_module
from mpizero.comm import agree
from mpizero.errors import ZeroError


def use_local_device(collectives, device: str) -> int:
    """Make this rank's device current for ``device`` (``gpu``, or ``standin`` on the CPU) and return its id
    (collective: a device no rank can use is one error on every rank)."""
    problem, chosen = None, -1
    try:
        xp = device_module(device)
        chosen = collectives.node.Get_rank() % xp.cuda.runtime.getDeviceCount()
        xp.cuda.Device(chosen).use()
    except ZeroError as error:
        problem = str(error)
    agree.raise_if_any(collectives, problem, "choosing each rank's device")
    return chosen


def describe(collectives, chosen: int) -> str:
    """Which device each rank uses, by host: ``host a: ranks 0-3 on devices 0, 1, 2, 3`` (collective)."""
    rows = collectives.allgather_object((MPI.Get_processor_name(), chosen), "every rank's device")
    hosts: dict[str, list[tuple[int, int]]] = {}
    for rank, (host, device) in enumerate(rows):
        hosts.setdefault(host, []).append((rank, device))
    plural = "s" if len(rows) > 1 else ""
    return "; ".join(
        f"{host}: rank{plural} {', '.join(str(r) for r, _ in ranks)} on device{plural} "
        f"{', '.join(str(d) for _, d in ranks)}"
        for host, ranks in hosts.items()
    )
