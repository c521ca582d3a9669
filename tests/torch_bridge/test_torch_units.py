"""Stage 3's default units: the repeated blocks of a model, and a warning when one unit holds most of it."""

import re
import warnings

import pytest
from mpirun import run_mpi_ok

torch = pytest.importorskip("torch", reason="mpizero.torch needs torch: add its CPU build (docs/getting-started.md)")
import torch_models  # noqa: E402
from torch import nn  # noqa: E402

import mpizero  # noqa: E402
from mpizero.torch import default_units, shard  # noqa: E402
from mpizero.torch.units import plan_units  # noqa: E402

HAS_TRANSFORMERS = True
try:
    import transformers
except ImportError:
    HAS_TRANSFORMERS = False
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers: pip install transformers")
SMALL = {"vocab_size": 64, "max_position_embeddings": 16, "num_hidden_layers": 2, "num_attention_heads": 2}


def unit_names(model: nn.Module) -> list[str]:
    return [u.name for u in plan_units(model, default_units(model))]


def test_the_blocks_of_a_module_list_are_the_units_and_tied_weights_are_owned_once():
    model = torch_models.make("transformer")
    units = plan_units(model, default_units(model))
    assert [u.name for u in units] == ["<model>", "blocks.0", "blocks.1"]
    assert units[0].owned == ("pos", "embed.weight", "norm.weight", "norm.bias")
    owned = [n for u in units for n in u.owned]
    assert sorted(owned) == sorted(n for n, _ in model.named_parameters())


def test_a_container_inside_a_container_is_looked_into_as_in_nanogpt():
    """nanoGPT's ``transformer = ModuleDict(wte, wpe, h=ModuleList([...]), ln_f)``: each block a unit, not the list
    (a ModuleList has no forward of its own for a unit's hooks)."""

    class NanoGPT(nn.Module):
        def __init__(self):
            super().__init__()
            blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(3))
            self.transformer = nn.ModuleDict(
                dict(wte=nn.Embedding(16, 8), wpe=nn.Embedding(4, 8), h=blocks, ln_f=nn.LayerNorm(8))
            )
            self.lm_head = nn.Linear(8, 16, bias=False)

    names = unit_names(NanoGPT())
    assert names == [
        "<model>",
        "transformer.wte",
        "transformer.wpe",
        *(f"transformer.h.{i}" for i in range(3)),
        "transformer.ln_f",
    ], names


def test_a_sequential_of_one_repeated_class_is_blocks_and_a_model_without_blocks_takes_its_children():
    stem = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    mixed = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    model = nn.ModuleDict({"stem": nn.Embedding(3, 4), "body": stem, "mixed": mixed})
    assert unit_names(model) == ["<model>", "body.0", "body.2", "body.4"]  # mixed: not repeated blocks, so in the model
    assert unit_names(nn.Sequential(nn.Embedding(3, 4), mixed)) == ["0", "1"]


@needs_transformers
def test_hugging_face_gpt2_llama_and_bert_from_configs_get_one_unit_per_layer():
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    )
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_key_value_heads=2, **SMALL)
    )
    bert = transformers.BertForMaskedLM(transformers.BertConfig(hidden_size=32, intermediate_size=64, **SMALL))
    assert unit_names(gpt2) == ["<model>", "transformer.h.0", "transformer.h.1"]
    assert unit_names(llama) == ["<model>", "model.layers.0", "model.layers.1"]
    assert unit_names(bert) == ["<model>", "bert.encoder.layer.0", "bert.encoder.layer.1"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shard(gpt2, mpizero.SGD(lr=0.1), stage=3)
    assert not [w for w in caught if "units=" in str(w.message)]


def wrapped() -> nn.Module:
    """Most parameters in one child without a ModuleList, as a ``*LMHeadModel``'s ``transformer``."""
    model, model.body = nn.Module(), nn.Module()
    model.body.a, model.body.b, model.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 2)
    return model


def test_a_unit_holding_most_parameters_is_warned_of_at_stage_3_naming_units():
    with pytest.warns(UserWarning, match=r"unit 'body' \(Module\) holds 544 of the 578 parameters \(94%\).*units="):
        shard(wrapped(), mpizero.SGD(lr=0.1), stage=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shard(wrapped(), mpizero.SGD(lr=0.1), stage=2)  # units only matter at stage 3


@needs_transformers
def test_gpt2_at_stage_3_without_units_is_sharded_by_block_to_stage_0s_bytes():
    out = run_mpi_ok(2, ["-m", "mpi4py", "tests/torch_bridge/torch_users.py", "--default-units"], timeout=120)
    assert "units 3 ['<model>', 'transformer.h.0', 'transformer.h.1']" in out, out
    found = dict(re.findall(r"^digest gpt2 (\d) (\w+)$", out, re.M))
    assert found.keys() == {"0", "3"} and found["3"] == found["0"], out
