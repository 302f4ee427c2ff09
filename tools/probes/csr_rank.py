"""One rank of the CSR-share probe (or the whole matrix on one GPU, 'single'): eager iterations, the step
times from CUDA events, and 3 iterations inside the NVTX range 'probe' for Nsight Compute."""
import json, logging, os, sys, time
import cupy as cp
import numpy as np
from cupy.cuda import nvtx
from mlemlib.backends import make_backend
from mlemlib.formats import open_source

logging.basicConfig(level=logging.WARNING)
mode = sys.argv[1]
info = json.load(open("/tmp/probe.json"))
g = np.load("/tmp/probe_g.npy"); norm = np.load("/tmp/probe_norm.npy")
src = open_source(info["matrix"], "matrix")
tsrc = open_source(info["transpose"], "transpose") if info["transpose"] else None
kw = {"fp": "auto", "bp": "auto", "graph": False}
if mode == "single":
    kw["gpus"] = 1
else:
    kw.update(gpus=4, layout=info["layout"], plan=info["plan"])
be = make_backend("cuda", src, g, norm, tsrc, **kw)
f = be.initial_image()
steps = []
for k in range(25):
    f = be.iterate(f)
    t = be.last_step_times()
    if k >= 5:
        steps.append(t)
med = {k: round(1e3 * float(np.median([s.get(k, 0.0) for s in steps])), 4) for k in steps[0]}
d = be.describe()
row = {"mode": mode, "rank": os.environ.get("MLEM_RANK"), "fp": be.fp_kernel, "bp": be.bp_kernel, "steps_ms": med,
       "lanes_fp": d.get("lanes_fp"), "lanes_bp": d.get("lanes_bp")}
shards = getattr(be, "shards", None)
if shards:
    s = shards[0]
    row.update(nnz=int(getattr(s, "nnz", 0)), rows=list(map(int, s.rows)) if getattr(s, "rows", None) is not None else None,
               at_shape=list(s.at.shape) if s.at is not None else None)
print("ROW", json.dumps(row), flush=True)
be.synchronize()
nvtx.RangePush("probe")
for k in range(3):
    f = be.iterate(f)
be.synchronize()
nvtx.RangePop()
getattr(be, "close", lambda: None)()
