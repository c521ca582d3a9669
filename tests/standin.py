"""A host array posing as a GPU buffer, with CuPy's copy methods, counting every copy between "device" and host.

The comm layer's device paths (staging, the one-rank path) run on it without a GPU: ``get`` and ``set``
are what would cross the PCIe bus, ``[...] =`` a copy on the device.
"""

from collections import Counter

import numpy as np


class StandInDevice:
    """A "device" view of a host array; slices and dtype views share the memory and the counts."""

    counts: Counter = Counter()  # "get", "set", "device copy": calls; "bytes": bytes over the "bus"

    def __init__(self, host: np.ndarray) -> None:
        self.host = host
        self.__cuda_array_interface__ = {"shape": host.shape, "typestr": host.dtype.str}

    shape = property(lambda self: self.host.shape)
    dtype = property(lambda self: self.host.dtype)
    size = property(lambda self: self.host.size)
    nbytes = property(lambda self: self.host.nbytes)
    itemsize = property(lambda self: self.host.itemsize)

    def __getitem__(self, index):
        return StandInDevice(self.host[index])

    def __setitem__(self, index, value) -> None:
        StandInDevice.counts["device copy"] += 1
        self.host[index] = value.host if isinstance(value, StandInDevice) else value

    def view(self, dtype):
        return StandInDevice(self.host.view(dtype))

    def reshape(self, *shape):
        return StandInDevice(self.host.reshape(*shape))

    def get(self, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
        StandInDevice.counts["get"] += 1
        StandInDevice.counts["bytes"] += self.nbytes
        if out is None:
            return self.host.copy()
        out[...] = self.host
        return out

    def set(self, host: np.ndarray, stream=None) -> None:
        StandInDevice.counts["set"] += 1
        StandInDevice.counts["bytes"] += host.nbytes
        self.host[...] = host
