"""How many distinct voxels a group of k neighbouring LORs touches, per non-zero (CPU, any preset).

The one pass over Matrix 3 is bound by the L2 cache: one gather of f and one
atomic add to the back projection per non-zero (benchmarks.md section 53).
Rows stored as groups of k LORs over the union of their columns (one column
code, a mask of the rows that have it, their values) would need one gather
and one atomic per distinct column of the group instead: this script
measures ``union / nnz`` for groups of

- ``fan``: k consecutive rows of the scanner's own order (crystal i with
  crystals j .. j + k - 1: LORs that share an end);
- ``parallel``: both ends shifted together along their rings (crystals
  (i + d, j + d), d < k: neighbouring parallel LORs);
- ``axial``: both ends shifted together by a ring.

Each group starts at a random LOR (fixed seed). Run from the repository root:
``python3 tools/row_group_union.py --preset matrix3 --groups 40``.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> int:
    from mlemlib.scanner import get_preset
    from mlemlib.scanner.system import trace_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="matrix3")
    ap.add_argument("--groups", type=int, default=40, help="groups per kind and size")
    ap.add_argument("--sizes", default="2,4,8,16,32")
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args(argv)

    cfg = get_preset(args.preset)
    ncr, cpr, rings = cfg.n_crystals, cfg.crystals_per_ring, cfg.n_rings
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    print(f"{args.preset}: {cfg.shape[0]} x {cfg.shape[1]}, {ncr} crystals ({cpr} per ring, {rings} rings)")
    print("| grouping | k | groups | non-zeros | distinct voxels / non-zeros |")
    print("|---|---|---|---|---|")
    for kind in ("fan", "parallel", "axial"):
        for k in (int(v) for v in args.sizes.split(",")):
            if kind == "axial" and k > rings:
                continue  # no group of k rings
            union = nnz = groups = 0
            while groups < args.groups:
                ri, rj = rng.integers(0, rings, 2)
                ki, kj = rng.integers(0, cpr, 2)
                d = np.arange(k)
                if kind == "fan":
                    i = np.full(k, ri * cpr + ki)
                    j = rj * cpr + (kj + d) % cpr
                elif kind == "parallel":
                    i = ri * cpr + (ki + d) % cpr
                    j = rj * cpr + (kj + d) % cpr
                else:
                    if max(ri, rj) + k > rings:
                        continue
                    i = (ri + d) * cpr + ki
                    j = (rj + d) * cpr + kj
                a = trace_rows(cfg, (i * ncr + j).astype(np.int64))
                if a.indptr[-1] == 0:
                    continue  # LORs that miss the field of view
                union += np.unique(a.indices).size
                nnz += int(a.indptr[-1])
                groups += 1
            print(f"| {kind} | {k} | {groups} | {nnz} | {union / nnz:.3f} |")
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
