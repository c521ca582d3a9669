"""One device per local rank (``mpizero/comm/local_device.py``), on the stand-in with several fake devices."""

import re

import pytest
from mpirun import run_mpi_ok

from mpizero.standin import cuda


def test_each_rank_uses_its_place_on_the_host_modulo_the_devices_and_says_so():
    """3 ranks on one host with 2 devices: ranks 0 and 2 share device 0, rank 1 has device 1; the run trains."""
    train = ["-m", "mpizero", "train", "--device", "standin", "--steps", "1", "--log-every", "1"]
    out = run_mpi_ok(3, train, timeout=120, env={cuda.DEVICES_ENV_VAR: "2"})
    said = re.search(r"^devices \(standin\): \S+: ranks 0, 1, 2 on devices (.*)$", out, re.M)
    assert said and said.group(1) == "0, 1, 0", out
    assert "step     1" in out, out


def test_the_standin_device_is_current_once_used_and_refuses_one_it_does_not_have(monkeypatch):
    monkeypatch.setenv(cuda.DEVICES_ENV_VAR, "4")
    assert cuda.runtime.getDeviceCount() == 4
    with cuda.Device(3):
        assert cuda.Device().id == 3
    assert cuda.Device().id == 0
    with pytest.raises(ValueError, match="has 4 devices"):
        cuda.Device(4)
