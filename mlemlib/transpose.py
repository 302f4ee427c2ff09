"""Sparse matrix transposition: ScanTrans (thesis ch. 6), SciPy and cuSPARSE (CPU; GPU for cusparse).

Provides

- :func:`transpose` — transpose an in-memory :class:`~mlemlib.matrix.CSRMatrix`
  with one of three methods that all return *identical arrays*:

  ``scantrans``
      The scan-based parallel transposition of Wang et al. (ICS'16) as the
      thesis describes it in ch. 6, on the CPU with Numba (``prange`` over
      threads): each thread takes an equal share of the non-zeros, counts them
      per column in its row of the histogram ``inter`` and records each
      non-zero's rank within its column and thread in ``intra``; a vertical
      scan over ``inter`` and a prefix sum give the output row pointer and the
      per-thread column offsets; the write-back scatters every non-zero to
      ``colptr[c] + inter[tid][c] + intra[k]``. No atomics, so the result does
      not depend on the thread count.
  ``scipy``
      ``scipy.sparse`` (``A.T.tocsr()``), single-threaded.
  ``cusparse``
      CuPy's ``csr_matrix(...).T.tocsr()`` (cuSPARSE csr2csc) on the GPU; needs
      CuPy and a CUDA device, else :class:`~mlemlib.errors.DeviceError`.

- :func:`transpose_file` — the ``transpose`` stage: ``matrix.h5`` ->
  ``transpose.h5``, in the matrix's format (CSR or compressed). The ``scantrans`` method streams the input in row chunks
  (two passes: a column histogram gives the output row pointer, then every
  chunk is scattered with per-chunk ``inter``/``intra`` offset by a running
  per-column cursor), so it holds one copy of the matrix (the output) plus one
  chunk.

The transposition is *stable*: inside each column the non-zeros keep their row
order, so the output rows have sorted column indices and equal
``scipy.sparse.csr_matrix(A).T.tocsr()`` array for array, whether or not the
input rows have sorted columns (duplicates keep their input order).

The thread-count helpers :func:`numba_threads` and :func:`usable_threads` are
shared with :mod:`mlemlib.norm`, :mod:`mlemlib.partition`, the scanner and the
cpu backend.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

from mlemlib.errors import ConfigError, DeviceError, MatrixFormatError
from mlemlib.formats.spec import matrix_format_of
from mlemlib.matrix import INDEX_DTYPE, INDPTR_DTYPE, VALUE_DTYPE, CSRMatrix

log = logging.getLogger(__name__)

#: Transposition methods, in the order the CLI lists them.
METHODS = ("scantrans", "scipy", "cusparse")

#: Default number of non-zeros per streamed chunk (2**26: 512 MiB of per-chunk
#: input plus 256 MiB of ``intra``).
DEFAULT_CHUNK_NNZ = 1 << 26

#: Largest chunk: ``inter`` and ``intra`` hold int32 counts within one chunk.
MAX_CHUNK_NNZ = np.iinfo(np.int32).max

_INT32_MAX = int(np.iinfo(np.int32).max)
_SCAN_BLOCK = 4096  # columns per task of the vertical scan


# --------------------------------------------------------------------------- threads


@contextlib.contextmanager
def numba_threads(threads: int | None) -> Iterator[int]:
    """Run the enclosed Numba code with ``threads`` threads; yield the count in use.

    Parameters
    ----------
    threads
        Number of threads, or None for Numba's current setting (all cores
        unless ``NUMBA_NUM_THREADS`` says otherwise). More threads than Numba
        has (``NUMBA_NUM_THREADS``, by default the usable cores) are reduced
        to that number with a warning.

    Raises
    ------
    ConfigError
        If ``threads`` is not a positive integer.
    """
    if threads is None:
        yield numba.get_num_threads()
        return
    threads = usable_threads(threads)
    old = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        yield threads
    finally:
        numba.set_num_threads(old)


def usable_threads(threads: int) -> int:
    """``threads`` checked and reduced to what Numba has (``NUMBA_NUM_THREADS``), with a warning.

    ``snakemake --cores 64`` on a 16-core node hands a job 64 threads;
    Numba refuses more than it started with, so they are cut here.

    Raises
    ------
    ConfigError
        If ``threads`` is not a positive integer.
    """
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise ConfigError("threads", f"{threads!r} is not a positive number of threads")
    limit = numba.config.NUMBA_NUM_THREADS
    if threads > limit:
        log.warning("%d threads asked for, Numba has %d (NUMBA_NUM_THREADS): using %d", threads, limit, limit)
        return int(limit)
    return int(threads)


# --------------------------------------------------------------------------- kernels


@njit(parallel=True, cache=True)
def _column_histogram(indices, n, hist):  # pragma: no cover - compiled
    """Add the per-column counts of ``indices`` to ``hist`` (T x n, one row per thread).

    Returns the position of the first index outside ``[0, n)``, or -1.
    """
    nthreads = hist.shape[0]
    nnz = indices.shape[0]
    bad = np.full(nthreads, -1, np.int64)
    for t in prange(nthreads):
        k0 = t * nnz // nthreads
        k1 = (t + 1) * nnz // nthreads
        for k in range(k0, k1):
            c = indices[k]
            if c < 0 or c >= n:
                if bad[t] < 0:
                    bad[t] = k
            else:
                hist[t, c] += 1
    for t in range(nthreads):
        if bad[t] >= 0:
            return bad[t]
    return -1


@njit(parallel=True, cache=True)
def _scan_count(indices, n, bounds, inter, intra):  # pragma: no cover - compiled
    """ScanTrans step 1 (horizontal scan) on one chunk.

    Thread ``t`` owns non-zeros ``bounds[t]:bounds[t+1]``; it zeroes row
    ``t+1`` of ``inter``, then for each non-zero stores its rank among the
    thread's non-zeros of the same column in ``intra[k]`` and counts it in
    ``inter[t+1, c]``. Row 0 of ``inter`` stays zero. Returns the position of
    the first column index outside ``[0, n)``, or -1.
    """
    nthreads = bounds.shape[0] - 1
    bad = np.full(nthreads, -1, np.int64)
    for t in prange(nthreads):
        row = inter[t + 1]
        row[:] = 0
        for k in range(bounds[t], bounds[t + 1]):
            c = indices[k]
            if c < 0 or c >= n:
                if bad[t] < 0:
                    bad[t] = k
                intra[k] = 0
            else:
                intra[k] = row[c]
                row[c] += 1
    inter[0, :] = 0
    for t in range(nthreads):
        if bad[t] >= 0:
            return bad[t]
    return -1


@njit(parallel=True, cache=True)
def _vertical_scan(inter, cursor, base, block):  # pragma: no cover - compiled
    """ScanTrans step 2: scan ``inter`` down each column, offset by the column's output cursor.

    ``base[t, c] = cursor[c] + inter[1, c] + ... + inter[t, c]`` is the output
    position of thread ``t``'s first column-``c`` non-zero: the first two terms
    of the thesis's eq. 6.1 (``cscColPtr[c] + inter[t][c]``, with the chunk's
    running cursor in place of ``cscColPtr``) added once per column instead of
    once per non-zero. Then ``cursor[c]`` advances by the chunk's column total
    (the thesis's ``inter[nthreads][c]``). Parallel over blocks of columns.
    """
    rows, n = inter.shape
    nblocks = (n + block - 1) // block
    for b in prange(nblocks):
        c0 = b * block
        c1 = min(n, c0 + block)
        for c in range(c0, c1):
            run = cursor[c]
            for j in range(rows - 1):
                base[j, c] = run
                run += inter[j + 1, c]
            cursor[c] = run


@njit(parallel=True, cache=True)
def _scatter(indptr, indices, data, bounds, base, intra, row0, out_indices, out_data):  # pragma: no cover
    """ScanTrans step 3 (write-back) on one chunk.

    Each thread walks its share of the chunk's non-zeros, deriving the row
    number from ``indptr`` as it goes (instead of the thesis's nnz-sized
    ``csrRowIdx``), and writes non-zero ``k`` of column ``c`` to
    ``loc = base[t, c] + intra[k]`` (eq. 6.1).
    """
    nthreads = bounds.shape[0] - 1
    for t in prange(nthreads):
        k0 = bounds[t]
        k1 = bounds[t + 1]
        if k0 < k1:
            # last row r with indptr[r] <= k0 (binary search; rows may be empty)
            lo = 0
            hi = indptr.shape[0] - 1
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if indptr[mid] <= k0:
                    lo = mid
                else:
                    hi = mid
            r = lo
            nxt = indptr[r + 1]
            bt = base[t]
            for k in range(k0, k1):
                while k >= nxt:
                    r += 1
                    nxt = indptr[r + 1]
                loc = bt[indices[k]] + intra[k]
                out_indices[loc] = row0 + r
                out_data[loc] = data[k]


# --------------------------------------------------------------------------- ScanTrans driver


def _thread_bounds(nnz: int, nthreads: int) -> np.ndarray:
    """Equal shares of ``nnz`` non-zeros for ``nthreads`` threads (int64, length T+1)."""
    return (np.arange(nthreads + 1, dtype=np.int64) * nnz) // nthreads


def column_counts(
    indices: np.ndarray,
    n: int,
    *,
    threads: int | None = None,
    hist: np.ndarray | None = None,
    source: str | os.PathLike = "<matrix>",
) -> np.ndarray:
    """Count the non-zeros per column (parallel, exact int64).

    Parameters
    ----------
    indices
        Column indices (int32) of a matrix or of one chunk.
    n
        Number of columns.
    threads
        Numba threads (None: current setting).
    hist
        Optional int64 array ``(T, n)`` to accumulate into across chunks; the
        per-thread rows are summed by :func:`histogram_total`.
    source
        File named in errors.

    Returns
    -------
    numpy.ndarray
        ``hist`` (T x n, int64) with this chunk's counts added.

    Raises
    ------
    MatrixFormatError
        If a column index is outside ``[0, n)``.
    """
    with numba_threads(threads) as nt:
        if hist is None:
            hist = np.zeros((nt, n), dtype=np.int64)
        idx = np.ascontiguousarray(indices, dtype=INDEX_DTYPE)
        bad = _column_histogram(idx, np.int64(n), hist)
    if bad >= 0:
        raise MatrixFormatError(source, f"column index {int(idx[bad])} out of range [0, {n})")
    return hist


def histogram_total(hist: np.ndarray) -> np.ndarray:
    """Sum the per-thread rows of a :func:`column_counts` histogram (int64, length n)."""
    return hist.sum(axis=0, dtype=np.int64)


class ScanTransScatter:
    """Streaming ScanTrans: scatter row chunks of ``A`` (in row order) into ``A^T``.

    The output arrays (one copy of the matrix) are allocated up front from the
    column counts; each :meth:`add` call runs the three ScanTrans steps on one
    chunk with chunk-sized ``intra``, a ``(T+1) x n`` int32 ``inter`` and a
    ``T x n`` int64 table of per-thread column bases, offset by a per-column
    cursor. Chunks must come in row order for the result to be
    stable; :meth:`finish` checks that every slot was filled.

    Parameters
    ----------
    col_counts
        Non-zeros per column of ``A`` (int64, length n).
    shape
        ``(m, n)`` of ``A``.
    threads
        Number of ScanTrans threads ``T`` (None: Numba's current setting).
    source
        File named in errors.
    """

    def __init__(
        self,
        col_counts: np.ndarray,
        shape: tuple[int, int],
        *,
        threads: int | None = None,
        source: str | os.PathLike = "<matrix>",
    ) -> None:
        m, n = int(shape[0]), int(shape[1])
        if m > _INT32_MAX + 1:
            raise MatrixFormatError(source, f"{m} rows: the transpose's int32 column indices hold at most 2**31")
        if len(col_counts) != n:
            raise MatrixFormatError(source, f"{len(col_counts)} column counts for {n} columns")
        self.shape = (m, n)
        self.source = source
        self.nthreads = numba.get_num_threads() if threads is None else int(threads)
        self.indptr = np.zeros(n + 1, dtype=INDPTR_DTYPE)
        np.cumsum(col_counts, out=self.indptr[1:])
        self.nnz = int(self.indptr[-1])
        self.indices = np.empty(self.nnz, dtype=INDEX_DTYPE)
        self.data = np.empty(self.nnz, dtype=VALUE_DTYPE)
        self._cursor = self.indptr[:-1].copy()
        self._inter = np.zeros((self.nthreads + 1, n), dtype=np.int32)
        self._base = np.empty((self.nthreads, n), dtype=np.int64)
        self._intra = np.empty(0, dtype=np.int32)
        self._next_row = 0
        self.seconds = 0.0  # time spent in the ScanTrans kernels

    def add(self, row0: int, block: CSRMatrix) -> None:
        """Scatter the row block ``A[row0 : row0 + block.shape[0]]`` (the next in row order).

        Raises
        ------
        MatrixFormatError
            If the block is out of order, too large, holds more non-zeros per
            column than counted, or has a column index out of range.
        """
        rows, n = block.shape
        if row0 != self._next_row:
            raise MatrixFormatError(self.source, f"row chunk starts at row {row0}, expected {self._next_row}")
        if n != self.shape[1] or row0 + rows > self.shape[0]:
            raise MatrixFormatError(self.source, f"row chunk of shape {block.shape} at row {row0} does not fit {self.shape}")
        self._next_row = row0 + rows
        indptr = block.indptr
        if len(indptr) and indptr[0] != 0:
            indptr = indptr - indptr[0]
        nnz = int(indptr[-1]) if len(indptr) else 0
        if nnz == 0:
            return
        if nnz > MAX_CHUNK_NNZ:
            raise MatrixFormatError(self.source, f"row chunk at row {row0} has {nnz} non-zeros; at most 2**31-1 per chunk")
        if self._intra.shape[0] < nnz:
            self._intra = np.empty(nnz, dtype=np.int32)
        indices = block.indices[:nnz]
        data = block.data[:nnz]
        bounds = _thread_bounds(nnz, self.nthreads)
        t0 = time.perf_counter()
        with numba_threads(min(self.nthreads, numba.config.NUMBA_NUM_THREADS)):
            bad = _scan_count(indices, np.int64(n), bounds, self._inter, self._intra)
            if bad >= 0:
                raise MatrixFormatError(self.source, f"column index {int(indices[bad])} out of range [0, {n})")
            _vertical_scan(self._inter, self._cursor, self._base, _SCAN_BLOCK)
            # a file that changed between the passes would overrun the next column
            over = self._cursor > self.indptr[1:]
            if over.any():
                c = int(np.argmax(over))
                raise MatrixFormatError(
                    self.source, f"column {c} has more non-zeros than counted in the first pass (file changed?)"
                )
            _scatter(
                indptr, indices, data, bounds, self._base, self._intra, np.int64(row0), self.indices, self.data
            )
        self.seconds += time.perf_counter() - t0

    def finish(self) -> CSRMatrix:
        """Return ``A^T`` (shape ``(n, m)``) once every row was added.

        Raises
        ------
        MatrixFormatError
            If rows are missing or a column got fewer non-zeros than counted.
        """
        if self._next_row != self.shape[0]:
            raise MatrixFormatError(self.source, f"rows {self._next_row}..{self.shape[0]} were never added")
        if not np.array_equal(self._cursor, self.indptr[1:]):
            c = int(np.argmax(self._cursor != self.indptr[1:]))
            raise MatrixFormatError(self.source, f"column {c} has fewer non-zeros than counted (file changed?)")
        self._inter = self._intra = self._base = self._cursor = np.empty(0, dtype=np.int32)
        return CSRMatrix(self.indptr, self.indices, self.data, (self.shape[1], self.shape[0]))


def iter_row_chunks(indptr: np.ndarray, chunk_nnz: int) -> Iterator[tuple[int, int]]:
    """Yield ``(r0, r1)`` row ranges of at most ``chunk_nnz`` non-zeros (one row when a row is larger).

    Empty trailing rows are included in the last range; every row is covered once.
    """
    m = len(indptr) - 1
    r0 = 0
    while r0 < m:
        target = int(indptr[r0]) + chunk_nnz
        r1 = int(np.searchsorted(indptr, target, side="right")) - 1
        r1 = min(max(r1, r0 + 1), m)
        if int(indptr[-1]) <= target:
            r1 = m
        yield r0, r1
        r0 = r1


def _row_block(a: CSRMatrix, r0: int, r1: int) -> CSRMatrix:
    """Rows ``r0:r1`` of ``a`` (views of ``indices``/``data``, rebased small ``indptr``)."""
    p0, p1 = int(a.indptr[r0]), int(a.indptr[r1])
    return CSRMatrix(a.indptr[r0 : r1 + 1] - p0, a.indices[p0:p1], a.data[p0:p1], (r1 - r0, a.shape[1]))


def _scantrans_single(a: CSRMatrix, nthreads: int) -> CSRMatrix:
    """ScanTrans in one pass, as thesis Code 6.1 (the row pointer from the totals of ``inter``)."""
    m, n = a.shape
    nnz = a.nnz
    p0 = int(a.indptr[0]) if len(a.indptr) else 0
    indptr = a.indptr - p0 if p0 else a.indptr
    indices = a.indices[p0 : p0 + nnz]
    data = a.data[p0 : p0 + nnz]
    inter = np.zeros((nthreads + 1, n), dtype=np.int32)
    intra = np.empty(nnz, dtype=np.int32)
    bounds = _thread_bounds(nnz, nthreads)
    bad = _scan_count(indices, np.int64(n), bounds, inter, intra)
    if bad >= 0:
        raise MatrixFormatError("<matrix>", f"column index {int(indices[bad])} out of range [0, {n})")
    out_indptr = np.zeros(n + 1, dtype=INDPTR_DTYPE)
    np.cumsum(inter.sum(axis=0, dtype=np.int64), out=out_indptr[1:])  # cscColPtr: prefix sum of the column totals
    cursor = out_indptr[:-1].copy()
    base = np.empty((nthreads, n), dtype=np.int64)
    _vertical_scan(inter, cursor, base, _SCAN_BLOCK)
    out_indices = np.empty(nnz, dtype=INDEX_DTYPE)
    out_data = np.empty(nnz, dtype=VALUE_DTYPE)
    _scatter(indptr, indices, data, bounds, base, intra, np.int64(0), out_indices, out_data)
    return CSRMatrix(out_indptr, out_indices, out_data, (n, m))


def scantrans(a: CSRMatrix, *, threads: int | None = None, chunk_nnz: int | None = DEFAULT_CHUNK_NNZ) -> CSRMatrix:
    """Transpose ``a`` with ScanTrans on the CPU (Numba).

    Parameters
    ----------
    a
        The matrix (rows in order; columns within a row in any order).
    threads
        Number of threads (None: Numba's current setting).
    chunk_nnz
        Non-zeros per chunk. When the whole matrix fits one chunk (or
        ``chunk_nnz`` is None) this is the one-pass algorithm of thesis Code
        6.1 with nnz-sized ``intra``; otherwise a column histogram first gives
        the row pointer and the chunks are scattered one after another, with
        chunk-sized auxiliaries.

    Returns
    -------
    CSRMatrix
        ``a`` transposed, shape ``(n, m)``; identical to SciPy's ``a.T.tocsr()``.

    Raises
    ------
    MatrixFormatError
        If a column index is out of range or ``m`` exceeds 2**31.
    ConfigError
        If ``threads`` or ``chunk_nnz`` is invalid.
    """
    m, n = a.shape
    if m > _INT32_MAX + 1:
        raise MatrixFormatError("<matrix>", f"{m} rows: the transpose's int32 column indices hold at most 2**31")
    if chunk_nnz is not None and (chunk_nnz < 1 or chunk_nnz > MAX_CHUNK_NNZ):
        raise ConfigError("chunk_nnz", f"{chunk_nnz!r} is not in [1, 2**31-1]")
    with numba_threads(threads) as nt:
        if a.nnz <= (MAX_CHUNK_NNZ if chunk_nnz is None else chunk_nnz):
            return _scantrans_single(a, nt)
        hist = column_counts(a.indices[int(a.indptr[0]) : int(a.indptr[-1])], n)
        scat = ScanTransScatter(histogram_total(hist), a.shape, threads=nt)
        del hist
        for r0, r1 in iter_row_chunks(a.indptr, chunk_nnz):
            scat.add(r0, _row_block(a, r0, r1))
        return scat.finish()


# --------------------------------------------------------------------------- other methods


def scipy_transpose(a: CSRMatrix) -> CSRMatrix:
    """Transpose with SciPy (``A.T.tocsr()``), single-threaded.

    Memory: besides ``a``, the output (SciPy picks int32 index arrays while
    ``nnz < 2**31``, else int64, and the int32 copy of the indices then
    adds 4 bytes per non-zero).
    """
    import scipy.sparse as sp

    s = sp.csr_matrix((a.data, a.indices, a.indptr), shape=a.shape, copy=False)
    t = s.T.tocsr()
    return CSRMatrix(t.indptr, t.indices, t.data, t.shape)


def _cupy():
    """Import CuPy and check for a device; raise DeviceError otherwise."""
    try:
        import cupy
        import cupyx.scipy.sparse  # noqa: F401
    except ImportError as exc:
        raise DeviceError(f"the cusparse transposition needs CuPy (pip install mlemlib[gpu]): {exc}") from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError without a driver
        raise DeviceError(f"the cusparse transposition needs a CUDA GPU: {exc}") from exc
    if count < 1:
        raise DeviceError("the cusparse transposition needs a CUDA GPU: none found")
    return cupy


def cusparse_warm_up() -> None:
    """Create CuPy's cuSPARSE handle and kernels on a tiny matrix, so that timings exclude set-up."""
    a = CSRMatrix(np.array([0, 2, 3]), np.array([1, 0, 1]), np.array([1.0, 2.0, 3.0]), (2, 2))
    cusparse_transpose(a)


def cusparse_transpose(a: CSRMatrix, *, timing: dict | None = None) -> CSRMatrix:
    """Transpose on the GPU with cuSPARSE through CuPy (``csr_matrix(...).T.tocsr()``).

    CuPy's sparse matrices use int32 indices, so ``nnz`` must stay below 2**31.
    Device memory: the matrix, its transpose and cuSPARSE's work buffer.

    Parameters
    ----------
    a
        The matrix.
    timing
        Optional dict that receives ``"seconds"`` (the transposition on the
        device, synchronised) and ``"seconds_transfer"`` (host<->device copies).

    Raises
    ------
    DeviceError
        Without CuPy or a CUDA device.
    MatrixFormatError
        If ``nnz`` or a dimension does not fit int32.
    """
    cupy = _cupy()
    import cupyx.scipy.sparse as csp

    m, n = a.shape
    if a.nnz > _INT32_MAX or m > _INT32_MAX or n > _INT32_MAX:
        raise MatrixFormatError("<matrix>", f"shape {a.shape} with {a.nnz} non-zeros exceeds CuPy's int32 indices")
    t0 = time.perf_counter()
    p0 = int(a.indptr[0]) if len(a.indptr) else 0
    d_indptr = cupy.asarray((a.indptr - p0).astype(np.int32))
    d_indices = cupy.asarray(a.indices[p0 : p0 + a.nnz])
    d_data = cupy.asarray(a.data[p0 : p0 + a.nnz])
    dev = csp.csr_matrix((d_data, d_indices, d_indptr), shape=(m, n))
    cupy.cuda.Device().synchronize()
    t1 = time.perf_counter()
    dt = dev.T.tocsr()
    cupy.cuda.Device().synchronize()
    t2 = time.perf_counter()
    del dev, d_indptr, d_indices, d_data
    out = CSRMatrix(
        cupy.asnumpy(dt.indptr).astype(INDPTR_DTYPE),
        cupy.asnumpy(dt.indices).astype(INDEX_DTYPE, copy=False),
        cupy.asnumpy(dt.data).astype(VALUE_DTYPE, copy=False),
        (n, m),
    )
    t3 = time.perf_counter()
    if timing is not None:
        timing["seconds"] = t2 - t1
        timing["seconds_transfer"] = (t1 - t0) + (t3 - t2)
    return out


def transpose(
    a: CSRMatrix,
    method: str = "scantrans",
    threads: int | None = None,
    *,
    chunk_nnz: int | None = DEFAULT_CHUNK_NNZ,
) -> CSRMatrix:
    """Transpose an in-memory CSR matrix; every method returns identical arrays.

    Parameters
    ----------
    a
        The matrix, shape ``(m, n)``.
    method
        ``"scantrans"`` (CPU, Numba), ``"scipy"`` or ``"cusparse"`` (GPU).
    threads
        Threads for ``scantrans`` (None: Numba's setting); ignored otherwise.
    chunk_nnz
        Chunk size for ``scantrans`` (see :func:`scantrans`).

    Returns
    -------
    CSRMatrix
        ``A^T``, shape ``(n, m)``, rows with sorted column indices.

    Raises
    ------
    ConfigError
        For an unknown method.
    DeviceError
        For ``cusparse`` without CuPy or a GPU.
    """
    if method == "scantrans":
        return scantrans(a, threads=threads, chunk_nnz=chunk_nnz)
    if method == "scipy":
        return scipy_transpose(a)
    if method == "cusparse":
        return cusparse_transpose(a)
    raise ConfigError("method", f"unknown transposition method {method!r}, expected one of {', '.join(METHODS)}")


# --------------------------------------------------------------------------- file stage


def warm_up() -> None:
    """Compile the ScanTrans kernels (cached on disk) so that timings exclude compilation."""
    a = CSRMatrix(np.array([0, 2, 3]), np.array([1, 0, 1]), np.array([1.0, 2.0, 3.0]), (2, 2))
    scantrans(a, chunk_nnz=None)
    hist = column_counts(a.indices, 2)
    s = ScanTransScatter(histogram_total(hist), a.shape)
    s.add(0, a)
    s.finish()


def _write_transpose(
    out: str | os.PathLike, t: CSRMatrix, attrs: dict, *, source: str, chunk_nnz: int, fmt: str = "csr"
) -> int | None:
    """Write ``t`` as a container of format ``fmt`` with extra attributes (atomic); return the code width.

    A compressed ``fmt`` encodes each row chunk of ``t`` as it is written, from
    ``t``'s float32 values (the input's decoded values), with one code width
    for the file: :func:`~mlemlib.formats.compressed_h5.sample_code_bits` of
    ``t`` (the whole matrix up to 4 million elements, else rows spread over
    it), as :func:`mlemlib.formats.convert` chooses it.
    """
    from mlemlib.formats import InMemoryMatrix
    from mlemlib.formats.compressed_h5 import sample_code_bits

    spec = matrix_format_of(fmt)
    code_bits = sample_code_bits(InMemoryMatrix(t, out), spec.name) if spec.compressed else None
    with spec.writer(out, t.shape, t.nnz, code_bits=code_bits, source=source, **attrs) as w:
        for r0, r1 in iter_row_chunks(t.indptr, chunk_nnz):
            w.write_rows(_row_block(t, r0, r1))
    return code_bits


def transpose_file(
    matrix_h5: str | os.PathLike,
    out: str | os.PathLike,
    method: str = "scantrans",
    *,
    threads: int | None = None,
    chunk_nnz: int = DEFAULT_CHUNK_NNZ,
) -> dict:
    """The ``transpose`` stage: read ``matrix.h5``, write ``A^T`` as ``transpose.h5``.

    ``transpose.h5`` is a container of the same format as ``matrix.h5`` (CSR,
    ``compressed``, ``compressed-f16`` or ``compressed-u16``; shape ``(n, m)``,
    column indices = LOR numbers) with the attributes ``kind="transpose"``,
    ``method``, ``source`` (the input's file name), ``source_checksum`` (the
    input's checksum), ``threads`` and ``seconds`` (the transposition proper).

    Values: ``A^T`` holds exactly the values ``A`` decodes to, so that it is
    ``A``'s transpose bit for bit and a run back-projecting with it models what
    its forward projection does. A CSR or ``compressed`` (lossless) transpose
    stores them as they are; the transpose of a lossy (16-bit) matrix is
    written in the lossless ``compressed`` format (:func:`mlemlib.compressed.exact_format`):
    encoding it again in 16 bits would round every value a second time, and
    OSEM with such an ``A^T`` missed the float64 reference by 2.5e-5.

    Memory: ``scantrans`` holds the output (8 bytes per non-zero plus the
    row pointer; a compressed one is encoded chunk by chunk as it is written), one input chunk (8 bytes per non-zero of the chunk),
    ``intra`` (4 bytes per chunk non-zero) and the per-thread tables
    (``inter`` and the column bases, or the first pass's histogram: at most
    ``12 * T * n`` bytes): one copy of the matrix. ``scipy`` and
    ``cusparse`` read the whole matrix and hold it beside the output: two
    copies (``scipy`` switches to int64 indices, 12 bytes per non-zero of
    output, when ``nnz >= 2**31``).

    Parameters
    ----------
    matrix_h5
        The input container.
    out
        The output path (written atomically).
    method
        ``scantrans``, ``scipy`` or ``cusparse``.
    threads
        Threads for ``scantrans`` (None: all Numba threads).
    chunk_nnz
        Non-zeros per streamed chunk (``scantrans``).

    Returns
    -------
    dict
        ``out``, ``method``, ``format`` (the input's and the output's),
        ``code_bits`` (compressed formats, else None), ``shape`` (of the
        output), ``nnz``, ``threads``, ``chunk_nnz``, ``seconds`` (the transposition: histogram + ScanTrans
        kernels, SciPy's ``tocsr``, or the cuSPARSE call on the device),
        ``seconds_total`` (the whole stage, reading and writing included).

    Raises
    ------
    MatrixFormatError
        For a corrupt input.
    ConfigError
        For a bad method, thread count or chunk size.
    DeviceError
        For ``cusparse`` without a GPU.
    """
    from mlemlib.formats.h5 import MatrixH5

    if method not in METHODS:
        raise ConfigError("method", f"unknown transposition method {method!r}, expected one of {', '.join(METHODS)}")
    if not isinstance(chunk_nnz, (int, np.integer)) or not 1 <= chunk_nnz <= MAX_CHUNK_NNZ:
        raise ConfigError("chunk_nnz", f"{chunk_nnz!r} is not in [1, 2**31-1]")
    if method == "cusparse":
        _cupy()  # fail before reading gigabytes
    t_start = time.perf_counter()
    name = Path(matrix_h5).name
    with MatrixH5(matrix_h5) as src, numba_threads(threads) as nt:
        m, n = src.shape
        fmt = matrix_format_of(src).name  # a compressed container's format; its rows are read decoded
        if method == "scantrans":
            warm_up()
            log.info("%s: ScanTrans of %d x %d, %d non-zeros, %d threads, chunks of %d", name, m, n, src.nnz, nt, chunk_nnz)
            seconds = 0.0
            hist = np.zeros((nt, n), dtype=np.int64)
            for r0, r1, block in src.iter_chunks(max_nnz=chunk_nnz, validate=True):
                t0 = time.perf_counter()
                column_counts(block.indices, n, hist=hist, source=matrix_h5)
                seconds += time.perf_counter() - t0
                log.debug("%s: counted rows %d..%d", name, r0, r1)
            counts = histogram_total(hist)
            del hist
            if int(counts.sum()) != src.nnz:
                raise MatrixFormatError(matrix_h5, f"chunks hold {int(counts.sum())} non-zeros, header says {src.nnz}")
            scat = ScanTransScatter(counts, (m, n), threads=nt, source=matrix_h5)
            next_report = 0.1
            # validated in pass 1; the kernels re-check the column range
            for r0, r1, block in src.iter_chunks(max_nnz=chunk_nnz, validate=False):
                scat.add(r0, block)
                if m and r1 / m >= next_report:
                    log.info("%s: transposed rows up to %d of %d (%.0f%%)", name, r1, m, 100.0 * r1 / m)
                    next_report = r1 / m + 0.1
            t = scat.finish()
            seconds += scat.seconds
        else:
            a = src.read_rows(0, m)
            log.info("%s: %s transposition of %d x %d, %d non-zeros", name, method, m, n, a.nnz)
            if method == "scipy":
                t0 = time.perf_counter()
                t = scipy_transpose(a)
                seconds = time.perf_counter() - t0
            else:
                cusparse_warm_up()
                timing: dict = {}
                t = cusparse_transpose(a, timing=timing)
                seconds = timing["seconds"]
            del a
        attrs = {
            "kind": "transpose",
            "method": method,
            "source_checksum": src.checksum,
            "threads": int(nt) if method == "scantrans" else 1,
            "seconds": float(seconds),
        }
    from mlemlib.compressed import exact_format

    fmt = exact_format(fmt)
    log.info("%s: transposed in %.3f s (%s); writing %s (%s)", name, seconds, method, out, fmt)
    code_bits = _write_transpose(out, t, attrs, source=name, chunk_nnz=chunk_nnz, fmt=fmt)
    total = time.perf_counter() - t_start
    return {
        "out": os.fspath(out),
        "method": method,
        "format": fmt,
        "code_bits": code_bits,
        "shape": [n, m],
        "nnz": int(t.nnz),
        "threads": attrs["threads"],
        "chunk_nnz": int(chunk_nnz),
        "seconds": float(seconds),
        "seconds_total": float(total),
    }
