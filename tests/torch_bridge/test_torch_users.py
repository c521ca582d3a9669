"""mpizero.torch with what users bring: byte-identical at every world size and stage, close to plain torch,
safe to read, state dicts that load anywhere, uneven work under join(), streamed gradients."""

import gc
import re
import weakref

import numpy as np
import pytest
from mpirun import run_mpi_ok, run_python

torch = pytest.importorskip("torch", reason="mpizero.torch needs torch: add its CPU build (docs/getting-started.md)")
import torch_user_models as users  # noqa: E402

import mpizero  # noqa: E402
from mpizero import heap  # noqa: E402
from mpizero.torch import shard, tensors  # noqa: E402

STEPS, MICRO_BATCHES = 3, 5
HAS_TRANSFORMERS = True
try:
    import transformers  # noqa: F401
except ImportError:
    HAS_TRANSFORMERS = False
KINDS = [k for k in users.MODELS if HAS_TRANSFORMERS or not k.startswith("gpt2")]
TOLERANCE = {"autocast": 2e-3}  # bfloat16 matmuls: the two orders of float32 additions differ more
# The bias of a Linear right before BatchNorm has a true gradient of 0 (BatchNorm removes the mean), so both
# gradients are rounding noise, which Adam turns into steps of up to lr: checked only to within STEPS * lr, as
# is the running mean, which averages that bias in.
NOISE_ONLY = {("batchnorm", "0.bias"): STEPS * 1e-2, ("batchnorm", "1.running_mean"): STEPS * 1e-2}


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="the GPT-2 case needs transformers: pip install transformers")
def test_a_widely_used_librarys_model_is_among_them():
    assert "gpt2" in KINDS


@pytest.fixture(scope="module")
def digests():
    return {}


@pytest.mark.parametrize("n", [1, 2, 4])  # 3 ranks: the recipe's and the identity tests (test_torch*.py)
def test_every_model_gives_the_same_bytes_at_every_stage_and_world_size(n, digests):
    kinds = [k for k in KINDS if n < 4 or k not in users.CHECKPOINTED]  # recomputed: at 1 and 2 ranks (time)
    out = run_mpi_ok(n, ["-m", "mpi4py", "tests/torch_bridge/torch_users.py", *kinds], timeout=240)
    found = {(m, s): d for m, s, d in re.findall(r"^digest (\w+) (\dk?) (\w+)$", out, re.M)}
    assert len(found) == 5 * len(kinds), out
    for kind in kinds:
        assert len({found[(kind, s)] for s in ("0", "1", "2", "3", "3k")}) == 1, f"{kind}: stages differ at -n {n}"
    for kind in set(users.CHECKPOINTED) & set(kinds):  # activation checkpointing changes no byte
        plain = kind.split("_")[0]
        assert found[(kind, "0")] == found[(plain, "0")], f"{kind} differs from {plain} at -n {n}"
    digests[n] = found
    first = digests[min(digests)]
    assert all(first[key] == digest for key, digest in found.items()), f"-n {n} differs from -n {min(digests)}"


@pytest.mark.parametrize("n", [1, 3])
def test_placeholders_gathered_state_dicts_and_mismatched_calls(n):
    out = run_mpi_ok(n, ["-m", "mpi4py", "tests/torch_bridge/torch_users.py", "--features"], timeout=180)
    for check in ("placeholders", "gathered", "state dicts", "mismatch"):
        assert f"{check} ok" in out, out


@pytest.mark.parametrize("n", [1, 3])
def test_meta_device_models_equal_normally_built_ones_at_any_world_size(n):
    assert "meta ok" in run_mpi_ok(n, ["-m", "mpi4py", "tests/torch_bridge/torch_users.py", "--meta"], timeout=120)


def plain_step(kind, model, optimizer, step):
    for m in range(MICRO_BATCHES):
        x, y = users.batch(kind, step, m)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "autocast"):
            out = model(x)
        users.loss(kind, out, y).backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= MICRO_BATCHES
    if kind == "clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("kind", KINDS)
def test_within_tolerance_of_plain_torch(kind):
    torch.set_num_threads(1)
    (plain, _), (model, units) = users.make(kind), users.make(kind)
    optimizer = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    zero = shard(model, mpizero.AdamW(lr=1e-2, weight_decay=0.1), stage=3, units=units)
    for step in range(STEPS):
        plain_step(kind, plain, optimizer, step)
        for m in range(MICRO_BATCHES):
            x, y = users.batch(kind, step, m)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "autocast"):
                out = model(x)
            users.loss(kind, out, y).backward()
        if kind == "clip":
            zero.clip_grad_norm_(0.05)
        zero.step()
    ours = zero.state_dict()
    for name, value in plain.state_dict().items():
        if value.dtype.is_floating_point:
            difference = (ours[name] - value).abs().max().item()
            limit = NOISE_ONLY.get((kind, name), TOLERANCE.get(kind, 1e-5))
            assert difference <= limit, (name, difference)
    if kind == "frozen":
        assert torch.equal(ours["0.weight"], users.make(kind)[0][0].weight)


