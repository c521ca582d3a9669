"""transformers' Trainer on mpizero (``mpizero.integrations.ZeroTrainer``): examples/hf_trainer.py trains a GPT-2
built from a config to the same bytes at every world size and stage, resumed or not, and saves it for plain
``from_pretrained``; settings that cannot work are refused by name."""

import re

import pytest
from mpirun import run_mpi_ok

torch = pytest.importorskip("torch", reason="mpizero.torch needs torch: add its CPU build (docs/getting-started.md)")
transformers = pytest.importorskip("transformers", reason="ZeroTrainer needs transformers (and accelerate)")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

from mpizero.integrations import ZeroTrainer  # noqa: E402
from mpizero.integrations.trainer_data import SlotSampler  # noqa: E402

EXAMPLE = "examples/hf_trainer.py"


def train(n: int, output_dir, *options: str) -> tuple[str, list]:
    """Run the example at ``n`` ranks; return its digest and its logged losses, norms and rates (rank 0's)."""
    out = run_mpi_ok(n, ["-m", "mpi4py", EXAMPLE, "--output-dir", str(output_dir), *options], timeout=240)
    logged = re.findall(r"'(loss|grad_norm|learning_rate|eval_loss)': '([^']+)'", out)
    return re.search(r"^digest (\w+)$", out, re.M)[1], logged


def test_the_trainer_gives_the_same_bytes_at_1_2_and_4_ranks_stages_2_and_3_and_resumed(tmp_path):
    straight, logs = train(4, tmp_path / "straight", "--stage", "3")
    keys = [key for key, _ in logs]
    assert keys == ["loss", "grad_norm", "learning_rate", "eval_loss"] * 2 + ["eval_loss"], logs  # rank 0's only
    # Interrupted after step 4's checkpoint at 1 rank and stage 2, resumed from it at 2 ranks and stage 3, its units
    # kept gathered through each step.
    interrupted, first_half = train(1, tmp_path / "resumed", "--stage", "2", "--stop-after", "4")
    checkpoint = tmp_path / "resumed" / "checkpoint-4"
    assert {"model.safetensors", "trainer_state.json", "rng_state.pth", "zero"} <= {
        p.name for p in checkpoint.iterdir()
    }
    assert interrupted != straight and first_half[:4] == logs[:4]
    assert train(2, tmp_path / "resumed", "--stage", "3", "--keep-gathered", "--resume") == (straight, logs[4:])


def test_one_rank_trains_as_the_plain_trainer_does(tmp_path):
    """Plain SGD (a gradient twice as big is a step twice as big), 3 micro-batches a step and the Trainer's loss
    normalised by the step's label count, no clipping (the norm measured only), the dataset's order, no dropout:
    ZeroTrainer on one rank is transformers' Trainer, within float32 rounding, in parameters and logged loss."""

    def run(trainer_class, **extra):
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=16, n_positions=8, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.randint(0, 16, (24, 8), generator=torch.Generator().manual_seed(1))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / trainer_class.__name__), max_steps=3, per_device_train_batch_size=2,
            gradient_accumulation_steps=3, optim="sgd", learning_rate=0.5, max_grad_norm=0.0,
            train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", report_to=[],
            disable_tqdm=True,
        )  # fmt: skip
        trainer = trainer_class(model, args, train_dataset=[{"input_ids": x, "labels": x} for x in ids], **extra)
        trainer.train()
        logged = [log[key] for log in trainer.state.log_history if "loss" in log for key in ("loss", "grad_norm")]
        return {name: value.clone() for name, value in model.state_dict().items()}, logged

    plain, plain_logged = run(transformers.Trainer)
    sharded, logged = run(ZeroTrainer, stage=2)
    assert sharded.keys() == plain.keys()
    for name, value in plain.items():
        assert torch.allclose(sharded[name], value, rtol=1e-5, atol=1e-6), name
    assert len(logged) == 6 and logged == pytest.approx(plain_logged, rel=1e-5)


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_walks_every_micro_batch_and_loads_only_its_own(drop_last):
    """23 samples in micro-batches of 2 (the last short), 3 a step, at 1, 2 and 4 ranks."""
    one = list(SlotSampler(23, 2, 3, seed=5, drop_last=drop_last, rank=0, world_size=1))
    assert len(one) == (9 if drop_last else 12) and all(one)
    for n in (2, 4):
        ranks = [SlotSampler(23, 2, 3, seed=5, drop_last=drop_last, rank=r, world_size=n) for r in range(n)]
        walked = [list(sampler) for sampler in ranks]
        assert {len(sampler) for sampler in ranks} == {len(w) for w in walked} == {len(one)}
        for slot, samples in enumerate(one):
            assert [w[slot] for w in walked if w[slot]] == [samples]  # one owner, with one process's samples
    assert not any(walked[3])  # 3 micro-batches a step over 4 ranks: the fourth walks every step with none


@pytest.mark.parametrize(
    "setting, named",
    [
        (
            {"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"},
            "load_best_model_at_end",
        ),
        ({"train_sampling_strategy": "group_by_length"}, "train_sampling_strategy='group_by_length'"),
        ({"include_num_input_tokens_seen": "all"}, "include_num_input_tokens_seen"),
    ],
)
def test_settings_that_cannot_work_are_refused_by_name(setting, named, tmp_path):
    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], **setting)
    with pytest.raises(ValueError, match=f"ZeroTrainer: {re.escape(named)}"):
        ZeroTrainer(transformers.GPT2LMHeadModel(config), args, eval_dataset=[{"input_ids": torch.zeros(8).long()}])
