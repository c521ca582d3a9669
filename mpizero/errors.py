"""The one error type every rank raises identically."""


class ZeroError(RuntimeError):
    """An error raised identically on every rank of the communicator."""


class CheckpointError(ZeroError):
    """A checkpoint (or the key that signs it) that cannot be used, named with its file and the problem."""
