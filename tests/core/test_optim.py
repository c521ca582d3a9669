"""Optimizers on shards equal the optimizer on the full vector, bit for bit, and mean what torch.optim documents;
parameter groups cover every tensor once, and their hyper-parameters are read, checked and agreed at every step."""

from functools import partial

import numpy as np
import pytest

from mpizero import SGD, Adam, AdamW, Lion, Muon, Partition, Reference
from mpizero.core import whole_matrices
from mpizero.core.optim import BoundOptimizer, binding, device_update, host_update, oracle, update
from mpizero.core.optim.adam import AdamHyper, AdamRule, documented_adam, documented_adamw
from mpizero.core.optim.lion import LionHyper, LionRule
from mpizero.core.optim.muon import COEFFICIENTS, newton_schulz
from mpizero.core.optim.oracle import DocumentedOptimizer
from mpizero.core.optim.sgd import SGDHyper, SGDRule, documented_sgd
from mpizero.core.optim.update import apply_step
from mpizero.core.reduce import kernels

OPTIMIZERS = [
    SGD(lr=0.1),
    SGD(lr=0.05, momentum=0.9, weight_decay=0.01),
    SGD(lr=0.05, momentum=0.9, dampening=0.3, maximize=True),
    SGD(lr=0.05, momentum=0.8, nesterov=True),
    Adam(lr=1e-2, weight_decay=0.01),
    Adam(lr=1e-2, amsgrad=True, maximize=True),
    AdamW(lr=1e-2),
    AdamW(lr=1e-2, amsgrad=True),
    Lion(lr=1e-3, weight_decay=0.1),
    Lion(lr=1e-3, betas=(0.95, 0.98), maximize=True),
]


def one_update(optimizer, param, grad, state, step):
    """One step of ``optimizer``'s only group on a flat array."""
    hyper = optimizer.rule.hyper_type(**{k: v for k, v in optimizer.param_groups[0].items() if k != "params"})
    apply_step(optimizer.rule, hyper, step, param, grad, state)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("world", [2, 3, 7])
def test_shard_updates_equal_full_update(optimizer, world):
    rng = np.random.default_rng(world)
    numel = 257
    full = rng.standard_normal(numel).astype(np.float32)
    full_state = {n: np.zeros(numel, np.float32) for n in optimizer.state_names}
    part = Partition(numel, world)
    shards = [full[slice(*part.data_range(r))].copy() for r in range(world)]
    shard_states = [{n: np.zeros(len(s), np.float32) for n in optimizer.state_names} for s in shards]
    for step in range(1, 6):
        grad = (rng.standard_normal(numel) * 10.0 ** rng.integers(-6, 3)).astype(np.float32)
        one_update(optimizer, full, grad, full_state, step)
        for r, (shard, state) in enumerate(zip(shards, shard_states)):
            one_update(optimizer, shard, grad[slice(*part.data_range(r))].copy(), state, step)
    assert np.concatenate(shards).tobytes() == full.tobytes()
    for name in optimizer.state_names:
        assert np.concatenate([s[name] for s in shard_states]).tobytes() == full_state[name].tobytes()


def test_optimizer_moves_parameters_downhill():
    p = np.array([1.0, -2.0], dtype=np.float32)
    state = {n: np.zeros(2, np.float32) for n in Adam().state_names}
    one_update(Adam(lr=0.1), p, np.array([1.0, -1.0], dtype=np.float32), state, 1)
    assert p.tolist() == pytest.approx([0.9, -1.9])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: SGD(lr=-0.1), "lr must be in"),
        (lambda: SGD(lr=0.1, momentum=-0.5), "momentum"),
        (lambda: Adam(betas=(0.9, 1.0)), r"betas\[1\]"),
        (lambda: AdamW(eps=float("nan")), "eps"),
        (lambda: SGD(lr=0.1, nesterov=True), "nesterov=True needs momentum"),
        (lambda: Adam(momentum=0.9), r"Adam has no hyper-parameter \['momentum'\]"),
        (lambda: AdamW([{"params": ["w"], "lr": -1.0}]), "lr must be in"),
        (lambda: SGD([{"lr": 0.1}]), "needs a 'params' list"),
    ],
)
def test_bad_hyperparameters_name_the_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# torch.optim's documented algorithms (mpizero.core.optim.oracle), the independent oracle verify uses.


