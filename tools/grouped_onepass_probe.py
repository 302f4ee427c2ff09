"""Probe: the one pass over Matrix 3 rows stored as groups of 8 parallel LORs over their union of voxels.

Section 62 of docs/benchmarks.md: 8 neighbouring parallel LORs of the
``matrix3`` preset touch 0.60 distinct voxels per non-zero. This probe
traces such groups (both ends shifted together along their rings), stores
them twice on one GPU and times the one pass (forward projection, ratio,
back projection with float atomics) over each:

- ``csr``: the rows as CSR in the same order, the library's one pass
  (``_compressed_cuda.onepass``);
- ``grouped``: per group the union of its rows' columns (int32), a mask of
  the rows that have each (uint8) and their values in row order; one warp
  per group: one gather of f per distinct voxel (its terms added to each
  row's sum), the ratios, then one atomic per distinct voxel;

and the back projection alone from a given c: the library's CSR ``scatter``
against ``union_scatter`` over the non-zeros sorted by (group, voxel, row),
a lane per non-zero, each run of one voxel within a warp's 32 summed by a
segmented scan and added by one atomic.

Both back projections are checked against a float64 one on the host. Run
from the repository root on the device: ``PYTHONPATH=. python3
tools/grouped_onepass_probe.py --out $OUT/grouped.json``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

K = 8  # rows per group

SOURCE = r"""
typedef long long i64;
#define K 8

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The values of the trip's element: lane's first value index (exclusive scan of the masks' popcounts).
__device__ __forceinline__ i64 trip_values(unsigned m, int lane, i64 voff, i64& next) {
    const int cnt = __popc(m);
    int incl = cnt;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    next = voff + __shfl_sync(0xffffffffu, incl, 31);
    return voff + incl - cnt;
}

// Back projection alone from slots sorted by (group, voxel, row): a lane per slot computes its
// term, the runs of one voxel in a warp's 32 slots are summed by a segmented scan, and the
// run's last lane adds it: one atomic per run instead of one per slot.
extern "C" __global__ void union_scatter(const int* __restrict__ col, const int* __restrict__ row,
                                         const float* __restrict__ val, const float* __restrict__ c,
                                         float* bp, i64 nslots) {
    const int lane = threadIdx.x & 31;
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 base = warp * 32; base < nslots; base += nwarps * 32) {
        const i64 k = base + lane;
        const bool ok = k < nslots;
        const int cl = ok ? col[k] : -1;
        float t = ok ? __ldcs(val + k) * __ldg(c + __ldcs(row + k)) : 0.0f;
        const int up = __shfl_up_sync(0xffffffffu, cl, 1);
        const unsigned heads = __ballot_sync(0xffffffffu, lane == 0 || up != cl);
        const int start = 31 - __clz(heads & (0xffffffffu >> (31 - lane)));
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane - o >= start) t += y;
        }
        const bool tail = lane == 31 || ((heads >> (lane + 1)) & 1u);
        if (ok && tail) atomicAdd(bp + cl, t);
    }
}

