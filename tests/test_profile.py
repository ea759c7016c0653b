"""Profiler: exact parameter and output bytes, measured timing's mechanics on a fake clock, analytic costs on meta."""

import pytest
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from partitioner import OpGraph, ProfileError, TraceError, flatten_inputs, profile, trace
from partitioner.devices import DeviceSpec, load_profile
from partitioner.graph import OUTPUT_OP
from partitioner.program import op_nodes
from smp.models import build

ZOO = ["gpt", "bert", "t5", "resnet", "unet", "mlp"]


def _unique_param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("name", ZOO + ["hf-gpt2", "hf-bert", "hf-t5"])
def test_params_sum_to_unique_parameter_bytes(name):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    bundle = build(name if name.startswith("hf-") else f"{name}:size=tiny")
    graph = profile(bundle.model, bundle.example_args, bundle.example_kwargs, repeats=1, warmup=0)
    assert graph.total_params == _unique_param_bytes(bundle.model)
    for node in graph.nx:
        data = graph[node]
        assert data["fwd"] >= 0 and data["bwd"] >= 0 and 0 <= data["bwd_w"] <= data["bwd"] + 1e-12
        assert set(data) >= {"fwd", "bwd", "params", "out_bytes", "flops", "module", "op"}


def test_tied_parameter_is_counted_once_and_marked():
    bundle = build("gpt:size=tiny")
    graph = profile(bundle.model, bundle.example_args, repeats=1, warmup=0)
    shared = [n for n in graph.nx if graph[n]["shared_params"]]
    assert len(shared) == 1
    head = graph[shared[0]]
    assert head["params"] == 0  # its weight was counted on the embedding
    assert head["shared_bytes"] == bundle.model.tok_emb.weight.numel() * 4  # but a stage holding it holds it
    owner = [n for n in graph.nx if "tok_emb.weight" in graph[n]["param_names"]]
    assert graph[owner[0]]["params"] == bundle.model.tok_emb.weight.numel() * 4


