"""One-off probe (not kept): where the chunked one pass's time goes on ONE GPU, for madpet2 folded+reordered
(MLEM: the whole matrix) and for one OSEM subset (S = 16: rows of subset 0), by CUDA events (mode 'time':
kernel alone, forward-only kernel, fill, update; medians of 30) and under Nsight Compute (mode 'mlem' / 'subset':
the kernel launched 4 times; ncu profiles the 3rd)."""
import json
import os
import sys
import time

import cupy as cp
import numpy as np

from mlemlib.backends import _compressed_cuda as cc
from mlemlib.backends import _cuda_kernels as ck
from mlemlib.bench.cases import load_cases, select
from mlemlib.bench.runner import prepare_case
from mlemlib.formats import open_matrix

mode, out = sys.argv[1], sys.argv[2]
case = select(load_cases("perf/cases.yaml"), ["madpet2-osem"])[0]
t0 = time.time()
preps = prepare_case(case, "/tmp/bench")
print(f"prepared in {time.time() - t0:.1f} s", flush=True)
sms = ck.device_properties(0)["sm_count"]


def share(S, k=0):
    prep = [p for p in preps if p.subsets == S][0]
    g, norm = prep.load_problem()
    if S > 1:
        b = np.load(prep.bounds)
        rows = (int(b[k]), int(b[k + 1]))
    else:
        rows = None
    with open_matrix(str(prep.matrix)) as mat:
        a = cc.DeviceChunked.upload(mat, rows, sms=sms)
    r0 = rows[0] if rows else 0
    m, n = a.shape
    return a, cp.asarray(g[r0:r0 + m]), cp.asarray(norm.reshape(-1)[:n], dtype=cp.float32), n, m


def ev_time(fn, reps=30):
    ts = []
    for k in range(reps + 5):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        if k >= 5:
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    return round(float(np.median(ts)), 1)


rows = []
jobs = [(1, 0)] + [(16, k) for k in range(16)] if mode == "time" else ([(1, 0)] if mode == "mlem" else [(16, 0)])
for S, k in jobs:
    a, g, norm, n, m = share(S, k)
    f = cp.ones(n, dtype=cp.float32)
    fp = cp.empty(m, dtype=cp.float32)
    acc = cp.zeros(n, dtype=cp.uint64)
    flag = cp.zeros(1, dtype=cp.int32)
    bound = 1e6

    def step():
        cc.chunked_step(a, g, f, fp=fp, acc=acc, flag=flag, bound=bound)

    if mode != "time":
        for _ in range(4):
            acc.fill(0)
            flag.fill(0)
            step()
        cp.cuda.Device().synchronize()
        continue
    step()
    scale = cc.chunk_scale(bound)
    f2 = cp.ones(n, dtype=cp.float32)
    row = {"S": S, "subset": k, "nnz": int(a.nnz), "chunks": int(a.chunks), "reuse": round(float(a.reuse), 2),
           "kernel_us": ev_time(lambda: (acc.fill(0), flag.fill(0), step())),
           "fill_us": ev_time(lambda: (acc.fill(0), flag.fill(0))),
           "forward_only_us": ev_time(lambda: cc.chunked_forward(a, f, out=fp)),
           "update_us": ev_time(lambda: ck.update_fixed(f2, acc, scale, norm, out=f2))}
    rows.append(row)
    print(json.dumps(row), flush=True)
if rows:
    json.dump(rows, open(os.path.join(out, "ncu_probe_time.json"), "w"), indent=1)
