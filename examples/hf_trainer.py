# Run: mpiexec -n 4 python -m mpi4py examples/hf_trainer.py --output-dir out   (or plain `python examples/...`)
#      ended early (--stop-after 4), it resumes at any world size and stage: mpiexec -n 2 python -m mpi4py
#      examples/hf_trainer.py --output-dir out --stage 3 --resume
"""transformers' Trainer on mpizero: a standard ``Trainer`` loop, sharded, the same bytes at any world size.

A GPT-2 built from a config (no download) learns the bytes of Python's own ``textwrap.py`` through
``ZeroTrainer``: AdamW with the Trainer's decay groups, warm-up then cosine decay, gradient accumulation,
clipping, dropout, an evaluation and a checkpoint every few steps, and ``save_model`` at the end. Rank 0 loads
the saved model back with plain ``from_pretrained`` and prints its digest: every world size and stage prints the
same one, and so does a run resumed from its checkpoint.
"""

import argparse
import hashlib
import os
import sysconfig

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from mpizero.integrations import ZeroTrainer


class ByteWindows(torch.utils.data.Dataset):
    """``count`` windows of ``length`` bytes of ``text``, at seeded places; each is its own labels (GPT-2 shifts)."""

    def __init__(self, text: bytes, count: int, length: int, seed: int) -> None:
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        starts = torch.randint(0, len(data) - length, (count,), generator=torch.Generator().manual_seed(seed))
        self.windows = torch.stack([data[s : s + length] for s in starts.tolist()])

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.windows[index], "labels": self.windows[index]}


class StopAfter(TrainerCallback):
    """End training after step ``step``, as a crash right after that step's checkpoint would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop |= state.global_step == self.step


def build_model(width: int, layers: int, length: int) -> GPT2LMHeadModel:
    """GPT-2 from a config, the same on every rank (same seed): the 256 byte values are its vocabulary."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256, n_positions=length, n_embd=width, n_layer=layers, n_head=4, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def units_of(model: GPT2LMHeadModel) -> list:
    """Stage 3's units: the embeddings, each block, the final norm (the tied head belongs to the embedding)."""
    return [model.transformer.wte, model.transformer.wpe, *model.transformer.h, model.transformer.ln_f]


def digest(model: torch.nn.Module) -> str:
    """sha256 of the model's parameters and buffers, name by name."""
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
    return sha.hexdigest()


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument(
        "--keep-gathered", action="store_true", help="stage 3: keep each unit gathered through a step (across hosts)"
    )
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=3, help="micro-batches per step, shared by the ranks")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--length", type=int, default=32, help="bytes per sample")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--every", type=int, default=4, help="evaluate and save a checkpoint every so many steps")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--stop-after", type=int, default=None, help="end after this step, as if interrupted")
    return parser.parse_args(argv)


def main(argv=None) -> str:
    args = parse(argv)
    torch.set_num_threads(1)  # one thread per rank: ranks x threads must not exceed the cores
    text = open(os.path.join(sysconfig.get_paths()["stdlib"], "textwrap.py"), "rb").read()
    model = build_model(args.width, args.layers, args.length)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,  # a micro-batch
        gradient_accumulation_steps=args.accumulation,  # the global batch, whatever the world size
        learning_rate=3e-3,
        weight_decay=0.1,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        max_grad_norm=1.0,
        eval_strategy="steps",
        eval_steps=args.every,
        save_steps=args.every,
        logging_steps=args.every,
        report_to=[],
        disable_tqdm=True,  # the logs, one line each, on rank 0
        seed=0,
    )
    trainer = ZeroTrainer(
        model,
        training,
        train_dataset=ByteWindows(text, 96, args.length, seed=1),
        eval_dataset=ByteWindows(text, 8, args.length, seed=2),
        stage=args.stage,
        keep_gathered=args.keep_gathered,
        units=units_of(model),
        callbacks=[StopAfter(args.stop_after)] if args.stop_after else None,
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)  # gathered on every rank, written by rank 0
    metrics = trainer.evaluate()  # on every rank: stage 3 gathers each unit collectively
    if trainer.is_world_process_zero():
        print(f"eval_loss {metrics['eval_loss']:.6f}")
        print("digest", digest(GPT2LMHeadModel.from_pretrained(final)), flush=True)
    return final


if __name__ == "__main__":
    main()
