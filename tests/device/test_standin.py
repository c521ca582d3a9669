"""The CPU stand-in for CuPy (``mpizero.standin``) refuses what CuPy refuses and counts what crosses the bus, so the
device code paths that run on it are held to CuPy's rules without a GPU."""

import gc
from functools import partial

import numpy as np
import pytest

from mpizero import standin
from mpizero.arrays import array_module, device_of, to_host, write
from mpizero.core import held
from mpizero.errors import ZeroError
from mpizero.standin import bus


@pytest.fixture(autouse=True)
def fresh_counts():
    bus.COUNTS.clear()


def test_host_arrays_never_enter_implicitly():
    a = standin.zeros(4, np.float32)
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(a)
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        a[...] = np.ones(4, np.float32)  # CuPy's __setitem__ falls back to fill(), which refuses it
    with pytest.raises(TypeError, match="Unsupported type"):
        a + np.ones(4, np.float32)
    with pytest.raises(TypeError, match="expected a sequence of cupy.ndarray"):
        standin.stack([a, np.ones(4, np.float32)])
    a[...] = 2.0  # a scalar is a fill, on the device
    a[1:3] = standin.ones(2, np.float32)  # a device array is a copy on the device
    assert to_host(a).tolist() == [2.0, 1.0, 1.0, 2.0]


def test_results_stay_on_the_device_and_every_copy_is_counted():
    a = standin.asarray(np.arange(6, dtype=np.float32))
    assert bus.COUNTS["h2d"] == 1 and bus.COUNTS["sync"] == 0
    total = (a * 2).sum()
    assert array_module(total) is standin and total.shape == () and bus.COUNTS["d2h"] == 0
    assert float(total) == 30.0  # an implicit copy back, as CuPy's: counted as a copy and a wait
    assert bus.COUNTS["d2h"] == 1 and bus.COUNTS["sync"] == 1
    write(a, np.zeros(6, np.float32))  # the explicit way in
    assert bus.COUNTS["h2d"] == 2 and to_host(a).sum() == 0.0 and bus.COUNTS["d2h"] == 2
    with pytest.raises(TypeError, match="float64 array cannot be set to float32 array"):
        a.set(np.zeros(6))


def test_every_new_device_array_is_counted_as_an_allocation_and_views_and_writes_are_not():
    a = standin.asarray(np.arange(6, dtype=np.float32))  # a copy of host data: new device memory
    b = standin.empty(6, np.float32)
    assert bus.COUNTS["alloc"] == 2
    a.reshape(2, 3), a[1:4], a.view(np.uint32)  # views of a's memory
    b[...] = a  # a copy into memory that exists
    np.multiply(a, 2, out=b)
    assert bus.COUNTS["alloc"] == 2
    a * 2, a.max(), a.astype(np.float64), standin.zeros(3, np.int64)  # each a new array (a reduction's 0-d one too)
    assert bus.COUNTS["alloc"] == 6


def test_device_names():
    assert device_of(standin.zeros(1)) == "standin" and device_of(np.zeros(1)) == "cpu"


def standin_model(monkeypatch, stage: int, on_standin: bool = True, param_dtype: str = "float32"):
    """A 3-group torch model sharded with its CPU tensors standing for CUDA ones (``MPIZERO_STANDIN=1``), or on
    the host."""
    import torch

    from mpizero.torch import shard, tensors

    monkeypatch.setattr(tensors, "STANDIN", on_standin)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    return model, shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage, param_dtype=param_dtype)


def backward_passes(model, count: int) -> None:
    import torch

    for i in range(count):
        model(torch.full((3, 4), 0.1 * (i + 1))).sum().backward()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_first_steps_held_gradients_wait_in_host_memory(monkeypatch, stage):
    model, zero = standin_model(monkeypatch, stage)
    backward_passes(model, 3)
    held = [a for g in zero.engine.groups for arrays in g.gradients.kept.values() for a, _ in arrays]
    waiting = [a for g in zero.engine.groups if g.gradients.waiting for a in g.gradients.waiting.grads.values()]
    assert len(waiting) == (6 if stage < 2 else 0)  # stages 0-1 pair passes: the third waits for a partner
    held += [standin.asnumpy(a) for a in waiting]  # encoded, then kept, at the step
    assert len(held) == 3 * 6 and all(isinstance(a, np.ndarray) for a in held)  # every tensor of every pass
    zero.step()
    assert array_module(zero.engine.groups[0].grad_shard) is standin
    on_device = {name: a.tobytes() for name, a in zero.master_params().items()}
    model, zero = standin_model(monkeypatch, stage, on_standin=False)
    backward_passes(model, 3)
    zero.step()
    assert {name: a.tobytes() for name, a in zero.master_params().items()} == on_device  # the host's bytes


