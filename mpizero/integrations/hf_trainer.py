"""``ZeroTrainer``: transformers' ``Trainer`` with its model and optimizer sharded by mpizero, run under ``mpiexec``.

Every rank runs its own Trainer, which believes it is alone (no torch.distributed): mpizero is the distribution,
and a run trains to the same bytes at any world size and stage, as one process would train it:

- data: a step's global batch is ``gradient_accumulation_steps`` micro-batches of ``per_device_train_batch_size``
  samples, dealt over the ranks (``trainer_data``); each runs under ``zero.micro_batch(index)``, inside
  ``zero.join()``. The ranks share the global batch: more ranks do not make it bigger;
- loss: not divided by the accumulation steps (the step averages every backward). A loss normalised by the step's
  label count (``num_items_in_batch``) counts every rank's labels and is multiplied back by the step's
  micro-batches; the logged loss is summed over every micro-batch of every rank, in order;
- clipping (``max_grad_norm``), the optimizer step and the scheduler go through the sharded model;
- checkpoints: ``checkpoint-N/`` holds the model (``save_pretrained``, gathered, written by rank 0), the sharded
  training state in ``checkpoint-N/zero/`` (every rank writes its shard) and the Trainer's state and random state
  (rank 0); ``train(resume_from_checkpoint=...)`` resumes from it at any world size and stage;
- logging, saving and callbacks happen on rank 0 (``is_world_process_zero``); evaluation runs on every rank, over
  the whole evaluation set (stage 3 gathers each unit collectively), and gives every rank the same metrics.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from contextlib import ExitStack
from functools import partial

import numpy as np
import torch
from mpi4py import MPI
from transformers import Trainer, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints, seed_worker
from transformers.training_args import ParallelMode
from transformers.utils import is_datasets_available

from mpizero.errors import ZeroError
from mpizero.integrations.trainer_data import EpochLoader, OwnedCollate, Slot, SlotSampler
from mpizero.torch import ShardedModel, shard

ZERO_DIR = "zero"  # the sharded training state inside each checkpoint-N/


class ZeroTrainer(Trainer):
    """``Trainer(model, args, train_dataset=..., ...)`` sharded at ZeRO ``stage`` over ``comm`` (default COMM_WORLD).

    ``units``: the submodules stage 3 gathers together (default: the model's repeated blocks, as ``shard``);
    ``keep_gathered``: keep them gathered through each step (as ``shard``'s).
    Every rank builds the same model and passes the same arguments; settings that cannot work here are refused
    at construction, alike on every rank, naming them.
    """

    def __init__(
        self,
        model=None,
        args: TrainingArguments | None = None,
        *rest,
        stage: int = 2,
        units: Sequence[torch.nn.Module] | None = None,
        keep_gathered: bool = False,
        comm: MPI.Comm | None = None,
        **kwargs,
    ) -> None:
        self.comm = MPI.COMM_WORLD if comm is None else comm
        if args is not None and args.use_cpu and self.comm.Get_size() > 1:
            raise ValueError(
                "ZeroTrainer: use_cpu=True makes accelerate start torch.distributed under mpiexec; leave it False "
                "(without a GPU the Trainer runs on the CPU anyway), or hide the GPUs (CUDA_VISIBLE_DEVICES=)"
            )
        super().__init__(model, args, *rest, **kwargs)
        self.stage, self.units, self.keep_gathered = stage, None if units is None else list(units), keep_gathered
        self.zero: ShardedModel | None = None
        self._joined = ExitStack()  # the step's zero.join(), entered at its first micro-batch, left at its last
        self._step_losses = np.zeros(0)
        problem = unsupported(self)
        if problem is not None:
            raise ValueError(f"ZeroTrainer: {problem}")

    # Whose work -------------------------------------------------------------

    def is_world_process_zero(self) -> bool:
        return self.comm.Get_rank() == 0

    def is_local_process_zero(self) -> bool:
        """Rank 0 only: one rank prints the progress and the logs."""
        return self.comm.Get_rank() == 0

    # Model and optimizer ----------------------------------------------------

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """The Trainer's optimizer (or the one given), with the model sharded on it (once per model)."""
        optimizer = super().create_optimizer(model)
        if self.zero is None or self.zero.model is not self.model:
            self.zero = shard(
                self.model,
                optimizer,
                stage=self.stage,
                comm=self.comm,
                units=self.units,
                seed=self.args.seed,
                keep_gathered=self.keep_gathered,
            )
        return optimizer

    # Data -------------------------------------------------------------------

    def get_train_dataloader(self) -> EpochLoader:
        """Every micro-batch of each epoch in one seeded order, this rank's loaded (``trainer_data``)."""
        dataset, collate = self.train_dataset, self.data_collator
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError(
                "ZeroTrainer: the train_dataset must have a length and be indexable (a map-style dataset): each "
                "step's micro-batches are dealt to the ranks by index"
            )
        if is_hf_dataset(dataset):  # as the Trainer drops the columns the model's forward does not take
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        args = self.args
        sampler = SlotSampler(
            len(dataset),
            self._train_batch_size,
            args.gradient_accumulation_steps,
            shuffle=args.train_sampling_strategy != "sequential",
            seed=args.seed if args.data_seed is None else args.data_seed,
            drop_last=args.dataloader_drop_last,
            rank=self.comm.Get_rank(),
            world_size=self.comm.Get_size(),
        )
        return EpochLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=OwnedCollate(collate),
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            prefetch_factor=args.dataloader_prefetch_factor,
            in_order=args.dataloader_in_order,
            worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers, rank=self.comm.Get_rank()),
        )

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device) -> tuple[list, object]:
        """The step's micro-batches as ``Slot``s, and its label count over every rank (None if not counted)."""
        batches = list(itertools.islice(epoch_iterator, num_batches))
        owned = [b for b in batches if b is not None]
        mine = self._get_num_items_in_batch(owned, device) if owned else None
        facts = np.array(
            [0.0 if mine is None else float(mine), owned != [] and mine is not None, owned != [] and mine is None]
        )
        total, counted, uncounted = self.zero.engine.collectives.agree(facts)
        if counted and uncounted:
            raise ZeroError("ZeroTrainer: some ranks' batches have labels to count (num_items_in_batch), others not")
        items = torch.tensor(total, dtype=torch.float32, device=device) if counted else None
        return [Slot(index, len(batches), batch) for index, batch in enumerate(batches)], items

    # One micro-batch ----------------------------------------------------------

    def training_step(self, model, inputs: Slot, num_items_in_batch=None) -> torch.Tensor:
        """Run micro-batch ``inputs.index`` of the step if this rank owns it; the step's last returns the step's
        loss over every rank (the others 0), so the Trainer's running loss is the same on every rank."""
        if inputs.index == 0:
            self._step_losses = np.zeros(inputs.count)
            self._joined.enter_context(self.zero.join())
        if inputs.batch is not None:
            self._step_losses[inputs.index] = self._backward(model, inputs, num_items_in_batch)
        if inputs.index < inputs.count - 1:
            return torch.zeros((), device=self.args.device)
        self._joined.close()
        losses = self.zero.engine.collectives.allreduce_array(self._step_losses, MPI.SUM, "the step's losses")
        return torch.tensor(float(losses.sum()), device=self.args.device)  # one rank's value per entry: exact

    def _backward(self, model, slot: Slot, num_items_in_batch) -> float:
        """Forward and backward of this rank's micro-batch, keyed to its index; return its share of the step's loss."""
        model.train()
        inputs = self._prepare_inputs(slot.batch)
        normalised = self._loss_is_normalised(num_items_in_batch)
        with self.zero.micro_batch(slot.index):
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            # The step averages every backward: a loss already divided by the step's count comes back up.
            (loss * slot.count if normalised else loss).backward()
        return loss.item() if normalised else loss.item() / slot.count

    def _loss_is_normalised(self, num_items_in_batch) -> bool:
        """Whether the loss is over the whole step's labels (the Trainer then does not divide it by the steps)."""
        if self.loss_is_scaled_for_ga is not None:
            return self.loss_is_scaled_for_ga
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None

    def floating_point_ops(self, inputs: Slot) -> int:
        return 0 if inputs.batch is None else super().floating_point_ops(inputs.batch)

    def store_flos(self) -> None:
        """Count every rank's floating-point operations (collective)."""
        self.current_flos = self.zero.engine.collectives.allreduce_value(self.current_flos, MPI.SUM, "the flos")
        super().store_flos()

    # The step -----------------------------------------------------------------

    def _clip_grad_norm(self, model) -> float:
        """Clip by the exact global norm, in the engine; return the norm before."""
        return self.zero.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None) -> float:
        """The step's gradient norm: the clipped one, or measured without clipping."""
        return self.zero.clip_grad_norm_(math.inf) if grad_norm is None else grad_norm

    # Checkpoints --------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """``save_pretrained`` of the full model: gathered on every rank (collective), written by rank 0."""
        if state_dict is None and self.zero is not None:
            state_dict = self.zero.state_dict()
        if self.is_world_process_zero():
            super()._save(output_dir, state_dict=state_dict)

    def _save_checkpoint(self, model, trial) -> None:
        """``checkpoint-N/``: the model (rank 0), the sharded training state in ``zero/`` (every rank's shard),
        then the Trainer's state and random state (rank 0). Collective."""
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.store_flos()
        self.save_model(output_dir, _internal_call=True)
        if not self.args.save_only_model:
            self.zero.save(os.path.join(output_dir, ZERO_DIR), scheduler=self.lr_scheduler)
        if not self.is_world_process_zero():
            return
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
        if self.state.best_global_step and os.path.exists(best):  # rank 0's alone: it rotates the checkpoints
            self.state.best_model_checkpoint = best
        if not self.args.save_only_model:
            self._save_rng_state(output_dir)  # rank 0's, which every rank takes back on resuming
        for callback in [*self.callback_handler.callbacks, self.control]:  # as the Trainer's own
            if isinstance(callback, ExportableState):
                name, held = type(callback).__name__, self.state.stateful_callbacks
                held[name] = [*held[name], callback.state()] if isinstance(held[name], list) else callback.state()
        self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))
        rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Nothing yet: the weights come back with the sharded training state, once the model is sharded
        (``_load_optimizer_and_scheduler``)."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Restore the masters, the optimizer, its groups and the scheduler from ``checkpoint/zero/`` (collective)."""
        if checkpoint is not None:
            self.zero.load(os.path.join(checkpoint, ZERO_DIR), scheduler=self.lr_scheduler)


