"""The `smp` command line: every command, its --json output parsed back, and the user errors.

Kept lean for two shared cores: tiny models (the default `mlp`, a 1-layer GPT), one timed
run per op, one plan and one op graph made once per module and shared.
"""

from __future__ import annotations

import json
import operator
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from smp.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
SMALL = "mlp"  # 9 ops: plans in well under a second
GPT = "gpt:layers=1,d_model=32,vocab=64,seq_len=8"


def smp(*args: str):
    result = runner.invoke(app, [str(a) for a in args])
    return result


def ok(*args: str):
    result = smp(*args)
    assert result.exit_code == 0, f"smp {' '.join(map(str, args))} failed:\n{result.output}\n{result.exception!r}"
    return result


def as_json(result) -> dict:
    # --json must print one JSON document on stdout and nothing else.
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def plan_file(work) -> Path:
    path = work / "plan.json"
    ok("plan", SMALL, "--stages", 2, "--microbatches", 4, "--repeats", 1, "-o", path)
    return path


@pytest.fixture(scope="module")
def graph_file(work) -> Path:
    path = work / "graph.json"
    ok("profile", GPT, "--repeats", 1, "-o", path)
    return path


# ------------------------------------------------------------------ help


def test_help_lists_every_command_and_each_has_an_example():
    res = ok("--help")
    for cmd in ("models", "profile", "plan", "inspect", "simulate", "compare", "calibrate", "train"):
        assert cmd in res.stdout
        sub = ok(cmd, "--help")
        assert "Example: smp " + cmd in " ".join(sub.stdout.split())


def test_version():
    assert ok("--version").stdout.startswith("smp ")


# ------------------------------------------------------------------ models


@pytest.mark.slow
def test_models_table_and_json():
    res = ok("models")
    assert "gpt" in res.stdout and "1b" in res.stdout and "1,112,289,280" in res.stdout
    data = as_json(ok("models", "--json"))
    names = [m["name"] for m in data["models"]]
    assert names[:6] == ["gpt", "bert", "t5", "resnet", "unet", "mlp"]
    gpt = data["models"][0]
    assert {p["preset"]: p["params"] for p in gpt["presets"]}["1b"] == 1_112_289_280


# ------------------------------------------------------------------ profile


def test_profile_prints_totals_and_heaviest_ops(graph_file):
    from partitioner.graph import OpGraph

    graph = OpGraph.from_json(graph_file)
    assert len(graph) > 10 and graph.meta["fingerprint"] and graph.meta["name"] == GPT
    res = ok("profile", SMALL, "--repeats", 1)
    assert "9 ops" in res.stdout and "heaviest ops" in res.stdout and "totals per batch" in res.stdout


def test_profile_json_analytic_on_a_cluster_profile():
    data = as_json(ok("profile", GPT, "--timing", "analytic", "--cluster", "h100-sxm", "--top", 3, "--json"))
    assert data["kind"] == "smp.profile_summary" and data["timing"] == "analytic"
    assert data["ops"] > 10 and len(data["heaviest"]) == 3
    assert data["heaviest"][0]["fwd_s"] >= data["heaviest"][-1]["fwd_s"]
    assert data["totals"]["params_bytes"] > 0 and data["totals"]["fwd_s"] > 0


# ------------------------------------------------------------------ plan


def test_plan_table_headline_and_files(plan_file, work):
    res = ok("plan", SMALL, "--stages", 2, "--microbatches", 4, "--repeats", 1, "--memory-limit", "40GiB",
             "--timeline", work / "t.png")
    out = res.stdout
    for text in ("stage", "modules", "memory / limit", "predicted step time", "bubble", "speed-up",
                 "lower bound", "proven optimal", "40.00 GiB", "batch 16 in 4 microbatches"):
        assert text in out, text
    assert (work / "t.png").stat().st_size > 1000
    assert json.loads(plan_file.read_text())["kind"] == "smp.Plan"


