"""smp: an automatic model-partitioning compiler for PyTorch pipeline parallelism."""

from partitioner.plan import package_version

__version__ = package_version()

from smp import models  # noqa: E402
from smp.deferred import delay_param_initialization  # noqa: E402
from smp.launch import LaunchError, init_distributed  # noqa: E402
from smp.partition import PipelinedModel, PipelineError, RuntimeConfigError, partition  # noqa: E402
from runtime.checkpoint import consolidate as consolidate_checkpoint  # noqa: E402
from runtime.precision import PipelineGradScaler  # noqa: E402
from runtime.resume import latest_checkpoint  # noqa: E402
from smp.plan import Plan, PlanError, PlanRequest, plan, plan_shapes  # noqa: E402

__all__ = ["LaunchError", "Plan", "PlanError", "PlanRequest", "PipelineError", "PipelineGradScaler", "PipelinedModel",
           "RuntimeConfigError", "__version__", "consolidate_checkpoint", "delay_param_initialization",
           "init_distributed", "latest_checkpoint", "models", "partition", "plan", "plan_shapes"]
