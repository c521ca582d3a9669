"""Optimizers on shards equal the optimizer on the full vector, bit for bit."""

import numpy as np
import pytest

from mpizero import SGD, Adam, AdamW, Partition

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
