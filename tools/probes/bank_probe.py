"""One-off probe (not kept): a chunk's voxel list sorted by column (before) against in the order its rows first
touch the voxels (after: consecutive places along a line, fewer shared-memory bank conflicts). One GPU; the whole
madpet2 (folded, reordered) and its 16 angle subsets; chunked_step alone, CUDA events, medians of 20; the sums'
bits compared between the two."""
import hashlib, json, os, sys, time
import cupy as cp
import numpy as np
from numba import njit, prange
from mlemlib import chunked
from mlemlib.backends import _compressed_cuda as cc
from mlemlib.backends import _cuda_kernels as ck
from mlemlib.bench.cases import load_cases, select
from mlemlib.bench.runner import prepare_case
from mlemlib.formats import open_matrix


@njit(parallel=True, cache=False)
def _fill_sorted(indptr, indices, chunk_rows, vptr, voxels, local, n, groups):
    nch = chunk_rows.shape[0] - 1
    for gi in prange(groups):
        stamp = np.full(n, -1, np.int64)
        pos = np.zeros(n, np.int32)
        for c in range(nch * gi // groups, nch * (gi + 1) // groups):
            a = indptr[chunk_rows[c]]; b = indptr[chunk_rows[c + 1]]; v0 = vptr[c]; cnt = 0
            for k in range(a, b):
                j = indices[k]
                if stamp[j] != c:
                    stamp[j] = c; voxels[v0 + cnt] = j; cnt += 1
            voxels[v0:v0 + cnt] = np.sort(voxels[v0:v0 + cnt])
            for i in range(cnt):
                pos[voxels[v0 + i]] = i
            for k in range(a, b):
                local[k] = pos[indices[k]]


out = sys.argv[1]
first_fill = chunked._fill
case = select(load_cases("perf/cases.yaml"), ["madpet2-osem"])[0]
t0 = time.time(); preps = prepare_case(case, "/tmp/bench"); print(f"prepared in {time.time() - t0:.1f} s", flush=True)
sms = ck.device_properties(0)["sm_count"]
rows_out = []
for S in (1, 16):
    prep = [p for p in preps if p.subsets == S][0]
    g, _ = prep.load_problem()
    b = np.load(prep.bounds) if S > 1 else None
    for k in range(S):
        rows = (int(b[k]), int(b[k + 1])) if S > 1 else None
        r0 = rows[0] if rows else 0
        res = {}
        for name, fill in (("sorted", _fill_sorted), ("first", first_fill)):
            chunked._fill = fill
            with open_matrix(str(prep.matrix)) as mat:
                a = cc.DeviceChunked.upload(mat, rows, sms=sms)
            m, n = a.shape
            gg = cp.asarray(g[r0:r0 + m]); f = cp.ones(n, dtype=cp.float32) * 0.7
            fp = cp.empty(m, dtype=cp.float32); acc = cp.zeros(n, dtype=cp.uint64); flag = cp.zeros(1, dtype=cp.int32)
            ts = []
            for it in range(25):
                acc.fill(0); flag.fill(0)
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(); cc.chunked_step(a, gg, f, fp=fp, acc=acc, flag=flag, bound=1e6); e1.record(); e1.synchronize()
                if it >= 5:
                    ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
            sha = hashlib.sha256(acc.get().tobytes() + fp.get().tobytes()).hexdigest()[:16]
            res[name] = (round(float(np.median(ts)), 1), sha, int(a.chunks))
            del a
        row = {"S": S, "subset": k, "sorted_us": res["sorted"][0], "first_us": res["first"][0],
               "same_bits": res["sorted"][1] == res["first"][1], "chunks": res["first"][2]}
        rows_out.append(row); print(json.dumps(row), flush=True)
json.dump(rows_out, open(os.path.join(out, "bank_probe.json"), "w"), indent=1)
s16 = [r for r in rows_out if r["S"] == 16]
print("S=16 summed: sorted %.1f us, first %.1f us" % (sum(r["sorted_us"] for r in s16), sum(r["first_us"] for r in s16)))
