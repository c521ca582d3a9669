"""mpizero.torch treats parameter edits made outside the documented ways the same at every stage and on every rank:
refused at the next step, or, inside ``gathered()`` without a writeback, dropped (issue 31, point 5)."""

import re
import time
from collections import Counter

import numpy as np
import pytest
from mpirun import run_mpi, run_mpi_ok

torch = pytest.importorskip("torch", reason="mpizero.torch needs torch: add its CPU build (docs/getting-started.md)")

import mpizero  # noqa: E402
from mpizero.torch import fingerprint, shard  # noqa: E402
from mpizero.torch.fingerprint import COLUMNS, _by_formula, fingerprints  # noqa: E402

EDITED = "changed in place since the last step"
MASTERS = "the parameters hold the masters, so the edit reached this rank's masters"
DROP = "`with zero.gathered(): pass` shows the masters again, dropping the edit"
SPOILED = "this step's backward passes ran with an edit that `zero.gathered()` then dropped"
FLIPPED = "changed after shard(): set requires_grad before shard()"
REFUSED = {  # case: what the refusal says, at every stage
    "no_grad edit": f"parameters '0.weight' {EDITED}",
    "nn.init": f"parameters '4.weight' {EDITED}",
    "freeze": f"requires_grad of '0.bias' {FLIPPED}",
    "unfreeze": f"requires_grad of '4.bias' {FLIPPED}",
}


def test_on_a_device_every_edit_is_refused_or_dropped_as_on_the_host():
    """The edit watch on a device (the stand-in at one rank: the step's check comes back with the step's device
    stats, in the one copy a step) says what the host's says, case by case, at every stage."""
    on_host = run_mpi_ok(1, ["-m", "mpi4py", "tests/torch_bridge/torch_edits.py"], timeout=300)
    on_device = run_mpi_ok(
        1, ["-m", "mpi4py", "tests/torch_bridge/torch_edits.py"], timeout=300, env={"MPIZERO_STANDIN": "1"}
    )
    lines = [re.findall(r"^stage \d [^:]+: .*$", out, re.M) for out in (on_host, on_device)]
    assert len(lines[0]) > 60 and lines[0] == lines[1]


@pytest.mark.parametrize("n", [1, 3])  # 2 ranks: the exception-inside-gathered test below
def test_edits_are_refused_or_dropped_alike_at_every_stage_and_rank(n):
    out = run_mpi_ok(n, ["-m", "mpi4py", "tests/torch_bridge/torch_edits.py"], timeout=300)
    lines = re.findall(r"^stage (\d) ([^:]+): (.*)$", out, re.M)
    counts = Counter(lines)
    assert set(counts.values()) == {n}, "ranks differ: " + str([k for k, c in counts.items() if c != n])
    outcome = {(int(stage), case): said for stage, case, said in counts}
    every = "rank 0: " if n == 1 else f"ranks {list(range(n))}: "
    for stage in range(4):
        for case, fragment in REFUSED.items():
            assert outcome[stage, case].startswith(f"refused: step 2: {every}"), (stage, case, outcome[stage, case])
            assert fragment in outcome[stage, case], (stage, case, outcome[stage, case])
        for case in ("no_grad edit", "nn.init", ".data edit"):  # a refused step took nothing
            assert outcome[stage, case].endswith("; then as without the edit: True"), (stage, case)
        for case in ("no_grad edit", "nn.init", ".data edit"):  # still shown: the next step is refused too
            # at stages 0-2 in float32 the module's tensors hold the masters: gathered() cannot drop it, a load does
            again = (
                "; again: refused; gathered(): refused; step: refused; then" if stage < 3 else "; again: refused; then"
            )
            assert again in outcome[stage, case], (stage, case)
            assert (MASTERS in outcome[stage, case]) == (stage < 3), (stage, case)
        assert_edits_in_order(stage, outcome, every)
        assert outcome[stage, "no writeback"] == "done; then as without the edit: True"
        said = outcome[stage, "exception inside"]
        expected = "KeyError; forward as without the edit: True; next step refused: True; then as without the edit"
        assert said == expected + ": True", said
        if n > 1:  # each rank's edit differs: the writeback is refused, and every edit dropped
            said = outcome[stage, "refused writeback"]
            assert said.startswith("refused: ") and said.endswith("then as without the edit: True"), said
            assert "the parameters after gathered(writeback=True)" in said, said
    for stage in range(3):  # the bytes tell, not torch's version counter: an op that changes none is no edit
        assert outcome[stage, "unchanged in-place op"] == "done; then as without the edit: True", stage
    # at stage 3 the placeholder has no bytes to compare: an in-place op on it is refused, whatever it would do
    assert outcome[3, "unchanged in-place op"].startswith(f"refused: step 2: {every}parameters '0.weight' {EDITED}")
    for stage in range(3):  # the module shows full parameters between steps: a write through .data is seen
        assert f"one or more of the parameters '2.weight', '2.bias' {EDITED}" in outcome[stage, ".data edit"]
    # at stage 3 the placeholder's .data shares the parameter's version counter: the write is counted
    assert f"parameters '2.bias' {EDITED}" in outcome[3, ".data edit"]
    # stage 3 on one host reads the params in place: an edit in a forward reached every rank's masters
    said = outcome[3, "edit in forward"]
    assert said.startswith(f"refused: step 2: {every}parameters '0.weight' were edited in place during a forward"), said
    assert said.endswith("; again: refused; after a load: done"), said
    # kept gathered (keep_gathered=True), rank 0's edit in a forward: a new .data is caught by the kept groups'
    # check (Binder.drop_kept_gathered) on that rank; an edit of the bytes, read in place on one host, reached
    # every rank's masters
    said = outcome[3, "kept gathered, new .data edit"]
    assert said.startswith("refused: step 1: rank 0: one or more of the parameters '2.bias', '2.weight' changed"), said
    assert "while stage 3 kept them gathered" in said and said.endswith("then as without the edit: True"), said
    for how in ("counted", "uncounted"):
        said = outcome[3, f"kept gathered, {how} edit"]
        assert said.startswith(f"refused: step 1: {every}parameters '2.bias', '2.weight' were edited in place"), said
        assert said.endswith("then as without the edit: True"), said


