"""The standard torch recipe on mpizero.torch at any world size.

Run: mpiexec -n N python -m mpi4py tests/torch_bridge/torch_recipe.py [--stages 0 1 2 3] [--steps S]
[--save D --until T | --resume D]

A small CNN with dropout and BatchNorm; torch.optim.AdamW with a decay and a no-decay group; warm-up plus cosine
(LambdaLR, built before shard); 6 global micro-batches a step split over the ranks (unevenly at 4), each run
under ``zero.micro_batch(i)`` inside ``join()``; ``clip_grad_norm_``, ``optimizer.step()``, ``scheduler.step()``,
``optimizer.zero_grad()``. Prints, on rank 0, ``digest STAGE PARAMS BUFFERS EVAL``: digests of the fp32 masters,
of the buffers, and of the eval-mode outputs on a fixed batch.
"""

import argparse
import hashlib
import math

import torch
from mpi4py import MPI

import mpizero
from mpizero.torch import shard

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
MICRO_BATCHES, WARMUP, TOTAL = 6, 2, 8


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 6, 3)
        self.norm = torch.nn.BatchNorm2d(6)
        self.drop = torch.nn.Dropout(0.3)
        self.head = torch.nn.Linear(6 * 6 * 6, 5)

    def forward(self, x):
        x = self.drop(torch.relu(self.norm(self.conv(x))))  # (B, 6, 6, 6)
        return self.head(x.flatten(1))


def make():
    torch.manual_seed(0)
    model = Net()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=3e-2, betas=(0.9, 0.95))

    def schedule(step):
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (TOTAL - WARMUP)))

    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def batch(step, index):
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)


def train(zero, model, optimizer, scheduler, steps):
    mine = list(mpizero.split_evenly(MICRO_BATCHES, comm.size, comm.rank))
    for step in steps:
        with zero.join():
            for index in mine:
                x, y = batch(step, index)
                with zero.micro_batch(index):
                    torch.nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def digest(tensors) -> str:
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def report(stage, zero, model):
    masters = zero.master_params()
    model.eval()
    with torch.no_grad():
        outputs = model(batch(99, 0)[0])
    model.train()
    if comm.rank == 0:
        params = digest(torch.from_numpy(masters[n]) for n in sorted(masters))
        buffers = digest(b for _, b in sorted(model.named_buffers()))
        print(f"digest {stage} {params} {buffers} {digest([outputs])}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=TOTAL)
    parser.add_argument("--save", default=None)
    parser.add_argument("--until", type=int, default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    for stage in args.stages:
        model, optimizer, scheduler = make()
        zero = shard(model, optimizer, stage=stage, comm=comm)
        start = 0
        if args.resume:
            start = zero.load(args.resume, scheduler=scheduler)["step"]
        until = args.until if args.save else args.steps
        train(zero, model, optimizer, scheduler, range(start, until))
        if args.save:
            zero.save(args.save, scheduler=scheduler)
        else:
            report(stage, zero, model)


if __name__ == "__main__":
    main()
