"""smp's runtime: stage programs from a Plan (split), point-to-point transfers (comm), the engine that runs them."""

from runtime.comm import PipelineError
from runtime.engine import Engine
from runtime.errors import RuntimeConfigError
from runtime.split import SplitError, split_program

__all__ = ["Engine", "PipelineError", "RuntimeConfigError", "SplitError", "split_program"]
