#!/usr/bin/env python3
"""What 16-bit values cost an MLEM image: float16 with a row scale (``compressed-f16``) against a per-row 16-bit
fixed point, on the CPU in float64 (no GPU).

Usage::

    PYTHONPATH=. python3 tools/lossy_values.py --preset small [--iterations 100] [--out lossy.json]
    PYTHONPATH=. python3 tools/lossy_values.py --preset pet-bench       # madpet2 cut to 4 rings, 140 x 140 x 20
    PYTHONPATH=. python3 tools/lossy_values.py --matrix M.h5

The matrix's values are replaced by (1) ``compressed-f16``'s decoded values
(:class:`mlemlib.compressed.CompressedMatrix`: float16 times a power-of-two
row scale, 11 significant bits) and (2) a per-row 16-bit fixed point,
``rint(a_ij / max_i * 65535) * max_i / 65535`` (every value of a row on the
same grid of 65,536 steps up to the row's largest: absolute error at most
``max_i / 131070``) and (3) ``compressed-u16``'s decoded values (the format's
fixed point: (2) with the step ``float32(max_i / 65535)``, the decode rounded to float32);
each runs a float64 MLEM from the same start on a
noiseless measurement of a random phantom (seeded), and its image is
compared with the float32 values' image (relative L2) after ``--iterations``
and at 10, 20 and 50. Prints a table; ``--out`` writes it as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHECKPOINTS = (10, 20, 50)


def load(args) -> tuple[str, object]:
    """(label, SciPy CSR float64) of the matrix asked for."""
    from mlemlib.formats import open_matrix
    from mlemlib.scanner import get_preset
    from mlemlib.scanner.system import trace_rows

    if args.matrix:
        src = open_matrix(args.matrix)
        return str(args.matrix), src.read_rows(0, src.shape[0]).to_scipy().astype(np.float64)
    cfg = get_preset("madpet2" if args.preset == "pet-bench" else args.preset)
    if args.preset == "pet-bench":  # tools/transpose_bench/make.py's PET-like matrix
        cfg = dataclasses.replace(cfg, name="bench", layers=cfg.layers[:1], n_rings=4, ring_gaps=(0.3,) * 3,
                                  grid=(140, 140, 20), voxel_size=(0.5, 0.5, 0.43), rays=16).validate("bench")
    a = trace_rows(cfg, np.arange(cfg.n_lors, dtype=np.int64))
    return args.preset, a.to_scipy().astype(np.float64)


def per_row_fixed16(a):
    """``a`` with every value on its row's grid of 65,536 steps up to the row's largest value."""
    b = a.tocsr(copy=True)
    lengths = np.diff(b.indptr)
    rowmax = np.zeros(b.shape[0])
    full = lengths > 0
    rowmax[full] = np.maximum.reduceat(b.data, b.indptr[:-1][full])
    scale = np.repeat(rowmax, lengths)
    b.data = np.rint(b.data / scale * 65535.0) * (scale / 65535.0)
    return b


def mlem_images(a, g, iterations: int) -> dict[int, np.ndarray]:
    """Float64 MLEM from the uniform start: the image at each checkpoint and at ``iterations``."""
    n = a.shape[1]
    norm = np.asarray(a.sum(axis=0)).ravel()
    norm[norm == 0] = 1.0
    f = np.full(n, g.sum() / norm.sum())
    at = a.T.tocsr()
    out = {}
    for it in range(1, iterations + 1):
        fp = a @ f
        c = np.divide(g, fp, out=np.zeros_like(fp), where=fp > 0)
        f = f * (at @ c) / norm
        if it in CHECKPOINTS or it == iterations:
            out[it] = f.copy()
    return out


def main(argv=None) -> int:
    from mlemlib.compressed import CompressedMatrix
    from mlemlib.matrix import CSRMatrix

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", choices=("small", "pet-bench"))
    ap.add_argument("--matrix", default=None, help="a matrix file instead of a preset")
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    label, a = load(args)
    a.sort_indices()
    print(f"{label}: {a.shape[0]:,} x {a.shape[1]:,}, {a.nnz:,} nnz ({time.perf_counter() - t0:.1f} s)", flush=True)
    rng = np.random.default_rng(1)
    g = a @ rng.uniform(0.5, 1.5, a.shape[1])
    csr = CSRMatrix.from_scipy(a.astype(np.float32))
    variants = {
        "float32 values": csr.to_scipy().astype(np.float64),
        "compressed-f16 (float16 x power-of-two row scale)": CompressedMatrix.from_csr(
            csr, "compressed-f16", validate=False).to_csr().to_scipy().astype(np.float64),
        "per-row 16-bit fixed point": per_row_fixed16(csr.to_scipy().astype(np.float64)),
        "compressed-u16 (uint16 x float32 row scale)": CompressedMatrix.from_csr(
            csr, "compressed-u16", validate=False).to_csr().to_scipy().astype(np.float64),
    }
    images = {name: mlem_images(v, g, args.iterations) for name, v in variants.items()}
    ref = images["float32 values"]
    base = variants["float32 values"].data
    rows = []
    for name, v in variants.items():
        err = {it: float(np.linalg.norm(img - ref[it]) / np.linalg.norm(ref[it])) for it, img in images[name].items()}
        rows.append({"values": name, "value_rel_l2": float(np.linalg.norm(v.data - base) / np.linalg.norm(base)),
                     "image_rel_l2": err})
    its = sorted(rows[0]["image_rel_l2"])
    print("| values | values' rel. L2 | " + " | ".join(f"image after {i}" for i in its) + " |")
    print("|---|---|" + "---|" * len(its))
    for r in rows:
        print(f"| {r['values']} | {r['value_rel_l2']:.1e} | "
              + " | ".join(f"{r['image_rel_l2'][i]:.1e}" for i in its) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"matrix": label, "shape": list(a.shape), "nnz": int(a.nnz),
                                              "iterations": args.iterations, "rows": rows}, indent=1))
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
