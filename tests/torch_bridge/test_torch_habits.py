"""torch habits on a sharded model work as on a plain model, or fail naming the mpizero way (docs/pytorch.md's
table of habits points at each of these tests)."""

import pytest

torch = pytest.importorskip("torch", reason="mpizero.torch needs torch: add its CPU build (docs/getting-started.md)")

import mpizero  # noqa: E402
from mpizero.torch import shard  # noqa: E402


class Tied(torch.nn.Module):
    """An embedding tied to the head; the head is no unit of its own (the model's), like a language model's."""

    def __init__(self):
        super().__init__()
        self.embed, self.body = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(torch.tanh(self.body(self.embed(x))))


def tied(stage, optimizer=torch.optim.SGD):
    torch.manual_seed(0)
    net = Tied()
    opt = optimizer(net.parameters(), lr=0.1)
    return net, opt, shard(net, opt, stage=stage, units=[net.embed, net.body])


def backward(net, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g)
    torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()


@pytest.mark.parametrize("stage", [0, 3])
def test_clip_grad_norm_clips_through_the_engine_and_returns_torchs_norm(stage):
    torch.manual_seed(0)
    plain = Tied()
    net, opt, _ = tied(stage)
    backward(plain)
    backward(net)
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    found = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
    assert isinstance(found, torch.Tensor) and found.item() == pytest.approx(expected.item(), rel=1e-6)
    opt.step()


def test_clip_grad_norm_by_inf_measures_the_norm_and_clips_nothing():
    torch.manual_seed(0)
    plain = Tied()
    net, opt, zero = tied(2)
    backward(plain)
    backward(net)
    with pytest.raises(mpizero.ZeroError, match="max_norm must be a positive number"):
        torch.nn.utils.clip_grad_norm_(net.parameters(), float("nan"))
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), float("inf"))
    found = torch.nn.utils.clip_grad_norm_(net.parameters(), float("inf"))
    assert found.item() == pytest.approx(expected.item(), rel=1e-6) and expected.item() > 1.0
    with zero.gathered(grads=True):  # not scaled down: the gradients torch's unclipped ones
        for mine, theirs in zip(net.parameters(), plain.parameters()):
            assert torch.allclose(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7)
    opt.step()


def test_clipping_part_of_a_model_or_by_value_names_the_way():
    net, _, _ = tied(2)
    backward(net)
    with pytest.raises(mpizero.ZeroError, match="clips by the norm over all of them; pass model.parameters"):
        torch.nn.utils.clip_grad_norm_(net.body.parameters(), 1.0)
    with pytest.raises(mpizero.ZeroError, match="clip the global norm with torch.nn.utils.clip_grad_norm_"):
        torch.nn.utils.clip_grad_value_(net.parameters(), 1.0)
    plain = torch.nn.Linear(2, 2)  # other models keep torch's own functions
    plain(torch.ones(1, 2)).sum().backward()
    assert torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0).item() > 0


def grad_norm(model) -> torch.Tensor:
    """The grad-norm logging recipe as torch users write it."""
    return sum(p.grad.norm() ** 2 for p in model.parameters() if p.grad is not None) ** 0.5


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_grads_read_the_averaged_gradient_at_stages_0_1_and_inside_gathered_grads_else_name_it(stage):
    torch.manual_seed(0)
    plain = Tied()
    net, opt, zero = tied(stage)
    backward(plain)
    backward(net)
    expected = grad_norm(plain).item()
    if stage < 2:
        assert grad_norm(net).item() == pytest.approx(expected, rel=1e-6)  # as clip_grad_norm_ against torch's
    else:
        with pytest.raises(mpizero.ZeroError, match=r"outside zero.gathered\(grads=True\)"):
            grad_norm(net)
    with zero.gathered(grads=True):
        for mine, theirs in zip(net.parameters(), plain.parameters()):
            assert torch.allclose(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7)  # the exact sum against torch's
    with pytest.raises(mpizero.ZeroError, match="writing into .grad changes nothing there; clip with"):
        net.body.weight.grad.mul_(0.5)
    opt.step()
    with pytest.raises(mpizero.ZeroError, match=r"after step\(\)"):
        grad_norm(net)
    opt.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def test_reading_grads_at_stage_1_leaves_the_step_bitwise_unchanged():
    masters = []
    for read in (False, True):
        net, opt, zero = tied(1)
        backward(net)
        if read:
            assert grad_norm(net).item() > 0
        opt.step()
        backward(net, seed=1)  # the next step's backward starts from .grad None again
        opt.step()
        masters.append(zero.master_params())
    assert all(masters[0][name].tobytes() == masters[1][name].tobytes() for name in masters[0])


