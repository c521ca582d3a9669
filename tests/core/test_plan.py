"""The stage plan, the step's state machine, the communication paths and the launch check: plain pytest, no MPI."""

import pytest

from mpizero.comm import paths
from mpizero.comm.job import launch
from mpizero.core.partition import Partition
from mpizero.core.stages import STAGES, GradientCollective, Publish, ShardPlan, span
from mpizero.core.step import StepOrderError, StepState, StepTracker
from mpizero.errors import ZeroError


@pytest.mark.parametrize("numel, ranks", [(17, 4), (257, 3), (2, 5), (8, 1)])
def test_every_rank_owns_its_shard_at_sharded_stages_and_everything_at_stage_0(numel, ranks):
    partition = Partition(numel, ranks)
    for stage, row in STAGES.items():
        plans = [ShardPlan(row, partition, r) for r in range(ranks)]
        owned = [span(p.owned_range) for p in plans]
        assert sum(owned) == (partition.padded_numel * (1 if stage else ranks))
        held = sum(span(p.params_range) for p in plans)
        assert held == partition.padded_numel * (1 if stage == 3 else ranks)


def test_the_plan_answers_per_stage():
    partition = Partition(10, 2)
    answers = {
        stage: (p.gradient_collective, p.publish, p.keeps_local_grads, p.gathers_params, p.allgathers_per_step(3))
        for stage, p in ((s, ShardPlan(row, partition, 1)) for s, row in STAGES.items())
    }
    assert answers == {
        0: (GradientCollective.ALLREDUCE, Publish.COPY_FULL, True, False, 0),
        1: (GradientCollective.REDUCE_SCATTER, Publish.COPY_THEN_ALLGATHER, True, False, 1),
        2: (GradientCollective.REDUCE_SCATTER, Publish.COPY_THEN_ALLGATHER, False, False, 1),
        3: (GradientCollective.REDUCE_SCATTER, Publish.COPY_SHARD, False, True, 6),
    }


def test_every_stage_in_float32_and_none_in_16_bits_keeps_the_master_in_the_params():
    partition = Partition(10, 2)
    plans = {stage: ShardPlan(row, partition, 1) for stage, row in STAGES.items()}
    shared = [(stage, nbytes) for stage, p in plans.items() for nbytes in (4, 2) if p.master_is_params(nbytes)]
    assert shared == [(0, 4), (1, 4), (2, 4), (3, 4)]


def test_step_calls_out_of_order_name_the_problem():
    tracker = StepTracker(groups=2)
    with pytest.raises(StepOrderError, match=r"step 1: finish_step\(\) called with no start_reduce\(\)"):
        tracker.finish(1)
    assert tracker.start(0, 1) and tracker.state is StepState.REDUCING
    with pytest.raises(StepOrderError, match=r"start_reduce\(0\) called twice in one step"):
        tracker.start(0, 1)
    with pytest.raises(StepOrderError, match="no group 2; the engine has groups 0-1"):
        tracker.start(2, 1)
    assert tracker.missing() == [1]
    assert tracker.finish(1) is False
    tracker.reset()  # the engine ends every step so
    with pytest.raises(StepOrderError, match="finish_step"):
        tracker.finish(2)


def test_a_skipped_step_accepts_the_remaining_groups_once_and_ends_skipped():
    tracker = StepTracker(groups=3)
    tracker.start(0, 4)
    tracker.skip()
    assert tracker.start(1, 4) is False and tracker.state is StepState.SKIPPING
    with pytest.raises(StepOrderError, match=r"start_reduce\(1\) called twice"):
        tracker.start(1, 4)
    assert tracker.finish(4) is True


def test_reduce_scatter_path_is_settled_and_refused_where_it_cannot_work():
    assert paths.settle_reduce_scatter("auto", nodes=1, on_device=False) == "shared"
    assert paths.settle_reduce_scatter("auto", nodes=2, on_device=False) == "mpi+pieces"
    assert paths.settle_reduce_scatter("auto", nodes=1, on_device=True) == "mpi+pieces"
    assert paths.settle_reduce_scatter("pieces", nodes=3, on_device=False) == "pieces"
    with pytest.raises(ZeroError, match="MPIZERO_REDUCE_SCATTER=shared needs .* these ranks span 2 nodes"):
        paths.settle_reduce_scatter("shared", nodes=2, on_device=False)
    with pytest.raises(ZeroError, match="must be one of auto, shared, two-level, pieces, mpi, got 'fast'"):
        paths.requested_reduce_scatter({"MPIZERO_REDUCE_SCATTER": "fast"})


@pytest.mark.parametrize(
    "environ",
    [
        {"PMI_SIZE": "4"},
        {"OMPI_COMM_WORLD_SIZE": "4"},
        {"PMIX_RANK": "2"},
        {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"},
        {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"},
    ],
)
def test_a_one_rank_world_started_as_several_processes_is_refused(environ):
    with pytest.raises(ZeroError, match="1-rank MPI world, but the launcher started more"):
        launch.refuse_split_launch(environ=environ, world_size=1)


@pytest.mark.parametrize("environ", [{}, {"PMI_SIZE": "1", "PMI_RANK": "0"}, {"SLURM_NTASKS": "4"}])
def test_a_true_singleton_runs(environ):
    launch.refuse_split_launch(environ=environ, world_size=1)


def test_an_intended_singleton_may_run_anyway():
    launch.refuse_split_launch(allow_singleton=True, environ={"PMI_SIZE": "4"}, world_size=1)


def test_a_larger_world_is_never_refused():
    launch.refuse_split_launch(environ={"PMI_SIZE": "4", "PMI_RANK": "3"}, world_size=4)
