"""`make test` (SMP_REQUIRE_DEV=1) fails a test that would skip for a missing dev extra; plain pytest skips it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

_NEEDS_A_MISSING_MODULE = '''
import pytest

def test_inside():
    pytest.importorskip("smp_no_such_module_inside")

def test_runs():
    assert True
'''

_MODULE_LEVEL = '''
import pytest

pytest.importorskip("smp_no_such_module_at_import")

def test_never():
    assert True
'''


def _pytest(tmp_path: Path, test_file: str, require: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_it.py").write_text(test_file)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this project's settings
    env = {k: v for k, v in os.environ.items() if k != "SMP_REQUIRE_DEV"}
    env["PYTHONPATH"] = str(TESTS) + os.pathsep + env.get("PYTHONPATH", "")
    if require:
        env["SMP_REQUIRE_DEV"] = "1"
    # -p conftest: this project's tests/conftest.py as a plugin, the hooks under test.
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-rfEs", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)


@pytest.mark.slow
def test_missing_dev_extra_skips_in_plain_pytest(tmp_path):
    proc = _pytest(tmp_path, _NEEDS_A_MISSING_MODULE, require=False)
    assert proc.returncode == 0 and "1 passed, 1 skipped" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
def test_missing_dev_extra_fails_under_make_test(tmp_path):
    proc = _pytest(tmp_path, _NEEDS_A_MISSING_MODULE, require=True)
    assert proc.returncode == 1 and "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    assert "could not import 'smp_no_such_module_inside'" in proc.stdout
    assert "SMP_REQUIRE_DEV=1 (make test) requires every dev extra" in proc.stdout
    proc = _pytest(tmp_path, _MODULE_LEVEL, require=True)  # a collection error stops the run
    assert proc.returncode == 2 and "could not import 'smp_no_such_module_at_import'" in proc.stdout, proc.stdout
    assert "SMP_REQUIRE_DEV=1 (make test) requires every dev extra" in proc.stdout


def test_make_test_sets_the_switch():
    makefile = (TESTS.parent / "Makefile").read_text()
    assert "SMP_REQUIRE_DEV=1 $(BIN)/python -m pytest" in makefile
