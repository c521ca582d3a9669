"""Torch tensors as NumPy or CuPy arrays and back, without copying.

CPU tensors become NumPy arrays through ``Tensor.numpy()``; CUDA tensors become
CuPy arrays through DLPack, so the engine's GPU path serves torch on GPUs.
``FullParams`` is stage 3's unsharded buffer: a torch tensor that exists only
between a gather and a release (as FSDP2 frees its unsharded parameters).
"""

from __future__ import annotations

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


class FullParams:
    """One group's full params (padded numel, float32) as a torch tensor, allocated only while gathered.

    Each gather gets a new tensor, and freeing only drops this reference: a caller still holding a view (or a
    NumPy array of it) keeps valid memory, never a view of freed storage.
    """

    def __init__(self, numel: int, device: torch.device) -> None:
        self.numel, self.device = numel, device
        self.nbytes = 4 * numel
        self.tensor: torch.Tensor | None = None

    @property
    def allocated(self) -> bool:
        return self.tensor is not None

    def allocate(self):
        """Make the buffer exist (if it does not); return an array view of it (zero-copy)."""
        if self.tensor is None:
            self.tensor = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        return as_array(self.tensor)

    def free(self) -> None:
        self.tensor = None
