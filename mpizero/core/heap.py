"""Hand the C heap's free pages back to the OS when the heap grew (glibc's ``malloc_trim``).

Used by ``mpizero.torch`` after each backward pass and step, and by the NumPy trainer after each unit.

Each backward, torch allocates a new full-size gradient per parameter (and stage 3 a full-params buffer per
unit) and frees it soon after. Once ``shard`` has freed the model's own parameters, glibc's adaptive mmap
threshold lies above blocks that size, so they come from its heap; small allocations made in between split
the freed blocks, the heap grows step after step, and every page it ever touched stays resident. On the
4 x 2048² MLP of ``benchmarks/bench_peers.py`` (stage 3, 8 micro-batches per rank) that was 450-530 MiB of
peak RSS above the model, about 300 with trimming. ``malloc_trim(0)`` returns every free page of the heap,
wherever it lies; but a later allocation faults them in again, zeroed by the kernel, so trimming after every
backward made each micro-batch's gradients cost page faults. So the heap is trimmed only when it has grown by
``GROWTH`` since the last trim (glibc's ``mallinfo2``): a heap that reuses its freed blocks is left alone
(``bench_peers.py --ranks 2 --steps 8 --micro-batches 8``, one run each, stages 2 and 3: trimming after every
backward 1.37x and 1.88x DDP's step time, 449 and 487 MiB peak RSS above the model; ``GROWTH`` 16 MiB 1.23x
and 1.83x, 450 and 503 MiB; 64 MiB 0.87x and 1.15x, 482 and 519 MiB). Where
the C library has no ``malloc_trim`` (macOS, musl) nothing is done. (The trainer's units free their gathered
params and gradients between the engine's int64 sums the same way: on a 67M-parameter MLP at stage 3, 4 ranks,
about 100 MiB of peak RSS above the engine's peak without trimming, about 70 with it.)
"""

from __future__ import annotations

import ctypes

from mpizero import libc

GROWTH = 64 << 20  # bytes the heap may grow by before it is trimmed
_last_size = [0]  # the heap's size after the last trim


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks")] + [
        (name, ctypes.c_size_t) for name in ("fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def heap_bytes() -> int | None:
    """The main heap's size now (glibc), or None where it cannot be read."""
    info = libc.function("mallinfo2", (), _Mallinfo2)
    return None if info is None else int(info().arena)


def release_if_grown() -> bool:
    """Trim the heap if it has grown by ``GROWTH`` since the last trim (always, where its size cannot be read);
    return whether it trimmed."""
    size = heap_bytes()
    if size is not None and size < _last_size[0] + GROWTH:
        return False
    trimmed = release_free_pages()
    after = heap_bytes()
    _last_size[0] = 0 if after is None else after
    return trimmed


def release_free_pages() -> bool:
    """Return the C heap's free pages to the OS where the C library can; whether it could (glibc)."""
    trim = libc.function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)
    if trim is not None:
        trim(0)
    return trim is not None
