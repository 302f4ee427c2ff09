#!/bin/bash
# The CSR-share probe: Nsight Compute on the csr_vector fp and bp of the whole madpet2 (own order) on one GPU
# and of rank 0's quarter share in a 4-rank run.
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
python3 build/csr_prep.py 2>&1 | grep -v "^INFO" | tail -3
export NCU="/usr/local/cuda/bin/ncu --clock-control none --nvtx --nvtx-include probe/ --kernel-name regex:csr_ --launch-count 2 --section SpeedOfLight --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis --section WorkloadDistribution --section SchedulerStats --section WarpStateStats"
: single skipped
echo "single done rc=$?"
timeout 300 python3 -m mlemlib.dist.mpi -n 4 -- bash build/csr_rank.sh
echo "ranks done rc=$?"
grep -h "^ROW" $OUT/*.txt
