"""Parameter edits outside the documented ways, at every stage.

Run: mpiexec -n N python -m mpi4py tests/torch_bridge/torch_edits.py

Rank 0 prints one line per stage, case and rank, ``stage S CASE: OUTCOME`` (every rank's outcomes gathered, so
that no two ranks' lines interleave); the test checks every rank and stage has the same outcome.
"""

import hashlib
import shutil
import tempfile

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


def unchanged_in_place(model):
    with torch.no_grad():
        model[0].weight.mul_(1.0)  # counted by torch's version counter; no byte changes


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
    "unchanged in-place op": unchanged_in_place,
    "nn.init": init_again,
    "freeze": freeze,
    "unfreeze": unfreeze,
}


def between_steps(stage: int, name: str) -> str:
    """The next step's outcome; for an edit of values, also whether the run goes on as one without the edit once
    ``gathered()`` has shown the masters again (a refused step takes nothing), or, where the module's tensors are
    the masters themselves (stage 0 in float32), once a state dict saved before the edit is loaded."""
    model, plain = make("mlp"), make("mlp")
    for m in (model, plain):
        m[4].bias.requires_grad_(False)
    zero = shard(model, mpizero.SGD(lr=0.1), comm=comm, stage=stage)
    zero_plain = shard(plain, mpizero.SGD(lr=0.1), comm=comm, stage=stage)
    train_step(model, zero, 0)
    train_step(plain, zero_plain, 0)
    saved = zero.state_dict(all_ranks=True)
    BETWEEN_STEPS[name](model)
    result = outcome(lambda: train_step(model, zero, 1))
    if name in ("freeze", "unfreeze"):
        return result
    if result == "done":
        train_step(plain, zero_plain, 1)
    else:  # the edit is still shown: refused again, until gathered() shows the masters
        result += "; again: " + outcome(lambda: train_step(model, zero, 1)).split(":")[0]
    shown = word(lambda: show(zero))
    if shown != "done":  # the edit reached the masters (stage 0 in float32): a load undoes it
        result += f"; gathered(): {shown}; step: {word(lambda: train_step(model, zero, 1))}"
        zero.load_state_dict(saved)
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


def pair(stage: int, param_dtype: str = "float32"):
    """A model and a plain twin, sharded alike, each one step in; the model's state dict then, on every rank."""
    model, plain = make("mlp"), make("mlp")
    zero = shard(model, mpizero.SGD(lr=0.1), comm=comm, stage=stage, param_dtype=param_dtype)
    zero_plain = shard(plain, mpizero.SGD(lr=0.1), comm=comm, stage=stage, param_dtype=param_dtype)
    train_step(model, zero, 0)
    train_step(plain, zero_plain, 0)
    return model, zero, plain, zero_plain, zero.state_dict(all_ranks=True)


def word(action) -> str:
    """``outcome`` in one word: done or refused."""
    return outcome(action).split(":")[0]


def show(zero, writeback=False, grads=False) -> None:
    with zero.gathered(writeback=writeback, grads=grads):
        pass


def go_on(model, zero, plain, zero_plain, result: str) -> str:
    """One more step each; whether the masters are as without the edit."""
    train_step(model, zero, 2)
    train_step(plain, zero_plain, 2)
    return f"{result}; then as without the edit: {masters_digest(zero) == masters_digest(zero_plain)}"


def edit_then_gathered(stage: int, param_dtype: str = "float32") -> str:
    """An edit, a backward, then ``gathered(grads=True)`` before the step: dropped there at stage 3, and where the
    module's tensors are copies of the masters (16-bit params); at stages 0-2 in float32 (the module's tensors hold
    the masters) refused on entry and at the step, and kept by an agreed writeback (every rank made the same edit;
    the twin makes it inside ``gathered(writeback=True)``)."""
    model, zero, plain, zero_plain, _ = pair(stage, param_dtype)
    edit_under_no_grad(model)
    x, y = batch("mlp", 1, comm.rank)
    loss("mlp", model(x), y).backward()
    result = outcome(lambda: show(zero, grads=True))
    if result == "done":  # dropped: the step refuses gradients computed with it
        result += "; step: " + outcome(zero.step)
        if not result.endswith("; step: done"):
            show(zero)
            train_step(model, zero, 1)
        train_step(plain, zero_plain, 1)
    else:
        result += "; step: " + word(zero.step)
        result += "; writeback: " + word(lambda: show(zero, writeback=True))
        with zero_plain.gathered(writeback=True):
            edit_under_no_grad(plain)
        result += "; step: " + word(lambda: train_step(model, zero, 1))
        train_step(plain, zero_plain, 1)
    return go_on(model, zero, plain, zero_plain, result)


