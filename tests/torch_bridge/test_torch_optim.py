"""torch.optim optimizers as users build them, on mpizero.torch in one process: the same numbers as plain torch
within float rounding, schedules that change the engine's learning rate, torch-format optimizer state, and clear
errors for what the engine cannot honour."""

import math

import pytest

torch = pytest.importorskip("torch", reason="mpizero.torch needs torch: add its CPU build (docs/getting-started.md)")

import mpizero  # noqa: E402
from mpizero.torch import shard  # noqa: E402

STEPS, MICRO_BATCHES = 12, 3


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.LayerNorm(24), torch.nn.GELU(), torch.nn.Linear(24, 4))


def groups(net, **decay):
    matrices = [p for p in net.parameters() if p.dim() >= 2]
    vectors = [p for p in net.parameters() if p.dim() < 2]
    return [{"params": matrices, **decay}, {"params": vectors, "weight_decay": 0.0}]


def warmup_cosine(optimizer, warmup=3, total=STEPS):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def micro_batch(step, m):
    g = torch.Generator().manual_seed(100 * step + m)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def run_plain_and_sharded(make_optimizer, stage, make_scheduler=None, steps=STEPS):
    """Yield, after each step, the largest relative difference between plain torch's parameters and the engine's."""
    torch.set_num_threads(1)
    plain, ours = model(), model()
    opt_plain, opt_ours = make_optimizer(plain), make_optimizer(ours)
    sched_plain = make_scheduler(opt_plain) if make_scheduler else None
    sched_ours = make_scheduler(opt_ours) if make_scheduler else None
    zero = shard(ours, opt_ours, stage=stage)
    for step in range(steps):
        for m in range(MICRO_BATCHES):
            x, y = micro_batch(step, m)
            (torch.nn.functional.mse_loss(plain(x), y) / MICRO_BATCHES).backward()  # torch's habit: mean by hand
            torch.nn.functional.mse_loss(ours(x), y).backward()  # mpizero's step is the mean already
        for opt, sched in ((opt_plain, sched_plain), (opt_ours, sched_ours)):
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
        masters = zero.state_dict()
        yield max(((masters[k] - v).abs().max() / v.abs().max()).item() for k, v in plain.state_dict().items())


@pytest.mark.parametrize("stage", [0, 3])
def test_adamw_with_decay_groups_and_warmup_cosine_agrees_with_plain_torch_every_step(stage):
    make = lambda net: torch.optim.AdamW(groups(net, weight_decay=0.1), lr=3e-3, betas=(0.9, 0.95))  # noqa: E731
    for step, difference in enumerate(run_plain_and_sharded(make, stage, warmup_cosine)):
        assert difference <= 1e-6, (step, difference)


