"""One-off probe: the chunked kernel's flush as checked atomics (red_lim 0, as before) against reductions below
fixed_limits' red_lim, kernel by kernel on each GPU's shares (MLEM: one launch; OSEM S=16: the 16 subsets'
launches back to back), all GPUs at once, CUDA events per GPU, medians of 20 after 3; the slowest GPU."""
import json, logging, os, sys
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
res = []
for S in (1, 16):
    prep = [p for p in preps if p.subsets == S][0]
    prob = bench_problem(prep, "none")
    for P in (1, 2, 4):
        src = open_source(os.fspath(prep.matrix), "matrix")
        kw = {"fp": "auto", "bp": "auto", **prob.backend_options(), "gpus": P, "layout": case.layout, "graph": True}
        if P > 1 and S == 1:
            kw["plan"] = os.fspath(partition(case, prep, P))
        be = make_backend("cuda", src, prob.g, prob.norm, None, **kw)
        f0 = be.initial_image()
        f0 = be.iterate(f0)
        parts = be.parts if hasattr(be, "parts") else [be]
        gpus = [s.device for s in parts[0].shards]
        per = {d: [] for d in gpus}  # (a, g, f, fp, acc, flag) per subset
        for p in parts:
            for s in p.shards:
                per[s.device].append((s.a, s.g, s.f, s.fp, s.acc, s.flag))
        bounds = {}
        kmax = {}
        for d in gpus:
            with cp.cuda.Device(d):
                bounds[d] = [cc.onepass_bound(g, f) for a, g, f, fp, acc, flag in per[d]]
                kmax[d] = [cc.column_count_max(a) for a, *_ in per[d]]
        variants = {"checked (before)": [(0, (1 << 63) // P)] * len(parts),
                    "reductions": [cc.fixed_limits(sum(kmax[d][k] for d in gpus), P) for k in range(len(parts))]}
        R = 23
        ev = {(v, d): [] for v in variants for d in gpus}
        sums = {}
        for r in range(R):
            for v, lims in variants.items():
                for d in gpus:
                    with cp.cuda.Device(d):
                        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                        e0.record()
                        for k, (a, g, f, fp, acc, flag) in enumerate(per[d]):
                            acc.fill(0); flag.fill(0)
                            cc.chunked_step(a, g, f, fp=fp, acc=acc, flag=flag, bound=bounds[d][k], limits=lims[k])
                        e1.record()
                        ev[(v, d)].append((e0, e1))
                for d in gpus:
                    with cp.cuda.Device(d):
                        cp.cuda.Device().synchronize()
                if r == R - 1:
                    for d in gpus:
                        with cp.cuda.Device(d):
                            sums[(v, d)] = int(per[d][-1][4].sum().get())
        row = {"S": S, "gpus": P, "red_lim": [int(x[0]) for x in variants["reductions"]][:4],
               "kmax_gpu0": kmax[gpus[0]][:4]}
        for v in variants:
            t = [float(np.median([cp.cuda.get_elapsed_time(a, b) for a, b in ev[(v, d)][3:]])) for d in gpus]
            row[v] = [round(x, 4) for x in t]
        row["same_sums"] = all(sums[("checked (before)", d)] == sums[("reductions", d)] for d in gpus)
        getattr(be, "close", lambda: None)()
        print(json.dumps(row), flush=True)
        res.append(row)
        json.dump(res, open(os.path.join(out, "red_probe.json"), "w"), indent=1)