def test_plan_json_is_the_documented_report(work):
    out = work / "p2.json"
    data = as_json(ok("plan", SMALL, "--stages", 2, "-m", 2, "--schedule", "gpipe", "--method", "dp",
                      "--repeats", 1, "--cluster", "cpu", "-o", out, "--json"))
    assert data["kind"] == "smp.report" and data["schema"] == 1
    assert data["schedule"] == "gpipe" and data["microbatches"] == 2 and data["num_stages"] == 2
    assert len(data["stages"]) == 2 and data["cluster"] == "cpu"
    for key in ("step_time_s", "bubble_fraction", "speedup", "bottleneck_s", "lower_bound_s", "gap", "optimal",
                "cut_tensors", "warnings"):
        assert key in data
    stage = data["stages"][0]
    for key in ("modules", "ops", "params_bytes", "activation_bytes", "fwd_s", "bwd_s", "comm_in_s", "comm_out_s",
                "memory_bytes", "memory_limit_bytes", "share"):
        assert key in stage
    assert data["cut_tensors"] and data["cut_tensors"][0]["dst_stages"] == [1]
    assert data["files"]["plan"] == str(out) and out.exists()


def test_plan_from_an_op_graph_keeps_the_fingerprint(graph_file):
    from partitioner.graph import OpGraph

    data = as_json(ok("plan", graph_file, "--stages", 2, "-m", 4, "--json"))
    assert data["model"]["fingerprint"] == OpGraph.from_json(graph_file).meta["fingerprint"]
    assert data["model"]["batch_size"] == 4 * 2  # the graph is one microbatch of the spec's batch (2)


def test_plan_big_preset_on_meta_with_a_cluster():
    data = as_json(ok("plan", "gpt:size=1b", "--meta", "--stages", 4, "-m", 4, "--cluster", "h100-sxm",
                      "--method", "dp", "--json"))
    assert data["model"]["num_params"] == 1_112_289_280 and data["model"]["timing"] == "analytic"
    assert data["stages"][0]["memory_limit_bytes"] > 70 * 2**30


def test_plan_on_meta_measured_one_op_at_a_time():
    data = as_json(ok("plan", GPT, "--meta", "--timing", "measured", "--repeats", 1, "--stages", 2, "--json"))
    assert data["model"]["timing"] == "measured" and data["model"]["profiled_on"] == "cpu"


# ------------------------------------------------------------------ inspect / simulate


def test_inspect_table_cuts_warnings_and_pictures(plan_file, work):
    res = ok("inspect", plan_file, "--timeline", work / "tl.svg", "--graph", work / "stages.svg")
    for text in ("cut tensors", "producer op", "predicted step time", "warnings"):
        assert text in res.stdout
    assert (work / "tl.svg").read_text().lstrip().startswith("<?xml")
    assert "<svg" in (work / "stages.svg").read_text()
    data = as_json(ok("inspect", plan_file, "--json"))
    assert data["plan_file"] == str(plan_file) and data["num_stages"] == 2 and isinstance(data["warnings"], list)


def test_inspect_warns_about_imbalance_and_memory(work):
    # uniform split of the GPT's ops is unbalanced; a limit just above the peak is "close to the limit".
    path = work / "uneven.json"
    data = as_json(ok("plan", GPT, "--stages", 3, "-m", 3, "--method", "uniform", "--timing", "analytic",
                      "-o", path, "--json"))
    peak = max(s["memory_bytes"] for s in data["stages"])
    data = as_json(ok("plan", GPT, "--stages", 3, "-m", 3, "--method", "uniform", "--timing", "analytic",
                      "--memory-limit", str(int(peak * 1.05)), "-o", path, "--json"))
    kinds = {w["kind"] for w in data["warnings"]}
    assert {"imbalance", "memory"} <= kinds
    assert "!" in ok("inspect", path).stdout


