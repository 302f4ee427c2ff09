"""Locality orders of LORs (rows) and voxels (columns) from the matrix alone: Hilbert keys (CPU; NumPy + Numba).

The forward projection ``A f`` gathers ``f`` at the column indices of a row
of ``A``, the back projection ``A^T c`` gathers ``c`` at the LOR indices of a
row of ``A^T``. A LOR order in which neighbouring LOR numbers cross the same
voxels makes the second local; a voxel order in which neighbouring voxel
numbers are neighbours in space makes the first local.

Provides

- :func:`compute_permutation` — streams the matrix once. Rows: each row's
  voxel distribution gives its centroid and principal direction (weighted
  first and second moments of the voxel centres); the line through the
  centroid along that direction meets the grid's bounding box at an entry and
  an exit point (about where the LOR enters and leaves the image, an image-side
  stand-in for its two detectors). Rows are sorted by the 6-D Hilbert index of
  the two points (put in a canonical order). Empty rows go last, in their
  order. Without a grid the key is the row's mean column index.
  Voxels: the 3-D Hilbert index of ``(x, y, z)``, from the grid alone.
- :func:`hilbert_keys`, :func:`voxel_permutation` — the curve itself.
- :func:`voxel_row_order`, :func:`transpose_row_order` — the order to take
  the rows of ``A^T`` in along the curve (a launch order of a back projection).
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import numpy as np
from numba import njit, prange

from mlemlib.errors import ConfigError, InputError
from mlemlib.permutation import (
    DEFAULT_CHUNK_NNZ,
    DEFAULT_MODE,
    Permutation,
    _already_reordered,
    _check_mode,
    _name,
    _open,
    _progress,
    fingerprint,
    permutation_of,
)

log = logging.getLogger(__name__)

#: Bits per coordinate of the rows' 6-D Hilbert key (6 x 10 = 60 bits of an int64).
ROW_KEY_BITS = 10

_NO_KEY = np.iinfo(np.int64).max  # key of an empty row: after every other

# --------------------------------------------------------------------------- keys (Numba)


@njit(parallel=True, cache=True)
def _row_moments(indptr, indices, data, gx, gy, out):  # pragma: no cover - compiled
    """Weighted moments of each row's voxel centres.

    ``out[i] = (w, sx, sy, sz, sxx, sxy, sxz, syy, syz, szz)`` with
    ``x = col % gx + 0.5``, ``y = (col // gx) % gy + 0.5``, ``z = col // (gx*gy) + 0.5``
    and ``w`` the sum of the row's values.
    """
    k = indptr.shape[0] - 1
    gxy = gx * gy
    for i in prange(k):
        w = sx = sy = sz = sxx = sxy = sxz = syy = syz = szz = 0.0
        for p in range(indptr[i], indptr[i + 1]):
            c = np.int64(indices[p])
            v = np.float64(data[p])
            x = np.float64(c % gx) + 0.5
            y = np.float64((c // gx) % gy) + 0.5
            z = np.float64(c // gxy) + 0.5
            w += v
            sx += v * x
            sy += v * y
            sz += v * z
            sxx += v * x * x
            sxy += v * x * y
            sxz += v * x * z
            syy += v * y * y
            syz += v * y * z
            szz += v * z * z
        out[i, 0] = w
        out[i, 1] = sx
        out[i, 2] = sy
        out[i, 3] = sz
        out[i, 4] = sxx
        out[i, 5] = sxy
        out[i, 6] = sxz
        out[i, 7] = syy
        out[i, 8] = syz
        out[i, 9] = szz


@njit(cache=True)
def _hilbert_one(x, bits):  # pragma: no cover - compiled
    """Hilbert index of the point ``x`` (int64[d], each in ``[0, 2**bits)``; overwritten).

    Skilling's algorithm (AIP Conf. Proc. 707, 2004): axes to "transposed"
    Hilbert coordinates, then their bits interleaved (axis 0 most significant).
    ``d * bits`` must be at most 63.
    """
    d = x.shape[0]
    m = np.int64(1) << (bits - 1)
    q = m
    while q > 1:
        p = q - 1
        for i in range(d):
            if x[i] & q:
                x[0] ^= p
            else:
                t = (x[0] ^ x[i]) & p
                x[0] ^= t
                x[i] ^= t
        q >>= 1
    for i in range(1, d):
        x[i] ^= x[i - 1]
    t = np.int64(0)
    q = m
    while q > 1:
        if x[d - 1] & q:
            t ^= q - 1
        q >>= 1
    for i in range(d):
        x[i] ^= t
    key = np.int64(0)
    for b in range(bits - 1, -1, -1):
        for i in range(d):
            key = (key << 1) | ((x[i] >> b) & 1)
    return key


@njit(parallel=True, cache=True)
def _hilbert_keys(coords, bits, out):  # pragma: no cover - compiled
    """``out[i]`` = Hilbert index of ``coords[i]`` (int64[k, d]), see :func:`_hilbert_one`."""
    k, d = coords.shape
    for i in prange(k):
        x = np.empty(d, np.int64)
        for j in range(d):
            x[j] = coords[i, j]
        out[i] = _hilbert_one(x, bits)


def hilbert_keys(coords: np.ndarray, bits: int) -> np.ndarray:
    """Hilbert indices (int64) of integer points ``coords`` (k x d, each coordinate in ``[0, 2**bits)``).

    Neighbouring indices are neighbouring points (the curve has no jumps), in
    any dimension ``d`` with ``d * bits <= 63``.
    """
    coords = np.ascontiguousarray(coords, dtype=np.int64)
    k, d = coords.shape
    if not 1 <= bits or d * bits > 63:
        raise ValueError(f"{d} dimensions x {bits} bits do not fit an int64 key")
    out = np.empty(k, dtype=np.int64)
    if k:
        _hilbert_keys(coords, np.int64(bits), out)
    return out


def voxel_permutation(grid: tuple[int, int, int]) -> np.ndarray:
    """The voxel order: columns sorted by the 3-D Hilbert index of ``(x, y, z)`` (int64[n], ``perm[new] = old``).

    Computed from the grid alone (``col = x + gx*(y + gy*z)``): a Hilbert curve
    over the smallest power-of-two cube holding the grid, visited where it
    lies inside the grid.
    """
    keys = _voxel_keys(grid, np.arange(math.prod(int(v) for v in grid), dtype=np.int64))
    return np.argsort(keys, kind="stable").astype(np.int64)


def _voxel_keys(grid: tuple[int, int, int], col: np.ndarray) -> np.ndarray:
    """3-D Hilbert index of each raster voxel ``col = x + gx*(y + gy*z)`` (int64) on the smallest
    power-of-two cube holding the grid."""
    gx, gy, gz = (int(v) for v in grid)
    bits = max(1, math.ceil(math.log2(max(gx, gy, gz))))
    return hilbert_keys(np.stack([col % gx, (col // gx) % gy, col // (gx * gy)], axis=1), bits)


def voxel_row_order(grid: tuple[int, int, int] | None, voxels: np.ndarray | None = None,
                    rows: tuple[int, int] | None = None) -> np.ndarray | None:
    """The order to take the rows of ``A^T`` (voxels) in: along the 3-D Hilbert curve (int64, or None).

    ``order[k]`` is the row taken k-th, counted from ``rows[0]``. Row ``j`` of
    ``A^T`` is column ``j`` of ``A``, the user's voxel ``voxels[j]`` in a
    reordered container (:attr:`Permutation.voxels`), else voxel ``j`` of the
    grid's raster order. Consecutive rows in this order are neighbours in space
    and gather nearly the same correlation entries (a launch order of the back
    projection, ``DeviceCSR.set_row_order``). None where there is no grid, or the rows
    already lie along the curve (a matrix generated or reordered with its
    voxels in Hilbert order).

    Parameters
    ----------
    grid
        ``(gx, gy, gz)`` or None.
    voxels
        The user's voxel of each column, or None (raster order).
    rows
        ``(r0, r1)``: only these rows (a partition's), numbered from ``r0``; default all.
    """
    if grid is None:
        return None
    n = math.prod(int(v) for v in grid)
    r0, r1 = (0, n) if rows is None else (int(rows[0]), int(rows[1]))
    if not 0 <= r0 <= r1 <= n:
        raise ValueError(f"rows [{r0}, {r1}) outside the grid's {n} voxels")
    col = np.arange(r0, r1, dtype=np.int64)
    if voxels is not None:
        if len(voxels) != n:
            raise ValueError(f"voxel permutation of {len(voxels)} entries for a grid of {n} voxels")
        col = np.asarray(voxels, dtype=np.int64)[r0:r1]
    keys = _voxel_keys(grid, col)
    if keys.size < 2 or bool(np.all(keys[1:] >= keys[:-1])):
        return None
    return np.argsort(keys, kind="stable").astype(np.int64)


def transpose_row_order(matrix: Any, rows: tuple[int, int] | None = None) -> np.ndarray | None:
    """:func:`voxel_row_order` for the transpose of ``matrix`` (a path or an opened matrix): from its grid
    and, in a reordered container, its voxel permutation. None for a matrix without a grid (an in-memory
    one, a ``.mtx``) or whose grid does not count its columns."""
    from mlemlib.formats import geometry_value, open_source

    if isinstance(matrix, (str, os.PathLike)):
        with open_source(matrix, "matrix") as src:
            return transpose_row_order(src, rows)
    grid = geometry_value(matrix, "grid")
    grid = tuple(int(v) for v in grid) if grid is not None and len(grid) == 3 else None
    shape = getattr(matrix, "shape", None)
    if grid is None or shape is None or math.prod(grid) != int(shape[1]):
        return None
    perm = permutation_of(matrix)
    return voxel_row_order(grid, perm.voxels if perm is not None else None, rows)


def _row_keys_geometric(mom: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
    """Row keys (int64) from the moments of :func:`_row_moments`: 6-D Hilbert index of entry and exit point."""
    k = mom.shape[0]
    keys = np.full(k, _NO_KEY, dtype=np.int64)
    w = mom[:, 0]
    ne = w > 0
    if not ne.any():
        return keys
    mo = mom[ne] / w[ne, None]
    c = mo[:, 1:4]
    cov = np.empty((len(mo), 3, 3))
    pairs = ((0, 0, 4), (0, 1, 5), (0, 2, 6), (1, 1, 7), (1, 2, 8), (2, 2, 9))
    for i, j, col in pairs:
        cov[:, i, j] = cov[:, j, i] = mo[:, col] - c[:, i] * c[:, j]
    _, vecs = np.linalg.eigh(cov)
    d = vecs[:, :, 2]  # the principal direction (largest eigenvalue)
    box = np.asarray(grid, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        t1 = (0.0 - c) / d
        t2 = (box - c) / d
    moving = np.abs(d) > 1e-12
    tmin = np.max(np.where(moving, np.minimum(t1, t2), -np.inf), axis=1)
    tmax = np.min(np.where(moving, np.maximum(t1, t2), np.inf), axis=1)
    p1 = c + tmin[:, None] * d
    p2 = c + tmax[:, None] * d
    # canonical order of the two points: by angle around the grid's axis, then z
    a1 = np.arctan2(p1[:, 1] - box[1] / 2, p1[:, 0] - box[0] / 2)
    a2 = np.arctan2(p2[:, 1] - box[1] / 2, p2[:, 0] - box[0] / 2)
    swap = (a1 > a2) | ((a1 == a2) & (p1[:, 2] > p2[:, 2]))
    q1 = np.where(swap[:, None], p2, p1)
    q2 = np.where(swap[:, None], p1, p2)
    scale = float(1 << ROW_KEY_BITS) / box
    pts = np.concatenate([q1 * scale, q2 * scale], axis=1)
    pts = np.clip(np.floor(pts), 0, (1 << ROW_KEY_BITS) - 1).astype(np.int64)
    keys[ne] = hilbert_keys(pts, ROW_KEY_BITS)
    return keys



# --------------------------------------------------------------------------- compute


def compute_permutation(
    source: Any,
    mode: str = DEFAULT_MODE,
    *,
    grid: tuple[int, int, int] | None = None,
    chunk_nnz: int = DEFAULT_CHUNK_NNZ,
    threads: int | None = None,
) -> Permutation:
    """Compute the locality permutation of a matrix, streaming it once.

    Parameters
    ----------
    source
        A matrix container path, an opened matrix or a :class:`CSRMatrix`.
    mode
        ``none`` (identity rows, voxel order kept), ``rows`` or ``rows+voxels``.
    grid
        ``(gx, gy, gz)``; default: the matrix's ``grid`` attribute. Without a
        grid rows are ordered by their mean column index and the voxel order
        is kept (with a warning for ``rows+voxels``).
    chunk_nnz
        Non-zeros per streamed chunk.
    threads
        Numba threads (None: all); the result does not depend on it.

    Returns
    -------
    Permutation

    Raises
    ------
    InputError
        The matrix is itself a reordered container (reorder the user's matrix).
    MatrixFormatError
        A corrupt matrix.
    ConfigError
        An unknown mode or a bad chunk size.
    """
    from mlemlib.transpose import numba_threads

    _check_mode(mode)
    if not isinstance(chunk_nnz, (int, np.integer)) or chunk_nnz < 1:
        raise ConfigError("chunk_nnz", f"{chunk_nnz!r} is not a positive number of non-zeros")
    src, opened = _open(source)
    try:
        name = _name(src)
        if _already_reordered(src):
            raise InputError(name, "is already a reordered matrix; reorder the user's matrix (from 'mlem convert')")
        m, n = (int(v) for v in src.shape)
        nnz = int(src.nnz)
        checksum = fingerprint(src)
        grid = tuple(int(v) for v in grid) if grid is not None else getattr(src, "grid", None)
        if grid is not None and math.prod(grid) != n:
            raise ConfigError("grid", f"grid {grid} does not multiply to n = {n} ({name})")
        voxels = None
        if mode == "none":
            return Permutation(np.arange(m, dtype=np.int64), None, mode, (m, n), nnz, checksum)
        if mode == "rows+voxels":
            if grid is None:
                log.warning("%s: no voxel grid: the voxel order is kept (rows only)", name)
            else:
                voxels = voxel_permutation(grid)
        keys = np.empty(m, dtype=np.int64)
        t0 = time.perf_counter()
        next_report = 0.1
        with numba_threads(threads):
            for r0, r1, block in src.iter_chunks(max_nnz=chunk_nnz):
                mom = np.empty((r1 - r0, 10), dtype=np.float64)
                ip = block.indptr - block.indptr[0]
                if r1 > r0:
                    gx, gy = (grid[0], grid[1]) if grid is not None else (max(n, 1), 1)
                    _row_moments(ip, block.indices, block.data, np.int64(gx), np.int64(gy), mom)
                if grid is not None:
                    keys[r0:r1] = _row_keys_geometric(mom, grid)
                else:
                    w = mom[:, 0]
                    mean = np.divide(mom[:, 1], w, out=np.zeros_like(w), where=w > 0)
                    # mean column index, scaled to keep sub-column order; empty rows last
                    keys[r0:r1] = np.where(w > 0, np.floor(mean * 1024.0).astype(np.int64), _NO_KEY)
                if m and r1 / m >= next_report:
                    _progress(name, "keys of", r1, m, t0)
                    next_report = r1 / m + 0.1
        rows = np.argsort(keys, kind="stable").astype(np.int64)
        log.info(
            "%s: %s permutation of %d rows%s in %.2f s",
            name, mode, m, f" and {n} voxels" if voxels is not None else "", time.perf_counter() - t0,
        )
        return Permutation(rows, voxels, mode, (m, n), nnz, checksum)
    finally:
        if opened:
            src.close()
