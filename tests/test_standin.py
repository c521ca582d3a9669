"""The CPU stand-in for CuPy (``mpizero.standin``) refuses what CuPy refuses and counts what crosses the bus, so the
device code paths that run on it are held to CuPy's rules without a GPU."""

import numpy as np
import pytest

from mpizero import standin
from mpizero.arrays import array_module, device_of, to_host, write
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
    with pytest.raises(TypeError, match="Unsupported type"):
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


def test_device_names():
    assert device_of(standin.zeros(1)) == "standin" and device_of(np.zeros(1)) == "cpu"
