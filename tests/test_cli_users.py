"""What a new user hit with `smp` (issue 40, round two): each test fails without its fix."""

from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from smp.cli import app

runner = CliRunner()


def ok(*args: object):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, f"smp {' '.join(map(str, args))} failed:\n{result.output}\n{result.exception!r}"
    return result


# ------------------------------------------------------------------ a model file importing its siblings

_LAYERS = '''
from torch import nn


def block(width):
    return nn.Sequential(nn.Linear(width, width), nn.ReLU())
'''

_NET = '''
import torch
from torch import nn

from layers import block


def make():
    return nn.Sequential(block(8), block(8), nn.Linear(8, 2)), (torch.randn(4, 8),)
'''


@pytest.fixture
def sibling_model(tmp_path, monkeypatch) -> str:
    """net.py imports layers.py from its own folder; run from another folder, as a user would."""
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "layers.py").write_text(_LAYERS)
    (folder / "net.py").write_text(_NET)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader adds the folder: keep it to this test
    monkeypatch.delitem(sys.modules, "layers", raising=False)
    return "models/net.py:make"


def test_a_model_file_imports_modules_beside_it(sibling_model):
    # Was: ModuleNotFoundError: No module named 'layers' (even run from the file's own folder).
    data = json.loads(ok("plan", sibling_model, "--stages", 2, "-m", 2, "--timing", "analytic", "--json").stdout)
    assert data["microbatches"] == 2


# ------------------------------------------------------------------ the stage table's op counts


def test_the_stage_ops_sum_to_the_headline_op_count():
    # Was one more: the graph's output node counted as an op of the last stage, but not in "N ops" above it.
    data = json.loads(ok("plan", "mlp", "--stages", 2, "-m", 2, "--timing", "analytic", "--json").stdout)
    assert sum(stage["ops"] for stage in data["stages"]) == data["ops"]
    out = ok("plan", "mlp", "--stages", 2, "-m", 2, "--timing", "analytic").stdout
    headline_ops = int(out.split(": ", 1)[1].split(" ops", 1)[0])
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("stage  rank"))
    end = lines[header].index(" ops ") + len(" ops")  # the column is right-aligned under its header
    table_ops = [int(line[:end].split()[-1]) for line in lines[header + 2:header + 4]]
    assert headline_ops == data["ops"] and sum(table_ops) == headline_ops, out


# ------------------------------------------------------------------ bad usage: one error line, exit 2


@pytest.mark.parametrize("argv, says", [
    (["plan", "mlp", "--stage", "2"], "no such option --stage (did you mean --stages?); see `smp plan --help`"),
    (["plan"], "missing argument 'MODEL|GRAPH.json'; see `smp plan --help`"),
    (["plan", "mlp", "--stages", "two"], "invalid value for '--stages' / '-p': * integer*; see `smp plan --help`"),
    (["plann", "mlp"], "no such command 'plann' (did you mean 'plan'?); see `smp --help`"),
])
def test_bad_usage_is_one_error_line_and_exit_2(argv, says, capsys):
    # Was typer's boxed usage panel (several lines) where docs/cli.md promises one `error:` line.
    from smp.cli import main

    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and fnmatch.fnmatchcase(err, f"error: {says}\n"), err  # the value's wording is typer's


def test_help_and_no_arguments_still_show_the_help(capsys):
    from smp.cli import main

    assert main(["plan", "--help"]) == 0 and "Usage: smp plan" in capsys.readouterr().out
    assert main([]) == 2 and "Usage: smp" in capsys.readouterr().out


# ------------------------------------------------------------------ smp train: what the rank reports

_KWARGS_MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


def make():
    torch.manual_seed(0)
    return {"model": Net(), "args": (), "kwargs": {"x": torch.randn(4, 6)}}
'''


def test_a_train_rank_reads_the_batch_of_keyword_inputs(tmp_path, capsys):
    # Was batch size 1 (and samples/s per step, not per sample): only positional tensors were looked at.
    from smp.cli.train_worker import EVENT_PREFIX, main

    path = tmp_path / "kw.py"
    path.write_text(_KWARGS_MODEL)
    job = {"spec": f"{path}:make", "microbatches": 2, "schedule": "1f1b", "steps": 1, "batch_size": None,
           "seq_len": None, "lr": 1e-3, "device": "cpu", "timeout": 60.0, "plan": None}
    assert main([json.dumps(job)]) == 0  # one rank, no torchrun: the whole model on this process
    events = [json.loads(line[len(EVENT_PREFIX):]) for line in capsys.readouterr().out.splitlines()
              if line.startswith(EVENT_PREFIX)]
    step, summary = events[0], events[-1]
    assert summary["batch_size"] == 8  # 2 microbatches of the factory's 4 rows
    assert step["samples_per_s"] == pytest.approx(8 / step["seconds"])


_DIES_ON_RANK_1 = '''
import os
import signal

