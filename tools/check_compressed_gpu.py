#!/usr/bin/env python3
"""GPU check of the compressed-matrix and one-pass kernels (``mlemlib/kernels/compressed.cu``).

Run from the repository root on a machine with a GPU (CuPy, Numba, SciPy, h5py)::

    PYTHONPATH=. python3 tools/check_compressed_gpu.py                 # small preset + a madpet2 row sample
    PYTHONPATH=. python3 tools/check_compressed_gpu.py --matrix results/small/matrix.h5 --repeat 50
    PYTHONPATH=. python3 tools/check_compressed_gpu.py --rows 200000 --all-lanes --json $OUT/compressed.json

For each matrix it encodes ``A`` and ``A^T`` (``compressed`` and
``compressed-f16``) on the host, uploads them with the CSR arrays, runs every
kernel of compressed.cu, compares each result with the Numba reference of the
same format (:mod:`mlemlib.backends._compressed_cpu`) and reports the largest
relative error over the non-zero reference entries (and whether the
reference's zeros stayed zero), whether two runs of a deterministic kernel
are bit-identical, and the median time of one call (``--repeat`` batches of 10 calls between CUDA events)
with the effective bandwidth (bytes of the matrix format + vectors / time),
next to cupyx.scipy.sparse's CSR SpMV (cuSPARSE) on the same matrix. Prints a
table; ``--json`` also writes the rows. Exits 1 if a check fails (relative
error above ``--tol``, a deterministic kernel that is not, or an exception).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlemlib.backends import _compressed_cpu as ref  # noqa: E402
from mlemlib.backends import _compressed_cuda as gpu  # noqa: E402
from mlemlib.compressed import CompressedMatrix  # noqa: E402
from mlemlib.matrix import CSRMatrix  # noqa: E402

ROWS: list[dict] = []
FAILURES: list[str] = []


# --------------------------------------------------------------------------- matrices
def load_matrices(args) -> list[tuple[str, CSRMatrix]]:
    """The matrices to check: ``--matrix`` files, else the small preset and a madpet2 row sample."""
    out = []
    if args.matrix:
        from mlemlib.formats import read_matrix

        for p in args.matrix:
            t0 = time.perf_counter()
            out.append((Path(p).name, read_matrix(p)))
            print(f"read {p} in {time.perf_counter() - t0:.1f} s", flush=True)
        return out
    from mlemlib.scanner.presets import get_preset
    from mlemlib.scanner.system import trace_rows

    t0 = time.perf_counter()
    small = get_preset("small")
    out.append(("small", trace_rows(small, np.arange(small.n_lors))))
    print(f"traced small ({small.n_lors} rows) in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.rows:
        t0 = time.perf_counter()
        mad = get_preset("madpet2")
        stride = max(1, mad.n_lors // args.rows)
        rows = np.arange(0, mad.n_lors, stride)[: args.rows]
        out.append((f"madpet2-{len(rows)}rows", trace_rows(mad, rows)))
        print(f"traced {len(rows)} madpet2 rows (stride {stride}) in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def transpose(a: CSRMatrix) -> CSRMatrix:
    t = a.to_scipy().T.tocsr()
    t.sort_indices()
    return CSRMatrix.from_scipy(t)


# --------------------------------------------------------------------------- measures
def rel_error(got, want) -> tuple[float, bool]:
    """Largest |got - want| / want over want > 0, and whether got is 0 wherever want is."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    pos = want > 0
    err = float(np.max(np.abs(got[pos] - want[pos]) / want[pos])) if pos.any() else 0.0
    zeros_ok = bool(np.all(got[~pos] == 0))
    return err, zeros_ok


