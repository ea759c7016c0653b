"""The typed planning request: every option that shapes a plan, checked once, carried from each entry point down."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Union

from partitioner.checks import flag, positive, whole
from partitioner.cluster import Cluster
from partitioner.devices import dtype_name
from partitioner.errors import OptionError, PlanError, PlanningError
from partitioner.ir import ScheduleKind
from partitioner.plan import PLACEMENTS
from partitioner.recompute import check_mode
from partitioner.schedule import check_active_microbatches
from partitioner.sharding import SHARDING_MODES, check_backward, check_sharding
from partitioner.tensor_parallel import not_run_split

__all__ = ["PlanRequest", "Profiling", "default_microbatches", "check_stages_divide", "TIMINGS"]

#: How a model is costed: measured op by op, or priced on a device profile (docs/profiling.md).
TIMINGS = ("measured", "analytic")

ClusterLike = Union[Cluster, str, Path, None]


def default_microbatches(ranks: int, batch: int | None) -> int:
    """The one default microbatch count: none to overlap on one rank, else enough to fill the pipeline twice.

    One pipeline rank: 1 (microbatches would only add overhead). P > 1 ranks: the largest
    count not above 2 x P that divides the step's ``batch`` (2 x P when the batch is not
    known yet, e.g. a zoo spec built to fit the count). Every entry point (``smp.plan``,
    ``smp.partition``, the CLI) takes this rule; SMP v1 scripts keep v1's own default, 1.
    """
    if ranks <= 1:
        return 1
    if batch is None:
        return 2 * ranks
    return max(d for d in range(1, min(batch, 2 * ranks) + 1) if batch % d == 0)


@dataclass(frozen=True)
class Profiling:
    """How the model is costed: measured op by op on ``device``, or priced analytically on ``device_profile``.

    ``timing`` None: analytic for a model on the meta device or when ``device_profile`` is
    given, else measured. ``dtype`` (analytic): the precision priced, ``"bf16"``/``"fp16"`` a
    mixed-precision run (the ops walked under ``torch.autocast``, docs/memory.md#mixed-precision).
    ``name`` labels the plan's model (default: the model's class).
    ``compile``: the stages will run compiled with ``torch.compile`` (the runtime does so for a
    plan made with it): analytic prices leave out the per-op dispatch (docs/cost-model.md).
    """

    timing: str | None = None
    device: Any = None
    device_profile: str | Path | None = None
    dtype: str | None = None
    frontend: str = "auto"
    leaf_modules: tuple[Any, ...] = ()
    repeats: int = 5
    name: str | None = None
    compile: bool = False

    def __post_init__(self) -> None:
        from partitioner.trace import FRONTENDS  # the tracer's front ends live with the tracer

        if self.timing is not None and self.timing not in TIMINGS:
            raise PlanError(f"unknown timing {self.timing!r}; choose {' or '.join(TIMINGS)}")
        if self.frontend not in FRONTENDS:
            raise PlanError(f"unknown frontend {self.frontend!r}; choose one of {', '.join(FRONTENDS)}")
        if self.dtype is not None:
            try:
                object.__setattr__(self, "dtype", dtype_name(self.dtype))
            except ValueError as err:
                raise PlanError(str(err)) from None
        leaf = self.leaf_modules
        object.__setattr__(self, "leaf_modules", (leaf,) if isinstance(leaf, (str, type)) else tuple(leaf))
        object.__setattr__(self, "repeats", whole(self.repeats, "repeats"))
        flag(self.compile, "compile")


@dataclass(frozen=True)
class PlanRequest:
    """What to plan, checked once: the pipeline's shape, its schedule and memory levers, the solver's budget.

    One pipeline: ``stages`` ranks (P), ``microbatches`` per step (None: :func:`default_microbatches`
    of the step's batch), under ``schedule`` (``virtual_stages`` per rank when interleaved),
    ``recompute`` ("auto", "none", "selective", "full", "offload"), at most ``active_microbatches`` in
    flight (gpipe, 1f1b), ``data_parallel`` replicas laid out by ``placement`` (None: both
    tried, the faster kept), each stage's modules split over ``tensor_parallel`` ranks (T; recorded in
    the plan, run by runtime/tensor_parallel.py, priced by partitioner/tensor_parallel.py), with
    ``sequence_parallel`` (True: required; False: off; "auto": on at T > 1 where the program allows it, its rowwise
    outputs reduce-scattered on the sequence; partitioner/tp_graph.py). A search instead:
    ``devices`` (N; D x P x T x m weighed for ``global_batch`` samples a step; T fixed, or "auto": weighed),
    ``microbatches="auto"`` or a tuple of counts, ``schedule`` "auto" or a tuple of kinds. The solver: ``cluster`` (a Cluster, a profile name or a file),
    ``memory_limit`` (bytes per device), ``method``, ``time_limit`` (seconds), ``objective``,
    ``colocate_tied``; ``training`` (None: the graph's, else a training step); ``sharding`` (how a
    stage's replicas hold its state: :mod:`partitioner.sharding`'s modes, or "auto"). ``profiling``:
    how the model is costed (:class:`Profiling`).
    """

    stages: int | None = None
    microbatches: int | str | tuple[int, ...] | None = None
    schedule: str | tuple[str, ...] = "1f1b"
    virtual_stages: int = 2
    recompute: str = "auto"
    active_microbatches: int | None = None
    data_parallel: int = 1
    tensor_parallel: int | str = 1
    sequence_parallel: bool | str = "auto"
    placement: str | None = None
    devices: int | None = None
    global_batch: int | None = None
    cluster: ClusterLike = None
    memory_limit: float | None = None
    method: str = "auto"
    time_limit: float | None = None
    objective: str = "step_time"
    colocate_tied: bool = False
    training: bool | None = None
    sharding: str = "auto"
    profiling: Profiling = field(default_factory=Profiling)

    def __post_init__(self) -> None:
        from partitioner.solve import check_choices  # the solvers' names live with the solvers

        if self.tensor_parallel == "auto":
            if self.devices is None:
                raise PlanError("tensor_parallel='auto' (the planner choosing T) is not supported yet for one plan: "
                                "it weighs T in a shape search (pass devices=N too), or pass the tensor-parallel "
                                "degree, a whole number (e.g. tensor_parallel=2)")
        else:
            object.__setattr__(self, "tensor_parallel", whole(self.tensor_parallel, "tensor_parallel"))
        if not isinstance(self.sequence_parallel, bool) and self.sequence_parallel != "auto":
            raise OptionError(f"sequence_parallel takes True, False or 'auto', got {self.sequence_parallel!r}",
                              "sequence_parallel")
        for name, optional in (("stages", True), ("virtual_stages", False), ("data_parallel", False),
                               ("devices", True), ("global_batch", True),
                               ("active_microbatches", True)):
            object.__setattr__(self, name, whole(getattr(self, name), name, optional=optional))
        flag(self.colocate_tied, "colocate_tied")
        flag(self.training, "training", optional=True)
        positive(self.memory_limit, "memory_limit", "bytes")
        positive(self.time_limit, "time_limit", "seconds")
        object.__setattr__(self, "schedule", _schedules(self.schedule))
        object.__setattr__(self, "microbatches", _microbatches(self.microbatches))
        if not isinstance(self.recompute, str):
            raise PlanError(f"recompute takes one mode for every stage, got {self.recompute!r}; for a choice per "
                            "stage, re-plan with plan.resimulate(recompute=[...])")
        try:
            object.__setattr__(self, "recompute", str(check_mode(self.recompute)))
        except PlanningError as err:
            raise PlanError(str(err)) from None
        if self.sharding != "auto" and self.sharding not in SHARDING_MODES:
            raise PlanError(f"unknown sharding {self.sharding!r}; use auto or one of {', '.join(SHARDING_MODES)}")
        if self.profiling.compile:
            self._check_compiled()
        if self.tensor_parallel != 1 and self.tensor_parallel != "auto":  # a search leaves out what T > 1 cannot run
            why = not_run_split(compiled=self.profiling.compile,
                                schedules=[self.schedule] if isinstance(self.schedule, str) else [])
            if why is not None:
                raise OptionError(f"tensor_parallel={self.tensor_parallel} does not run with {why} yet: drop it, or "
                                  "tensor_parallel=", "tensor_parallel")
        if not isinstance(self.schedule, tuple):  # a search leaves zero-bubble kinds unsharded itself
            try:
                check_backward(self.sharding, self.schedule, ScheduleKind.parse(self.schedule).split_backward)
            except ValueError as err:
                raise PlanError(str(err)) from None
        check_choices(self.method, self.objective)
        if self.placement is not None and self.placement not in PLACEMENTS:
            raise PlanError(f"unknown placement {self.placement!r}; choose {' or '.join(PLACEMENTS)}")
        if not isinstance(self.cluster, (Cluster, str, Path, type(None))):
            raise PlanError(f"cluster takes a Cluster, a profile name or a file, got {type(self.cluster).__name__}")
        if self.searching:
            if self.active_microbatches is not None:
                raise OptionError("active_microbatches fixes one schedule's warm-up, and a search weighs schedules and "
                                  "microbatch counts as they are: drop active_microbatches=, or fix the schedule and "
                                  "count", "active_microbatches")
            if self.devices is not None and self.data_parallel != 1:
                raise PlanError("devices= searches the data-parallel degree itself; drop data_parallel=")
            if self.devices is None and self.stages is None:
                raise PlanError("a microbatch or schedule search is for a pipeline of stages= ranks (or pass "
                                "devices=)")
            check_stages_divide(self.stages, self.devices)
        else:
            if self.global_batch is not None:
                raise OptionError("global_batch= goes with devices= (the shape search); without it the sample batch "
                                  "is one replica's batch", "global_batch", "devices")
            # a typo should fail before minutes of profiling
            check_active_microbatches(self.schedule, self.active_microbatches)  # type: ignore[arg-type]

    def _check_compiled(self) -> None:
        """What compiled stages cannot run is refused (docs/runtime.md#compiled-stages); a schedule search
        weighs only the kinds they run (a zero-bubble kind's W would rerun the whole compiled backward)."""
        if self.recompute == "selective":
            raise PlanError("compile=True runs each stage as one compiled graph, and selective recomputation replays "
                            "a stage op by op: use recompute='full', 'none' or 'auto' (a stage auto plans "
                            "selective runs eagerly)")
        if self.sharding not in ("auto", "none"):
            raise PlanError(f"compile=True runs unsharded stages (FSDP2's hooks around a compiled stage are not "
                            f"supported here): use sharding='none' (or 'auto'), not {self.sharding!r}")
        kinds = tuple(k for k in self.schedules if not ScheduleKind.parse(k).split_backward)
        if not kinds:
            raise PlanError(f"compile=True runs each stage's backward as one compiled graph, which cannot be split "
                            f"into B and W: schedule {self.schedules[0]!r} splits it; use gpipe, 1f1b or "
                            "interleaved")
        if isinstance(self.schedule, tuple):
            object.__setattr__(self, "schedule", kinds)

    # ------------------------------------------------------------------ building one

    @classmethod
    def build(cls, request: PlanRequest | None = None, **options: Any) -> PlanRequest:
        """``request`` (default: every default) with ``options`` in place of its fields (profiling ones included).

        An option that is no field is refused with the nearest names, so a typo fails before
        any profiling.
        """
        names = {f.name for f in fields(cls)}
        profiling_names = {f.name for f in fields(Profiling)}
        unknown = sorted(set(options) - names - profiling_names)
        if unknown:
            hints = [h for u in unknown for h in difflib.get_close_matches(u, names | profiling_names, n=1)]
            raise PlanError(f"unknown planning option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
                            + (f" (did you mean {', '.join(hints)}?)" if hints else "")
                            + f"; the options are {', '.join(sorted(names | profiling_names))}")
        base = request if request is not None else cls()
        prof = {k: options.pop(k) for k in list(options) if k in profiling_names}
        if prof:
            options["profiling"] = replace(options.get("profiling", base.profiling), **prof)
        return replace(base, **options) if options else base

    def with_(self, **changes: Any) -> PlanRequest:
        """This request with some fields changed (checked again)."""
        return PlanRequest.build(self, **changes)

    # ------------------------------------------------------------------ what it asks

    @property
    def searching(self) -> bool:
        """Whether this asks for a search over shapes (devices, microbatch counts or schedules), not one plan."""
        return self.devices is not None or not isinstance(self.microbatches, (int, type(None))) or \
            isinstance(self.schedule, tuple)

    @property
    def trains(self) -> bool:
        """Whether the plan is for training (the default, when ``training`` is unset)."""
        return self.training is not False

    @property
    def schedules(self) -> tuple[str, ...]:
        """The schedule kinds asked for: one, or those a search weighs."""
        return self.schedule if isinstance(self.schedule, tuple) else (self.schedule,)

    @property
    def microbatch_counts(self) -> tuple[int, ...] | None:
        """The microbatch counts a search weighs (None: its default grid)."""
        m = self.microbatches
        return (m,) if isinstance(m, int) else m if isinstance(m, tuple) else None

    @property
    def kind(self) -> ScheduleKind:
        """The one schedule of a single plan."""
        if isinstance(self.schedule, tuple):
            raise PlanError("this request weighs several schedules; one plan needs one schedule")
        return ScheduleKind.parse(self.schedule)

    @property
    def stages_per_rank(self) -> int:
        """Stages each pipeline rank holds: ``virtual_stages`` when interleaved, else 1."""
        return self.virtual_stages if self.kind.interleaved else 1

    def sharding_for(self, data_parallel: int) -> str:
        """The sharding mode of one plan with ``data_parallel`` replicas ("auto": none; a plan with replicas weighs
        the modes before it gets here, partitioner.compile.weigh_sharding)."""
        if self.sharding == "auto":
            return "none"
        try:
            return check_sharding(self.sharding, data_parallel)
        except ValueError as err:
            raise PlanError(str(err)) from None

    def microbatches_for(self, batch: int | None) -> int:
        """The microbatch count of one plan for a step of ``batch`` samples (the default rule when unset)."""
        if isinstance(self.microbatches, int):
            return self.microbatches
        if self.microbatches is not None:
            raise PlanError("this request weighs several microbatch counts; one plan needs one count")
        return default_microbatches(self.stages or 1, batch)


def check_stages_divide(stages: int | None, devices: int | None) -> None:
    """Refuse a stage count that does not divide the devices (each replica is one pipeline of ``stages`` ranks)."""
    if devices is not None and stages is not None and devices % stages:
        raise PlanError(f"{stages} stages do not divide {devices} devices; pass a divisor of {devices}")


def _schedules(value: Any) -> str | tuple[str, ...]:
    """One schedule kind's name, or the tuple of kinds a search weighs ("auto"/"all": every kind)."""
    try:
        if isinstance(value, ScheduleKind):
            return value.value
        if isinstance(value, str):
            if value.strip().lower() in ("auto", "all"):
                return tuple(k.value for k in ScheduleKind)
            return ScheduleKind.parse(value).value
        kinds = tuple(ScheduleKind.parse(v).value for v in value)
    except (ValueError, TypeError) as err:
        raise PlanError(str(err)) from None
    if not kinds:
        raise PlanError("schedule names no schedule")
    return kinds


def _microbatches(value: Any) -> int | str | tuple[int, ...] | None:
    """A count, "auto" (a search's default grid) or a tuple of counts; each at least 1."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        raise PlanError(f"microbatches must be a count, a list of counts or 'auto', got {value!r}")
    if isinstance(value, (list, tuple)):
        for v in value:
            whole(v, "each microbatch count", error=PlanError)  # no one option: named as it reads
        if not value:
            raise PlanError("microbatches names no count")
        return tuple(int(v) for v in value)
    whole(value, "microbatches")
    return int(value)

