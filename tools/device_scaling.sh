#!/usr/bin/env bash
# One device call of the multi-GPU work (issue 5): where the time of a GPU's
# share goes, scaling on the madpet2 preset and the TOR matrix, the GPU tests
# of the distributed backend, and the workflow's GPU leases under Snakemake.
#
#   bash tools/device_scaling.sh OUT [STEP ...]
#
# Steps (default: all, in this order; each has its own time limit and log
# under OUT, so one failing step does not hide the rest):
#   env       GPUs, NVLink topology, CuPy, NCCL
#   parts     tools/device_dist.py --section parts (one part at a time on GPU 0)
#   partsm    the same on the madpet2 preset
#   madpet2   tools/device_dist.py --section bench --matrix madpet2
#   tor       tools/device_dist.py --section bench (TOR matrix)
#   nccl      all-reduce alone and the graph-replayed iteration (TOR) under
#             NCCL settings: default, NCCL_MIN_CTAS, NCCL_PROTO, NCCL_ALGO
#   small     tools/device_dist.py --section small: images through the
#             workflow's files, 1..P GPUs, both layouts, graphs, and one
#             process per GPU (file bootstrap, mpirun) against one process
#   overlap   the local layout's back projection in voxel chunks with the
#             chunk all-reduces on a second stream (default, NCCL_MAX_CTAS=4, =2)
#   tests     pytest -m gpu: the distributed and CUDA backends, kernels, benchmark
#   workflow  tools/device_workflow/run.sh (needs .whl carried)
set -u
DEST=${1:?usage: device_scaling.sh OUT [STEP ...]}
shift
# Everything is written under OUT/run and packed into OUT/run.tgz at the end
# (the device tool returns only a few files); OUT/summary.txt is the table.
OUT=$DEST/run
STEPS=${*:-env parts partsm madpet2 tor tests workflow}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
NGPU=$(nvidia-smi -L | wc -l)
T0=$(date +%s)

step() {  # step NAME LIMIT CMD...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit} s, at $(($(date +%s) - T0)) s)"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name rc=$? after $(($(date +%s) - T0)) s"
    tail -n 40 "$OUT/$name.log"
}

for s in $STEPS; do
    case $s in
    env) step env 60 python3 tools/device_dist.py --out "$OUT" --section env ;;
    parts) step parts 150 python3 tools/device_dist.py --out "$OUT" --section parts --matrix tor ;;
    partsm) step partsm 150 python3 tools/device_dist.py --out "$OUT" --section parts --matrix madpet2 ;;
    madpet2) step madpet2 240 python3 tools/device_dist.py --out "$OUT" --section bench --matrix madpet2 ;;
    tor) step tor 120 python3 tools/device_dist.py --out "$OUT" --section bench ;;
    nccl)
        for v in "" NCCL_MIN_CTAS=8 NCCL_MIN_CTAS=16 NCCL_MIN_CTAS=32 NCCL_PROTO=LL128 NCCL_PROTO=LL NCCL_ALGO=Tree "NCCL_MIN_CTAS=16 NCCL_PROTO=LL128"; do
            step "nccl-${v// /-}" 60 env $v python3 tools/device_dist.py --out "$OUT" --section nccltune
            grep '^TUNE' "$OUT/nccl-${v// /-}.log" >>"$OUT/nccl.jsonl"
        done
        ;;
    overlap)
        for v in "" NCCL_MAX_CTAS=4 NCCL_MAX_CTAS=2; do
            step "overlap-${v// /-}" 120 env $v python3 tools/device_dist.py --out "$OUT" --section overlap
            grep -E 'GPU|overlap' "$OUT/overlap-${v// /-}.log" | sed "s/^/[$v] /" >>"$OUT/overlap.txt"
        done
        ;;
    small) step small 240 python3 tools/device_dist.py --out "$OUT" --section small ;;
    tests) step tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_dist.py tests/test_cuda_mlem.py tests/test_cuda_kernels.py tests/test_bench.py tests/test_transpose.py tests/test_devices.py ;;
    workflow) step workflow 200 bash tools/device_workflow/run.sh "$OUT/workflow" "$NGPU" ;;
    *) echo "unknown step $s" ;;
    esac
done
python3 tools/device_dist.py --out "$OUT" --section summary | tee "$DEST/summary.txt"
echo "total $(($(date +%s) - T0)) s"
tar czf "$DEST/run.tgz" -C "$DEST" run && rm -rf "$OUT"
