"""Sharded initialization without MPI: philox_normal's ranges, the fill contract, what FlatGroup asks for, digests."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpizero import ShardedInit, philox_normal
from mpizero.core import digest
from mpizero.core.group import FlatGroup
from mpizero.core.layout import FlatLayout
from mpizero.core.partition import Partition
from mpizero.core.sharded_init import BLOCK, FillError, checked_fill, tensor_key
from mpizero.core.stages import STAGES, ShardPlan

AWKWARD = (1, 2, 3, 17, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 3)  # tensors that end inside, at and past blocks
SHAPES = {f"t{numel}": (numel,) for numel in AWKWARD} | {"m": (3, 5, 7)}
INIT = philox_normal(SHAPES, seed=11)
FULL = {name: INIT.fill(name, 0, int(np.prod(shape))) for name, shape in SHAPES.items()}


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(SHAPES)), st.data())
def test_any_range_has_the_bits_of_the_whole_tensor(name, data):
    numel = FULL[name].size
    start = data.draw(st.integers(0, numel - 1))
    stop = data.draw(st.integers(start + 1, numel))
    assert INIT.fill(name, start, stop).tobytes() == FULL[name][start:stop].tobytes()


def test_ranges_cut_at_block_edges_and_pairs_have_the_bits_of_the_whole():
    name, numel = f"t{2 * BLOCK + 3}", 2 * BLOCK + 3
    for cut in (1, 2, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, numel - 1):
        pieces = np.concatenate([INIT.fill(name, 0, cut), INIT.fill(name, cut, numel)])
        assert pieces.tobytes() == FULL[name].tobytes(), cut


def test_element_i_is_drawn_from_word_i_of_one_philox_stream():
    """The blocks' counters continue one stream: Box-Muller on the words of Philox from counter 0, by hand."""
    name, numel = f"t{2 * BLOCK + 3}", 2 * BLOCK + 3
    words = np.random.Generator(np.random.Philox(key=tensor_key(11, name))).random(numel + 1)
    radius, angle = np.sqrt(-2 * np.log1p(-words[0::2])), 2 * np.pi * words[1::2]
    normals = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1).reshape(-1)[:numel]
    assert (normals * 0.02 + 0.0).astype(np.float32).tobytes() == FULL[name].tobytes()


def test_values_are_normal_with_the_given_std_and_differ_by_name_and_seed():
    values = FULL[f"t{2 * BLOCK + 3}"]
    assert abs(float(values.mean())) < 5 * 0.02 / np.sqrt(values.size)
    assert abs(float(values.std()) / 0.02 - 1) < 0.01
    assert values.dtype == np.float32
    assert not np.array_equal(FULL[f"t{BLOCK}"][:100], values[:100])
    other = philox_normal(SHAPES, seed=12).fill("m", 0, 105)
    assert not np.array_equal(other, FULL["m"])


def test_per_tensor_std_and_mean_give_exact_constants_where_std_is_zero():
    shapes = {"g": (5,), "b": (5,), "w": (4, 4)}
    init = philox_normal(shapes, 0, std={"g": 0, "b": 0, "w": 0.5}, mean={"g": 1, "b": 0, "w": 0})
    assert init.fill("g", 0, 5).tolist() == [1.0] * 5
    assert init.fill("b", 1, 4).tobytes() == np.zeros(3, np.float32).tobytes()
    assert np.array_equal(init.fill("w", 0, 16), philox_normal(shapes, 0, std=0.5).fill("w", 0, 16))
    assert "seed=0" in init.identity and "'w': 0.5" in init.identity
    with pytest.raises(ValueError, match=r"std gives no value for tensors \['b'\]"):
        philox_normal(shapes, 0, std={"g": 0, "w": 1})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shapes": {}}, "non-empty dict"),
        ({"shapes": {"w": (3, 0)}}, "positive ints"),
        ({"shapes": {"w": 3}}, "positive ints"),
        ({"fill": None}, "callable"),
        ({"identity": ""}, "non-empty string"),
        ({"device": "tpu"}, "device must be one of"),
    ],
)
def test_sharded_init_refuses_bad_fields_naming_them(kwargs, message):
    fields = {"shapes": {"w": (2, 3)}, "fill": lambda n, a, b: np.zeros(b - a, np.float32), "identity": "zeros"}
    with pytest.raises(ValueError, match=message):
        ShardedInit(**(fields | kwargs))


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (lambda n: np.zeros(n + 1, np.float32), r"returned shape \[5\], expected \[4\]"),
        (lambda n: np.zeros(n, np.float64), "returned dtype float64, expected float32"),
        (lambda n: np.zeros((n, 1), np.float32), r"returned shape \[4, 1\], expected \[4\]"),
        (lambda n: [0.0] * n, "returned a builtins.list, expected a numpy.ndarray"),
        (lambda n: 1 / 0, "raised ZeroDivisionError: division by zero"),
    ],
)
def test_checked_fill_names_the_call_and_what_is_wrong(returned, message):
    init = ShardedInit({"w": (8,)}, lambda name, start, stop: returned(stop - start), "bad")
    with pytest.raises(FillError, match=r"fill\('w', 2, 6\) " + message):
        checked_fill(init, np)("w", 2, 6)


