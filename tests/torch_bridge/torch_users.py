"""What torch users bring, at any world size. Run: mpiexec -n N python -m mpi4py tests/torch_bridge/torch_users.py

Models no one here tuned for mpizero (torch_user_models): tied and frozen
weights, a module used twice, ModuleDict/ModuleList nesting, BatchNorm, CPU
autocast in bfloat16, clipping, and a transformers GPT-2 built from a config.
Each trains at stages 0-3, and at stage 3 with units kept gathered through
each step (``keep_gathered=True``, stage ``3k``), with 5 global micro-batches
a step split unevenly over the ranks, under ``join()``: two steps with kept
gradients, one with ``step(closure)``. Rank 0 prints ``digest MODEL STAGE
HEX`` of the masters.
With ``--features``: placeholders, gathered(), state dicts, and mismatched
calls; each prints one ``ok`` line. With ``--default-units``: GPT-2 at
stages 0 and 3 without ``units=``. ``--device cuda`` first: the models and
their batches on the GPU (``launch/gpu_check.sh``: one digest per model there
too, at every stage and world size; not the CPU's, whose matrix products sum
in another order).
"""

import hashlib
import io
import sys
import time

import torch
from mpi4py import MPI
from torch_user_models import MODELS, batch, loss, make

import mpizero
from mpizero.torch import shard

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
MICRO_BATCHES = 5
DEVICE = torch.device("cpu")  # where the models and their batches live (``--device``)


def mine() -> list[int]:
    return list(mpizero.split_evenly(MICRO_BATCHES, comm.size, comm.rank))


def backward(kind, zero, model, step, m):
    x, y = (t.to(DEVICE) for t in batch(kind, step, m))
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=kind == "autocast"):
        out = model(x)
    result = loss(kind, out, y)
    result.backward()
    return result


def train(kind, zero, model, steps=3):
    for step in range(steps):
        if step < steps - 1:
            with zero.join():
                for m in mine():
                    backward(kind, zero, model, step, m)
            if kind == "clip":
                zero.clip_grad_norm_(0.05)
            zero.step()
        else:
            zero.step(lambda step=step: [backward(kind, zero, model, step, m) for m in mine()])


def build(kind, stage, **settings):
    model, units = make(kind)
    model.to(DEVICE)
    return model, shard(model, mpizero.AdamW(lr=1e-2, weight_decay=0.1), stage=stage, units=units, **settings)


def digest(values) -> str:
    h = hashlib.blake2b(digest_size=8)
    for a in values:
        h.update(a.tobytes())
    return h.hexdigest()


def say(text: str) -> None:
    if comm.rank == 0:
        print(text, flush=True)


def check_placeholders():
    """Stage 3: reading a parameter is safe before and after training; state_dict() + torch.save works."""
    model, zero = build("tied", 3)
    for _ in range(2):
        for p in model.parameters():
            assert p.numel() == 0 and float(p.detach().sum()) == 0.0 and p.detach().numpy().size == 0
            str(p)
        torch.save(model.state_dict(), io.BytesIO())
        train("tied", zero, model, steps=1)
    say("placeholders ok")


def check_gathered():
    """Full parameters inside gathered(); writeback=True lands on every rank's shards, bit for bit."""
    for stage in range(4):
        model, zero = build("tied", stage)
        before = zero.master_params()
        with zero.gathered() as full, torch.no_grad():
            assert torch.equal(full.embed.weight, torch.from_numpy(before["embed.weight"]))
            full.embed.weight.mul_(3)
        assert digest(zero.master_params().values()) == digest(before.values()), "change without writeback kept"
        with zero.gathered(writeback=True), torch.no_grad():
            model.embed.weight.mul_(2)
        after = zero.master_params()
        assert (after["embed.weight"] == 2 * before["embed.weight"]).all()
        ranks = comm.allgather(digest(after.values()))
        assert len(set(ranks)) == 1, ranks
        train("tied", zero, model, steps=1)
    say("gathered ok")


def check_state_dicts():
    """state_dict() on rank 0 or all ranks, tied names included; loads at another stage, and in plain torch."""
    model, zero = build("tied", 3)
    train("tied", zero, model, steps=2)
    full = zero.state_dict()
    everywhere = zero.state_dict(all_ranks=True)
    assert (full is None) == (comm.rank != 0)
    assert "head.weight" in everywhere and torch.equal(everywhere["head.weight"], everywhere["embed.weight"])
    plain, _ = make("tied", seed=7)
    plain.load_state_dict(everywhere)
    tokens = batch("tied", 9, 0)[0]
    model.eval()
    with torch.no_grad():
        ours, theirs = model(tokens), plain(tokens)
    assert torch.equal(ours, theirs), "plain torch with the state dict computes other outputs"
    buffer = io.BytesIO()
    torch.save(everywhere, buffer)
    buffer.seek(0)
    for stage in range(4):
        other, zero_other = build("tied", stage, reduction="exact")
        zero_other.load_state_dict(torch.load(buffer, weights_only=True))
        buffer.seek(0)
        masters = zero_other.master_params()
        assert all(torch.equal(torch.from_numpy(masters[n]), everywhere[n]) for n in masters)
    say("state dicts ok")