OPTIMIZERS = {
    "sgd nesterov": lambda net: torch.optim.SGD(groups(net, weight_decay=1e-2), lr=0.05, momentum=0.9, nesterov=True),
    "sgd dampening maximize": lambda net: torch.optim.SGD(
        net.parameters(), lr=0.05, momentum=0.8, dampening=0.3, maximize=True
    ),
    "adam amsgrad": lambda net: torch.optim.Adam(groups(net, weight_decay=1e-3), lr=1e-2, amsgrad=True),
    "adamw onecycle": lambda net: torch.optim.AdamW(net.parameters(), lr=1e-2),
}
SCHEDULES = {"adamw onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS)}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_torchs_optimizers_and_their_options_agree_with_plain_torch(name):
    differences = list(run_plain_and_sharded(OPTIMIZERS[name], 2, SCHEDULES.get(name), steps=6))
    assert max(differences) <= 1e-5, differences  # maximize climbs: the values grow, and so does float noise


def test_lion_from_its_usual_package_agrees_with_plain_torch_and_keeps_its_state_dict():
    lion_pytorch = pytest.importorskip("lion_pytorch", reason="lion-pytorch is not installed (.ci/run installs it)")
    make = lambda net: lion_pytorch.Lion(groups(net, weight_decay=0.1), lr=1e-3, betas=(0.9, 0.99))  # noqa: E731
    differences = list(run_plain_and_sharded(make, 2, warmup_cosine, steps=6))
    assert max(differences) <= 1e-5, differences
    net = model()
    optimizer = make(net)
    zero = shard(net, optimizer, stage=3)
    x, y = micro_batch(0, 0)
    torch.nn.functional.mse_loss(net(x), y).backward()
    optimizer.step()
    state = optimizer.state_dict()
    assert sorted(state["state"][0]) == ["exp_avg"] and state["param_groups"][0]["weight_decay"] == 0.1
    assert zero.engine.bound.type_name == "Lion"


def test_lions_decoupled_weight_decay_outside_its_groups_is_refused():
    lion_pytorch = pytest.importorskip("lion_pytorch", reason="lion-pytorch is not installed (.ci/run installs it)")
    net = model()
    with pytest.raises(mpizero.ZeroError, match=r"Lion\(decoupled_weight_decay=True\) divides weight_decay"):
        shard(net, lion_pytorch.Lion(net.parameters(), lr=1e-3, decoupled_weight_decay=True), stage=2)


def test_torchs_muon_trains_through_the_bridge_within_its_bfloat16_newton_schulz():
    """torch.optim.Muon (2-D parameters only) on a bias-free model: the engine orthogonalises in float32, torch in
    bfloat16, so they agree to bfloat16's rounding, not to float32's; its state dict is torch's."""
    torch.manual_seed(0)

    def make_net():
        return torch.nn.Sequential(
            torch.nn.Linear(8, 16, bias=False), torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False)
        )

    plain, ours = make_net(), make_net()
    ours.load_state_dict(plain.state_dict())
    opt_plain, opt_ours = torch.optim.Muon(plain.parameters(), lr=0.02), torch.optim.Muon(ours.parameters(), lr=0.02)
    zero = shard(ours, opt_ours, stage=2)
    for step in range(4):
        x, y = micro_batch(step, 0)
        for net, opt in ((plain, opt_plain), (ours, opt_ours)):
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        masters = zero.state_dict()
        worst = max(((masters[k] - v).abs().max() / v.abs().max()).item() for k, v in plain.state_dict().items())
        assert 0 < worst <= 1e-2, (step, worst)
    ours_state, plain_state = opt_ours.state_dict()["state"], opt_plain.state_dict()["state"]
    assert sorted(ours_state[0]) == ["momentum_buffer"]
    for number, entry in plain_state.items():  # torch's running average, not a sum 1/(1 - momentum) times larger
        buffer = entry["momentum_buffer"]
        assert (ours_state[number]["momentum_buffer"] - buffer).abs().max() <= 1e-2 * buffer.abs().max(), number
    assert zero.engine.bound.type_name == "Muon"


@pytest.mark.parametrize("stage", [0, 3])
def test_mpizeros_muon_with_adamw_beside_it_trains_a_model_with_biases(stage):
    """The reference recipes' split, by the parameters' names: Muon on the matrices, AdamW on the biases; the
    same bytes at stage 0 and 3, each tensor's own states moving."""
    results = []
    for _ in range(2):
        net = model()
        matrices = [n for n, p in net.named_parameters() if p.dim() == 2]
        biases = [n for n, p in net.named_parameters() if p.dim() < 2]
        groups = [{"params": matrices}, {"params": biases, "use_muon": False, "lr": 3e-3}]
        zero = shard(net, mpizero.Muon(groups, lr=0.02), stage=stage if not results else 3 - stage)
        for step in range(3):
            x, y = micro_batch(step, 0)
            torch.nn.functional.mse_loss(net(x), y).backward()
            zero.step()
            zero.zero_grad()
        results.append({n: a.tobytes() for n, a in zero.engine.master_params().items()})
        engine = zero.engine
        momentum, moments = (
            {k: v for i in range(len(engine.groups)) for k, v in engine.state_group(i, state).items()}
            for state in ("momentum_buffer", "exp_avg")
        )
        assert all(momentum[n].any() and not moments[n].any() for n in matrices)
        assert all(moments[n].any() and not momentum[n].any() for n in biases)
    assert results[0] == results[1]


def test_the_users_optimizer_reads_the_schedules_rate_and_its_state_dict_is_torchs():
    plain, ours = model(), model()
    opt_plain, opt_ours = (torch.optim.AdamW(net.parameters(), lr=1e-2) for net in (plain, ours))
    zero = shard(ours, opt_ours, stage=3)
    sched = torch.optim.lr_scheduler.StepLR(opt_ours, step_size=1, gamma=0.5)  # built after shard
    for step in range(3):
        for net, opt in ((plain, opt_plain), (ours, opt_ours)):
            x, y = micro_batch(step, 0)
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        sched.step()
        for group in opt_plain.param_groups:
            group["lr"] = opt_ours.param_groups[0]["lr"]
    assert opt_ours.param_groups[0]["lr"] == 1e-2 * 0.5**3 and zero.engine.read_hyper()[0][0].lr == 1e-2 * 0.5**3
    ours_sd, plain_sd = opt_ours.state_dict(), opt_plain.state_dict()
    assert ours_sd["param_groups"][0]["params"] == plain_sd["param_groups"][0]["params"]
    for index, entry in plain_sd["state"].items():
        assert ours_sd["state"][index].keys() == entry.keys() and float(ours_sd["state"][index]["step"]) == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(ours_sd["state"][index][key], entry[key], rtol=1e-5, atol=1e-9)  # not bitwise: torch


