"""The back projection on A^T with its rows (voxels) taken along the 3-D Hilbert curve, and the row list's cost.

Usage (repository root on the device; a matrix file with a grid, e.g. ``python3 -m mlemlib generate --preset
madpet2 -o /tmp/m2.h5``)::

    PYTHONPATH=. python3 tools/row_order_probe.py /tmp/m2.h5 --out $OUT/row_order.json \
        [--old-source old_spmv.cu] [--repeat 100]

``A`` and ``A^T`` (transposed on the GPU) in the interleaved layout a backend gives them, each tuned as a backend
tunes it. Times (CUDA events, medians of ``repeat``; every variant of an operation in turn, two rounds, the
second in reverse order):

- the fused back projection with the update (``MODE_UPDATE``) on A^T: rows in order, and along the Hilbert
  curve (:func:`mlemlib.reorder.transpose_row_order`, ``DeviceCSR.set_row_order``) under every launch shape;
  the plain back projection (``bp plain``) in order at the tuned shape;
- with ``--old-source`` (another ``spmv.cu`` with the same kernel arguments, whose row list came with a
  compacted row pointer, as before commit 4693137): the fused forward over the non-empty rows
  (``skip_empty``), the fused and the plain back projection in order with that build.

Every output is compared bit for bit with the library's in-order one, and the back projection with a float64
product (cuSPARSE on float64 values).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("matrix")
    ap.add_argument("--out", required=True)
    ap.add_argument("--old-source", help="an older spmv.cu whose csr_vector read a compacted row pointer")
    ap.add_argument("--old-in-place", action="store_true",
                    help="the --old-source build reads its row list in place too (a variant of the current kernel)")
    ap.add_argument("--repeat", type=int, default=100)
    args = ap.parse_args()

    import cupy as cp

    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.backends import _cuda_plan as plan
    from mlemlib.bench import copy_bandwidth, time_gpu_interleaved
    from mlemlib.formats import open_source
    from mlemlib.reorder import transpose_row_order

    with open_source(args.matrix, "matrix") as src:
        order = transpose_row_order(src)
        a = ck.load_device(src)
    if order is None:
        raise SystemExit(f"{args.matrix}: no grid, or its voxels already follow the curve: nothing to compare")
    at = a.transpose()
    m, n = a.shape
    la, lt = a.lanes(), ck.transpose_lanes(at)
    ck.set_row_layouts(a, at, "csr_vector", "csr_vector", la, lt, True)
    at_h = ck.DeviceCSR(at.indptr, at.indices, at.data, at.shape, layout=at.layout)
    at_h.set_row_order(order)
    shape_a, shape_t, shape_h = a.tune(la), at.tune(lt), at_h.tune(lt)
    f, norm, g, c = probe_vectors(cp, a)
    res = {"copy": copy_bandwidth(), "shape": [m, n], "nnz": a.nnz, "lanes": {"a": la, "at": lt},
           "tuned": {"fp": shape_a.label(), "bp": shape_t.label(), "bp_hilbert": shape_h.label()}, "ops": {}}
    print(f"{args.matrix}: {m} x {n}, {a.nnz} nnz; lanes {la} / {lt}; tuned fp {shape_a.label()}, bp in order "
          f"{shape_t.label()}, bp along the curve {shape_h.label()}; copy {res['copy']}", flush=True)

    bp_out = {}

    def bp(mat, shape, key):
        out = bp_out.setdefault(key, cp.empty(n, cp.float32))
        return lambda: ck.spmv(mat, c, out, lanes=lt, mode=ck.MODE_UPDATE, aux0=f, aux1=norm, shape=shape)

    fp_lib = ck.spmv_launch(a, f, cp.zeros(m, cp.float32), lanes=la, mode=ck.MODE_CORR, aux0=g, shape=shape_a,
                            skip_empty=True)
    out_pl = cp.empty(n, cp.float32)
    ops = {"bp": {}, "fp": {"library, rows read in place": fp_lib},
           "bp plain": {"library": lambda: ck.spmv(at, c, out_pl, lanes=lt, shape=shape_t)}}
    for sh in plan.SHAPE_CANDIDATES:
        ops["bp"][f"in order {sh.label()}"] = bp(at, sh, f"o{sh.label()}")
        ops["bp"][f"Hilbert {sh.label()}"] = bp(at_h, sh, f"h{sh.label()}")
    if args.old_source:
        old = _old_kernels(cp, ck, plan, Path(args.old_source).read_text())
        rows = a.compact_rows()
        ptr = cp.concatenate([a.indptr[rows], a.indptr[-1:]]) if rows is not None and not args.old_in_place \
            else a.indptr
        nul = np.uint64(0) if rows is None else rows
        out_old = cp.zeros(m, cp.float32)
        ops["fp"]["old build, compacted row pointer"] = old(ptr, a, f, out_old, ck.MODE_CORR, g, g, nul, la, shape_a)
        out_bo = cp.empty(n, cp.float32)
        ops["bp"][f"old build, in order {shape_t.label()}"] = old(at.indptr, at, c, out_bo, ck.MODE_UPDATE, f, norm,
                                                                  np.uint64(0), lt, shape_t)
        out_po = cp.empty(n, cp.float32)
        ops["bp plain"]["old build"] = old(at.indptr, at, c, out_po, ck.MODE_PLAIN, out_po, out_po, np.uint64(0), lt,
                                           shape_t)
    ref_bp = ops["bp"][f"in order {shape_t.label()}"]().copy()
    ref_fp = ops["fp"]["library, rows read in place"]().copy()
    ref_plain = ops["bp plain"]["library"]().copy()
    at64 = at.cusparse().astype(cp.float64)  # cusparse() puts the columns back in order first
    bp64 = (at64 @ c.astype(cp.float64)) * f.astype(cp.float64) / norm.astype(cp.float64)
    del at64
    at.drop_cusparse()
    at.set_layout(lt)  # as timed (at_h shares the arrays)
    res["bp_rel_l2_to_float64"] = float(cp.linalg.norm(ref_bp - bp64) / cp.linalg.norm(bp64))
    for op, fns in ops.items():
        names = list(fns)
        ref = {"bp": ref_bp, "fp": ref_fp, "bp plain": ref_plain}[op]
        same = {k: bool(cp.array_equal(fns[k](), ref)) for k in names}
        rounds = [time_gpu_interleaved([fns[k] for k in names], repeat=args.repeat),
                  time_gpu_interleaved([fns[k] for k in names[::-1]], repeat=args.repeat)[::-1]]
        res["ops"][op] = {k: {"ms": [float(np.median(r[i])) * 1e3 for r in rounds],
                              "median_ms": float(np.median(np.concatenate([r[i] for r in rounds]))) * 1e3,
                              "same_bits": same[k]} for i, k in enumerate(names)}
        for k, v in sorted(res["ops"][op].items(), key=lambda kv: kv[1]["median_ms"]):
            print(f"{op} {k:40s} {v['median_ms']:.4f} ms (rounds {v['ms'][0]:.4f} / {v['ms'][1]:.4f}) "
                  f"same bits {v['same_bits']}", flush=True)
    print(f"bp in order against float64: rel L2 {res['bp_rel_l2_to_float64']:.2e}")
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


def probe_vectors(cp, a):
    """An image ``f``, a norm, a measurement ``g`` and a correlation ``c`` (0 at A's empty rows) for A, seed 5."""
    m, n = a.shape
    rng = np.random.default_rng(5)
    f = cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
    norm = cp.asarray(rng.uniform(0.5, 2.0, n).astype(np.float32))
    g = cp.asarray(rng.poisson(3.0, m).astype(np.float32))
    c = cp.asarray(rng.uniform(0.5, 1.5, m).astype(np.float32))
    c[cp.diff(a.indptr) == 0] = 0.0
    return f, norm, g, c


def _old_kernels(cp, ck, plan, text):
    """A launcher of an older spmv.cu's csr_vector / csr_block (same arguments, row pointer given as is)."""
    kernels = Path(ck.__file__).resolve().parents[1] / "kernels"
    text = ck._LOCAL_INCLUDE.sub(lambda mo: (kernels / mo.group(1)).read_text(), text)  # as ck.kernel_source
    mods = {}
    props = ck.device_properties(cp.cuda.Device().id)

    def launcher(ptr, mat, x, out, mode, aux0, aux1, rows, lanes, shape):
        opts = ("--std=c++17", *ck.SPMV_OPTIONS, *shape.options())
        mod = mods.get(opts)
        if mod is None:
            mod = mods[opts] = cp.RawModule(code=text, options=opts)
        mr = int(ptr.size - 1) if isinstance(rows, np.uint64) else int(rows.size)
        args = (ptr, mat.indices, mat.data, x, out, np.int64(mr), np.int32(mode), aux0, aux1)
        if shape.is_default:
            blocks, threads = plan.launch_shape(mr, plan.THREADS // lanes, props["sm_count"],
                                                props["max_threads_per_sm"])
            fn, args = mod.get_function(f"csr_vector_{lanes}"), (*args, rows)
        else:
            blocks, threads = plan.launch_shape(mr, shape.threads // lanes, props["sm_count"],
                                                props["max_threads_per_sm"], threads=shape.threads, waves=shape.waves)
            fn, args = mod.get_function(f"csr_block_{lanes}"), (*args, np.int32(bool(shape.sync)), rows)

        def call():
            fn((blocks,), (threads,), args)
            return out
        return call
    return launcher


if __name__ == "__main__":
    sys.exit(main())
