"""One-off probe, after launch_order (TAIL_WAVES=1): MAX_CHUNK_NNZ 2^18 / 2^19 / 2^20 for MLEM, CHUNK_WAVES 2 / 1
for OSEM S=16; madpet2 folded reordered, 1/2/4 GPUs, backends as the bench runner makes them. Eager step times of
MLEM at the default on every GPU count."""
import hashlib, json, logging, os, sys, time
import cupy as cp
import numpy as np
from mlemlib import chunked
from mlemlib.backends import make_backend, graph_option
from mlemlib.backends._compressed_cuda import DeviceChunked
from mlemlib.bench.cases import load_cases, select
from mlemlib.bench.factors import bench_problem
from mlemlib.bench.runner import prepare_case, partition
from mlemlib.formats import open_source

logging.basicConfig(level=logging.WARNING)
out = sys.argv[1]
gpus = [int(x) for x in sys.argv[2].split(",")]
case = select(load_cases("perf/cases.yaml"), ["madpet2-osem"])[0]
t0 = time.time()
preps = prepare_case(case, "/tmp/bench")
print(f"prepared in {time.time() - t0:.1f} s", flush=True)
rows = []

def mats(be):
    if isinstance(getattr(be, "a", None), DeviceChunked):
        return [be.a]
    if hasattr(be, "parts"):
        return [m for p in be.parts for m in mats(p)]
    return [s.a for s in getattr(be, "shards", []) if isinstance(s.a, DeviceChunked)]

def timed(be, iters):
    f = be.initial_image()
    ts, steps = [], []
    for k in range(iters + 3):
        f = be.iterate(f)
        if k >= 3:
            t = be.last_step_times()
            ts.append(t["iteration"]); steps.append(t)
    med = {k: round(1e3 * float(np.median([s[k] for s in steps if k in s])), 4) for k in steps[-1]}
    return f, 1e3 * float(np.median(ts)), med

variants = [(1, "MAX_CHUNK_NNZ", v) for v in (1 << 18, 1 << 19, 1 << 20)] + [(16, "CHUNK_WAVES", v) for v in (2, 1)]
for S, name, val in variants:
    prep = [p for p in preps if p.subsets == S][0]
    prob = bench_problem(prep, "none")
    old = getattr(chunked, name)
    setattr(chunked, name, val)
    for p in gpus:
        t1 = time.time()
        src = open_source(os.fspath(prep.matrix), "matrix")
        kw = {"fp": "auto", "bp": "auto", **prob.backend_options(), "gpus": p, "layout": case.layout}
        if p > 1 and S == 1:
            kw["plan"] = os.fspath(partition(case, prep, p))
        be = make_backend("cuda", src, prob.g, prob.norm, None, **kw)
        try:
            ms_ = mats(be)
            row = {"S": S, name: val, "gpus": p, "kernel": be.bp_kernel, "graph": getattr(be, "graph", None),
                   "chunks": sum(int(a.chunks) for a in ms_), "reuse": round(float(np.mean([a.reuse for a in ms_])), 2),
                   "load_s": round(time.time() - t1, 1)}
            r = []
            for rnd in range(2):
                f, ms, _ = timed(be, 20 if S == 1 else 10)
                r.append(round(ms, 4))
            row["ms"] = r
            row["sha"] = hashlib.sha256(be.to_host(f).tobytes()).hexdigest()[:16]
            if S == 1 and val == 1 << 18 and hasattr(be, "use_graph"):
                be.use_graph(False)
                _, ms, med = timed(be, 10)
                row["eager_ms"], row["eager_steps"] = round(ms, 4), med
        finally:
            getattr(be, "close", lambda: None)()
            src.close() if hasattr(src, "close") else None
        rows.append(row)
        print(json.dumps(row), flush=True)
        json.dump(rows, open(os.path.join(out, "cap_probe.json"), "w"), indent=1)
    setattr(chunked, name, old)
print(f"total {time.time() - t0:.1f} s")
