"""``verify --against cpu``: the engine on a device against the engine on the host, fed the same gradients.

The trainer computes each gradient once, on the host, from the host engine's parameters; ``Mirrored`` makes
every engine call on the device engine too, with the gradients copied there, and compares what the two hold
bit for bit: the full params each stage 3 gather makes, each step's result, and after every step the params,
master and optimizer state each rank holds. A wrong device kernel (encode, decode, update) or device path
(staging, gathers) is thus a mismatch with the host's bytes, which ``verify`` (on the CPU) holds to the
single-rank reference; a reference on the device would run the same kernels and agree with them. The models'
forward and backward are not compared: a device's matrix products sum in another order than the host's BLAS.
"""

from __future__ import annotations

from mpizero.arrays import device_module, to_device
from mpizero.cli.bitwise import Mismatch, first_difference
from mpizero.cli.verify_runs import build_engine, build_model, make_optimizer, micro_batches_at, synthetic_batch
from mpizero.comm.paths import CommPaths
from mpizero.core.precision import PRECISIONS
from mpizero.training.trainer import Trainer

SIDES = ("device", "host")


class Diverged(Exception):
    """The two engines ended a step differently (redone, skipped, or another norm): agreed, so raised on every
    rank at the same call."""


class Mirrored:
    """The host engine as the trainer sees it, each call made on the device engine too (gradients copied there);
    ``mismatch``: this rank's first difference, once found."""

    def __init__(self, host, device, xp) -> None:
        self.host, self.device, self.xp = host, device, xp
        self.mismatch: Mismatch | None = None

    @property
    def groups(self):
        return self.host.groups

    @property
    def comm(self):
        return self.host.comm

    @property
    def collectives(self):
        return self.host.collectives

    @property
    def step_number(self) -> int:
        return self.host.step_number

    def agree_keep_gathered(self, keep: bool) -> None:
        self.host.agree_keep_gathered(keep)

    def gather(self, index: int, blocking: bool = True) -> dict:
        views = self.host.gather(index, blocking)
        self.device.gather(index, blocking)
        if blocking and self.host.groups[index].plan.gathers_params:
            pair = ("gathered params", self.host.groups[index], 0, self.device.full_params(index))
            self._note(self.host.step_number, [(*pair, self.host.full_params(index))])
        return views

    def release(self, index: int) -> None:
        self.host.release(index)
        self.device.release(index)

    def reduce_round(self, index: int, grads, keep: str, can_redo: bool) -> None:
        self.host.reduce_round(index, grads, keep=keep, can_redo=can_redo)
        self.device.reduce_round(index, self._copied(grads), keep=keep, can_redo=can_redo)

    def accumulate(self, grads, groups, keep: str, can_redo: bool) -> None:
        self.host.accumulate(grads, groups=groups, keep=keep, can_redo=can_redo)
        self.device.accumulate(self._copied(grads), groups=groups, keep=keep, can_redo=can_redo)

    def start_reduce(self, index: int) -> None:
        self.host.start_reduce(index)
        self.device.start_reduce(index)

    def finish_step(self):
        step = self.host.step_number
        ours, theirs = self.host.finish_step(), self.device.finish_step()
        ended = [(r.redo, r.skipped, repr(r.grad_norm)) for r in (theirs, ours)]
        if ended[0] != ended[1]:
            raise Diverged(f"step {step}: (redo, skipped, norm) device {ended[0]} != host {ended[1]}")
        if not ours.redo:
            self._note(step, self._held_pairs())
        return ours

    def _copied(self, grads):
        return None if grads is None else to_device(grads, self.xp)

    def _held_pairs(self):
        for host_group, device_group in zip(self.host.groups, self.device.groups):
            for (what, start, expected), (_, _, mine) in zip(host_group.held_buffers(), device_group.held_buffers()):
                yield what, host_group, start, mine, expected

    def _note(self, step: int, pairs) -> None:
        if self.mismatch is None:
            self.mismatch = first_difference(step, self.comm.Get_rank(), pairs, SIDES)


def run(args, comm, stages: list[int], precisions: list[str]) -> int:
    """Compare the device with the host at each precision and stage; one line each on rank 0; the exit code."""
    failed = described = False
    device_comm = comm.Dup()  # the device engines' collectives never meet the host engines' in flight
    for name in precisions:
        for stage in stages:
            line, ok, paths = compare_stage(stage, name, args, comm, device_comm)
            if not described:
                say(comm, paths.describe())
                described = True
            failed |= not ok
            say(comm, line)
    return 1 if failed else 0


def compare_stage(stage: int, precision_name: str, args, comm, device_comm) -> tuple[str, bool, CommPaths]:
    """Train ``args.steps`` steps at ``stage`` on the device (over ``device_comm``) and on the host from the same
    gradients; return rank 0's line, whether every step's bytes were equal, and the device engine's paths."""
    precision, model = PRECISIONS[precision_name], build_model(args.model)
    optimizer = make_optimizer(args, model)
    host = build_engine(stage, args, comm, model, precision, optimizer, "cpu")
    device = build_engine(stage, args, device_comm, model, precision, optimizer, args.device)
    mirrored = Mirrored(host, device, device_module(args.device))
    trainer, found, steps = Trainer(model, mirrored, precision), None, 0
    try:
        for steps in range(1, args.steps + 1):
            count = micro_batches_at(steps, args.micro_batches, comm.Get_size())
            trainer.step(lambda m, s=steps: synthetic_batch(model, args.seed, s, m, args.batch), count)
            reports = [m for m in host.collectives.allgather_object(mirrored.mismatch, "mismatches") if m is not None]
            if reports:
                found = str(min(reports, key=lambda m: (m.step, m.rank)))
                break
    except Diverged as error:
        found = f"MISMATCH at {error}"
    head = (
        f"stage {stage}  ranks {comm.Get_size()}  steps {args.steps}  model {args.model}  optimizer {args.optimizer}  "
        f"{precision_name}  {args.device} against cpu:"
    )
    if found is not None:
        return f"{head} {found}", False, device.collectives.paths
    gathers = "; the full params of every gather" if host.groups[0].plan.gathers_params else ""
    line = f"{head} bitwise (params, masters and optimizer states after each of {steps} steps{gathers})"
    return line, True, device.collectives.paths


def say(comm, line: str) -> None:
    if comm.Get_rank() == 0:
        print(line, flush=True)
