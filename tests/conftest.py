"""Shared test set-up: offline Hugging Face, deterministic torch, small thread count, no silent dev-extra skips."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The CLI prints 160 columns wide without a terminal unless COLUMNS says otherwise; pytest-xdist's workers
# inherit COLUMNS=80 from the controller, which wraps the lines the tests read.
os.environ["COLUMNS"] = "160"

import torch  # noqa: E402

# one intra-op thread per pytest-xdist worker (make test runs one worker per core), at most two otherwise
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))

#: Set by `make test`, where the dev extras (transformers, hypothesis) are installed: a test
#: that skips because it cannot import one is then a broken environment, and fails.
REQUIRE_DEV = "SMP_REQUIRE_DEV"


def _failure(skip_message: str) -> str | None:
    """Why a skip must fail under REQUIRE_DEV (a pytest.importorskip that found no module), else None."""
    if os.environ.get(REQUIRE_DEV) != "1" or not skip_message.startswith("could not import"):
        return None
    return (f"{skip_message}\n{REQUIRE_DEV}=1 (make test) requires every dev extra: install them with "
            "`pip install -e '.[dev]'` (or `make venv`)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and call.excinfo is not None and call.excinfo.errisinstance(pytest.skip.Exception):
        failure = _failure(str(call.excinfo.value.msg))
        if failure:
            report.outcome, report.longrepr = "failed", failure


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(report.longrepr, tuple):  # a module-level importorskip
        failure = _failure(str(report.longrepr[2]).removeprefix("Skipped: "))
        if failure:
            report.outcome, report.longrepr = "failed", failure
