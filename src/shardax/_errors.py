"""Exception hierarchy shared by every shardax subpackage."""

from __future__ import annotations


class ShardaxError(Exception):
    """Base class of every error raised by shardax itself."""


class DistributedSetupError(ShardaxError, RuntimeError):
    """The multi-process world cannot be set up as asked (wrong order of calls, unequal processes, ...)."""


class ProgramMismatchError(ShardaxError, RuntimeError):
    """Processes are about to run different distributed programs (which would hang or return garbage)."""


class CapacityError(ShardaxError, ValueError):
    """A fixed-size buffer was too small for the data; nothing was dropped, the call must be retried.

    Attributes:
        needed: the capacity the data needed (per device, the maximum over devices).
        available: the capacity the buffer had.
        argument: the name of the argument of the call that raised to increase (e.g. ``ghost_capacity``), so that a
            retry loop can pass ``{err.argument: err.needed}``; ``None`` when no argument of that call fixes it (the
            message says what to change instead).
    """

    def __init__(self, message: str, *, needed: int | None = None, available: int | None = None,
                 argument: str | None = None):
        super().__init__(message)
        self.needed = needed
        self.available = available
        self.argument = argument
