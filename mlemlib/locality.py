"""The locality proxy of a matrix's SpMV: distinct memory sectors a row's gather touches (CPU; NumPy + Numba).

Provides :func:`gather_locality` (streamed, any opened matrix),
:func:`locality` (of ``A`` and ``A^T``, in memory) and :func:`voxel_reuse`
(how often a chunk of consecutive rows reuses its voxels).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from mlemlib.matrix import CSRMatrix
from mlemlib.permutation import DEFAULT_CHUNK_NNZ, _open

@njit(parallel=True, cache=True)
def _window_sectors(indptr, indices, per, window, out):  # pragma: no cover - compiled
    """``out[i]`` = distinct values of ``indices // per`` in rows ``[i*window, (i+1)*window)``."""
    k = indptr.shape[0] - 1
    for i in prange(out.shape[0]):
        a = indptr[i * window]
        b = indptr[min((i + 1) * window, k)]
        if b == a:
            out[i] = 0
            continue
        s = np.empty(b - a, np.int64)
        for t in range(b - a):
            s[t] = np.int64(indices[a + t]) // per
        s.sort()
        c = 1
        for t in range(1, b - a):
            if s[t] != s[t - 1]:
                c += 1
        out[i] = c


def gather_locality(
    source: Any,
    *,
    window: int = 1,
    sector_bytes: int = 32,
    itemsize: int = 4,
    chunk_nnz: int = DEFAULT_CHUNK_NNZ,
) -> dict[str, float]:
    """The gather footprint of a CSR matrix's SpMV: distinct memory sectors touched per row.

    A row gathers ``x`` (float32) at its column indices; a GPU reads memory
    in 32-byte sectors, 8 float32 entries each. Fewer distinct sectors per
    row (relative to its non-zeros) means a more local gather. With
    ``window = w`` the sectors are counted per group of ``w`` consecutive
    rows (what a thread block, or a cache shared by neighbouring rows, sees).

    Returns
    -------
    dict
        ``sectors_per_row`` (mean over non-empty rows; per window: the total
        over the non-empty rows' count), ``sectors_per_nnz`` (total over
        total: 1/8 is ideal, 1 is fully scattered), ``nnz_per_row``, ``rows``
        (non-empty), ``window``.
    """
    per = max(1, sector_bytes // itemsize)
    window = max(1, int(window))
    src, opened = _open(source)
    try:
        total = 0
        nnz = 0
        rows = 0
        for r0, r1, block in src.iter_chunks(max_nnz=chunk_nnz):
            ip = block.indptr - block.indptr[0]
            out = np.zeros(-(-(r1 - r0) // window), dtype=np.int64)
            if r1 > r0:
                _window_sectors(ip, block.indices, np.int64(per), np.int64(window), out)
            total += int(out.sum())
            nnz += int(ip[-1])
            rows += int(np.count_nonzero(np.diff(ip)))
    finally:
        if opened:
            src.close()
    return {
        "sectors_per_row": total / rows if rows else 0.0,
        "sectors_per_nnz": total / nnz if nnz else 0.0,
        "nnz_per_row": nnz / rows if rows else 0.0,
        "rows": rows,
        "window": window,
    }


def voxel_reuse(matrix: CSRMatrix, *, window: int = 16384, rows: np.ndarray | None = None) -> dict[str, float]:
    """How often a chunk of consecutive rows reuses its voxels: the atomics a shared-memory scatter saves.

    The rows (``rows``: an order of them; default: the stored order, empty
    rows skipped) are grouped greedily into chunks whose distinct columns
    fit ``window`` (a chunk's voxels held in shared memory: 16,384 float32
    and their 16,384 partial sums take 128 KB); a row with more distinct
    columns than ``window`` is a chunk of its own. A one-pass or scatter
    kernel that accumulates each chunk in shared memory and then adds its
    distinct voxels to global memory makes ``nnz / reuse`` global atomics
    instead of ``nnz``.

    Returns
    -------
    dict
        ``chunks``, ``nnz_per_chunk``, ``rows_per_chunk``, ``reuse`` (non-zeros
        over the distinct columns summed over chunks; 1 = no reuse), ``window``.
    """
    ip = np.asarray(matrix.indptr, dtype=np.int64)
    if rows is None:
        rows = np.flatnonzero(np.diff(ip))
    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) and (rows.min() < 0 or rows.max() >= matrix.shape[0]):
        raise ValueError(f"rows must lie in [0, {matrix.shape[0]})")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    from mlemlib.chunked import greedy_chunks

    starts, distinct = greedy_chunks(ip, np.asarray(matrix.indices), rows, int(matrix.shape[1]), int(window))
    chunks = len(distinct)
    total = int(distinct.sum())
    nnz = int((ip[rows + 1] - ip[rows]).sum()) if len(rows) else 0
    return {
        "chunks": int(chunks),
        "nnz_per_chunk": nnz / chunks if chunks else 0.0,
        "rows_per_chunk": len(rows) / chunks if chunks else 0.0,
        "reuse": nnz / total if total else 1.0,
        "window": int(window),
    }


def locality(matrix: CSRMatrix, *, window: int = 1) -> dict[str, dict[str, float]]:
    """:func:`gather_locality` of ``A`` (forward projection) and of ``A^T`` (back projection), in memory."""
    from mlemlib.transpose import transpose

    return {
        "A": gather_locality(matrix, window=window),
        "AT": gather_locality(transpose(matrix, "scipy"), window=window),
    }