def check_mismatch():
    """Uneven backward passes at stage 3 without join(): every rank gets the same error, at once."""
    if comm.size == 1:
        say("mismatch ok")
        return
    model, zero = build("mlp", 3)
    started = time.perf_counter()
    try:
        for m in range(2 if comm.rank == 0 else 1):
            backward("mlp", zero, model, 0, m)
        zero.step()
    except mpizero.ZeroError as error:
        assert "join()" in str(error) and "called step()" in str(error), error
        took = time.perf_counter() - started
        assert took < 20, took
    else:
        raise AssertionError("uneven passes without join() raised nothing")
    # A call made on one rank only (torch.save(zero.state_dict()) under `if rank == 0:`): the hint names the call
    # and says to make it on every rank; join() is no fix for it.
    try:
        if comm.rank == 0:
            zero.state_dict()
        zero.step()
    except mpizero.ZeroError as error:
        assert "ranks [0] called state_dict()" in str(error), error
        assert "must be made on every rank, not under `if rank == 0:`" in str(error), error
        assert "join()" not in str(error), error
    else:
        raise AssertionError("a state_dict() on one rank raised nothing")
    # Evaluation at stage 3 on one rank only (`if rank == 0: evaluate()`): its gathers are an evaluation's, told
    # apart from the others' training forward, so the hint is the same, not join().
    model, zero = build("mlp", 3)
    try:
        if comm.rank == 0:
            with torch.no_grad():
                model(batch("mlp", 0, 0)[0])
        backward("mlp", zero, model, 0, comm.rank)
        zero.step()
    except mpizero.ZeroError as error:
        assert "ranks [0] gathered parameters for a forward without gradients" in str(error), error
        assert "must be made on every rank, not under `if rank == 0:`" in str(error), error
        assert "join()" not in str(error), error
    else:
        raise AssertionError("an evaluation on one rank raised nothing")
    # Stage 1: reading p.grad reduces the step's gradients (collective): on every rank it is the averaged one; on
    # rank 0 alone (grad-norm logging under `if rank == 0:`) every rank gets the error naming the read.
    model, zero = build("mlp", 1)
    backward("mlp", zero, model, 0, comm.rank)
    norms = comm.allgather(float(sum(p.grad.norm() ** 2 for p in model.parameters()) ** 0.5))
    assert len(set(norms)) == 1, norms
    zero.step()
    backward("mlp", zero, model, 1, comm.rank)
    try:
        if comm.rank == 0:
            float(model[0].weight.grad.norm())
        zero.step()
    except mpizero.ZeroError as error:
        assert "ranks [0] read a parameter's .grad" in str(error) and "`if rank == 0:`" in str(error), error
    else:
        raise AssertionError("a .grad read on one rank raised nothing")
    # Stages 0-1: forward and backward make no collective call, so uneven passes need no join(), even where the
    # ranks with more start their reductions in their last backward (each start announced, in the same order).
    model, zero = build("mlp", 1)
    count = 2 if comm.rank == 0 else 1
    for m in range(count):
        if m == count - 1:
            zero.last_backward()
        backward("mlp", zero, model, 0, m)
    assert zero.step().step == 1
    assert len(set(comm.allgather(digest(zero.master_params().values())))) == 1
    say(f"mismatch ok: every rank raised after {took:.2f} s")


def check_meta():
    """Models built on the meta device: each rank keeps only its pieces, equal to the model built normally."""
    for kind in ("tied", "twice", "batchnorm"):
        normal, _ = make(kind)
        after_normal = torch.rand(1)
        for stage in range(4):
            torch.manual_seed(0)
            with torch.device("meta"):
                model, _ = make(kind, seed=None)
            zero = shard(model, mpizero.AdamW(lr=1e-2, weight_decay=0.1), stage=stage)
            assert torch.equal(torch.rand(1), after_normal), "the random state differs from a normal build"
            masters = zero.master_params()
            for name, p in normal.named_parameters():
                assert torch.equal(torch.from_numpy(masters[name]), p.detach()), (kind, stage, name)
            for ours, theirs in zip(model.buffers(), normal.buffers()):
                assert torch.equal(ours, theirs), (kind, stage)
            if stage == 3:
                assert zero.engine.memory()["params"] <= 4 * (zero.engine.numel // comm.size + len(zero.engine.groups))
            train(kind, zero, model, steps=1)
    torch.manual_seed(0)
    with torch.device("meta"):
        nested, _ = make("nested", seed=None)
    try:
        shard(nested, mpizero.SGD(lr=0.1), stage=3)
    except ValueError as error:
        assert "['bias']" in str(error) and "init=" in str(error), error
    else:
        raise AssertionError("a meta parameter no module initializes was accepted")
    say("meta ok")


def check_default_units():
    """GPT-2 at stage 3 without units=: each block is a unit, and the bytes are stage 0's."""
    for stage in (0, 3):
        model, _ = make("gpt2")
        zero = shard(model, mpizero.AdamW(lr=1e-2, weight_decay=0.1), stage=stage)
        train("gpt2", zero, model, steps=2)
        say(f"units {stage} {[u.name for u in zero.units]}")
        say(f"digest gpt2 {stage} {digest(zero.master_params().values())}")


def main(argv):
    global DEVICE
    if argv[:1] == ["--device"]:
        DEVICE, argv = torch.device(argv[1]), argv[2:]
    if argv == ["--meta"]:
        check_meta()
        return
    if argv == ["--default-units"]:
        check_default_units()
        return
    if argv == ["--features"]:
        check_placeholders()
        check_gathered()
        check_state_dicts()
        check_mismatch()
        return
    for kind in argv or MODELS:
        for stage, label in [(stage, "") for stage in range(4)] + [(3, "k")]:
            model, zero = build(kind, stage, keep_gathered=label == "k")
            train(kind, zero, model)
            say(f"digest {kind} {stage}{label} {digest(zero.master_params().values())}")


if __name__ == "__main__":
    main(sys.argv[1:])
