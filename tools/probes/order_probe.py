"""One-off probe: the chunked kernel's launch order (chunked.launch_order, TAIL_WAVES 0 = row order, 1, 2,
1000 = all largest first). madpet2 folded reordered (case madpet2-osem's matrices), MLEM S=1 and OSEM S=16,
1/2/4 GPUs, backends as the bench runner makes them; the order arrays rewritten in place between variants
(graphs keep their pointers). Per variant: ms per iteration (median of CUDA-event iteration times), sha."""
import hashlib, json, logging, os, sys, time
import cupy as cp
import numpy as np
from mlemlib import chunked
from mlemlib.backends import make_backend
from mlemlib.backends._compressed_cuda import DeviceChunked
from mlemlib.bench.cases import load_cases, select
from mlemlib.bench.factors import bench_problem
from mlemlib.bench.runner import prepare_case, partition
from mlemlib.backends import graph_option
from mlemlib.formats import open_source

logging.basicConfig(level=logging.WARNING)
out = sys.argv[1]
gpus = [int(x) for x in sys.argv[2].split(",")]
ngpu = cp.cuda.runtime.getDeviceCount()
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

def set_order(be, w):
    for a in mats(be):
        with cp.cuda.Device(a.order.device.id):
            sizes = (a.indptr[a.chunk_rows[1:]] - a.indptr[a.chunk_rows[:-1]]).get()
            sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
            a.order[...] = cp.asarray(chunked.launch_order(sizes, sms, w))
            cp.cuda.Device().synchronize()

def timed(be, f, iters):
    ts = []
    for k in range(iters + 3):
        f = be.iterate(f)
        if k >= 3:
            ts.append(be.last_step_times()["iteration"])
    return f, 1e3 * float(np.median(ts))

for S in (1, 16):
    prep = [p for p in preps if p.subsets == S][0]
    prob = bench_problem(prep, "none")
    for p in [x for x in gpus if x <= ngpu]:
        t1 = time.time()
        src = open_source(os.fspath(prep.matrix), "matrix")
        kw = {"fp": "auto", "bp": "auto", **prob.backend_options(), "gpus": p, "layout": case.layout}
        if p > 1 and S == 1:
            kw["plan"] = os.fspath(partition(case, prep, p))
        g = graph_option(case.graph)
        if g is not None:
            kw["graph"] = g
        be = make_backend("cuda", src, prob.g, prob.norm, None, **kw)
        try:
            ms_ = mats(be)
            info = {"S": S, "gpus": p, "kernel": be.bp_kernel, "graph": getattr(be, "graph", None),
                    "chunks": [int(a.chunks) for a in ms_][:8], "n_mats": len(ms_), "load_s": round(time.time() - t1, 1)}
            sz = np.diff(ms_[0].indptr.get()[ms_[0].chunk_rows.get()])
            info["sizes_first_mat"] = [int(np.percentile(sz, q)) for q in (0, 10, 50, 90, 100)]
            print(json.dumps(info), flush=True)
            f0 = be.initial_image()
            for rnd in range(2):
                for w in (0, 1, 2, 1000):
                    set_order(be, w)
                    f, ms = timed(be, f0, 20 if S == 1 else 10)
                    row = dict(info, round=rnd, tail_waves=w, ms=round(ms, 4),
                               sha=hashlib.sha256(be.to_host(f).tobytes()).hexdigest()[:16])
                    rows.append(row)
                    print(json.dumps({k: row[k] for k in ("S", "gpus", "round", "tail_waves", "ms", "sha")}), flush=True)
                    json.dump(rows, open(os.path.join(out, "order_probe.json"), "w"), indent=1)
        finally:
            be.close()
print(f"total {time.time() - t0:.1f} s")
