"""One-off probe: each GPU's chunked pass of madpet2 folded reordered on 4 (and 2) GPUs, alone and all at once
(CUDA events per GPU, medians of 30), beside the whole matrix's on one GPU; the shares' sizes."""
import json, logging, os, sys, time
import cupy as cp
import numpy as np
from mlemlib.backends import make_backend
from mlemlib.backends import _compressed_cuda as cc
from mlemlib.bench.cases import load_cases, select
from mlemlib.bench.factors import bench_problem
from mlemlib.bench.runner import prepare_case, partition
from mlemlib.formats import open_source

logging.basicConfig(level=logging.WARNING)
out = sys.argv[1]
case = select(load_cases("perf/cases.yaml"), ["madpet2-osem"])[0]
preps = prepare_case(case, "/tmp/bench")
prep = [p for p in preps if p.subsets == 1][0]
prob = bench_problem(prep, "none")
res = []

def shard_steps(items, reps=30, together=True):
    """items: (device, a, g, f, fp, acc, flag); per item median ms, launched all at once or one by one."""
    ev = {}
    for d, *_ in items:
        with cp.cuda.Device(d):
            ev[d] = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(reps)]
    bounds = {}
    for d, a, g, f, fp, acc, flag in items:
        with cp.cuda.Device(d):
            bounds[d] = cc.onepass_bound(g, f)
    for r in range(reps):
        groups = [items] if together else [[it] for it in items]
        for grp in groups:
            for d, a, g, f, fp, acc, flag in grp:
                with cp.cuda.Device(d):
                    acc.fill(0); flag.fill(0)
                    ev[d][r][0].record()
                    cc.chunked_step(a, g, f, fp=fp, acc=acc, flag=flag, bound=bounds[d])
                    ev[d][r][1].record()
            for d, *_ in grp:
                with cp.cuda.Device(d):
                    cp.cuda.Device().synchronize()
    return {d: round(float(np.median([cp.cuda.get_elapsed_time(s, e) for s, e in ev[d][3:]])), 4) for d in ev}

for p in (1, 2, 4):
    src = open_source(os.fspath(prep.matrix), "matrix")
    kw = {"fp": "auto", "bp": "auto", **prob.backend_options(), "gpus": p, "layout": case.layout, "graph": True}
    if p > 1:
        kw["plan"] = os.fspath(partition(case, prep, p))
    be = make_backend("cuda", src, prob.g, prob.norm, None, **kw)
    f = be.initial_image()
    for _ in range(3):
        f = be.iterate(f)
    items = []
    for s in be.shards:
        with cp.cuda.Device(s.device):
            items.append((s.device, s.a, s.g, s.f, s.fp, s.acc, s.flag))
    row = {"gpus": p,
           "shares": [{"nnz": int(s.a.nnz), "chunks": int(s.a.chunks), "voxels": int(s.a.voxels.size),
                       "elements": int(s.a.local.size), "rows": int(s.a.shape[0])} for s in be.shards]}
    row["alone_ms"] = shard_steps(items, together=False)
    row["together_ms"] = shard_steps(items, together=True)
    row["alone_ms_again"] = shard_steps(items, together=False)
    ts = []
    for _ in range(23):
        f = be.iterate(f); ts.append(be.last_step_times()["iteration"])
    row["iteration_ms"] = round(1e3 * float(np.median(ts[3:])), 4)
    getattr(be, "close", lambda: None)()
    print(json.dumps(row), flush=True)
    res.append(row)
    json.dump(res, open(os.path.join(out, "share_probe.json"), "w"), indent=1)