extern "C" __global__ void grouped_onepass(const i64* __restrict__ gptr, const i64* __restrict__ vptr,
                                           const int* __restrict__ col, const unsigned char* __restrict__ mask,
                                           const float* __restrict__ val, const float* __restrict__ f,
                                           const float* __restrict__ g, float* bp, i64 ngroups) {
    const int lane = threadIdx.x & 31;
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 grp = warp; grp < ngroups; grp += nwarps) {
        const i64 s = gptr[grp], e = gptr[grp + 1];
        float acc[K];
#pragma unroll
        for (int r = 0; r < K; ++r) acc[r] = 0.0f;
        i64 voff = vptr[grp];
        for (i64 k0 = s; k0 < e; k0 += 32) {
            const i64 k = k0 + lane;
            const bool ok = k < e;
            const unsigned m = ok ? (unsigned)mask[k] : 0u;
            const float fc = ok ? __ldg(f + col[k]) : 0.0f;
            i64 next;
            i64 my = trip_values(m, lane, voff, next);
#pragma unroll
            for (int r = 0; r < K; ++r)
                if ((m >> r) & 1u) acc[r] += __ldg(val + my++) * fc;
            voff = next;
        }
        float c[K];
#pragma unroll
        for (int r = 0; r < K; ++r) {
            const float fp = warp_sum(acc[r]);
            c[r] = fp != 0.0f ? __ldg(g + grp * K + r) / fp : 0.0f;
        }
        voff = vptr[grp];
        for (i64 k0 = s; k0 < e; k0 += 32) {
            const i64 k = k0 + lane;
            const bool ok = k < e;
            const unsigned m = ok ? (unsigned)mask[k] : 0u;
            i64 next;
            i64 my = trip_values(m, lane, voff, next);
            float t = 0.0f;
#pragma unroll
            for (int r = 0; r < K; ++r)
                if ((m >> r) & 1u) t += __ldg(val + my++) * c[r];
            if (ok) atomicAdd(bp + col[k], t);
            voff = next;
        }
    }
}
"""


def group_rows(cfg, groups: int, seed: int) -> np.ndarray:
    """Row numbers of ``groups`` groups of K parallel LORs (both ends shifted together along their rings)."""
    rng = np.random.default_rng(seed)
    ncr, cpr, rings = cfg.n_crystals, cfg.crystals_per_ring, cfg.n_rings
    ri = rng.integers(0, rings, groups)
    rj = rng.integers(0, rings, groups)
    ki = rng.integers(0, cpr, groups)
    off = rng.integers(cpr // 4, 3 * cpr // 4, groups)  # LORs across the field of view, not beside a crystal
    d = np.arange(K)
    i = ri[:, None] * cpr + (ki[:, None] + d) % cpr
    j = rj[:, None] * cpr + (ki[:, None] + off[:, None] + d) % cpr
    return (i * ncr + j).reshape(-1).astype(np.int64)


def grouped(ip: np.ndarray, ix: np.ndarray, v: np.ndarray, ngroups: int):
    """(gptr, vptr, col, mask, val) of the grouped layout of a CSR whose rows come K by K in groups."""
    m = ngroups * K
    lengths = np.diff(ip)
    row = np.repeat(np.arange(m, dtype=np.int64), lengths)
    gid = row // K
    r = (row % K).astype(np.uint8)
    order = np.lexsort((r, ix, gid))  # by group, then voxel, then row in the group
    gid, col, r, val = gid[order], ix[order], r[order], v[order]
    slots = (col.astype(np.int32), (gid * K + r).astype(np.int32))  # union_scatter's voxel and row per slot
    new = np.ones(col.size, dtype=bool)
    new[1:] = (gid[1:] != gid[:-1]) | (col[1:] != col[:-1])
    starts = np.flatnonzero(new)
    mask = np.bitwise_or.reduceat((np.uint8(1) << r).astype(np.uint8), starts)
    ucol = col[starts].astype(np.int32)
    ugid = gid[starts]
    gptr = np.searchsorted(ugid, np.arange(ngroups + 1)).astype(np.int64)
    vptr = ip[::K][: ngroups + 1].astype(np.int64)
    return gptr, vptr, ucol, mask, val.astype(np.float32), slots


def main(argv=None) -> int:
    import cupy as cp

    from mlemlib.backends import _compressed_cuda as cc
    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.bench import copy_bandwidth, time_gpu
    from mlemlib.scanner import get_preset
    from mlemlib.scanner.system import trace_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    cfg = get_preset("matrix3")
    rows = group_rows(cfg, args.groups, args.seed)
    t0 = time.perf_counter()
    host = trace_rows(cfg, rows)
    t_trace = time.perf_counter() - t0
    m, n = host.shape[0], cfg.shape[1]
    ip, ix, v = host.indptr.astype(np.int64), host.indices.astype(np.int32), host.data.astype(np.float32)
    t0 = time.perf_counter()
    gptr, vptr, ucol, mask, val, (scol, srow) = grouped(ip, ix, v, args.groups)
    t_group = time.perf_counter() - t0
    nnz = int(ip[-1])
    res = {"groups": args.groups, "rows": m, "nnz": nnz, "distinct": int(ucol.size),
           "distinct_per_nnz": ucol.size / nnz, "trace_s": t_trace, "group_s": t_group,
           "copy": copy_bandwidth()}
    print(f"{m} rows, {nnz} nnz, {ucol.size} distinct ({ucol.size / nnz:.3f} per nnz); "
          f"traced in {t_trace:.1f} s, grouped in {t_group:.1f} s", flush=True)

    rng = np.random.default_rng(1)
    f_h = rng.uniform(0.5, 1.5, n).astype(np.float32)
    g_h = rng.uniform(0.5, 1.5, m).astype(np.float32)
    # float64 reference of the one pass's back projection
    import scipy.sparse as sp

    a64 = sp.csr_matrix((v.astype(np.float64), ix, ip), shape=(m, n))
    fp64 = a64 @ f_h.astype(np.float64)
    c64 = np.where(fp64 != 0, g_h / np.where(fp64 != 0, fp64, 1.0), 0.0)
    ref = a64.T @ c64
    del a64

    f = cp.asarray(f_h)
    g = cp.asarray(g_h)
    bp = cp.zeros(n, dtype=cp.float32)
    fp = cp.zeros(m, dtype=cp.float32)
    a = ck.DeviceCSR(cp.asarray(ip), cp.asarray(ix), cp.asarray(v), (m, n))
    dg = [cp.asarray(x) for x in (gptr, vptr, ucol, mask, val)]
    mod = cp.RawModule(code=SOURCE, options=("--std=c++17",))
    fn = mod.get_function("grouped_onepass")
    props = ck.device_properties(cp.cuda.Device().id)
    threads = 256
    blocks = min((args.groups * 32 + threads - 1) // threads, props["sm_count"] * 8)

    def run_csr():
        bp.fill(0)
        cc.onepass(a, g, f, bp=bp, fp=fp)
        return bp

    def run_grouped():
        bp.fill(0)
        fn((blocks,), (threads,), (*dg, f, g, bp, np.int64(args.groups)))
        return bp

    res["variants"] = {}

    def compare(calls: dict, want: np.ndarray) -> None:
        """Check each call against ``want`` and time it; two rounds, the order reversed in the second."""
        for rnd in range(2):
            for name in (list(calls) if rnd == 0 else list(calls)[::-1]):
                y = calls[name]().get().astype(np.float64)
                err = float(np.linalg.norm(y - want) / np.linalg.norm(want))
                t = time_gpu(calls[name], repeat=args.repeat) * 1e3
                res["variants"].setdefault(name, []).append({"median_ms": float(np.median(t)),
                                                             "rel_l2_to_float64": err})
                print(f"{name:14s} {np.median(t):.3f} ms  {nnz / np.median(t) / 1e6:.3f} nnz/ns  rel L2 {err:.2e}",
                      flush=True)

    compare({"csr": run_csr, "grouped": run_grouped}, ref)
    # the back projection alone from a given c: the library's CSR scatter against the slot runs
    c_h = rng.uniform(0.5, 1.5, m).astype(np.float32)
    c = cp.asarray(c_h)
    ref_bp = sp.csr_matrix((v.astype(np.float64), ix, ip), shape=(m, n)).T @ c_h.astype(np.float64)
    ds = [cp.asarray(x) for x in (scol, srow, val)]
    fs = mod.get_function("union_scatter")
    sblocks = min((scol.size + threads - 1) // threads, props["sm_count"] * 8)

    def run_scatter():
        return ck.scatter(a, c, bp, kernel="scatter", lanes=32)

    def run_union():
        bp.fill(0)
        fs((sblocks,), (threads,), (*ds, c, bp, np.int64(scol.size)))
        return bp

    compare({"csr_scatter": run_scatter, "union_scatter": run_union}, ref_bp)
    res["bytes"] = {"csr": int(ip.nbytes + ix.nbytes + v.nbytes),
                    "grouped": int(gptr.nbytes + vptr.nbytes + ucol.nbytes + mask.nbytes + val.nbytes)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
