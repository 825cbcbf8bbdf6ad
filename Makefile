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

.PHONY: demo lint test test-slow test-all experiments-quick clean

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

# every experiment's quick mode (or its smallest run) on the embedded corpus, all under runs/quick:
# that each runs on a fresh clone (minutes). hf_explicit_init needs `pip install -e '.[hf]'` (else
# it is skipped); setup_times, which clones and runs `make demo` and `make test`, is left out
QUICK := runs/quick
RUN := $(VENV)/bin/python experiments
experiments-quick: $(TESTS)
	$(VENV)/bin/python -c "from saffu.runner import prepared; prepared('$(QUICK)/work')"
	mkdir -p $(QUICK)/blimp && ln -sf $(abspath ../shared/data/blimp/determiner_noun_agreement_1.jsonl) $(QUICK)/blimp/
	$(RUN)/tune.py --workdir $(QUICK)/work --out $(QUICK)/tune --quick
	$(RUN)/budgets.py --workdir $(QUICK)/work --out $(QUICK)/budgets --quick --report --no-write \
		--runs cold:1:16:0 explicit-init:1:16:0 residual-crossfit:1:16:0 llama-explicit:1:16:0
	$(RUN)/any_model.py --workdir $(QUICK)/work --out $(QUICK)/any_model --steps 5 --eval-every 5
	$(RUN)/inheritune.py --workdir $(QUICK)/work --out $(QUICK)/inheritune --variants inherit scratch \
		--reference $(QUICK)/budgets/runs/cold_e1_w16_s0_lr0.01 --inspect-windows 8
	$(RUN)/harness_blimp.py --run quick=$(QUICK)/budgets/runs/cold_e1_w16_s0_lr0.01 --blimp $(QUICK)/blimp
	$(RUN)/soak.py --epochs 1 --resumes 3 --no-write
	$(RUN)/bench_train.py --quick
	$(RUN)/bench_scoring.py --quick --workdir $(QUICK)/work --exact-run $(QUICK)/exact --blimp-dir $(QUICK)/blimp
	$(RUN)/bench_scoring.py --quick --dtypes --workdir $(QUICK)/work
	$(RUN)/bench_stats.py --workdir $(QUICK)/work --repeats 1
	if $(VENV)/bin/python -c "import torch, transformers" 2>/dev/null; then \
		$(RUN)/hf_explicit_init.py --quick --workdir $(QUICK)/work --out $(QUICK)/hf; \
	else echo "hf_explicit_init: skipped (pip install -e '.[hf]')"; fi
	$(RUN)/render_results.py --check

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
