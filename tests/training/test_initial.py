"""The built-in models' initial values made piece by piece (``initial.sharded``): the bits of the whole build."""

import contextlib
import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpizero.training import initial
from mpizero.training.mlp import MLP
from mpizero.training.model import param_shapes
from mpizero.training.transformer import Transformer

MODELS = {
    "verify mlp": MLP((13, 31, 29, 5)),
    "digits mlp": MLP((64, 128, 128, 10), "xent"),
    "verify transformer": Transformer(11, 8, 16, 2, 2),
    "text transformer": Transformer(65, 32, 64, 4, 2),
}
# sha256 (first 16 hex digits) of names and bytes of ``init(seed)`` as the models built them before ``initial``
# existed (each drew from ``default_rng([seed, 0])`` in its own loop): train's and verify's runs keep their bytes
BEFORE = {
    ("verify mlp", 0): "7a3ddfb9f132444d",
    ("digits mlp", 3): "ec66f573546e93ac",
    ("verify transformer", 0): "d36ed089b933f441",
    ("text transformer", 5): "ae98af42988062ff",
}


def digest(params: dict) -> str:
    h = hashlib.sha256()
    for name, values in params.items():
        h.update(name.encode())
        h.update(values.tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("model, seed", BEFORE)
def test_the_whole_build_is_what_it_was(model, seed):
    assert digest(MODELS[model].init(seed)) == BEFORE[model, seed]


def pieces(shapes: dict, data) -> list[tuple[str, int, int]]:
    """Every tensor cut at drawn points, the pieces in a drawn order (the engine asks in group order)."""
    cut = []
    for name, shape in shapes.items():
        numel = int(np.prod(shape))
        edges = sorted(set(data.draw(st.lists(st.integers(1, numel - 1), max_size=3)) if numel > 1 else []))
        cut += [(name, a, b) for a, b in zip([0, *edges], [*edges, numel])]
    return data.draw(st.permutations(cut))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(MODELS)), st.sampled_from([1, 5, 64, 1 << 20]), st.data())
def test_pieces_in_any_order_have_the_bits_of_the_whole_build(name, checkpoint, data):
    """With kept states every few draws (1, 5, 64) or every 2**20, pieces asked in any order, again included."""
    model = MODELS[name]
    whole, source = model.init(4), initial.sharded(model, 4)
    asked = pieces(param_shapes(model), data)
    with checkpoints_every(checkpoint):
        for tensor, start, stop in [*asked, *asked[:3]]:
            made = source.fill(tensor, start, stop)
            assert made.dtype == np.float32 and made.tobytes() == whole[tensor].reshape(-1)[start:stop].tobytes()


@contextlib.contextmanager
def checkpoints_every(draws: int):
    """Keep the generator's state every ``draws`` draws inside the block."""
    saved, initial.CHECKPOINT = initial.CHECKPOINT, draws
    try:
        yield
    finally:
        initial.CHECKPOINT = saved


def test_a_model_past_a_checkpoint_is_made_in_backward_order_as_stages_0_to_2_ask():
    model = MLP((64, 1100, 1000, 10))  # 1.18M draws: past the first kept state
    whole, source = model.init(1), initial.sharded(model, 1)
    for tensor in reversed(param_shapes(model)):
        assert source.fill(tensor, 0, whole[tensor].size).tobytes() == whole[tensor].tobytes(), tensor
    assert len(source.fill.states) == 2


def test_the_initializer_names_the_model_and_seed():
    source = initial.sharded(MODELS["verify transformer"], 7)
    assert source.identity == "Transformer(vocab=11, block_size=8, width=16, heads=2, n_layer=2).init(7)"
    assert source.shapes == param_shapes(MODELS["verify transformer"])
