"""Command-line value types for ``train``'s checkpoint flags, so a bad value is refused before any step."""

from __future__ import annotations

import argparse


def keep_count(text: str) -> int:
    """Parse ``--keep N``: how many complete checkpoints to keep, at least 1."""
    try:
        keep = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--keep must be an integer >= 1, got {text!r}") from None
    if keep < 1:
        raise argparse.ArgumentTypeError(f"--keep must be >= 1 (0 would delete every checkpoint), got {keep}")
    return keep
