# Two commands set everything up on a fresh machine: `make up` runs the stack, `make test` the suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up test test-unit lint bench attack chaos soak clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[local,test,bench]'
	touch $(STAMP)

# `make up CONFIG=examples/two-pools`: serve every pool of a registry folder at one address.
up: $(STAMP)
	$(BIN)/lig up $(if $(CONFIG),--config $(CONFIG))

# The suite mostly waits on servers and subprocesses, so it runs in more workers than cores
# (4 halved its time on 2 cores; docs/testing.md). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 4

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=20

# The inner loop: unit tests only, no NATS, Envoy, subprocess or socket (tests/support/process_marker.py).
test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not process"

# ruff, then mypy over the packages listed in pyproject.toml's [tool.mypy].
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# Every speed benchmark in bench/, one after the other (several minutes; see bench/README.md).
bench: $(STAMP)
	for script in bench/bench_*.py; do echo "== $$script"; $(BIN)/python $$script || exit 1; done

# Attack, chaos and soak runs against a stack each starts on free loopback ports (minutes; bounded;
# see docs/resilience.md). ARGS passes flags, e.g. make attack ARGS='--only flood'.
attack: $(STAMP)
	$(BIN)/python -m resilience attack $(ARGS)

chaos: $(STAMP)
	$(BIN)/python -m resilience chaos $(ARGS)

soak: $(STAMP)
	$(BIN)/python -m resilience soak $(ARGS)

clean:
	rm -rf $(VENV) .lig .pytest_cache .mypy_cache build *.egg-info
