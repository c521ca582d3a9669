"""The node-shared sum's kernel: the compiled pass gives NumPy's int64 sum, wrapping included."""

import numpy as np
import pytest

from mpizero import compiled
from mpizero.comm import shared


@pytest.mark.parametrize("count", [2, 3, 4])
def test_the_compiled_block_sum_gives_numpys_wrapping_int64_sum(count, monkeypatch):
    """Blocks not a multiple of the kernel's 4096, at an offset, with values whose sum wraps past int64."""
    rng = np.random.default_rng(count)
    views = [rng.integers(-(2**63), 2**63 - 1, 10_007, dtype=np.int64) for _ in range(count)]
    for view, wraps in zip(views, ([2**63 - 1, -(2**63)], [1, -1])):
        view[1_000:1_002] = wraps
    for view in views[2:]:
        view[1_000:1_002] = 0
    if shared._compiled_sum() is None:
        pytest.skip("no compiled host kernel here")
    summed, expected = np.empty(9_000, np.int64), np.empty(9_000, np.int64)
    shared.sum_block(views, 1_000, summed)
    monkeypatch.setenv(compiled.ENV_VAR, "numpy")
    shared._compiled_sum.cache_clear()
    shared.sum_block(views, 1_000, expected)
    shared._compiled_sum.cache_clear()
    assert summed.tobytes() == expected.tobytes()
    assert summed[:2].tolist() == [-(2**63), 2**63 - 1]  # past int64's ends, wrapped
