# Each target creates its own virtual environment (.venv) on first use and installs what it
# needs: `make demo` the package alone, `make test` the package with its test extras.
PYTHON ?= python3
VENV := .venv
HASH := $(shell cksum pyproject.toml | cut -d' ' -f1)
BASE := $(VENV)/.installed-base-$(HASH)
TESTS := $(VENV)/.installed-test-$(HASH)
# compat: the checkout itself goes on sys.path, so a clone folder named `saffu` cannot shadow
# the package for scripts run from its parent folder
EDITABLE := --config-settings editable_mode=compat
# the fast suite's pytest-xdist workers (each its own process and JAX runtime)
TEST_WORKERS ?= 2

.PHONY: demo lint test test-slow test-all clean

$(VENV)/bin/pip:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip

$(BASE): pyproject.toml | $(VENV)/bin/pip
	$(VENV)/bin/pip install --quiet -e . $(EDITABLE)
	rm -f $(VENV)/.installed-base-* && touch $@

$(TESTS): pyproject.toml | $(VENV)/bin/pip
	$(VENV)/bin/pip install --quiet -e '.[test]' $(EDITABLE)
	rm -f $(VENV)/.installed-* && touch $@ $(BASE)

demo: $(BASE)
	$(VENV)/bin/saffu demo --workdir runs/demo --metrics-json runs/demo/metrics.json

# the linters (ruff; import-linter's layers contract, pyproject.toml), then the fast suite; the
# slow one runs the real corpus, the notebooks and long CLI runs
lint: $(TESTS)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: lint
	$(VENV)/bin/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist worksteal

test-slow: $(TESTS)
	$(VENV)/bin/python -m pytest -q -m slow

test-all: $(TESTS)
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
