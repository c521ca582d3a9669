"""A throw-away SLURM cluster for tests: munged, slurmctld and one slurmd per node, all in one temporary directory.

Nothing outside that directory is read or written: the cluster has its own
munge key and socket, its own ``slurm.conf`` (named through ``SLURM_CONF``),
state, spool and log directories, and ports no other process was listening on.
``SlurmCluster.close`` (or leaving ``slurm_cluster(...)``) kills every process
started for it, and every process whose environment names its ``slurm.conf``
(slurmstepd and the job's ranks), then deletes the directory.

A node is a name, an address and a way to run a command on it: on this machine
(``local_node()``), or in a namespace node of ``tests/launch/cluster/nodes.py``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from slurm.config import slurm_conf

DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")
CLIENTS = ("sbatch", "srun", "sinfo", "scontrol", "scancel")
CPUS_PER_NODE = 8  # advertised (SlurmdParameters=config_overrides), so a 2-core machine can hold 4 ranks a node


@dataclass(frozen=True)
class SlurmNode:
    """One node: its SLURM name, the address its slurmd listens on, and how to run a command there."""

    name: str
    address: str
    wrap: Callable[[list[str]], list[str]] = field(default=list)


def local_node() -> SlurmNode:
    """This machine as the one node of a cluster."""
    return SlurmNode(socket.gethostname(), "127.0.0.1")


def unavailable_reason() -> str | None:
    """Why a SLURM cluster cannot be brought up here, or None if it can."""
    if os.geteuid() != 0:
        return "a test SLURM cluster runs its daemons as root"
    missing = [tool for tool in (*DAEMONS, *CLIENTS) if not shutil.which(tool, path=f"{os.environ['PATH']}:/usr/sbin")]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge; .ci/run does it as root)"
    return None


def free_ports(count: int) -> list[int]:
    """``count`` different TCP ports nothing listens on now."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]


class SlurmCluster:
    """munged, slurmctld on the first node and a slurmd on each node, in ``root``; use ``slurm_cluster(...)``."""

    def __init__(self, nodes: Sequence[SlurmNode], root: Path) -> None:
        self.nodes, self.root = list(nodes), root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "PATH": f"{os.environ['PATH']}:/usr/sbin"}
        self._daemons: list[subprocess.Popen] = []

    def open(self) -> SlurmCluster:
        """Start the daemons and wait until every node is idle (tears everything down if that fails)."""
        try:
            self.root.chmod(0o755)  # munged refuses a socket directory that others cannot read
            for sub in ("state", "log", *(f"spool/{node.name}" for node in self.nodes)):
                (self.root / sub).mkdir(parents=True)
            self._start_munged()
            self.conf.write_text(slurm_conf(self.root, self.nodes, *free_ports(2), CPUS_PER_NODE))
            self._start(self.nodes[0], ["slurmctld", "-D", "-c", "-f", str(self.conf)], "slurmctld")
            for node in self.nodes:
                self._start(node, ["slurmd", "-D", "-f", str(self.conf), "-N", node.name], f"slurmd-{node.name}")
            self._wait_idle(timeout=30)
        except BaseException:
            self.close()
            raise
        return self

    def _start_munged(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        argv = ["munged", "-F", "-f", f"--socket={self.root / 'munge.sock'}", f"--key-file={key}"]
        files = [f"--{what}-file={self.root / ('munged.' + what)}" for what in ("log", "pid", "seed")]
        self._start(None, argv + files, "munged")
        self._wait(lambda: (self.root / "munge.sock").exists(), 10, "munged to make its socket")

    def _start(self, node: SlurmNode | None, argv: list[str], name: str) -> None:
        with open(self.root / "log" / f"{name}.out", "w") as log:
            command = node.wrap(argv) if node else argv
            proc = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._daemons.append(proc)

    def _wait_idle(self, timeout: float) -> None:
        def idle() -> bool:
            states = self.client(["sinfo", "-h", "-N", "-o", "%T"], timeout=10).stdout.split()
            return len(states) == len(self.nodes) and all(s == "idle" for s in states)

        self._wait(idle, timeout, f"{len(self.nodes)} idle nodes")

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"not within {timeout}s"
                raise RuntimeError(f"SLURM test cluster: waiting for {what}: {why}\n{self.logs()}")
            time.sleep(0.1)

    def client(self, argv: list[str], timeout: float, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
        """Run a SLURM client command (sbatch, sinfo, ...) on the first node, against this cluster."""
        full_env = {**self.env, **(env or {})}
        command = self.nodes[0].wrap(argv)
        return subprocess.run(command, env=full_env, cwd=cwd, capture_output=True, text=True, timeout=timeout)

    def sbatch(self, args: list[str], timeout: float, env: dict | None = None, cwd=None) -> tuple[str, str]:
        """Submit ``sbatch ARGS``, wait for the job to end; return its final state (``COMPLETED``, ...) and output."""
        output = self.root / f"job-{time.monotonic_ns()}.out"
        done = self.client(["sbatch", "--parsable", f"--output={output}", *args], 30, env, cwd)
        if done.returncode != 0:
            return "NOT SUBMITTED", done.stderr
        job = done.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while (state := self.job_state(job)) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", ""):
            if time.monotonic() > deadline:
                self.client(["scancel", "--full", job], timeout=10)
                raise AssertionError(f"job {job} ({args}) still {state} after {timeout}s\n{self.read(output)}")
            time.sleep(0.2)
        return state, self.read(output)

    def job_state(self, job: str) -> str:
        """The job's state as ``scontrol`` tells it (no accounting database here)."""
        shown = self.client(["scontrol", "-o", "show", "job", job], timeout=10).stdout
        fields = dict(word.split("=", 1) for word in shown.split() if "=" in word)
        return fields.get("JobState", "")

    @staticmethod
    def read(path: Path) -> str:
        """A file's text, or '' if it was never written."""
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        """Every daemon's log, for a failure message."""
        return "\n".join(f"== {p.name}\n{self.read(p)[-2000:]}" for p in sorted((self.root / "log").glob("*")))

    def close(self) -> None:
        """Kill every process started for this cluster (jobs included) and delete its directory."""
        for proc in self._daemons:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in pids_with_env("SLURM_CONF", str(self.conf)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


def pids_with_env(name: str, value: str) -> list[int]:
    """Processes whose environment has ``name=value`` (this cluster's conf path is unique to it)."""
    wanted, found = f"{name}={value}".encode(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if wanted in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return found


@contextlib.contextmanager
def slurm_cluster(nodes: Sequence[SlurmNode]) -> Iterator[SlurmCluster]:
    """A running cluster of ``nodes`` for the ``with`` block, always torn down after."""
    cluster = SlurmCluster(nodes, Path(tempfile.mkdtemp(prefix="mpizero-slurm-")))
    try:
        yield cluster.open()
    finally:
        cluster.close()
