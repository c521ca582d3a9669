"""Several nodes on one machine: one network namespace per node, joined by a bridge, for tests across nodes.

Each node is a network namespace with its own address on a private /24, a
veth pair to a bridge that lives in a namespace of its own, and, for every
command run on it, its own hostname (UTS namespace) and its own ``/etc/hosts``
(bind-mounted in a private mount namespace). Nothing is added to the host's own
network: every interface and address is made inside the namespaces. Nodes share
the machine's filesystem, as cluster nodes share a network filesystem, and its
kernel, so MPI libraries may still pass bytes between them through shared
memory unless told to use TCP (``TCP_ENV``).

Names carry this process's id and a random tag, so two runs cannot collide;
``Cluster.close`` (or leaving ``nodes(...)``) always deletes what was made, and a
new cluster first deletes namespaces left behind by runs whose process is gone.

Usage::

    with nodes(2) as cluster:                       # raises NodesUnavailable with the reason
        done = cluster.mpiexec([2, 2], ["-m", "mpizero", "verify"], timeout=120)
        sent, received = cluster.link_bytes(1)      # bytes on node 1's link so far

In pytest, ``cluster_or_skip(2)`` skips with the printed reason where namespaces cannot be made.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpizero.comm.job.launcher import mpiexec as mpiexec_path

PREFIX = "mpizero"
NETNS_DIR = Path("/run/netns")
SUBNET = "10.213.7"  # private, and only ever inside these namespaces
TCP_ENV = {"UCX_TLS": "self,tcp"}  # MPICH over UCX: inter-node bytes go over the link, not shared memory
THREADS_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


class NodesUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, no permission); the message says why."""


@dataclass(frozen=True)
class Node:
    """One node: its hostname, its network namespace and its address on the cluster's /24."""

    index: int
    name: str
    netns: str
    address: str

    @property
    def bridge_port(self) -> str:
        """The bridge-side end of this node's veth pair (in the bridge's namespace)."""
        return f"port{self.index}"