def test_model_state_dict_at_stage_3_holds_the_full_masters_and_loads_into_a_plain_model():
    net, opt, zero = tied(3)
    backward(net)
    opt.step()
    state = net.state_dict()  # collective at stage 3, as FSDP's full state dict
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()  # tied, as in a plain model
    masters = zero.master_params()
    assert all(torch.equal(state[name], torch.from_numpy(masters[name])) for name in masters)
    plain = Tied()
    plain.load_state_dict(state)
    sub = net.body.state_dict()  # a submodule's state dict is full too
    assert torch.equal(sub["weight"], torch.from_numpy(masters["body.weight"]))


def test_model_load_state_dict_loads_into_the_masters_at_every_stage():
    for stage in range(4):
        net, _, zero = tied(stage)
        zeros = {key: torch.zeros_like(value) for key, value in zero.state_dict().items()}
        assert net.load_state_dict(zeros) == torch.nn.modules.module._IncompatibleKeys([], [])
        assert all(not a.any() for a in zero.master_params().values()), stage
        with pytest.raises(mpizero.ZeroError, match="strict=True"):
            net.load_state_dict(zeros, strict=False)


def test_model_zero_grad_drops_the_steps_gradients_at_every_stage_and_a_submodules_names_the_model():
    """Backward passes, ``model.zero_grad()``, one more backward and a step: the step of that last backward alone,
    as ``optimizer.zero_grad()`` gives (the gradients live in the engine's sums, which ``.grad`` does not hold)."""
    for stage in range(4):
        found = {}
        for how in ("model", "optimizer"):
            net, opt, zero = tied(stage)
            backward(net, seed=1)
            backward(net, seed=2)
            net.zero_grad() if how == "model" else opt.zero_grad()
            backward(net, seed=3)
            opt.step()
            found[how] = [a.tobytes() for a in zero.master_params().values()]
        assert found["model"] == found["optimizer"], stage
        with pytest.raises(mpizero.ZeroError, match=r"submodule.*model.zero_grad\(\)"):
            net.body.zero_grad()


def test_a_submodule_called_outside_the_forward_at_stage_3_gathers_for_its_forward_and_backward():
    net, opt, zero = tied(3)
    hidden = torch.randn(3, 8, requires_grad=True)
    out = net.head(hidden)  # the tied head, outside the model's forward
    assert out.shape == (3, 11) and net.embed.weight.shape == (0,)  # gathered for the call, freed after
    out.sum().backward()
    assert hidden.grad is not None and zero.memory()["gathered"] == 0


def test_a_model_is_sharded_once():
    net, _, _ = tied(1)
    with pytest.raises(mpizero.ZeroError, match="sharded already"):
        shard(net, torch.optim.SGD(net.parameters(), lr=0.1))


def test_micro_batch_draws_the_same_numbers_for_the_same_index_and_leaves_the_callers_stream_alone():
    net, _, zero = tied(1)
    drop = torch.nn.Dropout(0.5)
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    with zero.micro_batch(4):
        first = drop(torch.ones(64))
    with zero.micro_batch(4):
        again = drop(torch.ones(64))
    with zero.micro_batch(5):
        other = drop(torch.ones(64))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(torch.rand(3), expected_next)
    with pytest.raises(ValueError, match="index in the global batch"):
        with zero.micro_batch(-1):
            pass


def test_zero_load_takes_the_directory_save_was_given(tmp_path):
    net, opt, zero = tied(2)
    for step in range(2):
        backward(net, step)
        opt.step()
        opt.zero_grad()
        zero.save(str(tmp_path / "ck"), data={"at": step})
    fresh, _, again = tied(2)
    assert again.load(str(tmp_path / "ck"))["data"] == {"at": 1}
    assert all((a == b).all() for a, b in zip(again.master_params().values(), zero.master_params().values()))


def test_dividing_the_loss_by_the_accumulation_steps_scales_the_step_twice():
    """The step is the mean over every backward already: torch's ``loss / steps`` habit divides a second time."""
    steps, updates = 4, {}
    for divided in (False, True):
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 1, bias=False)
        zero = shard(net, torch.optim.SGD(net.parameters(), lr=1.0), stage=0)
        before = net.weight.detach().clone()
        for m in range(steps):
            loss = net(torch.full((1, 3), float(m + 1))).sum()
            (loss / steps if divided else loss).backward()
        zero.step()
        updates[divided] = before - net.weight.detach()
    assert torch.allclose(updates[True] * steps, updates[False])  # scaled by 1/steps again, within rounding