def test_simulate_other_schedule_and_microbatches(plan_file, work):
    data = as_json(ok("simulate", plan_file, "--schedule", "gpipe", "--microbatches", 8, "--json",
                      "--timeline", work / "sim.png", "-o", work / "sim.json"))
    assert data["schedule"] == "gpipe" and data["microbatches"] == 8
    assert data["change"]["before"]["schedule"] == "1f1b" and data["change"]["after"]["microbatches"] == 8
    assert (work / "sim.png").exists() and json.loads((work / "sim.json").read_text())["summary"]["microbatches"] == 8
    res = ok("simulate", plan_file, "--schedule", "zb-h1")
    assert "re-timed" in res.stdout and "zb-h1" in res.stdout


# ------------------------------------------------------------------ compare


def test_compare_every_method(graph_file):
    res = ok("compare", graph_file, "--stages", 2, "-m", 4, "--time-limit", 2)
    for m in ("auto", "dp", "cpsat", "uniform", "params", "blocks", "vs best"):
        assert m in res.stdout
    data = as_json(ok("compare", graph_file, "--stages", 2, "-m", 4, "--methods", "dp,uniform", "--json"))
    rows = {r["method"]: r for r in data["methods"]}
    assert set(rows) == {"dp", "uniform"}
    assert min(r["ratio_to_best"] for r in rows.values()) == pytest.approx(1.0)
    assert rows["uniform"]["step_time_s"] >= rows["dp"]["step_time_s"] * (1 - 1e-9)
    for key in ("bottleneck_s", "step_time_s", "memory_peak_bytes", "solve_seconds", "ratio_to_best"):
        assert key in rows["dp"]


# ------------------------------------------------------------------ user errors


def _fails(code: int, *args: str, match: str = "") -> str:
    res = smp(*args)
    assert res.exit_code == code, f"exit {res.exit_code}, output:\n{res.output}"
    err = res.stderr
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in res.output
    assert match.lower() in err.lower(), err
    return err


def test_unknown_model():
    _fails(2, "plan", "gptt", "--stages", 2, match="did you mean 'gpt'")
    _fails(2, "profile", "nosuchmodel", match="unknown model")


def test_bad_option_values():
    _fails(2, "plan", SMALL, "--stages", 2, "--memory-limit", "40XB", match="bad size '40XB'")
    _fails(2, "plan", SMALL, "--stages", 2, "--memory-limit", "40G", match="ambiguous")
    _fails(2, "plan", SMALL, "--stages", 2, "--schedule", "2f2b", match="--schedule")
    _fails(2, "plan", SMALL, "--stages", 2, "--method", "magic", match="--method")
    _fails(2, "plan", SMALL, "--stages", 0, match="--stages")
    _fails(2, "plan", "mlp:layers=abc", "--stages", 2, match="expected an integer")


def test_infeasible_memory_limit_says_what_would_fit():
    _fails(1, "plan", SMALL, "--stages", 2, "--repeats", 1, "--memory-limit", "1KiB", match="at least")


def test_corrupted_and_missing_plan_files(work, plan_file):
    bad = work / "bad.json"
    bad.write_text(plan_file.read_text()[:500])
    _fails(1, "inspect", bad, match="not a valid plan file")
    damaged = json.loads(plan_file.read_text())
    del damaged["partition"]
    (work / "damaged.json").write_text(json.dumps(damaged))
    _fails(1, "simulate", work / "damaged.json", match="damaged")
    (work / "other.json").write_text('{"kind": "something else"}')
    _fails(1, "inspect", work / "other.json", match="not an smp plan")
    _fails(1, "inspect", work / "missing.json", match="no plan file")
    _fails(2, "plan", plan_file, "--stages", 2, match="is a plan, not an op graph")


def test_plan_for_another_model_is_refused(plan_file):
    _fails(1, "train", GPT, "--stages", 2, "--plan", plan_file, match="made for another model")