class Cluster:
    """Namespace nodes joined by a bridge; run commands and ``mpiexec`` on them. Use ``nodes(count)`` to make one."""

    def __init__(self, count: int, root: Path) -> None:
        if count < 1 or count > 200:
            raise ValueError(f"node count must be in 1..200, got {count}")
        tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.root = root
        self.bridge_netns = f"{tag}-br"
        self.nodes = [Node(i, f"node{i}", f"{tag}-n{i}", f"{SUBNET}.{i + 1}") for i in range(count)]
        self.hosts_file = root / "hosts"
        self.on_node = root / "on-node"  # on-node NAME CMD...: run CMD on node NAME
        self.launcher = root / "hydra-ssh"  # what hydra calls instead of ssh
        self._made: list[str] = []

    # Set-up and tear-down.

    def open(self) -> Cluster:
        """Make the bridge, the nodes and their links (tears down what it made if any step fails)."""
        try:
            self._add_netns(self.bridge_netns)
            _ip(f"-n {self.bridge_netns} link add br0 type bridge")
            _ip(f"-n {self.bridge_netns} link set br0 up")
            for node in self.nodes:
                self._add_node(node)
            self._write_files()
        except BaseException:
            self.close()
            raise
        return self

    def _add_netns(self, name: str) -> None:
        _ip(f"netns add {name}")
        self._made.append(name)
        _ip(f"-n {name} link set lo up")

    def _add_node(self, node: Node) -> None:
        self._add_netns(node.netns)
        _ip(f"-n {node.netns} link add eth0 type veth peer name {node.bridge_port} netns {self.bridge_netns}")
        _ip(f"-n {self.bridge_netns} link set {node.bridge_port} master br0 up")
        _ip(f"-n {node.netns} addr add {node.address}/24 dev eth0")
        _ip(f"-n {node.netns} link set eth0 up")

    def _write_files(self) -> None:
        lines = ["127.0.0.1 localhost"] + [f"{n.address} {n.name}" for n in self.nodes]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        cases = "\n".join(f"    {n.name}) netns={n.netns} ;;" for n in self.nodes)
        self.on_node.write_text(ON_NODE.format(cases=cases, netns_dir=NETNS_DIR, hosts=self.hosts_file))
        self.launcher.write_text(HYDRA_SSH.format(on_node=self.on_node))
        for script in (self.on_node, self.launcher):
            script.chmod(0o755)

    def close(self) -> None:
        """Delete every namespace this cluster made (their interfaces go with them) and its files."""
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self._made.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    # Running on a node.

    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` on node ``node`` (its network, hostname and ``/etc/hosts``)."""
        return [str(self.on_node), self.nodes[node].name, *argv]

    def run(self, node: int, argv: Sequence[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on node ``node`` and wait (text output captured unless ``kwargs`` say otherwise)."""
        kwargs = {"capture_output": True, "text": True, **kwargs}
        return subprocess.run(self.command(node, argv), timeout=timeout, check=False, **kwargs)

    def popen(self, node: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on node ``node`` in a session of its own; the caller waits for it or kills it."""
        return subprocess.Popen(self.command(node, argv), start_new_session=True, **kwargs)

    # MPI across nodes.

    def hosts(self, ranks_per_node: Sequence[int]) -> str:
        """Hydra's ``-hosts`` value: ``node0:2,node1:2`` for ``[2, 2]`` (nodes with 0 ranks left out)."""
        if len(ranks_per_node) > len(self.nodes):
            raise ValueError(f"{len(ranks_per_node)} nodes asked for, the cluster has {len(self.nodes)}")
        return ",".join(f"{self.nodes[i].name}:{n}" for i, n in enumerate(ranks_per_node) if n > 0)

    def mpiexec_command(self, ranks_per_node: Sequence[int], args: Sequence[str], *, ranks: int = 0) -> list[str]:
        """``mpiexec``, run on node 0, starting ``sys.executable ARGS`` with ``ranks_per_node[i]`` ranks on node i.

        ``ranks`` above ``sum(ranks_per_node)``: hydra deals them out round the nodes, ``ranks_per_node[i]`` at
        a time (``[1, 1]`` with 4 ranks: ranks 0 and 2 on node 0, 1 and 3 on node 1).
        """
        ranks = ranks or sum(ranks_per_node)
        launch = ["-launcher", "ssh", "-launcher-exec", str(self.launcher), "-hosts", self.hosts(ranks_per_node)]
        return self.command(0, [mpiexec_path(), *launch, "-n", str(ranks), sys.executable, *args])

    def start_mpiexec(
        self,
        ranks_per_node: Sequence[int],
        args: Sequence[str],
        env: dict | None = None,
        cwd: str | Path | None = None,
        *,
        ranks: int = 0,
    ) -> subprocess.Popen:
        """Start ``mpiexec_command`` in a session of its own, over TCP between nodes; output captured as text."""
        full_env = {**os.environ, **THREADS_ENV, **TCP_ENV, **(env or {})}
        return subprocess.Popen(
            self.mpiexec_command(ranks_per_node, args, ranks=ranks),
            env=full_env,
            cwd=cwd,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def mpiexec(
        self,
        ranks_per_node: Sequence[int],
        args: Sequence[str],
        timeout: float = 120,
        env: dict | None = None,
        cwd: str | Path | None = None,
        *,
        ranks: int = 0,
    ) -> subprocess.CompletedProcess:
        """Run ``start_mpiexec`` to the end; on timeout kill its session and raise AssertionError with the output."""
        proc = self.start_mpiexec(ranks_per_node, args, env, cwd, ranks=ranks)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc)
            out, err = proc.communicate()
            where = f"mpiexec on {list(ranks_per_node)} {list(args)}"
            raise AssertionError(f"{where} timed out after {timeout}s\n{out}\n{err}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # The links.

    def link_bytes(self, node: int) -> tuple[int, int]:
        """Bytes node ``node`` has sent and received on its link so far (its ``eth0`` counters)."""
        shown = json.loads(_ip(f"-n {self.nodes[node].netns} -s -j link show eth0"))
        stats = shown[0]["stats64"]
        return stats["tx"]["bytes"], stats["rx"]["bytes"]

    def cap(self, rate: str = "1gbit") -> None:
        """Cap every link to ``rate`` each way (a token bucket on both ends of each veth pair)."""
        for node in self.nodes:
            for netns, dev in ((node.netns, "eth0"), (self.bridge_netns, node.bridge_port)):
                _run(
                    [
                        "tc",
                        "-n",
                        netns,
                        "qdisc",
                        "replace",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        rate,
                        "burst",
                        "256kb",
                        "latency",
                        "50ms",
                    ]
                )


ON_NODE = """#!/bin/sh
# on-node NAME CMD...: run CMD in node NAME's network namespace, with hostname NAME and the cluster's /etc/hosts.
case "$1" in
{cases}
    *) echo "on-node: no node named $1" >&2; exit 255 ;;
esac
exec nsenter --net="{netns_dir}/$netns" unshare -m -u \\
    sh -c 'hostname "$0" && mount --bind "{hosts}" /etc/hosts && exec "$@"' "$@"
"""

HYDRA_SSH = """#!/bin/sh
# Hydra's ssh: skip the options it passes (-x), then run the command line it gives on the named node.
while [ "${{1#-}}" != "$1" ]; do shift; done
host="$1"; shift
exec "{on_node}" "$host" sh -c "$*"
"""


def _run(argv: Sequence[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NodesUnavailable(f"{shlex.join(argv)} failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _ip(args: str) -> str:
    """Run ``ip ARGS`` (words split on spaces); raise NodesUnavailable with its error if it fails."""
    return _run(["ip", *args.split()])


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the session ``proc`` leads (``start_mpiexec``/``popen``): mpiexec, its launchers and its ranks."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def unavailable_reason() -> str | None:
    """Why namespace nodes cannot be made here, or None if they may be."""
    if os.geteuid() != 0:
        return "namespace nodes need root (network namespaces, bind mounts)"
    missing = [tool for tool in ("ip", "tc", "nsenter", "unshare", "hostname", "mount") if not shutil.which(tool)]
    return f"namespace nodes need {', '.join(missing)} on PATH" if missing else None


def remove_stale() -> None:
    """Delete namespaces that earlier runs left behind (their process, named in the namespace, is gone)."""
    if not NETNS_DIR.is_dir():
        return
    for entry in NETNS_DIR.iterdir():
        parts = entry.name.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not Path(f"/proc/{parts[1]}").exists():
            subprocess.run(["ip", "netns", "del", entry.name], capture_output=True, check=False)


@contextlib.contextmanager
def nodes(count: int = 2) -> Iterator[Cluster]:
    """Make ``count`` namespace nodes for the ``with`` block, always torn down after; NodesUnavailable if impossible."""
    reason = unavailable_reason()
    if reason:
        raise NodesUnavailable(reason)
    remove_stale()
    cluster = Cluster(count, Path(tempfile.mkdtemp(prefix=f"{PREFIX}-nodes-")))
    try:
        yield cluster.open()
    finally:
        cluster.close()


@contextlib.contextmanager
def cluster_or_skip(count: int = 2) -> Iterator[Cluster]:
    """``nodes(count)`` in a test: skip it, with the reason, where namespace nodes cannot be made."""
    import pytest

    with contextlib.ExitStack() as stack:
        try:
            cluster = stack.enter_context(nodes(count))
        except NodesUnavailable as why:
            pytest.skip(f"no namespace nodes: {why}")
        yield cluster