DOCUMENTED = [
    ("sgd", SGD(lr=0.05, momentum=0.9, weight_decay=0.01)),
    ("sgd", SGD(lr=0.05, momentum=0.9, dampening=0.5, maximize=True)),
    ("sgd", SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("adam", Adam(lr=1e-2, weight_decay=0.01)),
    ("adam", Adam(lr=1e-2, amsgrad=True, maximize=True)),
    ("adamw", AdamW(lr=1e-2)),
    ("adamw", AdamW(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    ("lion", Lion(lr=1e-3, weight_decay=0.1)),
    ("lion", Lion(lr=1e-3, betas=(0.95, 0.98), maximize=True)),
]


@pytest.mark.parametrize("name, optimizer", DOCUMENTED, ids=[repr(o) for _, o in DOCUMENTED])
def test_optimizers_follow_torch_documented_algorithm_over_many_steps(name, optimizer):
    rng = np.random.default_rng(7)
    param = rng.standard_normal(257).astype(np.float32)
    state = {n: np.zeros(257, np.float32) for n in optimizer.state_names}
    documented = DocumentedOptimizer(optimizer, {"p": param}, clip_norm=None)
    for step in range(1, 51):
        grad = (rng.standard_normal(257) * (1.0 + 0.5 * np.sin(step))).astype(np.float32)
        one_update(optimizer, param, grad, state, step)
        documented.step({"p": grad})
    expected = documented.params["p"]
    assert np.max(np.abs(param - expected)) / np.max(np.abs(expected)) < 1e-5


def test_documented_adam_first_step_moves_each_element_by_lr():
    theta, g = np.array([1.0, -2.0]), np.array([3.0, -1e-3])
    moved = documented_adam(theta, g, {}, 1, lr=0.1, betas=(0.9, 0.999), eps=0.0)
    assert moved.tolist() == pytest.approx([0.9, -1.9])


def test_documented_weight_decay_is_coupled_in_adam_and_decoupled_in_adamw():
    theta, zero, hyper = np.array([2.0]), np.zeros(1), dict(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    coupled = documented_adam(theta, zero, {}, 1, **hyper)
    decoupled = documented_adamw(theta, zero, {}, 1, **hyper)
    assert coupled.tolist() == pytest.approx([1.9])  # lambda * theta is normalised like a gradient: a step of lr
    assert decoupled.tolist() == pytest.approx([1.98])  # theta * (1 - lr * lambda); the moments stay 0


def test_documented_sgd_momentum_buffer_starts_at_the_first_gradient():
    state, theta = {}, np.array([1.0])
    theta = documented_sgd(theta, np.array([1.0]), state, 1, lr=0.1, momentum=0.9)
    theta = documented_sgd(theta, np.array([1.0]), state, 2, lr=0.1, momentum=0.9)
    assert state["b"].tolist() == pytest.approx([1.9]) and theta.tolist() == pytest.approx([1.0 - 0.1 - 0.19])


def test_documented_clip_coefficient_is_torch_clip_grad_norm():
    grads = {"a": np.array([3.0]), "b": np.array([[4.0]])}
    assert oracle.clip_coefficient(grads, 1.0) == 1.0 / (5.0 + 1e-6)
    assert oracle.clip_coefficient(grads, 10.0) == 1.0


def test_documented_amsgrad_steps_with_the_largest_second_moment_so_far():
    state, theta = {}, np.array([0.0])
    hyper = dict(lr=0.1, betas=(0.0, 0.5), eps=0.0, amsgrad=True)
    documented_adam(theta, np.array([2.0]), state, 1, **hyper)
    documented_adam(theta, np.array([0.0]), state, 2, **hyper)
    assert state["v_max"].tolist() == [2.0] and state["v"].tolist() == [1.0]


# Parameter groups


def test_each_group_updates_its_tensors_with_its_own_hyper_parameters():
    optimizer = AdamW([{"params": ["w"]}, {"params": ["b"], "weight_decay": 0.0, "lr": 0.5}], lr=0.1)
    bound = BoundOptimizer(optimizer, {"w": (3,), "b": (3,)})
    assert bound.group_of == {"w": 0, "b": 1}
    decay, plain = bound.snapshot()
    assert (decay.lr, decay.weight_decay, plain.lr, plain.weight_decay) == (0.1, 1e-2, 0.5, 0.0)


def test_a_group_without_params_takes_every_tensor_no_other_group_lists():
    optimizer = SGD([{"params": None}, {"params": ["b"], "lr": 0.0}], lr=0.1)
    assert BoundOptimizer(optimizer, {"w": (3,), "b": (3,), "c": (3,)}).group_of == {"w": 0, "c": 0, "b": 1}


@pytest.mark.parametrize(
    "groups, message",
    [
        ([{"params": ["w"]}], r"tensors \['b'\] are in no parameter group"),
        ([{"params": ["w", "b"]}, {"params": ["b"]}], r"name tensors twice \['b'\]"),
        ([{"params": ["w", "b", "x"]}], r"unknown tensors \['x'\]"),
        ([{"params": None}, {"params": None}], "only one parameter group may take every remaining tensor"),
    ],
)
def test_groups_must_cover_every_tensor_exactly_once(groups, message):
    with pytest.raises(ValueError, match=message):
        BoundOptimizer(SGD(groups, lr=0.1), {"w": (3,), "b": (3,)})


def test_a_schedule_changes_the_next_snapshot_and_its_digest():
    optimizer = AdamW(lr=0.1)
    bound = BoundOptimizer(optimizer, {"w": (3,)})
    before = bound.snapshot()
    optimizer.param_groups[0]["lr"] = 0.05
    after = bound.snapshot()
    assert after[0].lr == 0.05 and binding.digest(after) != binding.digest(before)
    assert binding.digest(after) == binding.digest(bound.snapshot()) < 2**binding.DIGEST_BITS


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda g: g[0].update(lr=-1.0), r"parameter group 0: lr must be in"),
        (lambda g: g[0].update(momentum=0.0), r"now needs states \[\], it had \['momentum_buffer'\]"),
        (lambda g: g.append({"params": ["x"], "lr": 0.1}), "the optimizer has 2 parameter groups; it had 1"),
        (lambda g: g[0].update(params=["w"]), "parameter group 0 changed its parameters"),
        (lambda g: g[0].update(differentiable=True), "differentiable=True is not supported"),
    ],
)
def test_a_snapshot_refuses_what_the_engine_cannot_honour(change, message):
    optimizer = SGD(["w", "b"], lr=0.1, momentum=0.9)
    bound = BoundOptimizer(optimizer, {"w": (3,), "b": (3,)})
    change(optimizer.param_groups)
    with pytest.raises(ValueError, match=message):
        bound.snapshot()


def test_hyper_parameters_given_as_numpy_or_torch_scalars_are_numbers():
    optimizer = Adam(lr=0.1)
    optimizer.param_groups[0].update(lr=np.float64(0.25), betas=(np.float32(0.5), 0.75))
    (hyper,) = BoundOptimizer(optimizer, {"w": (3,)}).snapshot()
    assert (hyper.lr, hyper.betas) == (0.25, (0.5, 0.75))


HYPERS = [  # (rule, hyper, state names): every term the formulas can take
    (SGDRule, SGDHyper(lr=0.1), []),
    (
        SGDRule,
        SGDHyper(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, maximize=True),
        ["momentum_buffer"],
    ),
    (SGDRule, SGDHyper(lr=0.1, momentum=0.9, nesterov=True), ["momentum_buffer"]),
    (AdamRule, AdamHyper(lr=1e-3, weight_decay=0.1), ["exp_avg", "exp_avg_sq"]),
    (
        AdamRule,
        AdamHyper(lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True, amsgrad=True, maximize=True),
        ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
    ),
    (LionRule, LionHyper(lr=1e-3, weight_decay=0.1, maximize=True), ["exp_avg"]),
]


@pytest.mark.parametrize("rule, hyper, states", HYPERS)
@pytest.mark.parametrize("step", [1, 2, 7])
def test_the_fused_device_update_gives_the_host_updates_bytes_in_one_launch(rule, hyper, states, step):
    """On the stand-in the device update is one launch of the formula as NumPy evaluates it (the CUDA kernel's
    C spelling of the same formula is pinned below)."""
    from mpizero import standin
    from mpizero.standin import cuda

    rng = np.random.default_rng(step)
    host = {name: rng.standard_normal(1000).astype(np.float32) for name in ["param", "grad", *states]}
    for name in states:
        host[name] = np.abs(host[name]) if name != "momentum_buffer" else host[name]
    device = {name: standin.asarray(a) for name, a in host.items()}
    launches = sum(cuda.LAUNCHES.values())
    apply_step(rule, hyper, step, device["param"], device["grad"], {n: device[n] for n in states})
    assert sum(cuda.LAUNCHES.values()) == launches + 1
    apply_step(rule, hyper, step, host["param"], host["grad"], {n: host[n] for n in states})
    for name, a in host.items():
        assert a.tobytes() == device[name].get().tobytes(), name


def wide_values(rng, n: int) -> np.ndarray:
    """float32 values across the whole range: magnitudes 1e-44 to 1e38, subnormals, signed zeros, infinities."""
    values = (rng.standard_normal(n) * 10.0 ** rng.uniform(-44, 38, n)).astype(np.float32)
    values[:8] = [0.0, -0.0, 1e-45, -1e-40, np.inf, -np.inf, 3e38, -3e38]
    return rng.permutation(values)


@pytest.mark.parametrize("rule, hyper, states", HYPERS)
def test_the_compiled_host_update_gives_numpys_bytes(rule, hyper, states):
    """One compiled pass (``host_update``) against the formula as NumPy evaluates it, on values across float32's
    range: the same bytes for every term the formulas take (NaN results included)."""
    rng = np.random.default_rng(len(states))
    arrays = {name: wide_values(rng, 20_000) for name in ["param", "grad", *states]}
    for name in states:  # second moments are never negative
        arrays[name] = np.abs(arrays[name]) if name.endswith("sq") else arrays[name]
    constants = {k: v if isinstance(v, bool) else np.float32(v) for k, v in rule.constants(hyper, 3).items()}
    by_formula = partial(update.numpy_step, rule, hyper, constants)
    function = host_update.kernel(rule, hyper, constants, states, by_formula)
    if function is None:
        pytest.skip(f"no compiled host kernel here: {kernels.backend()}")
    expected = {k: a.copy() for k, a in arrays.items()}
    with np.errstate(all="ignore"):
        by_formula(expected)
    host_update.host_update(function, arrays, constants)
    for name, a in arrays.items():
        assert a.tobytes() == expected[name].tobytes(), name


def test_the_fused_update_kernels_c_spelling():
    hyper = AdamHyper(lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True)
    constants = {k: v if isinstance(v, bool) else np.float32(v) for k, v in AdamRule.constants(hyper, 3).items()}
    inputs, outputs, body = device_update.kernel_source(AdamRule, hyper, constants, ["exp_avg", "exp_avg_sq"])
    assert inputs.startswith("float32 grad, float32 c_beta1, float32 c_beta2,") and inputs.endswith("float32 c_eps")
    assert outputs == "float32 param, float32 exp_avg, float32 exp_avg_sq"
    m = "((exp_avg * c_beta1) + (grad * c_one_minus_beta1))"
    v = "((exp_avg_sq * c_beta2) + ((grad * grad) * c_one_minus_beta2))"
    update = f"((param * c_decay) - (({m} / ((sqrtf({v}) / c_bias_correction2_sqrt) + c_eps)) * c_step_size))"
    assert body == (
        f"float new_exp_avg = {m}; float new_exp_avg_sq = {v}; float new_param = {update}; "
        "exp_avg = new_exp_avg; exp_avg_sq = new_exp_avg_sq; param = new_param;"
    )
    assert device_update.OPTIONS == ("--fmad=false",)  # no multiply and add contracted: each rounds as NumPy's do


def test_lions_sign_is_numpys_in_the_kernels_c_spelling():
    """The CUDA spelling of ``sign`` gives numpy.sign's values: +0 for both zeros, NaN kept."""
    sign = device_update.C_OPS.sign("x")
    assert sign == "((x) > 0.0f ? 1.0f : ((x) < 0.0f ? -1.0f : ((x) == 0.0f ? 0.0f : (x))))"
    for x in np.array([2.5, -1e-45, 0.0, -0.0, np.nan, -np.inf], np.float32):
        spelled = 1.0 if x > 0 else -1.0 if x < 0 else 0.0 if x == 0 else x  # the C expression, in Python
        assert np.float32(spelled).tobytes() == np.sign(x).tobytes(), x


# Muon: each matrix orthogonalised whole (Newton-Schulz), AdamW beside it.


def independent_newton_schulz(g, steps=5, coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7):
    """torch.optim.Muon's documented iteration, written apart from mpizero's: the polynomial expanded term by term,
    the tall case by the transpose of the wide one's result."""
    if g.shape[0] > g.shape[1]:
        return independent_newton_schulz(g.T, steps, coefficients, eps).T
    a, b, c = coefficients
    x = g / max(np.sqrt((g * g).sum()), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * (gram @ x) + c * (gram @ (gram @ x))
    return x


@pytest.mark.parametrize("shape", [(16, 24), (24, 16), (7, 7), (1, 5)])
def test_newton_schulz_is_the_documented_iteration(shape):
    g = np.random.default_rng(shape[0]).standard_normal(shape)
    expected = independent_newton_schulz(g)
    in_float64 = newton_schulz(g, COEFFICIENTS, 5, 1e-7)
    assert np.abs(in_float64 - expected).max() <= 1e-10 * np.abs(expected).max()
    in_float32 = newton_schulz(g.astype(np.float32), COEFFICIENTS, 5, 1e-7)
    assert in_float32.dtype == np.float32 and np.abs(in_float32 - expected).max() <= 1e-5 * np.abs(expected).max()


def test_muon_follows_its_documented_algorithm_with_adamw_beside_it():
    """Muon on a matrix, AdamW on a vector (``use_muon=False``), 30 steps against the float64 documented step."""
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal((16, 24)).astype(np.float32), "b": rng.standard_normal(24).astype(np.float32)}
    optimizer = Muon([{"params": ["w"]}, {"params": ["b"], "use_muon": False, "lr": 3e-3}], lr=0.02)
    reference = Reference({n: p.copy() for n, p in params.items()}, optimizer)
    documented = DocumentedOptimizer(optimizer, params, clip_norm=None)
    for _ in range(30):
        grads = {n: rng.standard_normal(p.shape).astype(np.float32) for n, p in params.items()}
        reference.step([grads])
        documented.step(grads)
    for name, value in reference.params.items():
        expected = documented.params[name]
        assert np.abs(value - expected).max() <= 1e-5 * np.abs(expected).max(), name


def test_muon_matrices_go_to_owners_whole_largest_first_to_the_least_loaded():
    assert whole_matrices.owners([10, 40, 30, 20], 2) == [0, 0, 1, 1]  # 40 | 30; 20 to rank 1, 10 to rank 0: 50 each
    assert whole_matrices.owners([5, 5, 5], 4) == [0, 1, 2]
    assert whole_matrices.owners([], 3) == []


def test_a_vector_in_a_muon_group_is_refused_when_bound():
    optimizer = Muon(lr=0.02)
    with pytest.raises(ValueError, match=r"group 0: Muon orthogonalises 2-D matrices; 'b' has shape \[24\]"):
        BoundOptimizer(optimizer, {"w": (16, 24), "b": (24,)})
    assert Muon.states_per_element() == 3  # a model with vectors: momentum, and AdamW's two moments beside it


def test_an_owner_that_fails_to_orthogonalise_is_an_agreed_error(monkeypatch):
    """Where the rank that owns a matrix fails (a device out of memory), every rank raises the same error before
    the results travel, naming the matrix, and before any master is written, AdamW's vector included (at stages
    1-2 in float32 the master is this rank's block of the params, which no all-gather would then spread)."""
    from mpizero import ZeroEngine, ZeroError
    from mpizero.core.optim.muon import MuonRule

    def failing(direction, hyper):
        raise MemoryError("out of memory")

    params = {"w": np.ones((4, 6), np.float32), "b": np.ones(6, np.float32)}
    engine = ZeroEngine(params, Muon.for_shapes({k: v.shape for k, v in params.items()}, lr=0.02), stage=2)
    monkeypatch.setattr(MuonRule, "orthogonalize", staticmethod(failing))
    with pytest.raises(ZeroError, match=r"Muon's update: rank 0: orthogonalising 'w': MemoryError: out of memory"):
        engine.step({name: np.full(p.shape, 0.5, np.float32) for name, p in params.items()})
    assert {name: a.tobytes() for name, a in engine.master_params().items()} == {
        name: p.tobytes() for name, p in params.items()
    }
