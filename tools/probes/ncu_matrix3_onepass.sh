#!/bin/bash
# probe: Nsight Compute on the fixed-point one pass after the reductions (Matrix 3's first eighth of rows, one H100)
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
nvidia-smi -L | head -1
t=$(date +%s); timeout 110 python3 -m mlemlib generate -p matrix3 --fold --voxel-order hilbert -f compressed -o /tmp/m3.h5 > /tmp/gen.log 2>&1; echo "generated rc $? in $(( $(date +%s) - t )) s"
timeout 60 python3 build/ncu_m3.py /tmp/m3.h5
M=gpu__time_duration.sum,lts__t_sectors_op_red.sum,lts__t_sectors_op_atom.sum,lts__t_requests_op_red.sum,lts__t_requests_op_atom.sum,lts__t_sectors.sum,lts__t_sectors_op_read.sum,dram__bytes_read.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed
timeout 120 /usr/local/cuda/bin/ncu --clock-control none --metrics $M -k regex:conepass --launch-skip 0 --launch-count 14 --csv python3 build/ncu_m3.py /tmp/m3.h5 > $OUT/ncu.csv 2> $OUT/ncu.err
echo "ncu rc $?"; grep -c conepass $OUT/ncu.csv; tail -3 $OUT/ncu.err
