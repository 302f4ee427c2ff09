"""The project's matrix container: CSR in HDF5 (h5py), read by row range; host memory, NumPy.

Layout (see ``docs/formats.md``)::

    /indptr   int64[m+1]   row pointer, starts at 0, ends at nnz
    /indices  int32[nnz]   column indices
    /data     float32[nnz] values
    attrs: format="mlem-csr", version=1, shape=(m, n), nnz, source, checksum,
           checksum_method, optional grid, voxel_size, scanner_block, and any
           extra attributes given by the writer's caller.

Datasets are chunked (1 MiB chunks, no compression, no filters) so a row range
reads only the chunks it overlaps. :class:`MatrixH5Writer` streams row blocks
and computes the checksum while it writes; :class:`MatrixH5` validates the
attributes against the datasets on open and every range it reads.

Checksum (:data:`CHECKSUM_METHOD`, ``docs/formats.md``): SHA-256 of the
three arrays' terms, each the SHA-256 of the digests of its little-endian
bytes in pieces of 2**20 elements, hashed side by side on a thread pool;
stored as 64 hex digits. Containers of the legacy method
(:data:`LEGACY_CHECKSUM_METHOD`, BLAKE2b of each whole array) are still read
and verified.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from mlemlib import setup_times
from mlemlib._io import atomic_path, prefetched
from mlemlib.errors import MatrixFormatError
from mlemlib.formats._check import (
    DEFAULT_CHUNK_NNZ,
    ElementReader,
    RowBlockWriter,
    check_block,
    check_columns,
    check_range,
    check_row_ends,
    check_values,
    split_rows,
)
from mlemlib.matrix import CSRMatrix

log = logging.getLogger(__name__)

FORMAT = "mlem-csr"
#: The project's other HDF5 files by their ``format`` attribute, named when one is given where a matrix belongs.
OTHER_FILES = {"mlem-image": "an image (mlem reconstruct, mlem simulate's truth)", "mlem-norm": "a norm (mlem norm)",
               "mlem-permutation": "a permutation (mlem reorder --perm-out)"}
VERSION = 1
#: The checksum of every container written now (docs/formats.md, "Checksum").
CHECKSUM_METHOD = (
    "sha256-tree/2: sha256(T(indptr) || T(indices) || T(data)), T(x) = sha256 of the concatenated sha256 digests "
    "of x's little-endian bytes in pieces of 2**20 elements (the last piece shorter; none for an empty array)"
)
#: The checksum of containers written before (read and verified, no longer written).
LEGACY_CHECKSUM_METHOD = (
    "blake2b-256(blake2b-256(indptr) || blake2b-256(indices) || blake2b-256(data)), little-endian"
)
#: dataset name -> on-disk dtype
DATASETS = {"indptr": np.dtype("<i8"), "indices": np.dtype("<i4"), "data": np.dtype("<f4")}
#: Chunk size in bytes of every dataset (1 MiB).
CHUNK_BYTES = 1 << 20
#: Attributes the writer sets itself; callers may not override them.
RESERVED_ATTRS = frozenset(
    {
        "format",
        "version",
        "shape",
        "nnz",
        "source",
        "checksum",
        "checksum_method",
        "grid",
        "voxel_size",
        "scanner_block",
    }
)
#: A folded container's row map (int64[m_user]) and the attribute that marks it (the user's row count):
#: :mod:`mlemlib.fold` reads and writes them; a reordered copy keeps them (docs/formats.md, "Folded matrices").
FOLD_DATASET = "row_fold"
FOLD_ATTR_USER_ROWS = "fold_user_rows"
#: Piece size (elements) for verifying checksums without holding a dataset.
_HASH_PIECE = 1 << 24
#: Elements per hashed piece of the checksum (method :data:`CHECKSUM_METHOD`): pieces are hashed side by side.
CHECKSUM_PIECE = 1 << 20
#: Pieces smaller than this (bytes) are hashed on the calling thread (a pool hand-off would cost more).
_INLINE_BYTES = 1 << 16
#: Threads hashing checksum pieces (``hashlib`` releases the GIL on large buffers).
_HASH_THREADS = max(2, min(8, os.cpu_count() or 2))
_HASH_POOL = ThreadPoolExecutor(max_workers=_HASH_THREADS, thread_name_prefix="checksum")


def _sha256_of(parts: list) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        h.update(memoryview(p).cast("B"))
    return h.digest()


class _TreeStream:
    """One array's term ``T(x)`` of the checksum, fed in order in pieces of any size.

    Every whole piece of :data:`CHECKSUM_PIECE` elements is hashed as a job of
    its own; the digests are kept in piece order. The elements of an
    unfinished piece are copied (a caller may reuse its buffer).
    """

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype
        self.digests: list = []  # bytes or futures of bytes, in piece order
        self.tail: list[np.ndarray] = []
        self.tail_len = 0

    def _emit(self, parts: list, jobs: list) -> None:
        if sum(p.nbytes for p in parts) < _INLINE_BYTES:
            self.digests.append(_sha256_of(parts))
        else:
            job = _HASH_POOL.submit(_sha256_of, parts)
            self.digests.append(job)
            jobs.append(job)

    def submit(self, a: np.ndarray) -> list:
        """Queue ``a``'s elements; return the jobs hashing them (``a`` must stay unchanged until they end)."""
        a = np.ascontiguousarray(a, dtype=self.dtype).reshape(-1)
        jobs: list = []
        pos = 0
        if self.tail_len:
            pos = min(CHECKSUM_PIECE - self.tail_len, len(a))
            self.tail.append(a[:pos])
            self.tail_len += pos
            if self.tail_len == CHECKSUM_PIECE:
                self._emit(self.tail, jobs)
                self.tail, self.tail_len = [], 0
            else:  # a too short to finish the piece: keep copies only
                self.tail[-1] = self.tail[-1].copy()
        while len(a) - pos >= CHECKSUM_PIECE:
            self._emit([a[pos : pos + CHECKSUM_PIECE]], jobs)
            pos += CHECKSUM_PIECE
        if pos < len(a):
            self.tail, self.tail_len = [a[pos:].copy()], len(a) - pos
        return jobs

    def digest(self) -> bytes:
        parts = [d if isinstance(d, bytes) else d.result() for d in self.digests]
        if self.tail_len:
            parts.append(_sha256_of(self.tail))
        return hashlib.sha256(b"".join(parts)).digest()


