# Tidepool: `make run` to serve, `make test` to check. Both install what they need first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tidepool-installed
PYTEST_FLAGS ?= -q
export PYTHON VENV

.PHONY: install system run test test-slow test-all unit integration fuzz test-gpu bench chaos clean

install: $(STAMP) system

$(STAMP): pyproject.toml constraints/cpu.txt scripts/install.sh
	scripts/install.sh
	@touch $@

system:
	@scripts/install-system.sh

run: install
	$(PY) -m services.launch

# `make test` (what CI runs) leaves out the tests marked slow, to stay under 20 minutes on
# 2 cores (DEVELOPERS.md lists them: two-rank TP, the reduced chaos matrix, the launcher's
# restart test, whole models through the Triton interpreter, ...). `make test-slow` runs
# those; `make test-all` both.
test: install
	$(PY) -m pytest $(PYTEST_FLAGS) -m "not slow" tests/unit tests/integration

test-slow: install
	$(PY) -m pytest $(PYTEST_FLAGS) -m slow tests/unit tests/integration

test-all: install
	$(PY) -m pytest $(PYTEST_FLAGS) tests/unit tests/integration

unit: install
	$(PY) -m pytest $(PYTEST_FLAGS) tests/unit

integration: install
	$(PY) -m pytest $(PYTEST_FLAGS) tests/integration

# The long fuzzing run (make test runs a shorter one): 10,000 schemathesis requests against
# the router's OpenAPI document, and Hypothesis on the internal msgpack endpoints.
fuzz: install
	TIDEPOOL_FUZZ_REQUESTS=10000 TIDEPOOL_FUZZ_EXAMPLES=2000 $(PY) -m pytest $(PYTEST_FLAGS) --timeout 3600 tests/integration/test_fuzz_router.py tests/integration/test_fuzz_internal.py

test-gpu: install
	$(PY) -m pytest $(PYTEST_FLAGS) tests/gpu

# The fault matrix under steady load on the real stack (tests/chaos/): SIGKILL of every
# process kind, a paused decode, Redis restarted or 50 ms away, corrupt and evicted blocks,
# 200 clients leaving mid-stream, 5x overload. Writes bench/results/chaos.md; fails if a row
# misses the pass bar. `make test-slow` runs the reduced matrix (tests/integration/test_chaos.py).
# Then `make fuzz`: 10,000 schemathesis requests against the router.
chaos: install
	$(PY) -m tests.chaos --out bench/results/chaos.md
	$(MAKE) fuzz

bench: install
	$(PY) -m bench.run_all $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
