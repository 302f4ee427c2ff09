"""The norm (sensitivity) image: column sums of the system matrix (CPU, Numba).

Provides :func:`column_sums` (in memory), :func:`compute_norm` (the ``norm``
stage: stream ``matrix.h5`` in row chunks, write ``norm.h5``) and
:func:`read_norm` (validate and load a ``norm.h5``).

``norm_j = sum_i a_ij`` is accumulated in float64, and deterministically: each
column is summed sequentially in row order, whatever the number of threads or
the chunk size. The threads split the *columns* (thread ``p`` owns a fixed
range and scans the chunk's indices, adding only its own columns), so no two
threads ever add to the same sum and no partial sums are combined. The result
has the same bits as a sequential float64 loop over the non-zeros in row order
(which is also what SciPy's ``A.astype(float64).sum(axis=0)`` computes).

``norm.h5`` layout: dataset ``/norm`` float64[n]; attributes ``format="mlem-norm"``,
``version=1``, ``source`` (the matrix file's name), ``checksum`` (the matrix's
checksum attribute, to tie the norm to the matrix it came from), ``shape``
(the matrix's ``(m, n)``) and ``nnz``.

With OSEM subsets (a matrix whose rows the reorder stage grouped, its
``/subset_bounds``) or multiplicative factors ``m`` (:func:`compute_norm`'s
``multiplicative``) it also holds the sensitivities of
:func:`sensitivities`: ``/subset_norms`` float64[S, n]
(``s^k_j = sum_{i in S_k} a_ij m_i``), ``/subset_bounds`` int64[S+1] and the
attribute ``multiplicative`` (the factors' checksum,
:func:`mlemlib.corrections.factors_checksum`; ``""`` for m = 1); ``/norm`` is
then ``s`` weighted by ``m`` (unchanged for m = 1). :func:`read_subset_norms`
gives them to a run of the same subsets and factors.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit, prange

from mlemlib._io import atomic_path
from mlemlib.errors import ConfigError, MatrixFormatError
from mlemlib.matrix import CSRMatrix
from mlemlib.transpose import DEFAULT_CHUNK_NNZ, numba_threads

log = logging.getLogger(__name__)

NORM_FORMAT = "mlem-norm"
NORM_VERSION = 1


@njit(parallel=True, cache=True, nogil=True)
def _add_columns(indptr, indices, data, weights, weighted, n, sums, seg, nbins, out_col, out_val):  # pragma: no cover
    """Add ``data`` (times its row's weight) to ``sums[indices]`` in float64, every column in row order.

    ``indptr`` is the block's row pointer rebased to 0; ``seg`` cuts its rows
    into segments (parallel tasks). Each non-zero goes to one of ``nbins``
    column ranges: counted per segment, then written, segment by segment in
    row order, into its range's run of ``out_col``/``out_val`` (a stable
    counting sort); then each range's run is added to ``sums`` by one task.
    A column's terms are added in row order whatever the segments, ranges and
    threads, so the sums are bit for bit those of a plain loop over the rows.
    ``weights[r]`` (when ``weighted``) multiplies row ``r``'s values: small
    integers, so the products are exact. Returns the first element whose
    column lies outside ``[0, n)`` (nothing added then), else -1.
    """
    nseg = seg.shape[0] - 1
    counts = np.zeros((nseg, nbins), dtype=np.int64)
    bad = np.full(nseg, -1, dtype=np.int64)
    for s in prange(nseg):
        for k in range(indptr[seg[s]], indptr[seg[s + 1]]):
            c = np.int64(indices[k])
            if c < 0 or c >= n:
                if bad[s] < 0:
                    bad[s] = k
            else:
                counts[s, (c * nbins) // n] += 1
    for s in range(nseg):
        if bad[s] >= 0:
            return bad[s]
    pos = np.empty((nseg, nbins), dtype=np.int64)
    start = np.empty(nbins + 1, dtype=np.int64)
    acc = 0
    for b in range(nbins):
        start[b] = acc
        for s in range(nseg):
            pos[s, b] = acc
            acc += counts[s, b]
    start[nbins] = acc
    for s in prange(nseg):
        p = pos[s].copy()
        for r in range(seg[s], seg[s + 1]):
            w = weights[r] if weighted else 1.0
            for k in range(indptr[r], indptr[r + 1]):
                c = np.int64(indices[k])
                b = (c * nbins) // n
                out_col[p[b]] = c
                out_val[p[b]] = np.float64(data[k]) * w
                p[b] += 1
    for b in prange(nbins):
        for q in range(start[b], start[b + 1]):
            sums[out_col[q]] += out_val[q]
    return -1


class ColumnScratch:
    """The sorted columns and products of :func:`accumulate_column_sums`, kept between blocks (grown, never
    shrunk): a pass over a large matrix faults in no new pages block after block."""

    def __init__(self) -> None:
        self.cols = np.empty(0, dtype=np.int32)
        self.vals = np.empty(0, dtype=np.float64)

    def get(self, nnz: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.cols) < nnz:
            self.cols = np.empty(nnz, dtype=np.int32)
            self.vals = np.empty(nnz, dtype=np.float64)
        return self.cols, self.vals


def accumulate_column_sums(
    sums: np.ndarray, block: CSRMatrix, *, source: str | os.PathLike = "<matrix>",
    row_weights: np.ndarray | None = None, scratch: ColumnScratch | None = None,
) -> None:
    """Add the column sums of a row block to ``sums`` (float64, in place).

    Call it for the row blocks in row order to get the sums of the whole matrix.
    ``row_weights`` (one per row of the block) weights each row's values: a
    folded matrix's multiplicities (:mod:`mlemlib.fold`), so that its norm is
    the unfolded matrix's. ``scratch`` keeps the work arrays (12 bytes per
    non-zero) for the next block.

    Raises
    ------
    MatrixFormatError
        If a column index is outside ``[0, n)`` (``sums`` unchanged).
    """
    n = sums.shape[0]
    p0 = int(block.indptr[0]) if len(block.indptr) else 0
    nnz = block.nnz
    indices = block.indices[p0 : p0 + nnz] if p0 else block.indices[:nnz]
    data = block.data[p0 : p0 + nnz] if p0 else block.data[:nnz]
    if nnz == 0 or n == 0:
        if nnz and n == 0:
            raise MatrixFormatError(source, f"column index {int(indices[0])} out of range [0, 0)")
        return
    from numba import get_num_threads

    indptr = np.asarray(block.indptr, dtype=np.int64)
    indptr = indptr - indptr[0]
    m = len(indptr) - 1
    threads = get_num_threads()
    nseg = max(1, min(m, 4 * threads))
    seg = np.searchsorted(indptr, np.linspace(0, nnz, nseg + 1), side="left").astype(np.int64)
    seg[0], seg[-1] = 0, m
    nbins = int(max(1, min(n, 8 * threads)))
    weighted = row_weights is not None
    weights = np.asarray(row_weights, dtype=np.float64) if weighted else np.ones(1, dtype=np.float64)
    out_col, out_val = (scratch or ColumnScratch()).get(nnz)
    bad = _add_columns(indptr, indices, data, weights, weighted, np.int64(n), sums, seg, np.int64(nbins),
                       out_col, out_val)
    if bad >= 0:
        raise MatrixFormatError(source, f"column index {int(indices[bad])} out of range [0, {n})")


def source_column_sums(src, *, max_nnz: int = 1 << 24, progress: str | None = None) -> np.ndarray:
    """The norm (column sums, float64, in row order) of any opened matrix, streamed by row blocks.

    A folded matrix's rows count as often as they occur (:func:`mlemlib.fold.stored_row_weights`).
    ``progress`` (a name for the log) logs the rows summed every tenth of the matrix.
    """
    from mlemlib.fold import stored_row_weights

    m, n = (int(v) for v in src.shape)
    sums = np.zeros(n, dtype=np.float64)
    name = str(getattr(src, "source", None) or getattr(src, "path", None) or "<memory>")
    weights = stored_row_weights(src)
    if progress is not None:
        log.info("%s: column sums of %d x %d, %d non-zeros%s", progress, m, n, int(src.nnz),
                 "" if weights is None else " (folded: rows weighted by their multiplicity)")
    next_report = 0.1
    scratch = ColumnScratch()
    for r0, r1, block in src.iter_chunks(max_nnz=max_nnz, reuse=True):
        accumulate_column_sums(sums, block, source=name, row_weights=None if weights is None else weights[r0:r1],
                               scratch=scratch)
        if progress is not None and m and r1 / m >= next_report:
            log.info("%s: summed rows up to %d of %d (%.0f%%)", progress, r1, m, 100.0 * r1 / m)
            next_report = r1 / m + 0.1
    return sums


def sensitivities(src: Any, bounds: np.ndarray, weights: np.ndarray | None = None, *,
                  max_nnz: int = 1 << 24) -> np.ndarray:
    """``s^k_j = sum_{i in S_k} a_ij w_i`` (float64, S x n) of an opened matrix whose subsets are the row ranges
    ``bounds``; ``weights`` one per stored row (:func:`row_weights`; None: 1 each).

    Each subset's columns are summed in row order in float64 (:func:`accumulate_column_sums`),
    so S = 1 without weights gives the bits of :func:`source_column_sums`.
    """
    from mlemlib.matrix import slice_rows
    from mlemlib.subsets import check_bounds

    m, n = (int(v) for v in src.shape)
    bounds = check_bounds(bounds, m)
    sk = np.zeros((len(bounds) - 1, n), dtype=np.float64)
    name = str(getattr(src, "source", None) or getattr(src, "path", None) or "<matrix>")
    scratch = ColumnScratch()
    for r0, r1, block in src.iter_chunks(max_nnz=max_nnz, reuse=True):
        for k in range(len(bounds) - 1):
            a, b = max(r0, int(bounds[k])), min(r1, int(bounds[k + 1]))
            if a < b:
                part = slice_rows(block, a - r0, b - r0) if (a, b) != (r0, r1) else block
                accumulate_column_sums(sk[k], part, source=name,
                                       row_weights=None if weights is None else weights[a:b], scratch=scratch)
    return sk


def column_sums(a: CSRMatrix, *, threads: int | None = None) -> np.ndarray:
    """Return the column sums of ``a`` (float64, length n), deterministic.

    Parameters
    ----------
    a
        The matrix.
    threads
        Numba threads (None: current setting). The result does not depend on it.

    Returns
    -------
    numpy.ndarray
        ``sum_i a_ij`` for every column ``j``, accumulated in float64 in row order.
    """
    sums = np.zeros(a.shape[1], dtype=np.float64)
    with numba_threads(threads):
        accumulate_column_sums(sums, a)
    return sums


def compute_norm(
    matrix_h5: str | os.PathLike,
    out: str | os.PathLike,
    *,
    threads: int | None = None,
    chunk_nnz: int = DEFAULT_CHUNK_NNZ,
    multiplicative: str | os.PathLike | np.ndarray | None = None,
) -> np.ndarray:
    """The ``norm`` stage: column sums of ``matrix.h5``, written to ``norm.h5``.

    Streams the matrix in row chunks of about ``chunk_nnz`` non-zeros (memory:
    one chunk plus the n-vector), validating each chunk as it is read. A
    folded matrix's rows are weighted by their multiplicity: its norm is that
    of the unfolded matrix.

    Parameters
    ----------
    matrix_h5
        The matrix container.
    out
        The ``norm.h5`` to write (atomically).
    threads
        Numba threads (None: all); the result does not depend on it.
    chunk_nnz
        Non-zeros per chunk.
    multiplicative
        The measurement's multiplicative factors (a file of
        :func:`mlemlib.corrections.read_factors`, one per LOR in the user's
        order), or None (m = 1). With them, or on a matrix whose rows are
        grouped by subset, the file also holds the subsets' sensitivities.

    Returns
    -------
    numpy.ndarray
        The norm (float64, length n).

    Raises
    ------
    MatrixFormatError
        For a corrupt matrix.
    ConfigError
        For a bad thread count or chunk size.
    """
    import h5py

    from mlemlib.formats.h5 import MatrixH5

    if not isinstance(chunk_nnz, (int, np.integer)) or chunk_nnz < 1:
        raise ConfigError("chunk_nnz", f"{chunk_nnz!r} is not a positive number of non-zeros")
    name = Path(matrix_h5).name
    subset_norms = None
    with MatrixH5(matrix_h5) as src, numba_threads(threads):
        m, n = src.shape
        nnz, checksum = src.nnz, src.checksum
        bounds, weights, m_checksum = _sensitivity_setup(src, multiplicative)
        if not m_checksum:  # m = 1: the column sums as ever (the S = 1 norm, bit for bit)
            sums = source_column_sums(src, max_nnz=chunk_nnz, progress=name)
        if bounds is not None:
            log.info("%s: sensitivities of %d subsets%s", name, len(bounds) - 1,
                     " weighted by the multiplicative factors" if m_checksum else "")
            subset_norms = sensitivities(src, bounds, weights, max_nnz=chunk_nnz)
            if m_checksum:
                sums = subset_norms.sum(axis=0)
    zero = int(np.count_nonzero(sums == 0))
    if zero:
        log.info("%s: %d of %d voxels are seen by no LOR (norm 0)", name, zero, n)
    with atomic_path(out) as tmp, h5py.File(tmp, "w") as f:
        f.create_dataset("norm", data=sums)
        f.attrs["format"] = NORM_FORMAT
        f.attrs["version"] = NORM_VERSION
        f.attrs["source"] = name
        f.attrs["checksum"] = checksum
        f.attrs["shape"] = np.array([m, n], dtype=np.int64)
        f.attrs["nnz"] = np.int64(nnz)
        if subset_norms is not None:
            f.create_dataset("subset_norms", data=subset_norms)
            f.create_dataset("subset_bounds", data=np.asarray(bounds, dtype=np.int64))
            f.attrs["multiplicative"] = m_checksum
    log.info("%s: wrote %s", name, out)
    return sums


def _sensitivity_setup(src, multiplicative) -> tuple[np.ndarray | None, np.ndarray | None, str]:
    """``(bounds, row weights, m's checksum)`` of the subsets' sensitivities of ``src``; bounds None: the plain norm.

    The bounds are the container's (``mlem reorder --subsets``), else one subset; the
    weights are ``m`` in the matrix's row order (a folded row's LORs summed), None without ``m``.
    """
    from mlemlib.permutation import permutation_of

    perm = permutation_of(src)
    bounds = None if perm is None else perm.subsets
    if multiplicative is None:
        return bounds, row_weights(src, None, perm), ""
    from mlemlib.corrections import factors_checksum, read_factors
    from mlemlib.fold import user_rows

    m = read_factors(multiplicative, user_rows(src), "multiplicative")
    if bounds is None:
        bounds = np.array([0, int(src.shape[0])], dtype=np.int64)
    return bounds, row_weights(src, m, perm), factors_checksum(m)


def row_weights(src, m: np.ndarray | None, perm=None) -> np.ndarray | None:
    """Each row's weight in the sensitivities (float64), in ``src``'s row order, or None where every weight is 1.

    ``m`` (the user's LOR order; None: 1) on an unfolded matrix; on a folded
    one ``M_r``, the sum of ``m`` over the LORs stored row ``r`` stands for
    (its multiplicity for m = 1): :func:`mlemlib.corrections.summed_factors`,
    the same sums as the run's background ``B_r / M_r``.
    """
    from mlemlib.corrections import summed_factors
    from mlemlib.fold import fold_of

    fold = fold_of(src)
    if fold is None and m is None:
        return None
    w = np.asarray(m, dtype=np.float64) if fold is None else summed_factors(fold, m, None)[0]
    return w if perm is None else w[np.asarray(perm.rows)]


def read_subset_norms(path: str | os.PathLike, bounds: np.ndarray, multiplicative: str) -> np.ndarray | None:
    """The sensitivities (float64, S x n) that ``norm.h5`` holds for these subset ``bounds`` and factors
    (``multiplicative``: their checksum, ``""`` for m = 1); None where it holds others or none."""
    import h5py

    with h5py.File(path, "r") as f:
        if "subset_norms" not in f or "subset_bounds" not in f:
            return None
        stored = np.asarray(f["subset_bounds"][()])
        found = f.attrs.get("multiplicative", "")
        found = found.decode() if isinstance(found, bytes) else str(found)
        if found != multiplicative or not np.array_equal(stored, bounds):
            return None
        sk = np.asarray(f["subset_norms"][()], dtype=np.float64)
    if sk.shape[0] != len(bounds) - 1 or not np.isfinite(sk).all() or (sk < 0).any():
        raise MatrixFormatError(path, f"'subset_norms' of shape {sk.shape} with non-finite or negative values")
    return sk


def read_norm(
    path: str | os.PathLike,
    expected_length: int | None = None,
    *,
    expected_checksum: str | None = None,
) -> np.ndarray:
    """Load and validate a ``norm.h5``.

    Parameters
    ----------
    path
        The file.
    expected_length
        The matrix's column count n, if known.
    expected_checksum
        The matrix's checksum, if the norm must come from that matrix.

    Returns
    -------
    numpy.ndarray
        The norm, float64, length n.

    Raises
    ------
    MatrixFormatError
        If the file is missing or not HDF5, has no float ``/norm`` vector, has
        the wrong length, holds a non-finite or negative value, or came from
        another matrix.
    """
    import h5py

    p = Path(path)
    if not p.is_file():
        raise MatrixFormatError(path, "no such norm file")
    try:
        f = h5py.File(p, "r")
    except OSError as exc:
        raise MatrixFormatError(path, f"not a readable HDF5 file ({exc})") from exc
    with f:
        if "norm" not in f or not isinstance(f["norm"], h5py.Dataset):
            raise MatrixFormatError(path, "no dataset 'norm' (expected float64[n], written by 'mlem norm')")
        ds = f["norm"]
        if ds.ndim != 1:
            raise MatrixFormatError(path, f"'norm' has shape {ds.shape}, expected a vector")
        if ds.dtype.kind != "f":
            raise MatrixFormatError(path, f"'norm' has dtype {ds.dtype}, expected float64")
        if expected_length is not None and ds.shape[0] != expected_length:
            raise MatrixFormatError(
                path, f"'norm' has {ds.shape[0]} entries, expected {expected_length} (the matrix's columns)"
            )
        if expected_checksum is not None:
            found = f.attrs.get("checksum", "")
            found = found.decode() if isinstance(found, bytes) else str(found)
            if found != expected_checksum:
                raise MatrixFormatError(
                    path, f"norm of matrix with checksum {found or '(none)'}, expected {expected_checksum}"
                )
        norm = np.asarray(ds[()], dtype=np.float64)
    finite = np.isfinite(norm)
    if not finite.all():
        j = int(np.argmax(~finite))
        raise MatrixFormatError(path, f"non-finite norm {float(norm[j])} at voxel {j}")
    if (norm < 0).any():
        j = int(np.argmax(norm < 0))
        raise MatrixFormatError(path, f"negative norm {float(norm[j])} at voxel {j}")
    return norm
