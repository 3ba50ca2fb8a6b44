# Two commands set everything up on a fresh machine: `make up` runs the stack, `make test` the suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up test test-unit lint bench attack chaos soak clean promtool

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

test: $(STAMP) promtool
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=20

# promtool checks the shipped alerting rules (tests/test_observability_assets.py); it comes with
# Debian's prometheus package, installed here when missing (as root; otherwise install it yourself).
promtool:
	@command -v promtool >/dev/null || { export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 \
	  || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; } \
	  || { echo "make: promtool is missing: install Debian's prometheus package (apt-get install prometheus)"; exit 1; }; }

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
