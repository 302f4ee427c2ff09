"""Locality permutations of the system matrix: LORs (rows) and voxels (columns); CPU (NumPy + Numba).

The ``reorder`` stage renumbers the rows and, optionally, the columns of
``A`` so that the gathers of both projections touch memory that lies close
together: the forward projection ``A f`` gathers ``f`` at the column indices
of a row of ``A``, the back projection ``A^T c`` gathers ``c`` at the LOR
indices of a row of ``A^T``. A LOR order in which neighbouring LOR numbers
cross the same voxels makes the second local; a voxel order in which
neighbouring voxel numbers are neighbours in space makes the first local.
Both permutations are computed from the matrix alone (and its voxel grid).

Provides

- :class:`Permutation` — ``rows[new] = old`` (int64, m) and optionally
  ``voxels[new] = old`` (int64, n), tied to the matrix they were computed
  from by that matrix's container checksum.
- :func:`compute_permutation` — streams the matrix once. Rows: each row's
  voxel distribution gives its centroid and principal direction (weighted
  first and second moments of the voxel centres); the line through the
  centroid along that direction meets the grid's bounding box at an entry and
  an exit point (about where the LOR enters and leaves the image, an image-side
  stand-in for its two detectors). Rows are sorted by the 6-D Hilbert index of
  the two points (put in a canonical order). Empty rows go last, in their
  order. Without a grid the key is the row's mean column index.
  Voxels: the 3-D Hilbert index of ``(x, y, z)``, from the grid alone.
- :func:`relabel_columns` — one row block with its columns renamed and each
  row sorted again (in memory).
- :func:`apply` — writes the permuted matrix (:mod:`mlemlib.formats.h5`
  container plus the permutations) streaming: the source is read in row
  chunks in file order and each row is copied to its new place in one
  output buffer (one copy of the matrix in host memory, or ``1/passes`` of
  it with several passes over the source).
- :func:`reorder_file` — the stage: compute (or read) and apply.
- :func:`write_permutation`, :func:`read_permutation` — a standalone
  ``perm.h5``; :func:`permutation_of` — the permutation stored in a reordered
  container (None for any other matrix). Both validate: right lengths, each
  index exactly once, and (where given) the matrix the permutation belongs to.
- :func:`to_permuted_measurement`, :func:`measurement_to_user_order`,
  :func:`image_to_user_order`, :func:`image_to_permuted_order` — the maps
  between the user's order and the permuted space of a reconstruction (NumPy
  or CuPy arrays; the result lives where the input lives).
- :func:`gather_locality`, :func:`locality` — the locality proxy: distinct
  32-byte sectors touched per row (gather footprint) of ``A`` and ``A^T``.

Convention: row ``r'`` of the permuted matrix is row ``rows[r']`` of the
user's matrix; its column ``j'`` is the user's column ``voxels[j']``. So
``A' = A[rows][:, voxels]``, ``g' = g[rows]`` and ``f = f'`` scattered back
with ``f[voxels] = f'``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit, prange

from mlemlib.errors import ConfigError, InputError, MatrixFormatError
from mlemlib.matrix import CSRMatrix

log = logging.getLogger(__name__)

#: Reorder modes, as the config key ``reorder`` and ``mlem reorder --mode`` name them.
MODES = ("none", "rows", "rows+voxels")
#: The mode the workflow uses by default (docs/stages.md, "reorder", says why).
DEFAULT_MODE = "rows+voxels"

PERM_FORMAT = "mlem-permutation"
PERM_VERSION = 1
#: Attributes of a reordered matrix container (besides the container's own).
ATTR_MODE = "reorder_mode"
ATTR_SOURCE = "reorder_source"
ATTR_SOURCE_CHECKSUM = "reorder_source_checksum"
ATTR_PERM_CHECKSUM = "reorder_perm_checksum"
#: Bits per coordinate of the rows' 6-D Hilbert key (6 x 10 = 60 bits of an int64).
ROW_KEY_BITS = 10
#: Default non-zeros per streamed chunk (as the other stages).
DEFAULT_CHUNK_NNZ = 1 << 26

_NO_KEY = np.iinfo(np.int64).max  # key of an empty row: after every other


# --------------------------------------------------------------------------- the permutation


@dataclass(frozen=True)
class Permutation:
    """Row and voxel permutations of one matrix.

    Attributes
    ----------
    rows
        int64[m]: new row ``r'`` is the user's row ``rows[r']``.
    voxels
        int64[n] or None (voxel order kept): new column ``j'`` is the user's column ``voxels[j']``.
    mode
        ``none``, ``rows`` or ``rows+voxels`` (what was asked; ``voxels`` is
        None also for ``rows+voxels`` on a matrix without a grid).
    shape, nnz
        Of the matrix.
    source_checksum
        The container checksum of the user's (unpermuted) matrix: the
        permutation belongs to that matrix only.
    """

    rows: np.ndarray
    voxels: np.ndarray | None
    mode: str
    shape: tuple[int, int]
    nnz: int
    source_checksum: str

    @property
    def m(self) -> int:
        return int(self.shape[0])

    @property
    def n(self) -> int:
        return int(self.shape[1])

    def inverse_rows(self) -> np.ndarray:
        """int64[m]: ``inv[old] = new``."""
        return _inverse(self.rows)

    def inverse_voxels(self) -> np.ndarray | None:
        """int64[n] ``inv[old] = new``, or None when the voxel order is kept."""
        return None if self.voxels is None else _inverse(self.voxels)

    @property
    def checksum(self) -> str:
        """blake2b-256 of the little-endian int64 bytes of ``rows`` then ``voxels`` (if any), hex."""
        h = hashlib.blake2b(digest_size=32)
        h.update(np.ascontiguousarray(self.rows, dtype="<i8").tobytes())
        if self.voxels is not None:
            h.update(np.ascontiguousarray(self.voxels, dtype="<i8").tobytes())
        return h.hexdigest()

    def is_identity(self) -> bool:
        """True when neither rows nor voxels move."""
        ident = bool(np.array_equal(self.rows, np.arange(self.m)))
        return ident and (self.voxels is None or bool(np.array_equal(self.voxels, np.arange(self.n))))


def _inverse(p: np.ndarray) -> np.ndarray:
    inv = np.empty(len(p), dtype=np.int64)
    inv[p] = np.arange(len(p), dtype=np.int64)
    return inv


def check_permutation(p: Any, length: int, source: str | os.PathLike, what: str) -> np.ndarray:
    """``p`` as int64 after checking that it holds each of ``0 .. length-1`` exactly once.

    Raises
    ------
    MatrixFormatError
        Naming ``source`` and ``what``: not a 1-D integer array, the wrong
        length, an index out of range, or an index that repeats (and one that
        is missing).
    """
    a = np.asarray(p)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise MatrixFormatError(source, f"{what} is {a.dtype}{list(a.shape)}, expected a 1-D integer array")
    if a.shape[0] != length:
        raise MatrixFormatError(source, f"{what} has {a.shape[0]} entries, expected {length}")
    a = a.astype(np.int64, copy=False)
    if length == 0:
        return a
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= length:
        bad = lo if lo < 0 else hi
        raise MatrixFormatError(source, f"{what} holds index {bad}, outside [0, {length})")
    counts = np.bincount(a, minlength=length)
    if counts.max() > 1:
        dup = int(np.argmax(counts > 1))
        missing = int(np.argmax(counts == 0))
        raise MatrixFormatError(
            source, f"{what} is not a permutation: index {dup} appears {int(counts[dup])} times, {missing} never"
        )
    return a


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError("reorder", f"mode {mode!r}, expected one of {', '.join(MODES)}")
    return mode


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
    and gather nearly the same correlation entries (a candidate launch order of
    the back projection, ``DeviceCSR.set_row_order``; measured in
    docs/benchmarks.md section 85). None where there is no grid, or the rows
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


# --------------------------------------------------------------------------- sources


def _open(source: Any) -> tuple[Any, bool]:
    """An opened matrix (reader interface) and whether this call opened it."""
    if isinstance(source, (str, os.PathLike)):
        from mlemlib.formats.h5 import MatrixH5

        return MatrixH5(source), True
    if isinstance(source, CSRMatrix):
        from mlemlib.formats._memory import InMemoryMatrix

        return InMemoryMatrix(source, "<matrix in memory>"), True
    if hasattr(source, "iter_chunks") and hasattr(source, "shape"):
        return source, False
    raise ConfigError("matrix", f"expected a matrix container path, a CSRMatrix or an opened matrix, got {type(source).__name__}")


def _name(src: Any) -> str:
    return os.fspath(getattr(src, "source", None) or getattr(src, "path", None) or "<matrix>")


def fingerprint(source: Any) -> str:
    """The identity of a matrix: its container checksum (computed for an in-memory matrix)."""
    src, opened = _open(source)
    try:
        checksum = getattr(src, "checksum", None)
        if checksum:
            return str(checksum)
        matrix = getattr(src, "matrix", None)
        if isinstance(matrix, CSRMatrix):
            from mlemlib.formats.h5 import checksum_arrays

            return checksum_arrays(matrix.indptr, matrix.indices, matrix.data)
        raise ConfigError(_name(src), "no checksum to tie a permutation to: convert it first ('mlem convert')")
    finally:
        if opened:
            src.close()


def _already_reordered(src: Any) -> bool:
    attrs = getattr(src, "attrs", None) or {}
    return ATTR_MODE in attrs


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


def _progress(name: str, what: str, row: int, m: int, t0: float, done: int | None = None, total: int | None = None) -> None:
    """Log rows done and the ETA; ``done``/``total`` count the work of every pass (default ``row``/``m``)."""
    done, total = (row, m) if done is None or total is None else (done, total)
    el = time.perf_counter() - t0
    eta = el * (total - done) / done if done else float("nan")
    log.info("%s: %s rows up to %d of %d (%.0f%% of the work), ETA %.1f s", name, what, row, m, 100.0 * done / total, eta)


# --------------------------------------------------------------------------- apply


@njit(parallel=True, cache=True)
def _scatter_rows(ip, idx, dat, r0, inv_rows, out_ip, lo_row, hi_row, base, vinv, relabel, out_idx, out_dat):  # pragma: no cover - compiled
    """Copy the rows of one source chunk to their new places in the output buffer.

    Source row ``r0 + i`` becomes row ``inv_rows[r0 + i]``; only rows in
    ``[lo_row, hi_row)`` (this pass) are copied, to ``out_ip[new] - base``.
    With ``relabel`` columns become ``vinv[col]`` and each row is sorted by
    column (stably: duplicates keep their order).
    """
    k = ip.shape[0] - 1
    for i in prange(k):
        new = inv_rows[r0 + i]
        if new < lo_row or new >= hi_row:
            continue
        a = ip[i]
        length = ip[i + 1] - a
        dst = out_ip[new] - base
        if relabel:
            cols = np.empty(length, np.int32)
            for t in range(length):
                cols[t] = vinv[idx[a + t]]
            order = np.argsort(cols, kind="mergesort")
            for t in range(length):
                out_idx[dst + t] = cols[order[t]]
                out_dat[dst + t] = dat[a + order[t]]
        else:
            for t in range(length):
                out_idx[dst + t] = idx[a + t]
                out_dat[dst + t] = dat[a + t]


def relabel_columns(block: CSRMatrix, vinv: np.ndarray) -> CSRMatrix:
    """``block`` with column ``c`` renamed ``vinv[c]`` and each row sorted by its new columns (stably).

    The voxel half of :func:`apply` for one row block in memory: with
    ``vinv = perm.inverse_voxels()`` the result is ``block[:, perm.voxels]``
    (all cores).
    """
    k = int(block.shape[0])
    ip = np.ascontiguousarray(block.indptr, dtype=np.int64)
    idx = np.empty_like(block.indices)
    dat = np.empty_like(block.data)
    if k:
        _scatter_rows(ip, block.indices, block.data, 0, np.arange(k, dtype=np.int64), ip, 0, k, 0,
                      np.ascontiguousarray(vinv, dtype=np.int64), True, idx, dat)
    return CSRMatrix(ip, idx, dat, block.shape)


def _check_belongs(perm: Permutation, src: Any, name: str, perm_name: str) -> None:
    m, n = (int(v) for v in src.shape)
    if perm.shape != (m, n) or perm.nnz != int(src.nnz):
        raise MatrixFormatError(
            perm_name, f"permutation of another matrix ({perm.shape[0]} x {perm.shape[1]} with {perm.nnz} non-zeros, "
            f"{name} is {m} x {n} with {int(src.nnz)})"
        )
    checksum = fingerprint(src)
    if perm.source_checksum != checksum:
        raise MatrixFormatError(
            perm_name, f"permutation of another matrix (checksum {perm.source_checksum[:16]}..., "
            f"{name} has {checksum[:16]}...)"
        )


def apply(
    source: Any,
    perm: Permutation | str | os.PathLike,
    out: str | os.PathLike,
    *,
    chunk_nnz: int = DEFAULT_CHUNK_NNZ,
    passes: int = 1,
    threads: int | None = None,
) -> dict[str, Any]:
    """Write the permuted matrix ``A[rows][:, voxels]`` as a container with its permutations.

    The source is read in row chunks in file order (``passes`` times); each
    row is copied to its new place in an output buffer that holds the rows of
    one pass (``1/passes`` of the matrix, 8 bytes per non-zero), which is then
    written in row blocks. With a voxel permutation every row's columns are
    relabelled and sorted (duplicates keep their order); without one, rows are
    copied verbatim. The output (written atomically) is the matrix container
    with the source's grid, voxel size and scanner block, attributes
    ``reorder_mode``, ``reorder_source``, ``reorder_source_checksum``,
    ``reorder_perm_checksum``, and datasets ``/row_perm`` (int64[m]) and, if
    the voxels move, ``/voxel_perm`` (int64[n]).

    Parameters
    ----------
    source
        The user's matrix: a container path, an opened matrix or a CSRMatrix.
    perm
        A :class:`Permutation` or a ``perm.h5`` path; it must belong to
        ``source`` (same shape, nnz and checksum).
    out
        The container to write.
    chunk_nnz
        Non-zeros per streamed chunk (read) and per written block.
    passes
        Passes over the source; the output buffer holds ``1/passes`` of the matrix.
    threads
        Numba threads (None: all).

    Returns
    -------
    dict
        ``out``, ``shape``, ``nnz``, ``mode``, ``checksum`` (of the output),
        ``source_checksum``, ``perm_checksum``, ``passes``, ``seconds``.

    Raises
    ------
    MatrixFormatError
        A corrupt source, or a permutation (file) that is not a permutation of
        the right length or belongs to another matrix.
    ConfigError
        A bad chunk size or pass count.
    """
    import h5py

    from mlemlib._io import atomic_path
    from mlemlib.formats.h5 import RESERVED_ATTRS, MatrixH5Writer
    from mlemlib.transpose import numba_threads

    for key, value in (("chunk_nnz", chunk_nnz), ("passes", passes)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigError(key, f"{value!r} is not a positive integer")
    t_start = time.perf_counter()
    src, opened = _open(source)
    try:
        name = _name(src)
        if _already_reordered(src):
            raise InputError(name, "is already a reordered matrix; reorder the user's matrix (from 'mlem convert')")
        m, n = (int(v) for v in src.shape)
        if isinstance(perm, (str, os.PathLike)):
            perm_name = os.fspath(perm)
            perm = read_permutation(perm, shape=(m, n))
        else:
            perm_name = "<permutation>"
            check_permutation(perm.rows, m, perm_name, "row permutation")
            if perm.voxels is not None:
                check_permutation(perm.voxels, n, perm_name, "voxel permutation")
        _check_belongs(perm, src, name, perm_name)
        from mlemlib.formats.h5 import FOLD_ATTR_USER_ROWS, FOLD_DATASET, marked_container

        # a folded source stays folded: its rows are permuted, its map (validated when read) is not
        folded = marked_container(src, FOLD_ATTR_USER_ROWS)
        row_map = None
        if folded is not None:
            with h5py.File(folded, "r") as f:
                row_map = f[FOLD_DATASET][()] if FOLD_DATASET in f else None
        nnz = int(src.nnz)
        lengths = np.diff(src.read_indptr())
        out_ip = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(lengths[perm.rows], out=out_ip[1:])
        inv_rows = perm.inverse_rows()
        vinv = perm.inverse_voxels()
        relabel = vinv is not None
        vinv_arr = vinv.astype(np.int32) if relabel else np.zeros(1, np.int32)
        # pass s writes output rows [b[s], b[s+1]), about nnz/passes non-zeros each
        targets = [-(-s * nnz // passes) for s in range(passes + 1)]
        bounds = [int(np.searchsorted(out_ip, t, side="left")) for t in targets]
        bounds[0], bounds[-1] = 0, m
        attrs = {
            k: v for k, v in (getattr(src, "attrs", None) or {}).items()
            if k not in RESERVED_ATTRS and not k.startswith("reorder_") and isinstance(v, (str, int, float, list))
        }
        attrs.update(_container_attrs(perm, Path(name).name))
        log.info(
            "%s: writing %s permutation (%d x %d, %d non-zeros) to %s in %d pass(es)",
            name, perm.mode, m, n, nnz, out, passes,
        )
        t0 = time.perf_counter()
        total = passes * m
        with atomic_path(out) as tmp:
            with MatrixH5Writer(
                tmp, (m, n), nnz, source=Path(name).name, grid=getattr(src, "grid", None),
                voxel_size=getattr(src, "voxel_size", None), scanner_block=getattr(src, "scanner_block", None),
                **attrs,
            ) as w, numba_threads(threads):
                next_report = 0.1
                for s in range(passes):
                    lo_row, hi_row = bounds[s], bounds[s + 1]
                    base, top = int(out_ip[lo_row]), int(out_ip[hi_row])
                    out_idx = np.empty(top - base, dtype=np.int32)
                    out_dat = np.empty(top - base, dtype=np.float32)
                    for r0, r1, block in src.iter_chunks(max_nnz=chunk_nnz):
                        ip = block.indptr - block.indptr[0]
                        if r1 > r0 and hi_row > lo_row:
                            _scatter_rows(
                                ip, block.indices, block.data, np.int64(r0), inv_rows, out_ip, np.int64(lo_row),
                                np.int64(hi_row), np.int64(base), vinv_arr, relabel, out_idx, out_dat,
                            )
                        done = s * m + r1
                        if total and done / total >= next_report:
                            _progress(name, f"pass {s + 1}/{passes}: permuted", r1, m, t0, done, total)
                            next_report = done / total + 0.1
                    r = lo_row
                    while r < hi_row:
                        r_end = int(np.searchsorted(out_ip, int(out_ip[r]) + chunk_nnz, side="right")) - 1
                        r_end = min(max(r_end, r + 1), hi_row)
                        a, b = int(out_ip[r]) - base, int(out_ip[r_end]) - base
                        w.write_rows(
                            CSRMatrix(out_ip[r : r_end + 1] - out_ip[r], out_idx[a:b], out_dat[a:b], (r_end - r, n))
                        )
                        r = r_end
                    del out_idx, out_dat
            with h5py.File(tmp, "a") as f:
                _write_perm_datasets(f, perm)
                if row_map is not None:  # the source's fold (its attributes came with the others)
                    f.create_dataset(FOLD_DATASET, data=np.ascontiguousarray(row_map, dtype="<i8"))
        seconds = time.perf_counter() - t_start
        log.info("%s: wrote %s (%.2f s)", name, out, seconds)
        return {
            "out": os.fspath(out),
            "shape": [m, n],
            "nnz": nnz,
            "mode": perm.mode,
            "voxels_permuted": perm.voxels is not None,
            "checksum": w.checksum,
            "source_checksum": perm.source_checksum,
            "perm_checksum": perm.checksum,
            "passes": passes,
            "seconds": seconds,
        }
    finally:
        if opened:
            src.close()


def reorder_file(
    matrix: str | os.PathLike,
    out: str | os.PathLike,
    mode: str = DEFAULT_MODE,
    *,
    perm: str | os.PathLike | None = None,
    perm_out: str | os.PathLike | None = None,
    chunk_nnz: int = DEFAULT_CHUNK_NNZ,
    passes: int = 1,
    threads: int | None = None,
) -> dict[str, Any]:
    """The ``reorder`` stage: compute the permutation of ``matrix`` (or read ``perm``) and write the permuted container.

    Parameters
    ----------
    matrix
        The user's matrix container (from ``mlem convert``).
    out
        The reordered container to write.
    mode
        ``none``, ``rows`` or ``rows+voxels`` (ignored when ``perm`` is given).
    perm
        A ``perm.h5`` to apply instead of computing one; it must belong to ``matrix``.
    perm_out
        Also write the permutation alone to this ``perm.h5``.
    chunk_nnz, passes, threads
        See :func:`compute_permutation` and :func:`apply`.

    Returns
    -------
    dict
        :func:`apply`'s summary plus ``permutation_s`` (computing the permutation).
    """
    from mlemlib.formats.h5 import MatrixH5

    with MatrixH5(matrix) as src:
        t0 = time.perf_counter()
        if perm is not None:
            p = read_permutation(perm, shape=src.shape)
            _check_belongs(p, src, os.fspath(matrix), os.fspath(perm))
        else:
            p = compute_permutation(src, mode, chunk_nnz=chunk_nnz, threads=threads)
        t_perm = time.perf_counter() - t0
        if perm_out is not None:
            write_permutation(perm_out, p, source=Path(matrix).name)
        summary = apply(src, p, out, chunk_nnz=chunk_nnz, passes=passes, threads=threads)
    summary["permutation_s"] = t_perm
    return summary


# --------------------------------------------------------------------------- files


def _is_container_format(fmt: Any) -> bool:
    """Whether ``fmt`` is the ``format`` attribute of a matrix container: CSR (``mlem reorder``) or compressed
    (``mlem generate --voxel-order hilbert``)."""
    from mlemlib.formats.compressed_h5 import FORMATS
    from mlemlib.formats.h5 import FORMAT

    return fmt == FORMAT or fmt in FORMATS


def _perm_datasets(perm: Permutation) -> dict[str, np.ndarray]:
    """The datasets that store ``perm`` in a file: ``row_perm`` and, if the voxels move, ``voxel_perm``."""
    out = {"row_perm": np.ascontiguousarray(perm.rows, dtype="<i8")}
    if perm.voxels is not None:
        out["voxel_perm"] = np.ascontiguousarray(perm.voxels, dtype="<i8")
    return out


def _container_attrs(perm: Permutation, source: str) -> dict[str, str]:
    """The attributes that mark a matrix container as reordered by ``perm`` (``source``: the user's matrix)."""
    return {ATTR_MODE: perm.mode, ATTR_SOURCE: source, ATTR_SOURCE_CHECKSUM: perm.source_checksum,
            ATTR_PERM_CHECKSUM: perm.checksum}


def attach(writer: Any, perm: Permutation, source: str) -> None:
    """Store ``perm`` in a matrix container being written (before the writer closes): it then reads as
    reordered (:func:`permutation_of`), and runs on it are transparent."""
    writer.attach(_perm_datasets(perm), _container_attrs(perm, source))


def _write_perm_datasets(f: Any, perm: Permutation) -> None:
    for name, data in _perm_datasets(perm).items():
        f.create_dataset(name, data=data)


def write_permutation(path: str | os.PathLike, perm: Permutation, *, source: str = "") -> None:
    """Write a standalone ``perm.h5`` (atomically).

    Layout: ``/row_perm`` int64[m], optional ``/voxel_perm`` int64[n];
    attributes ``format="mlem-permutation"``, ``version=1``, ``mode``,
    ``shape`` (m, n), ``nnz``, ``source`` (the matrix's file name),
    ``source_checksum`` (its container checksum) and ``checksum`` (of the
    permutations, :attr:`Permutation.checksum`).
    """
    import h5py

    from mlemlib._io import atomic_path

    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        _write_perm_datasets(f, perm)
        f.attrs["format"] = PERM_FORMAT
        f.attrs["version"] = np.int64(PERM_VERSION)
        f.attrs["mode"] = perm.mode
        f.attrs["shape"] = np.array(perm.shape, dtype=np.int64)
        f.attrs["nnz"] = np.int64(perm.nnz)
        f.attrs["source"] = str(source)
        f.attrs["source_checksum"] = perm.source_checksum
        f.attrs["checksum"] = perm.checksum


def _attr(f: Any, key: str, default: Any = None) -> Any:
    v = f.attrs.get(key, default)
    if isinstance(v, bytes):
        v = v.decode()
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if isinstance(v, np.generic):
        v = v.item()
    return v


def _read_perm(f: Any, path: str, shape: tuple[int, int], mode: str, nnz: int, source_checksum: str, checksum: str) -> Permutation:
    import h5py

    m, n = shape
    if "row_perm" not in f or not isinstance(f["row_perm"], h5py.Dataset):
        raise MatrixFormatError(path, "no dataset 'row_perm' (a permutation written by 'mlem reorder')")
    rows = check_permutation(f["row_perm"][()], m, path, "row_perm")
    voxels = None
    if "voxel_perm" in f:
        if not isinstance(f["voxel_perm"], h5py.Dataset):
            raise MatrixFormatError(path, "'voxel_perm' is a group, expected a dataset")
        voxels = check_permutation(f["voxel_perm"][()], n, path, "voxel_perm")
    if mode not in MODES:
        raise MatrixFormatError(path, f"permutation mode {mode!r}, expected one of {', '.join(MODES)}")
    if mode != "rows+voxels" and voxels is not None:
        raise MatrixFormatError(path, f"mode {mode!r} but a voxel permutation is stored")
    perm = Permutation(rows, voxels, mode, (m, n), nnz, source_checksum)
    if checksum and perm.checksum != checksum:
        raise MatrixFormatError(path, f"permutation checksum mismatch: attribute says {checksum[:16]}..., data gives {perm.checksum[:16]}... (file corrupted)")
    return perm


def read_permutation(
    path: str | os.PathLike,
    *,
    shape: tuple[int, int] | None = None,
    source_checksum: str | None = None,
) -> Permutation:
    """Read and validate a standalone ``perm.h5`` (or the permutation of a reordered container).

    Parameters
    ----------
    path
        The file.
    shape
        The matrix's ``(m, n)``: the permutations must have these lengths.
    source_checksum
        The matrix's container checksum: the permutation must belong to it.

    Raises
    ------
    MatrixFormatError
        One line naming ``path``: not HDF5, not a permutation file, a
        permutation of the wrong length, an index repeated or missing, a
        corrupt file, or a permutation of another matrix.
    """
    import h5py

    p = os.fspath(path)
    if not Path(p).is_file():
        raise MatrixFormatError(p, "no such permutation file")
    try:
        f = h5py.File(p, "r")
    except OSError as exc:
        raise MatrixFormatError(p, f"not a readable HDF5 file ({exc})") from None
    with f:
        fmt = _attr(f, "format")
        if fmt == PERM_FORMAT:
            version = _attr(f, "version")
            if version != PERM_VERSION:
                raise MatrixFormatError(p, f"unsupported permutation file version {version!r}, expected {PERM_VERSION}")
            stored = _attr(f, "shape")
            if not (isinstance(stored, list) and len(stored) == 2):
                raise MatrixFormatError(p, f"attribute shape is {stored!r}, expected (m, n)")
            mode, nnz = _attr(f, "mode"), int(_attr(f, "nnz", -1))
            src_ck, ck = str(_attr(f, "source_checksum", "")), str(_attr(f, "checksum", ""))
        elif _is_container_format(fmt) and ATTR_MODE in f.attrs:  # a reordered container (any matrix format)
            stored = _attr(f, "shape")
            mode, nnz = _attr(f, ATTR_MODE), int(_attr(f, "nnz", -1))
            src_ck, ck = str(_attr(f, ATTR_SOURCE_CHECKSUM, "")), str(_attr(f, ATTR_PERM_CHECKSUM, ""))
        else:
            raise MatrixFormatError(p, f"not a permutation file (attribute format is {fmt!r}, expected {PERM_FORMAT!r})")
        stored = (int(stored[0]), int(stored[1]))
        if shape is not None and tuple(int(v) for v in shape) != stored:
            raise MatrixFormatError(p, f"permutation of a {stored[0]} x {stored[1]} matrix, expected {shape[0]} x {shape[1]}")
        if source_checksum is not None and src_ck != source_checksum:
            raise MatrixFormatError(
                p, f"permutation of another matrix (checksum {src_ck[:16] or '(none)'}..., expected {source_checksum[:16]}...)"
            )
        return _read_perm(f, p, stored, mode, nnz, src_ck, ck)


def permutation_of(matrix: Any) -> Permutation | None:
    """The permutation stored in a reordered matrix container; None for any other matrix.

    Parameters
    ----------
    matrix
        A path, or an opened matrix (its ``path``/``source`` is used).
        Files that are not HDF5 containers (``.csr4``, ``.mtx``, ``.npz``) and
        in-memory matrices give None.

    Raises
    ------
    MatrixFormatError
        The container says it is reordered but its permutations are missing,
        of the wrong length, not permutations, or do not match their checksum.
    """
    from mlemlib.formats.h5 import marked_container

    path = marked_container(matrix, ATTR_MODE)
    return None if path is None else read_permutation(path)


# --------------------------------------------------------------------------- transparent MLEM


def _like(index: np.ndarray, a: Any) -> Any:
    """``index`` on the device of ``a`` (CuPy arrays get a CuPy index)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy.asarray(index)
    return index


def _check_length(a: Any, length: int, what: str) -> None:
    if a.ndim != 1 or a.shape[0] != length:
        raise ConfigError(what, f"has shape {tuple(a.shape)}, expected a vector of {length} values")


def to_permuted_measurement(g_user: Any, perm: Permutation) -> Any:
    """The measurement in the permuted LOR order: ``g'[r'] = g[rows[r']]`` (NumPy or CuPy)."""
    _check_length(g_user, perm.m, "measurement")
    return g_user[_like(perm.rows, g_user)]


def measurement_to_user_order(y_perm: Any, perm: Permutation) -> Any:
    """An m-vector of the permuted space (e.g. a forward projection) in the user's LOR order."""
    _check_length(y_perm, perm.m, "m-vector")
    out = y_perm.copy()
    out[_like(perm.rows, y_perm)] = y_perm
    return out


def image_to_user_order(f_perm: Any, perm: Permutation) -> Any:
    """An image of the permuted space in the user's voxel order: ``f[voxels[j']] = f'[j']``.

    Returns ``f_perm`` itself when the voxel order is kept.
    """
    _check_length(f_perm, perm.n, "image")
    if perm.voxels is None:
        return f_perm
    out = f_perm.copy()
    out[_like(perm.voxels, f_perm)] = f_perm
    return out


def image_to_permuted_order(f_user: Any, perm: Permutation) -> Any:
    """A user-order image (truth, reference, initial image, norm) in the permuted voxel order: ``f'[j'] = f[voxels[j']]``."""
    _check_length(f_user, perm.n, "image")
    if perm.voxels is None:
        return f_user
    return f_user[_like(perm.voxels, f_user)]


# --------------------------------------------------------------------------- locality proxy


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