def is_hf_dataset(dataset) -> bool:
    """Whether ``dataset`` is a ``datasets.Dataset`` (whose columns the Trainer prunes itself)."""
    if not is_datasets_available():
        return False
    import datasets

    return isinstance(dataset, datasets.Dataset)


def unsupported(trainer: Trainer) -> str | None:
    """The first setting of ``trainer`` that cannot work on mpizero, in words, or None (the same on every rank)."""
    args = trainer.args
    refused = {
        "launched by torchrun or accelerate (torch.distributed): launch with mpiexec, mpizero is the distribution": (
            args.parallel_mode == ParallelMode.DISTRIBUTED or args.world_size > 1
        ),
        f"{args.n_gpu} GPUs in one process (DataParallel): give each rank one GPU": args.n_gpu > 1,
        "deepspeed or fsdp: mpizero shards the model": bool(args.deepspeed or args.fsdp),
        "fp16 (a gradient scaler): gradients go straight into the engine; use bf16 or float32": args.fp16,
        f"train_sampling_strategy={args.train_sampling_strategy!r}: 'random' or 'sequential'": (
            args.train_sampling_strategy not in ("random", "sequential")
        ),
        "auto_find_batch_size: every rank must train the same batches": args.auto_find_batch_size,
        "load_best_model_at_end: load the best checkpoint with train(resume_from_checkpoint=...)": (
            args.load_best_model_at_end
        ),
        "include_num_input_tokens_seen: each rank counts only its own tokens": (
            args.include_num_input_tokens_seen not in ("no", False)
        ),
        "push_to_hub: push the saved model from rank 0 yourself": args.push_to_hub,
    }
    return next((problem for problem, found in refused.items() if found), None)
