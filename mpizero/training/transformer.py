"""A small decoder-only transformer in NumPy with hand-written backward.

Units: token and position embedding; ``n_layer`` pre-norm blocks (layer norm,
causal multi-head self-attention, layer norm, GELU MLP, each with a residual);
final layer norm and output head. Shapes: B batch, T time, D width, H heads,
hs = D / H, V vocabulary. The tests check every backward against finite
differences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mpizero.arrays import array_module
from mpizero.training import initial
from mpizero.training.initial import Constant, Normal
from mpizero.training.model import softmax_cross_entropy
from mpizero.training.scatter import sum_rows_by_index

LN_EPS = 1e-5
GELU_C = math.sqrt(2.0 / math.pi)


def layer_norm(x, gain, bias):
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    rstd = 1.0 / array_module(x).sqrt((centred * centred).mean(axis=-1, keepdims=True) + np.float32(LN_EPS))
    normed = centred * rstd
    # the cache keeps a copy: a view of the gain would keep a stage 3 unit's whole gathered buffer alive until backward
    return normed * gain + bias, (normed, rstd, gain.copy())


def layer_norm_backward(dout, cache):
    normed, rstd, gain = cache
    dnormed = dout * gain
    dx = rstd * (
        dnormed - dnormed.mean(axis=-1, keepdims=True) - normed * (dnormed * normed).mean(axis=-1, keepdims=True)
    )
    flat = dout.reshape(-1, dout.shape[-1])
    return dx, (flat * normed.reshape(flat.shape)).sum(axis=0), flat.sum(axis=0)


def gelu(x):
    inner = array_module(x).tanh(np.float32(GELU_C) * (x + np.float32(0.044715) * x * x * x))
    return np.float32(0.5) * x * (1 + inner), inner


def gelu_backward(dout, x, inner):
    dinner = (1 - inner * inner) * np.float32(GELU_C) * (1 + np.float32(3 * 0.044715) * x * x)
    return dout * (np.float32(0.5) * (1 + inner) + np.float32(0.5) * x * dinner)


def linear(x, w, b):
    return x @ w + b  # (..., d_out)


def linear_backward(dout, x, w):
    """Return dx, dw, db of ``x @ w + b``."""
    flat_x, flat_d = x.reshape(-1, x.shape[-1]), dout.reshape(-1, dout.shape[-1])
    return dout @ w.T, flat_x.T @ flat_d, flat_d.sum(axis=0)


@dataclass(frozen=True)
class Embedding:
    name: str
    vocab: int
    block_size: int
    width: int

    def param_shapes(self):
        return {f"{self.name}.tok": (self.vocab, self.width), f"{self.name}.pos": (self.block_size, self.width)}

    def forward(self, tokens, params):
        T = tokens.shape[1]
        return params[f"{self.name}.tok"][tokens] + params[f"{self.name}.pos"][:T], tokens  # (B, T, D)

    def backward(self, dout, tokens, params):
        xp = array_module(dout)
        dtok = sum_rows_by_index(dout.reshape(-1, self.width), tokens, self.vocab)  # not add.at: atomic on CuPy
        dpos = xp.zeros((self.block_size, self.width), dtype=dout.dtype)
        dpos[: tokens.shape[1]] = dout.sum(axis=0)
        return None, {f"{self.name}.tok": dtok, f"{self.name}.pos": dpos}


@dataclass(frozen=True)
class Block:
    name: str
    width: int
    heads: int

    def param_shapes(self):
        d, n = self.width, self.name
        return {
            f"{n}.ln1.g": (d,), f"{n}.ln1.b": (d,),
            f"{n}.attn.w": (d, 3 * d), f"{n}.attn.b": (3 * d,),
            f"{n}.proj.w": (d, d), f"{n}.proj.b": (d,),
            f"{n}.ln2.g": (d,), f"{n}.ln2.b": (d,),
            f"{n}.fc.w": (d, 4 * d), f"{n}.fc.b": (4 * d,),
            f"{n}.out.w": (4 * d, d), f"{n}.out.b": (d,),
        }  # fmt: skip

    def forward(self, x, params):
        p = {k[len(self.name) + 1 :]: v for k, v in params.items() if k.startswith(self.name + ".")}
        h1, ln1 = layer_norm(x, p["ln1.g"], p["ln1.b"])
        attn, attn_cache = self._attention(h1, p)
        x2 = x + linear(attn, p["proj.w"], p["proj.b"])
        h2, ln2 = layer_norm(x2, p["ln2.g"], p["ln2.b"])
        pre = linear(h2, p["fc.w"], p["fc.b"])  # (B, T, 4D)
        act, inner = gelu(pre)
        out = x2 + linear(act, p["out.w"], p["out.b"])
        return out, (h1, ln1, attn_cache, attn, h2, ln2, pre, act, inner)

    def _attention(self, h, p):
        B, T, D = h.shape
        hs = D // self.heads
        xp = array_module(h)
        qkv = linear(h, p["attn.w"], p["attn.b"]).reshape(B, T, 3, self.heads, hs).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (B, H, T, hs)
        scores = (q @ k.transpose(0, 1, 3, 2)) * np.float32(1.0 / math.sqrt(hs))  # (B, H, T, T)
        scores = xp.where(xp.tril(xp.ones((T, T), dtype=bool)), scores, np.float32(-np.inf))
        scores = scores - scores.max(axis=-1, keepdims=True)
        weights = xp.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        y = (weights @ v).transpose(0, 2, 1, 3).reshape(B, T, D)
        return y, (q, k, v, weights)

    def backward(self, dout, cache, params):
        n = self.name
        p = {k[len(n) + 1 :]: v for k, v in params.items() if k.startswith(n + ".")}
        h1, ln1, (q, k, v, weights), attn, h2, ln2, pre, act, inner = cache
        grads = {}
        dact, grads[f"{n}.out.w"], grads[f"{n}.out.b"] = linear_backward(dout, act, p["out.w"])
        dpre = gelu_backward(dact, pre, inner)
        dh2, grads[f"{n}.fc.w"], grads[f"{n}.fc.b"] = linear_backward(dpre, h2, p["fc.w"])
        dln2, grads[f"{n}.ln2.g"], grads[f"{n}.ln2.b"] = layer_norm_backward(dh2, ln2)
        dx2 = dout + dln2
        dattn, grads[f"{n}.proj.w"], grads[f"{n}.proj.b"] = linear_backward(dx2, attn, p["proj.w"])
        B, T, D = dattn.shape
        hs = D // self.heads
        dy = dattn.reshape(B, T, self.heads, hs).transpose(0, 2, 1, 3)  # (B, H, T, hs)
        dweights = dy @ v.transpose(0, 1, 3, 2)
        dv = weights.transpose(0, 1, 3, 2) @ dy
        dscores = weights * (dweights - (dweights * weights).sum(axis=-1, keepdims=True))
        dscores *= np.float32(1.0 / math.sqrt(hs))
        dq, dk = dscores @ k, dscores.transpose(0, 1, 3, 2) @ q
        dqkv = array_module(dq).stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(B, T, 3 * D)
        dh1, grads[f"{n}.attn.w"], grads[f"{n}.attn.b"] = linear_backward(dqkv, h1, p["attn.w"])
        dln1, grads[f"{n}.ln1.g"], grads[f"{n}.ln1.b"] = layer_norm_backward(dh1, ln1)
        return dx2 + dln1, grads


@dataclass(frozen=True)
class Head:
    name: str
    width: int
    vocab: int

    def param_shapes(self):
        return {
            f"{self.name}.ln.g": (self.width,),
            f"{self.name}.ln.b": (self.width,),
            f"{self.name}.w": (self.width, self.vocab),
        }

    def forward(self, x, params):
        h, ln = layer_norm(x, params[f"{self.name}.ln.g"], params[f"{self.name}.ln.b"])
        return h @ params[f"{self.name}.w"], (h, ln)  # (B, T, V)

    def backward(self, dout, cache, params):
        h, ln = cache
        flat_h, flat_d = h.reshape(-1, self.width), dout.reshape(-1, self.vocab)
        dh = dout @ params[f"{self.name}.w"].T
        dx, dg, db = layer_norm_backward(dh, ln)
        return dx, {f"{self.name}.ln.g": dg, f"{self.name}.ln.b": db, f"{self.name}.w": flat_h.T @ flat_d}


@dataclass(frozen=True)
class Transformer:
    """A GPT-style character model: ``n_layer`` blocks of width ``width`` with ``heads`` heads."""

    vocab: int
    block_size: int = 32
    width: int = 32
    heads: int = 4
    n_layer: int = 2

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")

    @property
    def units(self) -> list:
        blocks = [Block(f"h{i}", self.width, self.heads) for i in range(self.n_layer)]
        return [
            Embedding("emb", self.vocab, self.block_size, self.width),
            *blocks,
            Head("head", self.width, self.vocab),
        ]

    def init_rule(self, name: str, shape: tuple[int, ...]) -> Normal | Constant:
        """GPT-2-style initialisation: normal(0, 0.02) matrices, unit gains, zero biases."""
        if name.endswith(".g"):
            return Constant(1.0)
        return Constant(0.0) if len(shape) == 1 else Normal(0.02)

    def init(self, seed: int) -> dict[str, np.ndarray]:
        """The initial float32 parameters, the same on every rank."""
        return initial.full(self, seed)

    def loss(self, logits, targets):
        return softmax_cross_entropy(logits, targets)
