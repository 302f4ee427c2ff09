"""Reader and writer of the ``.csr4`` system-matrix format (PCSR version 4); host memory, NumPy.

The format (see ``docs/formats.md``) is a 28-byte header, a scanner-configuration
block of ``S`` bytes, ``nRows`` uint64 row END offsets (no leading 0) and
``nnz`` interleaved ``(uint32 column, float32 value)`` elements, all
little-endian.

:class:`Csr4File` memory-maps the file and reads any row range without touching
the rest, converting the row ends to an int64 ``indptr`` and the interleaved
elements to separate int32/float32 arrays block by block. :class:`Csr4Writer`
streams row blocks into a temporary file that is renamed into place only when
every row has been written. The scanner block is kept verbatim (a file read and
written again is identical byte for byte) and parsed into
:class:`ScannerGeometry` (grid shape, voxel size).
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlemlib import setup_times
from mlemlib._io import atomic_path
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

MAGIC = b"PCSR"
VERSION = 4
#: magic, version, flags, padding, nRows, nCols, nnz, S
HEADER = struct.Struct("<4sBBHIIQI")
HEADER_SIZE = HEADER.size  # 28
MIN_SCANNER_BLOCK = 60
#: One stored element: uint32 column then float32 value (8 bytes, array of structs).
ELEMENT_DTYPE = np.dtype([("col", "<u4"), ("val", "<f4")])
ROW_END_DTYPE = np.dtype("<u8")
MAX_COLS = np.iinfo(np.int32).max  # columns are held as int32 in memory
#: Elements converted per write call inside Csr4Writer (bounds its scratch memory to 32 MiB).
_WRITE_PIECE = 1 << 22
#: Elements split per step in Csr4File.read_rows (32 MiB of the mapping resident at a time).
_READ_PIECE = 1 << 22


# --------------------------------------------------------------------------- scanner block


class _Cursor:
    """Sequential little-endian reader over the scanner block, with clear errors."""

    def __init__(self, buf: bytes, source: str | os.PathLike) -> None:
        self.buf = buf
        self.pos = 0
        self.source = source

    def take(self, fmt: str, what: str) -> tuple:
        s = struct.Struct("<" + fmt)
        end = self.pos + s.size
        if end > len(self.buf):
            raise MatrixFormatError(
                self.source,
                f"scanner block too short: {what} needs bytes {self.pos}..{end} "
                f"but the block has {len(self.buf)} bytes",
            )
        out = s.unpack_from(self.buf, self.pos)
        self.pos = end
        return out

    def need(self, size: int, what: str) -> None:
        """Fail early, naming the count at fault, if fewer than ``size`` bytes remain."""
        if self.pos + size > len(self.buf):
            raise MatrixFormatError(
                self.source,
                f"scanner block too short: {what} needs {self.pos + size} bytes but the block has {len(self.buf)}",
            )


@dataclass
class ScannerGeometry:
    """The parsed scanner-configuration block of a ``.csr4`` file.

    Attributes
    ----------
    layers
        One ``(width, height, depth, radius, mu)`` record per crystal layer
        (crystal size and ring radius in mm, attenuation coefficient).
    n_blocks, block_size
        Detector blocks per ring and crystals per block.
    block_gaps
        ``block_size - 1`` gaps between crystals inside a block (mm).
    n_rings
        Number of detector rings.
    ring_gaps
        ``n_rings - 1`` gaps between rings (mm).
    voxel_size
        Voxel width, height, depth (mm).
    grid
        Image grid ``(gridX, gridY, gridZ)``; its product is the number of columns.
    """

    layers: list[tuple[float, float, float, float, float]]
    n_blocks: int
    block_size: int
    block_gaps: list[float]
    n_rings: int
    ring_gaps: list[float]
    voxel_size: tuple[float, float, float]
    grid: tuple[int, int, int]
    extra: bytes = field(default=b"", repr=False)

    @property
    def n_voxels(self) -> int:
        """``gridX * gridY * gridZ``."""
        return math.prod(self.grid)

    def to_bytes(self) -> bytes:
        """Encode the block as stored in a ``.csr4`` file.

        Raises
        ------
        ValueError
            If the gap lists do not have ``block_size - 1`` / ``n_rings - 1`` entries.
        """
        if self.block_size < 1 or len(self.block_gaps) != self.block_size - 1:
            raise ValueError(f"block_gaps needs block_size - 1 = {self.block_size - 1} entries")
        if self.n_rings < 1 or len(self.ring_gaps) != self.n_rings - 1:
            raise ValueError(f"ring_gaps needs n_rings - 1 = {self.n_rings - 1} entries")
        parts = [struct.pack("<I", len(self.layers))]
        parts += [struct.pack("<5f", *layer) for layer in self.layers]
        parts.append(struct.pack("<II", self.n_blocks, self.block_size))
        parts.append(struct.pack(f"<{self.block_size - 1}f", *self.block_gaps))
        parts.append(struct.pack("<I", self.n_rings))
        parts.append(struct.pack(f"<{self.n_rings - 1}f", *self.ring_gaps))
        parts.append(struct.pack("<3f", *self.voxel_size))
        parts.append(struct.pack("<3I", *self.grid))
        parts.append(self.extra)
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, b: bytes, source: str | os.PathLike = "<scanner block>") -> ScannerGeometry:
        """Parse a scanner block; raise :class:`MatrixFormatError` naming ``source`` if malformed.

        Trailing bytes after the grid are tolerated (kept in ``extra`` and
        logged as a warning): the block itself is kept verbatim by the reader.
        """
        b = bytes(b)
        if len(b) < MIN_SCANNER_BLOCK:
            raise MatrixFormatError(
                source, f"scanner block too short: {len(b)} bytes, the format needs at least {MIN_SCANNER_BLOCK}"
            )
        c = _Cursor(b, source)
        (n_layers,) = c.take("I", "nLayers")
        # bytes still needed after each count: blocks (8) + rings (4) + voxel (12) + grid (12)
        c.need(20 * n_layers + 36, f"nLayers = {n_layers}")
        layers = [tuple(float(v) for v in c.take("5f", f"layer {i}")) for i in range(n_layers)]
        n_blocks, block_size = c.take("II", "nBlocks, blocksize")
        if block_size < 1:
            raise MatrixFormatError(source, f"scanner block: blocksize is {block_size}, expected >= 1")
        c.need(4 * (block_size - 1) + 28, f"blocksize = {block_size}")
        block_gaps = [float(v) for v in c.take(f"{block_size - 1}f", f"{block_size - 1} crystal gaps")]
        (n_rings,) = c.take("I", "nRings")
        if n_rings < 1:
            raise MatrixFormatError(source, f"scanner block: nRings is {n_rings}, expected >= 1")
        c.need(4 * (n_rings - 1) + 24, f"nRings = {n_rings}")
        ring_gaps = [float(v) for v in c.take(f"{n_rings - 1}f", f"{n_rings - 1} ring gaps")]
        voxel = tuple(float(v) for v in c.take("3f", "voxel size"))
        grid = tuple(int(v) for v in c.take("3I", "grid size"))
        extra = b[c.pos :]
        if extra:
            log.warning("%s: scanner block has %d unparsed trailing bytes (kept verbatim)", source, len(extra))
        return cls(layers, n_blocks, block_size, block_gaps, n_rings, ring_gaps, voxel, grid, extra)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- reader


@dataclass
class Csr4Header:
    """The header of a ``.csr4`` file.

    Attributes
    ----------
    m, n, nnz
        Rows (LORs), columns (voxels), stored elements.
    flags
        Symmetry bits (0: x, 1: y, 2: z); informational.
    scanner_block
        The scanner-configuration block, verbatim.
    geometry
        The parsed scanner block.
    data_offset
        Byte offset of the row-end array (``28 + S``); the elements follow at
        ``data_offset + 8 * m``.
    """

    m: int
    n: int
    nnz: int
    flags: int
    scanner_block: bytes
    geometry: ScannerGeometry | None
    data_offset: int

    @property
    def elements_offset(self) -> int:
        """Byte offset of the first element."""
        return self.data_offset + 8 * self.m

    @property
    def file_size(self) -> int:
        """The exact size the file must have."""
        return self.elements_offset + 8 * self.nnz


def read_header(path: str | os.PathLike) -> Csr4Header:
    """Read and check the header and scanner block of a ``.csr4`` file against its size.

    Raises
    ------
    MatrixFormatError
        Missing file, wrong magic or version, truncated file, a size that
        disagrees with the header, a malformed scanner block, or a grid whose
        product differs from the number of columns.
    """
    source = os.fspath(path)
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
            if len(head) < HEADER_SIZE:
                raise MatrixFormatError(
                    source, f"truncated: {size} bytes, shorter than the {HEADER_SIZE}-byte .csr4 header"
                )
            magic, version, flags, _pad, m, n, nnz, s = HEADER.unpack(head)
            if magic != MAGIC:
                raise MatrixFormatError(source, f"bad magic {magic!r}, expected {MAGIC!r} (not a .csr4 file)")
            if version != VERSION:
                raise MatrixFormatError(source, f"unsupported .csr4 version {version}, expected {VERSION}")
            if s < MIN_SCANNER_BLOCK:
                raise MatrixFormatError(
                    source,
                    f"scanner block too short: header says {s} bytes, the format needs at least {MIN_SCANNER_BLOCK}",
                )
            if size < HEADER_SIZE + s:
                raise MatrixFormatError(
                    source, f"truncated: {size} bytes, the header and {s}-byte scanner block need {HEADER_SIZE + s}"
                )
            block = f.read(s)
    except FileNotFoundError:
        raise MatrixFormatError(source, "no such file") from None
    except IsADirectoryError:
        raise MatrixFormatError(source, "is a directory, expected a .csr4 file") from None
    geometry = ScannerGeometry.from_bytes(block, source)
    if geometry.n_voxels != n:
        raise MatrixFormatError(
            source,
            f"scanner block grid {geometry.grid[0]}x{geometry.grid[1]}x{geometry.grid[2]} = {geometry.n_voxels} "
            f"voxels disagrees with nCols = {n}",
        )
    if n > MAX_COLS:
        raise MatrixFormatError(source, f"nCols = {n} exceeds the int32 column index range")
    header = Csr4Header(m, n, nnz, flags, block, geometry, HEADER_SIZE + s)
    expected = header.file_size
    if size < expected:
        raise MatrixFormatError(
            source,
            f"truncated: file has {size} bytes, header (m={m}, n={n}, nnz={nnz}, S={s}) needs {expected}",
        )
    if size > expected:
        raise MatrixFormatError(
            source,
            f"file size {size} disagrees with header (m={m}, n={n}, nnz={nnz}, S={s}): "
            f"expected {expected} bytes, {size - expected} extra",
        )
    return header


class Csr4File(ElementReader):
    """A memory-mapped ``.csr4`` matrix; header and file size are checked on open.

    Parameters
    ----------
    path
        The ``.csr4`` file.

    Attributes
    ----------
    header : Csr4Header
    shape : tuple[int, int]
    nnz : int
    geometry : ScannerGeometry
    grid, voxel_size
        From the scanner block.

    Raises
    ------
    MatrixFormatError
        See :func:`read_header`; also if the last row end differs from nnz.

    Notes
    -----
    The file is memory-mapped read-only; nothing but the header (and the last
    row end) is read on open. A row-range read touches only the pages of that
    range and returns copies (int32 columns and float32 values split out of
    the interleaved elements). Use as a context manager, or call
    :meth:`close`, to release the mapping.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.source = os.fspath(path)
        self.header = read_header(path)
        h = self.header
        self.shape = (h.m, h.n)
        self.nnz = h.nnz
        self.geometry = h.geometry
        self.grid = h.geometry.grid if h.geometry else None
        self.voxel_size = h.geometry.voxel_size if h.geometry else None
        self._mm: mmap.mmap | None = None
        self._ends = np.zeros(0, dtype=ROW_END_DTYPE)
        self._el = np.zeros(0, dtype=ELEMENT_DTYPE)
        if h.m or h.nnz:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._ends = np.frombuffer(self._mm, dtype=ROW_END_DTYPE, count=h.m, offset=h.data_offset)
            self._el = np.frombuffer(self._mm, dtype=ELEMENT_DTYPE, count=h.nnz, offset=h.elements_offset)
        last = int(self._ends[-1]) if h.m else 0
        if last != h.nnz:
            self.close()
            raise MatrixFormatError(self.source, f"row pointer ends at {last} (last row end), expected nnz = {h.nnz}")

    # -- context management
    def close(self) -> None:
        """Release the memory mapping (blocks already read stay valid: they are copies)."""
        self._ends = np.zeros(0, dtype=ROW_END_DTYPE)
        self._el = np.zeros(0, dtype=ELEMENT_DTYPE)
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a caller still holds a view; GC unmaps later
                self._mm.close()
            self._mm = None

    def release(self, elem_lo: int, elem_hi: int) -> None:
        """Drop the mapped pages of elements ``[elem_lo, elem_hi)`` from this process.

        The data stays in the page cache; this only keeps the resident size of
        a long streaming pass at about one block instead of the whole file.
        :meth:`read_rows` calls it for every range it has copied.
        """
        if self._mm is None or not hasattr(self._mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        lo = self.header.elements_offset + 8 * int(elem_lo)
        hi = self.header.elements_offset + 8 * int(elem_hi)
        lo = -(-lo // page) * page
        hi = hi // page * page
        if hi > lo:
            with contextlib.suppress(OSError):
                self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def __repr__(self) -> str:
        return f"Csr4File({self.source!r}, shape={self.shape}, nnz={self.nnz})"

    # -- reads
    def read_indptr(self) -> np.ndarray:
        """Return the full int64 row pointer (``m + 1`` entries from 0), validated."""
        return check_row_ends(np.asarray(self._ends), 0, self.nnz, self.source)

    def row_pointer(self, start: int, stop: int) -> tuple[np.ndarray, int]:
        """Rows ``[start, stop)``'s row pointer rebased to 0 (checked) and the index of their first element."""
        start, stop = check_range(start, stop, self.shape[0], self.source)
        base = int(self._ends[start - 1]) if start else 0
        return check_row_ends(np.asarray(self._ends[start:stop]), base, self.nnz, self.source, row0=start), base

    def _read_elements(self, base: int, indices: np.ndarray, data: np.ndarray, validate: bool) -> None:
        """Elements ``[base, base + len(indices))`` split into ``indices`` and ``data``, checked where ``validate``."""
        k = len(indices)
        # split the interleaved elements piece by piece, dropping each piece's mapped
        # pages once copied: resident memory stays at the two output arrays
        # the copies fault the mapped pages in: the set-up phase read, 8 bytes per element
        with setup_times.phase("read", nbytes=8 * k):
            for lo in range(0, k, _READ_PIECE):
                hi = min(lo + _READ_PIECE, k)
                el = self._el[base + lo : base + hi]
                np.copyto(indices[lo:hi], el["col"], casting="unsafe")
                np.copyto(data[lo:hi], el["val"])
                self.release(base + lo, base + hi)
        if validate:
            # through a uint32 view, a column >= 2**31 is reported with its stored value
            check_columns(indices.view(np.uint32), self.shape[1], self.source, elem0=base)
            check_values(data, self.source, elem0=base, negative_ok=self.allow_negative)


def read_csr4(path: str | os.PathLike) -> CSRMatrix:
    """Read a whole ``.csr4`` file into memory, validated."""
    with Csr4File(path) as f:
        return f.to_csr()


# --------------------------------------------------------------------------- writer


class Csr4Writer(RowBlockWriter):
    """Streaming, atomic ``.csr4`` writer.

    Row blocks of any size are written in order with :meth:`write_rows`; the
    file is written under a temporary name beside ``path`` and renamed to
    ``path`` by :meth:`close` once exactly ``m`` rows and ``nnz`` elements have
    been written. On an error (or :meth:`abort`) the temporary file is removed.

    Parameters
    ----------
    path
        Target ``.csr4`` file.
    m, n, nnz
        Shape and number of stored elements, as written into the header;
        ``nnz`` None when not known in advance (the header's count is then
        written on :meth:`close`, from the blocks written).
    scanner_block
        The scanner-configuration block (verbatim); its grid product must equal ``n``.
    flags
        Symmetry flags byte.

    Raises
    ------
    MatrixFormatError
        If the scanner block is malformed or disagrees with ``n``, or a block
        does not fit the header.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        m: int,
        n: int,
        nnz: int | None,
        *,
        scanner_block: bytes,
        flags: int = 0,
    ) -> None:
        self.path = Path(path)
        self.m, self.n = int(m), int(n)
        self.nnz = None if nnz is None else int(nnz)  # None: learnt from the blocks, the header patched on close
        self.shape = (self.m, self.n)
        if not 0 <= self.m < 2**32:
            raise ValueError(f"m = {m} does not fit the uint32 nRows field")
        if not 0 <= self.n <= MAX_COLS:
            raise ValueError(f"n = {n} outside [0, {MAX_COLS}]")
        if self.nnz is not None and not 0 <= self.nnz < 2**63:
            raise ValueError(f"nnz = {nnz} out of range")
        if not 0 <= flags < 256:
            raise ValueError(f"flags = {flags} does not fit one byte")
        block = bytes(scanner_block)
        geometry = ScannerGeometry.from_bytes(block, self.path)
        if geometry.n_voxels != self.n:
            raise MatrixFormatError(
                self.path,
                f"scanner block grid {geometry.grid} = {geometry.n_voxels} voxels disagrees with n = {self.n}",
            )
        self._rows = 0
        self._written = 0
        self._ends_offset = HEADER_SIZE + len(block)
        self._el_offset = self._ends_offset + 8 * self.m
        self._stack = contextlib.ExitStack()
        self._tmp = self._stack.enter_context(atomic_path(self.path))
        self._f = open(self._tmp, "wb")  # noqa: SIM115 - closed by close()/abort()
        self._open = True
        self._flags = flags
        self._block_len = len(block)
        try:
            self._f.write(self._header())
            self._f.write(block)
            if self.nnz is not None:
                self._f.truncate(self._el_offset + 8 * self.nnz)
        except BaseException:
            self.abort()
            raise

    def _header(self) -> bytes:
        nnz = 0 if self.nnz is None else self.nnz  # rewritten on close when the count was not known
        return HEADER.pack(MAGIC, VERSION, self._flags, 0, self.m, self.n, nnz, self._block_len)

    def write_rows(self, block: CSRMatrix) -> None:
        """Append the next row block (validated: columns in range, values finite and >= 0)."""
        bnnz = self._accept(block)
        k = block.shape[0]
        f = self._f
        try:
            ends = (block.indptr[1:] - block.indptr[0] + self._written).astype(ROW_END_DTYPE)
            f.seek(self._ends_offset + 8 * self._rows)
            f.write(ends.tobytes())
            f.seek(self._el_offset + 8 * self._written)
            piece = np.empty(min(bnnz, _WRITE_PIECE), dtype=ELEMENT_DTYPE)
            for lo in range(0, bnnz, _WRITE_PIECE):
                hi = min(lo + _WRITE_PIECE, bnnz)
                p = piece[: hi - lo]
                p["col"] = block.indices[lo:hi]
                p["val"] = block.data[lo:hi]
                f.write(p.tobytes())
        except BaseException:
            self.abort()
            raise
        self._rows += k
        self._written += bnnz

    def close(self) -> None:
        """Finish: check that every row and element was written, then rename into place."""
        if not self._open:
            return
        unknown = self.nnz is None
        self._check_complete()
        self._open = False
        try:
            if unknown:
                self._f.seek(0)
                self._f.write(self._header())
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        except BaseException as exc:
            self._stack.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._stack.close()  # renames the temporary file to self.path
        log.debug("wrote %s (%d x %d, nnz %d)", self.path, self.m, self.n, self.nnz)

    def abort(self) -> None:
        """Discard the partial file (the target is left untouched)."""
        if not self._open:
            return
        self._open = False
        with contextlib.suppress(OSError):
            self._f.close()
        err = RuntimeError("aborted")
        self._stack.__exit__(RuntimeError, err, None)


def write_csr4(
    path: str | os.PathLike,
    matrix: CSRMatrix,
    *,
    scanner_block: bytes,
    flags: int = 0,
    max_nnz: int = DEFAULT_CHUNK_NNZ,
) -> None:
    """Write an in-memory matrix as ``.csr4`` (atomically, in row blocks of at most ``max_nnz``)."""
    m, n = matrix.shape
    check_block(matrix, path)
    with Csr4Writer(path, m, n, matrix.nnz, scanner_block=scanner_block, flags=flags) as w:
        for block in split_rows(matrix, max_nnz):
            w.write_rows(block)
