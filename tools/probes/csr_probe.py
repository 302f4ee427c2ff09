"""One-off probe: where madpet2's own-order CSR pair (auto) spends a 4-GPU iteration: per GPU, the steps of
eager iterations (fp, bp, allreduce incl. waiting, update; CUDA events on each GPU), beside the graph's
iteration and the 1-GPU backend's steps."""
import json, logging, os, sys, time
import cupy as cp
import numpy as np
from mlemlib.backends import make_backend
from mlemlib.bench.cases import load_cases, select
from mlemlib.bench.factors import bench_problem
from mlemlib.bench.runner import prepare_case, partition
from mlemlib.formats import open_source

logging.basicConfig(level=logging.WARNING)
out = sys.argv[1]
case = select(load_cases("perf/cases.yaml"), ["madpet2-own-csr"])[0]
t0 = time.time()
prep = prepare_case(case, "/tmp/bench")[0]
print(f"prepared in {time.time() - t0:.1f} s", flush=True)
prob = bench_problem(prep, "none")
res = []
for P in (1, 2, 4):
    t1 = time.time()
    src = open_source(os.fspath(prep.matrix), "matrix")
    tsrc = open_source(os.fspath(prep.transpose), "transpose") if prep.transpose is not None else None
    kw = {"fp": "auto", "bp": "auto", **prob.backend_options(), "gpus": P, "layout": case.layout, "graph": True}
    if P > 1:
        kw["plan"] = os.fspath(partition(case, prep, P))
    be = make_backend("cuda", src, prob.g, prob.norm, tsrc, **kw)
    row = {"gpus": P, "fp": be.fp_kernel, "bp": be.bp_kernel, "load_s": round(time.time() - t1, 1)}
    f = be.initial_image()
    ts = []
    for k in range(25):
        f = be.iterate(f)
        if k >= 5:
            ts.append(be.last_step_times()["iteration"])
    row["graph_ms"] = round(1e3 * float(np.median(ts)), 4)
    be.use_graph(False)
    per = {s.device: [] for s in be.shards}
    for k in range(15):
        f = be.iterate(f)
        be.last_step_times()
        if k < 5:
            continue
        for s in be.shards:
            with cp.cuda.Device(s.device):
                prev = s.events[s.order[0]]
                d = {}
                for name in s.order[1:]:
                    ev = s.events[name]
                    d[name] = d.get(name, 0.0) + cp.cuda.get_elapsed_time(prev, ev)
                    prev = ev
                per[s.device].append(d)
    row["eager_steps_ms"] = {dev: {k: round(float(np.median([d.get(k, 0.0) for d in v])), 4) for k in v[0]}
                             for dev, v in per.items()}
    row["shares_nnz"] = [int(getattr(s, "nnz", 0)) for s in be.shards]
    getattr(be, "close", lambda: None)()
    print(json.dumps(row), flush=True)
    res.append(row)
    json.dump(res, open(os.path.join(out, "csr_probe.json"), "w"), indent=1)
print(f"total {time.time() - t0:.1f} s")
