# Tidepool: `make run` to serve, `make test` to check. Both install what they need first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tidepool-installed
PYTEST_FLAGS ?= -q
export PYTHON VENV

.PHONY: install system run test unit integration fuzz test-gpu bench clean

install: $(STAMP) system

$(STAMP): pyproject.toml constraints/cpu.txt scripts/install.sh
	scripts/install.sh
	@touch $@

system:
	@scripts/install-system.sh

run: install
	$(PY) -m services.launch

test: install
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

bench: install
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
