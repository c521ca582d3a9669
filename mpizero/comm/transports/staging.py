"""Device buffers through page-locked host memory, in chunks, copies overlapped with MPI.

Glossary:
- block: what one rank owns of a buffer; a reduce-scatter's send and an
  all-gather's recv are ``world_size`` blocks, the other side one block; an
  all-reduce has one block each side, an all-to-all ``world_size`` each side.
- chunk: columns ``[lo, hi)`` of every block, at most ``CHUNK_BYTES`` in all;
  the collective runs once per chunk on host buffers of ``(blocks, hi - lo)``,
  which is the same collective on fewer columns, so every element is still
  combined by MPI exactly once (int64 sums keep their bits).
- slot: one of two pinned host buffers per side; chunk ``i`` uses slot ``i % 2``.

The pipeline: chunk ``i + 1`` is copied to the host on a side stream while MPI
works on chunk ``i``; chunk ``i``'s result goes back to the device on the side
stream while MPI works on chunk ``i + 1``. It waits for the side stream before
it returns, so the call is complete (blocking) when it returns.

Any array with CuPy's ``get(out=, stream=, blocking=)`` and ``set(host,
stream=)`` can be staged: CuPy arrays with ``CupyCopies`` (pinned buffers, a
side stream, events), others (the tests' stand-in) with ``PlainCopies``.
"""

from __future__ import annotations

import numpy as np

from mpizero.arrays import cupyx_of

CHUNK_BYTES = 1 << 22  # 4 MiB: large enough for the copy engines' full rate, small enough to overlap


class PlainCopies:
    """Host buffers from NumPy and copies that complete when called: for stand-ins, and the reference order."""

    stream = None

    def __init__(self) -> None:
        self.buffers: dict = {}

    def host(self, key, numel: int, dtype) -> np.ndarray:
        """A host buffer of at least ``numel`` elements for ``key``, kept and grown between calls."""
        held = self.buffers.get(key)
        if held is None or held.nbytes < numel * np.dtype(dtype).itemsize:
            held = self.buffers[key] = self._allocate(numel * np.dtype(dtype).itemsize)
        return held[: numel * np.dtype(dtype).itemsize].view(dtype)

    def _allocate(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def after_compute(self) -> None:
        """Order the side stream after the work already queued (nothing to order without streams)."""

    def mark(self):
        """A point in the side stream's queue, to wait for later (None: everything is done already)."""
        return None

    def wait(self, mark) -> None:
        """Block until the side stream has reached ``mark``."""

    def drain(self) -> None:
        """Block until every copy queued on the side stream is done."""


class CupyCopies(PlainCopies):
    """Pinned host buffers (``cupyx.empty_pinned``) and a non-blocking side stream for the copies."""

    def __init__(self, cupy) -> None:
        super().__init__()
        self.cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def _allocate(self, nbytes: int) -> np.ndarray:
        return cupyx_of(self.cupy).empty_pinned(nbytes, np.uint8)

    def after_compute(self) -> None:
        self.stream.wait_event(self.cupy.cuda.get_current_stream().record())

    def mark(self):
        return self.stream.record()

    def wait(self, mark) -> None:
        if mark is not None:
            mark.synchronize()

    def drain(self) -> None:
        self.stream.synchronize()


def blocks_of(send, recv, world_size: int) -> tuple[int, int, int]:
    """``(send blocks, recv blocks, block length)`` of a collective; 0 send blocks: in place (send is None)."""
    if send is None:
        return 0, world_size, recv.size // world_size
    if send.size == recv.size:
        return 1, 1, recv.size
    if send.size > recv.size:
        return send.size // recv.size, 1, recv.size
    return 1, recv.size // send.size, send.size


def chunk_columns(block: int, blocks: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """The chunks ``[lo, hi)`` of a block: at most ``chunk_bytes`` over ``blocks`` blocks, at least one column."""
    width = max(1, chunk_bytes // (itemsize * max(blocks, 1)))
    return [(lo, min(lo + width, block)) for lo in range(0, block, width)]


def staged_in_chunks(
    collective, send, recv, rank: int, world_size: int, copies, chunk_bytes=CHUNK_BYTES, blocks=None
) -> int:
    """Run ``collective(host_send, host_recv)`` chunk by chunk on host copies of device ``send`` and ``recv``;
    ``blocks``: (send blocks, recv blocks) where the sizes do not tell them (an all-to-all).

    ``collective`` returns None or a request to ``Wait`` for. Returns the bytes copied, both ways, in all.
    Every copy goes on the one side stream, so a copy never overtakes an earlier one on the same slot; the
    host waits only for a chunk to have arrived before MPI reads or writes its slot.
    """
    ins, outs, block = blocks_of(send, recv, world_size) if blocks is None else (*blocks, recv.size // blocks[1])
    chunks = chunk_columns(block, max(ins, outs), recv.itemsize, chunk_bytes)
    width = chunks[0][1] - chunks[0][0] if chunks else 0
    host_in = [copies.host(("send", s), ins * width, recv.dtype) for s in (0, 1)]
    host_out = [copies.host(("recv", s), outs * width, recv.dtype) for s in (0, 1)]
    copies.after_compute()

    def to_host(i: int):
        (lo, hi), slot = chunks[i], i % 2
        source, rows, target = (recv, [rank], host_out[slot]) if ins == 0 else (send, range(ins), host_in[slot])
        for r in rows:
            piece = target[r * (hi - lo) : (r + 1) * (hi - lo)]
            source[r * block + lo : r * block + hi].get(out=piece, stream=copies.stream, blocking=False)
        return copies.mark()

    arrived = to_host(0) if chunks else None
    for i, (lo, hi) in enumerate(chunks):
        slot, w = i % 2, hi - lo
        this_chunk, arrived = arrived, to_host(i + 1) if i + 1 < len(chunks) else None  # next one meanwhile
        copies.wait(this_chunk)
        request = collective(None if ins == 0 else host_in[slot][: ins * w], host_out[slot][: outs * w])
        if request is not None:
            request.Wait()
        for r in range(outs):
            recv[r * block + lo : r * block + hi].set(host_out[slot][r * w : (r + 1) * w], stream=copies.stream)
    copies.drain()
    return (max(ins, 1) + outs) * block * recv.itemsize
