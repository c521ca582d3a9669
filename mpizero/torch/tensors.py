"""Torch tensors as NumPy or CuPy arrays and back, without copying.

CPU tensors become NumPy arrays through ``Tensor.numpy()``; CUDA tensors become
CuPy arrays through DLPack, so the engine's GPU path serves torch on GPUs.
``FullParams`` is stage 3's unsharded buffer: a torch tensor that exists only
between a gather and a release (as FSDP2 frees its unsharded parameters), its
host memory refilled by the next gather while anything still holds it.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import ml_dtypes
import numpy as np
import torch

from mpizero.arrays import is_device_array
from mpizero.errors import ZeroError

STANDIN = os.environ.get("MPIZERO_STANDIN") == "1"  # CPU tensors stand for CUDA ones (``mpizero.standin``)


def as_array(tensor: torch.Tensor):
    """View a CPU tensor as a NumPy array, or a CUDA tensor as a CuPy array (DLPack); no copy. With
    ``MPIZERO_STANDIN=1`` a CPU tensor becomes a stand-in device array instead, so the bridge takes its CUDA path."""
    tensor = tensor.detach()
    if tensor.device.type == "cuda":
        import cupy

        return cupy.from_dlpack(tensor)
    if tensor.device.type != "cpu":
        raise ZeroError(f"mpizero.torch holds CPU or CUDA tensors, got one on {tensor.device}")
    if STANDIN:
        import mpizero.standin

        return mpizero.standin.from_dlpack(tensor)
    return tensor.numpy()


def host_copy(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy copy of any tensor's values on the host, bfloat16 included (as ml_dtypes' bfloat16)."""
    cpu = tensor.detach().to("cpu").contiguous()
    if cpu.dtype == torch.bfloat16:
        return cpu.view(torch.uint16).numpy().view(ml_dtypes.bfloat16).copy()
    return cpu.numpy().copy()


def host_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype ``host_copy`` gives a tensor of ``dtype``."""
    return np.dtype(ml_dtypes.bfloat16) if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


def from_host(array: np.ndarray) -> torch.Tensor:
    """``host_copy``'s inverse: a CPU tensor of ``array``'s values."""
    if array.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def as_tensor(array) -> torch.Tensor:
    """View a NumPy array (``from_numpy``) or a CuPy array (DLPack) as a tensor; no copy."""
    return torch.from_dlpack(array) if is_device_array(array) else torch.from_numpy(array)


class FullParams:
    """One group's full params (padded numel, float32) as a torch tensor, allocated only while gathered.

    Freeing only drops this reference: whoever still holds the memory (autograd's saved views of a unit's
    forward, kept for its backward; an array a caller took inside ``gathered()``) holds valid memory, never a
    view of freed storage. While anything holds it, the next gather refills that memory instead of allocating
    more, on the host as on a GPU (as FSDP2 refills its unsharded storage for the backward): a unit's backward
    then needs no second buffer, and a held view shows the group's params as of the last gather, as a view of a
    plain torch parameter shows them after an update. The memory is the engine's array module's (NumPy's, or
    CuPy's pool on a GPU), shared with torch without a copy; torch's tensor keeps that array alive, so a weak
    reference to it tells whether anything still holds the memory.
    """

    def __init__(self, numel: int, xp, device: torch.device) -> None:
        self.numel, self.xp, self.device = numel, xp, device
        self.nbytes = 4 * numel
        self.tensor: torch.Tensor | None = None
        self._last = lambda: None  # the array owning the last buffer, while anything still holds it (weakly)

    @property
    def allocated(self) -> bool:
        return self.tensor is not None

    def allocate(self, shown=None):
        """Make the buffer exist (if it does not): the last one if anything still holds it, else a new one; return
        an array view of it (zero-copy). ``shown``: the array to show instead (the engine's full params, read in
        place), made the buffer until ``free``."""
        with torch.inference_mode(False):  # a forward under inference_mode may gather it: it serves later ones too
            if shown is not None:
                self.tensor = as_tensor(shown)
            if self.tensor is None:
                memory = self._last()
                if memory is None:
                    device = self.xp.cuda.Device(self.device.index) if self.device.type == "cuda" else None
                    with device or contextlib.nullcontext():
                        memory = self.xp.empty(self.numel, dtype=np.float32)  # on the parameters' GPU, not CuPy's
                    self._last = weakref.ref(getattr(memory, "underneath", memory))  # the stand-in's: its host array
                self.tensor = as_tensor(memory)
        return as_array(self.tensor)

    def free(self) -> None:
        self.tensor = None
