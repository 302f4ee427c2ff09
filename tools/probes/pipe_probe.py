"""One-off probe: the cuda-nccl backend with its step times read one iteration late (pipelines, the
product now) against read after each iteration (the host waits for the GPUs before it queues the next one:
before), madpet2 own order, CSR, auto (csr_vector pair), graphs, 1 / 2 / 4 GPUs, as the benchmark runner
times it (time_iterations: 5 warm-up, 3 repeats of 20); the images compared bit for bit."""
import hashlib, json, os, sys, time
import numpy as np
from mlemlib.backends import make_backend
from mlemlib.backends import nccl as N
from mlemlib.bench.cases import load_cases, select
from mlemlib.bench.factors import bench_problem
from mlemlib.bench.runner import prepare_case
from mlemlib.bench.prepare import partition
from mlemlib.bench.timing import time_iterations
from mlemlib.formats import open_source

out = sys.argv[1]
case = select(load_cases("perf/cases.yaml"), [os.environ.get("CASE", "madpet2-own-csr")])[0]
prep = prepare_case(case, "/tmp/bench")[0]
prob = bench_problem(prep, "none")
piped = N.NcclBackend.pipelines
rows = []
GP = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4").split(",")]
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
for P in GP:
    src = open_source(os.fspath(prep.matrix), "matrix")
    tsrc = open_source(os.fspath(prep.transpose), "transpose") if prep.transpose is not None else None
    kw = {"fp": "auto", "bp": "auto", "gpus": P, "layout": case.layout or "local", "graph": True}
    if P > 1:
        kw["plan"] = os.fspath(partition(case, prep, P))
    be = make_backend("cuda", src, prob.g, prob.norm, tsrc, **kw)
    for rnd in range(ROUNDS):
        VAR = [("before", property(lambda self: False)), ("pipelined", piped)]
        for name, prop in (VAR if os.environ.get("FIRST") != "pipelined" else VAR[::-1]):
            N.NcclBackend.pipelines = prop
            r = time_iterations(be, warmup=5, iterations=20, repeats=3)
            row = {"gpus": P, "round": rnd, "variant": name, "ms": round(r["ms"], 4), "ms_min": round(r["ms_min"], 4),
                   "ms_max": round(r["ms_max"], 4), "pipelines": bool(be.pipelines), "bp": be.bp_kernel}
            rows.append(row); print(json.dumps(row), flush=True)
    N.NcclBackend.pipelines = piped
    be.close() if hasattr(be, "close") else None
json.dump(rows, open(os.path.join(out, "pipe_probe_" + case.name + ".json"), "w"), indent=1)
