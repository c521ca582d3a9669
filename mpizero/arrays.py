"""NumPy, CuPy or the stand-in: pick the array module of a buffer, and move buffers between host and device.

Every move between host and device is explicit (``to_host``, ``to_device``, ``write``), as CuPy requires:
it refuses a host array assigned into a device array, and so does the stand-in (``mpizero.standin``).
"""

from __future__ import annotations

import numpy as np

from mpizero.errors import ZeroError

CHUNK = 1 << 15  # elements per host chunk: a loop's float64 and int64 temporaries stay in cache


def is_device_array(a) -> bool:
    """True for a GPU buffer (CuPy or anything exporting ``__cuda_array_interface__``)."""
    return hasattr(a, "__cuda_array_interface__")


def array_module(a):
    """Return ``cupy`` for CuPy arrays, ``mpizero.standin`` for the stand-in's and ``numpy`` for everything else."""
    module = type(a).__module__
    if module.startswith("cupy"):
        import cupy

        return cupy
    if module.startswith("mpizero.standin"):
        import mpizero.standin

        return mpizero.standin
    return np


def device_of(a) -> str:
    """The device name (``DEVICES``) of the memory ``a`` lives in."""
    xp = array_module(a)
    return "cpu" if xp is np else "standin" if is_standin(xp) else "gpu"


def is_standin(xp) -> bool:
    """Whether array module ``xp`` is the CPU stand-in for CuPy (``mpizero.standin``): its kernels are NumPy
    bodies, and it is its own ``cupyx``."""
    return xp.__name__ == "mpizero.standin"


def cupyx_of(xp):
    """CuPy's companion module ``cupyx`` (pinned host memory), or the stand-in for the stand-in."""
    if is_standin(xp):
        return xp
    import cupyx

    return cupyx


def to_host(a) -> np.ndarray:
    """Copy a device buffer to a new host array; return host arrays unchanged."""
    return a.get() if is_device_array(a) else a


def read_back(values) -> list:
    """Device scalars and host numbers as Python numbers, the device ones copied to the host in one transfer
    (CuPy stacks only device arrays)."""
    on_device = [i for i, v in enumerate(values) if is_device_array(v)]
    numbers = [v.item() if isinstance(v, np.generic) else v for v in values]
    if on_device:
        xp = array_module(values[on_device[0]])
        for i, number in zip(on_device, to_host(xp.stack([values[i] for i in on_device])).tolist()):
            numbers[i] = number
    return numbers


def bits(a) -> np.ndarray:
    """Return the raw bytes of a host or device array as a host uint8 array."""
    host = np.ascontiguousarray(to_host(a))
    return host.reshape(-1).view(np.uint8)


def write(target, host: np.ndarray) -> None:
    """Copy host array ``host`` into ``target`` (the same shape and dtype), a host or a contiguous device array."""
    if is_device_array(target):
        target.set(host)
    else:
        target[...] = host


DEVICES = ("cpu", "gpu", "standin")


def device_module(device: str):
    """Return the array module for ``cpu`` (NumPy), ``gpu`` (CuPy) or ``standin`` (``mpizero.standin``: the device
    code paths on the CPU), saying what is missing if it cannot."""
    if device == "cpu":
        return np
    if device == "standin":
        import mpizero.standin

        return mpizero.standin
    try:
        import cupy
    except ImportError:
        raise ZeroError('--device gpu needs CuPy: pip install -e ".[cuda12]" (or ".[cuda13]")') from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as error:
        raise ZeroError(f"--device gpu: CUDA is not usable ({error})") from None
    if count < 1:
        raise ZeroError("--device gpu: CuPy sees no CUDA device")
    return cupy


def to_device(value, xp):
    """Move arrays (alone, or in tuples, lists and dicts) to ``xp``'s memory."""
    if isinstance(value, dict):
        return {k: to_device(v, xp) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, xp) for v in value)
    return value if xp is np else xp.asarray(value)
