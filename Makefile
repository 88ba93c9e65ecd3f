# Tidepool: `make run` to serve, `make test` to check. Both install what they need first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tidepool-installed
PYTEST_FLAGS ?= -q
export PYTHON VENV

.PHONY: install system run test unit integration test-gpu bench clean

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

test-gpu: install
	$(PY) -m pytest $(PYTEST_FLAGS) tests/gpu

bench: install
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
