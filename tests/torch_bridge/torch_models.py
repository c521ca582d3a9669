"""Small torch models with odd parameter counts, and deterministic micro-batches, for mpizero.torch tests."""

import torch
from torch import nn

VOCAB, WIDTH, SEQ = 13, 12, 6


class TinyTransformer(nn.Module):
    """Embedding, two encoder layers, LayerNorm, a head tied to the embedding; a parameter and a buffer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, WIDTH))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, 3, 20, dropout=0.0, activation="gelu", batch_first=True) for _ in range(2)
        )
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, tokens):
        x = self.embed(tokens) * self.scale + self.pos  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, T, VOCAB)


def make(kind: str, seed: int = 0) -> nn.Module:
    """``mlp`` (7-17-11-3, GELU) or ``transformer``, initialised from ``seed``."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(7, 17), nn.GELU(), nn.Linear(17, 11), nn.GELU(), nn.Linear(11, 3))
    return TinyTransformer()


def batch(kind: str, step: int, m: int):
    """Global micro-batch ``m`` of step ``step``: the same on whichever rank computes it."""
    g = torch.Generator().manual_seed(1000 * step + m)
    if kind == "mlp":
        x = torch.randn(4, 7, generator=g)
        return x, torch.tanh(x[:, :3])
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return tokens, torch.roll(tokens, 1, dims=1)


def loss(kind: str, out, y):
    if kind == "mlp":
        return nn.functional.mse_loss(out, y)
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