def _wait(jobs: list) -> None:
    """Wait for every job (all of them, even after one fails), then raise the first failure."""
    error = None
    for j in jobs:
        try:
            j.result()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once all jobs ended
            error = error or exc
    if error is not None:
        raise error


class _Checksum:
    """The container's checksum (:data:`CHECKSUM_METHOD`), fed array by array in any interleaving.

    Each array is fed in order; its whole pieces are hashed on
    :data:`_HASH_THREADS` threads at once, so the checksum keeps up with a
    disk (about 1.6 GB/s per thread for SHA-256 with the CPU's SHA
    instructions, against 0.8 GB/s for the single BLAKE2b stream of
    :data:`LEGACY_CHECKSUM_METHOD`).
    """

    method = CHECKSUM_METHOD

    def __init__(self) -> None:
        self.parts = {name: _TreeStream(dtype) for name, dtype in DATASETS.items()}

    def submit(self, name: str, a: np.ndarray) -> list:
        """Queue ``a`` (the next elements of array ``name``) without waiting; see :meth:`_TreeStream.submit`."""
        return self.parts[name].submit(a)

    def update(self, name: str, a: np.ndarray) -> None:
        _wait(self.submit(name, a))

    def update_rows(self, ends: np.ndarray, indices: np.ndarray, data: np.ndarray,
                    during: Callable[[], None] | None = None) -> None:
        """Add one row block's arrays; ``during`` (the block's writes) runs while they are hashed.

        Returns when the block's pieces are hashed (the caller may then free
        or reuse its arrays), so a block costs the longer of its writes and
        its hashing spread over the hashing threads.
        """
        jobs: list = []
        try:
            jobs += self.submit("indices", indices)
            jobs += self.submit("data", data)
            jobs += self.submit("indptr", ends)
            if during is not None:
                during()
        finally:
            _wait(jobs)

    def hexdigest(self) -> str:
        return hashlib.sha256(b"".join(self.parts[name].digest() for name in DATASETS)).hexdigest()