class Recorder:
    """A fill that slices known arrays and records every call."""

    def __init__(self, full):
        self.full, self.calls = full, []

    def __call__(self, name, start, stop):
        self.calls.append((name, start, stop))
        return self.full[name].reshape(-1)[start:stop]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(STAGES)), st.integers(1, 7), st.data())
def test_group_asks_only_for_what_the_rank_holds_in_layout_order(stage, world, data):
    shapes = {"a": (3, 4), "b": (5,), "c": (2, 2, 2)}
    full = {n: np.arange(np.prod(s), dtype=np.float32).reshape(s) + 100 * i for i, (n, s) in enumerate(shapes.items())}
    layout = FlatLayout.from_shapes(shapes)
    rank = data.draw(st.integers(0, world - 1))
    plan = ShardPlan(STAGES[stage], Partition(layout.numel, world, data.draw(st.integers(1, 3))), rank)
    recorder = Recorder(full)
    group = FlatGroup(layout, plan, np, np.float32, recorder)
    start, stop = plan.params_range
    expected = [(s.name, lo - s.offset, hi - s.offset) for _, s, lo, hi in layout.overlaps(start, stop)]
    assert recorder.calls == expected
    if not plan.gathers_params:
        assert [name for name, *_ in recorder.calls] == list(shapes)  # whole tensors
        assert all(b - a == full[n].size for n, a, b in recorder.calls)
    flat = np.concatenate([full[n].reshape(-1) for n in shapes] + [np.zeros(plan.partition.padding, np.float32)])
    owned = plan.owned_range
    assert group.master_shard.tobytes() == flat[owned[0] : owned[1]].tobytes()
    shard = plan.shard_range
    assert group.param_shard.tobytes() == flat[shard[0] : shard[1]].tobytes()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=6), st.permutations(range(7)))
def test_digest_of_pieces_is_the_digest_of_the_whole(cuts, order):
    values = np.random.default_rng(1).standard_normal(300).astype(np.float32)
    edges = [0, *sorted(cuts), 300]
    pieces = [("w", a, values[a:b]) for a, b in zip(edges, edges[1:])]
    shuffled = [pieces[i] for i in order if i < len(pieces)]
    parts = [digest.partial([p]) for p in shuffled]
    assert digest.combine(parts) == digest.combine([digest.partial([("w", 0, values)])])


def test_digest_changes_with_any_one_bit_and_with_the_name():
    values = np.random.default_rng(2).standard_normal(70000).astype(np.float32)
    whole = digest.combine([digest.partial([("w", 0, values)])])
    for index in (0, 1, 12345, 69999):
        for bit in (0, 17, 31):
            changed = values.copy()
            changed.view(np.uint32)[index] ^= np.uint32(1 << bit)
            assert digest.combine([digest.partial([("w", 0, changed)])]) != whole, (index, bit)
    assert digest.combine([digest.partial([("v", 0, values)])]) != whole
    negative_zero = digest.partial([("z", 0, np.array([-0.0], np.float32))])
    assert digest.combine([negative_zero]) != digest.combine([digest.partial([("z", 0, np.zeros(1, np.float32))])])
