"""Private helpers shared by the matrix readers and writers (NumPy, host memory).

The checks are vectorised (a few reductions per block, no Python loop per row)
and report global positions: the row and element numbers in the whole file,
not in the block, so a message points at the fault on disk.
:class:`RowBlockReader` and :class:`RowBlockWriter` hold what the readers and
the streaming writers of every format do alike (row blocks, bookkeeping).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import numpy as np

from mlemlib.errors import MatrixFormatError, os_error_words
from mlemlib.matrix import CSRMatrix, chunk_bounds
from mlemlib.setup_times import timed

#: Elements per streamed row block, unless the caller says otherwise.
DEFAULT_CHUNK_NNZ = 1 << 26


@timed("check")
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


@timed("check")
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


#: What the refusal of a negative value suggests.
CLIP_HINT = ("a system matrix holds probabilities; 'mlem convert --clip-negative' (the workflow: "
             "matrices.<name>.clip_negative: true) sets negative values to 0")


@timed("check")
def check_values(vals: np.ndarray, source: str | os.PathLike, *, elem0: int = 0, negative_ok: bool = False) -> None:
    """Raise :class:`MatrixFormatError` unless every value is finite and (unless ``negative_ok``) non-negative.

    Two reductions (min and max propagate NaN); the offending element is looked
    up only when the check fails. A negative value's message names
    ``mlem convert --clip-negative``.
    """
    if len(vals) == 0:
        return
    lo, hi = vals.min(), vals.max()
    if (lo >= 0 or (negative_ok and np.isfinite(lo))) and np.isfinite(hi):
        return
    nonfinite = ~np.isfinite(vals)
    if nonfinite.any():
        bad = int(np.argmax(nonfinite))
        raise MatrixFormatError(source, f"non-finite value {float(vals[bad])!r} at element {elem0 + bad}")
    bad = int(np.argmax(vals < 0))
    raise MatrixFormatError(source, f"negative value {float(vals[bad])!r} at element {elem0 + bad} ({CLIP_HINT})")


def check_range(start: int, stop: int, m: int, source: str | os.PathLike) -> tuple[int, int]:
    """Return ``(start, stop)`` as ints; raise ``IndexError`` unless ``0 <= start <= stop <= m``."""
    start, stop = int(start), int(stop)
    if not 0 <= start <= stop <= m:
        raise IndexError(f"{os.fspath(source)}: row range [{start}, {stop}) outside [0, {m}]")
    return start, stop


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


def split_rows(matrix: CSRMatrix, max_nnz: int) -> Iterator[CSRMatrix]:
    """Yield consecutive row blocks of ``matrix`` (views, ``indptr`` rebased to 0), see :func:`chunk_bounds`."""
    base = int(matrix.indptr[0]) if len(matrix.indptr) else 0
    ip = matrix.indptr - base
    for r0, r1 in chunk_bounds(ip, max_nnz):
        lo, hi = int(ip[r0]), int(ip[r1])
        yield CSRMatrix(ip[r0 : r1 + 1] - lo, matrix.indices[lo:hi], matrix.data[lo:hi], (r1 - r0, matrix.shape[1]))


def check_buffers(k: int, indices: np.ndarray, data: np.ndarray) -> int:
    """``k`` if both buffers hold ``k`` elements (:meth:`RowBlockReader.read_rows_into`), else ``ValueError``."""
    k = int(k)
    if len(indices) < k or len(data) < k:
        raise ValueError(f"buffers of {len(indices)} and {len(data)} elements cannot hold {k}")
    return k


class RowBlockReader:
    """What every matrix reader derives from ``shape``, ``read_indptr`` and ``read_rows``.

    A subclass provides ``shape``, ``close()``, ``read_indptr()`` and
    ``read_rows(start, stop, *, validate)``; this adds the context manager,
    row blocks and whole-matrix reads.
    """

    shape: tuple[int, int]
    #: whether ``iter_chunks(reuse=True)`` reads into reused buffers (False where a block is a view already)
    reads_into_buffers: bool = True
    #: whether validated reads let negative values through (``open_matrix(..., allow_negative=True)``, for
    #: ``convert(..., clip_negative=True)``); non-finite values are refused all the same
    allow_negative: bool = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chunk_bounds(self, max_nnz: int = DEFAULT_CHUNK_NNZ) -> list[tuple[int, int]]:
        """Row blocks of at most ``max_nnz`` elements (a longer row is a block of its own)."""
        return chunk_bounds(self.read_indptr(), max_nnz)

    def iter_chunks(
        self, max_nnz: int = DEFAULT_CHUNK_NNZ, *, validate: bool = True, reuse: bool = False
    ) -> Iterator[tuple[int, int, CSRMatrix]]:
        """Yield ``(row0, row1, block)`` covering every row exactly once, in order.

        Each block holds at most ``max_nnz`` elements unless a single row is
        longer. Iterating over all chunks with ``validate=True`` validates the
        whole file. Block k + 1 is read (and decoded, checked) on a helper
        thread while block k is used: two blocks in memory, the reading hidden
        behind the caller's work (the norm, the simulation, the transposition).

        ``reuse``: the blocks' columns and values live in two pairs of buffers
        of ``max_nnz`` elements, used in turn (:meth:`read_rows_into`), so a
        pass over a large matrix faults in no new pages block after block; a
        block is then valid only until the next one is asked for (a longer row
        gets arrays of its own).
        """
        from mlemlib._io import prefetched

        bounds = self.chunk_bounds(max_nnz)
        if reuse and bounds and self.reads_into_buffers:
            cap = max(1, int(max_nnz))
            buffers = [(np.empty(cap, dtype=np.int32), np.empty(cap, dtype=np.float32)) for _ in range(2)]

            def read(k: int) -> CSRMatrix:
                r0, r1 = bounds[k]
                idx, val = buffers[k % 2]
                try:
                    ip = self.read_rows_into(r0, r1, idx, val, validate=validate)
                except MatrixFormatError:
                    raise
                except ValueError:  # a row longer than the buffers
                    return self.read_rows(r0, r1, validate=validate)
                nnz = int(ip[-1])
                return CSRMatrix(ip, idx[:nnz], val[:nnz], (r1 - r0, self.shape[1]))

            for (r0, r1), block in zip(bounds, prefetched(read, range(len(bounds)))):
                yield r0, r1, block
            return
        blocks = prefetched(lambda rr: self.read_rows(rr[0], rr[1], validate=validate), bounds)
        for (r0, r1), block in zip(bounds, blocks):
            yield r0, r1, block

    def row_pointer(self, start: int, stop: int) -> tuple[np.ndarray, int]:
        """Rows ``[start, stop)``'s row pointer rebased to 0 (``stop - start + 1`` entries, checked) and the index of
        their first element. Readers that can read only the range's (``.h5``, ``.csr4``) override this."""
        start, stop = check_range(start, stop, self.shape[0], getattr(self, "source", "matrix"))
        ip = np.asarray(self.read_indptr()[start : stop + 1], dtype=np.int64)
        return ip - ip[0], int(ip[0])

    def read_rows_into(self, start: int, stop: int, indices: np.ndarray, data: np.ndarray, *,
                       validate: bool = True) -> np.ndarray:
        """Rows ``[start, stop)`` with their columns and values written to the front of ``indices`` and ``data``.

        For callers that bring their own buffers (the GPU upload's pinned
        staging buffers): returns the range's row pointer rebased to 0, whose
        last entry is the number of elements written. Raises ``ValueError`` if
        the buffers are shorter. Readers that can read straight into the
        buffers (``.h5``, ``.csr4``) override this; the rest copy a
        :meth:`read_rows` block.
        """
        block = self.read_rows(start, stop, validate=validate)
        k = check_buffers(block.nnz, indices, data)
        np.copyto(indices[:k], block.indices[:k], casting="unsafe")
        np.copyto(data[:k], block.data[:k])
        return np.asarray(block.indptr, dtype=np.int64) - int(block.indptr[0])

    def to_csr(self) -> CSRMatrix:
        """Read the whole matrix into memory (small matrices, tests)."""
        return self.read_rows(0, self.shape[0])