@pytest.mark.parametrize("stage", [1, 3])
def test_a_bf16_model_on_the_standin_trains_to_the_hosts_bytes(monkeypatch, stage):
    """bfloat16 parameters through the bridge: 16-bit words in the engine on the device, widened into the float32
    tensors the model computes with, as the host's bfloat16 are."""
    results = {}
    for on_standin in (True, False):
        model, zero = standin_model(monkeypatch, stage, on_standin, param_dtype="bfloat16")
        for _ in range(2):
            backward_passes(model, 2)
            zero.step()
        with zero.gathered():
            shown = [p.detach().numpy().tobytes() for p in model.parameters()]
        results[on_standin] = shown, {name: a.tobytes() for name, a in zero.master_params().items()}
    assert results[True] == results[False]
    shown = np.frombuffer(results[True][0][0], np.float32)
    assert np.array_equal(shown, shown.astype(held.BFLOAT16).astype(np.float32))  # bfloat16 values, widened


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_plain_loops_copies_to_the_host_per_step_do_not_grow_with_backward_passes(monkeypatch, stage):
    """What a step copies back: the device stats of every group for the agreement, with the edit watch's
    fingerprints (taken after the last update and at this step's check) at stages 0-2, in one copy; no backward
    pass waits to learn what to hold (what it leaves out is spilled: ``group_encode``)."""
    model, zero = standin_model(monkeypatch, stage)
    backward_passes(model, 2)
    zero.step()  # the first step holds its gradients (above)
    copies = {}
    for passes in (2, 4):
        bus.COUNTS.clear()
        backward_passes(model, passes)
        zero.step()
        copies[passes] = bus.COUNTS["d2h"]
    assert len(zero.engine.groups) > 1
    assert copies[4] == copies[2] == 1, copies


def closure_of(model, inputs):
    """A ``step(closure)`` closure: a backward pass per input."""

    def closure():
        for x in inputs:
            model(x).sum().backward()

    return closure


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_closure_copies_no_counts_back_per_backward_pass(monkeypatch, stage):
    """A caller that can run the step again holds nothing on a device (``Keep.REDO``): per step only the device
    stats come back (every group's, with the edit watch's fingerprints), in one copy, whatever the passes and
    groups."""
    import torch

    model, zero = standin_model(monkeypatch, stage)
    inputs = [torch.full((3, 4), 0.1 * (i + 1)) for i in range(4)]
    zero.step(closure_of(model, inputs[:2]))  # the first step measures, and runs again
    copies = {}
    for passes in (2, 4):
        bus.COUNTS.clear()
        assert not zero.step(closure_of(model, inputs[:passes])).redo
        copies[passes] = bus.COUNTS["d2h"]
    groups = len(zero.engine.groups)
    assert copies[4] == copies[2] == 1 and groups > 1, copies


def spiked_run(monkeypatch, stage: int, on_standin: bool, closure: bool):
    """Two small steps, then one whose second pass is far beyond the scale they predict: the masters' bytes, the
    steps redone and those that kept elements beyond a cap."""
    import torch

    small, large = [torch.full((3, 4), 0.01)], [torch.full((3, 4), 0.01), torch.full((3, 4), 1e4)]
    model, zero = standin_model(monkeypatch, stage, on_standin=on_standin)
    for inputs in (small, small, large):
        if closure:
            zero.step(closure_of(model, inputs))
        else:
            closure_of(model, inputs)()
            zero.step()
            zero.zero_grad()
    masters = {name: a.tobytes() for name, a in zero.master_params().items()}
    return masters, zero.engine.scales.redone_steps, zero.engine.scales.kept_steps


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("closure", [True, False], ids=["closure", "plain"])
def test_elements_left_out_on_a_device_are_spilled_for_the_hosts_bytes(monkeypatch, stage, closure):
    """A gradient far beyond the scale predicted from the step before: the host holds its left-out elements, the
    device spills them (no pass waits, no step is redone) and adds them at the chosen scales: the same bytes."""
    on_device, redone, kept = spiked_run(monkeypatch, stage, True, closure)
    on_host, host_redone, _ = spiked_run(monkeypatch, stage, False, closure)
    assert on_device == on_host
    assert kept == 1 and redone == host_redone == (1 if closure else 0), (kept, redone)  # the first step's measure