def step_raising_before_its_check(stage: int) -> str:
    """An edit, then a step that raises before it checks for edits (a closure after backward passes already
    handed in): the edit is still refused at the next step."""
    model, zero, plain, zero_plain, saved = pair(stage)
    edit_under_no_grad(model)
    x, y = batch("mlp", 1, comm.rank)
    loss("mlp", model(x), y).backward()
    result = word(lambda: zero.step(lambda: None)) + "; next step: " + word(lambda: train_step(model, zero, 1))
    if zero.binder.shows_masters:  # the edit is in the masters: a load undoes it
        zero.load_state_dict(saved)
    else:
        show(zero)
    train_step(model, zero, 1)
    train_step(plain, zero_plain, 1)
    return go_on(model, zero, plain, zero_plain, result)


def step_and_load_inside_gathered(stage: int) -> str:
    """A step inside ``gathered()``, then a load inside another: both are kept on leaving (no writeback). Stage 3
    refuses the step (inside the block its parameters show gathered tensors, not the placeholders)."""
    model, zero, plain, zero_plain, saved = pair(stage)

    def step_inside():
        with zero.gathered():
            train_step(model, zero, 1)

    result = word(step_inside)
    if result != "done":
        show(zero)
        train_step(model, zero, 1)
    train_step(plain, zero_plain, 1)
    result += f"; step kept: {masters_digest(zero) == masters_digest(zero_plain)}"
    train_step(model, zero, 2)
    with zero.gathered():
        zero.load_state_dict(zero_plain.state_dict(all_ranks=True))
    return go_on(model, zero, plain, zero_plain, result)


def read_out_after_an_edit(stage: int) -> str:
    """``state_dict()``, ``master_params()`` and ``save()`` after an edit: they read the masters, which hold
    the edit at stage 0 in float32 (refused there), and not elsewhere."""
    model, zero, plain, zero_plain, saved = pair(stage)
    edit_under_no_grad(model)
    directory = comm.bcast(tempfile.mkdtemp() if comm.rank == 0 else None)
    said = [
        word(lambda: zero.state_dict(all_ranks=True)),
        word(zero.master_params),
        word(lambda: zero.save(directory)),
    ]
    if comm.rank == 0:
        shutil.rmtree(directory)
    if zero.binder.shows_masters:
        zero.load_state_dict(saved)
    else:
        show(zero)
    train_step(model, zero, 1)
    train_step(plain, zero_plain, 1)
    return go_on(model, zero, plain, zero_plain, ", ".join(said))


def new_data(stage: int) -> str:
    """A new ``.data`` with other values (the masters untouched): refused, and dropped by ``gathered()``."""
    model, zero, plain, zero_plain, _ = pair(stage)
    model[2].bias.data = model[2].bias.data + 1
    result = outcome(lambda: train_step(model, zero, 1))
    show(zero)
    if result != "done":
        train_step(model, zero, 1)
    train_step(plain, zero_plain, 1)
    return go_on(model, zero, plain, zero_plain, result)


def refused_after_clip(stage: int) -> str:
    """An edit, a backward, ``clip_grad_norm_`` (which reduces), then the step: refused; once the edit is
    dropped (or loaded over), the next step is taken, not refused for the earlier edit."""
    model, zero, plain, zero_plain, saved = pair(stage)
    edit_under_no_grad(model)
    x, y = batch("mlp", 1, comm.rank)
    loss("mlp", model(x), y).backward()
    zero.clip_grad_norm_(1.0)
    result = word(zero.step)
    if zero.binder.shows_masters:
        zero.load_state_dict(saved)
    else:
        show(zero)
    result += "; next step: " + word(lambda: train_step(model, zero, 1))
    train_step(plain, zero_plain, 1)
    return go_on(model, zero, plain, zero_plain, result)