class ElementReader(RowBlockReader):
    """A reader that reads a row range's elements into any arrays (``.h5``, ``.csr4``): :meth:`read_rows` and
    :meth:`read_rows_into` from the subclass's :meth:`~RowBlockReader.row_pointer` (reading only the range's)
    and ``_read_elements(base, indices, data, validate)``."""

    def _read_elements(self, base: int, indices: np.ndarray, data: np.ndarray, validate: bool) -> None:
        raise NotImplementedError

    def read_rows(self, start: int, stop: int, *, validate: bool = True) -> CSRMatrix:
        """Rows ``[start, stop)`` as a CSR block (``indptr`` from 0, its own arrays); only that range is read.

        ``validate``: check the elements read (columns in range, values finite and
        non-negative); the row pointer of the range is always checked (non-decreasing,
        within nnz). Raises :class:`MatrixFormatError` if the range read is
        inconsistent, ``IndexError`` if it lies outside the matrix.
        """
        indptr, base = self.row_pointer(start, stop)
        k = int(indptr[-1])
        indices, data = np.empty(k, dtype=np.int32), np.empty(k, dtype=np.float32)
        self._read_elements(base, indices, data, validate)
        return CSRMatrix(indptr, indices, data, (len(indptr) - 1, self.shape[1]))

    def read_rows_into(self, start: int, stop: int, indices: np.ndarray, data: np.ndarray, *,
                       validate: bool = True) -> np.ndarray:
        """:meth:`RowBlockReader.read_rows_into`, the elements read straight into the buffers."""
        indptr, base = self.row_pointer(start, stop)
        k = check_buffers(indptr[-1], indices, data)
        self._read_elements(base, indices[:k], data[:k], validate)
        return indptr


#: HDF5 objects of files that could not be closed (:meth:`RowBlockWriter._close_h5`), kept alive.
ABANDONED: list[Any] = []


