#!/usr/bin/env python3
"""Every kernel of the registry on the ``madpet2`` matrix, in its own and in shuffled LOR order (one GPU).

Run from the repository root on a GPU machine::

    PYTHONPATH=. python3 tools/device_kernels.py --out $OUT [--rays 81] [--repeat 30] [--ncu] [--orders own,shuffled]

For each LOR order it builds ``A`` (traced on the host's CPUs, then on the
GPU) and ``A^T`` (cuSPARSE on the GPU), measures the device-to-device copy
bandwidth, and times with CUDA events (median of ``--repeat`` after warm-ups):

- every forward, back-on-``A^T`` and no-transpose kernel of the registry,
  cuSPARSE beside them, and ``csr_vector`` under each launch shape of
  :class:`mlemlib.backends._cuda_plan.RowShape` (block size, rows in step,
  grid cap);
- whole MLEM iterations of the main pairs, and the pair ``auto`` resolves to;
- optional kernels that other modules provide (compressed formats, one-pass
  iterations) when importable.

Every result is checked first against a float64 product on the GPU (relative
L2 error), launch shapes of ``csr_vector`` also bit for bit against the
default shape. Writes ``kernels.json`` and ``kernels.md`` under ``--out`` and
prints the Markdown. ``--ncu`` profiles the back projection's main shapes
with Nsight Compute (L1/L2 hit rates, DRAM and L2 throughput) into ``ncu.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Launch shapes of csr_vector to time: RowShape fields (threads, sync, waves, stream, min_blocks).
SHAPES = [(256, False, None), (512, False, 0), (1024, False, 0), (1024, True, 0), (512, False, 0, True),
          (1024, False, 0, True), (1024, True, 0, True), (1024, False, 0, False, 2), (1024, False, 0, True, 2),
          (1024, True, 0, True, 2)]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def trace(rays: int, save: Path | None = None):
    """The ``madpet2`` matrix traced on the host's CPUs (detector-pair order); optionally saved as .npy for ncu."""
    from mlemlib.scanner import get_preset
    from mlemlib.scanner.system import trace_rows

    cfg = get_preset("madpet2", rays=rays)
    t0 = time.perf_counter()
    host = trace_rows(cfg, np.arange(cfg.n_lors, dtype=np.int64))
    dt = time.perf_counter() - t0
    log(f"madpet2 rays={rays}: {host.shape} {host.nnz} nnz traced in {dt:.1f} s on {os.cpu_count()} CPUs")
    if save is not None:
        save.mkdir(parents=True, exist_ok=True)
        for k in ("indptr", "indices", "data"):
            np.save(save / f"{k}.npy", getattr(host, k))
        (save / "shape.json").write_text(json.dumps(list(host.shape)))
    return host, dt


def build(host, order: str, seed: int = 7):
    """``(A, A^T)`` on the GPU for one LOR order.

    ``own`` (detector pairs), ``shuffled`` (rows in a random permutation),
    and ``X-reordered``: order X passed through the reorder stage's
    permutation (``mlemlib.reorder.compute_permutation``, ``rows+voxels``),
    computed on the host from the matrix alone and applied on the GPU.
    """
    import cupy as cp

    from mlemlib.backends import _cuda_kernels as ck

    base, _, re_ = order.partition("-")
    a = ck.DeviceCSR.from_host(host)
    if base == "shuffled":
        perm = cp.asarray(np.random.default_rng(seed).permutation(a.shape[0]))
        a = _rows_cols(a, perm, None)
    if re_ == "reordered":
        from mlemlib.formats import InMemoryMatrix
        from mlemlib.reorder import compute_permutation
        from mlemlib.scanner import get_preset

        t0 = time.perf_counter()
        h = a.to_host() if base != "own" else host
        p = compute_permutation(InMemoryMatrix(h, grid=get_preset("madpet2").grid), "rows+voxels")
        del h
        t1 = time.perf_counter()
        a = _rows_cols(a, cp.asarray(p.rows), None if p.voxels is None else cp.asarray(p.voxels))
        log(f"{order}: permutation computed in {t1 - t0:.1f} s on the host, applied on the GPU in "
            f"{time.perf_counter() - t1:.1f} s")
    at = a.transpose()
    a.drop_cusparse()
    cp.get_default_memory_pool().free_all_blocks()
    return a, at


