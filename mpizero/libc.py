"""The C library's functions mpizero calls through ctypes (glibc's heap and page calls), where it has them."""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def function(name: str, argtypes: tuple, restype):
    """The C library's ``name``, typed ``argtypes -> restype``, or None where the C library has none
    (``malloc_trim`` and ``mallinfo2`` are glibc's own; macOS and musl lack them)."""
    try:
        found = getattr(ctypes.CDLL(None), name)  # the process's own symbols, the C library's among them
    except (AttributeError, OSError):
        return None
    found.argtypes, found.restype = list(argtypes), restype
    return found
