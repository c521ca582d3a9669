"""The GPT-2 recipe of examples/gpt2_recipe.py under DDP and mpizero.torch: bench_peers' ``gpt2-*`` rows.

Both run the example's model, data, optimizer (AdamW, decay and no-decay groups), warm-up and cosine schedule,
clipping and bfloat16 autocast, on the same global micro-batches (``--micro-batches`` per rank). DDP accumulates as
its users do: ``no_sync()`` but for the last micro-batch, the loss divided by their number. mpizero.torch runs the
example's loop: ``join()``, ``micro_batch(i)``, plain ``loss.backward()``, ``optimizer.step()``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def recipe_parts(args, size: int):
    """The example module and its model, optimizer, scheduler, data and settings for ``size`` ranks."""
    sys.path.insert(0, str(EXAMPLES))
    import gpt2_recipe

    settings = gpt2_recipe.parse(["--micro-batches", str(args.micro_batches * size), "--steps", str(args.steps)])
    model = gpt2_recipe.build_model(settings)
    optimizer, scheduler = gpt2_recipe.build_optimizer(model, settings)
    return gpt2_recipe, model, optimizer, scheduler, gpt2_recipe.text_bytes(), settings


def gpt2_worker(args, config: str, bench) -> dict:
    """Time the recipe's steps under ``config`` (``gpt2-ddp`` or ``gpt2-mpizero.torch-STAGE``)."""
    import torch

    import mpizero

    torch.set_num_threads(1)
    rank, size = int(os.environ.get("PMI_RANK", "0")), int(os.environ.get("PMI_SIZE", "1"))
    example, model, optimizer, scheduler, data, settings = recipe_parts(args, size)
    mine = list(mpizero.split_evenly(settings.micro_batches, size, rank))
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    baseline = bench.current_rss()
    if config == "gpt2-ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=size)
        trained = torch.nn.parallel.DistributedDataParallel(model)

        def step_fn(step: int) -> None:
            for m, index in enumerate(mine):
                x, y = example.micro_batch(data, settings, step, index)
                quiet = trained.no_sync() if m < len(mine) - 1 else contextlib.nullcontext()
                with quiet:
                    with autocast():
                        loss = trained(input_ids=x, labels=y).loss / len(mine)
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

        result = bench.gathered(bench.timed_steps(args, dist.barrier, step_fn), baseline)
        dist.destroy_process_group()
        return result
    from mpi4py import MPI

    from mpizero.torch import shard

    comm = MPI.COMM_WORLD
    zero = shard(model, optimizer, stage=int(config.split("-")[-1]), units=example.units_of(model), comm=comm)

    def step_fn(step: int) -> None:
        with zero.join():
            for index in mine:
                x, y = example.micro_batch(data, settings, step, index)
                with zero.micro_batch(index), autocast():
                    loss = model(input_ids=x, labels=y).loss
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    result = bench.mpi_gathered(comm, bench.timed_steps(args, comm.Barrier, step_fn), baseline)
    return {**result, "redone": zero.engine.redone_steps, "mapped": zero.engine.collectives.mapped_bytes >> 10}
