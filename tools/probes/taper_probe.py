"""One-off probe (not kept): chunks tapered towards each GPU share's end (chunked.taper_for) against untapered,
TAPER_WAVES 1 and 2; MLEM (madpet2 folded reordered, auto = onepass_chunked, graphs) and OSEM S=16 on 1, 2, 4 GPUs.
Per configuration: ms per iteration (median, CUDA events), per-GPU kernel time (eager), chunks, image sha."""
import hashlib
import json
import logging
import os
import sys
import time

import cupy as cp
import numpy as np

from mlemlib import chunked
from mlemlib.backends import make_backend
from mlemlib.backends.nccl import NcclBackend
from mlemlib.bench.cases import load_cases, select
from mlemlib.bench.factors import bench_problem
from mlemlib.bench.runner import prepare_case

logging.basicConfig(level=logging.WARNING)
out = sys.argv[1]
ngpu = cp.cuda.runtime.getDeviceCount()
orig = chunked.taper_for
case = select(load_cases("perf/cases.yaml"), ["madpet2-osem"])[0]
t0 = time.time()
preps = prepare_case(case, "/tmp/bench")
print(f"prepared in {time.time() - t0:.1f} s", flush=True)
rows = []


def variant(w):
    if w == 0:
        chunked.taper_for = lambda sms: None
    else:
        chunked.taper_for = orig
        chunked.TAPER_WAVES = w


def timed(be, iters):
    f = be.initial_image()
    ts, kern = [], []
    for k in range(iters + 3):
        f = be.iterate(f)
        t = be.last_step_times()
        if k >= 3:
            ts.append(t["iteration"])
    return f, 1e3 * float(np.median(ts))


for S in (1, 16):
    prep = [p for p in preps if p.subsets == S][0]
    prob = bench_problem(prep, "none")
    for p in [x for x in (1, 2, 4) if x <= ngpu]:
        for w in ((0, 1, 2) if S == 1 else (0, 1)):
            variant(w)
            t1 = time.time()
            if S > 1:
                be = make_backend("cuda", str(prep.matrix), prob.g, prob.norm, None, gpus=p, **prob.backend_options())
            else:
                be = NcclBackend(str(prep.matrix), prob.g, prob.norm, gpus=p, bp="auto", graph=True)
            try:
                shards = be.parts[1].shards if S > 1 else be.shards
                chunks = [int(s.a.chunks) for s in shards]
                graph = be.graph
                f, ms = timed(be, 10 if S > 1 else 20)
                be.use_graph(False)
                f2, eager = timed(be, 5 if S > 1 else 10)
                row = {"S": S, "gpus": p, "taper_waves": w, "graph": graph, "ms": ms, "eager_ms": eager,
                       "chunks": chunks, "kernel": be.bp_kernel, "load_s": round(time.time() - t1, 1),
                       "sha": hashlib.sha256(be.to_host(f).tobytes()).hexdigest()[:16]}
            finally:
                be.close()
            rows.append(row)
            print(json.dumps(row), flush=True)
            json.dump(rows, open(os.path.join(out, "taper_probe.json"), "w"), indent=1)