class _LegacyChecksum:
    """The checksum of containers written before the tree (:data:`LEGACY_CHECKSUM_METHOD`): read, never written."""

    method = LEGACY_CHECKSUM_METHOD

    def __init__(self) -> None:
        self.parts = {name: hashlib.blake2b(digest_size=32) for name in DATASETS}

    def submit(self, name: str, a: np.ndarray) -> list:
        a = np.ascontiguousarray(a, dtype=DATASETS[name])
        self.parts[name].update(memoryview(a).cast("B"))
        return []

    def update(self, name: str, a: np.ndarray) -> None:
        self.submit(name, a)

    def update_rows(self, ends: np.ndarray, indices: np.ndarray, data: np.ndarray,
                    during: Callable[[], None] | None = None) -> None:
        # the two element streams side by side on two threads, the writes meanwhile
        jobs = [_HASH_POOL.submit(self.update, "indices", indices), _HASH_POOL.submit(self.update, "data", data)]
        try:
            if during is not None:
                during()
            self.update("indptr", ends)
        finally:
            _wait(jobs)

    def hexdigest(self) -> str:
        top = hashlib.blake2b(digest_size=32)
        for name in DATASETS:
            top.update(self.parts[name].digest())
        return top.hexdigest()


def checksum_for(method: str | None) -> _Checksum | _LegacyChecksum:
    """A fresh checksum of the kind a container's ``checksum_method`` attribute names.

    Containers without the attribute are read with the legacy method; a
    compressed container's statement carries a suffix (", of the decoded CSR
    arrays") after the method's own.

    Raises
    ------
    ValueError
        For a method this version does not know.
    """
    if method is None or method.startswith(LEGACY_CHECKSUM_METHOD):
        return _LegacyChecksum()
    if method.startswith(CHECKSUM_METHOD):
        return _Checksum()
    raise ValueError(f"unknown checksum_method {method!r}")


def checksum_arrays(indptr: np.ndarray, indices: np.ndarray, data: np.ndarray) -> str:
    """The container checksum of in-memory CSR arrays (hex), as stored by :class:`MatrixH5Writer`."""
    c = _Checksum()
    jobs = c.submit("indptr", indptr) + c.submit("indices", indices) + c.submit("data", data)
    _wait(jobs)
    return c.hexdigest()


def _plain(value):
    """An HDF5 attribute value as a plain Python value."""
    if isinstance(value, np.void):
        return value.tobytes()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return value
    return value


def _peek_format(path: str | os.PathLike) -> str | None:
    """The ``format`` attribute of an HDF5 file, or None (no file, not HDF5, no such attribute)."""
    import h5py

    try:
        with h5py.File(os.fspath(path), "r") as f:
            value = _plain(f.attrs.get("format"))
    except Exception:  # noqa: BLE001 - any failure: let the reader report it
        return None
    return value if isinstance(value, str) else None


# --------------------------------------------------------------------------- reader

#: ``format`` attribute -> reader subclass that opens it (filled by the subclasses' modules:
#: :mod:`mlemlib.formats.compressed_h5`, imported with :mod:`mlemlib.formats`, so before any reader opens).
SUBCLASSES: dict[str, type] = {}


