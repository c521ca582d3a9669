"""Hand the C heap's free pages back to the OS after each unit of a step (glibc's ``malloc_trim``).

Each unit's forward frees its gathered full params (stage 3) and each unit's backward frees its gradients once
handed in, while the engine allocates a group's int64 grad-shard sum between them: the freed blocks are split,
the heap grows and every page it touched stays resident. On a 67M-parameter MLP (``train --width 2048
--layers 17``, stage 3, 4 ranks, 2 steps of 64 samples) that was about 100 MiB of peak RSS above the engine's
peak and the RSS before set-up, about 70 with this, at about 0.4 ms a call. Where the C library has no
``malloc_trim`` (macOS, musl) nothing is done. ``mpizero/torch/heap.py`` does the same for torch's backward.
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


def release_free_pages() -> None:
    """Return the C heap's free pages to the OS where the C library can (glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
