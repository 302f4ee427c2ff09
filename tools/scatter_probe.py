"""Variants of the atomic scatter (back projection without A^T, CSR) beside cuSPARSE's transposed product.

Issue 13: the library's ``scatter`` ran 1.4% behind ``cusparse_notrans`` on
``madpet2`` in its own order on the H100 (benchmarks.md section 59). This
probe times, in one process on the same matrix and vector (the correlation's
zeros at empty rows, as in an iteration), each including the zeroing of the
output:

- ``library``: ``ck.scatter(kernel="scatter")`` (32 lanes, a group per row);
- ``compact``: the same loop over the non-empty rows only (``compact_rows``);
- ``unrollU``: U trips' loads before their atomics;
- ``threads128``: the library's loop in 128-thread blocks (``unroll2_t512``: U = 2 in 512);
- ``lanes16``, ``lanes16_unroll2``, ``library_lanes16``: 16 lanes per row (two rows per warp);
- ``heads``, ``heads_unroll2``: the row's bounds loaded beside its correlation (one latency, not two);
- ``spread_golden``, ``spread_perm``: the library's loop (2 trips' loads before their atomics) over the
  rows in another launch order, each row read whole and in place: warp ``w`` takes row ``w P mod m``
  (``P`` near ``m`` over the golden ratio, coprime with ``m``) or that of a random permutation;
- ``*_c_nonzero``: with a vector without zeros (as ``mlem bench spmv``'s), every row is read;
- ``cusparse_notrans``.

Each is checked against cuSPARSE's result (relative L2). Run from the
repository root on the device: ``PYTHONPATH=. python3 tools/scatter_probe.py
--out $OUT/scatter.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_kernels as dk  # noqa: E402

SOURCE = r"""
typedef long long i64;

