"""User-facing planning errors: each message names the cause and the fix."""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = [
    "PlanningError",
    "PlanError",
    "OptionError",
    "InvalidAssignmentError",
    "StageCountError",
    "MemoryLimitError",
    "ColocationError",
    "ClusterError",
    "ProfileError",
    "ShapePruned",
]


class PlanningError(ValueError):
    """Base class: the planner cannot do what was asked; the message says why and what to change."""


class PlanError(PlanningError):
    """A plan cannot be made, read or used as asked (a bad option, a damaged plan file); the message says why."""


class OptionError(PlanError):
    """A planning option's bad value, or options that conflict; ``options`` are their names as the message writes
    them (``name`` or ``name=``), so a front end can name them its own way (the CLI: its flags)."""

    def __init__(self, message: str, *options: str):
        super().__init__(message)
        self.options = options

    def spelled(self, spell: Callable[[str], str]) -> str:
        """The message with each option named as ``spell`` names it: where the message names it as an option
        (``name=``, or ``name`` opening the message), not the same word in its prose ("4 stages")."""
        text = str(self)
        for name in self.options:
            text = re.sub(rf"^{re.escape(name)}\b=?|(?<![\w.-]){re.escape(name)}=", spell(name), text)
        return text


class InvalidAssignmentError(PlanningError):
    """An op -> stage assignment is not a pipeline (missing ops, empty stage, data flowing backward)."""


class StageCountError(PlanningError):
    """The number of stages does not fit the graph or the cluster."""


class MemoryLimitError(PlanningError):
    """No assignment fits the per-device memory limit.

    ``needed``: bytes no assignment can do with less than (a lower bound); ``works``: bytes
    per device at which a plan exists (its peak, or None when not computed);
    ``recompute_fits``: whether activation recomputation would fit the limit (None when it
    was already allowed).
    """

    def __init__(self, message: str, *, needed: float | None = None, works: float | None = None,
                 recompute_fits: bool | None = None):
        super().__init__(message)
        self.needed = needed
        self.works = works
        self.recompute_fits = recompute_fits


class ColocationError(PlanningError):
    """A colocation group names unknown ops or leaves too few movable units for the stages."""


class ClusterError(PlanningError):
    """A cluster description is inconsistent (no devices, non-positive bandwidth or speed, ...)."""


class ProfileError(ClusterError):
    """A device profile file is missing or malformed."""


class ShapePruned(Exception):
    """Not an error: a shape search asked for no plan whose step is at least ``bound`` seconds, and this
    shape's partition has none faster (raised before its schedule is built and simulated)."""

    def __init__(self, bound: float):
        super().__init__(f"its step is at least {bound:.4g} s")
        self.bound = bound