@pytest.mark.parametrize("stage", [0, 3])
def test_a_wrong_decode_inside_the_update_gives_other_bytes_than_the_host(monkeypatch, stage):
    """The decode the update's kernel makes as it reads the sum (``arithmetic.Decoding``), flipping the lowest bit of
    each gradient it writes: the masters are no longer the host's (the checks above bite on it)."""
    from mpizero.core.reduce import arithmetic

    decode = arithmetic.Decoding.numpy

    def flipped(self, total, out):
        decode(self, total, out)
        out.view(np.uint32)[...] ^= np.uint32(1)

    on_host = spiked_run(monkeypatch, stage, False, closure=False)[0]
    assert spiked_run(monkeypatch, stage, True, closure=False)[0] == on_host
    monkeypatch.setattr(arithmetic.Decoding, "numpy", flipped)
    assert spiked_run(monkeypatch, stage, True, closure=False)[0] != on_host


@pytest.mark.parametrize("stage", [0, 3])
def test_an_overflowing_spill_runs_a_closures_step_again_and_stops_a_plain_loop_on_every_rank(monkeypatch, stage):
    """A spill of 2 slots for more left-out elements: ``step(closure)`` runs the pass again holding them on the
    host (the host's bytes); a plain loop, whose gradients are gone, is stopped with an error naming the way."""
    from mpizero.core.reduce import group_encode

    monkeypatch.setattr(group_encode, "spill_slots", lambda padded_numel: 2)
    on_device, redone, _ = spiked_run(monkeypatch, stage, True, closure=True)
    assert on_device == spiked_run(monkeypatch, stage, False, closure=True)[0] and redone == 2
    with pytest.raises(ZeroError, match=r"spill.*zero.step\(closure\)"):
        spiked_run(monkeypatch, stage, True, closure=False)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_engines_device_work_is_queued_on_torchs_current_stream(monkeypatch, tmp_path, stage):
    """Every way from torch into the engine (set-up, hooks, step, clipping, gathered, state dicts, save and load)
    queues its device work on torch's current stream (``mpizero.torch.streams``), none on CuPy's null stream."""
    import torch

    from mpizero.standin import cuda
    from mpizero.torch.streams import STANDIN_TORCH_STREAM

    cuda.LAUNCHES.clear()
    model, zero = standin_model(monkeypatch, stage)
    for _ in range(2):
        backward_passes(model, 2)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        zero.step()
    with zero.gathered(writeback=True), torch.no_grad():
        model[0].weight.mul_(0.5)
    full = model.state_dict()
    zero.save(str(tmp_path / "checkpoints"))
    zero.load_state_dict(full)
    zero.load(str(tmp_path / "checkpoints"))
    assert cuda.LAUNCHES[STANDIN_TORCH_STREAM] > 100 and cuda.LAUNCHES[0] == 0, dict(cuda.LAUNCHES)


def test_a_meta_device_model_on_the_standin_trains_to_the_hosts_bytes(monkeypatch):
    """Built on the meta device, materialized piece by piece into the stand-in's arrays, as onto a GPU."""
    import torch

    import mpizero
    from mpizero.torch import shard, tensors

    masters = {}
    for on_standin in (False, True):
        monkeypatch.setattr(tensors, "STANDIN", on_standin)
        torch.manual_seed(0)
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        zero = shard(model, mpizero.AdamW(lr=1e-3), stage=3)
        backward_passes(model, 2)
        zero.step()
        assert array_module(zero.engine.groups[0].grad_shard) is (standin if on_standin else np)
        masters[on_standin] = {name: a.tobytes() for name, a in zero.master_params().items()}
    assert masters[True] == masters[False]


