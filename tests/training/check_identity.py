"""Train both models at every stage in fp32, bf16 and fp16; print one digest line per run.

Run: mpiexec -n N python -m mpi4py tests/training/check_identity.py
The caller compares the lines across world sizes: they must be identical. Stage
``3k`` is stage 3 with units kept gathered through each step (``keep_gathered``).
Also asserts that stage 3 never holds more than two units' full parameters
(every unit's, once, when kept).
"""

import hashlib

import numpy as np
from mpi4py import MPI

from mpizero import AdamW, ZeroEngine
from mpizero.core.precision import PRECISIONS
from mpizero.core.stages import STAGES, sharding
from mpizero.training.datasets import Corpus, Digits
from mpizero.training.mlp import MLP
from mpizero.training.model import param_shapes
from mpizero.training.trainer import Trainer, make_groups
from mpizero.training.transformer import Transformer

comm = MPI.COMM_WORLD
MICRO_BATCHES, SIZE, STEPS = 4, 6, 3
digits, corpus = Digits.load(), Corpus.load()
MODELS = {
    "mlp": (MLP((64, 24, 24, 10), objective="xent"), lambda s, m: digits.micro_batch(1, s, m, SIZE, MICRO_BATCHES)),
    "transformer": (
        Transformer(len(corpus.alphabet), block_size=8, width=16, heads=2, n_layer=2),
        lambda s, m: corpus.micro_batch(1, s, m, SIZE, 8),
    ),
}

for name, (model, batch) in MODELS.items():
    for precision_name in ("fp32", "bf16", "fp16"):
        for stage, kept in [(stage, False) for stage in STAGES] + [(3, True)]:
            precision = PRECISIONS[precision_name]
            engine = ZeroEngine(
                model.init(7),
                AdamW(lr=1e-2),
                comm=comm,
                groups=make_groups(model, stage, bucket_elems=700),
                stage=stage,
                clip_norm=0.5,
                **precision.engine_settings(),
            )
            trainer = Trainer(model, engine, precision, keep_gathered=kept)
            for step in range(1, STEPS + 1):
                trainer.step(lambda m, step=step, batch=batch: batch(step, m), MICRO_BATCHES)
            if kept:
                assert engine.peak_gathered_groups == len(engine.groups), (name, engine.peak_gathered_groups)
            else:
                assert engine.peak_gathered_groups <= 2, (name, stage, engine.peak_gathered_groups)
            if sharding(stage).params and not kept:
                assert engine.peak_gathered_groups == 2, "stage 3 should prefetch the next unit"
            master = engine.master_params()
            in_model_order = [master[k] for k in param_shapes(model)]
            digest = hashlib.sha256(b"".join(np.ascontiguousarray(v).tobytes() for v in in_model_order)).hexdigest()
            if comm.Get_rank() == 0:
                print(f"{name} {precision_name} stage {stage}{'k' if kept else ''} {digest}", flush=True)
