"""Test helpers for code built on mpizero, and a pytest plugin for sessions under ``mpiexec``.

Bitwise checks, agreed across ranks so every rank passes or fails the same way::

    from mpizero.testing import assert_bitwise_equal
    assert_bitwise_equal(engine, reference)  # full master params vs reference.params, raw bytes

The plugin (``pytest_plugins = ["mpizero.testing"]`` in a top-level conftest)
acts only in ``mpiexec -n N python -m pytest --with-mpi`` sessions with N > 1:
rank 0 alone prints pytest's report, and a test that fails on any rank prints
its failure and ends the whole job with ``MPI_Abort``, so no other rank is left
waiting forever in a collective the failed rank will never enter.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping

import numpy as np
import pytest

from mpizero.arrays import to_host

ABORT_STATUS = 1
REPORT_SECONDS = 0.5  # a failing rank waits this long after printing its report before it aborts the job
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def first_difference(actual: Mapping, expected: Mapping) -> str | None:
    """Describe the first byte-level difference between two dicts of arrays, or return None."""
    if list(actual) != list(expected):
        return f"tensor names differ: {list(actual)} vs reference {list(expected)}"
    for name, want in expected.items():
        got, want = np.asarray(to_host(actual[name])), np.asarray(to_host(want))
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{name!r} is {got.dtype}{list(got.shape)}, reference {want.dtype}{list(want.shape)}"
        bits = _BITS[got.dtype.itemsize]
        differ = np.flatnonzero(got.reshape(-1).view(bits) != want.reshape(-1).view(bits))
        if differ.size:
            i = int(differ[0])
            where = tuple(int(k) for k in np.unravel_index(i, got.shape))
            return (
                f"{name!r}{list(where)}: {_show(got, i)} != reference {_show(want, i)} "
                f"({differ.size} of {got.size} elements differ)"
            )
    return None


def bitwise_mismatch(engine, reference) -> str | None:
    """Compare ``engine.master_params()`` with ``reference.params`` bit for bit on every rank.

    Collective: call it on every rank. Returns None when every rank sees equal
    bytes; otherwise the same message on every rank, naming the tensor, the
    first differing index, both values and the ranks that saw it.
    """
    problem = first_difference(engine.master_params(), reference.params)
    ranks_by_problem: dict[str, list[int]] = {}
    for rank, text in enumerate(engine.collectives.allgather_object(problem, "the bitwise comparison")):
        if text is not None:
            ranks_by_problem.setdefault(text, []).append(rank)
    if not ranks_by_problem:
        return None
    found = "; ".join(f"{text} (seen by ranks {ranks})" for text, ranks in ranks_by_problem.items())
    return f"master params differ from the reference: {found}"


def assert_bitwise_equal(engine, reference) -> None:
    """Raise ``AssertionError`` on every rank unless the engine's master params equal the reference's bytes."""
    message = bitwise_mismatch(engine, reference)
    if message is not None:
        raise AssertionError(message)


def _show(values: np.ndarray, index: int) -> str:
    value = values.reshape(-1)[index]
    bits = value.view(_BITS[values.dtype.itemsize])
    return f"{float(value)!r} (0x{int(bits):0{2 * values.dtype.itemsize}x})"


# pytest plugin ------------------------------------------------------------


class MPISession:
    """Hooks for one rank of a pytest session that runs on several MPI ranks."""

    def __init__(self, comm) -> None:
        self.comm = comm

    def pytest_runtest_logreport(self, report) -> None:
        """A test failed here (set-up, call or teardown): end every rank, the others may be waiting on it."""
        if report.failed:
            self._abort(report, f"failed in {report.when}")

    def pytest_collectreport(self, report) -> None:
        """Collection failed here: the other ranks would run tests this rank never reaches, so end them."""
        if report.failed:
            self._abort(report, "failed to collect")

    def _abort(self, report, what: str) -> None:
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        sections = "".join(f"\n--- {title} ---\n{text}" for title, text in report.sections)
        print(
            f"\nmpizero.testing: rank {rank} of {size}: {report.nodeid} {what}; aborting all ranks\n"
            f"{report.longreprtext}{sections}",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        time.sleep(REPORT_SECONDS)  # mpiexec forwards the report before the abort ends its forwarding (1 in 6 lost)
        self.comm.Abort(ABORT_STATUS)


@pytest.hookimpl(trylast=True)  # after the terminal reporter exists, so rank > 0 can silence it
def pytest_configure(config) -> None:
    """Under ``--with-mpi`` or ``--only-mpi`` on several ranks: abort on any failure; rank 0 alone reports."""
    if not (config.getoption("--with-mpi", default=False) or config.getoption("--only-mpi", default=False)):
        return
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        return
    config.pluginmanager.register(MPISession(comm), "mpizero-mpi-session")
    if comm.Get_rank() > 0:
        _silence_terminal(config)


def _silence_terminal(config) -> None:
    """Send this rank's pytest report to /dev/null; its failures still reach stderr through ``MPISession``."""
    plugins = config.pluginmanager
    if plugins.get_plugin("terminalreporter") is None:
        return
    plugins.unregister(name="terminalreporter")
    quiet = open(os.devnull, "w")  # noqa: SIM115 - open for the whole session
    plugins.register(pytest.TerminalReporter(config, quiet), "terminalreporter")
