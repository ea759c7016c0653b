"""The built wheel is complete: installed on its own, away from the checkout, it plans on a built-in device profile."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PLAN_FROM_THE_WHEEL = """
import smp, partitioner.devices
from smp.models import build
assert smp.__file__.startswith({site!r}), smp.__file__
assert str(partitioner.devices.PROFILES_DIR).startswith({site!r}), partitioner.devices.PROFILES_DIR
b = build("gpt:layers=2,d_model=64,heads=2,seq_len=32,vocab=256,batch=4", meta=True)
plan = smp.plan(b.model, b.example_args, stages=2, microbatches=2, cluster="h100-sxm", device_profile="h100-sxm")
print("PLANNED", plan.partition.cluster["name"], plan.num_stages)
"""


@pytest.mark.slow
def test_an_installed_wheel_plans_on_a_built_in_profile(tmp_path: Path) -> None:
    dist, site, source = tmp_path / "dist", tmp_path / "site", tmp_path / "source"
    # a clean copy of the sources: an in-tree build would reuse a stale build/ directory
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info",
                                                                "__pycache__", ".hypothesis", ".pytest_cache"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(dist), str(source)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(dist.glob("smp-*.whl"))
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    # -S skips site.py, so the editable install's .pth (which puts the checkout on sys.path) is
    # not read; the dependencies come from site-packages named explicitly, after the wheel.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]]))
    run = subprocess.run([sys.executable, "-S", "-c", PLAN_FROM_THE_WHEEL.format(site=str(site))], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "PLANNED h100-sxm 2" in run.stdout
