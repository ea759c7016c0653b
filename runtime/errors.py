"""The runtime's errors: a pipeline that cannot start as configured, and one that stopped because a rank failed."""

from __future__ import annotations

__all__ = ["RuntimeConfigError", "PipelineError"]


class RuntimeConfigError(ValueError):
    """The runtime cannot start as configured (world size, plan, loss); raised before any work."""


class PipelineError(RuntimeError):
    """The pipeline could not set up, run a step or a collective call: a peer died, hung, raised or did not call it;
    the message names the rank."""

    def __init__(self, message: str, *, rank: int | None = None, peer: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
