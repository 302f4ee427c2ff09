#!/bin/bash
# madpet2's own-order CSR matrix, NEMA phantom: OSEM S=8 against MLEM over 50 passes, noiseless and with more counts
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
nvidia-smi -L | head -1
t=$(date +%s)
timeout 100 python3 -m mlemlib bench prepare perf/cases.yaml -k madpet2-own-csr -w /tmp/bench > $OUT/prep.log 2>&1; echo "prepare rc $? $(( $(date +%s) - t )) s"
M=$(ls -d /tmp/bench/madpet2-*/ | head -1)/matrix.h5; ls -la $M
for v in "noiseless:--noiseless -c 10000000" "poisson1e8:-c 100000000"; do
  name=${v%%:*}; args=${v#*:}
  t=$(date +%s)
  timeout 40 python3 -m mlemlib simulate $M $args -o /tmp/$name.LMsino -t /tmp/$name-truth.h5 > $OUT/sim-$name.log 2>&1; echo "sim $name rc $? $(( $(date +%s) - t )) s"
  t=$(date +%s)
  timeout 130 python3 -m mlemlib convergence $M -s /tmp/$name.LMsino -t /tmp/$name-truth.h5 --subsets 1 8 -n 50 -b cuda --no-ignored -o $OUT/conv-$name.json > $OUT/conv-$name.log 2>&1; echo "conv $name rc $? $(( $(date +%s) - t )) s"
  python3 - $OUT/conv-$name.json <<'P'
import json, sys
from mlemlib.convergence import study_rows
rec = json.load(open(sys.argv[1]))
for r in study_rows([rec]):
    print({k: r.get(k) for k in ("subsets", "passes_to_mlem_crc", "mlem_crc_hot", "crc_hot", "rel_error")})
for s in rec["series"]:
    c = s["crc_hot"]; k = max(range(len(c)), key=c.__getitem__)
    print(s["subsets"], "crc at pass 1/4/8:", [round(c[i], 4) for i in (0, 3, 7)], "max", round(c[k], 4), "at", s["passes"][k])
P
done
