"""NumPy or CuPy: pick the array module of a buffer, and move buffers to the host."""

from __future__ import annotations

import numpy as np


def is_device_array(a) -> bool:
    """True for a GPU buffer (CuPy or anything exporting ``__cuda_array_interface__``)."""
    return hasattr(a, "__cuda_array_interface__")


def array_module(a):
    """Return ``cupy`` for CuPy arrays and ``numpy`` for everything else."""
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def to_host(a) -> np.ndarray:
    """Copy a device buffer to a new host array; return host arrays unchanged."""
    return a.get() if is_device_array(a) else a


def bits(a) -> np.ndarray:
    """Return the raw bytes of a host or device array as a host uint8 array."""
    host = np.ascontiguousarray(to_host(a))
    return host.reshape(-1).view(np.uint8)