def assert_edits_in_order(stage: int, outcome: dict, every: str) -> None:
    """An edit followed by a read-out, a ``gathered()``, a step that raises early, a clip, a backward and a
    writeback; a step, a load, a read-out, a ``zero_grad()`` and a refused writeback inside ``gathered()``; a new
    ``.data`` (``torch_edits.ORDER_CASES``)."""
    same = "; then as without the edit: True"
    assert outcome[stage, "step raising before its check"] == "refused; next step: refused" + same
    assert outcome[stage, "refused after clip"] == "refused; next step: done" + same
    read_out = "refused, refused, refused" if stage < 3 else "done, done, done"
    assert outcome[stage, "read out after an edit"] == read_out + same
    inside = "refused" if stage < 3 else "done"  # the masters hold the block's edit until the block ends
    assert outcome[stage, "read out inside gathered"] == f"{inside}; step: done" + same
    if stage < 3:  # kept by the writeback: the gradients computed with it are the step's
        assert outcome[stage, "writeback after backward"] == "done; as with the edit: True"
    assert outcome[stage, "zero_grad inside gathered"] == "done" + same  # no gradients computed with it are left
    if (stage, "nested refused writeback") in outcome:  # 2 ranks or more: rank 0's edit is dropped on every rank
        assert outcome[stage, "nested refused writeback"] == "refused; step: done" + same
    stepped = "refused" if stage == 3 else "done"  # stage 3 shows gathered tensors inside the block: a step is refused
    assert outcome[stage, "step and load inside gathered"] == f"{stepped}; step kept: True" + same
    said = outcome[stage, "new .data"]
    if stage < 3:  # the masters untouched: refused, and dropped by gathered()
        assert said.startswith(f"refused: step 2: {every}parameters '2.bias' {EDITED}") and DROP in said, said
        assert MASTERS not in said and said.endswith(same), said
    said = outcome[stage, "edit then gathered"]
    if stage < 3:  # refused on entry; kept by an agreed writeback
        assert said.startswith(f"refused: gathered(): {every}parameters '0.weight' {EDITED}") and MASTERS in said, said
        assert said.endswith("; step: refused; writeback: done; step: done" + same), said
    else:  # the edit acted on an empty placeholder: the forward computed with the masters
        assert said == "done; step: done" + same, said
    if stage < 3 and every != "rank 0: ":  # rank 0's edit of its masters: a writeback tried again is refused too
        said = outcome[stage, "retried writeback"]
        assert said == "refused; again: refused; step: refused" + same, said
    if stage in (1, 2) and every != "rank 0: ":  # no master of rank 0's: refused, and dropped by gathered()
        said = outcome[stage, "edit in another block"]
        assert said.startswith("refused: step 2: rank 0: parameters ") and EDITED in said and DROP in said, said
        assert MASTERS not in said and said.endswith("; gathered(): done" + same), said
    if stage < 3:  # 16-bit params: the module's tensors are copies; dropped, and the gradients computed with it refused
        said = outcome[stage, "edit then gathered in bfloat16"]
        assert said.startswith(f"done; step: refused: step 2: {every}{SPOILED}") and said.endswith(same), said