def timed(fn, repeat: int, warmup: int = 3, batch: int = 10) -> float:
    """Median milliseconds of one ``fn()``: ``repeat`` batches of ``batch`` calls between two CUDA events."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeat):
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / batch)
    return float(np.median(times))


def record(matrix, op, kernel, fmt, lanes, det, ms, nbytes, err=None, zeros_ok=None, repeat_equal=None, tol=None):
    row = {
        "matrix": matrix,
        "op": op,
        "kernel": kernel,
        "format": fmt,
        "lanes": lanes,
        "deterministic": det,
        "ms": ms,
        "GB/s": (nbytes / (ms * 1e-3) / 1e9) if ms else None,
        "max_rel_err": err,
        "zeros_ok": zeros_ok,
        "bitwise_repeat": repeat_equal,
    }
    ROWS.append(row)
    bad = []
    if err is not None and tol is not None and not err <= tol:
        bad.append(f"rel err {err:.3g} > {tol:.3g}")
    if zeros_ok is False:
        bad.append("non-zero where the reference is 0")
    if det and repeat_equal is False:
        bad.append("two runs differ")
    if bad:
        FAILURES.append(f"{matrix} {op} {kernel} L={lanes}: " + "; ".join(bad))
    row["ok"] = not bad
    return row


def print_table() -> None:
    cols = ["matrix", "op", "kernel", "format", "lanes", "det", "ms", "GB/s", "max rel err", "repeat", "ok"]
    lines = []
    for r in ROWS:
        lines.append(
            [
                r["matrix"],
                r["op"],
                r["kernel"],
                r["format"],
                str(r["lanes"] or ""),
                "yes" if r["deterministic"] else "no",
                f"{r['ms']:.4f}" if r["ms"] is not None else "",
                f"{r['GB/s']:.0f}" if r["GB/s"] is not None else "",
                f"{r['max_rel_err']:.2e}" if r["max_rel_err"] is not None else "",
                {True: "equal", False: "DIFFER", None: ""}[r["bitwise_repeat"]],
                "ok" if r["ok"] else "FAIL",
            ]
        )
    widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c) for i, c in enumerate(cols)]
    print()
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for line in lines:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths)))


# --------------------------------------------------------------------------- the checks
def check_matrix(name: str, a: CSRMatrix, args) -> None:
    import cupy as cp
    import cupyx.scipy.sparse as cps

    m, n = a.shape
    rng = np.random.default_rng(1)
    f_h = (rng.random(n) + 0.5).astype(np.float32)
    f_h[rng.random(n) < 0.05] = 0  # some zero voxels: exercises fp == 0 rows and the bound's blind spot
    y_true = np.zeros(m, dtype=np.float32)
    ref.csr_onepass(a.indptr, a.indices, a.data, np.zeros(m, np.float32), f_h, fp=y_true)
    g_h = rng.poisson(np.maximum(y_true, 0) * 10).astype(np.float32)
    c_h = np.zeros(m, dtype=np.float32)
    np.divide(g_h, y_true, out=c_h, where=y_true != 0)
    at = transpose(a)
    print(f"\n{name}: {m} x {n}, nnz {a.nnz}, {a.nnz / max(m, 1):.1f} per row", flush=True)

    enc = {fmt: CompressedMatrix.from_csr(a, fmt) for fmt in ("compressed", "compressed-f16")}
    enc_t = {fmt: CompressedMatrix.from_csr(at, fmt) for fmt in ("compressed", "compressed-f16")}
    for fmt, e in enc.items():
        print(f"  {fmt}: {e.bytes_per_nnz:.3f} B/nnz (A), {enc_t[fmt].bytes_per_nnz:.3f} (A^T); slots {e.slots}")
    csr_bytes = 8 * a.nnz + 8 * (m + 1)

    f, g, c = cp.asarray(f_h), cp.asarray(g_h), cp.asarray(c_h)
    d_csr = gpu.upload_csr(a)
    d_enc = {k: gpu.DeviceCompressed.from_host(v) for k, v in enc.items()}
    d_enc_t = {k: gpu.DeviceCompressed.from_host(v) for k, v in enc_t.items()}
    R = args.repeat
    tol = args.tol

    # cuSPARSE baselines
    if a.nnz < 2**31:
        sa = cps.csr_matrix((d_csr.data, d_csr.indices, d_csr.indptr.astype(cp.int32)), shape=(m, n))
        ms = timed(lambda: sa @ f, R)
        ye = rel_error((sa @ f).get(), ref.spmv(enc["compressed"], f_h))
        record(name, "fp", "cusparse", "csr", None, False, ms, csr_bytes + 4 * (m + n), *ye, tol=tol)
        dt = gpu.upload_csr(at)
        st = cps.csr_matrix((dt.data, dt.indices, dt.indptr.astype(cp.int32)), shape=(n, m))
        ms = timed(lambda: st @ c, R)
        be = rel_error((st @ c).get(), ref.spmv(enc_t["compressed"], c_h))
        record(name, "bp(A^T)", "cusparse", "csr", None, False, ms, 8 * a.nnz + 8 * (n + 1) + 4 * (m + n), *be, tol=tol)
        del sa, st, dt

    lane_list = gpu.LANE_CHOICES if args.all_lanes else (None,)
    for fmt in ("compressed", "compressed-f16"):
        da, dat = d_enc[fmt], d_enc_t[fmt]
        want_fp = ref.spmv(enc[fmt], f_h)
        want_bp_t = ref.spmv(enc_t[fmt], c_h)
        want_bp = ref.spmv_t(enc[fmt], c_h)
        want_op_bp, want_op_fp = ref.onepass(enc[fmt], g_h, f_h)
        for lanes in lane_list:
            L = lanes or da.lanes()
            y = cp.empty(m, dtype=cp.float32)
            gpu.spmv(da, f, y, lanes=L)
            y1 = y.get()
            gpu.spmv(da, f, y, lanes=L)
            ms = timed(lambda: gpu.spmv(da, f, y, lanes=L), R)
            record(name, "fp", f"{da.kind}_spmv", fmt, L, True, ms, da.nbytes + 4 * (m + n),
                   *rel_error(y1, want_fp), bool(np.array_equal(y1, y.get())), tol=tol)
            # fused epilogue: c = g / (A f)
            gpu.spmv(da, f, y, lanes=L, mode=gpu.MODE_CORR, aux0=g)
            cw = np.zeros(m, np.float32)
            np.divide(g_h, want_fp, out=cw, where=want_fp != 0)
            record(name, "fp+corr", f"{da.kind}_spmv", fmt, L, True, None, 0, *rel_error(y.get(), cw), tol=tol)

            Lt = lanes or dat.lanes()
            b = cp.empty(n, dtype=cp.float32)
            gpu.spmv(dat, c, b, lanes=Lt)
            b1 = b.get()
            ms = timed(lambda: gpu.spmv(dat, c, b, lanes=Lt), R)
            record(name, "bp(A^T)", f"{dat.kind}_spmv", fmt, Lt, True, ms, dat.nbytes + 4 * (m + n),
                   *rel_error(b1, want_bp_t), tol=tol)

            for det in (False, True):
                out = gpu.scatter(da, c, lanes=L, deterministic=det).get()
                again = gpu.scatter(da, c, lanes=L, deterministic=det).get()
                if det:
                    st: dict = {}
                    gpu.scatter(da, c, lanes=L, deterministic=True, stats=st)
                    acc = cp.zeros(n, dtype=cp.uint64)
                    flag = cp.zeros(1, dtype=cp.int32)
                    fn = gpu.function(f"cscatter_det_{da.kind}_{L}")

                    def run_scatter(acc=acc, flag=flag, fn=fn, st=st):
                        acc.fill(0)
                        groups, order = gpu.spread(m, 0)  # as the library's fixed point
                        gpu._launch_rows(fn, groups, L, (*da.kernel_args(), c, acc, np.float64(st["scale"]), flag,
                                                         np.int64(m), *order))
                        gpu.fixed_to_float(acc, b, st["scale"])

                    ms = timed(run_scatter, R)
                else:
                    ms = timed(lambda: gpu.scatter(da, c, b, lanes=L), R)
                record(name, "bp(scatter)", f"scatter{'_det' if det else ''}_{da.kind}", fmt, L, det, ms,
                       da.nbytes + 4 * (m + 2 * n), *rel_error(out, want_bp), bool(np.array_equal(out, again)), tol=tol)

            for det in (False, True):
                bp1, fp1 = (v.get() for v in gpu.onepass(da, g, f, lanes=L, deterministic=det))
                bp2, _ = (v.get() for v in gpu.onepass(da, g, f, lanes=L, deterministic=det))
                ms = _time_onepass(da, g, f, L, det, R)
                record(name, "onepass", f"onepass{'_det' if det else ''}_{da.kind}", fmt, L, det, ms,
                       da.nbytes + 4 * (2 * m + 2 * n), *rel_error(bp1, want_op_bp), bool(np.array_equal(bp1, bp2)),
                       tol=tol)
                record(name, "onepass.fp", f"onepass{'_det' if det else ''}_{da.kind}", fmt, L, det, None, 0,
                       *rel_error(fp1, want_op_fp), tol=tol)

    # one-pass on CSR
    want_bp, want_fp = ref.csr_onepass(a.indptr, a.indices, a.data, g_h, f_h)
    for lanes in lane_list:
        L = lanes or gpu.choose_lanes(a.nnz / max(m, 1))
        for det in (False, True):
            bp1, fp1 = (v.get() for v in gpu.onepass(d_csr, g, f, lanes=L, deterministic=det))
            bp2, _ = (v.get() for v in gpu.onepass(d_csr, g, f, lanes=L, deterministic=det))
            ms = _time_onepass(d_csr, g, f, L, det, R)
            record(name, "onepass", f"onepass{'_det' if det else ''}_csr", "csr", L, det, ms,
                   csr_bytes + 4 * (2 * m + 2 * n), *rel_error(bp1, want_bp), bool(np.array_equal(bp1, bp2)), tol=tol)
            record(name, "onepass.fp", f"onepass{'_det' if det else ''}_csr", "csr", L, det, None, 0,
                   *rel_error(fp1, want_fp), tol=tol)


def _time_onepass(a, g, f, L, det, repeat) -> float:
    import cupy as cp

    m, n = a.shape
    bp = cp.empty(n, dtype=cp.float32)
    fp = cp.empty(m, dtype=cp.float32)
    if not det:
        return timed(lambda: gpu.onepass(a, g, f, bp=bp, fp=fp, lanes=L), repeat)
    st: dict = {}
    gpu.onepass(a, g, f, bp=bp, fp=fp, lanes=L, deterministic=True, stats=st)
    acc = cp.zeros(n, dtype=cp.uint64)
    flag = cp.zeros(1, dtype=cp.int32)

    def run():  # what an iteration with a known bound does: no host read
        acc.fill(0)
        gpu.onepass_fixed(a, g, f, acc, fp, st["scale"], flag, lanes=L)
        gpu.fixed_to_float(acc, bp, st["scale"])

    return timed(run, repeat)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--matrix", nargs="*", help="matrix files to check (any format mlem reads); default: synthetic")
    p.add_argument("--rows", type=int, default=60000, help="rows of the madpet2 sample (0: none)")
    p.add_argument("--repeat", type=int, default=20, help="timed runs per kernel (median)")
    p.add_argument("--all-lanes", action="store_true", help="every lane count, not only the default")
    p.add_argument("--tol", type=float, default=1e-4, help="largest relative error accepted")
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args()

    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"device: {name}, CuPy {cp.__version__}", flush=True)
    t0 = time.perf_counter()
    gpu.function("fixed_to_float")  # compile once, timed
    print(f"compiled compressed.cu in {time.perf_counter() - t0:.1f} s", flush=True)
    for mname, a in load_matrices(args):
        try:
            check_matrix(mname, a, args)
        except Exception:  # noqa: BLE001 - report and go on with the next matrix
            traceback.print_exc()
            FAILURES.append(f"{mname}: exception (see above)")
    print_table()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "rows": ROWS, "failures": FAILURES}, indent=1))
    if FAILURES:
        print("\nFAILED:\n  " + "\n  ".join(FAILURES))
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
