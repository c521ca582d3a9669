"""Transport checks that hold at any world size. Run: mpiexec -n N python -m mpi4py tests/comm/check_transport.py

Device stand-ins (tests/standin.py) through pinned (chunked) and pageable staging: the same bytes as MPI
on host buffers, chunks cut at odd places; at one rank nothing crosses the "bus" (no get, no set) and
nothing is counted as staged, while calls are counted as before.
"""

import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpizero import standin  # noqa: E402
from mpizero.comm.collectives import Collectives  # noqa: E402
from mpizero.comm.cuda_aware import cuda_aware  # noqa: E402
from mpizero.standin import bus  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
rng = np.random.default_rng(rank)


def collectives_for(staging: str) -> Collectives:
    os.environ.update(MPIZERO_CUDA_AWARE="0", MPIZERO_STAGING=staging)  # the stand-in is staged on purpose
    cuda_aware.cache_clear()
    coll = Collectives(comm, on_device=True)
    coll.transports.device.chunk_bytes = 8 * 17 * size  # 17 int64 columns per chunk: blocks of 257 end mid-chunk
    return coll


def random(n: int, dtype) -> np.ndarray:
    return rng.integers(-(2**40), 2**40, n).astype(np.int64).view(np.uint8)[: n * np.dtype(dtype).itemsize].view(dtype)


def landed(a: standin.ndarray) -> bytes:
    """``a``'s bytes once the current stream's work is done (a wait, not a copy: the bus counts stay as they are)."""
    standin.cuda.get_current_stream().synchronize()
    return a.underneath.tobytes()


def check_same_bytes_as_host_mpi(coll: Collectives, block: int) -> None:
    send = random(size * block, np.int64)
    want = np.empty(block, np.int64)
    comm.Reduce_scatter_block(send, want, op=MPI.SUM)
    got = standin.ndarray(np.zeros(block, np.int64))
    coll.reduce_scatter(standin.ndarray(send.copy()), got)
    assert landed(got) == want.tobytes(), ("reduce_scatter", block)

    send = random(size * block, np.float32)
    want = np.empty(size * block, np.float32)
    comm.Alltoall(send, want)
    got = standin.ndarray(np.zeros(size * block, np.float32))
    coll.alltoall(standin.ndarray(send.copy()), got)
    assert landed(got) == want.tobytes(), ("alltoall", block)

    send = random(block, np.int64)
    want = np.empty(block, np.int64)
    comm.Allreduce(send, want, op=MPI.SUM)
    got = standin.ndarray(np.zeros(block, np.int64))
    coll.allreduce(standin.ndarray(send.copy()), got)
    assert landed(got) == want.tobytes(), ("allreduce", block)

    for dtype in (np.int64, np.float16):
        send = random(block, dtype)
        want = np.empty(size * block, dtype)
        comm.Allgather(send.view(np.uint8), want.view(np.uint8))
        got = standin.ndarray(np.zeros(size * block, dtype))
        coll.allgather(standin.ndarray(send.copy()), got)
        assert landed(got) == want.tobytes(), ("allgather", dtype, block)
        full = np.zeros(size * block, dtype)
        full[rank * block : (rank + 1) * block] = send
        in_place = standin.ndarray(full)
        coll.allgather_in_place(in_place)
        assert landed(in_place) == want.tobytes(), ("allgather in place", dtype, block)


def check_staging(staging: str) -> None:
    coll = collectives_for(staging)
    before = dict(coll.traffic.calls)
    bus.COUNTS.clear()
    for block in (1, 17, 257):
        check_same_bytes_as_host_mpi(coll, block)
    calls = Counter(coll.traffic.calls) - Counter(before)
    assert calls == {"reduce_scatter": 3, "alltoall": 3, "allreduce": 3, "allgather": 12}, calls
    staged = sum(coll.traffic.staged.values())
    if size == 1:  # one rank moves nothing: no copy to or from the "device", nothing staged
        assert bus.COUNTS["d2h"] == bus.COUNTS["h2d"] == staged == 0, bus.COUNTS
    else:
        assert bus.COUNTS["d2h"] > 0 and staged == bus.COUNTS["bytes"], (
            staged,
            bus.COUNTS,
        )


for staging in ("pinned", "pageable"):
    check_staging(staging)
if rank == 0:
    print("transport checks ok")