def test_a_fingerprint_sees_any_two_words_swapped():
    """Words a row apart (the same column) and words in one row (the same row) weigh differently: swapping either
    pair changes the fingerprint, as it does the bytes (at stage 0 in float32 such a write reaches the masters)."""
    values = np.random.default_rng(0).random(3 * 2 * COLUMNS + 5).astype(np.float32)
    original = fingerprints([values])
    for first, second in [(0, 2 * COLUMNS), (2, 3), (4, 4 * COLUMNS + 6), (2 * 3 * COLUMNS, 6 * COLUMNS + 4)]:
        swapped = values.copy()
        swapped[[first, second]] = swapped[[second, first]]
        assert fingerprints([swapped]) != original, (first, second)


@pytest.mark.parametrize("numel", [0, 1, 2, 3, 2 * COLUMNS - 1, 2 * COLUMNS, 2 * COLUMNS + 1, 6 * COLUMNS + 5, 100_003])
def test_the_compiled_fingerprint_gives_the_formulas_sums(numel):
    """The host's one compiled pass sums what the formula (a device's, or NumPy's where nothing compiles) sums:
    odd counts, partial last rows and whole ones; values across the float32 range, so that the sums wrap."""
    if fingerprint._compiled() is None:
        pytest.skip("no C compiler here: the host fingerprints by formula too")
    rng = np.random.default_rng(numel)
    values = rng.integers(0, 2**32, numel + 1, dtype=np.uint64).astype(np.uint32).view(np.float32)
    pieces = [values[:numel], values[::-1].copy()[:numel], values[1:]]  # the last one 4 bytes off 8-byte words
    assert fingerprints(pieces) == _by_formula(pieces)


@pytest.mark.parametrize("numel", [0, 1, 3, 2 * COLUMNS + 1, 100_003])
def test_the_device_fingerprint_gives_the_formulas_sums_in_one_launch(numel):
    """On a device (the stand-in) every buffer's sums take one launch, all come back in one copy, and they are the
    formula's: odd counts, partial rows, a piece 4 bytes off 8-byte words."""
    from mpizero import standin
    from mpizero.standin import bus, cuda

    rng = np.random.default_rng(numel)
    values = rng.integers(0, 2**32, numel + 1, dtype=np.uint64).astype(np.uint32).view(np.float32)
    pieces = [values[:numel], values[::-1].copy()[:numel], values[1:]]
    on_device = [standin.asarray(values)[:numel], standin.asarray(pieces[1]), standin.asarray(values)[1:]]
    bus.COUNTS.clear()
    cuda.LAUNCHES.clear()
    assert fingerprints(on_device) == _by_formula(pieces)
    assert sum(cuda.LAUNCHES.values()) == 3 and bus.COUNTS["sync"] == 1  # zeros, sums, the copy back


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_write_through_data_that_only_moves_values_is_refused(stage):
    """The fingerprint weighs each word by its place: rows permuted in place change it, though not the sum."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.GELU(), torch.nn.Linear(4, 3))  # rows: 2 words
    zero = shard(model, mpizero.SGD(lr=0.1), stage=stage)
    model[2].weight.data.copy_(model[2].weight.data.flip(0))
    with pytest.raises(mpizero.ZeroError, match=f"one or more of the parameters '2.weight', '2.bias' {EDITED}"):
        model(torch.ones(2, 6)).sum().backward()
        zero.step()


def test_a_write_through_data_between_steps_at_stage_3_is_counted_and_refused():
    """A stage-3 parameter shows an empty placeholder between steps: ``p.data.mul_()`` acts on no element, and
    is refused at the next step rather than doing nothing unseen; the parameter stays an ``nn.Parameter``."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.GELU(), torch.nn.Linear(4, 3))
    zero = shard(model, mpizero.SGD(lr=0.1), stage=3)
    weight = model[2].weight
    assert isinstance(weight, torch.nn.Parameter) and weight.data.shape == (0,)
    model(torch.ones(2, 6)).sum().backward()
    zero.step()
    weight.data.mul_(0.9)
    with pytest.raises(mpizero.ZeroError, match=f"parameters '2.weight' {EDITED}"):
        model(torch.ones(2, 6)).sum().backward()
        zero.step()
    with zero.gathered():
        assert weight.data.shape == (3, 4)  # gathered: .data is the full view again
    model(torch.ones(2, 6)).sum().backward()
    zero.step()


@pytest.mark.parametrize("stage", [1, 3])
def test_an_exception_inside_gathered_on_one_rank_ends_the_job_at_once(stage):
    start = time.monotonic()
    done = run_mpi(2, ["-m", "mpi4py", "tests/torch_bridge/torch_gathered_raise.py", str(stage)], timeout=120)
    assert done.returncode != 0 and time.monotonic() - start < 60, done.stderr[-2000:]
    assert "KeyError: 'only the last rank raises inside gathered()'" in done.stderr, done.stderr[-2000:]
    assert "waited" not in done.stderr  # no rank was left in a collective until the watchdog
