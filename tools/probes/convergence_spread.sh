#!/bin/bash
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
t=$(date +%s)
timeout 100 python3 -m mlemlib bench prepare perf/cases.yaml -k madpet2-own-csr -w /tmp/bench > $OUT/prep.log 2>&1; echo "prepare rc $? $(( $(date +%s) - t )) s"
M=$(ls -d /tmp/bench/madpet2-*/ | head -1)/matrix.h5
timeout 40 python3 -m mlemlib simulate $M --noiseless -c 10000000 -o /tmp/nl.LMsino -t /tmp/nl-truth.h5 > $OUT/sim.log 2>&1; echo "sim rc $?"
t=$(date +%s)
timeout 100 python3 tools/probes/order_conv.py convergence $M -s /tmp/nl.LMsino -t /tmp/nl-truth.h5 --subsets 8 -n 20 -b cuda --no-ignored -o $OUT/conv-spread.json > $OUT/conv.log 2>&1; echo "conv rc $? $(( $(date +%s) - t )) s"
python3 - $OUT/conv-spread.json <<'P'
import json, sys
rec = json.load(open(sys.argv[1]))
for s in rec["series"]:
    c = s["crc_hot"]
    print(s["subsets"], "crc per pass:", [round(x, 4) for x in c[:20]])
P
