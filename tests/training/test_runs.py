"""Groups as runs of alike ones: the same groups ``make_groups`` makes, found without listing every unit."""

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from mpizero.training.registry import Size, entry
from mpizero.training.runs import Run, group_runs
from mpizero.training.trainer import make_groups


class Unit:
    def __init__(self, index: int, tensors: tuple[int, ...]) -> None:
        self.index, self.tensors = index, tensors

    def param_shapes(self) -> dict:
        return {f"u{self.index}.t{j}": (n,) for j, n in enumerate(self.tensors)}


class Model:
    """A model whose units hold the given tensor sizes: enough for ``make_groups``."""

    def __init__(self, units: list[tuple[int, ...]]) -> None:
        self.units = [Unit(i, tensors) for i, tensors in enumerate(units)]


def listed(model, stage: int, bucket_elems: int) -> Counter:
    """``make_groups``'s groups, each as its tensors' sizes, counted."""
    sizes = {name: shape[0] for unit in model.units for name, shape in unit.param_shapes().items()}
    return Counter(tuple(sizes[name] for name in group) for group in make_groups(model, stage, bucket_elems))


def counted(runs: list[Run]) -> Counter:
    total = Counter()
    for run in runs:
        total[run.tensors] += run.count
    return total


runs = st.lists(
    st.builds(Run, st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), st.integers(0, 40)),
    min_size=1,
    max_size=4,
)


@settings(max_examples=400, deadline=None)
@given(units=runs, stage=st.sampled_from([0, 1, 2, 3]), bucket_elems=st.integers(1, 70))
def test_group_runs_are_make_groups_counted(units, stage, bucket_elems):
    model = Model([run.tensors for run in units for _ in range(run.count)])
    assert counted(group_runs(units, stage, bucket_elems)) == listed(model, stage, bucket_elems)


def test_each_models_unit_runs_are_its_units():
    for name, size in [("mlp", Size(17, 5)), ("mlp", Size(None, 1)), ("transformer", Size(16, 3, 2, 8))]:
        task = entry(name, size)
        data = task.load()
        model = task.build(data)
        units = [tuple(map(math.prod, u.param_shapes().values())) for u in model.units]
        assert [t for run in task.unit_runs(data) for t in [run.tensors] * run.count] == units, name
        for stage in (0, 2, 3):
            assert counted(group_runs(task.unit_runs(data), stage, 300)) == listed(Model(units), stage, 300)


def test_ten_million_alike_units_take_no_time():
    import time

    start = time.perf_counter()
    found = group_runs([Run((3, 5), 1), Run((7, 2, 4), 10**7), Run((1,), 1)], 2, 1000)
    assert time.perf_counter() - start < 1.0
    assert sum(sum(run.tensors) * run.count for run in found) == 8 + 13 * 10**7 + 1