def read_out_inside_gathered(stage: int) -> str:
    """An edit inside ``gathered()``, then ``master_params()`` there (refused at stage 0 in float32, where the
    masters hold the edit meanwhile): leaving the block drops the edit, and the next step is taken."""
    model, zero, plain, zero_plain, _ = pair(stage)
    with zero.gathered():
        edit_under_no_grad(model)
        result = word(zero.master_params)
    result += "; step: " + word(lambda: train_step(model, zero, 1))
    train_step(plain, zero_plain, 1)
    return go_on(model, zero, plain, zero_plain, result)


def writeback_after_backward(stage: int) -> str:
    """Every rank's same edit, a backward with it, then ``gathered(writeback=True)``: the edit is kept, so the
    gradients computed with it are the step's (the twin makes the edit inside the block, before its backward)."""
    model, zero, plain, zero_plain, _ = pair(stage)
    edit_under_no_grad(model)
    x, y = batch("mlp", 1, comm.rank)
    loss("mlp", model(x), y).backward()
    show(zero, writeback=True)
    result = word(zero.step)
    with zero_plain.gathered(writeback=True):
        edit_under_no_grad(plain)
    train_step(plain, zero_plain, 1)
    return f"{result}; as with the edit: {masters_digest(zero) == masters_digest(zero_plain)}"


def zero_grad_inside_gathered(stage: int) -> str:
    """A new ``.data``, a backward with it, then ``zero_grad()`` inside ``gathered()``: those gradients are gone,
    so the next backward's step is taken."""
    model, zero, plain, zero_plain, _ = pair(stage)
    model[2].bias.data = model[2].bias.data + 1
    x, y = batch("mlp", 1, comm.rank)
    loss("mlp", model(x), y).backward()
    with zero.gathered():
        zero.zero_grad()
    result = word(lambda: train_step(model, zero, 1))
    train_step(plain, zero_plain, 1)
    return go_on(model, zero, plain, zero_plain, result)


def nested_refused_writeback(stage: int) -> str:
    """Rank 0 alone edits inside ``gathered()``, then a nested ``gathered(writeback=True)`` is refused (the ranks
    differ): the edit is dropped on every rank, and the run goes on as without it."""
    model, zero, plain, zero_plain, _ = pair(stage)
    with zero.gathered():
        if comm.rank == 0:
            edit_under_no_grad(model)
        result = word(lambda: show(zero, writeback=True))
    result += "; step: " + word(lambda: train_step(model, zero, 1))
    train_step(plain, zero_plain, 1)
    return go_on(model, zero, plain, zero_plain, result)


def retried_writeback(stage: int) -> str:
    """Rank 0 alone edits a weight its block holds, then ``gathered(writeback=True)`` twice: refused both times
    (publishing after the first would have spread its edit to every rank's copy of its block, and the second
    found every rank alike), and the steps too, until a load."""
    model, zero, plain, zero_plain, saved = pair(stage)
    if comm.rank == 0:
        edit_under_no_grad(model)
    result = word(lambda: show(zero, writeback=True)) + "; again: " + word(lambda: show(zero, writeback=True))
    result += "; step: " + word(lambda: train_step(model, zero, 1))
    zero.load_state_dict(saved)
    train_step(model, zero, 1)
    train_step(plain, zero_plain, 1)
    return go_on(model, zero, plain, zero_plain, result)


def edit_in_another_block(stage: int) -> str:
    """Rank 0 alone edits a parameter that lies wholly in another rank's block of the flat buffer: no master of
    rank 0's (at stages 1-2), so refused as an edit ``gathered()`` drops, which it does."""
    model, zero, plain, zero_plain, _ = pair(stage)
    group = zero.engine.groups[0]
    _, mine = group.partition.shard_range(0)
    name = next(spec.name for spec in group.layout.specs if spec.offset >= mine)
    if comm.rank == 0:
        with torch.no_grad():
            dict(model.named_parameters())[name].mul_(2)
    result = outcome(lambda: train_step(model, zero, 1))
    result += "; gathered(): " + word(lambda: show(zero))
    train_step(model, zero, 1)
    train_step(plain, zero_plain, 1)
    return go_on(model, zero, plain, zero_plain, result)