def test_train_with_a_plan_takes_its_microbatches(plan_file):
    # plan_file: 4 microbatches. The default count was 2 x stages whatever the plan said.
    _fails(2, "train", SMALL, "--stages", 2, "--plan", plan_file, "--batch-size", 6,
           match="--batch-size 6 does not split into --microbatches 4")
    _fails(2, "train", SMALL, "--stages", 2, "--plan", plan_file, "-m", 2, match="is a plan for 4 microbatches")


def test_debug_shows_the_traceback(work):
    from smp.plan import PlanError

    res = runner.invoke(app, ["--debug", "inspect", str(work / "missing.json")])
    assert res.exit_code != 0 and isinstance(res.exception, PlanError)


@pytest.mark.slow
def test_console_script_exit_code_and_json_only_stdout(plan_file):
    exe = Path(sys.executable).parent / "smp"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "smp.cli"]
    proc = subprocess.run(cmd + ["simulate", str(plan_file), "-m", "2", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["microbatches"] == 2
    proc = subprocess.run(cmd + ["plan", "nosuch", "--stages", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.startswith("error: unknown model")


# ------------------------------------------------------------------ calibrate / train


@pytest.mark.slow
def test_calibrate_quick_writes_a_usable_profile(work):
    from partitioner.cluster import Cluster
    from partitioner.devices import DeviceSpec

    out = work / "profiles" / "here.json"
    data = as_json(ok("calibrate", "-o", out, "--quick", "--json"))
    assert data["kind"] == "smp.profile" and data["device"]["efficiency"] == 1.0
    assert {"fp32", "bf16"} <= set(data["device"]["peak_flops"])
    assert data["links"]["intra_node"]["bandwidth"] > 0 and data["links"]["intra_node"]["latency"] > 0
    assert "measured by smp calibrate on" in data["sources"]["links.intra_node"]
    assert len(Cluster.load(out, devices=3)) == 3
    assert DeviceSpec.from_profile(out).flops_per_second("fp32") > 0
    res = ok("plan", SMALL, "--stages", 2, "-m", 2, "--repeats", 1, "--cluster", out)
    assert "cluster here" in res.stdout


def test_calibrate_without_link_measurement_is_fast(work):
    out = work / "nolink.json"
    ok("calibrate", "-o", out, "--quick", "--no-link")
    data = json.loads(out.read_text())
    assert "not measured" in data["sources"]["links.intra_node"]


def trace_gpt():
    """GPT (the module's model spec) traced as the planner traces it."""
    from partitioner.trace import trace
    from smp.models import build

    bundle = build(GPT, seed=0)
    return trace(bundle.model, bundle.example_args, bundle.example_kwargs)


def test_calibrated_dispatch_prices_every_op_that_dispatches(work):
    out = work / "calibrated.json"
    ok("calibrate", "-o", out, "--quick", "--no-link")
    data = json.loads(out.read_text())
    dispatch = data["device"]["dispatch"]
    assert dispatch["fwd"] > 0 and dispatch["bwd"] > 0 and data["device"]["gemm_efficiency"]["fp32"]
    for key in ("device.dispatch", "device.gemm_efficiency"):
        assert data["sources"][key].startswith("measured by smp calibrate on"), key
    without = work / "no-dispatch.json"
    del data["device"]["dispatch"]
    without.write_text(json.dumps(data))
    cli = ["plan", GPT, "--stages", 2, "-m", 2, "--timing", "analytic", "--method", "dp", "--json", "--cluster"]
    priced, kernels_only = as_json(ok(*cli, out)), as_json(ok(*cli, without))
    ops = priced["ops"]
    assert ops == kernels_only["ops"] == sum(stage["ops"] for stage in priced["stages"])

    def total(plan: dict, key: str) -> float:
        return sum(stage[key] for stage in plan["stages"])

    # a CPU runs its ops one after another: each op that dispatches an aten op costs its kernels plus its
    # dispatch; a shape read, a buffer read or a tuple's item dispatches nothing (the cuts may differ)
    dispatching = sum(1 for n in trace_gpt().graph.nodes if n.op not in ("placeholder", "output", "get_attr")
                      and not (n.op == "call_function" and n.target is operator.getitem)
                      and not (n.op == "call_method" and n.target == "size"))
    assert 0 < dispatching < ops
    assert total(priced, "fwd_s") - total(kernels_only, "fwd_s") == pytest.approx(dispatching * dispatch["fwd"])
    assert 0 < total(priced, "bwd_s") - total(kernels_only, "bwd_s") <= ops * dispatch["bwd"] * (1 + 1e-9)


@pytest.mark.slow
def test_train_runs_with_torchrun():
    data = as_json(ok("train", SMALL, "--stages", 2, "-m", 2, "--steps", 3, "--json", "--timeout", 300))
    assert len(data["steps"]) == 3 and data["summary"]["measured_step_time"] > 0
    summary = data["summary"]
    # a real pipeline: two gloo ranks, rank 0 holding only its share of the model
    assert summary["world_size"] == 2 and summary["backend"] == "gloo"
    assert 0 < summary["rank0_params"] < summary["model_params"]


# ------------------------------------------------------------------ batches of file models

_FILE_MODEL = '''
import torch
from torch import nn


def make():
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    return net, (torch.randn(8, 16),)
'''


@pytest.fixture(scope="module")
def file_model(work) -> str:
    path = work / "mine.py"
    path.write_text(_FILE_MODEL)
    return f"{path}:make"


def test_file_model_sample_batch_is_one_microbatch(file_model, work):
    # Was: the factory's 8 rows were the whole step, so the default 2 x 3 = 6 microbatches failed.
    data = as_json(ok("plan", file_model, "--stages", 3, "--timing", "analytic", "--json"))
    assert data["microbatches"] == 6 and data["model"]["batch_size"] == 6 * 8
    # ... and planning from the saved op graph gave another step batch (48 there, 8 from the spec).
    graph = work / "mine-graph.json"
    ok("profile", file_model, "--timing", "analytic", "-o", graph)
    from_graph = as_json(ok("plan", graph, "--stages", 3, "--json"))
    assert from_graph["microbatches"] == 6 and from_graph["model"]["batch_size"] == data["model"]["batch_size"]


def test_batch_size_sets_the_step_batch_of_a_file_model(file_model):
    # Was silently ignored: the plan said batch 8 whatever --batch-size said.
    data = as_json(ok("plan", file_model, "--stages", 2, "-m", 4, "--batch-size", 64, "--timing", "analytic",
                      "--json"))
    assert data["model"]["batch_size"] == 64 and data["microbatches"] == 4
    res = ok("plan", file_model, "--stages", 3, "--batch-size", 20, "--timing", "analytic")
    assert "batch 20 in 5 microbatches of 4" in res.stdout  # 5: the largest divisor of 20 not above 2 x 3
    assert "--microbatches defaults to 5: the largest divisor of the batch (20) not above 2 x 3 stages" in res.stdout
    data = as_json(ok("profile", file_model, "--batch-size", 3, "--timing", "analytic", "--json"))
    assert data["batch_size"] == 3
    _fails(2, "plan", file_model, "--stages", 2, "-m", 4, "--batch-size", 10, match="does not split into")
    _fails(2, "plan", file_model, "--stages", 2, "--seq-len", 16, match=":make:seq_len=16")


# ------------------------------------------------------------------ output details


def test_closed_pipe_ends_quietly(plan_file, monkeypatch):
    # `smp ... | head -1` exited 1 silently: rich's broken-pipe handler.
    exe = Path(sys.executable).parent / "smp"
    proc = subprocess.Popen([str(exe), "inspect", str(plan_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and err == b"", err
    # --json writes with sys.stdout.write, which raises BrokenPipeError itself.
    from smp.cli import plan as plan_commands

    def closed(data):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(plan_commands, "print_json", closed)
    res = smp("inspect", plan_file, "--json")
    assert res.exit_code == 0 and res.stderr == ""


@pytest.mark.slow
def test_cut_tensor_table_marks_skips_and_link_times_are_explained(work):
    # t5's encoder output feeds every decoder layer: on 4 stages it jumps from stage 1 to stage 3.
    path = work / "t5.json"
    data = as_json(ok("plan", "t5", "--stages", 4, "-m", 4, "--timing", "analytic", "--cluster", "cpu",
                      "-o", path, "--json"))
    skip = next(c for c in data["cut_tensors"] if max(c["dst_stages"]) > c["src_stage"] + 1)
    out = ok("inspect", path).stdout
    row = next(line for line in out.splitlines() if line.startswith(f"{skip['producer']} "))
    assert "[skip]" in row  # rich used to eat "[skip]" as markup
    # The stage table's link time counts the activation and its gradient: twice the cut list's one-way time.
    stage = data["stages"][0]
    one_way = sum(s for c in data["cut_tensors"] if c["src_stage"] == 0 for s in c["seconds"])
    assert stage["comm_out_s"] == pytest.approx(2 * one_way, rel=1e-9)
    assert "link time both ways (activation forward, gradient back)" in out and "time each way" in out


def test_splitting_that_does_not_pay_says_so(work):
    # A link whose latency dwarfs the model's work: the solver keeps (almost) everything on one stage.
    profile = json.loads((ROOT / "profiles" / "cpu.json").read_text())
    for link in profile["links"].values():
        link["latency"], link["bandwidth"] = 1.0, 1e6
    slow = work / "slow-link.json"
    slow.write_text(json.dumps(profile))
    data = as_json(ok("plan", GPT, "--stages", 2, "-m", 2, "--timing", "analytic", "--cluster", slow, "--json"))
    assert data["speedup"] < 1.1
    kinds = [w["kind"] for w in data["warnings"]]
    assert "no_gain" in kinds and "imbalance" not in kinds  # not "more ops or a finer graph would even it out"
    message = next(w["message"] for w in data["warnings"] if w["kind"] == "no_gain")
    assert "communication dominates" in message and "use fewer stages" in message and "1.00 s" in message


def test_splitting_that_does_not_pay_for_other_reasons_says_why(work):
    # One microbatch: balanced stages, but the pipeline idles half the step.
    data = as_json(ok("plan", GPT, "--stages", 2, "-m", 1, "--timing", "analytic", "--json"))
    message = next(w["message"] for w in data["warnings"] if w["kind"] == "no_gain")
    assert "stages balanced but the pipeline idle" in message and "use more microbatches" in message
    # One op holds nearly all the work: on free links no split can beat it.
    path = work / "one_big_op.py"
    path.write_text("import torch\nfrom torch import nn\n\n\ndef make():\n"
                    "    net = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 8))\n"
                    "    return net, (torch.randn(64, 2048),)\n")  # two ops: one per stage, the split proven best
    data = as_json(ok("plan", f"{path}:make", "--stages", 2, "-m", 2, "--timing", "analytic", "--json"))
    message = next(w["message"] for w in data["warnings"] if w["kind"] == "no_gain")
    assert "alone takes" in message and "use fewer stages" in message and "communication" not in message


def test_imbalance_advice_follows_where_the_bottleneck_spends_its_time(work):
    profile = json.loads((ROOT / "profiles" / "cpu.json").read_text())
    for link in profile["links"].values():
        link["latency"], link["bandwidth"] = 1e-4, 1e9
    link_file = work / "slowish-link.json"
    link_file.write_text(json.dumps(profile))
    # d_model 192: with the cpu profile's per-op dispatch, 64 and 128 balance the parameter split's stages too well
    data = as_json(ok("plan", "gpt:layers=2,d_model=192", "--stages", 3, "-m", 6, "--timing", "analytic",
                      "--cluster", link_file, "--method", "params", "--json"))
    worst = data["stages"][data["bottleneck_stage"]]
    share = (worst["comm_in_s"] + worst["comm_out_s"]) / worst["time_s"]
    assert share > 0.25 and data["speedup"] > 1.1
    advice = [w["message"] for w in data["warnings"] if w["kind"] == "imbalance"]
    assert advice and all(f"communication is {share:.0%} of the bottleneck stage's time, so fewer stages or a "
                          "faster link would help more than a finer graph" in m for m in advice)


def test_stage_labels_do_not_span_layers_a_stage_lacks():
    from partitioner.cost import module_range

    # A Llama stage holding layers 0-1 and one parameterless op of layer 3 read "model.layers.0–3".
    label = module_range(["model.embed_tokens"] + ["model.layers.0.mlp"] * 9 + ["model.layers.1.mlp"] * 9
                         + ["model.layers.3.self_attn"])
    assert label == "model, model.layers.0–1 (+1 op of 3)"
    assert module_range(["blocks.2.x"] * 3 + ["blocks.3.y"] * 4 + ["blocks.5.z"] * 2 + ["blocks.6.z"]) == \
        "blocks.2–3 (+3 ops of 5–6)"


# ------------------------------------------------------------------ train: file models, failures on ranks

_NO_TARGET_NO_LOSS = '''
import torch
from torch import nn


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), (torch.randn(4, 6),)


def _bad_loss(output, target):
    raise ValueError("this loss is not ready")


def bad_loss():
    model, args = make()
    return {"model": model, "args": args, "loss_fn": _bad_loss}
'''


@pytest.fixture(scope="module")
def train_file(work) -> Path:
    path = work / "train_me.py"
    path.write_text(_NO_TARGET_NO_LOSS)
    return path


@pytest.mark.slow
def test_train_a_factory_that_returns_model_and_args(train_file):
    # Was: the ranks stopped at "step() needs the target", and only torchrun's summary reached the user.
    from smp.models import build_step

    data = as_json(ok("train", f"{train_file}:make", "--stages", 2, "-m", 2, "--steps", 2, "--json",
                      "--timeout", 300))
    bundle = build_step(f"{train_file}:make", microbatches=2)  # the batch every rank trains on
    with torch.no_grad():
        mean_of_output = bundle.model(*bundle.example_args).float().mean().item()
    assert data["summary"]["batch_size"] == 8  # 2 microbatches of the factory's 4 rows
    assert data["steps"][0]["loss"] == pytest.approx(mean_of_output, rel=1e-5, abs=1e-6)  # docs/models.md's default


@pytest.mark.slow
def test_a_failing_rank_reports_its_own_error(train_file):
    err = _fails(1, "train", f"{train_file}:bad_loss", "--stages", 2, "-m", 2, "--steps", 1, "--timeout", 300, "--json",
                 match="your code raised ValueError: this loss is not ready")
    line = next(i for i, text in enumerate(_NO_TARGET_NO_LOSS.splitlines(), 1) if "not ready" in text)
    assert err.startswith("error: rank 1: ") and f"{train_file}:{line} in _bad_loss" in err
    assert "torchrun" not in err and "To enable traceback" not in err


def test_the_cli_schedule_names_are_the_schedule_kinds():
    from partitioner.ir import ScheduleKind
    from smp.cli.options import SCHEDULE_CHOICES, choice

    assert SCHEDULE_CHOICES == tuple(k.value for k in ScheduleKind)
    assert choice("interleaved_1f1b", SCHEDULE_CHOICES, "--schedule") == "interleaved"
    assert choice("ZB_H1", SCHEDULE_CHOICES, "--schedule") == "zb-h1"
