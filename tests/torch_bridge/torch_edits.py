"""Parameter edits outside the documented ways, at every stage.

Run: mpiexec -n N python -m mpi4py tests/torch_bridge/torch_edits.py

Rank 0 prints one line per stage, case and rank, ``stage S CASE: OUTCOME`` (every rank's outcomes gathered, so
that no two ranks' lines interleave); the test checks every rank and stage has the same outcome.
"""

import hashlib

import torch
from mpi4py import MPI
from torch_models import batch, loss, make

import mpizero
from mpizero.torch import shard

torch.set_num_threads(1)
comm = MPI.COMM_WORLD


def train_step(model, zero, step):
    x, y = batch("mlp", step, comm.rank)
    loss("mlp", model(x), y).backward()
    zero.step()


def masters_digest(zero) -> str:
    return hashlib.sha256(b"".join(t.tobytes() for t in zero.master_params().values())).hexdigest()[:12]


def outcome(action) -> str:
    try:
        action()
    except mpizero.ZeroError as error:
        return "refused: " + str(error)
    return "done"


def edit_under_no_grad(model):
    with torch.no_grad():
        model[0].weight.mul_(2)


def edit_through_data(model):
    model[2].bias.data.add_(1)


def init_again(model):
    torch.nn.init.zeros_(model[4].weight)


def freeze(model):
    model[0].bias.requires_grad_(False)


def unfreeze(model):
    model[4].bias.requires_grad_(True)  # frozen before shard()


BETWEEN_STEPS = {
    "no_grad edit": edit_under_no_grad,
    ".data edit": edit_through_data,
    "nn.init": init_again,
    "freeze": freeze,
    "unfreeze": unfreeze,
}


def between_steps(stage: int, name: str) -> str:
    """The next step's outcome; for an edit of values, also whether the run goes on as one without the edit once
    ``gathered()`` has shown the masters again (a refused step takes nothing)."""
    model, plain = make("mlp"), make("mlp")
    for m in (model, plain):
        m[4].bias.requires_grad_(False)
    zero = shard(model, mpizero.SGD(lr=0.1), comm=comm, stage=stage)
    zero_plain = shard(plain, mpizero.SGD(lr=0.1), comm=comm, stage=stage)
    train_step(model, zero, 0)
    train_step(plain, zero_plain, 0)
    BETWEEN_STEPS[name](model)
    result = outcome(lambda: train_step(model, zero, 1))
    if name in ("freeze", "unfreeze"):
        return result
    if result == "done":
        train_step(plain, zero_plain, 1)
    else:  # the edit is still shown: refused again, until gathered() shows the masters
        result += "; again: " + outcome(lambda: train_step(model, zero, 1)).split(":")[0]
    with zero.gathered():
        pass
    train_step(model, zero, 2)
    train_step(plain, zero_plain, 2)
    return f"{result}; then as without the edit: {masters_digest(zero) == masters_digest(zero_plain)}"


def inside_gathered(stage: int, how: str) -> str:
    """An edit inside ``gathered()``: without writeback, with an exception inside, or a refused writeback (each
    rank's edit differs); returns the outcome and whether the masters and the next step are as without it."""
    model, plain = make("mlp"), make("mlp")
    zero = shard(model, mpizero.SGD(lr=0.1), comm=comm, stage=stage)
    zero_plain = shard(plain, mpizero.SGD(lr=0.1), comm=comm, stage=stage)
    train_step(model, zero, 0)
    train_step(plain, zero_plain, 0)

    def edit():
        with zero.gathered(writeback=how == "refused writeback"), torch.no_grad():
            model[0].weight.add_(1.0 + comm.rank)
            if how == "exception inside":
                raise KeyError("inside")

    try:
        result = outcome(edit)
    except KeyError:
        result = "KeyError"
    if how == "exception inside":  # the edit is dropped at once: a forward computes as without it
        x, _ = batch("mlp", 1, comm.rank)
        with torch.no_grad():
            result += f"; forward as without the edit: {torch.equal(model(x), plain(x))}"
        # this rank's next step is refused, until gathered() shows the masters
        result += f"; next step refused: {'left `zero.gathered()`' in outcome(lambda: train_step(model, zero, 1))}"
        with zero.gathered():
            pass
    train_step(model, zero, 1)
    train_step(plain, zero_plain, 1)
    same = masters_digest(zero) == masters_digest(zero_plain)
    return f"{result}; then as without the edit: {same}"


def edit_in_forward() -> str:
    """Stage 3 on one host shows the engine's node-shared params inside a forward: an edit there (a pre-hook
    writing through ``.data``) reaches every rank's masters, so the next steps are refused until a load."""
    model = make("mlp")
    zero = shard(model, mpizero.SGD(lr=0.1), comm=comm, stage=3)
    train_step(model, zero, 0)
    saved = zero.state_dict(all_ranks=True)

    def double(module, args) -> None:
        module.weight.data.mul_(2)

    hook = model[0].register_forward_pre_hook(double)
    result = outcome(lambda: train_step(model, zero, 1))
    hook.remove()
    zero.zero_grad()
    result += "; again: " + outcome(lambda: train_step(model, zero, 1)).split(":")[0]
    zero.zero_grad()
    zero.load_state_dict(saved)
    return result + "; after a load: " + outcome(lambda: train_step(model, zero, 2))


outcomes = [f"stage 3 edit in forward: {edit_in_forward()}"]
for stage in range(4):
    for name in BETWEEN_STEPS:
        outcomes.append(f"stage {stage} {name}: {between_steps(stage, name)}")
    for how in ("no writeback", "exception inside", "refused writeback"):
        if how == "refused writeback" and comm.size == 1:
            continue  # one rank's edit is every rank's
        outcomes.append(f"stage {stage} {how}: {inside_gathered(stage, how)}")
everyone = comm.gather(outcomes, root=0)
if comm.rank == 0:
    print("\n".join(line for lines in everyone for line in lines), flush=True)
