# Set-up and entry points of the MLEM workflow (see README.md).
#
#   make run     set up .venv if needed, then run the default workflow
#   make test    set up .venv if needed, then run the test suite
#
# The virtual environment is created once and reinstalled only when
# pyproject.toml changes (the stamp file below records the last install).

PYTHON ?= python3
VENV   ?= .venv
CORES  ?= all
EXTRAS ?= workflow,test

BIN   := $(VENV)/bin
STAMP := $(VENV)/.mlem-installed

.DEFAULT_GOAL := help
.PHONY: help setup run test test-slurm lint dry-run report clean

help:
	@echo "make run      set up $(VENV) if needed, run the default workflow (CPU without a GPU)"
	@echo "make test     set up $(VENV) if needed, run the tests (pytest)"
	@echo "make test-slurm  start a single-node SLURM here (root), run tests/test_slurm.py, stop it"
	@echo "make lint     snakefmt --check and snakemake --lint"
	@echo "make dry-run  show the jobs the workflow would run"
	@echo "make report   the HTML report of a finished run (results/report.html)"
	@echo "make setup    only create or update $(VENV)"
	@echo "make clean    remove the workflow's outputs (results, resources, logs, benchmarks)"
	@echo "variables: PYTHON=$(PYTHON) VENV=$(VENV) CORES=$(CORES) EXTRAS=$(EXTRAS)"

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
		|| { echo "error: $(PYTHON) is older than Python 3.11 (set PYTHON=...)" >&2; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --editable '.[$(EXTRAS)]'
	@touch $@

run: $(STAMP)
	$(BIN)/snakemake --cores $(CORES)
	$(BIN)/snakemake --cores $(CORES) --report results/report.html

test: $(STAMP)
	$(BIN)/python -m pytest

test-slurm: $(STAMP)
	tools/slurm/run_test.sh

lint: $(STAMP)
	$(BIN)/snakefmt --check .
	$(BIN)/snakemake --lint

dry-run: $(STAMP)
	$(BIN)/snakemake --dry-run --quiet rules

report: $(STAMP)
	$(BIN)/snakemake --report results/report.html

clean:
	rm -rf results resources logs benchmarks
