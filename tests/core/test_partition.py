import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpizero import STAGES, FlatLayout, Partition, split_evenly
from mpizero.core.stages import sharding

sizes = st.integers(min_value=0, max_value=10_000)
worlds = st.integers(min_value=1, max_value=64)
aligns = st.integers(min_value=1, max_value=16)


@given(sizes, worlds, aligns)
def test_shards_tile_the_padded_buffer(numel, world, align):
    p = Partition(numel, world, align)
    ranges = [p.shard_range(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == p.padded_numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(stop - start == p.shard_numel for start, stop in ranges)
    assert p.shard_numel % align == 0
    assert 0 <= p.padding < world * align + world
    assert p.padded_numel >= numel


@given(sizes, worlds, aligns)
def test_data_ranges_cover_every_real_element_once(numel, world, align):
    p = Partition(numel, world, align)
    covered = [i for r in range(world) for i in range(*p.data_range(r))]
    assert covered == list(range(numel))
    assert sum(p.shard_padding(r) for r in range(world)) == p.padding


@given(st.integers(1, 5000), worlds, aligns, st.data())
def test_owner_agrees_with_shard_range(numel, world, align, data):
    p = Partition(numel, world, align)
    index = data.draw(st.integers(0, p.padded_numel - 1))
    start, stop = p.shard_range(p.owner(index))
    assert start <= index < stop


def test_fewer_elements_than_ranks_leaves_ranks_with_only_padding():
    p = Partition(3, 8)
    assert p.shard_numel == 1 and p.padding == 5
    assert [p.shard_padding(r) for r in range(8)] == [0, 0, 0, 1, 1, 1, 1, 1]


def test_worked_example_at_three_ranks_pads_to_nine():
    p = Partition(8, 3)
    assert (p.padded_numel, p.shard_numel, p.shard_range(2), p.data_range(2)) == (9, 3, (6, 9), (6, 8))


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(numel=-1, world_size=2), "numel must be >= 0, got -1"),
        (dict(numel=4, world_size=0), "world_size must be >= 1, got 0"),
        (dict(numel=4, world_size=2, align=0), "align must be >= 1, got 0"),
    ],
)
def test_bad_partition_names_the_value(bad, message):
    with pytest.raises(ValueError, match=message):
        Partition(**bad)


def test_out_of_range_queries_raise():
    p = Partition(10, 4)
    with pytest.raises(IndexError, match="rank 4"):
        p.shard_range(4)
    with pytest.raises(IndexError, match="index 12"):
        p.owner(12)


@given(st.integers(0, 200), st.integers(1, 20))
def test_split_evenly_partitions_the_items(total, parts):
    blocks = [split_evenly(total, parts, i) for i in range(parts)]
    assert [i for b in blocks for i in b] == list(range(total))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_stage_table_shards_more_at_each_stage():
    rows = [STAGES[s] for s in range(4)]
    assert [(r.optimizer, r.grads, r.params) for r in rows] == [
        (False, False, False),
        (True, False, False),
        (True, True, False),
        (True, True, True),
    ]
    with pytest.raises(ValueError, match="got 5"):
        sharding(5)


def test_layout_views_and_locate():
    layout = FlatLayout.from_shapes({"w": (2, 3), "b": (3,)})
    assert layout.numel == 9 and [s.offset for s in layout.specs] == [0, 6]
    assert layout.locate(4) == ("w", (1, 1))
    assert layout.locate(7) == ("b", (1,))
    assert layout.locate(10) == ("<padding>", (1,))
    assert [(i, spec.name, lo, hi) for i, spec, lo, hi in layout.overlaps(4, 12)] == [(0, "w", 4, 6), (1, "b", 6, 9)]
    assert layout.overlaps(9, 12) == []
    import numpy as np

    flat = np.arange(9.0)
    views = layout.views(flat)
    assert views["w"].shape == (2, 3) and views["b"].tolist() == [6.0, 7.0, 8.0]


@given(st.integers(2**31, 2**40), st.integers(1, 4096), st.integers(1, 64))
def test_sizes_past_32_bit_indexing(numel, world, align):
    p = Partition(numel, world, align)
    last_start, last_stop = p.shard_range(world - 1)
    assert last_stop == p.padded_numel >= numel and p.owner(numel - 1) == (numel - 1) // p.shard_numel
    layout = FlatLayout.from_shapes({"a": (numel,), "b": (2**20, 2**14)})
    assert layout.locate(numel + 5) == ("b", (0, 5)) and layout.numel == numel + 2**34
