# Run: mpiexec -n 4 python examples/gpt2_recipe.py --steps 40 --checkpoint-dir ck   (or plain `python examples/...`)
#      then, at any world size: mpiexec -n 2 python examples/gpt2_recipe.py --steps 60 --checkpoint-dir ck --resume
"""A GPT-style training recipe on mpizero.torch, as a PyTorch user writes it.

transformers' GPT-2 built from a config (no download), trained on the source of Python's own standard library;
torch.optim.AdamW with a weight-decay group and a no-decay group, warm-up then cosine decay (LambdaLR), gradient
clipping, dropout on, bfloat16 autocast, a global batch of --micro-batches micro-batches split over the ranks, a
checkpoint every --checkpoint-every steps, a resume at any world size, and the global loss logged on rank 0.
Every world size trains to the same bytes: dropout is keyed to each micro-batch's index (``zero.micro_batch``).
"""

import argparse
import hashlib
import math
import os
import sysconfig

import numpy as np
import torch
from mpi4py import MPI
from transformers import GPT2Config, GPT2LMHeadModel

import mpizero
from mpizero.torch import Recipe, shard

SOURCES = ("textwrap.py", "argparse.py", "difflib.py", "json/decoder.py")  # ~210 KB of text every Python ships


def text_bytes() -> np.ndarray:
    """The training text as bytes (the vocabulary is the 256 byte values)."""
    root = sysconfig.get_paths()["stdlib"]
    return np.frombuffer(b"".join(open(os.path.join(root, name), "rb").read() for name in SOURCES), np.uint8)


def build_model(args) -> GPT2LMHeadModel:
    """GPT-2 from a config, the same on every rank (same seed)."""
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=256, n_positions=args.block_size, n_embd=args.width, n_layer=args.layers, n_head=4)
    return GPT2LMHeadModel(config)


def build_optimizer(model, args):
    """AdamW with weight decay on matrices only (nanoGPT's split), warm-up then cosine decay to 10%."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))

    def schedule(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def micro_batch(data: np.ndarray, args, step: int, index: int):
    """Global micro-batch ``index`` of ``step``: --rows windows of the text, chosen by a generator keyed to both."""
    rng = np.random.default_rng([args.seed, step, index])
    starts = rng.integers(0, len(data) - args.block_size - 1, args.rows)
    windows = np.stack([data[s : s + args.block_size + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(windows[:, :-1]), torch.from_numpy(windows[:, 1:])


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--micro-batches", type=int, default=16, help="global micro-batches per step")
    parser.add_argument("--rows", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the directory")
    parser.add_argument("--log-every", type=int, default=10)
    return parser.parse_args(argv)


def recipe(argv=("--micro-batches", "4", "--width", "64")) -> Recipe:
    """This recipe for ``python -m mpizero check examples/gpt2_recipe.py:recipe``: same model, optimizer,
    schedule, data, clipping and autocast as ``main``, smaller by default."""
    args = parse(list(argv))
    data, model = text_bytes(), build_model(args)
    optimizer, scheduler = build_optimizer(model, args)

    def loss(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=batch[0], labels=batch[1]).loss

    return Recipe(
        model,
        optimizer,
        batch=lambda step, index: micro_batch(data, args, step, index),
        loss=loss,
        micro_batches=args.micro_batches,
        scheduler=scheduler,
        clip_norm=1.0,
        units=units_of,
    )


def units_of(model) -> list:
    """Stage 3's units: the embeddings, each block, the final norm (the tied head belongs to the embedding)."""
    return [model.transformer.wte, model.transformer.wpe, *model.transformer.h, model.transformer.ln_f]


def main(argv=None) -> mpizero.torch.ShardedModel:
    args = parse(argv)
    torch.set_num_threads(1)  # one thread per rank: ranks x threads must not exceed the cores
    comm = MPI.COMM_WORLD
    data, model = text_bytes(), build_model(args)
    optimizer, scheduler = build_optimizer(model, args)
    zero = shard(model, optimizer, stage=args.stage, units=units_of(model), seed=args.seed)
    start = zero.load(args.checkpoint_dir, scheduler=scheduler)["step"] if args.resume else 0
    mine = list(mpizero.split_evenly(args.micro_batches, comm.size, comm.rank))
    for step in range(start, args.steps):
        loss_sum = 0.0
        with zero.join():  # ranks may hold different numbers of micro-batches
            for index in mine:
                x, y = micro_batch(data, args, step, index)
                with zero.micro_batch(index), torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(input_ids=x, labels=y).loss
                loss.backward()  # no division by the micro-batch count: the step averages every backward
                loss_sum += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        loss = comm.allreduce(loss_sum) / args.micro_batches
        if comm.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:>4}  loss {loss:.4f}  grad norm {norm.item():.3f}  lr {scheduler.get_last_lr()[0]:.2e}")
        if args.checkpoint_dir and (step + 1) % args.checkpoint_every == 0:
            zero.save(args.checkpoint_dir, data={"seed": args.seed}, keep=2, scheduler=scheduler)
    masters = zero.master_params()  # collective: on every rank
    if comm.rank == 0:  # the same at any world size and stage, and across a resume
        print("digest", hashlib.sha256(b"".join(masters[name].tobytes() for name in sorted(masters))).hexdigest())
    return zero


if __name__ == "__main__":
    main()
