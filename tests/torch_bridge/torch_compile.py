"""torch.compile on a sharded model at stages 0-3: the whole model, and each unit.

Run: mpiexec -n N python -m mpi4py tests/torch_bridge/torch_compile.py

An MLP with dropout whose first layer also reads its weight through ``.data`` (as monitoring code does; at stage
3 a parameter's class changes between its uses), compiled after shard(), 4 global micro-batches a step under
``micro_batch(i)``, torch's AdamW; prints ``digest HOW STAGE HEX WARNED`` on rank 0: the masters' digest, and
whether the bridge warned of a model compiled across its stage 3 units. ``whole``: ``torch.compile(model)``,
which inductor fuses across units at stages 0-2, while stage 3's unit hooks break the graph at each unit, so its
bytes are compared stage by stage across world sizes. ``units``: each unit but the root compiled
(``module.compile()``), the same graphs at every stage, so one digest at every stage and world size.
"""

import hashlib
import warnings

import torch
from mpi4py import MPI

import mpizero
from mpizero.torch import shard

torch.set_num_threads(1)
comm = MPI.COMM_WORLD


class ReadsData(torch.nn.Linear):
    """A layer whose forward also reads its weight through ``.data`` (at stage 3, while its unit is gathered)."""

    def forward(self, x):
        return super().forward(x) + self.weight.data.abs().mean()


def compiled_whole(model, zero):
    return torch.compile(model)


def compiled_units(model, zero):
    """Each unit but the model itself (compiling the root would compile the whole forward again)."""
    for unit in zero.units:
        if unit.module is not model:
            unit.module.compile()
    return model


def train(zero, compiled, optimizer) -> None:
    for step in range(3):
        with zero.join():
            for index in mpizero.split_evenly(4, comm.size, comm.rank):
                g = torch.Generator().manual_seed(10 * step + index)
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
                with zero.micro_batch(index):
                    torch.nn.functional.mse_loss(compiled(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


for how, compiled_as in (("whole", compiled_whole), ("units", compiled_units)):
    for stage in range(4):
        torch.manual_seed(0)
        model = torch.nn.Sequential(ReadsData(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        zero = shard(model, optimizer, stage=stage, comm=comm)
        compiled = compiled_as(model, zero)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(zero, compiled, optimizer)
        warned = any("compiled this model across its stage 3 units" in str(w.message) for w in caught)
        masters = zero.master_params()
        if comm.rank == 0:
            h = hashlib.blake2b(digest_size=8)
            for name in sorted(masters):
                h.update(masters[name].tobytes())
            print(f"digest {how} {stage} {h.hexdigest()} {warned}", flush=True)
