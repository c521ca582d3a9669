"""Buffers the same on every rank after each step, and BatchNorm's running statistics independent of world size.

Glossary:

- running statistics: a BatchNorm module's ``running_mean``, ``running_var``
  and ``num_batches_tracked``, into which each training forward folds its batch
  statistics.
- record: one training forward's batch statistics of one BatchNorm module,
  taken by BatchNorm itself (for that forward its running statistics are zeroed
  stand-ins and its momentum 1; the module's own tensors are put back untouched,
  since autograd keeps them for the backward), keyed by the micro-batch's global
  index (``micro_batch``) or, outside it, by this rank and the forward's order.

During a step each counted training forward leaves the running statistics as
they were and keeps a record; at the step every rank gets every record and
replays them in the order of their keys with BatchNorm's update rule, so every
rank ends with the same statistics, and with ``zero.micro_batch(i)`` the same
at any world size. Other floating-point buffers a forward changed on any rank
are set to rank 0's after the step, as DDP's ``broadcast_buffers`` does.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from mpi4py import MPI
from torch.nn.modules.batchnorm import _BatchNorm

from mpizero.torch.hooks import outside_graphs


class BufferSync:
    """Records BatchNorm's batch statistics during a step and replays them at the step; equalizes other buffers."""

    def __init__(self, model: torch.nn.Module, collectives, around) -> None:
        """``around(hook)``: the hook as torch must call it (on its current stream: ``streams.TorchStream``)."""
        self.collectives, self.rank = collectives, collectives.comm.Get_rank()
        self.norms = [
            m
            for m in model.modules()
            if isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None
        ]
        normed = {id(b) for m in self.norms for b in m.buffers(recurse=False)}
        self.others = [b for b in model.buffers() if b.is_floating_point() and id(b) not in normed]
        self.versions = [b._version for b in self.others]
        self.index: int | None = None  # the global index of the micro-batch running now (``micro_batch``)
        self.counted = True
        self.forget()
        for position, module in enumerate(self.norms):
            module.register_forward_pre_hook(outside_graphs(around(partial(self._before, position))))
            module.register_forward_hook(outside_graphs(around(partial(self._after, position))))

    def forget(self) -> None:
        """Drop this step's records (after a step, or before a pass that runs again)."""
        self.records: list[list] = [[] for _ in self.norms]
        self.forwards = 0
        self.saved: dict[int, tuple] = {}

    def _before(self, position: int, module, args) -> None:
        if not module.training:
            return
        names = ("running_mean", "running_var", "num_batches_tracked")
        self.saved[position] = ({name: module._buffers[name] for name in names}, module.momentum)
        for name in names:
            module._buffers[name] = torch.zeros_like(module._buffers[name])
        module.momentum = 1.0  # the stand-in running statistics become exactly this forward's batch statistics

    def _after(self, position: int, module, args, output) -> None:
        if position not in self.saved:
            return
        mean, var = module.running_mean.detach().cpu().numpy().copy(), module.running_var.detach().cpu().numpy().copy()
        originals, module.momentum = self.saved.pop(position)
        module._buffers.update(originals)
        if self.counted:
            order = (0, self.index, 0, 0) if self.index is not None else (1, 0, self.rank, self.forwards)
            self.records[position].append((order, mean, var))
            self.forwards += 1

    def settle(self) -> None:
        """At a step (collective): replay every rank's records in key order; set changed buffers to rank 0's."""
        if self.norms:
            everyone = self.collectives.allgather_object(self.records, "BatchNorm's batch statistics")
            for position, module in enumerate(self.norms):
                records = sorted((r for rank in everyone for r in rank[position]), key=lambda r: r[0])
                _replay(module, records)
        if self.others:
            changed = any(b._version != v for b, v in zip(self.others, self.versions))
            if self.collectives.allreduce_value(changed, MPI.LOR, "whether a forward changed a buffer"):
                for buffer in self.others:
                    host = self.collectives.bcast_object(buffer.detach().cpu().numpy(), "rank 0's buffers")
                    with torch.no_grad():
                        buffer.copy_(torch.from_numpy(host))
            self.versions = [b._version for b in self.others]
        self.forget()


def _replay(module, records) -> None:
    """Fold each record into the module's running statistics in turn, as BatchNorm's training forward does."""
    with torch.no_grad():
        for _, mean, var in records:
            module.num_batches_tracked += 1
            factor = 1.0 / float(module.num_batches_tracked) if module.momentum is None else module.momentum
            for running, batch in ((module.running_mean, mean), (module.running_var, var)):
                folded = factor * batch.astype(np.float64) + (1.0 - factor) * running.double().cpu().numpy()
                running.copy_(torch.from_numpy(folded))