def test_clip_grad_norm_returns_the_global_norm_before_clipping():
    torch.set_num_threads(1)
    (plain, _), (model, _) = users.make("clip"), users.make("clip")
    zero = shard(model, mpizero.SGD(lr=0.0), stage=2)
    x, y = users.batch("clip", 0, 0)
    users.loss("clip", plain(x), y).backward()
    users.loss("clip", model(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9).item()
    assert zero.clip_grad_norm_(0.05) == pytest.approx(expected, rel=1e-6)
    assert zero.step().grad_norm == pytest.approx(expected, rel=1e-6)


def streamed_memory(micro_batches: int, stage: int) -> tuple[dict, int]:
    """The bytes held right after the last backward of a step(closure) with this many micro-batches."""
    model, _ = users.make("tied")
    zero = shard(model, mpizero.AdamW(lr=1e-2), stage=stage)
    seen = {}

    def closure():
        for m in range(micro_batches):
            x, y = users.batch("tied", 0, m)
            users.loss("tied", model(x), y).backward()
        seen.update(zero.memory())

    zero.step(closure)  # the first step measures the scales (the closure runs twice)
    result = zero.step(closure)
    return seen, result


@pytest.mark.parametrize("stage", [2, 3])
def test_streamed_gradients_hold_the_same_bytes_at_8_micro_batches_as_at_1(stage):
    torch.set_num_threads(1)
    one, _ = streamed_memory(1, stage)
    eight, result = streamed_memory(8, stage)
    assert one == eight
    assert not result.redo and result.step == 2


def test_only_the_first_step_holds_each_backwards_gradients():
    torch.set_num_threads(1)
    model, _ = users.make("tied")
    zero = shard(model, mpizero.AdamW(lr=1e-2), stage=3)
    shards = sum(g.grad_shard.nbytes for g in zero.engine.groups)

    def three_backward_passes(step):
        for m in range(3):
            users.loss("tied", model(users.batch("tied", step, m)[0]), users.batch("tied", step, m)[1]).backward()
        return zero.memory()["grads"]

    assert three_backward_passes(0) == shards + 3 * 4 * zero.engine.numel  # no scales yet: each backward is held
    zero.step()
    assert three_backward_passes(1) == shards  # predicted scales: each backward streams into the sum


def test_step_closure_returns_its_loss_and_refuses_earlier_backward_passes():
    torch.set_num_threads(1)
    model, _ = users.make("mlp")
    zero = shard(model, mpizero.SGD(lr=0.1), stage=1)
    x, y = users.batch("mlp", 0, 0)

    def closure():
        loss = users.loss("mlp", model(x), y)
        loss.backward()
        return loss

    assert zero.step(closure).loss is not None
    users.loss("mlp", model(x), y).backward()
    with pytest.raises(mpizero.ZeroError, match="backward passes ran before step"):
        zero.step(closure)


def test_watchdog_is_on_by_default_and_none_turns_it_off():
    model, _ = users.make("mlp")
    assert shard(model, mpizero.SGD(lr=0.1)).engine.config.watchdog == 600.0
    assert shard(users.make("mlp")[0], mpizero.SGD(lr=0.1), watchdog=None).engine.config.watchdog is None


@pytest.mark.parametrize("stage", [1, 3])
def test_a_sharded_model_its_user_drops_is_freed_and_one_still_used_keeps_training(stage):
    """Torch keeps tensor hooks in C++, out of sight of Python's collector: the gradient hooks hold their sharded
    model weakly, so one the user drops (model, optimizer and all) is freed with its engine; the model holds it,
    so training through the model and optimizer alone goes on."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.GELU(), torch.nn.Linear(4, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    engine = weakref.ref(shard(model, optimizer, stage=stage).engine)  # the sharded model itself is not kept
    gc.collect()
    before = dict(engine().master_params())
    for _ in range(2):
        model(torch.ones(2, 6)).sum().backward()
        optimizer.step()
    assert all(not np.array_equal(before[name], after) for name, after in engine().master_params().items())
    del model, optimizer
    gc.collect()
    assert engine() is None


def test_stage_3_parameters_are_empty_placeholders_between_uses():
    model, _ = users.make("tied")
    zero = shard(model, mpizero.SGD(lr=0.1), stage=3)
    assert all(p.shape == (0,) for p in model.parameters())
    with zero.gathered():
        assert model.embed.weight.shape == (users.VOCAB, users.WIDTH)
        assert np.array_equal(model.embed.weight.detach().numpy(), zero.master_params()["embed.weight"])
    assert model.embed.weight.shape == (0,)


@pytest.mark.parametrize("standin", [False, True])  # the stand-in takes the device path (CUDA's)
def test_stage_3_refills_full_params_still_held_instead_of_allocating_more(monkeypatch, standin):
    monkeypatch.setattr(tensors, "STANDIN", standin)
    model, _ = users.make("tied")
    zero = shard(model, mpizero.SGD(lr=0.1), stage=3)
    assert zero.engine.groups[0].xp.__name__ == ("mpizero.standin" if standin else "numpy")
    with zero.gathered():
        held = model.embed.weight.detach().numpy()  # outlives the block, as autograd's saved views of a forward do
    x, y = users.batch("tied", 0, 0)
    users.loss("tied", model(x), y).backward()
    zero.step()
    assert model.embed.weight.shape == (0,)
    with zero.gathered():
        assert model.embed.weight.data_ptr() == held.ctypes.data, "a second buffer while the first is still held"
        assert np.array_equal(held, zero.master_params()["embed.weight"])  # the params as of this gather


@pytest.mark.parametrize("trim_heap, standin", [(True, False), (False, False), (True, True)])
def test_the_heap_is_trimmed_after_a_backward_or_step_only_when_it_grew(monkeypatch, trim_heap, standin):
    """Where the gradients and params live on a device (the stand-in's), the host heap is never trimmed."""
    monkeypatch.setattr(tensors, "STANDIN", standin)
    calls, size, kept = [], [0], []
    monkeypatch.setattr(heap, "keep_freed_blocks", lambda: kept.append(True) or True)
    monkeypatch.setattr(heap, "release_free_pages", lambda: calls.append(size[0]) or True)
    monkeypatch.setattr(heap, "heap_bytes", lambda: size[0])
    monkeypatch.setattr(heap, "_last_size", [0])
    model, _ = users.make("mlp")
    zero = shard(model, mpizero.SGD(lr=0.1), stage=3, trim_heap=trim_heap)
    for m, grown in enumerate([0, heap.GROWTH, heap.GROWTH + 1]):
        size[0] = grown
        x, y = users.batch("mlp", 0, m)
        users.loss("mlp", model(x), y).backward()
    zero.step()
    assert calls == ([heap.GROWTH] if trim_heap and not standin else [])  # once, when it had grown by GROWTH
    assert kept == ([True] if trim_heap and not standin else [])  # glibc's own trimming turned off once


REALLOCATE = """
import sys
import numpy as np
from mpizero import heap
if sys.argv[1] == "keep":
    assert heap.keep_freed_blocks()
for _ in range(2):
    blocks = [np.ones(4 << 20, np.float32) for _ in range(4)]  # a backward's four 16 MiB gradients, freed
    del blocks
print(heap.heap_bytes())
"""


def test_freed_gradient_sized_blocks_stay_in_the_heap_for_the_next_micro_batch():
    """glibc alone hands them back to the OS at ``free`` (its heap's top trimmed), so the next micro-batch's
    gradients fault their pages in again."""
    if heap.heap_bytes() is None:
        pytest.skip("the C library is not glibc 2.33 or later: its heap settings are its own")

    def heap_after(how: str) -> int:
        done = run_python(["-c", REALLOCATE, how], timeout=60)
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    assert heap_after("keep") >= 64 << 20, "the four freed 16 MiB blocks left the heap"
    assert heap_after("glibc") < 32 << 20  # without it they do (so the check above could fail)


def test_releasing_free_pages_shrinks_a_fragmented_heap():
    if not heap.release_free_pages():
        pytest.skip("the C library has no malloc_trim (not glibc)")
    blocks = [np.ones(8 << 10) for _ in range(400)]  # 64 KiB each: below glibc's mmap threshold, in its heap
    kept = blocks[::10]  # every tenth stays, so the blocks freed between them are not the heap's top
    del blocks
    before = resident_kib()
    heap.release_free_pages()
    assert before - resident_kib() > 10 << 10, "of about 22 MiB freed, less than 10 went back to the OS"
    assert len(kept) == 40


def resident_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
