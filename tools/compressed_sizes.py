"""Bytes per non-zero of the compressed formats (layout 2) with 8- and 16-bit codes, on scanner matrices and their transposes.

Usage: ``PYTHONPATH=. python tools/compressed_sizes.py [small] [madpet2] [bench]`` (all three by default):

- ``small``: the whole ``small`` preset (every row traced, as ``mlem generate --preset small``) and its transpose;
- ``madpet2``: 3,000 random rows of the ``madpet2`` preset (``trace_rows``), and their transpose;
- ``madpet2T``: rows of the ``madpet2`` transpose (every 50th voxel: all LORs through it), from a streamed trace
  of every LOR;
- ``bench``: the PET-like matrix of docs/stages.md (``tools/transpose_bench/make.py``: madpet2 cut to one layer,
  4 rings, a 140 x 140 x 20 grid) and its transpose (rows = voxels, the matrix of the back projection).

Prints one line per matrix and format: nnz, rows, CSR bytes/nnz, compressed with 8 and 16 bits, the width the
encoder chooses, and the share of markers and pads. Nothing is encoded twice: the sizes come from
:func:`mlemlib.compressed.encoded_nbytes` (checked against a real encoding for the chosen width).
"""

import dataclasses
import sys
import time

import numpy as np

from mlemlib.compressed import CompressedMatrix, csr_bytes_per_nnz, encoded_nbytes
from mlemlib.matrix import CSRMatrix
from mlemlib.scanner import get_preset
from mlemlib.scanner.system import trace_rows


def report(name: str, a: CSRMatrix) -> None:
    m = a.shape[0]
    for fmt in ("compressed", "compressed-f16"):
        nb = encoded_nbytes(a, fmt)
        c = CompressedMatrix.from_csr(a, fmt, validate=False)
        assert c.nbytes == min(nb.values())
        markers = int(np.count_nonzero((c.codes >= c.code_high) & (c.value_bits() != 0)))
        pads = c.slots - c.nnz - markers
        other = CompressedMatrix.from_csr(a, fmt, code_bits=24 - c.code_bits, validate=False)
        markers_other = int(np.count_nonzero((other.codes >= other.code_high) & (other.value_bits() != 0)))
        print(
            f"{name:<22} {fmt:<15} nnz {a.nnz:>11,} rows {m:>9,} ({a.nnz / max(m, 1):7.1f}/row)  "
            f"csr {csr_bytes_per_nnz(m, a.nnz):.3f}  8-bit {nb[8] / a.nnz:.3f}  16-bit {nb[16] / a.nnz:.3f}  "
            f"-> {c.code_bits}  (markers {100 * markers / a.nnz:.1f}%, pads {100 * pads / a.nnz:.1f}% of nnz; "
            f"{other.code_bits}-bit markers {100 * markers_other / a.nnz:.1f}%)",
            flush=True,
        )


def transpose(a: CSRMatrix) -> CSRMatrix:
    return CSRMatrix.from_scipy(a.to_scipy().T.tocsr())


def main(which) -> None:
    if "small" in which:
        cfg = get_preset("small")
        a = trace_rows(cfg, np.arange(cfg.n_lors))
        report("small A", a)
        report("small A^T", transpose(a))
    if "madpet2" in which:
        cfg = get_preset("madpet2")
        rows = np.sort(np.random.default_rng(0).choice(cfg.n_lors, 3000, replace=False))
        t0 = time.time()
        a = trace_rows(cfg, rows)
        print(f"(madpet2 rows traced in {time.time() - t0:.0f} s)", flush=True)
        report("madpet2 3000 rows A", a)
        report("madpet2 3000 rows A^T", transpose(a))
    if "madpet2T" in which:
        cfg = get_preset("madpet2")
        n_lors, n_vox = cfg.n_lors, int(np.prod(cfg.grid))
        keep = np.arange(7, n_vox, 50)
        vox, lor = [], []
        t0 = time.time()
        step = 1 << 16
        for r0 in range(0, n_lors, step):
            rows = np.arange(r0, min(n_lors, r0 + step))
            b = trace_rows(cfg, rows)
            sel = (b.indices % 50) == 7
            vox.append(b.indices[sel] // 50)
            lor.append(np.repeat(rows, np.diff(b.indptr))[sel])
        print(f"(madpet2 traced in {time.time() - t0:.0f} s)", flush=True)
        import scipy.sparse as sp

        v, lo = np.concatenate(vox), np.concatenate(lor)
        t = sp.csr_matrix((np.ones(len(v), np.float32), (v, lo)), shape=(len(keep), n_lors))
        t.sort_indices()
        report("madpet2 A^T 1/50 voxels", CSRMatrix.from_scipy(t))
    if "bench" in which:
        c = get_preset("madpet2")
        cfg = dataclasses.replace(c, name="bench", layers=c.layers[:1], n_rings=4, ring_gaps=(0.3,) * 3,
                                  grid=(140, 140, 20), voxel_size=(0.5, 0.5, 0.43), rays=16).validate("bench")
        t0 = time.time()
        a = trace_rows(cfg, np.arange(cfg.n_lors))
        print(f"(bench traced in {time.time() - t0:.0f} s)", flush=True)
        report("bench A", a)
        report("bench A^T", transpose(a))


if __name__ == "__main__":
    main(sys.argv[1:] or ["small", "madpet2", "madpet2T", "bench"])
