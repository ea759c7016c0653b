"""``smp.DistributedOptimizer``: the script's optimizer, with v1's local / full state dicts over the partitions."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from runtime.checkpoint import merge_partial_states
from smp.v1.comm import CommGroup, cpu_copy, gather_objects, group_ranks
from smp.v1.errors import V1Error
from smp.v1.model import PARTIAL_KEY, DistributedModel
from smp.v1.state import current

__all__ = ["DistributedOptimizer", "NAMES_KEY"]

#: Each optimizer index's parameter name, stored with the state dicts made here, so that a state
#: loads by name into any rank's optimizer (and any partitioning).
NAMES_KEY = "_smp_param_names"


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer over the DistributedModel's parameters (made before or after wrapping the model).

    ``step``, ``zero_grad``, ``param_groups`` and ``state`` are the optimizer's own (an LR
    scheduler works on this object). Each rank's optimizer updates only the parameters it
    holds: the others get no gradient. Gradients are the mean over microbatches
    (``DistributedModel(average_grads_across_microbatches=False)``: their sum).
    ``local_state_dict()`` is this rank's state; ``state_dict()`` (a collective) the whole
    model's; ``load_state_dict`` takes either, and before partitioning defers the load to
    right after it, as v1 did. The FP16 loss-scale arguments belong to v1's fp16 mode,
    which smp refuses; use ``smp.amp.GradScaler``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, static_loss_scale: float | None = 1.0,
                 dynamic_loss_scale: bool = False, **dynamic_loss_args: Any) -> None:
        # no Optimizer.__init__: this object shares the wrapped optimizer's groups and state
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise V1Error(f"smp.DistributedOptimizer takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if dynamic_loss_scale or static_loss_scale not in (None, 1.0) or dynamic_loss_args:
            raise V1Error("DistributedOptimizer's loss-scale arguments belong to v1's fp16 mode, which smp does not "
                          "have: scale the loss with smp.amp.GradScaler instead")
        st = current()
        model = st.model
        if not isinstance(model, DistributedModel):
            raise V1Error("wrap the model in smp.DistributedModel before the optimizer in smp.DistributedOptimizer")
        if st.optimizer is not None:
            raise V1Error("a v1 script wraps one optimizer in smp.DistributedOptimizer; call smp.init() again to "
                          "start over")
        self.optimizer = optimizer
        self._model: DistributedModel = model
        self._pending: dict[str, Any] | None = None
        model.register_post_partition_hook(self._after_partition)
        st.optimizer = self

    # ------------------------------------------------------------ the optimizer's own

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    # ------------------------------------------------------------ state dicts

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def local_state_dict(self) -> dict[str, Any]:
        """The state of this rank's parameters (torch's format, plus every index's parameter name), marked partial."""
        self._model.need_pipe("DistributedOptimizer.local_state_dict()")
        sd = self.optimizer.state_dict()
        params = self._params()
        local = {id(p) for p in self._model.local_parameters()}
        sd["state"] = {i: s for i, s in sd["state"].items() if id(params[i]) in local}
        return {**sd, NAMES_KEY: [self._model.param_name(p) for p in params], PARTIAL_KEY: True}

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The whole model's optimizer state on every rank (a collective over the model replica's ranks)."""
        if not self._model.partitioned:
            return {**self.optimizer.state_dict(), NAMES_KEY: [self._model.param_name(p) for p in self._params()]}
        return self._merge(gather_objects("DistributedOptimizer.state_dict()", cpu_copy(self.local_state_dict()),
                                          group_ranks(CommGroup.MP_GROUP)))

    def _merge(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """The ranks' partial states as one full state in this optimizer's indices (matched by parameter name)."""
        names = [self._model.param_name(p) for p in self._params()]
        index = {n: i for i, n in enumerate(names)}
        by_name: list[dict[str, Any]] = []
        for part in parts:
            theirs = part.get(NAMES_KEY)
            by_name.append({(theirs if theirs is not None else names)[int(i)]: s for i, s in part["state"].items()})
        merged = merge_partial_states(by_name, names, require_all=False)  # a parameter without state has none
        unknown = [name for name in merged if name not in index]
        if unknown:
            raise V1Error(f"the optimizer state holds parameter {unknown[0]!r}, which this optimizer does not "
                          "optimize: was it saved for another model or another parameter list?")
        state = {index[name]: s for name, s in merged.items()}
        return {"state": state, "param_groups": parts[0]["param_groups"], NAMES_KEY: names}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Load a full or a partial (this rank's) state; a partial one is merged over the ranks first (collective)."""
        sd = dict(state_dict)
        if sd.pop(PARTIAL_KEY, False):
            sd = self._merge(gather_objects("DistributedOptimizer.load_state_dict()", cpu_copy(sd),
                                            group_ranks(CommGroup.MP_GROUP)))
        if self._model.partitioned:
            self._load(sd)
        else:
            self._pending = sd

    def _load(self, sd: dict[str, Any]) -> None:
        """Give the wrapped optimizer the state of this rank's parameters (others would only take memory)."""
        params = self._params()
        names = sd.get(NAMES_KEY)
        if names is not None:
            sd = self._merge([sd])
        local = {id(p) for p in self._model.local_parameters()}
        groups = [dict(g, params=list(mine["params"])) for g, mine in zip(sd["param_groups"],
                                                                       self.optimizer.state_dict()["param_groups"])]
        mine = {"state": {i: s for i, s in sd["state"].items() if id(params[int(i)]) in local},
                "param_groups": groups}
        try:
            self.optimizer.load_state_dict(mine)
        except ValueError as err:
            raise V1Error(f"the optimizer state does not fit this optimizer ({err}); was it saved with other "
                          "parameter groups?") from None

    def _after_partition(self, model: DistributedModel) -> None:
        """Follow the parameters partitioning made (a model built without weights gets new tensors), then load
        a state given before partitioning."""
        current_params = dict(model.module.named_parameters())
        for group in self.optimizer.param_groups:
            for j, p in enumerate(group["params"]):
                now = current_params.get(model.param_name(p))
                if now is not None and now is not p and not now.is_meta:
                    group["params"][j] = now
                    if p in self.optimizer.state:
                        self.optimizer.state[now] = self.optimizer.state.pop(p)
        if self._pending is not None:
            self._load(self._pending)
            self._pending = None