def problem(a, at, seed: int = 3):
    """A noise-free measurement ``g = A f`` of a random image (values in [0.5, 1.5)) and the norm ``A^T 1``
    (float64), on the host, computed on the GPU with cuSPARSE (its views dropped afterwards)."""
    import cupy as cp

    m, n = a.shape
    rng = np.random.default_rng(seed)
    f_true = cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
    g = (a.cusparse() @ f_true).get()
    a.drop_cusparse()
    norm = (at.cusparse() @ cp.ones(m, dtype=cp.float32)).get().astype(np.float64)
    at.drop_cusparse()
    return g, norm


def _rows_cols(a, rows, cols):
    """``A[rows][:, cols]`` (new row i = old row rows[i], new column j = old column cols[j]) as a DeviceCSR."""
    import cupy as cp

    from mlemlib.backends import _cuda_kernels as ck

    sp = a.cusparse()[rows]
    a.drop_cusparse()
    shape = a.shape
    del a
    if cols is not None:
        inv = cp.empty_like(cols)
        inv[cols] = cp.arange(cols.size, dtype=cols.dtype)
        sp.indices = inv[sp.indices].astype(cp.int32)
        sp.has_sorted_indices = False
        sp.sort_indices()
    out = ck.DeviceCSR(sp.indptr.astype(cp.int64), sp.indices, sp.data, shape)
    del sp
    cp.get_default_memory_pool().free_all_blocks()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--rays", type=int, default=81)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--orders", default="own,shuffled")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--compressed", action="store_true", help="also the compressed formats and one-pass iterations")
    ap.add_argument("--iterations", type=int, default=100, help="MLEM iterations of the format comparison")
    ap.add_argument("--lanes", type=lambda t: [int(v) for v in t.split(",")], default=[32],
                    help="lanes of the back projection's launch shapes")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import cupy as cp

    from mlemlib import registry
    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.backends import _cuda_plan as plan
    from mlemlib.backends.cuda import CudaBackend
    from mlemlib.bench import copy_bandwidth, time_gpu
    from mlemlib.devices import device_facts

    facts = device_facts(0)
    results = {"device": facts, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "orders": {}}
    bw = copy_bandwidth()["bandwidth"]
    results["copy_bandwidth"] = bw
    log(f"{facts.get('name')}: copy bandwidth {bw / 1e12:.3f} TB/s")
    md: list[str] = []

    host, trace_s = trace(args.rays, Path("/tmp/madpet2_npy") if args.ncu else None)
    for order in args.orders.split(","):
        a, at = build(host, order)
        label = f"madpet2 rays={args.rays}, {order} LOR order"
        m, n = a.shape
        nnz = a.nnz
        rng = np.random.default_rng(1)
        f = cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
        c = cp.asarray(rng.uniform(0.5, 1.5, m).astype(np.float32))
        a64 = a.cusparse().astype(cp.float64)
        ref_fp = a64 @ f.astype(cp.float64)
        ref_bp = a64.T @ c.astype(cp.float64)
        # the one-pass step's reference: g = A f_true, c = g / (A f), bp = A^T c (float64 throughout)
        g_op = (a.cusparse() @ cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))).astype(cp.float32)
        c64 = cp.where(ref_fp != 0, g_op.astype(cp.float64) / cp.where(ref_fp != 0, ref_fp, 1.0), 0.0)
        ref_op = a64.T @ c64
        del a64, c64
        a.drop_cusparse()
        cp.get_default_memory_pool().free_all_blocks()
        bytes_a, bytes_at = plan.csr_bytes(m, nnz), plan.csr_bytes(n, nnz)
        rows = []

        def run(op, name, fn, nbytes, ref, extra=None, same_as=None):
            y = fn()
            err = float(cp.linalg.norm(y.astype(cp.float64) - ref) / cp.linalg.norm(ref))
            identical = None if same_as is None else bool(cp.array_equal(y, same_as))
            t = time_gpu(fn, repeat=args.repeat, warmup=3)
            med = float(np.median(t))
            row = {"op": op, "kernel": name, "median_ms": med * 1e3, "min_ms": float(t.min()) * 1e3,
                   "of_copy": nbytes / med / bw, "rel_l2": err, "bit_identical_to_default": identical, **(extra or {})}
            rows.append(row)
            log(f"{order:8s} {op:12s} {name:34s} {med * 1e3:7.3f} ms  {100 * row['of_copy']:5.1f}% of copy  "
                f"err {err:.1e}{'' if identical is None else ('  identical' if identical else '  DIFFERS')}")
            return y

        y_fp = cp.empty(m, dtype=cp.float32)
        y_bp = cp.empty(n, dtype=cp.float32)
        lanes_fp = a.lanes()
        # ---- forward
        run("forward", "cusparse", lambda: a.cusparse() @ f, bytes_a, ref_fp)
        base_fp = run("forward", f"csr_vector ({lanes_fp} lanes)", lambda: ck.spmv(a, f, y_fp), bytes_a, ref_fp).copy()
        for fields in SHAPES[1:]:
            sh = plan.RowShape(*fields)
            for L in sorted({lanes_fp, 32}):
                run("forward", f"csr_vector ({L} lanes, {sh.label()})",
                    lambda sh=sh, L=L: ck.spmv(a, f, y_fp, lanes=L, shape=sh), bytes_a, ref_fp,
                    {"lanes": L, "shape": sh.label()}, same_as=base_fp if L == lanes_fp else None)
        a.drop_cusparse()
        run("forward", "merge (secsize 5)", lambda: ck.spmv(a, f, y_fp, kernel="merge"), bytes_a, ref_fp)
        # ---- back on A^T
        run("back", "cusparse", lambda: at.cusparse() @ c, bytes_at, ref_bp)
        at.drop_cusparse()
        lanes_bp = ck.transpose_lanes(at)
        base_bp = run("back", f"csr_vector ({lanes_bp} lanes)", lambda: ck.spmv(at, c, y_bp, lanes=lanes_bp),
                      bytes_at, ref_bp).copy()
        for fields in SHAPES[1:]:
            sh = plan.RowShape(*fields)
            for L in args.lanes:
                run("back", f"csr_vector ({L} lanes, {sh.label()})",
                    lambda sh=sh, L=L: ck.spmv(at, c, y_bp, lanes=L, shape=sh), bytes_at, ref_bp,
                    {"lanes": L, "shape": sh.label()}, same_as=base_bp if L == lanes_bp else None)
        # ---- back without A^T
        smem = ck.smem_plan(a)
        run("back_notrans", "cusparse_notrans", lambda: a.cusparse().T @ c, bytes_a, ref_bp)
        a.drop_cusparse()
        for k in ("scatter", "scatter_vec"):
            run("back_notrans", k, lambda k=k: ck.scatter(a, c, y_bp, kernel=k), bytes_a, ref_bp)
        run("back_notrans", f"scatter_smem ({100 * smem.local_fraction:.0f}% local)",
            lambda: ck.scatter(a, c, y_bp, kernel="scatter_smem", smem=smem), bytes_a, ref_bp)
        cp.get_default_memory_pool().free_all_blocks()

        if args.compressed:
            compressed_section(a, at, f, c, g_op, ref_fp, ref_bp, ref_op, run, args, order)
            RESULTS_BW[0] = bw
            results.setdefault("mlem", []).extend(mlem_section(a, at, order, args))
            ITER_MATS.clear()
        # ---- whole iterations
        g = (a.cusparse() @ cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))).get()
        a.drop_cusparse()
        norm = (at.cusparse() @ cp.ones(m, dtype=cp.float32)).get().astype(np.float64)
        at.drop_cusparse()
        its = []
        pairs = [("cusparse", "cusparse", True), ("csr_vector", "csr_vector", False),
                 ("csr_vector", "cusparse_notrans", True), ("csr_vector", "scatter_vec", True), ("auto", "auto", True),
                 ("auto", "onepass_chunked", True)]
        for fp_k, bp_k, tune in pairs:
            a.row_shape = at.row_shape = None
            be = CudaBackend(a, g, norm, at if registry.uses_transpose("cuda", bp_k) else None, fp=fp_k, bp=bp_k,
                             tune=tune)
            x = be.initial_image()
            t = []
            for i in range(3 + args.repeat):
                x = be.iterate(x)
                if i >= 3:
                    t.append(be.last_step_times())
            med = {k: float(np.median([s[k] for s in t])) * 1e3 for k in t[0]}
            floor = plan.iteration_floor_bytes(m, n, nnz, transpose=be.at is not None) / bw * 1e3
            d = be.describe()
            its.append({"fp": be.fp_kernel, "bp": be.bp_kernel,
                        "requested": f"{fp_k}+{bp_k}" + ("" if tune else " (untuned)"),
                        "shapes": f"{d.get('shape_fp')} / {d.get('shape_bp')}",
                        "tuned": {"fp": a.tuned, "bp": at.tuned},
                        "deterministic": be.deterministic, "ms": med, "floor_ms": floor,
                        "of_floor": floor / med["iteration"]})
            log(f"{order:8s} iteration {fp_k}+{bp_k} -> {be.fp_kernel}+{be.bp_kernel} ({its[-1]['shapes']}): "
                + ", ".join(f"{k} {v:.3f}" for k, v in med.items()) + f" ms; floor {floor:.3f} ms")
            del be
            cp.get_default_memory_pool().free_all_blocks()
        results["orders"][order] = {"label": label, "shape": [m, n], "nnz": nnz, "trace_s": trace_s,
                                    "kernels": rows, "iterations": its,
                                    "formats": [r for r in RESULTS_FORMATS if r["order"] == order]}
        md.append(_markdown(order, label, m, n, nnz, bw, rows, its))
        md.append("\n".join(f"- {r['format']} {r['matrix']}: {r['bytes_per_nnz']:.3f} bytes per non-zero, "
                            f"{r['markers']:,} markers, encoded in {r['encode_s']:.1f} s"
                            for r in RESULTS_FORMATS if r["order"] == order))
        (out / "kernels.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "kernels.md").write_text("\n\n".join(md) + "\n")
        if args.ncu and order == args.orders.split(",")[0]:
            _ncu(out, "/tmp/madpet2_npy")
        del a, at
        cp.get_default_memory_pool().free_all_blocks()
    print("\n\n".join(md))
    return 0


#: Launch shapes of the compressed SpMV: (threads per block, waves (0: no grid-stride loop), quads per lane).
CMP_SHAPES = [(256, 0, 1), (256, 0, 2), (512, 0, 1)]


def compressed_section(a, at, f, c, g, ref_fp, ref_bp, ref_op, run, args, order) -> None:
    """The compressed formats (lossless and float16) and the one-pass iteration, timed like the CSR kernels."""
    import cupy as cp

    from mlemlib.backends import _compressed_cuda as gpu
    from mlemlib.compressed import CompressedMatrix

    m, n = a.shape
    nnz = a.nnz
    t0 = time.perf_counter()
    host_a, host_at = a.to_host(), at.to_host()
    log(f"{order}: A and A^T to the host in {time.perf_counter() - t0:.1f} s")
    mats = {}
    for fmt in ("compressed", "compressed-f16"):
        for name, h in (("A", host_a), ("AT", host_at)):
            t0 = time.perf_counter()
            cm = CompressedMatrix.from_csr(h, fmt, validate=False)
            dt = time.perf_counter() - t0
            log(f"{order}: {fmt} {name}: {cm.bytes_per_nnz:.3f} bytes per non-zero, {cm.code_bits}-bit codes "
                f"({cm.slots - cm.nnz} markers and pads, {100 * (cm.slots - cm.nnz) / max(1, cm.nnz):.2f}%), "
                f"encoded in {dt:.1f} s")
            mats[(fmt, name)] = gpu.DeviceCompressed.from_host(cm)
            RESULTS_FORMATS.append({"order": order, "format": fmt, "matrix": name, "bytes_per_nnz": cm.bytes_per_nnz,
                                    "markers": int(cm.slots - cm.nnz), "code_bits": cm.code_bits, "encode_s": dt})
            if name == "A":
                mats[(fmt, "host")] = cm  # the MLEM runs' source of the chunked one pass (decoded block by block)
            del cm
    del host_a, host_at
    BOUND[0] = 4.0 * float(ref_op.max())  # the deterministic one-pass's fixed-point range (bp <= bound)
    y_fp = cp.empty(m, dtype=cp.float32)
    y_bp = cp.empty(n, dtype=cp.float32)
    fp_out = cp.empty(m, dtype=cp.float32)
    for threads, waves, quads in CMP_SHAPES:
        gpu.THREADS, gpu.WAVES, gpu.QUADS = threads, waves, quads
        tag = f"{threads}t w{waves}, {4 * quads} slots per lane"
        for fmt in ("compressed", "compressed-f16"):
            ca, cat = mats[(fmt, "A")], mats[(fmt, "AT")]
            run("forward", f"{fmt} ({tag})", lambda ca=ca: gpu.spmv(ca, f, y_fp), ca.nbytes, ref_fp,
                {"format": fmt, "bytes": ca.nbytes})
            run("back", f"{fmt} on A^T ({tag})", lambda cat=cat: gpu.spmv(cat, c, y_bp), cat.nbytes, ref_bp,
                {"format": fmt, "bytes": cat.nbytes})
    gpu.THREADS, gpu.WAVES, gpu.QUADS = 256, 0, 1
    tag = "256t w0"
    for label, mat in (("csr", a), ("compressed", mats[("compressed", "A")]),
                       ("compressed-f16", mats[("compressed-f16", "A")])):
        nb = mat.nbytes
        run("onepass", f"onepass {label} ({tag}, atomics)",
            lambda mat=mat: gpu.onepass(mat, g, f, bp=y_bp, fp=fp_out)[0], nb, ref_op, {"format": label, "bytes": nb})
        run("onepass", f"onepass {label} ({tag}, fixed point)",
            lambda mat=mat: gpu.onepass(mat, g, f, bp=y_bp, fp=fp_out, deterministic=True,
                                        bound=float(BOUND[0]), check=False)[0], nb, ref_op,
            {"format": label, "bytes": nb, "deterministic": True})
    gpu.THREADS, gpu.WAVES, gpu.QUADS = BEST_CMP
    ITER_MATS.update(mats)


#: Device matrices of the compressed formats, kept for the iterations (cleared per order).
ITER_MATS: dict = {}


def mlem_section(a, at, order, args) -> list[dict]:
    """Whole MLEM runs of every format and iteration kernel through CudaBackend: time and accuracy.

    Each configuration runs ``--iterations`` iterations from the same start on a
    noiseless measurement; times are medians of the per-iteration CUDA-event
    times; accuracy is the relative L2 distance of the final image to a
    float64 MLEM of the same problem (cuSPARSE in float64) and to the float32
    CSR run.
    """
    import cupy as cp

    from mlemlib.backends import _cuda_plan as plan
    from mlemlib.backends.cuda import CudaBackend

    m, n = a.shape
    g, norm = problem(a, at)
    its = args.iterations
    # float64 reference MLEM
    a64 = a.cusparse().astype(cp.float64)
    a.drop_cusparse()
    g64, n64 = cp.asarray(g, dtype=cp.float64), cp.asarray(norm)
    f64 = cp.full(n, float(g64.sum() / n64.sum()))
    for _ in range(its):
        fp = a64 @ f64
        c64 = cp.where(fp != 0, g64 / cp.where(fp != 0, fp, 1.0), 0.0)
        f64 = f64 * (a64.T @ c64) / cp.where(n64 != 0, n64, 1.0)
    del a64
    cp.get_default_memory_pool().free_all_blocks()
    ref = f64.get()
    del f64
    configs = [("csr", "auto", a, at), ("csr", "csr_vector", a, at), ("csr", "onepass", a, None),
               ("csr", "onepass_fixed", a, None), ("csr", "onepass_chunked", a, None)]
    for fmt in ("compressed", "compressed-f16"):
        if (fmt, "A") in ITER_MATS:
            configs += [(fmt, "auto", ITER_MATS[(fmt, "host")], ITER_MATS[(fmt, "AT")]),
                        (fmt, "delta_vector", ITER_MATS[(fmt, "A")], ITER_MATS[(fmt, "AT")]),
                        (fmt, "onepass", ITER_MATS[(fmt, "A")], None),
                        (fmt, "onepass_fixed", ITER_MATS[(fmt, "A")], None),
                        (fmt, "onepass_chunked", ITER_MATS[(fmt, "host")], None)]
    out, base = [], None
    bw = RESULTS_BW[0]
    for fmt, bp, mat, tr in configs:
        a.row_shape = at.row_shape = None
        be = CudaBackend(mat, g, norm, tr, bp=bp)
        f = be.initial_image()
        t = []
        for i in range(its):
            f = be.iterate(f)
            t.append(be.last_step_times())
        img = be.to_host(f)
        med = {k: float(np.median([x[k] for x in t[3:]])) * 1e3 for k in t[0]}
        d = be.describe()
        nbytes = be.a.nbytes + (be.at.nbytes if be.at is not None else 0)
        floor = nbytes / bw * 1e3
        csr_floor = plan.iteration_floor_bytes(m, n, a.nnz) / bw * 1e3
        err = float(np.linalg.norm(img.astype(np.float64) - ref) / np.linalg.norm(ref))
        if base is None:
            base = img
        err32 = float(np.linalg.norm(img.astype(np.float64) - base) / np.linalg.norm(base))
        row = {"order": order, "format": fmt, "bp_requested": bp, "fp": be.fp_kernel, "bp": be.bp_kernel,
               "deterministic": be.deterministic, "ms": med, "bytes": nbytes, "floor_ms": floor,
               "of_floor": floor / med["iteration"], "csr_floor_ms": csr_floor,
               "of_csr_floor": csr_floor / med["iteration"], "rel_l2_float64": err, "rel_l2_csr": err32,
               "iterations": its, "bytes_per_nnz": d.get("bytes_per_nnz")}
        out.append(row)
        log(f"{order:8s} MLEM {fmt:15s} {bp:14s} -> {be.fp_kernel}+{be.bp_kernel}: {med['iteration']:.3f} ms/it "
            f"({100 * row['of_floor']:.0f}% of its floor {floor:.3f}, {100 * row['of_csr_floor']:.0f}% of the CSR floor), "
            f"rel L2 {err:.2e} vs float64, {err32:.2e} vs csr after {its}")
        del be
        cp.get_default_memory_pool().free_all_blocks()
    return out


RESULTS_BW = [1.0]


RESULTS_FORMATS: list[dict] = []
#: The compressed kernels' launch (threads, waves, quads) the MLEM runs use.
BEST_CMP = (256, 0, 1)
#: The fixed-point bound of the timed deterministic one-pass runs (set from the problem).
BOUND = [0.0]


def _markdown(order, label, m, n, nnz, bw, rows, its) -> str:
    lines = [f"### {label}: {m:,} x {n:,}, {nnz:,} nnz; copy bandwidth {bw / 1e12:.3f} TB/s", "",
             "| operation | kernel | median ms | of copy bw | rel. L2 vs float64 | same bits as default shape |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        same = "" if r["bit_identical_to_default"] is None else ("yes" if r["bit_identical_to_default"] else "NO")
        lines.append(f"| {r['op']} | {r['kernel']} | {r['median_ms']:.3f} | {100 * r['of_copy']:.1f}% | "
                     f"{r['rel_l2']:.1e} | {same} |")
    lines += ["", "| requested | ran | shapes fp / bp | deterministic | iteration ms | fp ms | bp ms | floor ms | of floor |",
              "|---|---|---|---|---|---|---|---|---|"]
    for it in its:
        ms = it["ms"]
        lines.append(f"| {it['requested']} | {it['fp']} + {it['bp']} | {it['shapes']} | {'yes' if it['deterministic'] else 'no'} | "
                     f"{ms['iteration']:.3f} | {ms.get('fp', float('nan')):.3f} | {ms.get('bp', float('nan')):.3f} | "
                     f"{it['floor_ms']:.3f} | {100 * it['of_floor']:.1f}% |")
    return "\n".join(lines)


NCU_TARGET = r'''
import sys, numpy as np, cupy as cp
sys.path.insert(0, ".")
from mlemlib.backends import _cuda_kernels as ck, _cuda_plan as plan
from mlemlib.matrix import CSRMatrix
d = sys.argv[1]
host = CSRMatrix(np.load(d + "/indptr.npy"), np.load(d + "/indices.npy"), np.load(d + "/data.npy"),
                 tuple(__import__("json").load(open(d + "/shape.json"))))
a = ck.DeviceCSR.from_host(host)
at = a.transpose(); a.drop_cusparse()
c = cp.ones(a.shape[0], dtype=cp.float32); y = cp.empty(a.shape[1], dtype=cp.float32)
x = cp.ones(a.shape[1], dtype=cp.float32); z = cp.empty(a.shape[0], dtype=cp.float32)
for sh in (None, plan.RowShape(1024, False, 0), plan.RowShape(1024, False, 0, True), plan.RowShape(1024, False, 0, True, 2)):
    ck.spmv(at, c, y, lanes=32, shape=sh)
    ck.spmv(a, x, z, lanes=32, shape=sh)
cp.cuda.Device().synchronize()
'''


def run_ncu(out_file: Path, script: str, script_args: str, options: str, keep: str, timeout: int = 420) -> None:
    """Profile ``python3 <script> <script_args>`` under Nsight Compute (``options``: kernel filter,
    sections, metrics); write the report to ``out_file`` and print the lines matching ``keep``."""
    if not shutil.which("ncu"):
        log("ncu: not found")
        return
    target = Path("/tmp") / f"ncu_{out_file.stem}.py"
    target.write_text(script)
    t0 = time.perf_counter()
    proc = subprocess.run(f"cd {ROOT} && ncu {options} python3 {target} {script_args}", shell=True,
                          capture_output=True, text=True, timeout=timeout)
    text = proc.stdout + proc.stderr
    out_file.write_text(text)
    kept = [ln for ln in text.splitlines() if re.search(keep, ln)]
    print("\n".join(kept))
    log(f"ncu: rc {proc.returncode} in {time.perf_counter() - t0:.0f} s, {len(kept)} lines kept")


def _ncu(out: Path, npy_dir: str) -> None:
    run_ncu(out / "ncu.txt", NCU_TARGET, npy_dir,
            "--kernel-name regex:'csr_vector|csr_block' --section SpeedOfLight --section MemoryWorkloadAnalysis "
            "--section MemoryWorkloadAnalysis_Tables --section Occupancy "
            "--metrics l1tex__t_sector_hit_rate.pct,lts__t_sector_hit_rate.pct",
            r"csr_vector_\d+|csr_block_\d+|DRAM Throughput|L1/TEX Hit Rate|L2 Hit Rate|Duration|Achieved Occupancy|"
            r"l1tex__t_sector_hit_rate|lts__t_sector_hit_rate|L2 Cache Throughput|L1/TEX Cache Throughput")


if __name__ == "__main__":
    sys.exit(main())
