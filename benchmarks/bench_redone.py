"""Steps redone and steps that kept elements on mpizero.torch's own loops, at the default headroom.

Run: mpiexec -n 2 python benchmarks/bench_redone.py [--steps 500] [--stage 2]
Three loops, each for ``--steps`` steps: examples/gpt2_recipe.py as it is (``loss.backward()`` per micro-batch,
then ``optimizer.step()``: kept mode, which cannot redo a step); an MLP (4 x Linear(--width, --width)) whose
closure runs the step's micro-batches (``zero.step(closure)``: streamed mode, as bench_peers' loop); and the same
MLP with a closure that draws a new batch from a data stream on every call, as a user's ``next(loader)`` does, so a
redone step trains on other data. The table gives the closure's calls, the steps redone (the engine's count), and
the steps in which some rank kept elements beyond the predicted range (``docs/bitwise.md``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from mpizero.torch import shard

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--width", type=int, default=256, help="the MLP's width (4 layers)")
    parser.add_argument("--micro-batches", type=int, default=8, help="per rank, per step")
    return parser.parse_args()


def gpt2_recipe(args) -> dict:
    """The example's own loop; it makes no closure calls."""
    sys.path.insert(0, str(EXAMPLES))
    import gpt2_recipe

    zero = gpt2_recipe.main(["--steps", str(args.steps), "--stage", str(args.stage), "--log-every", "1000000"])
    return {"calls": None, "redone": zero.engine.redone_steps, "kept": zero.engine.scales.kept_steps}


def mlp(args):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(4)]
    return torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())][:-1])


def closure_loop(args, draw) -> dict:
    """Train the MLP by ``zero.step(closure)``; ``draw(step, call)`` gives the closure's batch for its call."""
    model = mlp(args)
    zero = shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=args.stage)
    calls = 0
    for step in range(args.steps):

        def closure(step=step):
            nonlocal calls
            x, y = draw(step, calls)
            calls += 1
            for i in range(args.micro_batches):
                rows = slice(4 * i, 4 * i + 4)
                torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()

        zero.step(closure)
    return {"calls": calls, "redone": zero.engine.redone_steps, "kept": zero.engine.scales.kept_steps}


def batch(args, *key: int):
    rng = np.random.default_rng([MPI.COMM_WORLD.rank, *key])
    x = rng.standard_normal((4 * args.micro_batches, args.width), dtype=np.float32)
    return torch.from_numpy(x), torch.from_numpy(np.tanh(x[:, ::-1].copy()))


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    rows = {
        "gpt2_recipe.py (loss.backward(); optimizer.step())": gpt2_recipe(args),
        "MLP, step(closure), the step's batch": closure_loop(args, lambda step, call: batch(args, step)),
        "MLP, step(closure), a new batch per call": closure_loop(args, lambda step, call: batch(args, 1 << 20, call)),
    }
    if MPI.COMM_WORLD.rank == 0:
        print(f"{args.steps} steps, stage {args.stage}, {MPI.COMM_WORLD.size} ranks, default headroom")
        print(f"{'loop':<52} {'closure calls':>13} {'redone':>13} {'kept':>13}")
        for name, row in rows.items():
            calls = "-" if row["calls"] is None else str(row["calls"])
            shares = [f"{row[k]} ({row[k] / args.steps:.1%})" for k in ("redone", "kept")]
            print(f"{name:<52} {calls:>13} {shares[0]:>13} {shares[1]:>13}")


if __name__ == "__main__":
    main()
