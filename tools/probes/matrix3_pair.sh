#!/bin/bash
# probe: Matrix 3 with a stored transpose, the delta_vector pair on one GPU (deterministic, no atomics) beside onepass_fixed
B="$(cd "$(dirname "$0")" && pwd)"
export NCCL_NVLS_ENABLE=0
nvidia-smi -L | head -1
cd "$B/after"; export PYTHONPATH=$PWD
sed -n '1,20p' perf/cases.yaml > /tmp/m3p.yaml
cat >> /tmp/m3p.yaml <<'EOC'
  - name: matrix3-pair
    description: probe
    matrix: matrix3
    fold: true
    voxel_order: hilbert
    order: own
    format: compressed
    kernels: [delta_vector, onepass_fixed]
    cusparse: false
    gpus: [1]
    warmup: 2
    iterations: 10
EOC
t=$(date +%s)
timeout 520 python3 -m mlemlib bench run /tmp/m3p.yaml -k matrix3-pair -w /tmp/bench -o $OUT/res-pair > $OUT/pair.log 2>&1; echo "pair rc $? $(( $(date +%s) - t )) s"
grep -i "prepare\|runner\|error" $OUT/pair.log | tail -12
