"""smp's runtime: stage programs from a Plan (split), point-to-point transfers (comm), the engine that runs them."""

from runtime.errors import PipelineError, RuntimeConfigError
from runtime.engine import Engine
from runtime.split import SplitError, split_program

__all__ = ["Engine", "PipelineError", "RuntimeConfigError", "SplitError", "split_program"]
