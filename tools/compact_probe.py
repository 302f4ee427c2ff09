"""Layouts of A and A^T for the row kernel: columns compacted, elements interleaved by lane.

Issue 13 (H200, madpet2 in its own order): the back projection on A^T runs at
85-90% of the copy bandwidth on an H200, bound by its gathers of the
correlation ``c`` (one entry per LOR). 58% of madpet2's LORs miss the field of
view: their rows of A are empty and ``c`` is 0 there, yet they sit between the
used entries, so that ``c`` spans 5.3 MB and each 32-byte sector holds fewer
useful entries. This probe renumbers A^T's columns to the ranks of A's
non-empty rows (a monotone map: every row of A^T keeps its order, so its sums
are the same bit for bit) and gathers from the compacted ``c`` (2.2 MB), and
likewise A's columns to the non-empty columns (voxels some LOR crosses) for
the forward projection. Each is timed under every launch shape of the tuner,
all kernels in turn (``time_gpu_interleaved``), two rounds, beside cuSPARSE
and the copy bandwidth.

``interleaved``: each row's 16-byte part (the quads ``csr_vector`` loads as
int4/float4) is stored so that lane ``l`` of a trip of ``Q`` quads loads the
row's elements ``l, Q + l, 2 Q + l, 3 Q + l`` of that trip instead of ``4 l ..
4 l + 3``: the k-th gather of every lane then reads consecutive elements (near
columns, few cache lines per instruction) instead of every fourth one. The
same pairs (column, value), in another order: the sums change in rounding only.

Run from the repository root on the device:
``PYTHONPATH=. python3 tools/compact_probe.py --out $OUT/compact.json``.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_kernels as dk  # noqa: E402


def renumber_columns(cp, ck, mat, keep):
    """``mat`` with its columns restricted to ``keep`` (the others hold no element) and renumbered 0..len-1."""
    rank = cp.full(mat.shape[1], -1, dtype=cp.int32)
    rank[keep] = cp.arange(keep.size, dtype=cp.int32)
    idx = rank[mat.indices]
    if bool((idx < 0).any()):
        raise SystemExit("a renumbered column was not kept")
    return ck.DeviceCSR(mat.indptr, idx, mat.data, (mat.shape[0], int(keep.size)))


INTERLEAVE = r"""
typedef long long i64;
// element p of row r moves within its trip of Q quads: element j = k Q + l of the trip goes to slot 4 l + k
extern "C" __global__ void interleave(const i64* __restrict__ rowptr, i64 m, const int* __restrict__ col,
                                      const float* __restrict__ val, int* ocol, float* oval, i64 nnz, int L) {
    const i64 p = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= nnz) return;
    i64 lo = 0, hi = m;  // the row r with rowptr[r] <= p < rowptr[r + 1]
    while (hi - lo > 1) {
        const i64 mid = (lo + hi) >> 1;
        if (rowptr[mid] <= p) lo = mid; else hi = mid;
    }
    const i64 s = rowptr[lo], e = rowptr[lo + 1];
    const i64 qa = (s + 3) >> 2, qe = e >> 2;
    i64 d = p;
    if (qe > qa && p >= 4 * qa && p < 4 * qe) {
        const i64 rel = p - 4 * qa, t = rel / (4 * L);
        const i64 Q = (qe - qa - t * L) < L ? (qe - qa - t * L) : L;
        const i64 j = rel - t * 4 * L;
        d = 4 * qa + t * 4 * L + 4 * (j % Q) + j / Q;
    }
    ocol[d] = col[p];
    oval[d] = val[p];
}
"""


PERMUTE_ROWS = r"""
typedef long long i64;
// new row r is old row perm[r]: one warp copies it
extern "C" __global__ void permute_rows(const i64* __restrict__ ip, const i64* __restrict__ perm,
                                        const i64* __restrict__ nip, i64 m, const int* __restrict__ col,
                                        const float* __restrict__ val, int* ocol, float* oval) {
    const i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (r >= m) return;
    const i64 s = ip[perm[r]], e = ip[perm[r] + 1], d = nip[r];
    for (i64 k = s + lane; k < e; k += 32) {
        ocol[d + k - s] = col[k];
        oval[d + k - s] = val[k];
    }
}
"""


def permute_rows(cp, ck, mat, perm):
    """``mat`` with its rows in the order ``perm`` (new row ``r`` = old row ``perm[r]``), on the GPU."""
    perm = cp.asarray(perm, dtype=cp.int64)
    lengths = cp.diff(mat.indptr)[perm]
    nip = cp.zeros(mat.shape[0] + 1, dtype=cp.int64)
    cp.cumsum(lengths, out=nip[1:])
    col, val = cp.empty_like(mat.indices), cp.empty_like(mat.data)
    m = mat.shape[0]
    fn = cp.RawModule(code=PERMUTE_ROWS).get_function("permute_rows")
    fn(((m * 32 + 255) // 256,), (256,), (mat.indptr, perm, nip, np.int64(m), mat.indices, mat.data, col, val))
    return ck.DeviceCSR(nip, col, val, mat.shape)


def interleave(cp, ck, mat, lanes):
    """``mat`` with each row's 16-byte part interleaved by lane for ``lanes`` lanes per row."""
    fn = cp.RawModule(code=INTERLEAVE).get_function("interleave")
    col, val = cp.empty_like(mat.indices), cp.empty_like(mat.data)
    nnz = int(mat.nnz)
    fn(((nnz + 255) // 256,), (256,), (mat.indptr, np.int64(mat.shape[0]), mat.indices, mat.data, col, val,
                                       np.int64(nnz), np.int32(lanes)))
    return ck.DeviceCSR(mat.indptr, col, val, mat.shape)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rays", type=int, default=81)
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layouts", default="full,compact,interleaved", help="comma-separated layouts to time")
    ap.add_argument("--shapes", default="",
                    help="launch shapes to time besides the tuner's, ';'-separated RowShape fields "
                         "(threads, sync, waves, stream, min_blocks, unroll), e.g. '(512,False,0,False,1,4)'")
    args = ap.parse_args(argv)

    import cupy as cp

    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.backends import _cuda_plan as plan
    from mlemlib.bench import copy_bandwidth, time_gpu_interleaved

    host, _ = dk.trace(args.rays)
    a = ck.DeviceCSR.from_host(host)
    del host
    m, n = a.shape
    at = a.transpose()
    rows = cp.flatnonzero(cp.diff(a.indptr)).astype(cp.int32)
    cols = cp.flatnonzero(cp.diff(at.indptr)).astype(cp.int32)
    at_c = renumber_columns(cp, ck, at, rows)
    a_c = renumber_columns(cp, ck, a, cols) if cols.size < n else None
    rng = np.random.default_rng(5)
    c = cp.asarray(rng.uniform(0.5, 1.5, m).astype(np.float32))
    c[cp.diff(a.indptr) == 0] = 0.0
    c_c = cp.ascontiguousarray(c[rows])
    f = cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
    f_c = cp.ascontiguousarray(f[cols]) if cols.size < n else None
    bp_ref = cp.asarray(at.cusparse() @ c, dtype=cp.float64)
    fp_ref = cp.asarray(a.cusparse() @ f, dtype=cp.float64)
    lanes_t = ck.transpose_lanes(at)
    lanes_a = a.lanes()
    at_i = interleave(cp, ck, at, lanes_t)
    at_h = hperm = None
    if "hilbert-rows" in args.layouts.split(","):  # A^T's rows (voxels) along the 3-D Hilbert curve, interleaved
        from mlemlib.reorder import voxel_permutation
        from mlemlib.scanner import get_preset

        hperm = cp.asarray(voxel_permutation(tuple(get_preset("madpet2").grid)))
        at_h = interleave(cp, ck, permute_rows(cp, ck, at, hperm), lanes_t)
    a_i = interleave(cp, ck, a, lanes_a)
    bp_out, fp_out = cp.empty(n, cp.float32), cp.empty(m, cp.float32)
    res = {"copy": copy_bandwidth(), "shape": [m, n], "nnz": int(a.nnz), "nonempty_rows": int(rows.size),
           "nonempty_cols": int(cols.size), "lanes": {"at": lanes_t, "a": lanes_a}, "ops": {}}
    print(f"madpet2 {m} x {n}, {a.nnz} nnz; non-empty rows {rows.size}, columns {cols.size}; "
          f"lanes A^T {lanes_t}, A {lanes_a}; copy {res['copy']}", flush=True)

    extra = [plan.RowShape(*ast.literal_eval(t)) for t in args.shapes.split(";") if t.strip()]
    layouts = args.layouts.split(",")

    def variants(name, mat, vec, out, lanes):
        got = {}
        if name not in layouts or mat is None:
            return got
        for sh in (*plan.SHAPE_CANDIDATES, *extra):
            if not (sh.is_default or lanes in plan.BLOCK_LANES):
                continue
            got[f"{name} {sh.label()}"] = (lambda sh=sh: ck.spmv(mat, vec, out, lanes=lanes, shape=sh))
        return got

    ops = {
        "bp_at": ({**variants("full", at, c, bp_out, lanes_t), **variants("compact", at_c, c_c, bp_out, lanes_t),
                   **variants("interleaved", at_i, c, bp_out, lanes_t),
                   **variants("hilbert-rows", at_h, c, bp_out, lanes_t), "cusparse": lambda: at.cusparse() @ c},
                  bp_ref),
        "fp": ({**variants("full", a, f, fp_out, lanes_a), **variants("compact", a_c, f_c, fp_out, lanes_a),
                **variants("interleaved", a_i, f, fp_out, lanes_a), "cusparse": lambda: a.cusparse() @ f}, fp_ref),
    }
    for op, (fns, ref) in ops.items():
        names = list(fns)
        errs = {}
        for name in names:
            y = cp.asarray(fns[name](), dtype=cp.float64)
            want = ref[hperm] if name.startswith("hilbert-rows") else ref  # its rows in the Hilbert order
            errs[name] = float(cp.linalg.norm(y - want) / cp.linalg.norm(want))
        rounds = []
        for rnd in range(2):  # the order reversed in the second round
            order = names if rnd == 0 else names[::-1]
            times = time_gpu_interleaved([fns[k] for k in order], repeat=args.repeat)
            rounds.append({k: float(np.median(t)) * 1e3 for k, t in zip(order, times)})
        res["ops"][op] = {k: {"ms": [r[k] for r in rounds], "rel_l2": errs[k]} for k in names}
        for k in names:
            print(f"{op:6s} {k:48s} {rounds[0][k]:.4f} / {rounds[1][k]:.4f} ms  rel L2 {errs[k]:.1e}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
