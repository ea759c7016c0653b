"""v1 calls for a feature smp does not have (tensor parallelism): each says so by name.

``model_creation`` and ``tensor_parallelism`` still work with tensor parallelism off, as
v1 scripts call them (``tensor_parallelism=smp.tp_size() > 1``, which is False here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from smp.v1.errors import V1Error

__all__ = ["tensor_parallelism", "set_tensor_parallelism", "tp_register_with_module", "get_tp_process_group",
           "model_creation"]

_NO_TENSOR_PARALLELISM = ("smp has no tensor parallelism: it splits a model into pipeline stages (partitions). "
                          "Remove the call, or pass tensor_parallelism=False")


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **tensor_parallel_config: Any) -> Iterator[None]:
    """v1's context for tensor-parallel module creation: a plain block when ``enabled`` is False."""
    if enabled:
        raise V1Error(f"smp.tensor_parallelism(): {_NO_TENSOR_PARALLELISM}")
    yield


def set_tensor_parallelism(module: torch.nn.Module, enabled: bool = True, **tensor_parallel_config: Any) -> None:
    """Refused when ``enabled`` (smp has no tensor parallelism)."""
    if enabled:
        raise V1Error(f"smp.set_tensor_parallelism(): {_NO_TENSOR_PARALLELISM}")


def tp_register_with_module(*args: Any, **kwargs: Any) -> None:
    """Refused: smp has no distributed (tensor-parallel) modules."""
    raise V1Error(f"smp.tp_register_with_module(): {_NO_TENSOR_PARALLELISM}")


def get_tp_process_group() -> Any:
    """Refused: smp has no tensor-parallel groups."""
    raise V1Error(f"smp.get_tp_process_group(): {_NO_TENSOR_PARALLELISM}")


@contextlib.contextmanager
def model_creation(tensor_parallelism: bool = False, dtype: torch.dtype | None = None,
                   **tensor_parallel_config: Any) -> Iterator[None]:
    """v1's model-creation context: modules made inside get ``dtype`` as their default dtype."""
    if tensor_parallelism:
        raise V1Error(f"smp.model_creation(tensor_parallelism=True): {_NO_TENSOR_PARALLELISM}")
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
