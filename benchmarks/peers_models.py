"""The two torch models bench_peers.py trains under every framework: the MLP stress row and the transformer row.

``mlp``: ``--layers`` Linear(width, width) with ReLU between, MSE on a fixed target; 24 flops per gradient element
and micro-batch at the default 4 rows, the worst case for an exact accumulator. ``gpt``: transformers' GPT-2 built
from a config (``--layers`` blocks of ``--width``, heads of 64 or one head below that, a 256-token vocabulary,
``--seq`` positions, dropout off, token 0 as start and end, the head tied to the embedding), next-token loss on
random tokens; ``--batch`` sequences per step.
"""

from __future__ import annotations

import numpy as np

VOCAB = 256
DEFAULTS = {"mlp": {"width": 2048, "layers": 4, "batch": 64}, "gpt": {"width": 512, "layers": 4, "batch": 32}}


def build(args):
    """The model, the same on every rank and framework (seed 0)."""
    import torch

    torch.manual_seed(0)
    if args.model == "mlp":
        layers = []
        for i in range(args.layers):
            layers.append(torch.nn.Linear(args.width, args.width))
            if i < args.layers - 1:
                layers.append(torch.nn.ReLU())
        return torch.nn.Sequential(*layers)
    from transformers import GPT2Config, GPT2LMHeadModel

    quiet = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=args.seq,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=max(1, args.width // 64),
        **quiet,
    )
    return GPT2LMHeadModel(config)


def local_batch(args, rank: int, size: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s rows of the step's global batch: (input, target); the GPT's target is its input."""
    rng = np.random.default_rng([step, rank])
    per_rank = args.batch // size
    if args.model == "gpt":
        tokens = rng.integers(0, VOCAB, (per_rank, args.seq), dtype=np.int64)
        return tokens, tokens
    x = rng.standard_normal((per_rank, args.width)).astype(np.float32)
    return x, np.tanh(x[:, ::-1]).copy()


def loss(args, model, x, y):
    """The model's loss on one micro-batch (``model`` may be a DDP, FSDP2 or DeepSpeed wrapper)."""
    import torch

    if args.model == "gpt":
        return model(input_ids=x, labels=y).loss
    return torch.nn.functional.mse_loss(model(x), y)


def blocks(args, model) -> list:
    """The repeated blocks: FSDP2's and mpizero stage 3's units (the rest of the model is the root's)."""
    if args.model == "gpt":
        return list(model.transformer.h)
    return [layer for layer in model if hasattr(layer, "weight")]


def describe(args, params: int) -> str:
    """The model in a few words, for the table's title."""
    if args.model == "gpt":
        return (
            f"GPT-2 ({args.layers} blocks of {args.width}, {args.seq} positions, {params:,} parameters), "
            f"{args.batch} sequences a step"
        )
    return f"{args.layers}-layer {args.width}x{args.width} ReLU MLP ({params:,} parameters), global batch {args.batch}"


def parameter_count(args) -> int:
    """The model's parameters (a tied one once)."""
    if args.model == "mlp":
        return args.layers * (args.width * args.width + args.width)
    return sum(p.numel() for p in build(args).parameters())
