"""The stand-in's device array: a host array underneath that reaches the host only when asked, as CuPy's does.

It refuses what CuPy refuses, with CuPy's errors: turning into a NumPy array implicitly (``numpy.asarray``,
``__array__``), a host array assigned into it (``a[...] = host``: CuPy's ``fill`` refuses a non-scalar ndarray), and
host arrays mixed with device arrays in any operation, and bfloat16, which CuPy's kernels do not cover (the engine
holds it as 16-bit words on a device). What CuPy allows but pays for on a GPU (``get``, ``set``,
``float()``, ``int()``, ``bool()``, ``item()``, ``tolist()``, printing) works and is counted (``bus``). NumPy's
functions and operators run on the host array underneath and give device arrays back (a reduction gives a 0-d
device array, as CuPy's does), each counted as a launch on the current stream (``cuda``). Work writing into
memory that exists is issued on its stream (``cuda.issue``), and runs late where the stand-in does (``late``);
work that makes a new array runs now, after the work queued before it on its stream (``cuda.due``).
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.lib.mixins

from mpizero.standin import bus, cuda, late

IMPLICIT = (
    "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a NumPy array explicitly."
)
NO_BFLOAT16 = "the stand-in holds no bfloat16, as CuPy holds none in full: hold bfloat16 as 16-bit words (uint16)"
METHODS = (  # cupy.ndarray's methods that compute on the device: one launch each (see ``_forward``)
    "all any argmax argmin argsort clip copy cumsum dot flatten max mean min nonzero prod ravel repeat round sort "
    "std sum take var"
).split()
VIEWS = "reshape squeeze swapaxes transpose view".split()  # new views of the same memory: no launch


class ndarray(numpy.lib.mixins.NDArrayOperatorsMixin):  # noqa: N801 - CuPy's name, as errors show it
    """A device array of the stand-in (see the module's docstring)."""

    __array_priority__ = 100

    def __init__(self, host: np.ndarray) -> None:
        if host.dtype.name == "bfloat16":
            raise TypeError(NO_BFLOAT16)
        self._host = host

    shape = property(lambda self: self._host.shape)
    dtype = property(lambda self: self._host.dtype)
    size = property(lambda self: self._host.size)
    ndim = property(lambda self: self._host.ndim)
    nbytes = property(lambda self: self._host.nbytes)
    itemsize = property(lambda self: self._host.itemsize)
    strides = property(lambda self: self._host.strides)
    flags = property(lambda self: self._host.flags)
    T = property(lambda self: ndarray(self._host.T))
    underneath = property(lambda self: self._host, doc="The host array that owns the memory (no copy is counted).")

    @property
    def __cuda_array_interface__(self) -> dict:
        """The buffer's address, so MPI can be handed it (on the stand-in, "device" memory is host memory)."""
        host = self._host.__array_interface__
        return {
            "shape": host["shape"],
            "typestr": host["typestr"],
            "data": host["data"],
            "strides": host["strides"],
            "version": 3,
        }

    # What CuPy refuses -------------------------------------------------------

    def __array__(self, dtype=None, copy=None):
        raise TypeError(IMPLICIT)

    def __setitem__(self, index, value) -> None:
        if isinstance(value, np.ndarray) and value.shape != ():
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        if isinstance(value, (list, tuple)):
            raise TypeError(f"Unsupported type {type(value)}")
        if isinstance(value, ndarray):
            bus.COUNTS["device copy"] += 1
        target, index = self._host, device_index(index)
        source = value._host if isinstance(value, ndarray) else value

        def assign():
            target[index] = source

        cuda.issue(assign, (target, *device_operands((source, index))))

    def fill(self, value) -> None:
        if isinstance(value, np.ndarray) and value.shape != ():
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        cuda.issue(functools.partial(self._host.fill, value), (self._host,))

    # Device computation --------------------------------------------------------

    def __array_ufunc__(self, ufunc, method: str, *inputs, **kwargs):
        for operand in inputs:  # CuPy takes device arrays and scalars as operands, not sequences
            if isinstance(operand, (list, tuple)):
                raise TypeError(f"Unsupported type {type(operand)}")
        out = kwargs.get("out")
        call = functools.partial(getattr(ufunc, method), *on_device(inputs), **on_device(kwargs))
        if out is None and method != "at":  # a new array
            cuda.due()
            result = call()
            cuda.launched()
            return wrap(result)
        cuda.issue(call, device_operands((inputs, out)))
        return out[0] if out is not None and len(out) == 1 else out

    def __array_function__(self, func, types, args, kwargs):
        return compute(func, args, kwargs)

    def __getitem__(self, index):
        index = device_index(index)
        found = self._host[index]
        if isinstance(found, np.ndarray) and np.may_share_memory(found, self._host):
            return ndarray(found)  # a view: nothing read yet
        cuda.due()
        return wrap(self._host[index])

    def __len__(self) -> int:
        return len(self._host)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        cuda.due()
        converted = self._host.astype(dtype, order=order, copy=copy)
        cuda.launched()
        return wrap(converted)

    # What crosses the bus ------------------------------------------------------

    def get(self, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
        """Copy to the host (a new array, or ``out``) on ``stream``; ``blocking=False`` returns before the copy is
        done, unless ``out`` is pageable memory (CUDA's copy into pageable memory returns once it is done)."""
        if out is not None:
            self._check_host(out, "obtained from")
        bus.copied("d2h", self.nbytes, blocking)
        out = late.garbage(np.empty_like(self._host, order=order)) if out is None else out
        cuda.issue(functools.partial(np.copyto, out, self._host), (self._host,), stream)
        if blocking or not late.pinned(out):
            cuda.due(stream)
        return out

    def set(self, arr: np.ndarray, stream=None) -> None:
        """Copy host array ``arr`` (the same dtype and shape) into this contiguous device array."""
        self._check_host(arr, "set to")
        if not self._host.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        bus.copied("h2d", arr.nbytes, False)
        source = arr if late.pinned(arr) else arr.copy()  # CUDA copies pageable memory before it returns
        cuda.issue(functools.partial(np.copyto, self._host, source), (self._host,), stream)

    def _check_host(self, host, verb: str) -> None:
        """CuPy's checks of a host array copied from or into this one (``verb``: "obtained from", "set to")."""
        if not isinstance(host, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be {verb} cupy.ndarray")
        if host.dtype != self.dtype:
            raise TypeError(f"{host.dtype} array cannot be {verb} {self.dtype} array")
        if host.shape != self.shape:
            raise ValueError("Shape mismatch")

    def _to_host(self) -> np.ndarray:
        bus.copied("d2h", self.nbytes, True)
        cuda.due()
        return self._host

    def item(self):
        return self._to_host().item()

    def tolist(self):
        return self._to_host().tolist()

    def __float__(self) -> float:
        return float(self._scalar())

    def __int__(self) -> int:
        return int(self._scalar())

    def __index__(self) -> int:
        return self._scalar().__index__()

    def __bool__(self) -> bool:
        return bool(self._scalar())

    def _scalar(self):
        if self.size != 1:
            raise TypeError("only length-1 arrays can be converted to Python scalars")
        return self._to_host().reshape(-1)[0]

    def __repr__(self) -> str:
        return repr(self._to_host()).replace("array(", "standin.array(", 1)

    def __str__(self) -> str:
        return str(self._to_host())

    def __format__(self, spec: str) -> str:
        return format(self._to_host() if self.ndim else self._scalar(), spec)

    def __reduce__(self):
        return (ndarray, (self._to_host().copy(),))

    # DLPack: a CPU capsule, so torch.from_dlpack gives a CPU tensor over the same memory ---------------------

    def __dlpack__(self, **kwargs):
        late.share(self._host)  # nothing made due: MPI takes device memory this way too (mpi4py), outside any stream
        return self._host.__dlpack__(**{k: v for k, v in kwargs.items() if k != "stream"})

    def __dlpack_device__(self):
        return self._host.__dlpack_device__()


def _forward(name: str, launches: bool):
    def method(self, *args, **kwargs):
        if launches:
            cuda.due()
            cuda.launched()
        return wrap(getattr(self._host, name)(*on_device(args), **on_device(kwargs)))

    method.__name__ = name
    return method


for _name in METHODS + VIEWS:
    setattr(ndarray, _name, _forward(_name, _name in METHODS))


def compute(func, args, kwargs):
    """``func`` of NumPy run on the arrays underneath device arguments, after the work queued before it; the results
    as device arrays."""
    cuda.due()
    result = func(*on_device(args), **on_device(kwargs))
    cuda.launched()
    return wrap(result)


def on_device(value):
    """The host arrays underneath device arrays, at any depth of tuples, lists and dicts; host arrays refused, 0-d
    ones too, as CuPy refuses them beside device arrays (NumPy scalars pass, as CuPy passes them by value)."""
    if isinstance(value, ndarray):
        return value._host
    if isinstance(value, np.ndarray):
        raise TypeError(f"Unsupported type {type(value)}")
    if isinstance(value, (tuple, list)):
        return type(value)(on_device(v) for v in value)
    if isinstance(value, dict):
        return {k: on_device(v) for k, v in value.items()}
    return value


def device_operands(value) -> list[np.ndarray]:
    """The host arrays underneath every device array in ``value`` (tuples, lists and dicts at any depth)."""
    if isinstance(value, ndarray):
        return [value._host]
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in device_operands(v)]
    if isinstance(value, dict):
        return device_operands(list(value.values()))
    return []


def allocated(host: np.ndarray) -> ndarray:
    """A device array over new memory ``host``, counted as one device allocation (``bus``)."""
    bus.allocated()
    return ndarray(host)


def device_arrays(arrays, function: str) -> list:
    """The arrays ``stack`` or ``concatenate`` joins, which CuPy takes only as device arrays (not numbers)."""
    for a in arrays:
        if not isinstance(a, ndarray):
            raise TypeError(f"{function}: expected a sequence of cupy.ndarray, got an element of {type(a)}")
    return list(arrays)


def device_index(index):
    """An index into a device array: device arrays in it as they are, host index arrays copied to the device first
    (CuPy accepts them)."""
    if isinstance(index, tuple):
        return tuple(device_index(i) for i in index)
    if isinstance(index, ndarray):
        return index._host
    if isinstance(index, (np.ndarray, list)):
        bus.copied("h2d", np.asarray(index).nbytes, False)
    return index


def wrap(value):
    """Device arrays for NumPy's results (a NumPy scalar or bool becomes a 0-d device array, as CuPy gives); each
    that owns its memory is counted as an allocation (``bus``)."""
    if isinstance(value, np.ndarray):
        return allocated(value) if value.flags.owndata else ndarray(value)
    if isinstance(value, (np.generic, bool)):
        return allocated(np.asarray(value))
    if isinstance(value, (tuple, list)):
        return type(value)(wrap(v) for v in value)
    return value
