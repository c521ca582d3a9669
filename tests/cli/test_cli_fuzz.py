"""Every option of every command, given extreme, empty, negative, non-numeric and very long values: refused at parse
time with one line (exit 2), or taken as a value (a path, an lr of 1e30), never a traceback; an option that takes
every value must be one that takes any text. Then a few extreme values that parsing takes, run under mpiexec:
each run ends, cleanly or with one agreed line and exit 2, never a hang or a traceback."""

import argparse
import contextlib
import io

import pytest
from mpirun import run_mpi

from mpizero.cli.main import make_parser
from mpizero.errors import ZeroError

# paths, and the names of settings a resumed run may change (checked against the checkpoint after parsing)
TAKES_ANY_TEXT = {
    "--checkpoint-dir",
    "--memory-json",
    "--offload-dir",
    "--resume",
    "--resume-override",
    "--save-params",
}
TAKES_ANY_TEXT |= {"-o", "--output"}
VALUES = ["-1", "", "abc", "1e30", "-1e30", "nan", "inf", "9" * 400, "0x10", "1.5", "x" * 5000, "1,,2", "-0"]


def options_of_every_command():
    commands = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in commands.choices.items():
        for action in parser._actions:
            if action.option_strings and action.nargs != 0 and not isinstance(action, argparse._HelpAction):
                yield pytest.param(parser, action.option_strings[-1], id=f"{name} {action.option_strings[-1]}")


@pytest.mark.parametrize("parser, flag", list(options_of_every_command()))
def test_no_value_of_any_option_is_a_traceback(parser, flag):
    positional = [a for a in parser._actions if not a.option_strings and a.nargs is None]
    refused = 0
    for value in VALUES:
        error = io.StringIO()
        try:
            with contextlib.redirect_stderr(error):
                parser.parse_args([f"{flag}={value}", *["x"] * len(positional)])
        except SystemExit as ended:
            assert ended.code == 2, (flag, value[:20], ended.code)
            assert error.getvalue().count("\n") <= 2 and "Traceback" not in error.getvalue(), error.getvalue()
            refused += 1
        except ZeroError as agreed:  # the commands' parsers that agree on errors: one line, exit 2 in main()
            assert "\n" not in str(agreed), str(agreed)
            refused += 1
    assert refused or flag in TAKES_ANY_TEXT, f"{flag} took every one of {len(VALUES)} bad values"


RUNS = [  # values that parse, run to the end at -n 2: (arguments, exit status)
    ("train --steps 2 --lr 1e30", 2),  # the agreed non-finite gradient
    ("train --steps 1 --width 2147483647", 2),  # the memory check, before any work
    ("train --steps 1 --global-batch 1099511627776", 2),
    ("train --steps 1 --watchdog 1e-300", 2),  # it would end the job in its first collective: refused
    ("train --steps 2 --precision fp16 --loss-scale-power 127", 0),  # overflowing scales are skipped and lowered
    ("train --steps 1 --global-batch 2 --clip-norm 1e-30 --watchdog 1e30", 0),
    ("verify --stage 3 --steps 1 --bucket-elems 1", 0),
]


@pytest.mark.parametrize("args, status", RUNS, ids=[args for args, _ in RUNS])
def test_extreme_values_that_parse_end_cleanly_or_with_one_line_under_mpiexec(args, status):
    done = run_mpi(2, ["-m", "mpizero", *args.split()], timeout=60)  # a hang fails here
    assert done.returncode == status, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("mpizero: error:") == (status == 2), done.stderr[-2000:]