ORDER_CASES = {
    "edit then gathered": edit_then_gathered,
    "step raising before its check": step_raising_before_its_check,
    "step and load inside gathered": step_and_load_inside_gathered,
    "read out after an edit": read_out_after_an_edit,
    "new .data": new_data,
    "refused after clip": refused_after_clip,
    "read out inside gathered": read_out_inside_gathered,
    "writeback after backward": writeback_after_backward,
    "zero_grad inside gathered": zero_grad_inside_gathered,
    "nested refused writeback": nested_refused_writeback,
}


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


def edit_kept_gathered(how: str) -> str:
    """Stage 3 keeping params gathered (``keep_gathered=True``): rank 0 alone edits them in its first pass's forward
    (``KEPT_EDITS``), so its second pass runs with the edit and the other ranks' without it: the step is refused,
    naming the parameter; then a step as without the edit once ``gathered()`` (or, read in place, a load) shows
    the masters again."""
    model, plain = make("mlp"), make("mlp")
    zero = shard(model, mpizero.SGD(lr=0.1), comm=comm, stage=3, keep_gathered=True)
    zero_plain = shard(plain, mpizero.SGD(lr=0.1), comm=comm, stage=3, keep_gathered=True)
    saved = zero.state_dict(all_ranks=True)

    def on_rank_0(module, args) -> None:
        if comm.rank == 0:
            with torch.no_grad():
                KEPT_EDITS[how](module.weight)

    hook = model[2].register_forward_pre_hook(on_rank_0)
    x, y = batch("mlp", 0, comm.rank)
    loss("mlp", model(x), y).backward()
    hook.remove()
    loss("mlp", model(x), y).backward()  # with the edit on rank 0, unless read in place
    result = outcome(zero.step)
    zero.zero_grad()
    zero.load_state_dict(saved)
    for m, z in ((model, zero), (plain, zero_plain)):
        train_step(m, z, 1)
    return f"{result}; then as without the edit: {masters_digest(zero) == masters_digest(zero_plain)}"


KEPT_EDITS = {
    "new .data": lambda p: setattr(p, "data", p.data * 2.0),
    "counted": lambda p: p.data.mul_(2.0),
    "uncounted": lambda p: p.detach().numpy().__imul__(2.0),
}

outcomes = [f"stage 3 edit in forward: {edit_in_forward()}"]
outcomes += [f"stage 3 kept gathered, {how} edit: {edit_kept_gathered(how)}" for how in KEPT_EDITS]
for stage in range(4):
    for name in BETWEEN_STEPS:
        outcomes.append(f"stage {stage} {name}: {between_steps(stage, name)}")
    for name, case in ORDER_CASES.items():
        if name == "nested refused writeback" and comm.size == 1:
            continue  # one rank's edit is every rank's
        outcomes.append(f"stage {stage} {name}: {case(stage)}")
    if stage < 3:  # the module's tensors are float32 copies of bfloat16 params: gathered() drops the edit
        outcomes.append(f"stage {stage} edit then gathered in bfloat16: {edit_then_gathered(stage, 'bfloat16')}")
    if stage < 3 and comm.size > 1:  # one rank's edit, where the module's tensors hold the masters
        outcomes.append(f"stage {stage} retried writeback: {retried_writeback(stage)}")
    if stage in (1, 2) and comm.size > 1:  # a block of another rank's masters
        outcomes.append(f"stage {stage} edit in another block: {edit_in_another_block(stage)}")
    for how in ("no writeback", "exception inside", "refused writeback"):
        if how == "refused writeback" and comm.size == 1:
            continue  # one rank's edit is every rank's
        outcomes.append(f"stage {stage} {how}: {inside_gathered(stage, how)}")
everyone = comm.gather(outcomes, root=0)
if comm.rank == 0:
    print("\n".join(line for lines in everyone for line in lines), flush=True)
