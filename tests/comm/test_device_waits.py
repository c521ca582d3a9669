"""Every wait that keeps device buffers correct around MPI can fail: with the stand-in running late
(``mpizero.standin.late``), taking any one of them away gives wrong bytes.

The waits: pinned staging's side stream waiting for the work already queued (``after_compute``), the host waiting
for each chunk's copy before MPI reads its slot (``wait``), the host waiting for the copies back before the call
returns (``drain``); CUDA-aware MPI's wait for the current stream before MPI touches device memory (``written``).
One process, MPI over ``COMM_SELF``: the transports themselves, not the router (which sends one rank ``Local``).
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpizero import standin
from mpizero.comm.transports.mpi import CudaAwareMPI, HostMPI
from mpizero.comm.transports.staged import PinnedStaging
from mpizero.comm.transports.staging import CupyCopies
from mpizero.standin import late

VALUES = np.arange(1, 40, dtype=np.int64) * 3  # 39 int64s: five chunks of 8 (the last one short)
WAITS = ["after_compute", "wait", "drain"]


def staged_allreduce() -> PinnedStaging:
    staging = PinnedStaging(HostMPI(MPI.COMM_SELF, float("inf")), 0, 1)
    staging.chunk_bytes = 8 * 8
    return staging


def allreduced(transport) -> np.ndarray:
    """An all-reduce over one rank of a buffer the current stream is still writing, read back as CuPy reads."""
    with late.running():
        send = standin.empty(VALUES.size, np.int64)
        send[...] = standin.asarray(VALUES)  # queued: runs when something makes it due
        recv = standin.empty(VALUES.size, np.int64)
        transport.run("allreduce", send, recv, True)
        return recv.get()  # waits for the current stream only


def test_staged_and_cuda_aware_collectives_give_the_bytes_with_every_wait():
    assert allreduced(staged_allreduce()).tobytes() == VALUES.tobytes()
    assert allreduced(CudaAwareMPI(MPI.COMM_SELF)).tobytes() == VALUES.tobytes()


@pytest.mark.parametrize("wait", WAITS)
def test_taking_away_any_staging_wait_gives_wrong_bytes(monkeypatch, wait):
    monkeypatch.setattr(CupyCopies, wait, lambda *args: None)
    got = allreduced(staged_allreduce())
    assert got.tobytes() != VALUES.tobytes(), wait


def test_taking_away_the_sync_before_cuda_aware_mpi_gives_wrong_bytes(monkeypatch):
    monkeypatch.setattr(CudaAwareMPI, "written", staticmethod(lambda recv: None))
    got = allreduced(CudaAwareMPI(MPI.COMM_SELF))
    assert (got == -1).all()  # MPI read the send buffer before it was written: empty's garbage pattern
