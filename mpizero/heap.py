"""Hand the C heap's free pages back to the OS when the heap grew (glibc's ``malloc_trim``).

Used by ``mpizero.torch`` after each backward pass and step, and by the NumPy trainer after each unit: full-size
gradients and gathered units, allocated and freed each micro-batch, would otherwise leave every heap page they
ever touched resident. Trimming after every backward makes each micro-batch's gradients fault their pages in
again, so the heap is trimmed only once it has grown by ``GROWTH`` since the last trim (glibc's ``mallinfo2``).
``mpizero.torch`` also turns glibc's own trimming on ``free`` off (``keep_freed_blocks``). Where the C
library has no ``malloc_trim`` (macOS, musl) nothing is done. Why, measured: ``benchmarks/results/heap_trim.txt``.
"""

from __future__ import annotations

import ctypes

from mpizero import libc

GROWTH = 64 << 20  # bytes the heap may grow by before it is trimmed
_last_size = [0]  # the heap's size after the last trim
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (glibc's malloc.h)
HEAP_BLOCKS_UP_TO = 32 << 20  # glibc's largest mmap threshold on 64 bits: blocks up to this come from the heap
NO_TRIM_ON_FREE = -1  # M_TRIM_THRESHOLD's "never": free() leaves the heap's top alone (mallopt(3))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks")] + [
        (name, ctypes.c_size_t) for name in ("fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def heap_bytes() -> int | None:
    """The main heap's size now (glibc), or None where it cannot be read."""
    info = libc.function("mallinfo2", (), _Mallinfo2)
    return None if info is None else int(info().arena)


def keep_freed_blocks() -> bool:
    """Have glibc keep freed blocks of up to 32 MiB in the heap for the next allocation, and trim only through
    ``release_if_grown`` (or ``release_free_pages``); whether it could (glibc). By default its mmap threshold
    adapts and ``free`` trims the heap's top beyond twice it, so a micro-batch's full-size gradients, freed
    there, are handed back and fault their pages in again the next micro-batch. Process-wide and for good, as
    trimming is: a large transient elsewhere (an evaluation) stays resident until the next trim
    (``benchmarks/results/heap_trim.txt``)."""
    mallopt = libc.function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    if mallopt is None or heap_bytes() is None:  # not glibc 2.33 or later: ``release_if_grown`` trims every time
        return False
    kept = mallopt(M_MMAP_THRESHOLD, HEAP_BLOCKS_UP_TO)
    untrimmed = mallopt(M_TRIM_THRESHOLD, NO_TRIM_ON_FREE)
    return bool(kept) and bool(untrimmed)


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