class _Recorder(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.bytes = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.bytes[n.name] = sum(t.numel() * t.element_size() for t in pytree.tree_leaves(out)
                                 if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("name", ["gpt", "unet", "t5"])
def test_out_bytes_are_the_real_output_sizes(name):
    bundle = build(f"{name}:size=tiny")
    gm = trace(bundle.model, bundle.example_args, bundle.example_kwargs)
    graph = profile(bundle.model, bundle.example_args, bundle.example_kwargs, graph_module=gm,
                    repeats=1, warmup=0)
    recorder = _Recorder(gm)
    with torch.no_grad():
        recorder.run(*flatten_inputs(gm, bundle.example_args, bundle.example_kwargs))
    ops, _ = op_nodes(gm)
    assert len(graph) == len(ops)
    op_names = [n for n in graph.nx if graph[n]["op"] != OUTPUT_OP]  # the output node sends nothing itself
    for node in op_names[:: max(1, len(graph) // 25)]:
        assert graph[node]["out_bytes"] == recorder.bytes[node], node


class _FakeClock:
    """Stands for the profiler's clock: the k-th timed call takes ``seconds(k)``; notes torch's threads meanwhile."""

    def __init__(self, seconds):
        self.seconds = seconds
        self.reads = 0
        self.threads = set()

    def __call__(self):
        self.threads.add(torch.get_num_threads())
        self.reads += 1
        return 0.0 if self.reads % 2 else self.seconds(self.reads // 2 - 1)  # read at the start, then the end

    @property
    def timed_calls(self):
        return self.reads // 2


def _three_linears():
    """Five ops, all trainable (every output asks for a gradient), three with weights, of which the first, fed
    by data, has no input gradient: a sweep of each kind times 5 forwards, 5 backwards and 2 input gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 4))
    return model, (torch.randn(4, 8),)


def test_measured_times_are_what_the_clock_gave(monkeypatch):
    """The mechanics of measured timing on a fake clock, never the wall's: every op gets the seconds the
    clock gave, the sums are theirs, warmup + repeats sweeps of each kind, on one thread, restored after.
    How close real sums come to a timed whole model is benchmarks/profile_accuracy.py's figure."""
    import partitioner.profile_measured as measured

    clock = _FakeClock(lambda k: 1e-3)
    monkeypatch.setattr(measured, "clock", clock)
    threads = torch.get_num_threads()
    model, args = _three_linears()
    graph = profile(model, args, repeats=3, warmup=2)
    ops = [n for n in graph.nx if graph[n]["op"] != OUTPUT_OP]
    assert len(ops) == 5
    assert all(graph[n]["fwd"] == 1e-3 and graph[n]["bwd"] == 1e-3 for n in ops)
    assert [graph[n]["bwd_w"] for n in ops] == [1e-3, 0.0, 0.0, 0.0, 0.0]  # the first's backward: its weights'
    assert graph.total_fwd == pytest.approx(5e-3) and graph.total_bwd == pytest.approx(5e-3)
    # forward sweeps over 5 ops, backward sweeps over 5, input-gradient sweeps over 2
    assert clock.timed_calls == (2 + 3) * (5 + 5 + 2)
    assert clock.threads == {measured.PROFILE_THREADS} and torch.get_num_threads() == threads
    assert graph.meta["threads"] == measured.PROFILE_THREADS and graph.meta["timing_spread"] == 0.0
    graph = profile(model, args, repeats=1, warmup=0, threads=None)  # torch's setting left alone
    assert clock.threads == {measured.PROFILE_THREADS, threads} and graph.meta["threads"] == threads


def test_a_busy_spell_gets_more_sweeps_and_the_medians_are_over_all_of_them(monkeypatch):
    import partitioner.profile_measured as measured

    first_set = (2 + 3) * 5  # the first forward sweeps, warm-up included; then the machine is quiet
    clock = _FakeClock(lambda k: 1e-3 * 2.0 ** k if k < first_set else 1e-3)
    monkeypatch.setattr(measured, "clock", clock)
    with pytest.warns(RuntimeWarning, match="unstable timings"):  # the spell stays among the sweeps
        graph = profile(*_three_linears(), repeats=3, warmup=2)
    # 3 slow sweeps and 6 quiet ones per op: the medians are the quiet seconds
    assert all(graph[n]["fwd"] == 1e-3 for n in graph.nx if graph[n]["op"] != OUTPUT_OP)
    assert clock.timed_calls == first_set + measured.RETRIES * 3 * 5 + (2 + 3) * (5 + 2)
    assert graph.meta["timing_spread"] > measured.UNSTABLE_SPREAD


def test_timings_that_stay_unstable_are_flagged_with_their_spread(monkeypatch, tmp_path):
    import partitioner.profile_measured as measured

    clock = _FakeClock(lambda k: 1e-3 * 1.3 ** k)  # ever slower: every set of sweeps spreads widely
    monkeypatch.setattr(measured, "clock", clock)
    with pytest.warns(RuntimeWarning, match=r"unstable timings: the profile's sweeps differed by \d+%"):
        graph = profile(*_three_linears(), repeats=3, warmup=2)
    assert clock.timed_calls == (2 + 3 * (1 + measured.RETRIES)) * (5 + 5 + 2)  # every kind measured 3 times
    assert graph.meta["timing_spread"] > measured.UNSTABLE_SPREAD
    # the plan made from it carries the figure (in its graph's meta, saved with it) and the warning
    from partitioner import Plan, plan_from_graph

    plan = plan_from_graph(graph, stages=2, microbatches=2, schedule="gpipe")
    plan = Plan.load(plan.save(tmp_path / "plan.json"))
    assert plan.timing_spread == graph.meta["timing_spread"]
    assert f"{plan.timing_spread:.0%}" in plan.timing_warning


def test_steady_or_analytic_profiles_make_plans_without_a_timing_warning(monkeypatch):
    import partitioner.profile_measured as measured
    from partitioner import plan_from_graph

    monkeypatch.setattr(measured, "clock", _FakeClock(lambda k: 1e-3))
    model, args = _three_linears()
    steady = plan_from_graph(profile(model, args, repeats=3, warmup=1), stages=2, microbatches=2, schedule="gpipe")
    assert steady.timing_spread == 0.0 and steady.timing_warning is None
    priced = plan_from_graph(profile(model, args, timing="analytic"), stages=2, microbatches=2, schedule="gpipe")
    assert priced.timing_spread is None and priced.timing_warning is None


def test_sweep_spread_is_the_totals_range_over_their_median():
    from partitioner.profile_measured import sweep_spread, sweep_totals

    assert sweep_totals({"a": [1.0, 2.0, 3.0], "b": [1.0, 1.0, 1.0], "no backward": []}) == [2.0, 3.0, 4.0]
    assert sweep_spread([2.0, 3.0, 4.0]) == pytest.approx(2.0 / 3.0)
    assert sweep_spread([5.0]) == 0.0 and sweep_spread([]) == 0.0


def test_profile_leaves_model_state_untouched():
    bundle = build("resnet:size=tiny")
    bundle.model.train()
    state = {k: v.clone() for k, v in bundle.model.state_dict().items()}
    profile(bundle.model, bundle.example_args, repeats=2, warmup=1)
    assert bundle.model.training
    for k, v in bundle.model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(p.grad is None for p in bundle.model.parameters())


def test_analytic_timing_plans_a_1b_model_on_meta():
    bundle = build("gpt:size=1b", meta=True)
    # The roofline's kernels alone: h100-sxm without its host dispatch per op (which the last lines check)
    kernels_only = load_profile("h100-sxm")
    kernels_only["device"] = {k: v for k, v in kernels_only["device"].items() if k != "dispatch"}
    graph = profile(bundle.model, bundle.example_args, timing="analytic", device_profile=kernels_only,
                    dtype="bf16")
    assert graph.meta["timing"] == "analytic"
    assert graph.total_params == _unique_param_bytes(bundle.model)
    # A decoder's forward is about 2 FLOPs per matmul parameter per token, plus attention.
    cfg = bundle.config
    tokens = cfg["batch"] * cfg["seq_len"]
    matmul_params = bundle.num_params() - cfg["seq_len"] * cfg["d_model"]  # all but the position table
    ratio = graph.total_flops / (2 * matmul_params * tokens)
    assert 0.9 <= ratio <= 1.6, ratio
    # Roofline time of the whole forward cannot beat the device at full efficiency.
    assert graph.total_fwd >= graph.total_flops / 9.894e14
    assert 1.5 <= graph.total_bwd / graph.total_fwd <= 2.5
    priced = profile(bundle.model, bundle.example_args, timing="analytic", device_profile="h100-sxm", dtype="bf16")
    spec = DeviceSpec.from_profile("h100-sxm")
    assert priced.total_fwd >= max(graph.total_fwd, len(priced) * spec.dispatch_fwd)


META_MEASURED = ["mlp:layers=4,d_in=256,hidden=512,d_out=256,batch=8",  # fx, one weight per op
                 "gpt:layers=2,d_model=64,heads=4,vocab=128,seq_len=16,batch=2",  # tied embedding, buffers
                 "hf-llama"]  # torch.export: parameters and constants fetched by get_attr


@pytest.mark.parametrize("spec", META_MEASURED)
def test_a_model_on_meta_is_measured_one_op_at_a_time(spec, monkeypatch):
    if spec.startswith("hf-"):
        pytest.importorskip("transformers")
    import weakref

    import partitioner.profile_measured as measured

    alive: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()
    most = [0]
    materialize = measured.materialized

    def tracked(tensor, device):
        real = materialize(tensor, device)
        if tensor.is_meta:
            alive.add(real)
            most[0] = max(most[0], sum(t.numel() * t.element_size() for t in alive))
        return real

    monkeypatch.setattr(measured, "materialized", tracked)
    meta = build(spec, meta=True)
    graph = profile(meta.model, meta.example_args, meta.example_kwargs, repeats=1, warmup=0)
    assert graph.meta["timing"] == "measured" and graph.meta["one_op_at_a_time"] and graph.meta["device"] == "cpu"
    assert all(p.is_meta for p in meta.model.parameters())  # the model as given is left on meta
    # Bytes and FLOPs are those analytic timing counts on meta; the times are measured for real.
    counted = profile(meta.model, meta.example_args, meta.example_kwargs, timing="analytic", device_profile="cpu")
    for name, data in counted.nx.nodes(data=True):
        for key in ("params", "shared_bytes", "buffers", "out_bytes", "flops", "saved_bytes", "storage_bytes"):
            assert graph.nx.nodes[name][key] == data[key], (name, key)
    assert all(d["fwd"] > 0 for _, d in graph.nx.nodes(data=True) if d["op"] != OUTPUT_OP)
    assert all(d["bwd"] > 0 for _, d in graph.nx.nodes(data=True) if d["params"])
    # Only one op's weights (and the sample batch, made up from meta too) were ever real at a time.
    one_op = max(d["params"] + d["shared_bytes"] + d["buffers"] for _, d in graph.nx.nodes(data=True))
    batch = sum(t.numel() * t.element_size() for t in pytree.tree_leaves((meta.example_args, meta.example_kwargs))
                if isinstance(t, torch.Tensor))
    assert 0 < most[0] <= one_op + batch, (most[0], one_op, batch)
    assert not list(alive)


def test_delay_param_initialization_models_are_measured_one_op_at_a_time():
    import smp

    with smp.delay_param_initialization():
        bundle = build("gpt:layers=2,d_model=64,heads=4,vocab=128,seq_len=16,batch=2")
    assert all(p.is_meta for p in bundle.model.parameters())
    graph = profile(bundle.model, bundle.example_args, repeats=1, warmup=0)
    assert graph.meta["one_op_at_a_time"] and graph.total_params == _unique_param_bytes(bundle.model)
    assert graph.total_fwd > 0 and graph.total_bwd > 0


@pytest.mark.parametrize("spec", ["gpt:layers=3,d_model=64,heads=4,vocab=128,seq_len=16,batch=2",
                                  "resnet:size=tiny", "t5:size=tiny"])
def test_ops_that_compute_the_same_are_costed_once_with_the_same_costs(spec, monkeypatch):
    import importlib

    profiling = importlib.import_module("partitioner.profile")
    meta = build(spec, meta=True)
    counted = []
    count = profiling._OpRunner._count_cost

    def counting(self, node, *rest):
        counted.append(node.name)
        return count(self, node, *rest)

    monkeypatch.setattr(profiling._OpRunner, "_count_cost", counting)
    cached = profile(meta.model, meta.example_args, meta.example_kwargs, timing="analytic", device_profile="h100-sxm")
    once = len(counted)
    counted.clear()
    monkeypatch.setattr(profiling._OpRunner, "_cost_key", lambda *_: None)
    every = profile(meta.model, meta.example_args, meta.example_kwargs, timing="analytic", device_profile="h100-sxm")
    assert once < len(counted)
    for name, data in every.nx.nodes(data=True):
        for key in ("fwd", "bwd", "bwd_w", "flops"):
            assert cached.nx.nodes[name][key] == data[key], (name, key)


def test_profiled_graph_json_round_trip(tmp_path):
    bundle = build("unet:size=tiny")
    graph = profile(bundle.model, bundle.example_args, repeats=1, warmup=0)
    graph.to_json(tmp_path / "graph.json")
    again = OpGraph.from_json(tmp_path / "graph.json")
    assert again == graph
    assert again.total_fwd == graph.total_fwd and again.meta == graph.meta


def test_profile_errors():
    bundle = build("mlp:size=tiny")
    with pytest.raises(TraceError, match="do not match"):
        profile(bundle.model, (bundle.example_args[0], 3, 4))
    meta = build("mlp:size=tiny", meta=True)
    with pytest.raises(ValueError, match="analytic"):
        profile(meta.model, meta.example_args, device="meta")
    with pytest.raises(ValueError, match="timing"):
        profile(bundle.model, bundle.example_args, timing="guess")
    with pytest.raises(ProfileError, match="built-in names"):
        profile(bundle.model, bundle.example_args, timing="analytic", device_profile="tpu-v9")


def test_progress_callback_reports_every_op():
    bundle = build("mlp:size=tiny")
    seen = []
    graph = profile(bundle.model, bundle.example_args, repeats=2, warmup=1,
                    progress=lambda done, total: seen.append((done, total)))
    total = seen[-1][1]
    # one unit per op for the walk, then per op for each forward, backward and input-gradient sweep
    assert total == len(graph) * (1 + 3 * (2 + 1))
    assert seen[-1] == (total, total)
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))


def test_in_place_modules_and_functions_profile():
    import torch.nn.functional as F
    from torch import nn

    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=True))
            self.out = nn.Linear(16, 4)

        def forward(self, x):
            return self.out(F.relu(self.body(x), inplace=True))

    model, x = InPlace(), torch.randn(8, 8)
    for timing in ("measured", "analytic"):
        graph = profile(model, (x,), timing=timing, repeats=1, warmup=0)
        assert graph.total_params == _unique_param_bytes(model)
        assert graph.total_bwd > 0


def test_profiling_leaves_the_callers_random_stream_alone():
    bundle = build("gpt:size=tiny,dropout=0.1")
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    profile(bundle.model, bundle.example_args, repeats=1, warmup=0)
    assert torch.equal(torch.rand(3), expected)
