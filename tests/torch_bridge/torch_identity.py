"""mpizero.torch at any world size.

Run: mpiexec -n N python -m mpi4py tests/torch_bridge/torch_identity.py [--save|--resume D]

Trains the MLP and the transformer (torch_models) at stages 0-3, 5 global
micro-batches per step split unevenly over the ranks; a rank with fewer runs a
``not_counted`` pass so every rank joins stage 3's gathers; the last round
uses ``last_backward()`` at stage 3; the transformer trains again at stages 2-3 with rounds paired
(``pair_contributions=True``, stage ``2p`` and ``3p``), and both at stage 3 with units kept gathered through
each step (``keep_gathered=True``, stage ``3k``). Prints ``digest MODEL STAGE HEX`` of the final master
parameters (rank 0), so runs at different world sizes and ways can be compared.
"""

import hashlib
import sys

import torch
from mpi4py import MPI
from torch_models import batch, loss, make

import mpizero
from mpizero.torch import shard

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
MICRO_BATCHES, STEPS = 5, 3


def train_steps(kind, zero, model, steps):
    mine = list(mpizero.split_evenly(MICRO_BATCHES, comm.size, comm.rank))
    rounds = -(-MICRO_BATCHES // comm.size)
    for step in steps:
        for r in range(rounds):
            if r == rounds - 1 and zero.engine.config.stage == 3:
                zero.last_backward()
            x, y = batch(kind, step, mine[min(r, len(mine) - 1)] if mine else 0)
            with zero.not_counted() if r >= len(mine) else _nothing():
                loss(kind, model(x), y).backward()
        zero.step()
        zero.zero_grad()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def digest(zero) -> str:
    h = hashlib.blake2b(digest_size=8)
    for a in zero.master_params().values():
        h.update(a.tobytes())
    return h.hexdigest()


def build(kind, stage, **settings):
    model = make(kind)
    return model, shard(model, mpizero.AdamW(lr=1e-2, weight_decay=0.1), stage=stage, comm=comm, **settings)


def main(argv):
    if argv[:1] == ["--save"]:  # 2 steps at stage 3, then a checkpoint
        model, zero = build("transformer", 3)
        train_steps("transformer", zero, model, range(2))
        zero.save(argv[1])
        return
    if argv[:1] == ["--resume"]:  # the last step at stage 1 from that checkpoint, at another world size
        model, zero = build("transformer", 1)
        zero.load(argv[1])
        train_steps("transformer", zero, model, range(2, STEPS))
        found = digest(zero)  # collective: every rank computes it
        print(f"resumed digest {found}" if comm.rank == 0 else "", flush=True)
        return
    paired = [("transformer", stage, "p") for stage in (2, 3)]  # rounds two in one pass (not the default there)
    kept = [(kind, 3, "k") for kind in ("mlp", "transformer")]
    for kind, stage, label in (
        [(kind, stage, "") for kind in ("mlp", "transformer") for stage in range(4)] + paired + kept
    ):
        settings = {"pair_contributions": True} if label == "p" else {"keep_gathered": True} if label == "k" else {}
        model, zero = build(kind, stage, **settings)
        train_steps(kind, zero, model, range(STEPS))
        found = digest(zero)
        if comm.rank == 0:
            print(f"digest {kind} {stage}{label} {found}", flush=True)
        if stage == 3:  # torch.no_grad() and eval() inference gathers every unit, and frees it unless kept
            with torch.no_grad():
                model.eval()
                model(batch(kind, 0, 0)[0])
            left = [b.allocated for b in zero.binder.buffers]
            assert left == [label == "k"] * len(left), f"stage 3 {label}: gathered afterwards {left}"
            assert label == "k" or zero.memory()["gathered"] == 0


if __name__ == "__main__":
    main(sys.argv[1:])
