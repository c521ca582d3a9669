"""Torch tensors as NumPy or CuPy arrays and back, without copying.

CPU tensors become NumPy arrays through ``Tensor.numpy()``; CUDA tensors become
CuPy arrays through DLPack, so the engine's GPU path serves torch on GPUs.
``FullParams`` is stage 3's unsharded buffer: a torch tensor whose storage
exists only between a gather and a release (as FSDP2 frees its unsharded
parameters), so views made once (the torch parameters) stay valid across gathers.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from mpizero.core.arrays import is_device_array
from mpizero.core.errors import ZeroError


def as_array(tensor: torch.Tensor):
    """View a CPU tensor as a NumPy array, or a CUDA tensor as a CuPy array (DLPack); no copy."""
    tensor = tensor.detach()
    if tensor.device.type == "cuda":
        import cupy

        return cupy.from_dlpack(tensor)
    if tensor.device.type != "cpu":
        raise ZeroError(f"mpizero.torch holds CPU or CUDA tensors, got one on {tensor.device}")
    return tensor.numpy()


def as_tensor(array) -> torch.Tensor:
    """View a NumPy array (``from_numpy``) or a CuPy array (DLPack) as a tensor; no copy."""
    return torch.from_dlpack(array) if is_device_array(array) else torch.from_numpy(array)


def raw_array(tensor: torch.Tensor):
    """View a contiguous float32 tensor's memory as an array that does not pin its storage.

    ``Tensor.numpy()`` would make the storage unresizable for good; this view
    must not be used once the storage is freed (the caller releases it first).
    """
    count = tensor.numel()
    if tensor.device.type == "cuda":
        import cupy

        memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), 4 * count, tensor)
        return cupy.ndarray((count,), np.float32, cupy.cuda.MemoryPointer(memory, 0))
    return np.ctypeslib.as_array((ctypes.c_float * count).from_address(tensor.data_ptr()))


class FullParams:
    """One group's full params (padded numel, float32) as a torch tensor, allocated only while gathered."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.tensor = torch.zeros(numel, dtype=torch.float32, device=device)
        self.nbytes = 4 * numel

    @property
    def allocated(self) -> bool:
        return self.tensor.untyped_storage().size() > 0

    def allocate(self):
        """Make the storage exist again (views made before see it); return an array view of it."""
        if not self.allocated:
            self.tensor.untyped_storage().resize_(self.nbytes)
        return raw_array(self.tensor)

    def free(self) -> None:
        """Free the storage; the views stay, with no memory behind them, until the next ``allocate``."""
        self.tensor.untyped_storage().resize_(0)
