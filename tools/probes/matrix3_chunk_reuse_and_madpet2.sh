#!/bin/bash
# probe: can the chunked one pass serve Matrix 3 (its sample reuse, then its time on 1 and 4 GPUs)?
# and madpet2 folded+reordered through the runner after the fixed point's reductions
B="$(cd "$(dirname "$0")" && pwd)"
export NCCL_NVLS_ENABLE=0
nvidia-smi -L | head -1
cd "$B/after"; export PYTHONPATH=$PWD
t=$(date +%s)
timeout 150 python3 -m mlemlib bench prepare perf/cases.yaml -k matrix3-onepass -w /tmp/bench > $OUT/prep.log 2>&1; echo "prepare rc $? $(( $(date +%s) - t )) s"
M=$(ls -d /tmp/bench/matrix3-*/ | head -1); echo $M; ls $M
timeout 120 python3 -c "
import sys, time
from mlemlib import chunked
from mlemlib.formats import open_matrix
for w in (16384,):
    for nnz in (1<<24, 1<<26):
        t=time.time(); print('window', w, 'sample nnz', nnz, chunked.sample_chunks(open_matrix('$M/matrix.h5'), w, nnz), '%.1f s' % (time.time()-t), flush=True)
"
sed -n '1,19p' perf/cases.yaml > /tmp/m3c.yaml
cat >> /tmp/m3c.yaml <<'EOC'
  - name: matrix3-chunked
    description: probe
    matrix: matrix3
    fold: true
    voxel_order: hilbert
    order: own
    format: compressed
    kernels: [onepass_chunked]
    cusparse: false
    gpus: [1, 4]
    warmup: 2
    iterations: 10
EOC
t=$(date +%s)
timeout 240 python3 -m mlemlib bench run /tmp/m3c.yaml -k matrix3-chunked -w /tmp/bench -o $OUT/res-chunk > $OUT/chunk.log 2>&1; echo "chunk rc $? $(( $(date +%s) - t )) s"
grep -i "runner\|error\|chunks\|reuse" $OUT/chunk.log | tail -8
t=$(date +%s)
timeout 200 python3 -m mlemlib bench run perf/cases.yaml -k madpet2-folded-reordered-auto -w /tmp/bench -o $OUT/res-madpet2 > $OUT/madpet2.log 2>&1; echo "madpet2 rc $? $(( $(date +%s) - t )) s"
grep "runner" $OUT/madpet2.log | tail -10
