"""Optimizers on shards equal the optimizer on the full vector, bit for bit, and mean what torch.optim documents."""

import dataclasses

import numpy as np
import pytest

from mpizero import SGD, Adam, AdamW, Partition
from mpizero.core import torch_semantics
from mpizero.core.torch_semantics import DocumentedOptimizer

OPTIMIZERS = [
    SGD(lr=0.1),
    SGD(lr=0.05, momentum=0.9, weight_decay=0.01),
    Adam(lr=1e-2, weight_decay=0.01),
    AdamW(lr=1e-2),
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("world", [2, 3, 7])
def test_shard_updates_equal_full_update(optimizer, world):
    rng = np.random.default_rng(world)
    numel = 257
    full = rng.standard_normal(numel).astype(np.float32)
    full_state = {n: np.zeros(numel, np.float32) for n in optimizer.state_names}
    part = Partition(numel, world)
    shards = [full[slice(*part.data_range(r))].copy() for r in range(world)]
    shard_states = [{n: np.zeros(len(s), np.float32) for n in optimizer.state_names} for s in shards]
    for step in range(1, 6):
        grad = (rng.standard_normal(numel) * 10.0 ** rng.integers(-6, 3)).astype(np.float32)
        optimizer.update(full, grad, full_state, step)
        for r, (shard, state) in enumerate(zip(shards, shard_states)):
            optimizer.update(shard, grad[slice(*part.data_range(r))].copy(), state, step)
    assert np.concatenate(shards).tobytes() == full.tobytes()
    for name in optimizer.state_names:
        assert np.concatenate([s[name] for s in shard_states]).tobytes() == full_state[name].tobytes()


def test_optimizer_moves_parameters_downhill():
    p = np.array([1.0, -2.0], dtype=np.float32)
    state = {n: np.zeros(2, np.float32) for n in Adam().state_names}
    Adam(lr=0.1).update(p, np.array([1.0, -1.0], dtype=np.float32), state, 1)
    assert p.tolist() == pytest.approx([0.9, -1.9])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: SGD(lr=-0.1), "lr must be in"),
        (lambda: SGD(lr=0.1, momentum=1.5), "momentum"),
        (lambda: Adam(betas=(0.9, 1.0)), r"betas\[1\]"),
        (lambda: AdamW(eps=float("nan")), "eps"),
    ],
)
def test_bad_hyperparameters_name_the_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# torch.optim's documented algorithms (mpizero.core.torch_semantics), the independent oracle verify uses.


DOCUMENTED = {"sgd": SGD(lr=0.05, momentum=0.9, weight_decay=0.01), "adam": Adam(lr=1e-2, weight_decay=0.01)}
DOCUMENTED["adamw"] = AdamW(lr=1e-2)


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_optimizers_follow_torch_documented_algorithm_over_many_steps(name):
    optimizer = DOCUMENTED[name]
    rng = np.random.default_rng(7)
    param = rng.standard_normal(257).astype(np.float32)
    state = {n: np.zeros(257, np.float32) for n in optimizer.state_names}
    documented = DocumentedOptimizer(name, {"p": param}, dataclasses.asdict(optimizer), clip_norm=None)
    for step in range(1, 51):
        grad = rng.standard_normal(257).astype(np.float32)
        optimizer.update(param, grad, state, step)
        documented.step({"p": grad})
    expected = documented.params["p"]
    assert np.max(np.abs(param - expected)) / np.max(np.abs(expected)) < 1e-5


def test_documented_adam_first_step_moves_each_element_by_lr():
    theta, g = np.array([1.0, -2.0]), np.array([3.0, -1e-3])
    moved = torch_semantics.adam(theta, g, {}, 1, lr=0.1, betas=(0.9, 0.999), eps=0.0)
    assert moved.tolist() == pytest.approx([0.9, -1.9])


def test_documented_weight_decay_is_coupled_in_adam_and_decoupled_in_adamw():
    theta, zero, hyper = np.array([2.0]), np.zeros(1), dict(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    coupled = torch_semantics.adam(theta, zero, {}, 1, **hyper)
    decoupled = torch_semantics.adamw(theta, zero, {}, 1, **hyper)
    assert coupled.tolist() == pytest.approx([1.9])  # lambda * theta is normalised like a gradient: a step of lr
    assert decoupled.tolist() == pytest.approx([1.98])  # theta * (1 - lr * lambda); the moments stay 0


def test_documented_sgd_momentum_buffer_starts_at_the_first_gradient():
    state, theta = {}, np.array([1.0])
    theta = torch_semantics.sgd(theta, np.array([1.0]), state, 1, lr=0.1, momentum=0.9)
    theta = torch_semantics.sgd(theta, np.array([1.0]), state, 2, lr=0.1, momentum=0.9)
    assert state["b"].tolist() == pytest.approx([1.9]) and theta.tolist() == pytest.approx([1.0 - 0.1 - 0.19])


def test_documented_clip_coefficient_is_torch_clip_grad_norm():
    grads = {"a": np.array([3.0]), "b": np.array([[4.0]])}
    assert torch_semantics.clip_coefficient(grads, 1.0) == 1.0 / (5.0 + 1e-6)
    assert torch_semantics.clip_coefficient(grads, 10.0) == 1.0
