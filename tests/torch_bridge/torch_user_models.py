"""Models as torch users write them, tiny, with deterministic micro-batches (for tests/torch_bridge/torch_users.py).

Each ``make(kind)`` returns ``(model, units)``: the stage 3 units to pass to
``shard`` (None for the default, ``mpizero.torch.default_units``).
"""

import torch
from torch import nn

# activation checkpointing (torch.utils.checkpoint's, and transformers'), by use_reentrant: the bytes of the kind
# before the underscore
CHECKPOINTED = {"mlp_ac": False, "mlp_ac_reentrant": True, "gpt2_ac": False, "gpt2_ac_reentrant": True}
MODELS = ("tied", "twice", "frozen", "nested", "batchnorm", "autocast", "clip", "mlp", "gpt2", *CHECKPOINTED)
VOCAB, WIDTH, SEQ = 13, 12, 6


class Tied(nn.Module):
    """An embedding whose weight is also the output layer's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))  # (B, T, VOCAB)


class Twice(nn.Module):
    """One block applied twice in a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(7, 9), nn.Linear(9, 9), nn.Linear(9, 3)

    def forward(self, x):
        x = torch.nn.functional.gelu(self.inp(x))
        return self.out(self.block(torch.nn.functional.gelu(self.block(x))))


class Nested(nn.Module):
    """Parameters in a ModuleDict of ModuleLists, and one of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleDict(
            {"enc": nn.ModuleList([nn.Linear(7, 9), nn.Linear(9, 9)]), "dec": nn.ModuleList([nn.Linear(9, 3)])}
        )
        self.bias = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        for layer in self.parts["enc"]:
            x = torch.tanh(layer(x))
        return self.parts["dec"][0](x) + self.bias


class Recomputed(nn.Module):
    """A layer run under ``torch.utils.checkpoint``: its activations recomputed in the backward."""

    def __init__(self, layer: nn.Module, use_reentrant: bool) -> None:
        super().__init__()
        self.layer, self.use_reentrant = layer, use_reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=self.use_reentrant)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(7, 17), nn.GELU(), nn.Linear(17, 11), nn.GELU(), nn.Linear(11, 3))


def gpt2(use_reentrant: bool | None = None):
    """GPT-2 from a config, with transformers' activation checkpointing if ``use_reentrant`` is not None."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    if use_reentrant is not None:
        model.gradient_checkpointing_enable({"use_reentrant": use_reentrant})
    body = model.transformer
    return model, [body.wte, body.wpe, *body.h, body.ln_f]


def make(kind: str, seed: int | None = 0):
    """The model of ``kind``, initialised from ``seed`` (None: from torch's random state as it is), and its
    stage 3 units."""
    if seed is not None:
        torch.manual_seed(seed)
    if kind == "tied":
        return Tied(), None
    if kind == "twice":
        return Twice(), None
    if kind == "frozen":
        model = mlp()
        model[0].requires_grad_(False)  # frozen
        return model, None
    if kind == "nested":
        return Nested(), None
    if kind == "batchnorm":
        return nn.Sequential(nn.Linear(7, 9), nn.BatchNorm1d(9), nn.GELU(), nn.Linear(9, 3)), None
    if kind == "gpt2":
        return gpt2()
    if kind.startswith("gpt2_"):
        return gpt2(CHECKPOINTED[kind])
    if kind in CHECKPOINTED:  # every layer but the first recomputed (a reentrant one needs inputs with gradients)
        model = mlp()
        for index in (2, 4):
            model[index] = Recomputed(model[index], CHECKPOINTED[kind])
        return model, [model[0], model[2].layer, model[4].layer]  # stage 3 units inside the recomputed calls
    return mlp(), None  # mlp, autocast, clip


def tokens_model(kind: str) -> bool:
    return kind == "tied" or kind.startswith("gpt2")


def batch(kind: str, step: int, m: int):
    """Global micro-batch ``m`` of step ``step``: the same on whichever rank computes it."""
    g = torch.Generator().manual_seed(1000 * step + m)
    if tokens_model(kind):
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        return tokens, torch.roll(tokens, 1, dims=1)
    x = torch.randn(4, 7, generator=g)
    return x, torch.tanh(x[:, :3])


def loss(kind: str, out, y):
    if kind.startswith("gpt2"):
        out = out.logits
    if tokens_model(kind):
        return nn.functional.cross_entropy(out.float().reshape(-1, VOCAB), y.reshape(-1))
    return nn.functional.mse_loss(out.float(), y)
