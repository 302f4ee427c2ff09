#!/usr/bin/env python3
"""The one-pass MLEM iteration on the whole ``matrix3`` preset (12.4e9 non-zeros) on one GPU, without a disk.

Run from the repository root on a GPU machine with >= 70 GB of GPU memory::

    PYTHONPATH=. python3 tools/device_matrix3_onepass.py --out $OUT [--chunks 16] [--repeat 5] [--format compressed-u16]
        [--order own|voxels|rows+voxels]

The workflow's Matrix 3 run (docs/cluster.md, "The matrix3 run") needs the
2-GPU node's disk; this probe needs none: it traces the preset in
``--chunks`` row blocks on the host's CPUs, encodes each block in the lossless
compressed format (``CompressedMatrix.from_csr``; ``--format compressed-u16``
or ``compressed-f16``: 16-bit values, about 3 bytes per non-zero, the checks
then against the decoded values) and keeps it on the GPU,
one :class:`~mlemlib.backends._compressed_cuda.DeviceCompressed` per block
(the whole matrix is on the GPU at the end; host memory holds one block).
It then times, with CUDA events (median of ``--repeat``):

- the forward projection alone (``cspmv`` on every block): the read of A;
- the one-pass iteration with float atomics (``onepass``) and in 64-bit fixed
  point (``onepass_fixed``) over all blocks: one GPU's iteration (without
  the elementwise update, 2.6e6 voxels: microseconds);
- the same over the first and over the second half of the blocks (split by
  non-zeros): what each GPU of the 2-GPU local layout computes per
  iteration, before its all-reduce.

``--order voxels`` relabels the columns by the reorder stage's 3-D Hilbert
voxel order (from the grid alone) and sorts each row again; ``rows+voxels``
also traces the rows in the reorder stage's order, computed from the preset
traced with ``--perm-rays`` per tube (docs/benchmarks.md, section 52);
``upper`` traces each line of response once (rows ``i * N + j`` with
``i < j``, the empty ones included; section 64); ``folded`` only the
non-empty ones, exactly the stored rows of ``mlem generate --fold`` (section 74).
``--sweep`` times the one pass again under other builds (threads per block,
compile options such as ``-DMLEM_CMP_CACHE=2``, unused shared memory per
block), in turn, three rounds; ``--l2-persist f+bp,bp,f`` times each build
again on streams whose L2 access-policy window holds that region
(docs/benchmarks.md, sections 80 and 81). The probe's own launches take no
window unless asked (the library's one pass does: ``persist_in_l2``).

Checks first: the forward and back projection of block 0 against a float64
SciPy product on the host, and the atomic against the fixed-point iteration
over the whole matrix (relative L2). Writes ``matrix3_onepass.json``.
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


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


ORDERS = ("own", "voxels", "rows+voxels", "upper", "folded", "folded+voxels")


def order_of(order: str, preset: str, cfg, m: int, perm_rays: int):
    """The rows to trace (int64[m], in the new order) and ``vinv`` (new column of each old one, or None)."""
    from mlemlib.reorder import Permutation, voxel_permutation

    if order == "own":
        return np.arange(m, dtype=np.int64), None, {}
    if order in ("upper", "folded", "folded+voxels"):  # each LOR once: the rows i * N + j with i < j (docs/formats.md)
        from mlemlib.scanner.system import Tracer, _upper_rows

        rows = _upper_rows(cfg.n_crystals, 0, cfg.n_crystals)
        rows = rows if m >= cfg.n_lors else rows[rows < m]
        if order != "upper":  # only the tubes that cross the grid: the generator's stored rows
            rows = rows[Tracer(cfg, 1).hits(rows) > 0]
        if order == "folded+voxels":  # and the voxels along the reorder stage's 3-D Hilbert curve
            t0 = time.perf_counter()
            perm = Permutation(np.arange(m, dtype=np.int64), voxel_permutation(tuple(cfg.grid)), "rows+voxels",
                               (m, cfg.n_voxels), 0, "")
            info = {"perm_s": time.perf_counter() - t0}
            log(f"order {order}: voxel permutation in {info['perm_s']:.1f} s")
            return rows, perm.inverse_voxels(), info
        return rows, None, {}
    if order == "voxels":
        t0 = time.perf_counter()
        perm = Permutation(np.arange(m, dtype=np.int64), voxel_permutation(tuple(cfg.grid)), "rows+voxels",
                           (m, cfg.n_voxels), 0, "")
        info = {"perm_s": time.perf_counter() - t0}
    else:
        sys.path.insert(0, str(ROOT / "tools"))
        from device_matrix3_chunked import permutation

        perm, info = permutation(preset, m, perm_rays)
    log(f"order {order}: permutation in {info.get('perm_s', 0.0):.1f} s")
    return np.asarray(perm.rows, dtype=np.int64), perm.inverse_voxels(), info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--preset", default="matrix3")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-rows", type=int, default=0, help="only the first rows (a quick trial)")
    ap.add_argument("--format", default="compressed", choices=("compressed", "compressed-f16", "compressed-u16"),
                    help="the blocks' encoding on the GPU (default: lossless)")
    ap.add_argument("--order", default="own", choices=ORDERS,
                    help="own: the scanner's LOR and voxel numbers; voxels: columns in the reorder stage's 3-D "
                         "Hilbert voxel order (from the grid alone); rows+voxels: also the rows in the reorder "
                         "stage's order, computed from the preset traced with --perm-rays per tube; upper: "
                         "each LOR once (rows i * N + j, i < j: the folded matrix)")
    ap.add_argument("--perm-rays", type=int, default=16, help="rays per tube of the rows+voxels permutation's trace")
    ap.add_argument("--sweep", default="",
                    help="after the standard timings, the one pass (float atomics) again under other builds, in "
                         "turn: comma-separated THREADS:OPTION[;OPTION][:PAD[:UNIT]] (e.g. "
                         "'512:,256:-DMLEM_CMP_CACHE=2,256::65536,256:::1'); THREADS is _compressed_cuda.THREADS, "
                         "the options its OPTIONS, PAD its SHARED_PAD (bytes of unused shared memory per block: "
                         "fewer blocks per multiprocessor), UNIT its SPREAD_UNIT (rows per unit of the spread launch "
                         "order; 0: rows in order)")
    ap.add_argument("--l2-persist", default="",
                    help="time the sweep's builds again with an L2 persisting access-policy window on the stream, "
                         "per comma-separated region: f+bp (adjacent in one buffer), f or bp (names suffixed "
                         "+L2:<region>; _compressed_cuda.persist_in_l2)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import cupy as cp

    from mlemlib.backends import _compressed_cuda as gpu
    from mlemlib.compressed import CompressedMatrix
    from mlemlib.reorder import relabel_columns
    from mlemlib.scanner import get_preset
    from mlemlib.scanner.system import trace_rows

    cfg = get_preset(args.preset)
    m = cfg.n_lors if not args.max_rows else min(cfg.n_lors, args.max_rows)
    n = cfg.n_voxels
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    log(f"{dev}; {args.preset}: {m} x {n}, {args.chunks} blocks, {os.cpu_count()} CPUs")
    rows_of, vinv, order_info = order_of(args.order, args.preset, cfg, m, args.perm_rays)
    m = len(rows_of)
    bounds = np.linspace(0, m, args.chunks + 1).astype(np.int64)
    blocks = []
    nnz = 0
    nbytes = 0
    sample = None
    t_all = time.perf_counter()
    for b in range(args.chunks):
        r0, r1 = int(bounds[b]), int(bounds[b + 1])
        t0 = time.perf_counter()
        host = trace_rows(cfg, rows_of[r0:r1])
        if vinv is not None:  # each row sorted again: the compressed format's delta code
            host = relabel_columns(host, vinv)
        t1 = time.perf_counter()
        cm = CompressedMatrix.from_csr(host, args.format, validate=False)
        t2 = time.perf_counter()
        dc = gpu.DeviceCompressed.from_host(cm)
        t3 = time.perf_counter()
        if b == 0:  # the values the GPU holds (a lossy format's decoded ones)
            sample = (host if cm.lossless else cm.to_csr()).to_scipy().astype(np.float64)
        blocks.append((r0, r1, dc, int(host.nnz)))
        nnz += int(host.nnz)
        nbytes += int(dc.nbytes)
        elapsed = time.perf_counter() - t_all
        log(f"block {b + 1}/{args.chunks}: rows {r0}-{r1}, {host.nnz} nnz, {cm.bytes_per_nnz:.3f} bytes/nnz "
            f"({dc.kind}); trace {t1 - t0:.1f} s, encode {t2 - t1:.1f} s, upload {t3 - t2:.1f} s; "
            f"{nnz} nnz so far, ETA {elapsed / (b + 1) * (args.chunks - b - 1):.0f} s")
        del host, cm
    log(f"whole matrix on the GPU: {nnz} nnz, {nbytes / 1e9:.2f} GB ({nbytes / nnz:.3f} bytes/nnz) "
        f"in {time.perf_counter() - t_all:.0f} s")

    sys.path.insert(0, str(ROOT / "tools"))
    from device_onepass import copy_bandwidth, timer

    def timed(fn, repeat):  # median ms
        return timer(repeat)(fn)

    bw = copy_bandwidth()
    rng = np.random.default_rng(5)
    fbp = cp.empty(2 * n, dtype=cp.float32)  # f and bp adjacent: one L2 access-policy window holds both
    f, bp = fbp[:n], fbp[n:]
    f[...] = cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
    truth = cp.asarray(rng.uniform(0.0, 2.0, n).astype(np.float32))
    g = cp.empty(m, dtype=cp.float32)
    fp = cp.empty(m, dtype=cp.float32)
    bp_det = cp.empty(n, dtype=cp.float32)
    acc = cp.empty(n, dtype=cp.uint64)
    flag = cp.zeros(1, dtype=cp.int32)
    for r0, r1, dc, _ in blocks:
        gpu.spmv(dc, truth, g[r0:r1])
    bound = gpu.onepass_bound(g, f)
    scale = gpu.fixed_scale(bound)
    lanes = gpu.choose_lanes(sum(dc.slots for _, _, dc, _ in blocks) / 4 / m)

    def forward(sel):
        for r0, r1, dc, _ in sel:
            gpu.spmv(dc, f, fp[r0:r1])

    def onepass(sel):
        bp.fill(0)
        for r0, r1, dc, _ in sel:
            groups, order = gpu.spread(r1 - r0)
            gpu._launch_rows(gpu.function(gpu._onepass_name(dc.kind, lanes, False)), groups, lanes,
                             (*dc.kernel_args(), f, g[r0:r1], fp[r0:r1], bp, np.int64(r1 - r0), *order))

    def onepass_fixed(sel):
        acc.fill(0)
        for r0, r1, dc, _ in sel:
            gpu.onepass_fixed(dc, g[r0:r1], f, acc, fp[r0:r1], scale, flag, lanes=lanes)
        gpu.fixed_to_float(acc, bp_det, scale)

    # checks: block 0 against float64 on the host, atomics against fixed point
    r0, r1, dc0, _ = blocks[0]
    fhost = cp.asnumpy(f).astype(np.float64)
    ref_fp = sample @ fhost
    gpu.spmv(dc0, f, fp[r0:r1])
    err_fp = float(np.linalg.norm(cp.asnumpy(fp[r0:r1]) - ref_fp) / np.linalg.norm(ref_fp))
    onepass(blocks[:1])
    g0 = cp.asnumpy(g[r0:r1]).astype(np.float64)
    c0 = np.where(ref_fp > 0, g0 / np.where(ref_fp > 0, ref_fp, 1.0), 0.0)
    ref_bp = sample.T @ c0
    err_bp = float(np.linalg.norm(cp.asnumpy(bp) - ref_bp) / np.linalg.norm(ref_bp))
    del sample
    onepass(blocks)
    onepass_fixed(blocks)
    if int(flag.get()[0]):
        log(f"fixed point overflowed (flag {int(flag.get()[0])})")
    err_det = float(cp.linalg.norm(bp - bp_det) / cp.linalg.norm(bp_det))
    log(f"checks: block 0 fp rel.L2 {err_fp:.1e}, bp rel.L2 {err_bp:.1e} (float64 host); "
        f"onepass vs onepass_fixed over the whole matrix {err_det:.1e}")

    cum = np.cumsum([b[3] for b in blocks])
    split = int(np.searchsorted(cum, cum[-1] / 2)) + 1
    halves = (blocks[:split], blocks[split:])
    rec = {"device": dev, "preset": args.preset, "format": args.format, "order": args.order, **order_info, "rows": m, "cols": n, "nnz": nnz, "bytes": nbytes,
           "bytes_per_nnz": nbytes / nnz, "blocks": args.chunks, "lanes": lanes, "copy_bw_TBps": bw,
           "one_read_ms": nbytes / (bw * 1e12) * 1e3, "check_fp_block0": err_fp, "check_bp_block0": err_bp,
           "onepass_vs_fixed": err_det, "half_nnz": [int(sum(b[3] for b in h)) for h in halves]}
    for name, fn in (("forward", forward), ("onepass", onepass), ("onepass_fixed", onepass_fixed)):
        rec[f"{name}_ms"] = timed(lambda fn=fn: fn(blocks), args.repeat)
        rec[f"{name}_half_ms"] = [timed(lambda fn=fn, h=h: fn(h), args.repeat) for h in halves]
        log(f"{name}: {rec[f'{name}_ms']:.2f} ms over the whole matrix; halves "
            f"{rec[f'{name}_half_ms'][0]:.2f} / {rec[f'{name}_half_ms'][1]:.2f} ms")
    log(f"copy bandwidth {bw:.3f} TB/s; one read of the compressed matrix {rec['one_read_ms']:.2f} ms")
    if args.sweep:  # every build timed in turn, three rounds: the clocks drift (docs/benchmarks.md section 70)
        builds = [("default", gpu.THREADS, gpu.OPTIONS, gpu.SHARED_PAD, gpu.SPREAD_UNIT)]
        for item in args.sweep.split(","):
            threads, _, rest = item.partition(":")
            opts, _, rest = rest.partition(":")
            pad, _, unit = rest.partition(":")
            builds.append((item, int(threads), tuple(o for o in opts.split(";") if o), int(pad or 0),
                           int(unit or gpu.SPREAD_UNIT)))
        base = gpu.THREADS, gpu.OPTIONS, gpu.SHARED_PAD, gpu.SPREAD_UNIT
        # (name suffix, stream, the region its L2 window holds or None)
        regions = {"f+bp": fbp, "f": f, "bp": bp}
        streams = [("", cp.cuda.Stream(non_blocking=True), None)]
        streams += [(f"+L2:{r}", cp.cuda.Stream(non_blocking=True), r) for r in args.l2_persist.split(",") if r]
        rec["l2_window"] = {}
        times = {b[0] + sfx: [] for b in builds for sfx, _, _ in streams}
        onepass_fixed(blocks)  # the reference: the whole matrix (the timings above ended on a half)
        for _ in range(3):
            for name, threads, opts, pad, unit in builds:
                for sfx, stream, region in streams:
                    gpu.THREADS, gpu.OPTIONS, gpu.SHARED_PAD, gpu.SPREAD_UNIT = threads, opts, pad, unit
                    # the library's window: the set-aside sized to it, emptied of other lines (none: given back)
                    if region is None:
                        gpu.release_l2()
                    else:
                        window = gpu.persist_in_l2(stream, regions[region])
                        if window is None:
                            raise SystemExit("this GPU gives no control of L2 persistence (--l2-persist)")
                        if region not in rec["l2_window"]:
                            rec["l2_window"][region] = window
                            log(f"L2 persisting window {region}: {window}")
                    with stream:
                        onepass(blocks)  # compiles the build; then checked against the fixed point
                        err = float(cp.linalg.norm(bp - bp_det) / cp.linalg.norm(bp_det))
                        if err > 1e-5:
                            raise SystemExit(f"build {name}{sfx}: one pass off the fixed point by {err:.1e}")
                        times[name + sfx].append(timed(lambda: onepass(blocks), args.repeat))
        gpu.THREADS, gpu.OPTIONS, gpu.SHARED_PAD, gpu.SPREAD_UNIT = base
        gpu.release_l2()
        rec["sweep_onepass_ms"] = {k: v for k, v in times.items()}
        for k, v in times.items():
            log(f"sweep {k}: one pass {' / '.join(f'{t:.2f}' for t in v)} ms")
    (out / "matrix3_onepass.json").write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
