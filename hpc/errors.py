"""Typed errors shared by the runtime.

Every error carries the context a user needs to act on it on a cluster (which
rank, which file, which job, where the log is), rendered after the message so a
one-line report is enough to find the problem.
"""

from __future__ import annotations


class HpcError(Exception):
    """Base of every error we raise on purpose; the CLI prints it as one line."""

    def __init__(self, message: str, **context: object) -> None:
        super().__init__(message)
        self.message = message
        self.context = {k: v for k, v in context.items() if v is not None}

    def __str__(self) -> str:
        if not self.context:
            return self.message
        where = ", ".join(f"{k}={v}" for k, v in self.context.items())
        return f"{self.message} ({where})"


class ConfigError(HpcError):
    """A job spec or command-line override is invalid; the message names the dotted path."""


class LayoutError(ConfigError):
    """A (dp, tp, pp) layout does not fit the world or the model."""


class LaunchEnvError(HpcError):
    """A launcher variable (OMPI_*, PMI_*, SLURM_*, RANK, ...) is missing or malformed."""


class RendezvousError(HpcError):
    """A rank could not join the process group in time."""


class RankFailedError(HpcError):
    """A rank of a launched job exited non-zero or was killed; ``exit_code`` is what the launcher returns."""

    def __init__(self, message: str, exit_code: int = 1, **context: object) -> None:
        super().__init__(message, **context)
        self.exit_code = exit_code


class CollectiveStalled(HpcError):
    """A rank waited past the stall inspector's abort threshold, or its backend's timeout, in a collective; the
    message is the inspector's report: the channel (``tp group [0, 1]``), the operation and its number on it,
    and the ranks that never entered it (hpc/observe/stall.py)."""


class DeviceOutOfMemoryError(HpcError):
    """A rank ran out of GPU memory; the message says how much was held and what to try."""


class NodeUnhealthy(HpcError):
    """A node failed the start-up health check (hpc/observe/health.py): a directory it must write, or its GPU;
    the node's fault, not the job's (a restart inside the allocation excludes it where a spare is left)."""
