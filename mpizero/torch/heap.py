"""Hand the C heap's free pages back to the OS after each backward pass and step (glibc's ``malloc_trim``).

Each backward, torch allocates a new full-size gradient per parameter (and stage 3 a full-params buffer per
unit) and frees it soon after. Once ``shard`` has freed the model's own parameters, glibc's adaptive mmap
threshold lies above blocks that size, so they come from its heap; small allocations made in between split
the freed blocks, the heap grows step after step, and every page it ever touched stays resident. On the
4 x 2048² MLP of ``benchmarks/bench_peers.py`` (stage 3, 8 micro-batches per rank) that was 450-530 MiB of
peak RSS above the model, about 300 with this. ``malloc_trim(0)`` returns every free page of the heap, wherever
it lies; a later allocation faults them in again. Where the C library has no ``malloc_trim`` (macOS, musl)
nothing is done.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    """The C library's ``malloc_trim``, or None where it has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols, the C library's among them
    except (AttributeError, OSError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_pages() -> bool:
    """Return the C heap's free pages to the OS where the C library can; whether it could (glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    return trim is not None