def test_forward_and_backward_on_a_users_stream_then_step_on_another_give_the_hosts_bytes(monkeypatch):
    """``with torch.cuda.stream(s):`` around forward and backward, ``step()`` outside it, at stage 3: the engine's
    work on ``s`` (gathers, gradient reductions) and on the default stream (updates of the param shards) is ordered
    by events (``TorchStream.follow``; the lenders' wait, ``TorchStream.left``, where gradients were lent before
    the engine met a second stream); without them the stand-in, running late, gives other bytes. In bfloat16, so
    that a kernel on ``s`` reads the param shards (widening them for the forward): in float32 one rank's forward
    reads them in place, through torch, whose reads of shared memory the stand-in runs at once."""
    from mpizero.torch import streams

    current = [streams.STANDIN_TORCH_STREAM]  # what stands for torch's current stream
    monkeypatch.setattr(streams, "torch_stream_pointer", lambda device: current[0])

    def trained(on_standin: bool) -> dict:
        model, zero = standin_model(monkeypatch, 3, on_standin, param_dtype="bfloat16")
        for _ in range(2):
            current[0] = 0xB0B  # the user's stream
            backward_passes(model, 2)
            current[0] = streams.STANDIN_TORCH_STREAM
            zero.step()
        return {name: a.tobytes() for name, a in zero.master_params().items()}

    on_host = trained(on_standin=False)
    assert trained(on_standin=True) == on_host
    monkeypatch.setattr(streams.TorchStream, "follow", lambda self, stream: None)
    monkeypatch.setattr(streams.TorchStream, "lend", lambda self, tensor, array: array)  # no lender joins either
    assert trained(on_standin=True) != on_host


def last_entered(entered: list, zero, module, args) -> None:
    entered.append(zero.torch_stream.last)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_forward_on_a_users_stream_enters_the_engine_before_its_first_module(monkeypatch, stage):
    """At stages 0-2 no gather enters the engine before a forward, so ``order_forward`` does: a forward on the
    user's stream after ``step()`` on another first makes that stream wait for the step's update (``follow``),
    as stage 3's gathers do; the bytes stay the host's."""
    from mpizero.torch import streams

    current = [streams.STANDIN_TORCH_STREAM]
    monkeypatch.setattr(streams, "torch_stream_pointer", lambda device: current[0])
    on_host = {}
    for on_standin in (False, True):
        model, zero = standin_model(monkeypatch, stage, on_standin)
        entered = []  # the stream the engine was last entered on, as each forward's first module starts
        model[0].register_forward_pre_hook(partial(last_entered, entered, zero))
        for _ in range(2):
            current[0] = 0xB0B  # the user's stream
            backward_passes(model, 2)
            current[0] = streams.STANDIN_TORCH_STREAM
            zero.step()
        masters = {name: a.tobytes() for name, a in zero.master_params().items()}
        if on_standin:
            assert [stream.ptr for stream in entered] == [0xB0B] * 4
            assert masters == on_host
        on_host = masters


def test_a_stream_that_lent_gradients_waits_for_the_entries_on_other_streams(monkeypatch):
    """Stage 1, set up and three backward passes on the default stream, ``step()`` on another: the third pass's
    gradients, waiting for a partner (paired encode), are torch's own memory, read by the step. Lent before the
    engine met a second stream, none is recorded: at the step's end the default stream waits for an event after
    the step's last work (``TorchStream.left``), so torch's allocator cannot give that memory to later work there
    before the step has read it. Gradients lent after that are recorded (``record_stream``) on each stream the
    engine enters. A loop on one stream waits for nothing and records nothing."""
    from mpizero.standin import cuda, late
    from mpizero.torch import streams

    default = streams.STANDIN_TORCH_STREAM
    current = [default]
    monkeypatch.setattr(streams, "torch_stream_pointer", lambda device: current[0])
    waits = []  # (the stream that waits, the stream it waits on, where that stream's queue then stood)
    wait_event = cuda.Stream.wait_event

    def logged(stream, event):
        waits.append((stream.ptr, event.stream.ptr, event.position))
        wait_event(stream, event)

    monkeypatch.setattr(cuda.Stream, "wait_event", logged)
    recorded = []
    monkeypatch.setattr(streams, "record_stream", lambda tensor, device: recorded.append(current[0]))
    model, zero = standin_model(monkeypatch, 1)
    backward_passes(model, 3)
    assert waits == [] and recorded == [] and all(g.gradients.waiting.grads for g in zero.engine.groups)
    current[0] = 0xB0B
    zero.step()
    assert [(w, on) for w, on, _ in waits] == [(0xB0B, default), (default, 0xB0B)] and recorded == []
    assert waits[-1][2] == late.position(0xB0B) > 0  # after the step's last launch
    waits.clear()
    current[0] = default
    backward_passes(model, 2)
    assert [(w, on) for w, on, _ in waits] == [(default, 0xB0B)]  # after the step's update
    assert recorded == [default] * (2 * 6)  # each gradient, as it is lent
    del model, zero
    gc.collect()  # the first model's clean-up enters its engine too
    model, zero = standin_model(monkeypatch, 1)
    waits.clear()
    recorded.clear()
    for _ in range(2):
        backward_passes(model, 3)
        zero.step()
    assert waits == [] and recorded == []
