"""Chunked staging (comm/transports/staging.py) on the CPU: the same bytes arrive whatever the chunk boundaries.

Each collective is emulated in one process as if rank q held ``send + q``, so a chunk that lands in the
wrong block or columns changes the result. The MPI runs are in tests/comm/check_transport.py.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpizero import standin
from mpizero.comm.transports.staging import PlainCopies, blocks_of, chunk_columns, staged_in_chunks

ODD_CHUNKS = [8, 17 * 8, 257 * 8, 1 << 22]  # bytes: one int64, 17 and 257 of them, the default


def emulated(op, rank, world):
    """The collective as MPI would do it if rank q's contribution were this rank's plus q."""

    def reduce_scatter(send, recv):
        rows = send.reshape(world, -1)
        recv[...] = sum(rows[rank] + q for q in range(world))

    def allgather(send, recv):
        own = recv.reshape(world, -1)[rank].copy() if send is None else send
        for q, row in enumerate(recv.reshape(world, -1)):
            row[...] = own + (q - rank if send is None else q)

    def allreduce(send, recv):
        recv[...] = sum(send + q for q in range(world))

    return {"reduce_scatter": reduce_scatter, "allgather": allgather, "allreduce": allreduce}[op]


def expected(op, send, recv, rank, world):
    out = recv.copy()
    emulated(op, rank, world)(None if send is None else send.copy(), out)
    return out


@settings(max_examples=60, deadline=None)
@given(
    op=st.sampled_from(["reduce_scatter", "allgather", "in place", "allreduce"]),
    block=st.sampled_from([1, 2, 16, 17, 255, 257, 1000]),
    world=st.integers(2, 5),
    chunk_bytes=st.sampled_from(ODD_CHUNKS),
    seed=st.integers(0, 1000),
)
def test_chunked_staging_delivers_the_same_bytes(op, block, world, chunk_bytes, seed):
    rng = np.random.default_rng(seed)
    rank = int(rng.integers(world))
    sizes = {"reduce_scatter": (world, 1), "allgather": (1, world), "in place": (0, world), "allreduce": (1, 1)}
    ins, outs = sizes[op]
    send = rng.integers(-(2**40), 2**40, ins * block) if ins else None
    recv = rng.integers(-(2**40), 2**40, outs * block)
    name = "allgather" if op == "in place" else op
    want = expected(name, send, recv, rank, world)
    device_recv = standin.ndarray(recv.copy())
    device_send = None if send is None else standin.ndarray(send.copy())
    copied = staged_in_chunks(
        emulated(name, rank, world), device_send, device_recv, rank, world, PlainCopies(), chunk_bytes
    )
    assert device_recv.get().tobytes() == want.tobytes()
    assert copied == (max(ins, 1) + outs) * block * 8


@pytest.mark.parametrize("block, blocks, chunk_bytes", [(17, 3, 8 * 3 * 5), (257, 2, 8 * 2 * 16), (1, 4, 1)])
def test_chunks_tile_the_block(block, blocks, chunk_bytes):
    chunks = chunk_columns(block, blocks, 8, chunk_bytes)
    assert chunks[0][0] == 0 and chunks[-1][1] == block
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert all(0 < (hi - lo) * 8 * blocks <= max(chunk_bytes, 8 * blocks) for lo, hi in chunks)


def test_blocks_of_each_collective():
    one, four = np.zeros(6), np.zeros(24)
    assert blocks_of(four, one, 4) == (4, 1, 6)  # reduce-scatter
    assert blocks_of(one, four, 4) == (1, 4, 6)  # all-gather
    assert blocks_of(None, four, 4) == (0, 4, 6)  # all-gather in place
    assert blocks_of(four, four, 4) == (1, 1, 24)  # all-reduce