import torch
from torch import nn

calls = 0


def _loss(output, target):
    global calls
    calls += 1
    if os.environ.get("RANK") == "1" and calls > 2:  # step 2's first microbatch: as the OOM killer would
        os.kill(os.getpid(), signal.SIGKILL)
    return output.float().mean()


def make():
    torch.manual_seed(0)
    return {"model": nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), "args": (torch.randn(4, 6),),
            "loss_fn": _loss}
'''


@pytest.mark.slow
def test_a_killed_rank_is_reported_with_its_signal_after_the_steps_it_made(tmp_path):
    # Was: "rank 0: internal error (... Connection closed by peer); this is a bug in smp", and step 1's line,
    # kept until the run ended, was never printed.
    path = tmp_path / "dies.py"
    path.write_text(_DIES_ON_RANK_1)
    res = runner.invoke(app, ["train", f"{path}:make", "--stages", "2", "-m", "2", "--steps", "3", "--timeout", "300"])
    assert res.exit_code == 1, res.output
    assert res.stderr.splitlines()[-1].startswith("error: rank 1 was killed by signal 9 (SIGKILL)"), res.stderr
    assert "bug in smp" not in res.stderr and "Traceback" not in res.output
    assert res.stdout.startswith("step    1  loss "), res.stdout


@pytest.mark.slow
def test_ctrl_c_stops_the_ranks_and_ends_with_one_line(tmp_path):
    # Was: "error: interrupted", then the ranks went on training (and a traceback could follow).
    import os
    import signal
    import subprocess
    import time

    path = tmp_path / "long_run.py"
    path.write_text(_KWARGS_MODEL)
    proc = subprocess.Popen([sys.executable, "-m", "smp.cli", "train", f"{path}:make", "--stages", "2", "-m", "2",
                             "--steps", "100000", "--timeout", "300"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def ranks_left() -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and str(path) in (entry / "cmdline").read_text():
                    pids.append(int(entry.name))
            except OSError:
                pass
        return [pid for pid in pids if pid != proc.pid]

    try:
        assert proc.stdout.readline().startswith("step    1  loss "), proc.stderr.read()  # the ranks are training
        proc.send_signal(signal.SIGINT)  # Ctrl-C reaches smp (and torchrun; the ranks have their own sessions)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and err.splitlines()[-1] == "error: interrupted" and "Traceback" not in err, err
        deadline = time.monotonic() + 20
        while ranks_left() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not ranks_left()
    finally:
        for pid in [proc.pid, *ranks_left()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_a_plan_says_how_steady_its_measured_profile_was():
    import torch
    from torch import nn

    import smp
    from smp.cli.render import plan_header, warnings_for

    made = smp.plan(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(8, 4), stages=2,
                    microbatches=2, timing="measured", repeats=2)
    made.graph.meta["timing_spread"], made.graph.meta["threads"] = 0.12, 1
    assert "(1 thread, sweeps spread 12%)" in plan_header(made)
    assert all(w["kind"] != "unstable_timing" for w in warnings_for(made))
    made.graph.meta["timing_spread"] = 9.0
    assert [w for w in warnings_for(made) if w["kind"] == "unstable_timing"]


def test_a_python_warning_under_a_command_is_one_warning_line_without_a_source_path(monkeypatch):
    # CI (a busy machine) printed "/.../smp/cli/profile.py:93: RuntimeWarning: profiling ...: unstable
    # timings ..." from `smp profile`: a raw Python warning with smp's source path in a user's output.
    import importlib

    profile_module = importlib.import_module("partitioner.profile")  # the package exports a function of that name
    monkeypatch.setattr(profile_module, "unstable_timing_warning", lambda spread: "unstable timings: forced")
    result = ok("profile", "gpt:layers=1,d_model=16,heads=2,vocab=32,seq_len=8", "--batch-size", "2", "--repeats", "1")
    warned = [line for line in result.stderr.splitlines() if "unstable timings" in line]
    assert warned == ["warning: profiling GPT: unstable timings: forced"], result.stderr
    assert ".py:" not in result.stderr


def test_a_rank_whose_own_code_raised_is_named_before_the_ranks_that_failed_with_it():
    # xdist's busy CI run: rank 0 (failing together, naming rank 1) reported first and the line blamed smp
    from smp.cli.train import _failure

    errors = [{"rank": 0, "message": "PipelineError: pipeline step failed: rank 1 raised ValueError: not ready",
               "user_error": False},
              {"rank": 1, "message": "your code raised ValueError: not ready", "user_error": True}]
    assert _failure(1, errors, []) == "rank 1: your code raised ValueError: not ready (rank 0 failed too)"