template <int L, int U>
__device__ __forceinline__ void scat_row(i64 s, i64 e, const int* __restrict__ col, const float* __restrict__ val,
                                         float cr, float* out, int lane) {
    i64 k0 = s;
    if (U > 1) {
        // U trips' loads before their atomics (the last trip's elements under a predicate)
        for (; k0 + (U - 1) * L < e; k0 += U * L) {
            unsigned cc[U];
            float vv[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const i64 k = k0 + u * L + lane;
                const bool ok = k < e;
                cc[u] = ok ? (unsigned)__ldcs(col + k) : 0u;
                vv[u] = ok ? __ldcs(val + k) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (k0 + u * L + lane < e) atomicAdd(out + cc[u], vv[u] * cr);
        }
    }
    for (; k0 < e; k0 += L) {
        const i64 k = k0 + lane;
        if (k < e) atomicAdd(out + (unsigned)__ldcs(col + k), __ldcs(val + k) * cr);
    }
}

template <int L, int U, bool HEADS>
__device__ __forceinline__ void scat(const i64* __restrict__ rowptr, const int* __restrict__ col,
                                     const float* __restrict__ val, const float* __restrict__ c, float* out,
                                     i64 m, const i64* __restrict__ rows) {
    const int lane = threadIdx.x & (L - 1);
    const i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / L;
    if (r >= m) return;
    const i64 row = rows != nullptr ? rows[r] : r;
    if (HEADS) {  // the row's bounds loaded beside its correlation: one latency, not two
        const i64 s = __ldg(rowptr + r), e = __ldg(rowptr + r + 1);
        const float cr = __ldg(c + row);
        if (cr == 0.0f) return;
        scat_row<L, U>(s, e, col, val, cr, out, lane);
        return;
    }
    const float cr = __ldg(c + row);
    if (cr == 0.0f) return;
    scat_row<L, U>(rowptr[r], rowptr[r + 1], col, val, cr, out, lane);
}

// The rows in another launch order: warp w takes row (w P) mod m (P coprime with m, near m / golden
// ratio: the rows in flight together come from all over the matrix) or perm[w]; each row is still read
// whole and in place. In the scanner's order the rows in flight together are a fan of neighbouring
// LORs, whose atomics meet on the same voxels.
template <int L, int U>
__device__ __forceinline__ void scat_spread(const i64* __restrict__ rowptr, const int* __restrict__ col,
                                            const float* __restrict__ val, const float* __restrict__ c,
                                            float* out, i64 m, i64 P, const i64* __restrict__ perm) {
    const int lane = threadIdx.x & (L - 1);
    const i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / L;
    if (w >= m) return;
    const i64 r = perm != nullptr ? perm[w]
                                  : (i64)(((unsigned long long)w * (unsigned long long)P) % (unsigned long long)m);
    const float cr = __ldg(c + r);
    if (cr == 0.0f) return;
    scat_row<L, U>(rowptr[r], rowptr[r + 1], col, val, cr, out, lane);
}
extern "C" __global__ void __launch_bounds__(1024) scat32u2s(const i64* rowptr, const int* col, const float* val,
    const float* c, float* out, i64 m, i64 P, const i64* perm) { scat_spread<32, 2>(rowptr, col, val, c, out, m, P, perm); }

#define K(NAME, L, U, H) \
extern "C" __global__ void __launch_bounds__(1024) NAME(const i64* rowptr, const int* col, const float* val, \
    const float* c, float* out, i64 m, const i64* rows) { scat<L, U, H>(rowptr, col, val, c, out, m, rows); }
K(scat32, 32, 1, false)
K(scat32u2, 32, 2, false)
K(scat32u4, 32, 4, false)
K(scat16, 16, 1, false)
K(scat16u2, 16, 2, false)
K(scat32h, 32, 1, true)
K(scat32u2h, 32, 2, true)
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rays", type=int, default=81)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--only", default=None, help="comma-separated variants to time (default: all)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    import cupy as cp

    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.bench import copy_bandwidth, time_gpu

    host, _ = dk.trace(args.rays)
    a = ck.DeviceCSR.from_host(host)
    del host
    m, n = a.shape
    lengths = cp.diff(a.indptr)
    rng = np.random.default_rng(5)
    c = cp.asarray(rng.uniform(0.5, 1.5, m).astype(np.float32))
    c[lengths == 0] = 0.0  # the correlation of an empty row
    c_full = cp.asarray(rng.uniform(0.5, 1.5, m).astype(np.float32))  # as bench's vector: no zeros
    # once, as bench's forward product does: cupyx checks the CSR's canonical format (sorted, no
    # duplicates) on its first product and remembers it; unchecked, the transposed view's product
    # re-checks the whole index array on every call (~2.5 ms more on madpet2)
    a.cusparse().sum_duplicates()
    ref = a.cusparse().T @ c
    ref64 = cp.asarray(ref, dtype=cp.float64)
    mod = cp.RawModule(code=SOURCE, options=("--std=c++17",))
    rows_c = a.compact_rows()  # the non-empty rows; this probe's kernels take their compacted row pointer
    ptr_c = cp.concatenate([a.indptr[rows_c], a.indptr[-1:]])
    out = cp.empty(n, dtype=cp.float32)
    null = np.uint64(0)

    def raw(name, lanes, threads, compact=False, vec=None):
        fn = mod.get_function(name)
        cv = c if vec is None else vec
        mr = int(rows_c.size) if compact else m
        ptr = ptr_c if compact else a.indptr
        rows = rows_c if compact else null
        blocks = (mr * lanes + threads - 1) // threads

        def call():
            out.fill(0)
            fn((blocks,), (threads,), (ptr, a.indices, a.data, cv, out, np.int64(mr), rows))
            return out
        return call

    def spread(vec=None, perm=None):
        fn = mod.get_function("scat32u2s")
        cv = c if vec is None else vec
        p = int(m / 1.618033988749895)
        while math.gcd(p, m) != 1:
            p += 1
        blocks = (m * 32 + 255) // 256
        pa = perm if perm is not None else null

        def call():
            out.fill(0)
            fn((blocks,), (256,), (a.indptr, a.indices, a.data, cv, out, np.int64(m), np.int64(p), pa))
            return out
        return call

    perm = cp.asarray(rng.permutation(m).astype(np.int64))
    variants = {
        "library": lambda: ck.scatter(a, c, out, kernel="scatter", lanes=32),
        "spread_golden": spread(),
        "spread_golden_c_nonzero": spread(vec=c_full),
        "spread_perm": spread(perm=perm),
        "spread_perm_c_nonzero": spread(vec=c_full, perm=perm),
        "heads": raw("scat32h", 32, 256),
        "heads_unroll2": raw("scat32u2h", 32, 256),
        "heads_unroll2_c_nonzero": raw("scat32u2h", 32, 256, vec=c_full),
        "probe_same": raw("scat32", 32, 256),
        "compact": raw("scat32", 32, 256, compact=True),
        "unroll2": raw("scat32u2", 32, 256),
        "compact_unroll2": raw("scat32u2", 32, 256, compact=True),
        "unroll4": raw("scat32u4", 32, 256),
        "compact_unroll4": raw("scat32u4", 32, 256, compact=True),
        "unroll4_t128": raw("scat32u4", 32, 128),
        "threads128": raw("scat32", 32, 128),
        "unroll2_t512": raw("scat32u2", 32, 512),
        "lanes16": raw("scat16", 16, 256),
        "lanes16_unroll2": raw("scat16u2", 16, 256),
        "library_lanes16": lambda: ck.scatter(a, c, out, kernel="scatter", lanes=16),
        "library_c_nonzero": lambda: ck.scatter(a, c_full, out, kernel="scatter", lanes=32),
        "compact_unroll2_c_nonzero": raw("scat32u2", 32, 256, compact=True, vec=c_full),
        "cusparse_notrans": lambda: a.cusparse().T @ c,
        "cusparse_notrans_c_nonzero": lambda: a.cusparse().T @ c_full,
    }
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only.split(",")}
    res = {"copy": copy_bandwidth(), "matrix": {"shape": [m, n], "nnz": int(a.nnz), "empty_rows": int(m - rows_c.size)},
           "variants": {}}
    for rnd in range(2):  # two rounds, the order reversed in the second: a drift hits all alike
        for name in (list(variants) if rnd == 0 else list(variants)[::-1]):
            fn = variants[name]
            y = fn()
            want = (a.cusparse().T @ c_full).astype(cp.float64) if name.endswith("c_nonzero") else ref64
            err = float(cp.linalg.norm(cp.asarray(y, dtype=cp.float64) - want) / cp.linalg.norm(want))
            t = time_gpu(fn, repeat=args.repeat) * 1e3
            res["variants"].setdefault(name, []).append({"median_ms": float(np.median(t)), "min_ms": float(t.min()),
                                                         "rel_l2_to_cusparse": err})
    for name, runs in res["variants"].items():
        print(f"{name:18s} " + "  ".join(f"{r['median_ms']:.4f} ms" for r in runs) + f"  rel L2 {runs[0]['rel_l2_to_cusparse']:.2e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
