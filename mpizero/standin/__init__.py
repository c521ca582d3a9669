"""A strict CPU stand-in for CuPy, so the engine's device code paths run and are checked without a GPU.

``import mpizero.standin as xp`` is an array module like ``cupy`` (``--device standin``, or
``mpizero.arrays.device_module("standin")``): ``xp.zeros``, ``xp.asarray``, ``xp.stack`` and every other
NumPy function make and take device arrays (``device.ndarray``), ``xp.cuda`` has streams and events. It refuses
what CuPy refuses (``device``), counts every copy between device and host and every wait (``bus.COUNTS``), and
evaluates the engine's CUDA kernels with NumPy, from the same formulas (``mpizero.core.reduce.arithmetic``), after
checking their arguments against the kernel's parameters as CuPy does (``arguments``). Running late (``late``), its
work waits on its stream until something makes it due, so a missing wait gives wrong bytes. It is a test device:
nothing runs faster, and the CUDA source itself is not compiled here.
"""

from __future__ import annotations

import functools
import types

import numpy as np

from mpizero.standin import arguments, bus, cuda, late
from mpizero.standin.device import allocated, compute, device_arrays, device_operands, ndarray, on_device

__all__ = [
    "array",
    "asarray",
    "asnumpy",
    "bus",
    "concatenate",
    "cuda",
    "empty",
    "empty_like",
    "empty_pinned",
    "from_dlpack",
    "kernel",
    "late",
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
    return allocated(host)


def array(a, dtype=None, copy=True, order="K") -> ndarray:
    """``asarray``, copied on the device where ``a`` already is a device array."""
    if isinstance(a, ndarray):
        if not copy:
            return asarray(a, dtype)
        cuda.due()
        cuda.launched()
        return allocated(np.array(a._host, dtype=dtype, copy=True, order=order))
    return asarray(a, dtype, order)


def asnumpy(a, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
    """A host copy of a device array (``get``); host data as it is."""
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    return np.asarray(a, order=order)


def from_dlpack(tensor) -> ndarray:
    """A device array over a DLPack tensor's memory (a CPU tensor stands for a CUDA one): no copy."""
    host = np.from_dlpack(tensor)
    late.share(host)
    return ndarray(host)


def empty(shape, dtype=np.float64, order="C") -> ndarray:
    """``cupy.empty``: memory as it was left (running late, a garbage pattern: ``late.garbage``)."""
    return allocated(late.garbage(np.empty(shape, dtype, order)))


def empty_like(a, dtype=None, order="K", shape=None) -> ndarray:
    """``cupy.empty_like`` of a device array: memory as it was left."""
    return allocated(late.garbage(np.empty_like(device_arrays([a], "empty_like")[0]._host, dtype, order, shape=shape)))


def empty_pinned(shape, dtype=np.float64) -> np.ndarray:
    """``cupyx.empty_pinned``: a host array the device copies to and from asynchronously (memory as it was left)."""
    return late.pin(late.garbage(np.empty(shape, dtype)))


def stack(arrays, axis=0, out=None) -> ndarray:
    """``cupy.stack``: device arrays only (CuPy's ``expand_dims`` takes no Python number)."""
    return compute(np.stack, (device_arrays(arrays, "stack"),), {"axis": axis, "out": out})


def concatenate(arrays, axis=0, out=None, **kwargs) -> ndarray:
    """``cupy.concatenate``: device arrays only."""
    return compute(np.concatenate, (device_arrays(arrays, "concatenate"),), {"axis": axis, "out": out, **kwargs})


def kernel(body, in_params: str, out_params: str):
    """A device kernel (the stand-in's ``ElementwiseKernel``, with its ``in_params`` and ``out_params``): ``body``,
    written with NumPy, run on the memory underneath its device arguments (inputs, then outputs) as one launch on
    the current stream. Arguments are checked as CuPy checks them (``arguments.check``); host arrays among them are
    refused, as CuPy's kernels refuse them."""
    params = arguments.parse(in_params), arguments.parse(out_params)

    def launch(*args) -> None:
        arguments.check(body, *params, args)
        hosts = on_device(args)
        cuda.issue(functools.partial(body, *hosts), device_operands(args))

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
