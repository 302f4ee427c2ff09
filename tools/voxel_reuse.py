#!/usr/bin/env python3
"""How many global atomics a shared-memory scatter would save: voxel reuse per chunk of rows (CPU).

For a scanner preset traced in memory, groups its rows (in the scanner's own
order, and in the reorder stage's ``rows`` order) greedily into chunks whose
distinct voxels fit a shared-memory window, and prints
:func:`mlemlib.reorder.voxel_reuse` for each window: a one-pass or scatter
kernel that accumulated each chunk in shared memory would make ``nnz /
reuse`` global atomics instead of ``nnz`` (docs/benchmarks.md section 33)::

    PYTHONPATH=. python3 tools/voxel_reuse.py --preset madpet2 --rays 16
    PYTHONPATH=. python3 tools/voxel_reuse.py --preset small --windows 512,2048

Holds the traced matrix in memory (madpet2 at 16 rays: 5 GB).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlemlib import reorder  # noqa: E402
from mlemlib.scanner import get_preset  # noqa: E402
from mlemlib.scanner.system import trace_rows  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="madpet2")
    ap.add_argument("--rays", type=int, default=None, help="rays per tube (default: the preset's)")
    ap.add_argument("--windows", default="8192,16384,24576,49152", help="voxels a chunk may hold")
    args = ap.parse_args(argv)
    cfg = get_preset(args.preset, rays=args.rays)
    t0 = time.perf_counter()
    a = trace_rows(cfg, np.arange(cfg.n_lors, dtype=np.int64))
    t1 = time.perf_counter()
    perm = reorder.compute_permutation(a, "rows", grid=cfg.grid)
    t2 = time.perf_counter()
    print(f"{args.preset} (rays {cfg.rays}): {a.shape[0]} x {a.shape[1]}, {a.nnz} nnz; traced in {t1 - t0:.1f} s, "
          f"permutation in {t2 - t1:.1f} s")
    print()
    print("| row order | window (voxels) | chunks | rows per chunk | nnz per chunk | reuse (nnz / distinct) |")
    print("|---|---|---|---|---|---|")
    nonempty = np.diff(np.asarray(a.indptr)) > 0
    orders = {"scanner's own": np.flatnonzero(nonempty), "reorder: rows": perm.rows[nonempty[perm.rows]]}
    for name, rows in orders.items():
        for w in (int(v) for v in args.windows.split(",")):
            r = reorder.voxel_reuse(a, window=w, rows=rows)
            print(f"| {name} | {w} | {r['chunks']} | {r['rows_per_chunk']:.1f} | {r['nnz_per_chunk']:.0f} | "
                  f"{r['reuse']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
