"""Stage 3 with ``keep_gathered=True``: each unit gathered once a step, kept until the update, the same bytes.

Run: mpiexec -n N python -m mpi4py tests/torch_bridge/torch_kept.py

Prints ``CHECK ok`` for each check (every rank asserts): ``gathers`` (one all-gather of each group a step against
two a micro-batch, and nothing gathered after the step), ``join`` (uneven passes inside ``join()``, a call that
reads the params in mid-step and a ``gathered()`` block; ranks that ran no pass inside ``join()`` then passes
on every rank; each the bytes of the same run without keeping), ``edits`` (an edit inside a forward on rank 0
alone refuses the step on every rank, and the step taken again gives the bytes of a run that never saw it),
``refused`` (the option outside stage 3, unequal on the ranks, not a bool: the same error on every rank).
"""

import hashlib

import torch
from mpi4py import MPI

import mpizero
from mpizero.torch import shard

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
MICRO_BATCHES = 4


def build(keep: bool, stage: int = 3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.GELU(), torch.nn.Linear(9, 7), torch.nn.Linear(7, 2))
    units = [model[0], model[2], model[3]]
    return model, shard(model, mpizero.AdamW(lr=1e-2), stage=stage, units=units, keep_gathered=keep)


def backward(model, step: int, m: int) -> None:
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(100 * step + m))
    model(x).pow(2).mean().backward()


def digest(zero) -> str:
    masters = zero.master_params()
    return hashlib.sha256(b"".join(masters[name].tobytes() for name in sorted(masters))).hexdigest()


def say(text: str) -> None:
    if comm.rank == 0:
        print(text, flush=True)


def check_gathers() -> None:
    counted = {}
    for keep in (False, True):
        model, zero = build(keep)
        for step in range(2):
            zero.engine.collectives.traffic.clear()
            for m in mpizero.split_evenly(MICRO_BATCHES * comm.size, comm.size, comm.rank):
                backward(model, step, m)
            if keep:  # every group's full params held, but where read in place (``formulas.kept_bytes``)
                assert sorted(zero.binder.kept_gathered) == [0, 1, 2], zero.binder.kept_gathered
                in_place = zero.engine.groups[0].node_params is not None
                full = sum(4 * group.partition.padded_numel for group in zero.engine.groups)
                assert zero.memory()["gathered"] == (0 if in_place else full), zero.memory()
            zero.step()
            zero.zero_grad()
            counted[keep] = zero.engine.collectives.traffic.calls["allgather"]
            assert not zero.binder.kept_gathered and not any(b.allocated for b in zero.binder.buffers), keep
            assert zero.memory()["gathered"] == 0
        counted[keep, "digest"] = digest(zero)
    assert counted[False] == 2 * MICRO_BATCHES * 3 and counted[True] == 3, counted
    assert counted[False, "digest"] == counted[True, "digest"]
    say("gathers ok")


def uneven_run(keep: bool) -> str:
    """Three steps: rank 0 runs one more micro-batch than the others inside join(); mid-step, a state_dict() and
    a gathered() block between micro-batches; after each step, an evaluation forward under inference_mode (once
    followed by reshard())."""
    model, zero = build(keep)
    for step in range(3):
        with zero.join():
            for m in range(3 if comm.rank == 0 else 2):
                backward(model, step, 10 * comm.rank + m)
        if step == 1:
            zero.state_dict()
            assert not zero.binder.kept_gathered
            backward(model, step, 50 + comm.rank)
            with zero.gathered():
                assert not zero.binder.kept_gathered
            backward(model, step, 60 + comm.rank)
        zero.step()
        zero.zero_grad()
        with torch.inference_mode():  # Lightning's evaluation: the units it gathers stay for the next pass
            model(torch.ones(2, 5))
        if step == 1:  # freed at once, as FSDP2's model.reshard()
            zero.reshard()
            assert not zero.binder.kept_gathered and zero.memory()["gathered"] == 0
    return digest(zero)


