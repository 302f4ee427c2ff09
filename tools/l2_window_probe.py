"""The row kernels and the atomic scatter with their gathered or atomic vector in a persisting L2 window.

Issue 13 (madpet2 in its own order): the atomic scatter (back projection
without A^T) ran 0.6% behind cuSPARSE's transposed product on the H100, and
the H200's iteration at 92-95% of its floor, where its gathers weigh more
(benchmarks.md section 82). The compressed one pass gained 1.5% from keeping
its atomic target in L2 (``_compressed_cuda.persist_in_l2``, section 81).
This probe times the same window for the CSR kernels, on madpet2 traced here
(81 rays, detector-pair order), medians of CUDA events:

- ``scatter``: the library's scatter and ``cusparse_notrans``, with the
  output ``out`` in a window or not; ``scatter (no fill)`` leaves out the
  zeroing kernel (the sum then grows; the time is the same work);
- ``fp`` / ``bp``: ``csr_vector`` as the ``cuda`` backend sets it up
  (interleaved layout, tuned shape), with the gathered ``f`` / ``c`` in a
  window or not;
- ``iteration``: the backend's fused iteration on a stream with a window over
  ``c`` only, or over ``f`` and ``c`` held in one buffer, or none.

Persisting lines stay after their kernel, so the conditions are not
interleaved call by call: each group runs in blocks, none / window / none /
window, every kernel of a block in turn (``time_gpu_interleaved``), and the
set-aside and its lines are dropped after each window block. Every result is
checked against a float64 product (relative L2).

Run from the repository root on the device:
``PYTHONPATH=. python3 tools/l2_window_probe.py --out $OUT/l2.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_kernels as dk  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rays", type=int, default=81)
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--blocks", type=int, default=4, help="blocks per group, alternating none / window")
    ap.add_argument("--groups", default="scatter,fp,bp,iteration")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    import cupy as cp

    from mlemlib.backends import _compressed_cuda as cc
    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.backends import _cuda_plan as plan
    from mlemlib.backends.base import timed_iterations
    from mlemlib.backends.cuda import CudaBackend
    from mlemlib.bench import copy_bandwidth, time_gpu_interleaved

    host, _ = dk.trace(args.rays)
    a, at = dk.build(host, "own")
    del host
    m, n = a.shape
    g, norm = dk.problem(a, at)
    rng = np.random.default_rng(5)
    c = cp.asarray(rng.uniform(0.5, 1.5, m).astype(np.float32))
    c[cp.diff(a.indptr) == 0] = 0.0  # as in an iteration: no correlation at an empty row
    f = cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
    a64 = a.cusparse().astype(cp.float64)
    ref_bp, ref_fp = a64.T @ c.astype(cp.float64), a64 @ f.astype(cp.float64)
    del a64
    a.drop_cusparse()
    res = {"copy": copy_bandwidth(), "shape": [m, n], "nnz": int(a.nnz), "groups": {}}
    print(f"madpet2 {m} x {n}, {a.nnz} nnz; copy {res['copy']}", flush=True)
    plain, win = cp.cuda.Stream(), cp.cuda.Stream()

    def rel(y, ref):
        y = cp.asarray(y, dtype=cp.float64)
        return float(cp.linalg.norm(y - ref) / cp.linalg.norm(ref))

    def blocks(group, fns, window_buf, checks=None):
        """Time ``fns`` (name -> callable) in blocks without and with ``window_buf`` in a window."""
        out = {k: {"none": [], "window": []} for k in fns}
        info = None
        for b in range(args.blocks):
            cond = "window" if b % 2 else "none"
            stream = win if cond == "window" else plain
            if cond == "window":
                info = cc.persist_in_l2(win, window_buf)
                if info is None:
                    raise SystemExit("this GPU gives no control of L2 persistence")
            with stream:
                names = list(fns) if b % 4 < 2 else list(fns)[::-1]
                times = time_gpu_interleaved([fns[k] for k in names], repeat=args.repeat)
                stream.synchronize()
            if cond == "window":
                cc.release_l2()
            for k, t in zip(names, times):
                out[k][cond].append(float(np.median(t)) * 1e3)
        res["groups"][group] = {"ms": out, "window": info, "rel_l2": checks or {}}
        for k, v in out.items():
            print(f"{group:9s} {k:28s} none {' / '.join(f'{x:.4f}' for x in v['none'])}   "
                  f"window {' / '.join(f'{x:.4f}' for x in v['window'])}", flush=True)

    groups = args.groups.split(",")
    if "scatter" in groups:
        y = cp.empty(n, cp.float32)
        checks = {"scatter": rel(ck.scatter(a, c, y), ref_bp),
                  "cusparse_notrans": rel(ck.scatter(a, c, y, kernel="cusparse_notrans"), ref_bp)}
        lanes = a.lanes()
        fn = ck._function("spmv", f"scatter_{lanes}")

        def no_fill():
            ck._launch_rows(fn, m, lanes, (a.indptr, a.indices, a.data, c, y, np.int64(m),
                                           np.int64(plan.spread_stride(m))), waves=0)

        blocks("scatter", {"scatter": lambda: ck.scatter(a, c, y),
                           "scatter (no fill)": no_fill,
                           "cusparse_notrans": lambda: ck.scatter(a, c, y, kernel="cusparse_notrans")}, y, checks)
        a.drop_cusparse()

    # the cuda backend's set-up: A and A^T interleaved for csr_vector, the launch shapes tuned
    be = CudaBackend(a, g, norm, at, fp="auto", bp="auto", device=0)
    print(f"backend: {be.describe()['fp']} + {be.describe()['bp']}, layout {be.describe().get('layout')}", flush=True)
    la, lt = be._lanes(be.a), be._lanes(be.at)
    yf, yb = cp.empty(m, cp.float32), cp.empty(n, cp.float32)
    if "fp" in groups:
        chk = {"csr_vector": rel(ck.spmv(be.a, f, yf, lanes=la), ref_fp)}
        blocks("fp", {"csr_vector": lambda: ck.spmv(be.a, f, yf, lanes=la)}, f, chk)
    if "bp" in groups:
        chk = {"csr_vector": rel(ck.spmv(be.at, c, yb, lanes=lt), ref_bp)}
        blocks("bp", {"csr_vector": lambda: ck.spmv(be.at, c, yb, lanes=lt)}, c, chk)
    if "iteration" in groups:
        buf = cp.zeros(n + m, cp.float32)  # f and c side by side: one window holds both
        f_img, be._c = buf[:n], buf[n:]
        f0 = be.initial_image()
        out = {}
        for b in range(args.blocks):
            variants = ["none", "window c", "window f+c"] if b % 2 == 0 else ["window f+c", "window c", "none"]
            for v in variants:
                be._stream = plain if v == "none" else win
                if v != "none":
                    be.l2_window = cc.persist_in_l2(win, be._c if v == "window c" else buf)
                f_img[...] = f0
                t = []
                for _, _, ready in timed_iterations(be, f_img, 1, 3 + args.repeat):
                    t += [times["iteration"] for k, times in ready if k > 3]
                be.synchronize()
                if v != "none":
                    cc.release_l2()
                out.setdefault(v, []).append(float(np.median(t)) * 1e3)
                print(f"iteration {v:12s} block {b}: {out[v][-1]:.4f} ms", flush=True)
        be._stream = None
        res["groups"]["iteration"] = {"ms": out, "image_sum": float(cp.sum(f_img, dtype=cp.float64))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
