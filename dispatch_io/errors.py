"""The exceptions dispatch_io raises. Every error about a leaf names its key path."""


class CheckpointError(Exception):
    """Base class for every checkpoint failure raised by dispatch_io."""


class TreeMismatchError(CheckpointError, ValueError):
    """The restore target does not match the checkpoint (structure, shape or dtype).

    The message lists every offending key path at once; ``problems`` holds them as
    ``(keypath, reason)`` pairs for programs.
    """

    def __init__(self, problems):
        self.problems = list(problems)
        lines = "\n".join(f"  {path}: {why}" for path, why in self.problems)
        super().__init__(
            f"restore target does not match the checkpoint ({len(self.problems)} problem(s)):\n{lines}")


class IncompleteCheckpointError(CheckpointError):
    """The directory holds no committed checkpoint (a save failed, was killed, or is in flight)."""


class WorkerError(CheckpointError):
    """A worker failed while moving or writing/reading a leaf.

    ``worker`` is the worker id (the JAX process index), ``keypath`` the leaf.
    The original exception is chained as ``__cause__``.
    """

    def __init__(self, message, *, worker=None, keypath=None):
        self.worker = worker
        self.keypath = keypath
        super().__init__(message)


class BarrierTimeoutError(CheckpointError, TimeoutError):
    """Processes of a multi-process job did not reach a barrier within ``barrier_timeout``.

    ``processes`` lists the process indices that never arrived (empty if unknown) and
    ``barrier`` names the barrier (checkpoint path and phase).
    """

    def __init__(self, message, *, processes=(), barrier=None):
        self.processes = sorted(processes)
        self.barrier = barrier
        super().__init__(message)


class CorruptCheckpointError(CheckpointError):
    """Stored bytes do not match the checksum saved with them (``restore(verify=True)``), or the
    checkpoint's description is malformed (a damaged or crafted file: the message says
    "malformed checkpoint" and what is wrong; ``dispatch_io.validate``).

    ``keypath`` names the leaf (None: the checkpoint as a whole), ``path`` the checkpoint (where
    known), ``chunk`` the chunk grid index; for checksum mismatches the message lists every bad
    chunk, and ``chunks`` holds them: (key path, grid index, stored region, saved CRC-32C or None,
    read CRC-32C) each (empty where a chunk could not be read at all)."""

    def __init__(self, message, *, keypath=None, chunk=None, chunks=(), path=None):
        self.keypath = keypath
        self.chunk = chunk
        self.chunks = list(chunks)
        self.path = path
        super().__init__(message)
