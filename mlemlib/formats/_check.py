"""Private validation helpers shared by the matrix readers (NumPy, host memory).

The checks are vectorised (a few reductions per block, no Python loop per row)
and report global positions: the row and element numbers in the whole file,
not in the block, so a message points at the fault on disk.
"""

from __future__ import annotations

import os

import numpy as np

from mlemlib.errors import MatrixFormatError


def check_row_ends(
    ends: np.ndarray,
    base: int,
    nnz: int,
    source: str | os.PathLike,
    *,
    row0: int = 0,
    what: str = "row pointer",
) -> np.ndarray:
    """Check absolute row end offsets and return the block's rebased int64 indptr.

    Parameters
    ----------
    ends
        Absolute end offsets of rows ``row0 .. row0+k-1`` (any integer dtype,
        typically uint64 from a ``.csr4`` file or int64 from HDF5).
    base
        Absolute start offset of row ``row0`` (the previous row's end, 0 for row 0).
    nnz
        Number of stored elements in the whole file (upper bound of any offset).
    source
        File named in error messages.
    row0
        Global index of the first row, for messages.
    what
        Name of the array in messages.

    Returns
    -------
    numpy.ndarray
        int64 array of length ``k+1`` starting at 0.

    Raises
    ------
    MatrixFormatError
        If an offset exceeds ``nnz`` or the offsets decrease.
    """
    k = len(ends)
    if base < 0 or base > nnz:
        raise MatrixFormatError(source, f"{what} value {base} before row {row0} is outside [0, nnz = {nnz}]")
    indptr = np.empty(k + 1, dtype=np.int64)
    indptr[0] = 0
    if k == 0:
        return indptr
    if ends.dtype.kind == "u":
        hi = int(ends.max())
        if hi > nnz:
            bad = int(np.argmax(ends > np.uint64(nnz)))
            raise MatrixFormatError(source, f"{what} value {int(ends[bad])} at row {row0 + bad} exceeds nnz = {nnz}")
        np.subtract(ends.astype(np.int64, copy=False), base, out=indptr[1:])
    else:
        np.subtract(ends, base, out=indptr[1:], casting="unsafe")
        lo, hi = int(ends.min()), int(ends.max())
        if lo < 0 or hi > nnz:
            bad = int(np.argmax((ends < 0) | (ends > nnz)))
            raise MatrixFormatError(
                source, f"{what} value {int(ends[bad])} at row {row0 + bad} is outside [0, nnz = {nnz}]"
            )
    d = np.diff(indptr)
    if d.min() < 0:
        bad = int(np.argmax(d < 0))
        prev = base + int(indptr[bad])
        raise MatrixFormatError(
            source,
            f"{what} is not non-decreasing at row {row0 + bad} "
            f"(row starts at {prev}, ends at {base + int(indptr[bad + 1])})",
        )
    return indptr


def check_columns(cols: np.ndarray, n: int, source: str | os.PathLike, *, elem0: int = 0) -> None:
    """Raise :class:`MatrixFormatError` unless every column index lies in ``[0, n)``.

    ``elem0`` is the global index of the first element, for messages.
    """
    if len(cols) == 0:
        return
    lo, hi = int(cols.min()), int(cols.max())
    if lo < 0 or hi >= n:
        bad = int(np.argmax((cols < 0) | (cols >= n)))
        raise MatrixFormatError(source, f"column index {int(cols[bad])} at element {elem0 + bad} out of range [0, {n})")


def check_values(vals: np.ndarray, source: str | os.PathLike, *, elem0: int = 0) -> None:
    """Raise :class:`MatrixFormatError` unless every value is finite and non-negative.

    Two reductions (min and max propagate NaN); the offending element is looked
    up only when the check fails.
    """
    if len(vals) == 0:
        return
    lo, hi = vals.min(), vals.max()
    if lo >= 0 and np.isfinite(hi):
        return
    nonfinite = ~np.isfinite(vals)
    if nonfinite.any():
        bad = int(np.argmax(nonfinite))
        raise MatrixFormatError(source, f"non-finite value {float(vals[bad])!r} at element {elem0 + bad}")
    bad = int(np.argmax(vals < 0))
    raise MatrixFormatError(source, f"negative value {float(vals[bad])!r} at element {elem0 + bad}")


def check_range(start: int, stop: int, m: int, source: str | os.PathLike) -> tuple[int, int]:
    """Return ``(start, stop)`` as ints; raise ``IndexError`` unless ``0 <= start <= stop <= m``."""
    start, stop = int(start), int(stop)
    if not 0 <= start <= stop <= m:
        raise IndexError(f"{os.fspath(source)}: row range [{start}, {stop}) outside [0, {m}]")
    return start, stop


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


def check_block(block, source: str | os.PathLike, *, row0: int = 0, elem0: int = 0) -> None:
    """Validate an in-memory CSR row block (a :class:`~mlemlib.matrix.CSRMatrix`) before writing it.

    ``row0``/``elem0`` are the global row and element numbers of its start in
    the file being written, for messages.
    """
    k, n = block.shape
    ip = block.indptr
    if ip.ndim != 1 or len(ip) != k + 1:
        raise MatrixFormatError(source, f"row block pointer has {len(ip)} entries, expected {k + 1}")
    nnz = int(ip[-1] - ip[0])
    if len(block.indices) != nnz or len(block.data) != nnz:
        raise MatrixFormatError(
            source,
            f"row block at row {row0}: pointer spans {nnz} elements but has {len(block.indices)} "
            f"column indices and {len(block.data)} values",
        )
    check_row_ends(ip[1:] - ip[0], 0, nnz, source, row0=row0)
    check_columns(block.indices, n, source, elem0=elem0)
    check_values(block.data, source, elem0=elem0)
