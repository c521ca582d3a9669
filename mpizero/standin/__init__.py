"""A strict CPU stand-in for CuPy, so the engine's device code paths run and are checked without a GPU.

``import mpizero.standin as xp`` is an array module like ``cupy`` (``--device standin``, or
``mpizero.arrays.device_module("standin")``): ``xp.zeros``, ``xp.asarray``, ``xp.stack`` and every other
NumPy function make and take device arrays (``device.ndarray``), ``xp.cuda`` has streams and events. It refuses
what CuPy refuses (``device``), counts every copy between device and host and every wait (``bus.COUNTS``), and
evaluates the engine's CUDA kernels with NumPy, from the same formulas (``mpizero.core.reduce.arithmetic``). It is a
test device: nothing runs faster, and the CUDA source itself is not compiled here.
"""

from __future__ import annotations

import types

import numpy as np

from mpizero.standin import bus, cuda
from mpizero.standin.device import compute, device_arrays, ndarray, on_device

__all__ = [
    "array",
    "asarray",
    "asnumpy",
    "bus",
    "concatenate",
    "cuda",
    "empty_pinned",
    "from_dlpack",
    "kernel",
    "ndarray",
    "stack",
]


def asarray(a, dtype=None, order=None) -> ndarray:
    """A device array of ``a``: itself if it is one (converted to ``dtype`` on the device), else a copy of the
    host data on the device."""
    if isinstance(a, ndarray):
        return a if dtype is None else a.astype(dtype, copy=False)
    host = np.array(a, dtype=dtype, order=order or "K")  # a copy: the device has memory of its own
    bus.copied("h2d", host.nbytes, False)
    cuda.launched()
    return ndarray(host)


def array(a, dtype=None, copy=True, order="K") -> ndarray:
    """``asarray``, copied on the device where ``a`` already is a device array."""
    if isinstance(a, ndarray):
        return ndarray(np.array(a._host, dtype=dtype, copy=copy, order=order)) if copy else asarray(a, dtype)
    return asarray(a, dtype, order)


def asnumpy(a, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
    """A host copy of a device array (``get``); host data as it is."""
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    return np.asarray(a, order=order)


def from_dlpack(tensor) -> ndarray:
    """A device array over a DLPack tensor's memory (a CPU tensor stands for a CUDA one): no copy."""
    return ndarray(np.from_dlpack(tensor))


def empty_pinned(shape, dtype=np.float64) -> np.ndarray:
    """``cupyx.empty_pinned``: a host array the device copies to and from asynchronously."""
    return np.empty(shape, dtype)


def stack(arrays, axis=0, out=None) -> ndarray:
    """``cupy.stack``: device arrays only (CuPy's ``expand_dims`` takes no Python number)."""
    return compute(np.stack, (device_arrays(arrays, "stack"),), {"axis": axis, "out": out})


def concatenate(arrays, axis=0, out=None, **kwargs) -> ndarray:
    """``cupy.concatenate``: device arrays only."""
    return compute(np.concatenate, (device_arrays(arrays, "concatenate"),), {"axis": axis, "out": out, **kwargs})


def kernel(body):
    """A device kernel (the stand-in's ``ElementwiseKernel``): ``body``, written with NumPy, run on the memory
    underneath its device arguments as one launch; host arrays among them are refused, as CuPy's kernels refuse
    them."""

    def launch(*args) -> None:
        cuda.launched()
        body(*on_device(args))

    return launch


def __getattr__(name: str):
    """NumPy's dtypes and constants as they are; its functions on device arrays (``device.compute``)."""
    found = getattr(np, name)
    if isinstance(found, types.ModuleType):  # numpy.random, numpy.linalg, ...: they would make host arrays
        raise AttributeError(f"the stand-in has no {name!r}")
    if isinstance(found, type) or not callable(found):
        return found

    def on_device(*args, **kwargs):
        return compute(found, args, kwargs)

    on_device.__name__ = name
    return on_device
