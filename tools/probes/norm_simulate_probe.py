"""Probe (not kept): where norm's and simulate's time goes on Matrix 3 (read, decode, column sums, spmv), 32 threads."""
import sys, time
import numpy as np
import numba
from mlemlib.formats import open_matrix
from mlemlib.compressed import decode_slots, check_slots
from mlemlib.norm import accumulate_column_sums
from mlemlib.backends.cpu import spmv, passive_omp_wait

path, nt, nb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
numba.set_num_threads(nt)
passive_omp_wait()
src = open_matrix(path)
m, n = src.shape
bounds = src.chunk_bounds(1 << 24)
step = max(1, len(bounds) // nb)
sel = bounds[::step][:nb]
sums = np.zeros(n)
x = np.ones(n)
y = np.zeros(m)
T = dict(read=0.0, decode=0.0, add=0.0, spmv=0.0, check1=0.0)
nnz = 0
for i, (r0, r1) in enumerate(sel):
    t = time.perf_counter(); sp, lo, codes, values, scale = src._read_slots(r0, r1); T["read"] += time.perf_counter() - t
    t = time.perf_counter(); blk = decode_slots(sp, codes, values, scale, n, source="m", row0=r0, slot0=lo); T["decode"] += time.perf_counter() - t
    if i == 0:
        print("threading layer", numba.threading_layer(), flush=True)
    t = time.perf_counter(); accumulate_column_sums(sums, blk); T["add"] += time.perf_counter() - t
    t = time.perf_counter(); spmv(blk.indptr, blk.indices, blk.data, x, y[r0:r1]); T["spmv"] += time.perf_counter() - t
    if i < 4:
        numba.set_num_threads(1)
        t = time.perf_counter(); check_slots(sp, codes, values, scale, n, source="m", row0=r0, slot0=lo); T["check1"] += time.perf_counter() - t
        numba.set_num_threads(nt)
    nnz += blk.nnz
scale_up = src.nnz / nnz
print(f"threads {nt}, {len(sel)} blocks, {nnz} nnz; extrapolated to the whole matrix (x{scale_up:.1f}):")
for k, v in T.items():
    f = scale_up if k != "check1" else src.nnz / (nnz * min(4, len(sel)) / len(sel))
    print(f"  {k}: {v:.2f} s here -> {v * f:.1f} s whole")
