# Set-up and entry points of the MLEM workflow (see README.md).
#
#   make run     set up .venv if needed, then run the default workflow
#   make test    set up .venv if needed, then run the test suite
#
# CONFIG=my.yaml runs, reports or dry-runs another configuration (passed as
# --configfile); its summary is results/summary/<name>/ and its report
# results/report-<name>.html, <name> being the file's `name:` (default:
# default, as in config/config.yaml).
#
# The virtual environment is created once and reinstalled only when
# pyproject.toml changes (the stamp file below records the last install).

PYTHON ?= python3
VENV   ?= .venv
CORES  ?= all
EXTRAS ?= workflow,test
CONFIG ?=

# The configuration's name (its `name:` key; "default" without one), read
# when a recipe runs, after set-up.
NAME = $(shell $(BIN)/python -c 'import sys, yaml; print((yaml.safe_load(open(sys.argv[1])) or {}).get("name") or "default")' $(or $(CONFIG),config/config.yaml))
SNAKEMAKE = $(strip $(BIN)/snakemake $(if $(CONFIG),--configfile $(CONFIG)))
REPORT = results/report-$(NAME).html

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
	@echo "make report   the HTML report of a finished run (results/report-<name>.html)"
	@echo "make setup    only create or update $(VENV)"
	@echo "make clean    remove the workflow's outputs (results, resources, logs, benchmarks)"
	@echo "variables: PYTHON=$(PYTHON) VENV=$(VENV) CORES=$(CORES) EXTRAS=$(EXTRAS) CONFIG=$(CONFIG)"
	@echo "  CONFIG=my.yaml: run, dry-run or report that configuration; its summary is"
	@echo "  results/summary/<name>/, its report results/report-<name>.html (<name>: its name: key)"

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
		|| { echo "error: $(PYTHON) is older than Python 3.11 (set PYTHON=...)" >&2; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --editable '.[$(EXTRAS)]'
	@touch $@

run: $(STAMP)
	$(SNAKEMAKE) --cores $(CORES)
	$(SNAKEMAKE) --cores $(CORES) --report $(REPORT)
	@echo "summary: results/summary/$(NAME)/  report: $(REPORT)"

test: $(STAMP)
	$(BIN)/python -m pytest

test-slurm: $(STAMP)
	tools/slurm/run_test.sh

lint: $(STAMP)
	$(BIN)/snakefmt --check .
	$(BIN)/snakemake --lint

dry-run: $(STAMP)
	$(SNAKEMAKE) --dry-run --quiet rules

report: $(STAMP)
	$(SNAKEMAKE) --report $(REPORT)

clean:
	rm -rf results resources logs benchmarks
