# Two entry points: `make demo` (plan GPT-base for 4 H100s, priced analytically on the
# meta device, and show the plan with its timeline picture) and `make test` (`make test-all`
# adds the slow cases, as CI does). Each builds .venv first when it is missing or older than
# the files that define it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP_FLAGS ?= --quiet --disable-pip-version-check
PYTEST_ARGS ?=

.PHONY: demo test test-all venv clean bench

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(PIP_FLAGS) --upgrade pip
	$(BIN)/python -m pip install $(PIP_FLAGS) -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install $(PIP_FLAGS) -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/smp plan gpt:size=base --meta --cluster h100-sxm --dtype bf16 --stages 4 --microbatches 8 -o demo-plan.json
	$(BIN)/smp inspect demo-plan.json --timeline demo-timeline.png

# SMP_REQUIRE_DEV=1: a test that would skip for a missing dev extra fails instead (tests/conftest.py).
# -n auto: one pytest-xdist worker per core (the multi-rank tests start their own processes besides).
# test: every case but those marked slow (multi-process runs, long searches), under 15 minutes on 2 cores;
# test-all: every case, the slow ones too (what CI runs: .ci/run).
test: $(STAMP)
	SMP_REQUIRE_DEV=1 $(BIN)/python -m pytest -q -n auto -m "not slow" $(PYTEST_ARGS)

test-all: $(STAMP)
	SMP_REQUIRE_DEV=1 $(BIN)/python -m pytest -q -n auto $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) demo-plan.json demo-timeline.png
