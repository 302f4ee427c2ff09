"""One-off probe of 2026-11-27 at b5a2cf5 (committed once for the record, then removed; docs/gpu.md,
"Chunk sizes"): OSEM S = 16 pass time on 1, 2 and 4 GPUs against chunked.CHUNK_WAVES
(0: chunks of up to MAX_CHUNK_NNZ whatever the share)."""
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
from mlemlib.bench.cases import load_cases, select
from mlemlib.bench.factors import bench_problem
from mlemlib.bench.runner import prepare_case

logging.basicConfig(level=logging.WARNING)
out = sys.argv[1]
ngpu = cp.cuda.runtime.getDeviceCount()
case = select(load_cases("perf/cases.yaml"), ["madpet2-osem"])[0]
t0 = time.time()
preps = prepare_case(case, "/tmp/bench")
prep = [p for p in preps if p.subsets == 16][0]
print(f"prepared in {time.time() - t0:.1f} s", flush=True)
prob = bench_problem(prep, "none")
rows = []
for waves in (0, 1, 2, 4):
    chunked.CHUNK_WAVES = waves
    for p in [x for x in (1, 2, 4) if x <= ngpu]:
        be = make_backend("cuda", str(prep.matrix), prob.g, prob.norm, None, gpus=p, **prob.backend_options())
        try:
            chunks = [int(s.a.chunks) for s in be.parts[1].shards]
            f = be.initial_image()
            ts = []
            for k in range(13):
                f = be.iterate(f)
                if k >= 3:
                    ts.append(be.last_step_times()["iteration"])
            row = {"waves": waves, "gpus": p, "graph": be.graph, "pass_ms": 1e3 * float(np.median(ts)),
                   "subset1_chunks": chunks, "sha": hashlib.sha256(be.to_host(f).tobytes()).hexdigest()[:16]}
        finally:
            be.close()
        rows.append(row)
        print(json.dumps(row), flush=True)
json.dump(rows, open(os.path.join(out, "osem_probe.json"), "w"), indent=1)
