"""``expect_error``: assert that a call raises the agreed ``ZeroError`` with every given fragment (MPI checks)."""

from mpizero import ZeroError


def expect_error(fn, *fragments):
    try:
        fn()
    except ZeroError as error:
        for fragment in fragments:
            assert fragment in str(error), (fragment, str(error))
        return
    raise AssertionError(f"expected ZeroError containing {fragments}")
