"""mpizero.torch.StepSampler: each rank's micro-batches of every step through a DataLoader, with their indices in
the step's global batch, the same samples at any world size."""

import pytest

torch = pytest.importorskip("torch", reason="mpizero.torch needs torch: add its CPU build (docs/getting-started.md)")
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from mpizero.torch import StepSampler  # noqa: E402

DATASET = TensorDataset(torch.arange(50).float().unsqueeze(1))  # sample i is the number i


def global_steps(world_size: int, **settings) -> list[dict[int, list[int]]]:
    """Every step's micro-batches by global index, gathered from every rank's loader."""
    steps: list[dict[int, list[int]]] = []
    for rank in range(world_size):
        sampler = StepSampler(len(DATASET), rank=rank, world_size=world_size, **settings)
        loader = DataLoader(DATASET, batch_sampler=sampler)
        for step, micro in enumerate(sampler.steps(loader)):
            if step == len(steps):
                steps.append({})
            for index, (x,) in micro:
                assert index not in steps[step], (rank, step, index)
                steps[step][index] = x.squeeze(1).int().tolist()
    return steps


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_world_size_sees_the_same_micro_batches_under_the_same_indices(drop_last):
    settings = dict(micro_batch_size=4, micro_batches=3, seed=7, drop_last=drop_last)
    one = global_steps(1, **settings)
    assert all(global_steps(n, **settings) == one for n in (2, 3, 4, 5))
    assert all(sorted(step) == list(range(len(step))) for step in one)  # indices 0.. in each step's global batch
    drawn = [s for step in one for batch in step.values() for s in batch]
    if drop_last:  # 50 samples, 12 a step: 4 whole steps, 2 samples dropped
        assert len(one) == 4 and len(drawn) == 48 == len(set(drawn))
    else:  # the last step: 2 samples, one short micro-batch, and only one rank has it
        assert len(one) == 5 and sorted(drawn) == list(range(50)) and one[-1] == {0: one[-1][0]}
        assert len(one[-1][0]) == 2


def test_the_order_is_a_seeded_permutation_per_epoch_or_the_datasets():
    sampler = StepSampler(len(DATASET), 5, 2, rank=0, world_size=1, seed=1)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first and sorted(sum(list(sampler), [])) == list(range(50))
    sampler.set_epoch(0)
    assert list(sampler) == first == list(StepSampler(len(DATASET), 5, 2, rank=0, world_size=1, seed=1))
    in_order = StepSampler(len(DATASET), 5, 2, shuffle=False, rank=1, world_size=2)
    assert list(in_order)[:2] == [[5, 6, 7, 8, 9], [15, 16, 17, 18, 19]] and len(in_order) == 5


@pytest.mark.parametrize(
    "settings, fragment",
    [
        (dict(dataset_size=0, micro_batch_size=1, micro_batches=1), "dataset_size must be an int >= 1, got 0"),
        (dict(dataset_size=5, micro_batch_size=2.0, micro_batches=1), "micro_batch_size must be an int >= 1"),
        (dict(dataset_size=5, micro_batch_size=2, micro_batches=0), "micro_batches (per step, over all ranks)"),
        (dict(dataset_size=5, micro_batch_size=2, micro_batches=1, rank=2), "give rank and world_size together"),
        (dict(dataset_size=5, micro_batch_size=2, micro_batches=1, rank=2, world_size=2), "rank 2 is not one of"),
    ],
)
def test_bad_settings_are_named(settings, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        StepSampler(**settings)
