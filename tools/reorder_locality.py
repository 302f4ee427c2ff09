#!/usr/bin/env python3
"""The locality proxy of the reorder stage (docs/stages.md, "reorder"): a Markdown table.

For a matrix container (default: the ``small`` preset, generated into a
temporary directory) and a copy of it with its rows (LORs) shuffled, reports
the gather footprint of both projections (:func:`mlemlib.reorder.gather_locality`:
distinct 32-byte sectors touched per row, and per 32 consecutive rows) in the
stored order and after ``reorder: rows`` and ``reorder: rows+voxels``::

    PYTHONPATH=. python3 tools/reorder_locality.py
    PYTHONPATH=. python3 tools/reorder_locality.py results/small/matrix.h5 --seed 3

CPU only; the matrices are held in memory (a proxy for small and medium matrices).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlemlib import reorder  # noqa: E402
from mlemlib.formats.h5 import MatrixH5, write_matrix_h5  # noqa: E402
from mlemlib.matrix import CSRMatrix  # noqa: E402


def _permuted(a: CSRMatrix, perm: reorder.Permutation) -> CSRMatrix:
    s = a.to_scipy()[perm.rows]
    if perm.voxels is not None:
        s = s[:, perm.voxels]
        s.sort_indices()
    return CSRMatrix.from_scipy(s)


def _rows(label: str, path: Path) -> list[str]:
    with MatrixH5(path) as f:
        a = f.to_csr()
    lines = []
    for mode in reorder.MODES:
        t0 = time.perf_counter()
        perm = reorder.compute_permutation(path, mode)
        seconds = time.perf_counter() - t0
        b = _permuted(a, perm)
        one = reorder.locality(b)
        win = reorder.locality(b, window=32)
        name = "stored order" if mode == "none" else mode
        lines.append(
            f"| {label} | {name} | {one['A']['sectors_per_row']:.1f} | {one['A']['sectors_per_nnz']:.3f} | "
            f"{win['A']['sectors_per_nnz']:.3f} | {one['AT']['sectors_per_row']:.1f} | "
            f"{one['AT']['sectors_per_nnz']:.3f} | {win['AT']['sectors_per_nnz']:.3f} | {seconds:.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("matrix", nargs="?", help="matrix container (default: generate the small preset)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the row shuffle")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.matrix is None:
            from mlemlib.formats import convert
            from mlemlib.scanner import generate

            csr4 = tmp / "small.csr4"
            generate("small", csr4)
            path = tmp / "small.h5"
            convert(csr4, path)
        else:
            path = Path(args.matrix)
        with MatrixH5(path) as f:
            a = f.to_csr()
            grid, voxel_size = f.grid, f.voxel_size
        shuf = np.random.default_rng(args.seed).permutation(a.shape[0])
        shuffled = tmp / "shuffled.h5"
        write_matrix_h5(shuffled, CSRMatrix.from_scipy(a.to_scipy()[shuf]), grid=grid, voxel_size=voxel_size)
        reorder.compute_permutation(path, "rows")  # compile the kernels before timing
        m, n = a.shape
        print(f"{path.name}: {m} x {n}, {a.nnz} non-zeros, grid {grid}")
        print()
        print(
            "| matrix | order | A sectors/row | A sectors/nnz | A sectors/nnz (32 rows) | "
            "A^T sectors/row | A^T sectors/nnz | A^T sectors/nnz (32 rows) | permutation s |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for line in _rows(path.stem, path) + _rows(f"{path.stem}, rows shuffled", shuffled):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
