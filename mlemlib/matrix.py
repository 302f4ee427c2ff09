"""The in-memory CSR matrix of mlemlib and its invariants (NumPy, host memory).

A system matrix ``A`` (m lines of response x n voxels) is held as CSR with an
int64 row pointer, int32 column indices and float32 values. Row blocks of a
large matrix are CSR matrices too, with a row pointer rebased to start at 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from mlemlib.errors import MatrixFormatError

INDPTR_DTYPE = np.int64
INDEX_DTYPE = np.int32
VALUE_DTYPE = np.float32


@dataclass
class CSRMatrix:
    """A CSR matrix: ``indptr`` (int64, m+1), ``indices`` (int32, nnz), ``data`` (float32, nnz).

    Parameters
    ----------
    indptr, indices, data
        The CSR arrays. They are converted to the canonical dtypes (a copy only
        where the dtype differs).
    shape
        ``(m, n)``.
    """

    indptr: np.ndarray
    indices: np.ndarray
    data: np.ndarray
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        self.indptr = np.asarray(self.indptr, dtype=INDPTR_DTYPE)
        self.indices = np.asarray(self.indices, dtype=INDEX_DTYPE)
        self.data = np.asarray(self.data, dtype=VALUE_DTYPE)
        self.shape = (int(self.shape[0]), int(self.shape[1]))

    @property
    def nnz(self) -> int:
        return int(self.indptr[-1] - self.indptr[0]) if len(self.indptr) else 0

    @property
    def nbytes(self) -> int:
        return self.indptr.nbytes + self.indices.nbytes + self.data.nbytes

    def validate(self, source: str | os.PathLike = "<matrix>", *, check_values: bool = True) -> None:
        """Check every CSR invariant; raise :class:`MatrixFormatError` naming ``source``.

        Checks: row pointer length m+1, starting at 0, non-decreasing and ending at
        nnz; column indices in ``[0, n)``; values finite and non-negative (a
        system matrix holds probabilities), unless ``check_values`` is False.
        """
        validate_csr_arrays(
            self.indptr, self.indices, self.data, self.shape, source, check_values=check_values
        )

    def to_scipy(self):
        """Return a ``scipy.sparse.csr_matrix`` sharing the arrays (no copy)."""
        import scipy.sparse as sp

        m = sp.csr_matrix((self.data, self.indices, self.indptr), shape=self.shape, copy=False)
        return m

    @classmethod
    def from_scipy(cls, a) -> CSRMatrix:
        """Build from any SciPy sparse matrix or array (converted to CSR)."""
        a = a.tocsr()
        return cls(a.indptr, a.indices, a.data, a.shape)


def validate_csr_arrays(
    indptr: np.ndarray,
    indices: np.ndarray,
    data: np.ndarray,
    shape: tuple[int, int],
    source: str | os.PathLike = "<matrix>",
    *,
    check_values: bool = True,
    row_offset: int = 0,
) -> None:
    """Validate CSR arrays (a whole matrix or a row block); raise MatrixFormatError.

    ``indptr`` may start at a non-zero offset (a row block of a larger matrix);
    ``row_offset`` is the global index of the block's first row, used in messages.
    """
    m, n = shape
    if indptr.ndim != 1 or len(indptr) != m + 1:
        raise MatrixFormatError(source, f"row pointer has {len(indptr)} entries, expected m+1 = {m + 1}")
    nnz = len(indices)
    if len(data) != nnz:
        raise MatrixFormatError(source, f"{nnz} column indices but {len(data)} values")
    if m and (int(indptr[-1]) - int(indptr[0])) != nnz:
        raise MatrixFormatError(
            source, f"row pointer ends at {int(indptr[-1]) - int(indptr[0])}, expected nnz = {nnz}"
        )
    if m:
        d = np.diff(indptr)
        if d.size and d.min() < 0:
            bad = int(np.argmax(d < 0))
            raise MatrixFormatError(
                source, f"row pointer decreases at row {row_offset + bad} ({int(indptr[bad])} -> {int(indptr[bad + 1])})"
            )
    if nnz:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise MatrixFormatError(source, f"column index {bad} out of range [0, {n})")
        if check_values:
            if not np.isfinite(data).all():
                k = int(np.argmax(~np.isfinite(data)))
                raise MatrixFormatError(source, f"non-finite value {float(data[k])} at element {k}")
            if (data < 0).any():
                k = int(np.argmax(data < 0))
                raise MatrixFormatError(source, f"negative value {float(data[k])} at element {k}")


def shape_nnz(source) -> tuple[tuple[int, int], int]:
    """``((m, n), nnz)`` of any matrix: a :class:`CSRMatrix`, an opened file, a device matrix, SciPy sparse.

    Raises
    ------
    TypeError
        For an object without ``shape`` and ``nnz``.
    """
    if not hasattr(source, "shape") or not hasattr(source, "nnz"):
        raise TypeError(f"expected a matrix with shape and nnz, got {type(source).__name__}")
    return (int(source.shape[0]), int(source.shape[1])), int(source.nnz)


def slice_rows(a: CSRMatrix, r0: int, r1: int) -> CSRMatrix:
    """Rows ``[r0, r1)`` of a host CSR matrix, row pointer rebased to 0 (views, no copy of the data)."""
    ip = np.asarray(a.indptr, dtype=np.int64)
    base = int(ip[r0])
    end = int(ip[r1])
    off = int(ip[0])
    return CSRMatrix(ip[r0 : r1 + 1] - base, a.indices[base - off : end - off], a.data[base - off : end - off], (r1 - r0, a.shape[1]))


def row_elements(indptr: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(out_indptr, positions)`` of the rows ``rows`` (ascending local numbers) of a row pointer: the row
    pointer of those rows alone, and where their elements lie in the arrays ``indptr`` indexes (from
    ``indptr[0]``), in order; any per-element array taken at ``positions`` belongs to ``out_indptr``."""
    rows = np.asarray(rows, dtype=np.int64)
    ip = np.asarray(indptr, dtype=np.int64)
    p0 = int(ip[0])
    starts, ends = ip[rows] - p0, ip[rows + 1] - p0
    lens = ends - starts
    out_ip = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(lens, out=out_ip[1:])
    sel = np.repeat(starts - out_ip[:-1], lens) + np.arange(int(out_ip[-1]), dtype=np.int64)
    return out_ip, sel


def take_rows(a: CSRMatrix, rows: np.ndarray) -> CSRMatrix:
    """The rows ``rows`` (ascending local numbers) of a host CSR matrix or row block, as a new matrix."""
    out_ip, sel = row_elements(a.indptr, rows)
    return CSRMatrix(out_ip, a.indices[sel], a.data[sel], (len(out_ip) - 1, a.shape[1]))


def chunk_bounds(indptr: np.ndarray, max_nnz: int) -> list[tuple[int, int]]:
    """Split rows into consecutive blocks of at most ``max_nnz`` elements.

    ``indptr`` is the full (validated, non-decreasing) row pointer. A single row
    longer than ``max_nnz`` forms a block of its own. Every row is in exactly
    one block; a matrix with no rows gives no blocks.
    """
    if max_nnz < 1:
        raise ValueError(f"max_nnz must be >= 1, got {max_nnz}")
    m = len(indptr) - 1
    bounds = []
    r0 = 0
    while r0 < m:
        target = int(indptr[r0]) + max_nnz
        # rows r0..r1-1 end at or before target
        r1 = int(np.searchsorted(indptr, target, side="right")) - 1
        r1 = min(max(r1, r0 + 1), m)
        bounds.append((r0, r1))
        r0 = r1
    return bounds
