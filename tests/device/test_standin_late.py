"""The stand-in running late (``mpizero.standin.late``) and checking kernel arguments as CuPy does
(``mpizero.standin.arguments``): what a GPU would get wrong without a wait, or refuse, goes wrong or is refused on
the CPU too."""

import numpy as np
import pytest

from mpizero import standin
from mpizero.standin import cuda, late


def test_work_waits_on_its_stream_until_an_ordering_makes_it_due():
    with late.running():
        a, b = standin.zeros(3, np.int64), standin.zeros(3, np.int64)
        side = cuda.Stream(non_blocking=True)
        a.fill(7)  # on the current stream
        side.wait_event(cuda.get_current_stream().record())
        with side:
            b[...] = a  # on the side stream, after the event
        assert a.underneath.tolist() == b.underneath.tolist() == [0, 0, 0]  # nothing has run
        side.synchronize()  # the side stream runs, and first the current one up to the event
        assert b.underneath.tolist() == [7, 7, 7]
        a.fill(1)
        assert float(a.sum()) == 3.0  # later work on the stream, and a read by the host, make it due


def test_a_stream_that_does_not_wait_reads_what_was_there():
    with late.running():
        a, b = standin.zeros(3, np.int64), standin.zeros(3, np.int64)
        side = cuda.Stream(non_blocking=True)
        a.fill(7)
        with side:
            b[...] = a  # no wait_event: the race a GPU may lose
        side.synchronize()
        assert b.underneath.tolist() == [0, 0, 0]


def test_events_make_due_only_what_was_queued_before_them():
    with late.running():
        a = standin.zeros(2, np.int64)
        a.fill(1)
        first = cuda.get_current_stream().record()
        a.fill(2)
        first.synchronize()
        assert a.underneath.tolist() == [1, 1]
        cuda.get_current_stream().synchronize()
        assert a.underneath.tolist() == [2, 2]


def test_a_copy_to_pinned_memory_lands_with_its_stream_and_one_to_pageable_memory_at_once():
    with late.running():
        a = standin.asarray(np.arange(3, dtype=np.int64))
        pinned, pageable = standin.empty_pinned(3, np.int64), np.zeros(3, np.int64)
        a.get(out=pinned, blocking=False)
        assert pinned.tolist() == [-1, -1, -1]  # empty_pinned's garbage, until the stream runs
        a.get(out=pageable, blocking=False)  # returns once done, so the stream's earlier work is done too
        assert pageable.tolist() == pinned.tolist() == [0, 1, 2]


def test_empty_memory_holds_garbage_running_late():
    with late.running():
        assert np.isnan(standin.empty(3, np.float32).get()).all()
        assert (standin.empty_like(standin.zeros(2, np.int64)).get() == -1).all()
        assert (standin.empty_pinned(4, np.int32) == -1).all()


def copy_kernel():
    def body(x, out):
        out[...] = x

    return standin.kernel(body, "float32 x", "float32 out")


def test_kernel_arguments_are_checked_as_cupy_checks_them():
    out = standin.zeros(2, np.float32)
    with pytest.raises(TypeError, match="Type is mismatched. x float64 float32"):
        copy_kernel()(standin.zeros(2, np.float64), out)
    with pytest.raises(TypeError, match="Type is mismatched. out int32 float32"):
        copy_kernel()(standin.zeros(2, np.float32), standin.zeros(2, np.int32))
    with pytest.raises(TypeError, match="Output arguments must be cupy.ndarray"):
        copy_kernel()(standin.zeros(2, np.float32), np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="Wrong number of arguments"):
        copy_kernel()(standin.zeros(2, np.float32))
    with pytest.raises(TypeError, match="Unsupported type"):
        copy_kernel()(np.array(1.5, np.float32), out)  # a 0-d host array, which CuPy refuses
    copy_kernel()(np.float64(1.5), out)  # a scalar: passed by value, cast to the parameter's type
    assert out.get().tolist() == [1.5, 1.5]
    same = standin.kernel(lambda x, y, out: None, "T x, T y", "T out")
    with pytest.raises(TypeError, match="Type is mismatched. y float64 float32 T"):
        same(out, standin.zeros(2, np.float64), out)


def test_zero_dimensional_host_arrays_are_refused_beside_device_arrays():
    with pytest.raises(TypeError, match="Unsupported type"):
        standin.zeros(2) + np.array(1.0)
    assert (standin.zeros(2) + np.float64(1.0)).get().tolist() == [1.0, 1.0]
