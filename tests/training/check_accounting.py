"""Measured bytes and traffic against the formulas, at any world size.

Run: mpiexec -n N python -m mpi4py tests/training/check_accounting.py
For both models, every stage, fp32 and bf16, exact and native: the bytes the
engine holds after a step equal ``formulas.engine_bytes`` kind by kind
(padding included), a step's traffic equals ``formulas.traffic_per_step``, and
in elements it is the paper's 2 Psi (stages 0-2) or 3 Psi (stage 3) times (N-1)/N;
stage 3 with units kept gathered through the step (``keep_gathered``) gathers
each once a step, and holds every unit's full params at its peak (``kept_bytes``).
Under ``MPIZERO_REDUCE_SCATTER=mpi`` the exact rounds of stages 2-3 travel as
float32: 4 bytes an element on the wire, not 8.
"""

import numpy as np
from mpi4py import MPI

from mpizero import Adam, ZeroEngine
from mpizero.core import formulas
from mpizero.core.precision import PRECISIONS
from mpizero.core.stages import STAGES, groups_by_unit
from mpizero.training.mlp import MLP, regression_batch
from mpizero.training.trainer import Trainer, make_groups
from mpizero.training.transformer import Transformer

comm = MPI.COMM_WORLD
size = comm.Get_size()
MICRO_BATCHES = size  # one round per step, as the paper's count assumes
rounds = 1
mlp = MLP((13, 31, 29, 5))
transformer = Transformer(vocab=11, block_size=8, width=16, heads=2, n_layer=2)


def batch(model, step, m):
    if model is mlp:
        return regression_batch(mlp.widths, 0, step, m, 4)
    tokens = np.random.default_rng([step, m]).integers(0, 11, size=(4, 9))
    return tokens[:, :-1], tokens[:, 1:]


for model in (mlp, transformer):
    for precision_name in ("fp32", "bf16"):
        for reduction in ("exact", "native"):
            for stage, kept in [(stage, False) for stage in STAGES] + [(3, True)]:
                precision = PRECISIONS[precision_name]
                engine = ZeroEngine(
                    model.init(0),
                    Adam(lr=1e-3),
                    comm=comm,
                    groups=make_groups(model, stage, 300),
                    stage=stage,
                    reduction=reduction,
                    param_dtype=precision.param_dtype.name,
                )
                trainer = Trainer(model, engine, precision, keep_gathered=kept)
                trainer.step(lambda m, model=model: batch(model, 1, m), MICRO_BATCHES)
                engine.collectives.traffic.clear()
                trainer.step(lambda m, model=model: batch(model, 2, m), MICRO_BATCHES)
                setup = formulas.formula_setup(engine, kept)
                held = engine.memory()
                assert held == formulas.engine_bytes(setup), (stage, precision_name, reduction, held)
                sent = engine.collectives.traffic.sent
                predicted = formulas.traffic_per_step(setup, rounds)
                assert {op: sent[op] for op in predicted} == predicted, (stage, dict(sent), predicted)
                # the paper's claim, in elements of the padded buffers: 2 Psi, or 3 Psi at stage 3 (one round)
                padded = sum(p.padded_numel for p in setup.partitions())
                plan = setup.plans()[0]
                scatter_bytes = formulas.reduce_scatters(setup, plan, rounds)[1] / plan.partition.padded_numel
                if sent["reduce_scatter"]:  # the exact rounds off shared memory (stages 2-3): float32 on the wire
                    off_shared = reduction == "exact" and stage >= 2 and not setup.shared_memory
                    assert scatter_bytes == (4 if off_shared else setup.wire_bytes), (stage, reduction, scatter_bytes)
                elements = sent["reduce_scatter"] / scatter_bytes + sent["allreduce"] / setup.wire_bytes
                elements += sent["allgather"] / setup.param_bytes
                if size > 1:
                    expected = formulas.paper_traffic_elements(padded, size, 2 if kept else stage)  # kept: 1 gather
                    assert abs(elements - expected) <= len(setup.group_numels) * 2, (stage, elements, expected)
                peak = engine.memory_report()["peak"]
                if kept:  # every group's full params (none where read in place: on one host, shared)
                    assert peak["gathered"] == formulas.kept_bytes(setup), (peak, formulas.kept_bytes(setup))
                elif groups_by_unit(stage):
                    two_largest = sorted(p.padded_numel for p in setup.partitions())[-2:]
                    if engine.groups[0].node_params is None:  # one host: read in place, nothing gathered
                        assert 0 < peak["gathered"] <= sum(two_largest) * setup.param_bytes
                    else:
                        assert peak["gathered"] == 0
                else:
                    assert peak["gathered"] == 0
if comm.Get_rank() == 0:
    print("accounting ok")
