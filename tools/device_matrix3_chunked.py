#!/usr/bin/env python3
"""The chunked one pass (``onepass_chunked``) on the whole ``matrix3`` preset (12.4e9 non-zeros) on one GPU.

Run from the repository root on a GPU machine with >= 90 GB of GPU memory::

    PYTHONPATH=. python3 tools/device_matrix3_chunked.py --out $OUT [--blocks 32] [--repeat 5]

``onepass_chunked`` pays off on a matrix in the reorder stage's order
(docs/benchmarks.md §33-§36). Tracing Matrix 3 twice (once for the
permutation, once in its order) would take most of a 10-minute device call,
so the permutation is computed by the reorder stage's own code
(:func:`mlemlib.reorder.compute_permutation`, ``rows+voxels``, streaming)
from the preset traced with **16 rays per tube** (``--perm-rays``: the same
tubes, about 1/5 of the tracing; on madpet2 its permutation gives chunks a
reuse of 15.73 against 14.06 from one ray per tube); the matrix is then
traced with the preset's 81 rays in that row order, block by block (``--blocks``), its
columns relabelled by the voxel permutation, and each block chunked on the
GPU (:class:`mlemlib.backends._compressed_cuda.DeviceChunked`: the host holds
one block). Timed with CUDA events (median of ``--repeat``): the forward
projection through the chunks (the read of A) and the chunked one-pass step
(deterministic, 64-bit fixed point) over the whole matrix and over each half
of the blocks (what each GPU of a 2-GPU local layout would compute).

Checks first: block 0's forward projection and its one-pass back projection
against float64 SciPy products on the host (relative L2). Writes
``matrix3_chunked.json``. ``--host-only`` stops after the permutation and
the sampled chunk reuse (no GPU needed; try it on ``--preset small``).
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


class TracedRows:
    """The preset's matrix as the reorder stage reads a matrix (``iter_chunks``), traced block by block on demand.

    Host memory holds one block; ``nnz`` is the preset's estimate (only recorded).
    """

    def __init__(self, cfg, m: int, rows_per_block: int = 1 << 16) -> None:
        from mlemlib.scanner.presets import NNZ

        self.cfg, self.rows_per_block = cfg, rows_per_block
        self.shape = (m, cfg.n_voxels)
        self.nnz = NNZ.get(cfg.name, 0)
        self.grid = tuple(cfg.grid)
        self.checksum = f"traced:{cfg.name}:rays={cfg.rays}"
        self.attrs: dict = {}
        self.traced = 0

    def iter_chunks(self, max_nnz: int = 0):
        from mlemlib.scanner.system import trace_rows

        m = self.shape[0]
        for r0 in range(0, m, self.rows_per_block):
            r1 = min(m, r0 + self.rows_per_block)
            block = trace_rows(self.cfg, np.arange(r0, r1, dtype=np.int64))
            self.traced += int(block.nnz)
            yield r0, r1, block


def permutation(preset: str, m: int, rays: int):
    """The reorder stage's ``rows+voxels`` permutation of the preset, from its matrix traced with ``rays`` per tube."""
    from mlemlib.reorder import compute_permutation
    from mlemlib.scanner import get_preset

    src = TracedRows(get_preset(preset, rays=rays), m)
    t0 = time.perf_counter()
    perm = compute_permutation(src, "rows+voxels")
    dt = time.perf_counter() - t0
    log(f"rows+voxels permutation from the matrix traced with {rays} rays per tube ({src.traced} nnz) in {dt:.1f} s")
    return perm, {"perm_rays": rays, "perm_nnz": src.traced, "perm_s": dt}


