"""One-off probe of 2026-11-27 (committed once for the record, then removed): where the chunked one pass loses
its scaling on 2 and 4 GPUs (docs/gpu.md, "Chunk sizes"). Run on the device from a git archive of the commit
under test: ``python3 chunk_cap_probe.py OUT``.

Three runs used it: (1) at c597a47 with a nnz-balanced split and splits balanced on ``nnz + alpha * entries``
(the loop over ``alpha`` that this version no longer has); (2) at 6850eb6 (the kernel then read a launch
order, ``DeviceChunked.order``) looping ``chunked.MAX_CHUNK_NNZ`` over 2^62, 2^19, 2^18, 2^17 (set before
``write_layout``); (3) this version, at 6850eb6: 2^18, largest chunks first against row order.

Per GPU: the pass's kernel time (start -> bp events), its non-zeros, chunks and voxel-list entries, for the
nnz-balanced split of the matrix's chunk layout and for splits balanced on a fitted cost model; the iteration
with graphs; the image's bits (any split must give the same)."""
import hashlib
import json
import logging
import os
import sys
import time

import cupy as cp
import numpy as np

from mlemlib import chunked
from mlemlib.backends.nccl import NcclBackend
from mlemlib.bench.cases import load_cases, select
from mlemlib.bench.runner import prepare_case
from mlemlib.partition import balanced_bounds

logging.basicConfig(level=logging.WARNING)
out = sys.argv[1]
ngpu = cp.cuda.runtime.getDeviceCount()
case = select(load_cases("perf/cases.yaml"), [sys.argv[2] if len(sys.argv) > 2 else "madpet2-folded-reordered-auto"])[0]
t0 = time.time()
prep = prepare_case(case, "/tmp/bench")[0]
print(f"prepared in {time.time() - t0:.1f} s: {prep.matrix}", flush=True)
g, norm = prep.load_problem()
results = []


def feats(c0, c1):
    return [float(nnzptr[c1] - nnzptr[c0]), float(vptr[c1] - vptr[c0]), float(c1 - c0)]


def measure(label, ranges, iters=20, identity=False):
    p = len(ranges)
    lay = globals()["lay"]
    lay.ranges = lambda parts, r=ranges: list(r)
    be = NcclBackend(str(prep.matrix), g, norm, gpus=p, bp="auto", graph=False, chunks=lay)
    try:
        if identity:  # launch in row order
            for s in be.shards:
                with cp.cuda.Device(s.device):
                    s.a.order = cp.arange(s.a.chunks, dtype=cp.int32)
        f = be.initial_image()
        per = [[] for _ in range(p)]
        ar = [[] for _ in range(p)]
        its = []
        for k in range(iters + 3):
            f = be.iterate(f)
            t = be.last_step_times()
            if k >= 3:
                its.append(t["iteration"])
                for i, s in enumerate(be.shards):
                    per[i].append(cp.cuda.get_elapsed_time(s.events["start"], s.events["bp"]))
                    ar[i].append(cp.cuda.get_elapsed_time(s.events["bp"], s.events["allreduce"]))
        be.use_graph(True)
        gi = []
        for k in range(iters + 3):
            f = be.iterate(f)
            if k >= 3:
                gi.append(be.last_step_times()["iteration"])
        img = be.to_host(f)
        row = {"label": label, "gpus": p, "ranges": ranges, "kernel": be.bp_kernel,
               "shard_ms": [float(np.median(x)) for x in per], "allreduce_ms": [float(np.median(x)) for x in ar],
               "feats": [feats(*r) for r in ranges], "eager_ms": 1e3 * float(np.median(its)),
               "graph_ms": 1e3 * float(np.median(gi)), "sha": hashlib.sha256(img.tobytes()).hexdigest()[:16]}
    finally:
        be.close()
    results.append(row)
    print(json.dumps({k: (np.round(v, 4).tolist() if k in ("shard_ms", "allreduce_ms") else v)
                      for k, v in row.items() if k not in ("feats", "ranges")}), flush=True)
    return row


def ranges_by(weights, parts):
    cum = np.concatenate([[0], np.cumsum(weights)])
    b = balanced_bounds(np.round(cum).astype(np.int64), parts)
    return [(int(b[i]), int(b[i + 1])) for i in range(parts)]


def chunk_stats(label):
    d = np.diff(nnzptr)
    return {"label": label, "chunks": int(len(d)), "mean": float(d.mean()), "p99": float(np.percentile(d, 99)),
            "max": int(d.max()), "argmax": int(d.argmax()), "reuse": float(nnzptr[-1] / vptr[-1])}


stats = []
cap = chunked.MAX_CHUNK_NNZ
path = f"/tmp/bench/chunks-{cap}.h5"
chunked.write_layout(str(prep.matrix), path).close()
lay = chunked.open_layout(path)
nnzptr = np.asarray(lay.nnzptr, dtype=np.int64)
vptr = np.asarray(lay.vptr, dtype=np.int64)
print(json.dumps(chunk_stats(f"cap{cap}")), flush=True)
for identity in (False, True, False):
    for p in [x for x in (1, 2, 4) if x <= ngpu]:
        measure(f"cap{cap}-{'rows' if identity else 'largest'}-{p}", chunked.chunk_ranges(nnzptr, p), identity=identity)
json.dump({"results": results}, open(os.path.join(out, "balance.json"), "w"), indent=1)