def idle_rank_run(keep: bool) -> str:
    """Two steps whose passes all run on rank 0 inside join() (the other ranks take part from it, as a rank with no
    micro-batch does), then, on every rank, an evaluation forward and one more pass before the step."""
    model, zero = build(keep)
    for step in range(2):
        with zero.join():
            for m in range(2 if comm.rank == 0 else 0):
                backward(model, step, m)
        with torch.no_grad():
            model(torch.ones(2, 5))
        backward(model, step, 10 + comm.rank)
        zero.step()
        zero.zero_grad()
    return digest(zero)


def check_join() -> None:
    assert uneven_run(True) == uneven_run(False)
    assert idle_rank_run(True) == idle_rank_run(False)
    say("join ok")


def check_edits() -> None:
    """An edit in a forward on rank 0 alone: read in place (every rank on one host) its bytes reach every rank's
    masters, refused until a load; in a buffer of the rank's own, a write through ``.data`` is counted and refused
    until the masters are shown again, an uncounted one (through NumPy) or a new ``.data`` refuses the step."""
    clean_model, clean = build(True)
    for m in range(2):
        backward(clean_model, 0, m)
    clean.step()
    model, zero = build(True)
    saved = zero.state_dict(all_ranks=True)
    in_place = zero.engine.groups[0].node_params is not None
    kept, reached = "while stage 3 kept them gathered", "were edited in place during a forward or backward at stage 3"
    edits = {
        "uncounted": (lambda p: p.detach().numpy().__imul__(2.0), reached if in_place else kept),
        "counted": (lambda p: p.data.mul_(2.0), reached if in_place else "changed in place"),
        "new tensor": (lambda p: setattr(p, "data", p.data * 2.0), kept),
    }
    for edit, message in edits.values():

        def on_rank_0(module, args, edit=edit):
            if comm.rank == 0:
                with torch.no_grad():
                    edit(module.weight)

        hook = model[2].register_forward_pre_hook(on_rank_0)
        backward(model, 0, 0)
        hook.remove()
        backward(model, 0, 1)  # runs with the edit, on rank 0 alone unless read in place
        try:
            zero.step()
        except mpizero.ZeroError as error:
            assert message in str(error) and "'2.weight'" in str(error), error
        else:
            raise AssertionError(f"{message}: an edit of params kept gathered was not refused")
        assert not zero.binder.kept_gathered
        zero.zero_grad()
        if message == reached:
            zero.load_state_dict(saved)
        else:
            with zero.gathered():  # shows the masters again: a counted edit's refusal ends here
                pass
    for m in range(2):
        backward(model, 0, m)
    zero.step()
    # a new tensor shown in an evaluation on rank 0, gone before any backward: no gradient was computed with it
    new_tensor = edits["new tensor"][0]
    hook = model[2].register_forward_pre_hook(
        lambda module, args: new_tensor(module.weight) if comm.rank == 0 else None
    )
    with torch.no_grad():
        model(torch.ones(2, 5))
    hook.remove()
    zero.state_dict()
    for kept_or_not, sharded in ((clean_model, clean), (model, zero)):
        for m in range(2):
            backward(kept_or_not, 1, m)
        sharded.step()
    assert digest(zero) == digest(clean)
    say(f"edits {'in place ' if in_place else ''}ok")


def check_refused() -> None:
    cases = [
        ({"stage": 2, "keep": True}, ValueError, "keep_gathered keeps stage 3's units gathered"),
        ({"keep": "yes"}, TypeError, "keep_gathered must be True or False, got 'yes'"),
    ]
    if comm.size > 1:
        cases.append(({"keep": comm.rank == 0}, mpizero.ZeroError, "ranks disagree on keep_gathered"))
    for arguments, kind, message in cases:
        try:
            build(**arguments)
        except kind as error:
            assert message in str(error), error
        else:
            raise AssertionError(f"{arguments} was not refused")
    say("refused ok")


for check in (check_gathers, check_join, check_edits, check_refused):
    check()
