"""The one error type every rank raises identically."""


class ZeroError(RuntimeError):
    """An error raised identically on every rank of the communicator."""