class RowBlockWriter:
    """Bookkeeping shared by the streaming, atomic writers.

    A subclass sets ``path``, ``shape``, ``nnz``, ``_rows = _written = 0`` and
    ``_open = True`` and provides ``close()`` and ``abort()``; a ``with`` block
    closes the writer on success and aborts it on an exception. ``nnz`` None
    means not known in advance (a generator that traces each row once): the
    writer grows its arrays and takes the count it was given when it closes.
    """

    path: Path
    shape: tuple[int, int]
    nnz: int | None
    _rows: int
    _written: int
    _open: bool

    @property
    def rows_written(self) -> int:
        """Rows written so far."""
        return self._rows

    def _dataset(self, name: str) -> Any:
        """The open dataset ``name`` of the HDF5 file being written, kept for the writer's life.

        One handle per dataset: a handle made for each write (``f[name][lo:hi] = a``) is closed as
        soon as it is dropped, and that close, which flushes its cached chunks, can fail on a full
        disk where nothing reports it (h5py prints the error and goes on), so the writer went on
        writing after the disk was full. With handles kept, the write itself fails and raises.
        """
        cache = self.__dict__.setdefault("_datasets", {})
        ds = cache.get(name)
        if ds is None:
            ds = cache[name] = self._f[name]
        return ds

    def _close_h5(self) -> None:
        """Close the HDF5 file being written (and with it the kept dataset handles), once.

        Where HDF5 cannot close it (a full disk: the close flushes), the file's objects are kept
        referenced for the life of the process (:data:`ABANDONED`) and the error propagates: dropped,
        each would try to close again and HDF5 crashes on that (a segmentation fault). The ``mlem``
        command then ends without the interpreter's teardown (:func:`mlemlib.cli.run`). h5py raises a
        failed close as a RuntimeError whose text gives the system's errno: it goes on as that OSError.
        """
        if self.__dict__.get("_h5_closed"):
            return
        self._h5_closed = True
        try:
            self._f.close()
        except BaseException as exc:
            ABANDONED.append((self._f, self.__dict__.pop("_datasets", None)))
            code = re.search(r"errno = (\d+)", str(exc)) if isinstance(exc, RuntimeError) else None
            if code:
                raise OSError(int(code[1]), os.strerror(int(code[1]))) from exc
            raise
        self.__dict__.pop("_datasets", None)

    def _accept(self, block: CSRMatrix, *, validate: bool = True) -> int:
        """Check that ``block`` is the next row block that fits the declared size; return its nnz."""
        if not self._open:
            raise ValueError(f"{self.path}: writer is closed")
        k, bn = block.shape
        m, n = self.shape
        if bn != n:
            raise MatrixFormatError(self.path, f"row block has {bn} columns, the file has n = {n}")
        if self._rows + k > m:
            raise MatrixFormatError(self.path, f"rows {self._rows}..{self._rows + k} exceed m = {m}")
        if validate:
            check_block(block, self.path, row0=self._rows, elem0=self._written)
        bnnz = block.nnz
        if self.nnz is not None and self._written + bnnz > self.nnz:
            raise MatrixFormatError(
                self.path, f"elements {self._written}..{self._written + bnnz} exceed nnz = {self.nnz}"
            )
        return bnnz

    def attach(self, datasets: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
        """Store extra datasets and attributes in an HDF5 container being written (a row fold, for one).

        Raises
        ------
        ValueError
            When the writer is closed, or writes no HDF5 file (``.csr4``).
        """
        f = getattr(self, "_f", None)
        if not self._open or f is None or not hasattr(f, "create_dataset"):
            raise ValueError(f"{self.path}: cannot attach datasets (writer closed, or not an HDF5 container)")
        for name, data in datasets.items():
            f.create_dataset(name, data=data)
        for key, value in attrs.items():
            f.attrs[key] = value

    def _check_complete(self) -> None:
        """Abort and raise unless exactly ``m`` rows and ``nnz`` elements were written."""
        m = self.shape[0]
        if self.nnz is None and self._rows == m:
            self.nnz = self._written  # the count becomes what was written
        if self._rows != m or self._written != self.nnz:
            msg = (
                f"writer closed after {self._rows} of {m} rows and {self._written}"
                f"{'' if self.nnz is None else f' of {self.nnz}'} elements; nothing written"
            )
            self.abort()
            raise MatrixFormatError(self.path, msg)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close on success, abort on an exception; an OSError that names no file (h5py's, a full disk's,
        raised on a writer thread) leaves naming this writer's output."""
        try:
            if exc_type is None:
                self.close()
            else:
                self.abort()
        except OSError as err:
            if err.filename:
                raise
            raise _named(err, self.path) from err
        if isinstance(exc, OSError) and not exc.filename:
            raise _named(exc, self.path) from exc


def _named(exc: OSError, path: Path) -> OSError:
    """``exc`` as an OSError of ``path``: its errno and :func:`~mlemlib.errors.os_error_words`."""
    return OSError(exc.errno, os_error_words(exc), str(path))
