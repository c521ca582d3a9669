"""The ``slurm.conf`` of a test cluster: the smallest settings that run MPI jobs on any Linux box, no cgroups."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

SETTINGS = """\
ClusterName=mpizero{ctld_port}
SlurmctldHost={head}({head_address})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
# No cgroups: track a job's processes through /proc and bind no CPUs (Slurm 22.05 has no CgroupPlugin=disabled).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Count CPUs only, let a node advertise more CPUs than it has, and let jobs share them.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
"""


def slurm_conf(root: Path, nodes: Sequence, ctld_port: int, slurmd_port: int, cpus: int) -> str:
    """The text of ``slurm.conf`` for ``nodes`` (``.name``, ``.address``), the first one running slurmctld."""
    head = nodes[0]
    text = SETTINGS.format(
        root=root, head=head.name, head_address=head.address, ctld_port=ctld_port, slurmd_port=slurmd_port
    )
    lines = [f"NodeName={n.name} NodeAddr={n.address} CPUs={cpus} State=UNKNOWN" for n in nodes]
    names = ",".join(n.name for n in nodes)
    lines.append(f"PartitionName=test Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES")
    return text + "\n".join(lines) + "\n"
