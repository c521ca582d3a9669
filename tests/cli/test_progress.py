"""Progress lines: every few seconds, with an ETA once a few iterations are done, silent on short loops."""

import io

import pytest

from mpizero.progress import Progress, duration, progress


class FakeClock:
    """A clock that moves only when told: each call returns the current time."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(steps: int, seconds_per_step: float, stream=None, **settings) -> str:
    clock, out = FakeClock(), stream or io.StringIO()
    for _ in progress(range(steps), "train", clock=clock, stream=out, **settings):
        clock.now += seconds_per_step
    return out.getvalue()


def test_a_line_every_five_seconds_with_an_eta_after_three_steps():
    lines = run(10, 2.0).splitlines()
    assert lines == [
        "train: 3/10 (30 %), 6 s, ETA 14 s",
        "train: 6/10 (60 %), 12 s, ETA 8 s",
        "train: 9/10 (90 %), 18 s, ETA 2 s",
    ]


def test_the_eta_leaves_out_the_first_steps_warm_up():
    clock, out = FakeClock(), io.StringIO()
    counter = Progress(100, "bench", clock=clock, stream=out)
    clock.now += 30.0  # the first step: set-up and a redo
    counter.advance()
    for _ in range(9):
        clock.now += 1.0
        counter.advance()
    assert out.getvalue().splitlines()[-1] == "bench: 6/100 (6 %), 35 s, ETA 1 min 34 s"  # 1 s a step since the first


def test_slow_steps_report_each_step_but_no_eta_before_the_third():
    assert run(3, 7.0).splitlines() == [
        "train: 1/3 (33 %), 7 s",
        "train: 2/3 (66 %), 14 s",
        "train: 3/3 (100 %), 21 s, ETA 0 s",
    ]


def test_short_loops_and_other_ranks_print_nothing():
    assert run(100, 0.01) == ""
    assert run(10, 2.0, show=False) == ""


def test_a_terminal_gets_one_redrawn_bar_ended_by_a_newline():
    text = run(10, 2.0, stream=Terminal())
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "\r[######..............] train: 3/10 (30 %), 6 s, ETA 14 s" in text


def test_durations_read_naturally():
    assert [duration(s) for s in (0.4, 59.4, 65, 3600 + 7 * 60)] == ["0 s", "59 s", "1 min 05 s", "1 h 07 min"]


def test_bad_settings_name_their_values():
    with pytest.raises(ValueError, match="total -1, every 5.0"):
        Progress(-1, "x")