class MatrixH5(ElementReader):
    """Reader of a matrix container; checks its attributes against its datasets on open.

    Parameters
    ----------
    path
        A ``matrix.h5`` (or ``transpose.h5``, ``part-k.h5``) written by
        :class:`MatrixH5Writer`.

    Attributes
    ----------
    shape : tuple[int, int]
    nnz : int
    attrs : dict
        Every attribute as a plain Python value (``scanner_block`` as bytes).
    grid : tuple[int, int, int] | None
    voxel_size : tuple[float, float, float] | None
    scanner_block : bytes | None
    checksum : str

    Raises
    ------
    MatrixFormatError
        Not an HDF5 file, a wrong ``format``/``version``, missing datasets or
        attributes, wrong dtypes, sizes that disagree with ``shape``/``nnz``, a
        row pointer that does not start at 0 or end at nnz, or a grid whose
        product differs from the number of columns.
    """

    def __new__(cls, path: str | os.PathLike, *args, **kwargs):
        # One entry point for every container: a compressed one opens as its
        # subclass (mlemlib.formats.compressed_h5.CompressedH5), so the stages
        # that open MatrixH5 stream it as CSR unchanged.
        if cls is MatrixH5 and SUBCLASSES:
            sub = SUBCLASSES.get(_peek_format(path))
            if sub is not None:
                return super().__new__(sub)
        return super().__new__(cls)

    def __init__(self, path: str | os.PathLike) -> None:
        import h5py

        self.path = Path(path)
        self.source = os.fspath(path)
        if not self.path.exists():
            raise MatrixFormatError(self.source, "no such file")
        try:
            self._f = h5py.File(self.source, "r")
        except OSError as exc:
            raise MatrixFormatError(self.source, f"not a readable HDF5 file ({exc})") from None
        self._fd: int | None = None  # the file opened again for the direct reads (mlemlib.formats._direct)
        self._direct: dict[str, Any] = {}
        self._direct_lock = threading.Lock()
        try:
            self._open()
        except BaseException:
            self._f.close()
            raise

    def _fault(self, fault: str) -> MatrixFormatError:
        return MatrixFormatError(self.source, fault)

    def _open(self) -> None:
        f = self._f
        self.attrs = {k: _plain(v) for k, v in f.attrs.items()}
        a = self.attrs
        if "format" not in a:
            raise self._fault(f"missing attribute 'format' (expected {FORMAT!r}); not an mlem matrix container")
        if a["format"] != FORMAT:
            kind = OTHER_FILES.get(str(a["format"]))
            raise self._fault(f"attribute format is {a['format']!r}, expected {FORMAT!r}"
                              + (f": {kind}, not a matrix" if kind else ""))
        for key in ("version", "shape", "nnz", "checksum"):
            if key not in a:
                raise self._fault(f"missing attribute {key!r}")
        if a["version"] != VERSION:
            raise self._fault(f"unsupported container version {a['version']!r}, expected {VERSION}")
        shape = a["shape"]
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(v, int) and v >= 0 for v in shape)):
            raise self._fault(f"attribute shape is {shape!r}, expected two non-negative integers")
        nnz = a["nnz"]
        if not isinstance(nnz, int) or nnz < 0:
            raise self._fault(f"attribute nnz is {nnz!r}, expected a non-negative integer")
        self.shape = (int(shape[0]), int(shape[1]))
        self.nnz = int(nnz)
        m, n = self.shape
        if n > np.iinfo(np.int32).max:
            raise self._fault(f"{n} columns exceed the int32 column index range")
        expected = {"indptr": m + 1, "indices": self.nnz, "data": self.nnz}
        self._ds = {}
        for name, dtype in DATASETS.items():
            if name not in f:
                raise self._fault(f"missing dataset /{name}")
            ds = f[name]
            if not hasattr(ds, "dtype"):
                raise self._fault(f"/{name} is a group, expected a dataset")
            if ds.dtype != dtype or ds.ndim != 1:
                raise self._fault(f"dataset /{name} is {ds.dtype}{list(ds.shape)}, expected 1-D {dtype.name}")
            if ds.shape[0] != expected[name]:
                what = "shape[0] + 1" if name == "indptr" else "nnz"
                raise self._fault(f"dataset /{name} has {ds.shape[0]} entries, but attribute {what} = {expected[name]}")
            self._ds[name] = ds
        ip = self._ds["indptr"]
        first, last = int(ip[0]), int(ip[m])
        if first != 0:
            raise self._fault(f"row pointer starts at {first}, expected 0")
        if last != self.nnz:
            raise self._fault(f"row pointer ends at {last}, expected nnz = {self.nnz}")
        self._geometry(n)
        self.checksum = str(a["checksum"])
        self.checksum_method = self._checksum_method()

    def _geometry(self, n: int) -> None:
        """Parse the optional ``grid``, ``voxel_size`` and ``scanner_block`` attributes."""
        a = self.attrs
        self.grid = None
        self.voxel_size = None
        if "grid" in a:
            g = a["grid"]
            if not (isinstance(g, list) and len(g) == 3 and all(isinstance(v, int) and v > 0 for v in g)):
                raise self._fault(f"attribute grid is {g!r}, expected three positive integers")
            if math.prod(g) != n:
                raise self._fault(f"attribute grid {g[0]}x{g[1]}x{g[2]} = {math.prod(g)} disagrees with n = {n}")
            self.grid = (int(g[0]), int(g[1]), int(g[2]))
        if "voxel_size" in a:
            v = a["voxel_size"]
            if not (isinstance(v, list) and len(v) == 3 and all(isinstance(x, (int, float)) and x > 0 for x in v)):
                raise self._fault(f"attribute voxel_size is {v!r}, expected three positive numbers")
            self.voxel_size = (float(v[0]), float(v[1]), float(v[2]))
        sb = a.get("scanner_block")
        self.scanner_block = sb if isinstance(sb, bytes) else None

    # -- context management
    def close(self) -> None:
        """Close the HDF5 file."""
        self._f.close()
        with self._direct_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._direct.clear()

    def _read_into(self, name: str, lo: int, hi: int, out: np.ndarray) -> None:
        """Entries ``[lo, hi)`` of dataset ``name`` into ``out``: large ranges of a plain dataset straight from
        the file on several threads (:mod:`mlemlib.formats._direct`), anything else through h5py."""
        from mlemlib.formats._direct import MIN_BYTES, DirectDataset

        if out.nbytes >= MIN_BYTES:
            with self._direct_lock:
                if name not in self._direct:
                    if self._fd is None:
                        self._fd = os.open(self.source, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    self._direct[name] = DirectDataset.of(self._ds[name], self._fd)
                direct = self._direct[name]
            if direct is not None:
                try:
                    if direct.read(lo, hi, out):
                        return
                except OSError as exc:
                    raise self._fault(f"reading /{name}[{lo}:{hi}]: {exc}") from None
        self._ds[name].read_direct(out, np.s_[lo:hi])

    def __repr__(self) -> str:
        return f"MatrixH5({self.source!r}, shape={self.shape}, nnz={self.nnz})"

    # -- reads
    def read_indptr(self) -> np.ndarray:
        """The full int64 row pointer (``m + 1`` entries), validated non-decreasing."""
        with setup_times.phase("read", nbytes=8 * (self.shape[0] + 1)):
            ip = self._ds["indptr"][...]
        return check_row_ends(ip[1:], int(ip[0]), self.nnz, self.source)

    def row_pointer(self, start: int, stop: int) -> tuple[np.ndarray, int]:
        """Rows ``[start, stop)``'s row pointer rebased to 0 (checked) and the index of their first element."""
        start, stop = check_range(start, stop, self.shape[0], self.source)
        with setup_times.phase("read", nbytes=8 * (stop + 1 - start)):
            ip = self._ds["indptr"][start : stop + 1]
        base = int(ip[0])
        return check_row_ends(ip[1:], base, self.nnz, self.source, row0=start), base

    def _read_elements(self, base: int, indices: np.ndarray, data: np.ndarray, validate: bool) -> None:
        """Elements ``[base, base + len(indices))`` into ``indices`` and ``data``, checked where ``validate``."""
        hi = base + len(indices)
        for name, out in (("indices", indices), ("data", data)):
            if hi > base:
                with setup_times.phase("read", nbytes=out.nbytes):
                    self._read_into(name, base, hi, out)
        if validate:
            check_columns(indices, self.shape[1], self.source, elem0=base)
            check_values(data, self.source, elem0=base, negative_ok=self.allow_negative)

    def _read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Entries ``[lo, hi)`` of dataset ``name`` (set-up phase ``read``, with their bytes)."""
        ds = self._ds[name]
        out = np.empty(hi - lo, dtype=ds.dtype.newbyteorder("="))
        if hi > lo:
            with setup_times.phase("read", nbytes=out.nbytes):
                self._read_into(name, lo, hi, out)
        return out

    def read_ahead(self, name: str, ranges: list[tuple[int, int]]) -> Iterator[np.ndarray]:
        """Dataset ``name``'s pieces ``[lo, hi)`` in order, the next one read on a helper thread meanwhile.

        While the caller works on piece k, piece k + 1 is read: two pieces in
        memory at most.
        """
        return prefetched(lambda r: self._read(name, *r), ranges)

    def _checksum_method(self) -> str | None:
        """The ``checksum_method`` attribute, refused in one line if this version cannot verify it."""
        method = self.attrs.get("checksum_method")
        if method is not None and not isinstance(method, str):
            raise self._fault(f"attribute checksum_method is {method!r}, expected a string")
        try:
            checksum_for(method)
        except ValueError as exc:
            raise self._fault(f"{exc}; this version verifies {CHECKSUM_METHOD!r} and the legacy BLAKE2b") from None
        return method

    def compute_checksum(self) -> str:
        """Recompute the checksum from the datasets, reading them piece by piece (by the file's own method).

        Piece k + 1 is read while piece k is hashed on the hashing threads:
        at most three pieces in memory.
        """
        c = checksum_for(self.checksum_method)
        ranges = [
            (name, lo, min(lo + _HASH_PIECE, self._ds[name].shape[0]))
            for name in DATASETS
            for lo in range(0, self._ds[name].shape[0], _HASH_PIECE)
        ]
        pending: deque = deque()
        try:
            for name, piece in prefetched(lambda r: (r[0], self._read(*r)), ranges):
                pending.append(c.submit(name, piece))
                while len(pending) > 2:
                    _wait(pending.popleft())
        finally:
            while pending:
                _wait(pending.popleft())
        return c.hexdigest()

    def verify_checksum(self) -> None:
        """Raise :class:`MatrixFormatError` if the stored checksum differs from the data's."""
        got = self.compute_checksum()
        if got != self.checksum:
            raise self._fault(f"checksum mismatch: attribute says {self.checksum}, data gives {got} (file corrupted)")


def marked_container(matrix: Any, attr: str) -> str | None:
    """The path of the container ``matrix`` (a path or an opened matrix) when it has attribute ``attr``.

    None for a container without it, for files that are not HDF5 (``.csr4``,
    ``.mtx``, ``.npz``) and for in-memory matrices. An opened matrix whose
    ``attrs`` lack ``attr`` is answered without opening the file again.
    """
    import h5py

    if isinstance(matrix, (str, os.PathLike)):
        path = os.fspath(matrix)
    else:
        attrs = getattr(matrix, "attrs", None)
        if attrs is not None and attr not in attrs:
            return None
        path = getattr(matrix, "path", None) or getattr(matrix, "source", None)
        if path is None:
            return None
        path = os.fspath(path)
    if not Path(path).is_file() or not h5py.is_hdf5(path):
        return None
    with h5py.File(path, "r") as f:
        return path if attr in f.attrs else None


def read_matrix_h5(path: str | os.PathLike) -> CSRMatrix:
    """Read a whole matrix container into memory, validated."""
    with MatrixH5(path) as f:
        return f.to_csr()


# --------------------------------------------------------------------------- writer


def _chunk(n_items: int, itemsize: int) -> tuple[int] | None:
    if n_items == 0:
        return None  # empty datasets cannot be chunked with a fixed size
    return (min(n_items, CHUNK_BYTES // itemsize),)


class MatrixH5Writer(RowBlockWriter):
    """Streaming, atomic writer of the matrix container.

    Row blocks are written in order with :meth:`write_rows`; the checksum is
    computed as they stream. :meth:`close` checks that exactly ``m`` rows and
    ``nnz`` elements were written, stores the checksum and renames the
    temporary file to ``path``. On an error (or :meth:`abort`) nothing is left.

    Parameters
    ----------
    path
        Target ``.h5`` file.
    shape, nnz
        Size of the matrix; ``nnz`` None when not known in advance (the
        element datasets then grow with each block; attribute ``nnz`` is set
        on close).
    source
        Name of the file the matrix came from (attribute ``source``).
    grid, voxel_size
        Image geometry (attributes); ``grid``'s product must equal ``n``.
    scanner_block
        The ``.csr4`` scanner block, kept verbatim (opaque attribute).
    **attrs
        Extra attributes (str, numbers, lists of numbers), e.g. ``kind="transpose"``.

    Raises
    ------
    ValueError
        A reserved attribute name in ``attrs``, or an inconsistent grid.
    MatrixFormatError
        A row block that does not fit the declared size or fails validation.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        shape: tuple[int, int],
        nnz: int | None,
        *,
        source: str = "",
        grid: tuple[int, int, int] | None = None,
        voxel_size: tuple[float, float, float] | None = None,
        scanner_block: bytes | None = None,
        **attrs,
    ) -> None:
        import h5py

        self.path = Path(path)
        m, n = int(shape[0]), int(shape[1])
        self.shape = (m, n)
        self.nnz = None if nnz is None else int(nnz)
        if m < 0 or n < 0 or (self.nnz is not None and self.nnz < 0):
            raise ValueError(f"bad shape {shape} or nnz {nnz}")
        if n > np.iinfo(np.int32).max:
            raise ValueError(f"n = {n} exceeds the int32 column index range")
        bad = RESERVED_ATTRS.intersection(attrs)
        if bad:
            raise ValueError(f"reserved attribute names {sorted(bad)}; pass them as keywords")
        if grid is not None:
            grid = tuple(int(g) for g in grid)
            if len(grid) != 3 or math.prod(grid) != n:
                raise ValueError(f"grid {grid} does not multiply to n = {n}")
        if voxel_size is not None:
            voxel_size = tuple(float(v) for v in voxel_size)
            if len(voxel_size) != 3:
                raise ValueError(f"voxel_size {voxel_size} needs 3 values")
        self._rows = 0
        self._written = 0
        self._checksum = _Checksum()
        self._stack = contextlib.ExitStack()
        self._tmp = self._stack.enter_context(atomic_path(self.path))
        self._open = True
        try:
            f = self._f = h5py.File(self._tmp, "w")
            for name, dtype in DATASETS.items():
                if name != "indptr" and self.nnz is None:  # grown block by block
                    f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype,
                                     chunks=(CHUNK_BYTES // dtype.itemsize,))  # fmt: skip
                    continue
                size = m + 1 if name == "indptr" else self.nnz
                f.create_dataset(name, shape=(size,), dtype=dtype, chunks=_chunk(size, dtype.itemsize))
            f.attrs["format"] = FORMAT
            f.attrs["version"] = np.int64(VERSION)
            f.attrs["shape"] = np.array([m, n], dtype=np.int64)
            f.attrs["source"] = str(source)
            f.attrs["checksum_method"] = CHECKSUM_METHOD
            if grid is not None:
                f.attrs["grid"] = np.array(grid, dtype=np.int64)
            if voxel_size is not None:
                f.attrs["voxel_size"] = np.array(voxel_size, dtype=np.float64)
            if scanner_block is not None:
                f.attrs["scanner_block"] = np.void(bytes(scanner_block))
            for k, v in attrs.items():
                f.attrs[k] = v
            zero = np.zeros(1, dtype=np.int64)
            f["indptr"][0:1] = zero
            self._checksum.update("indptr", zero)
        except BaseException:
            self.abort()
            raise

    @property
    def checksum(self) -> str:
        """The checksum of everything written (final once every row is written)."""
        return self._checksum.hexdigest()

    def write_rows(self, block: CSRMatrix, *, validate: bool = True) -> None:
        """Append the next row block.

        Parameters
        ----------
        block
            Rows ``rows_written .. rows_written + k``; ``indptr`` may start anywhere.
        validate
            Validate the block (skip only when it was just validated by a reader).
        """
        bnnz = self._accept(block, validate=validate)
        k = block.shape[0]
        try:
            ends = block.indptr[1:] - block.indptr[0] + self._written
            lo, hi = self._written, self._written + bnnz

            def write() -> None:
                if k:
                    self._dataset("indptr")[self._rows + 1 : self._rows + k + 1] = ends
                if bnnz:
                    for name, arr in (("indices", block.indices), ("data", block.data)):
                        ds = self._dataset(name)
                        if self.nnz is None:
                            ds.resize((hi,))
                        ds[lo:hi] = arr

            self._checksum.update_rows(ends, block.indices, block.data, during=write)
        except BaseException:
            self.abort()
            raise
        self._rows += k
        self._written += bnnz

    def close(self) -> str:
        """Check completeness, store the checksum, rename into place; return the checksum."""
        if not self._open:
            return self.checksum
        self._check_complete()
        digest = self.checksum
        self._open = False
        try:
            self._f.attrs["nnz"] = np.int64(self.nnz)
            self._f.attrs["checksum"] = digest
            self._close_h5()
        except BaseException as exc:
            with contextlib.suppress(Exception):
                self._close_h5()  # where the error came before the close
            self._stack.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._stack.close()
        log.debug("wrote %s (%d x %d, nnz %d, checksum %s)", self.path, *self.shape, self.nnz, digest)
        return digest

    def abort(self) -> None:
        """Discard the partial file (the target is left untouched)."""
        if not self._open:
            return
        self._open = False
        with contextlib.suppress(Exception):
            self._close_h5()
        self._stack.__exit__(RuntimeError, RuntimeError("aborted"), None)


def write_matrix_h5(path: str | os.PathLike, matrix: CSRMatrix, *, max_nnz: int = DEFAULT_CHUNK_NNZ, **attrs) -> str:
    """Write an in-memory matrix as a container (atomically); return its checksum.

    ``attrs`` are passed to :class:`MatrixH5Writer` (``source``, ``grid``,
    ``voxel_size``, ``scanner_block`` and any extra attributes).
    """
    check_block(matrix, path)
    with MatrixH5Writer(path, matrix.shape, matrix.nnz, **attrs) as w:
        for block in split_rows(matrix, max_nnz):
            w.write_rows(block, validate=False)
    return w.checksum