def test_a_torch_optimizer_state_loads_into_the_engine_before_or_after_shard():
    source, target, early = model(), model(), model()
    opt_source = torch.optim.Adam(source.parameters(), lr=1e-2)
    for step in range(2):
        x, y = micro_batch(step, 0)
        torch.nn.functional.mse_loss(source(x), y).backward()
        opt_source.step()
        opt_source.zero_grad()
    saved = opt_source.state_dict()
    opt_target = torch.optim.Adam(target.parameters(), lr=5.0)
    zero = shard(target, opt_target, stage=2)
    opt_target.load_state_dict(saved)  # torch's semantics: the saved hyper-parameters win
    opt_early = torch.optim.Adam(early.parameters(), lr=1e-2)
    opt_early.load_state_dict(saved)  # a plain torch checkpoint loaded before shard stays the run's state
    zero_early = shard(early, opt_early, stage=3)
    for z, opt in ((zero, opt_target), (zero_early, opt_early)):
        assert opt.param_groups[0]["lr"] == 1e-2 and z.engine.step_count == 2
        state = opt.state_dict()["state"]
        assert all(torch.equal(state[i]["exp_avg"], saved["state"][i]["exp_avg"]) for i in saved["state"])


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda net: torch.optim.RMSprop(net.parameters()),
            "is not supported: the engine runs torch.optim.SGD, torch.optim.Adam",
        ),
        (lambda net: torch.optim.Adam(net.parameters(), differentiable=True), "differentiable=True is not supported"),
        (
            lambda net: torch.optim.SGD(list(net.parameters())[1:], lr=0.1),
            r"tensors \['0.weight'\] are in no parameter",
        ),
        (
            lambda net: torch.optim.SGD([*net.parameters(), torch.nn.Parameter(torch.ones(3))], lr=0.1),
            "not a trainable",
        ),
    ],
)
def test_what_the_engine_cannot_honour_is_one_error_naming_it(make, message):
    net = model()
    with pytest.raises(mpizero.ZeroError, match=message):
        shard(net, make(net), stage=1)


def test_a_schedule_that_breaks_a_hyper_parameter_is_refused_at_the_step():
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    zero = shard(net, opt, stage=1)
    x, y = micro_batch(0, 0)
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(mpizero.ZeroError, match=r"rank 0: optimizer: parameter group 0: lr must be in"):
        zero.step()


@pytest.mark.parametrize("stage", [0, 3])
def test_unfreezing_after_shard_is_refused_naming_the_way(stage):
    """Gradual unfreezing as torch users write it (requires_grad on, ``add_param_group``) after ``shard()``: one
    error at the step naming what to do, for the flag and then for the group, never a KeyError; the run goes on
    once both are undone."""
    net = model()
    net[3].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    zero = shard(net, opt, stage=stage)
    net[3].requires_grad_(True)
    opt.add_param_group({"params": list(net[3].parameters()), "lr": 1e-3})
    x, y = micro_batch(0, 0)

    def step():
        zero.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        return zero.step()

    with pytest.raises(mpizero.ZeroError, match=r"requires_grad of '3.bias', '3.weight' changed after shard\(\)"):
        step()
    net[3].requires_grad_(False)
    with zero.gathered():  # shows the parameters as the engine holds them again: the refusal ends
        pass
    refused = (
        r"rank 0: optimizer: parameter group 1 holds a tensor of shape \[4, 24\] that was no trainable parameter of "
        r"the model when it was sharded .*give the optimizer every parameter group before shard\(\)"
    )
    with pytest.raises(mpizero.ZeroError, match=refused):
        step()
    opt.param_groups.pop()
    assert step().step == 1


def test_mpizero_optimizers_take_parameter_groups_by_name():
    net = model()
    names = [n for n, p in net.named_parameters() if p.dim() < 2]
    opt = mpizero.AdamW([{"params": names, "weight_decay": 0.0}, {"params": None}], lr=1e-2, weight_decay=0.5)
    zero = shard(net, opt, stage=2)
    decay = {name: zero.engine.read_hyper()[0][zero.engine.bound.group_of[name]].weight_decay for name in zero.params}
    assert decay == {name: 0.0 if name in names else 0.5 for name in zero.params}