def traced_block(cfg, rows: np.ndarray, vinv: np.ndarray | None):
    """Rows ``rows`` of the preset (its rays), columns relabelled by ``vinv`` (``new = vinv[old]``)."""
    from mlemlib.matrix import CSRMatrix
    from mlemlib.scanner.system import trace_rows

    host = trace_rows(cfg, rows)
    if vinv is None:
        return host
    return CSRMatrix(host.indptr, vinv[host.indices].astype(np.int32), host.data, host.shape)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--preset", default="matrix3")
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-rows", type=int, default=0, help="only the first rows (a quick trial)")
    ap.add_argument("--perm-rays", type=int, default=16,
                    help="rays per tube of the matrix the permutation is computed from (1, 16, 81...)")
    ap.add_argument("--host-only", action="store_true", help="the permutation and the sampled reuse only")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from mlemlib import chunked
    from mlemlib.scanner import get_preset

    cfg = get_preset(args.preset)
    m = cfg.n_lors if not args.max_rows else min(cfg.n_lors, args.max_rows)
    n = cfg.n_voxels
    rec: dict = {"preset": args.preset, "rows": m, "cols": n, "blocks": args.blocks, "cpus": os.cpu_count()}
    t_all = time.perf_counter()
    perm, info = permutation(args.preset, m, args.perm_rays)
    rec.update(info)
    vinv = perm.inverse_voxels()
    # the chunk reuse of 16,384 rows in the scanner's order (from the middle) and in the new one (its first rows:
    # the reorder stage puts empty rows last), as a sample; the whole matrix's is measured below
    span = np.arange(m // 2, min(m, m // 2 + 16384), dtype=np.int64)
    for label, rows, vi in (("own", span, None), ("reordered", perm.rows[: len(span)], vinv)):
        got = chunked.sample_chunks(traced_block(cfg, rows, vi))
        rec[f"reuse_sample_{label}"] = None if got is None else got[0]
        log(f"chunk reuse of {len(rows)} rows, {label} order: {rec[f'reuse_sample_{label}']}")
    if args.host_only:
        (out / "matrix3_chunked.json").write_text(json.dumps(rec, indent=1))
        print(json.dumps(rec, indent=1))
        return 0

    import cupy as cp

    from mlemlib.backends import _compressed_cuda as gpu

    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    window = gpu.chunk_window()
    rec.update({"device": dev, "window": window})
    bounds = np.linspace(0, m, args.blocks + 1).astype(np.int64)
    parts, nnz, nbytes, sample = [], 0, 0, None
    t_trace = t_up = 0.0
    t0 = time.perf_counter()
    for b in range(args.blocks):
        r0, r1 = int(bounds[b]), int(bounds[b + 1])
        ta = time.perf_counter()
        host = traced_block(cfg, perm.rows[r0:r1], vinv)
        tb = time.perf_counter()
        d = gpu.DeviceChunked.upload(host, window=window, what=f"block {b}")
        tc = time.perf_counter()
        t_trace += tb - ta
        t_up += tc - tb
        if b == 0:
            sample = host.to_scipy().astype(np.float64)
        parts.append((r0, r1, d))
        nnz += int(host.nnz)
        nbytes += int(d.nbytes)
        del host
        el = time.perf_counter() - t0
        log(f"block {b + 1}/{args.blocks}: rows {r0}-{r1}, {d.nnz} nnz, {d.chunks} chunks, reuse {d.reuse:.2f}; "
            f"trace {tb - ta:.1f} s, chunk+upload {tc - tb:.1f} s; ETA {el / (b + 1) * (args.blocks - b - 1):.0f} s")
    rec.update({"nnz": nnz, "bytes": nbytes, "bytes_per_nnz": nbytes / nnz, "trace_s": t_trace, "upload_s": t_up,
                "chunks": sum(d.chunks for _, _, d in parts), "reuse": nnz / sum(int(d.voxels.size) for _, _, d in parts)})
    log(f"whole matrix on the GPU: {nnz} nnz, {rec['chunks']} chunks, reuse {rec['reuse']:.2f}, {nbytes / 1e9:.2f} GB "
        f"({rec['bytes_per_nnz']:.3f} bytes/nnz); trace {t_trace:.0f} s, chunk+upload {t_up:.0f} s")

    sys.path.insert(0, str(ROOT / "tools"))
    from device_onepass import copy_bandwidth, timer

    bw = copy_bandwidth()
    rng = np.random.default_rng(5)
    f = cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
    truth = cp.asarray(rng.uniform(0.0, 2.0, n).astype(np.float32))
    g = cp.empty(m, dtype=cp.float32)
    fp = cp.empty(m, dtype=cp.float32)
    bp = cp.empty(n, dtype=cp.float32)
    acc = cp.empty(n, dtype=cp.uint64)
    flag = cp.zeros(1, dtype=cp.int32)
    for r0, r1, d in parts:
        gpu.chunked_forward(d, truth, g[r0:r1])
    scale = gpu.chunk_scale(gpu.onepass_bound(g, f))

    def forward(sel):
        for r0, r1, d in sel:
            gpu.chunked_forward(d, f, fp[r0:r1])

    def step(sel):
        acc.fill(0)
        for r0, r1, d in sel:
            gpu.chunked_onepass_fixed(d, g[r0:r1], f, acc, fp[r0:r1], scale, flag)
        gpu.fixed_to_float(acc, bp, scale)

    # checks: block 0 against float64 on the host
    r0, r1, _ = parts[0]
    fhost = cp.asnumpy(f).astype(np.float64)
    ref_fp = sample @ fhost
    step(parts[:1])
    err_fp = float(np.linalg.norm(cp.asnumpy(fp[r0:r1]) - ref_fp) / np.linalg.norm(ref_fp))
    g0 = cp.asnumpy(g[r0:r1]).astype(np.float64)
    c0 = np.where(ref_fp > 0, g0 / np.where(ref_fp > 0, ref_fp, 1.0), 0.0)
    ref_bp = sample.T @ c0
    err_bp = float(np.linalg.norm(cp.asnumpy(bp) - ref_bp) / np.linalg.norm(ref_bp))
    del sample
    step(parts)
    again = bp.copy()
    step(parts)
    rec.update({"copy_bw_TBps": bw, "one_read_ms": nbytes / (bw * 1e12) * 1e3, "check_fp_block0": err_fp,
                "check_bp_block0": err_bp, "repeat_bit_identical": bool((bp == again).all()),
                "overflow_flag": int(flag.get()[0])})
    log(f"checks: block 0 fp rel.L2 {err_fp:.1e}, bp rel.L2 {err_bp:.1e} (float64 host); two steps bit-identical "
        f"{rec['repeat_bit_identical']}; overflow flag {rec['overflow_flag']}")
    cum = np.cumsum([d.nnz for _, _, d in parts])
    split = int(np.searchsorted(cum, cum[-1] / 2)) + 1
    halves = (parts[:split], parts[split:])
    rec["half_nnz"] = [int(sum(d.nnz for _, _, d in h)) for h in halves]
    for name, fn in (("forward", forward), ("onepass_chunked", step)):
        rec[f"{name}_ms"] = timer(args.repeat)(lambda fn=fn: fn(parts))
        rec[f"{name}_half_ms"] = [timer(args.repeat)(lambda fn=fn, h=h: fn(h)) for h in halves]
        log(f"{name}: {rec[f'{name}_ms']:.2f} ms over the whole matrix; halves "
            f"{rec[f'{name}_half_ms'][0]:.2f} / {rec[f'{name}_half_ms'][1]:.2f} ms")
    log(f"copy bandwidth {bw:.3f} TB/s; one read of the chunked matrix {rec['one_read_ms']:.2f} ms; "
        f"all in {time.perf_counter() - t_all:.0f} s")
    (out / "matrix3_chunked.json").write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
