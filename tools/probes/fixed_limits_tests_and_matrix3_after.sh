#!/bin/bash
# tests of the fixed-point limits on the device, then Matrix 3's one pass through the bench runner (after, before)
B="$(cd "$(dirname "$0")" && pwd)"
export NCCL_NVLS_ENABLE=0
nvidia-smi -L
cd "$B/after"; export PYTHONPATH=$PWD
timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_compressed.py tests/test_dist.py tests/test_cuda_mlem.py 2>&1 | tail -15
date
timeout 330 python3 -m mlemlib bench run perf/cases.yaml -k matrix3-onepass -w /tmp/bench -o $OUT/res-after > $OUT/after.log 2>&1; echo "after rc $?"
tail -30 $OUT/after.log
date
