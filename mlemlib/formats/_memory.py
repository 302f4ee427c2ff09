"""In-memory matrices behind the same reader interface as the file readers (NumPy).

Matrix Market and SciPy ``.npz`` files cannot be read by row range, so they are
read whole; :class:`InMemoryMatrix` then offers ``read_rows`` / ``iter_chunks``
like :class:`~mlemlib.formats.csr4.Csr4File` and
:class:`~mlemlib.formats.h5.MatrixH5`, so :func:`mlemlib.formats.convert` treats
every input alike.
"""

from __future__ import annotations

import os

import numpy as np

from mlemlib.errors import MatrixFormatError
from mlemlib.formats._check import (
    RowBlockReader,
    check_columns,
    check_range,
    check_row_ends,
    check_values,
)
from mlemlib.matrix import CSRMatrix, validate_csr_arrays

MAX_INDEX = int(np.iinfo(np.int32).max)


def csr_from_scipy(a, source: str | os.PathLike, *, allow_negative: bool = False) -> CSRMatrix:
    """Convert a SciPy sparse (or dense 2-D) matrix to a validated :class:`CSRMatrix`.

    Duplicate entries are summed and column indices sorted within rows (the
    canonical CSR form). Values are cast to float32. ``allow_negative`` lets
    negative values through (for ``convert(..., clip_negative=True)``).

    Raises
    ------
    MatrixFormatError
        Complex values, a shape beyond the int32 column range, or a matrix that
        has negative or non-finite values (also
        float64 values that overflow float32).
    """
    import scipy.sparse as sp

    if not sp.issparse(a):
        a = np.asarray(a)
        if a.ndim != 2:
            raise MatrixFormatError(source, f"expected a 2-D matrix, got {a.ndim} dimensions")
        a = sp.csr_matrix(a)
    if np.iscomplexobj(a.data):
        raise MatrixFormatError(source, f"complex values ({a.dtype}) are not supported; a system matrix is real")
    if a.dtype.kind not in "fiub":
        raise MatrixFormatError(source, f"unsupported value type {a.dtype}")
    m, n = a.shape
    if n > MAX_INDEX:
        raise MatrixFormatError(source, f"{n} columns exceed the int32 column index range")
    fmt = a.format
    if fmt in ("csr", "csc"):
        # check the raw arrays before SciPy's compiled routines index with them
        shape = (m, n) if fmt == "csr" else (n, m)
        validate_csr_arrays(a.indptr, a.indices, a.data, shape, source, check_values=False)
    a = a.tocsr()
    a.sum_duplicates()  # also sorts indices
    with np.errstate(over="ignore"):
        data = a.data.astype(np.float32)
    mat = CSRMatrix(a.indptr.astype(np.int64), a.indices.astype(np.int32), data, (m, n))
    check_row_ends(mat.indptr[1:], int(mat.indptr[0]), mat.nnz, source)
    check_columns(mat.indices, n, source)
    check_values(mat.data, source, negative_ok=allow_negative)
    return mat


class InMemoryMatrix(RowBlockReader):
    """A whole matrix held in memory, with the file readers' interface.

    Parameters
    ----------
    matrix
        The validated matrix.
    source
        The file it was read from (for messages and ``source`` attributes).
    grid, voxel_size
        Optional geometry (``(gridX, gridY, gridZ)``, ``(w, h, d)`` mm).
    """

    def __init__(
        self,
        matrix: CSRMatrix,
        source: str | os.PathLike = "<memory>",
        *,
        grid: tuple[int, int, int] | None = None,
        voxel_size: tuple[float, float, float] | None = None,
    ) -> None:
        self.matrix = matrix
        self.source = os.fspath(source)
        self.grid = tuple(int(v) for v in grid) if grid is not None else None
        self.voxel_size = tuple(float(v) for v in voxel_size) if voxel_size is not None else None
        self.shape = matrix.shape
        self.nnz = matrix.nnz
        self.attrs: dict = {}

    #: its blocks are views of its arrays: nothing to read into buffers
    reads_into_buffers = False

    def close(self) -> None:
        """Nothing to release (kept for interface symmetry)."""

    def read_indptr(self) -> np.ndarray:
        """The int64 row pointer."""
        return self.matrix.indptr

    def read_rows(self, start: int, stop: int, *, validate: bool = True) -> CSRMatrix:
        """Rows ``[start, stop)`` as a CSR block (views of the matrix's arrays: no second copy; validated on load)."""
        start, stop = check_range(start, stop, self.shape[0], self.source)
        if start == 0 and stop == self.shape[0]:
            return self.matrix
        ip = self.matrix.indptr
        lo, hi = int(ip[start]), int(ip[stop])
        return CSRMatrix(
            ip[start : stop + 1] - lo, self.matrix.indices[lo:hi], self.matrix.data[lo:hi], (stop - start, self.shape[1])
        )

    def to_csr(self) -> CSRMatrix:
        """The matrix itself."""
        return self.matrix
