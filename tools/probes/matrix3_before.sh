#!/bin/bash
B="$(cd "$(dirname "$0")" && pwd)"
export NCCL_NVLS_ENABLE=0
nvidia-smi -L
cd "$B/before"; export PYTHONPATH=$PWD
timeout 300 python3 -m mlemlib bench run perf/cases.yaml -k matrix3-onepass -w /tmp/bench -o $OUT/res-before > $OUT/before.log 2>&1; echo "before rc $?"
tail -30 $OUT/before.log
cd "$B/after"; export PYTHONPATH=$PWD
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_chunked.py tests/test_osem_gpu.py tests/test_format_runs.py 2>&1 | tail -8
