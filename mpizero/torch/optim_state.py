"""The optimizer's whole state in torch's format, gathered from the engine's shards and set back into them.

``optimizer.state_dict()`` on a ``torch.optim`` optimizer trained by ``shard``
is what torch's own gives for the unsharded model: each parameter (numbered in
``param_groups`` order) with its states (``exp_avg``, ``momentum_buffer``, ...)
and, for Adam, its ``step``; each group's hyper-parameters; CPU tensors, on
every rank (collective). ``optimizer.load_state_dict`` takes such a dict, saved
at any world size or stage or by plain torch, the same on every rank (checked),
and sets the hyper-parameters as torch does: the saved values win.
"""

from __future__ import annotations

import torch

from mpizero.comm import agree
from mpizero.torch.state import digest


def full_optimizer_state(zero) -> dict:
    """The optimizer's state dict in torch's format, on every rank (collective)."""
    engine, bound = zero.engine, zero.engine.bound
    states = {}  # (tensor name, state name) -> full host array
    for index in range(len(engine.groups)):
        for state in bound.state_names:
            states.update({(name, state): a for name, a in engine.state_group(index, state).items()})
    number, result_state = 0, {}
    param_groups = []
    for g, (group, members) in enumerate(zip(zero.optimizer.param_groups, bound.members)):
        param_groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(number, number + len(members)))}
        )
        for name in members:
            held = {state: torch.from_numpy(states[(name, state)]) for state in bound.group_states[g]}
            if bound.optimizer.kind.torch_counts_steps:
                held = {"step": torch.tensor(float(engine.step_count)), **held}
            if held:
                result_state[number] = held
            number += 1
    return {"state": result_state, "param_groups": param_groups}


def load_optimizer_state(zero, state_dict) -> None:
    """Set the engine's optimizer state and the optimizer's hyper-parameters from a torch-format state dict."""
    engine, bound = zero.engine, zero.engine.bound
    problem = _problem(state_dict, bound, engine.tensor_shapes())
    agree.raise_if_any(engine.collectives, problem, "optimizer.load_state_dict")
    tensors = [t for entry in state_dict["state"].values() for t in entry.values() if isinstance(t, torch.Tensor)]
    agree.raise_unless_equal(engine.collectives, {"the optimizer state dict's values": digest(tensors)})
    order = [name for members in bound.members for name in members]
    by_name = {order[number]: entry for number, entry in state_dict["state"].items()}
    for index, group in enumerate(engine.groups):
        for state in bound.state_names:
            values = {n: _state_of(by_name.get(n, {}), state, engine.tensor_shapes()[n]) for n in group.layout.names}
            engine.set_state(index, state, values)
    steps = {float(entry["step"]) for entry in by_name.values() if "step" in entry}
    if steps:
        engine.step_count = int(steps.pop())
    elif any("momentum_buffer" in entry for entry in by_name.values()):
        engine.step_count = max(engine.step_count, 1)  # a momentum buffer exists: the next step is not the first
    for group, saved in zip(zero.optimizer.param_groups, state_dict["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _state_of(entry: dict, state: str, shape) -> torch.Tensor:
    """One parameter's state ``state`` as a float32 CPU tensor (zeros where the dict holds none)."""
    found = entry.get(state)
    return torch.zeros(shape) if found is None else found.detach().to("cpu", torch.float32).contiguous().numpy()


def _problem(state_dict, bound, shapes: dict) -> str | None:
    """What keeps ``state_dict`` from loading into this optimizer (None when nothing does)."""
    if not (isinstance(state_dict, dict) and {"state", "param_groups"} <= set(state_dict)):
        return "an optimizer state dict must be a dict with 'state' and 'param_groups'"
    sizes = [len(g.get("params", ())) for g in state_dict["param_groups"]]
    if sizes != [len(m) for m in bound.members]:
        return f"its parameter groups hold {sizes} parameters; this optimizer's hold {[len(m) for m in bound.members]}"
    order = [name for members in bound.members for name in members]
    for number, entry in state_dict["state"].items():
        if not (isinstance(number, int) and 0 <= number < len(order)):
            return f"its state names parameter {number!r}, not one of 0-{len(order) - 1}"
        shape = list(shapes[order[number]])
        for state, value in entry.items():
            if state != "step" and isinstance(value, torch.Tensor) and list(value.shape) != shape:
                return f"parameter {number} ({order[number]}): {state} has shape {list(value.shape)}, not {shape}"
    steps = {float(e["step"]) for e in state_dict["state"].values() if "step" in e}
    if len(steps) > 1:
        return f"its parameters took different numbers of steps {sorted(steps)}; the engine keeps one step count"
    return None
