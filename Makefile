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
# pyproject.toml or the lock changes (the stamp file below records the last
# install, one per EXTRAS). Every package is installed at the version of the
# lock, requirements/lock.txt, by uv (itself pinned by UV_VERSION and
# installed into the venv with pip). `make lock` refreshes the lock after a
# change of pyproject.toml's dependencies (UPGRADE=1: every package to its
# newest allowed version) and derives the GPU node's wheel list from it.

PYTHON ?= python3
VENV   ?= .venv
CORES  ?= all
EXTRAS ?= workflow,test
CONFIG ?=
# make test: one pytest worker per core (pytest-xdist; `auto` is the core count, at most 8),
# each module's tests that share a module fixture on one worker (tests/conftest.py).
# PYTEST_ARGS= runs the tests one after another in one process.
PYTEST_ARGS ?= -n auto --dist loadgroup
UV_VERSION ?= 0.13.9
UPGRADE ?=

# The configuration's name (its `name:` key; "default" without one), read
# when a recipe runs, after set-up.
NAME = $(shell $(BIN)/python -c 'import sys, yaml; print((yaml.safe_load(open(sys.argv[1])) or {}).get("name") or "default")' $(or $(CONFIG),config/config.yaml))
SNAKEMAKE = $(strip $(BIN)/snakemake $(if $(CONFIG),--configfile $(CONFIG)))
REPORT = results/report-$(NAME).html

BIN   := $(VENV)/bin
STAMP := $(VENV)/.mlem-installed-$(EXTRAS)
LOCK  := requirements/lock.txt
UV    := $(BIN)/uv
# The lock: every extra, for every platform, from Python 3.11 on.
COMPILE = $(UV) pip compile pyproject.toml --all-extras --universal --python-version 3.11 \
	--custom-compile-command 'make lock' --quiet

.DEFAULT_GOAL := help
.PHONY: help setup compile lock lock-check run test test-slurm lint dry-run report clean

help:
	@echo "make run      set up $(VENV) if needed, run the default workflow (CPU without a GPU)"
	@echo "make test     set up $(VENV) if needed, run the tests (pytest)"
	@echo "make test-slurm  start a single-node SLURM here (root), run tests/test_slurm.py, stop it"
	@echo "make lint     snakefmt --check and snakemake --lint"
	@echo "make dry-run  show the jobs the workflow would run"
	@echo "make report   the HTML report of a finished run (results/report-<name>.html)"
	@echo "make setup    only create or update $(VENV) (at the versions of $(LOCK))"
	@echo "make compile  byte-compile the project's modules (make run and make test do it first)"
	@echo "make lock     refresh $(LOCK) from pyproject.toml (UPGRADE=1: newest versions) and the GPU node's wheel list"
	@echo "make lock-check  fail if $(LOCK) or the wheel list is not what pyproject.toml gives"
	@echo "make clean    remove the workflow's outputs (results, resources, logs, benchmarks)"
	@echo "variables: PYTHON=$(PYTHON) VENV=$(VENV) CORES=$(CORES) EXTRAS=$(EXTRAS) CONFIG=$(CONFIG)"
	@echo "  CONFIG=my.yaml: run, dry-run or report that configuration; its summary is"
	@echo "  results/summary/<name>/, its report results/report-<name>.html (<name>: its name: key)"

setup: $(STAMP)

# --compile-bytecode: the packages' bytecode written once here. Where PYTHONDONTWRITEBYTECODE is set (as on
# some CI machines) Python would otherwise compile every imported module again in every process: 3 s of a
# 5 s Snakemake dry run, in each of the hundreds of processes the tests and the workflow start.
$(STAMP): pyproject.toml $(LOCK) | $(UV)
	$(UV) pip install --quiet --compile-bytecode --python $(BIN)/python --constraint $(LOCK) --editable '.[$(EXTRAS)]'
	@touch $@

# The project's own bytecode (an editable install is not compiled above): only what changed, in a second.
compile: $(STAMP)
	@$(BIN)/python -m compileall -q mlemlib scripts tools > /dev/null

# The venv and uv in it (reinstalled when UV_VERSION changes).
$(UV): $(if $(filter $(UV_VERSION),$(shell $(UV) --version 2>/dev/null | cut -d' ' -f2)),,FORCE)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
		|| { echo "error: $(PYTHON) is older than Python 3.11 (set PYTHON=...)" >&2; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check 'uv==$(UV_VERSION)'

FORCE:

lock: | $(UV)
	$(COMPILE) $(if $(UPGRADE),--upgrade) --output-file $(LOCK)
	$(BIN)/python tools/device_workflow/wheels_from_lock.py

lock-check: | $(UV)
	@cp $(LOCK) $(VENV)/lock-check.txt
	@$(COMPILE) --output-file $(VENV)/lock-check.txt
	@diff -u $(LOCK) $(VENV)/lock-check.txt \
		|| { echo "error: $(LOCK) is not what pyproject.toml gives: run 'make lock' and commit it" >&2; exit 1; }
	@$(BIN)/python tools/device_workflow/wheels_from_lock.py --check
	@echo "$(LOCK) and tools/device_workflow/wheels.txt match pyproject.toml"

run: compile
	$(SNAKEMAKE) --cores $(CORES)
	$(SNAKEMAKE) --cores $(CORES) --report $(REPORT)
	@echo "summary: results/summary/$(NAME)/  report: $(REPORT)"

test: compile
	$(BIN)/python -m pytest $(PYTEST_ARGS)

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
