#!/usr/bin/env python3
"""The CSR pair (``csr_vector`` forward and back on ``A^T``) under compile-time variants of spmv.cu (one GPU).

Run from the repository root on a GPU machine::

    PYTHONPATH=. python3 tools/device_spmv_options.py --out $OUT --options "VEC_UNROLL=1;VEC_UNROLL=2;VEC_UNROLL=4"

``--options``: ``;``-separated variants, each a ``,``-separated list of
``MLEM_`` macros without the prefix (``''``: the defaults), and
``SKIP_EMPTY=0|1`` (``mlemlib.backends.cuda.SKIP_EMPTY_ROWS``: the fused
forward over the non-empty rows only; default 1). For each LOR
order of ``--orders`` (see ``tools/device_kernels.py``: ``own``,
``shuffled``, ``own-reordered``) it traces ``madpet2``, builds ``A`` and
``A^T`` on the GPU and times, with CUDA events (median of ``--repeat``):
cuSPARSE's forward and back on ``A^T`` once, then per variant the
``csr_vector`` forward and back kernels alone under their tuned launch shapes
(plain, and with the MLEM iteration's fused epilogues: the correlation after
the forward, the update after the back projection) and whole MLEM iterations of the ``auto`` pair (tuned), each against the
copy bandwidth of the same run. Every variant's forward and back projection
is checked against a float64 product first and bit for bit against the first
variant's (a macro that only changes the schedule must not change the sums).
Writes ``spmv_options.json`` and ``spmv_options.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import device_kernels as dk  # noqa: E402  (trace, build)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--rays", type=int, default=81)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--orders", default="own")
    ap.add_argument("--options", type=lambda t: t.split(";"), default=[""])
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import cupy as cp

    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.backends import _cuda_plan as plan
    from mlemlib.backends import cuda as cuda_mod
    from mlemlib.backends.cuda import CudaBackend
    from mlemlib.bench import copy_bandwidth, time_gpu
    from mlemlib.devices import device_facts

    facts = device_facts(0)
    bw = copy_bandwidth()["bandwidth"]
    dk.log(f"{facts.get('name')}: copy bandwidth {bw / 1e12:.3f} TB/s")
    results = {"device": facts, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
               "copy_bandwidth": bw, "rows": []}
    host, _ = dk.trace(args.rays)
    md = ["| order | variant | what | ms | of copy bandwidth | rel. L2 | same sums as the first variant |",
          "|---|---|---|---|---|---|---|"]

    def row(order, variant, what, ms, nbytes, err=None, same=None):
        r = {"order": order, "variant": variant, "what": what, "ms": ms, "of_copy": nbytes / (ms * 1e-3) / bw,
             "rel_l2": err, "same_sums": same}
        results["rows"].append(r)
        md.append(f"| {order} | {variant or 'defaults'} | {what} | {ms:.3f} | {100 * r['of_copy']:.1f}% | "
                  f"{'' if err is None else f'{err:.1e}'} | {'' if same is None else ('yes' if same else 'NO')} |")
        dk.log(f"{order:10s} {variant or 'defaults':22s} {what:40s} {ms:7.3f} ms {100 * r['of_copy']:5.1f}%"
               + ("" if err is None else f"  err {err:.1e}") + ("" if same is None else f"  same {same}"))

    for order in args.orders.split(","):
        a, at = dk.build(host, order)
        m, n = a.shape
        rng = np.random.default_rng(1)
        f = cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
        c = cp.asarray(rng.uniform(0.5, 1.5, m).astype(np.float32))
        a64 = a.cusparse().astype(cp.float64)
        ref_fp, ref_bp = a64 @ f.astype(cp.float64), a64.T @ c.astype(cp.float64)
        g = (a.cusparse() @ cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))).get()
        del a64
        a.drop_cusparse()
        norm = (at.cusparse() @ cp.ones(m, dtype=cp.float32)).get().astype(np.float64)
        # the fused epilogues' operands and float64 references (f_upd is not updated in place: out is y)
        g_dev = cp.asarray(g, dtype=cp.float32)
        f_upd = cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
        nrm_dev = cp.asarray(norm, dtype=cp.float32)
        ref_corr = cp.where(ref_fp != 0, g_dev.astype(cp.float64) / cp.where(ref_fp != 0, ref_fp, 1.0), 0.0)
        nrm64 = nrm_dev.astype(cp.float64)
        ref_upd = f_upd.astype(cp.float64) * ref_bp / cp.where(nrm64 != 0, nrm64, 1.0)
        bytes_a, bytes_at = plan.csr_bytes(m, a.nnz), plan.csr_bytes(n, a.nnz)

        def err(y, ref):
            return float(cp.linalg.norm(y.astype(cp.float64) - ref) / cp.linalg.norm(ref))

        for what, mat, x, nb, ref in (("forward, cuSPARSE", a, f, bytes_a, ref_fp),
                                      ("back on A^T, cuSPARSE", at, c, bytes_at, ref_bp)):
            e = err(mat.cusparse() @ x, ref)
            t = time_gpu(lambda mat=mat, x=x: mat.cusparse() @ x, repeat=args.repeat, warmup=3)
            row(order, "", what, float(np.median(t)) * 1e3, nb, e)
            mat.drop_cusparse()
        # back projection without A^T: cuSPARSE's transposed product and the scatter
        y_nt = cp.empty(n, dtype=cp.float32)
        for what, kernel in (("back without A^T, cusparse_notrans", "cusparse_notrans"),
                             ("back without A^T, scatter", "scatter")):
            fn = (lambda kernel=kernel: ck.scatter(a, c, y_nt, kernel=kernel))
            e = err(fn(), ref_bp)
            t = time_gpu(fn, repeat=args.repeat, warmup=3)
            row(order, "", what, float(np.median(t)) * 1e3, bytes_a, e)
        a.drop_cusparse()
        cp.get_default_memory_pool().free_all_blocks()
        first: dict[str, object] = {}
        for variant in args.options:
            kvs = [kv for kv in variant.split(",") if kv]
            skip = [kv for kv in kvs if kv.startswith("SKIP_EMPTY=")]
            cuda_mod.SKIP_EMPTY_ROWS = bool(int(skip[-1].split("=")[1])) if skip else True
            ck.SPMV_OPTIONS = tuple(f"-DMLEM_{kv}" for kv in kvs if kv not in skip)
            a.row_shape = at.row_shape = None
            be = CudaBackend(a, g, norm, at, fp="csr_vector", bp="csr_vector", tune=True)
            y_fp = cp.zeros(m, dtype=cp.float32)  # zeros: what skip_empty leaves at the empty rows
            y_bp = cp.empty(n, dtype=cp.float32)
            cases = [("forward, csr_vector (tuned)", a, f, y_fp, bytes_a, ref_fp, {}),
                     ("back on A^T, csr_vector (tuned)", at, c, y_bp, bytes_at, ref_bp, {}),
                     ("forward with the correlation (mode 1)", a, f, y_fp, bytes_a, ref_corr,
                      {"mode": ck.MODE_CORR, "aux0": g_dev, "skip_empty": cuda_mod.SKIP_EMPTY_ROWS}),
                     ("back with the update (mode 2)", at, c, y_bp, bytes_at, ref_upd,
                      {"mode": ck.MODE_UPDATE, "aux0": f_upd, "aux1": nrm_dev})]
            for what, mat, x, y, nb, ref, kw in cases:
                lanes = mat.lanes() if mat is a else ck.transpose_lanes(mat)
                fn = ck.spmv_launch(mat, x, y, lanes=lanes, shape=mat.row_shape, **kw)
                fn()
                same = None
                if what in first:
                    same = bool(cp.array_equal(y, first[what]))
                else:
                    first[what] = y.copy()
                e = err(y, ref)
                t = time_gpu(fn, repeat=args.repeat, warmup=3)
                row(order, variant, f"{what} {lanes} lanes {mat.row_shape.label() if mat.row_shape else ''}",
                    float(np.median(t)) * 1e3, nb, e, same)
            x = be.initial_image()
            steps = []
            for i in range(3 + args.repeat):
                x = be.iterate(x)
                if i >= 3:
                    steps.append(be.last_step_times())
            med = {k: float(np.median([s[k] for s in steps])) * 1e3 for k in steps[0]}
            key = "MLEM iteration image"
            same = None
            if key in first:
                same = bool(cp.array_equal(cp.asarray(x), first[key]))
            else:
                first[key] = cp.asarray(x).copy()
            floor = plan.iteration_floor_bytes(m, n, a.nnz, transpose=True)
            row(order, variant, f"MLEM iteration {be.fp_kernel}+{be.bp_kernel} "
                f"(fp {med.get('fp', 0):.3f}, bp {med.get('bp', 0):.3f})", med["iteration"], floor, None, same)
            # the same iterations queued back to back (no synchronisation between them): the GPU's own time
            ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
            piped = []
            for _ in range(5):
                ev0.record()
                for _ in range(args.repeat):
                    x = be.iterate(x)
                ev1.record()
                ev1.synchronize()
                piped.append(cp.cuda.get_elapsed_time(ev0, ev1) / args.repeat)
            row(order, variant, f"MLEM iterations queued back to back ({args.repeat} per timing, median of 5)",
                float(np.median(piped)), floor)
            del be
            cp.get_default_memory_pool().free_all_blocks()
        ck.SPMV_OPTIONS = ()
        del a, at
        cp.get_default_memory_pool().free_all_blocks()
    (out / "spmv_options.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "spmv_options.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
