#!/usr/bin/env bash
# Run the SLURM tests (tests/test_slurm.py) against a single-node SLURM on this
# machine: starts it with tools/slurm/start.sh if it is not up, runs the tests,
# and stops it again if this script started it (unless --keep): with --purge
# after tests that passed (a configured SLURM whose controller is down makes
# every later snakemake start wait 9 s: the SLURM executor plugin asks
# scontrol when it is imported), keeping its logs after tests that failed.
#
#   tools/slurm/run_test.sh [--keep] [pytest arguments...]
#
# Needs root (start.sh installs Debian's packages and starts the daemons) and
# the project's virtual environment (.venv, `make setup`; $VENV overrides).
# Takes about 8 minutes on 2 cores, plus about 2 for a first install.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
venv=${VENV:-$repo/.venv}
keep=0
if [[ ${1:-} == --keep ]]; then keep=1; shift; fi

[[ -x $venv/bin/python ]] || { echo "run_test: no virtual environment at $venv (run 'make setup')" >&2; exit 2; }

started=0
if ! scontrol ping 2>/dev/null | grep -q UP; then
    "$here/start.sh"
    started=1
fi
passed=0
cleanup() {
    if ((started && !keep)); then
        if ((passed)); then "$here/stop.sh" --purge; else "$here/stop.sh"; fi
    fi
}
trap cleanup EXIT

cd "$repo"
"$venv/bin/python" -m pytest tests/test_slurm.py -v -rs "$@"
passed=1
