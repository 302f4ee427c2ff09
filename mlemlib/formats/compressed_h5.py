"""The compressed matrix in the project's HDF5 container (h5py; host memory, NumPy).

Layout version 2 (see ``docs/formats.md``, "The compressed matrix" and
:mod:`mlemlib.compressed`), for ``m`` rows, ``nnz`` elements and ``S`` slots
(elements, markers and pads; every row starts at a multiple of 4 slots)::

    /rowbase  int64[m // 64 + 1]   slot offset of rows 0, 64, 128, ...
    /rowoff   uint32[m + 1]        slot offset of row r minus rowbase[r >> 6]
    /codes    uint8[S] | uint16[S] column delta (0..2**B-3) or marker (2**B-2, 2**B-1), B = code_bits
    /values   float32[S]           values and marker deltas (float16[S] in compressed-f16,
                                   uint16[S] in compressed-u16)
    /scale    float32[m]           16-bit values only: row scales (powers of two in compressed-f16)
    attrs: format="mlem-compressed" | "mlem-compressed-f16" | "mlem-compressed-u16", version=2,
           code_bits=8 | 16, shape=(m, n), nnz, slots, checksum,
           checksum_method, encoding, source, optional grid, voxel_size,
           scanner_block, extras (kind, ...).

Version 1 files (8-bit codes, rows not aligned) are refused: re-run ``mlem
convert``.

The ``checksum`` is the CSR container's checksum of the *decoded* matrix
(:func:`mlemlib.formats.h5.checksum_arrays` of its int64 row pointer, int32
columns and float32 values), so a lossless container has the same checksum as
the CSR container of the same matrix.

:class:`CompressedH5` is a :class:`~mlemlib.formats.h5.MatrixH5` (opening a
compressed file with ``MatrixH5(path)`` or :func:`mlemlib.formats.open_matrix`
returns one): ``read_rows`` and ``iter_chunks`` decode into CSR, so every
stage that streams a matrix streams this one; :meth:`CompressedH5.read_encoded`
returns the raw encoded arrays of a row range (for a GPU upload).
:class:`CompressedH5Writer` encodes CSR row blocks as they stream in.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlemlib import setup_times
from mlemlib._io import atomic_path, prefetched
from mlemlib.compressed import (
    CODE_DTYPES,
    LAYOUT_VERSION,
    MAX_BLOCK_SLOTS,
    ROW_BLOCK,
    ROW_SHIFT,
    SLOT_ALIGN,
    VALUE_DTYPES,
    CompressedMatrix,
    check_alignment,
    check_row_scales,
    check_slots,
    choose_code_bits,
    code_high,
    _value_bits,
    decode_slots,
    encode_bits,
    encoded_nbytes,
    pick_code_bits,
    rowbase_length,
    unpack_rowptr,
    values16,
)
from mlemlib.errors import MatrixFormatError
from mlemlib.formats._check import (
    DEFAULT_CHUNK_NNZ,
    RowBlockReader,
    RowBlockWriter,
    check_range,
    check_row_ends,
    chunk_bounds,
)
from mlemlib.formats.h5 import (
    CHECKSUM_METHOD,
    CHUNK_BYTES,
    RESERVED_ATTRS,
    SUBCLASSES,
    MatrixH5,
    _Checksum,
    _chunk,
    _plain,
    checksum_for,
)
from mlemlib.matrix import CSRMatrix, row_elements

log = logging.getLogger(__name__)

#: ``format`` attribute -> matrix format name (``mlem convert --format``).
FORMATS = {f"mlem-{name}": name for name in VALUE_DTYPES}
#: matrix format name -> ``format`` attribute.
FORMAT_ATTRS = {v: k for k, v in FORMATS.items()}
VERSION = LAYOUT_VERSION
#: Attributes the writer sets itself.
RESERVED = RESERVED_ATTRS | {"slots", "encoding", "code_bits"}
#: A short statement of the encoding, stored as attribute ``encoding``.
ENCODING = (
    "row r = slots [rowbase[r>>6]+rowoff[r], rowbase[(r+1)>>6]+rowoff[r+1]), each a multiple of 4; per slot, "
    "with B = code_bits: code 0..2**B-3 = column delta (element), 2**B-1 = marker adding the slot's value bits "
    "(value bits 0: a pad), 2**B-2 = marker adding bits<<16 (16-bit values only); column starts at 0 per row"
)
#: Slots read per piece by the whole-file passes.
PIECE_SLOTS = 1 << 24
#: Elements :func:`sample_code_bits` encodes to choose the code width of a streamed conversion.
SAMPLE_NNZ = 1 << 22
#: Row ranges, spread evenly over the matrix, that :func:`sample_code_bits` reads.
SAMPLE_PIECES = 16


def _datasets(fmt: str, code_bits: int) -> dict[str, np.dtype]:
    d = {
        "rowbase": np.dtype("<i8"),
        "rowoff": np.dtype("<u4"),
        "codes": CODE_DTYPES[code_bits].newbyteorder("<"),
        "values": VALUE_DTYPES[fmt].newbyteorder("<"),
    }
    if values16(fmt):
        d["scale"] = np.dtype("<f4")
    return d


class CompressedH5(MatrixH5):
    """Reader of a compressed container; same interface as :class:`MatrixH5`, plus the encoded arrays.

    ``read_rows``, ``iter_chunks`` and ``to_csr`` decode into CSR;
    ``read_indptr`` is the CSR row pointer (counting a range's elements
    reads its codes: one byte per slot). :meth:`read_encoded` and
    :meth:`read_slotptr` give the encoding itself.

    Attributes
    ----------
    format : str
        ``compressed``, ``compressed-f16`` or ``compressed-u16``.
    lossless : bool
    slots : int
        Stored slots (elements, markers and pads).
    code_bits : int
        8 or 16: the width of a code.
    nbytes : int
        Bytes of the encoded arrays.
    bytes_per_nnz : float

    Raises
    ------
    MatrixFormatError
        On open: a bad ``format``/``version`` (version 1: re-run ``mlem
        convert``), missing or malformed attributes (``code_bits`` not 8 or
        16, ``slots`` not a multiple of 4), missing datasets or wrong dtypes
        (``codes`` not uint8/uint16 as ``code_bits`` says), sizes that
        disagree with ``shape``/``nnz``/``slots``, a slot pointer that does
        not start at 0 or end at ``slots``, a bad grid. On read: a slot
        pointer that decreases, leaves ``[0, slots]`` or is not a multiple of
        4, column deltas that decode outside ``[0, n)``, a high marker in a
        float32 matrix,
        non-finite or negative values, row scales that are not finite and
        positive; on a whole pass: an element count other than ``nnz``, a
        checksum mismatch.
    """

    def _open(self) -> None:
        f = self._f
        self.attrs = {k: _plain(v) for k, v in f.attrs.items()}
        a = self.attrs
        fmt_attr = a.get("format")
        if fmt_attr not in FORMATS:
            raise self._fault(f"attribute format is {fmt_attr!r}, expected one of {', '.join(map(repr, FORMATS))}")
        self.format = FORMATS[fmt_attr]
        self.lossless = self.format == "compressed"
        if "version" not in a:
            raise self._fault("missing attribute 'version'")
        if a["version"] == 1:
            raise self._fault(
                "compressed container version 1 (8-bit codes, rows not aligned to 4 slots) is no longer read; "
                f"re-run `mlem convert --format {self.format}` on the source matrix to write version {VERSION}"
            )
        if a["version"] != VERSION:
            raise self._fault(f"unsupported container version {a['version']!r}, expected {VERSION}")
        for key in ("code_bits", "shape", "nnz", "slots", "checksum"):
            if key not in a:
                raise self._fault(f"missing attribute {key!r}")
        cb = a["code_bits"]
        if not isinstance(cb, int) or isinstance(cb, bool) or cb not in CODE_DTYPES:
            raise self._fault(f"attribute code_bits is {a['code_bits']!r}, expected 8 or 16")
        self.code_bits = int(a["code_bits"])
        self.code_high = code_high(self.code_bits)
        shape = a["shape"]
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(v, int) and v >= 0 for v in shape)):
            raise self._fault(f"attribute shape is {shape!r}, expected two non-negative integers")
        for key in ("nnz", "slots"):
            if not isinstance(a[key], int) or a[key] < 0:
                raise self._fault(f"attribute {key} is {a[key]!r}, expected a non-negative integer")
        self.shape = (int(shape[0]), int(shape[1]))
        self.nnz = int(a["nnz"])
        self.slots = int(a["slots"])
        m, n = self.shape
        if n > np.iinfo(np.int32).max:
            raise self._fault(f"{n} columns exceed the int32 column index range")
        if self.nnz > self.slots:
            raise self._fault(f"attribute nnz = {self.nnz} exceeds slots = {self.slots}")
        if self.slots % SLOT_ALIGN:
            raise self._fault(f"attribute slots = {self.slots} is not a multiple of {SLOT_ALIGN}")
        expected = {"rowbase": rowbase_length(m), "rowoff": m + 1, "codes": self.slots, "values": self.slots, "scale": m}
        what = {"rowbase": "shape[0] // 64 + 1", "rowoff": "shape[0] + 1", "codes": "slots", "values": "slots",
                "scale": "shape[0]"}
        self._ds = {}
        for name, dtype in _datasets(self.format, self.code_bits).items():
            if name not in f:
                raise self._fault(f"missing dataset /{name}")
            ds = f[name]
            if not hasattr(ds, "dtype"):
                raise self._fault(f"/{name} is a group, expected a dataset")
            if ds.dtype != dtype or ds.ndim != 1:
                extra = f" (attribute code_bits = {self.code_bits})" if name == "codes" else ""
                raise self._fault(
                    f"dataset /{name} is {ds.dtype}{list(ds.shape)}, expected 1-D {dtype.name}{extra}"
                )
            if ds.shape[0] != expected[name]:
                raise self._fault(
                    f"dataset /{name} has {ds.shape[0]} entries, but attribute {what[name]} = {expected[name]}"
                )
            self._ds[name] = ds
        first = int(self._ds["rowbase"][0]) + int(self._ds["rowoff"][0])
        last = int(self._ds["rowbase"][m >> ROW_SHIFT]) + int(self._ds["rowoff"][m])
        if first != 0:
            raise self._fault(f"slot pointer starts at {first}, expected 0")
        if last != self.slots:
            raise self._fault(f"slot pointer ends at {last}, expected slots = {self.slots}")
        self._geometry(n)
        self.checksum = str(a["checksum"])
        self.checksum_method = self._checksum_method()
        self._indptr: np.ndarray | None = None
        self.nbytes = int(sum(ds.shape[0] * ds.dtype.itemsize for ds in self._ds.values()))
        self.bytes_per_nnz = self.nbytes / self.nnz if self.nnz else math.inf

    def __repr__(self) -> str:
        return (
            f"CompressedH5({self.source!r}, {self.format}, shape={self.shape}, nnz={self.nnz}, slots={self.slots}, "
            f"code_bits={self.code_bits})"
        )

    # -- row pointers
    def _slotptr(self, start: int, stop: int) -> np.ndarray:
        """Absolute slot offsets of rows ``start .. stop`` (``stop - start + 1`` values), unchecked."""
        rb = self._read("rowbase", start >> ROW_SHIFT, (stop >> ROW_SHIFT) + 1)
        ro = self._read("rowoff", start, stop + 1)
        return unpack_rowptr(rb, ro, start)

    def read_slotptr(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The slot pointer of rows ``[start, stop)`` (``stop - start + 1`` absolute int64 offsets), validated.

        Checked: within ``[0, slots]``, non-decreasing, every offset a multiple of 4.
        """
        stop = self.shape[0] if stop is None else stop
        start, stop = check_range(start, stop, self.shape[0], self.source)
        sp = self._slotptr(start, stop)
        check_row_ends(sp[1:], int(sp[0]), self.slots, self.source, row0=start, what="slot pointer")
        check_alignment(sp, self.source, row0=start, slot0=int(sp[0]) if len(sp) else 0)
        return sp

    def read_indptr(self) -> np.ndarray:
        """The CSR row pointer (elements, ``m + 1`` entries); reads every code once, then cached."""
        if self._indptr is None:
            from mlemlib._compressed_kernels import _real_counts

            sp = self.read_slotptr()
            m = self.shape[0]
            counts = np.empty(m, dtype=np.int64)
            pieces = chunk_bounds(sp, PIECE_SLOTS)
            codes = self.read_ahead("codes", [(int(sp[r0]), int(sp[r1])) for r0, r1 in pieces])
            for (r0, r1), piece in zip(pieces, codes):
                _real_counts(sp[r0 : r1 + 1], piece, self.code_high, counts[r0:r1])  # parallel
            indptr = np.zeros(m + 1, dtype=np.int64)
            np.cumsum(counts, out=indptr[1:])
            if int(indptr[-1]) != self.nnz:
                raise self._fault(f"the codes hold {int(indptr[-1])} elements, attribute nnz = {self.nnz}")
            self._indptr = indptr
        return self._indptr

    def chunk_bounds(self, max_nnz: int = DEFAULT_CHUNK_NNZ) -> list[tuple[int, int]]:
        """Row blocks of at most ``max_nnz`` slots (so at most ``max_nnz`` elements); a longer row is a block of its own."""
        return chunk_bounds(self.read_slotptr(), max_nnz)

    # -- reads
    def read_encoded(self, start: int, stop: int, *, validate: bool = True) -> CompressedMatrix:
        """Rows ``[start, stop)`` as encoded (for a GPU upload); only that range is read.

        Parameters
        ----------
        start, stop
            Row range, ``0 <= start <= stop <= m``.
        validate
            Decode the range once to check its columns and values (the slot
            pointer is always checked).

        Returns
        -------
        CompressedMatrix
            Shape ``(stop - start, n)``, its row pointer rebased to slot 0.
        """
        start, stop = check_range(start, stop, self.shape[0], self.source)
        sp, lo, codes, values, scale = self._read_slots(start, stop)
        if validate:
            nnz = check_slots(sp, codes, values, scale, self.shape[1], source=self.source, row0=start, slot0=lo)
        else:
            nnz = int(np.count_nonzero(codes < self.code_high))
        return CompressedMatrix.from_arrays(
            sp - lo, codes, values, scale, (stop - start, self.shape[1]), nnz, self.code_bits
        )

    def read_encoded_into(self, start: int, stop: int, codes: np.ndarray, values: np.ndarray, *,
                          check: bool = True) -> CompressedMatrix:
        """Rows ``[start, stop)`` as :meth:`read_encoded` reads and checks them, their codes and values read
        into the first slots of the caller's ``codes`` and ``values`` (a GPU upload's pinned buffers, reused
        piece after piece: no new pages to fault in); the result's arrays are views of them.

        ``check=False`` checks the slot pointer and the row scales only and leaves the columns and values to
        the caller (a GPU upload checks them on the device, ``ccheck``); the result's ``nnz`` is then 0.
        """
        start, stop = check_range(start, stop, self.shape[0], self.source)

        def given(slots: int) -> tuple[np.ndarray, np.ndarray]:
            if slots > min(len(codes), len(values)):
                raise ValueError(f"rows {start}..{stop} hold {slots} slots, the buffers {min(len(codes), len(values))}")
            return codes[:slots], values[:slots]

        sp, lo, c, v, scale = self._read_slots(start, stop, given)
        if check:
            nnz = check_slots(sp, c, v, scale, self.shape[1], source=self.source, row0=start, slot0=lo)
        else:
            check_row_scales(sp, v, scale, self.source, row0=start)
            nnz = 0
        return CompressedMatrix.from_arrays(sp - lo, c, v, scale, (stop - start, self.shape[1]), nnz, self.code_bits)

    def _read_slots(
        self, start: int, stop: int, buffers: Callable[[int], tuple[np.ndarray, np.ndarray]] | None = None
    ) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray | None]:
        """The slot pointer of rows ``[start, stop)`` (a checked range), its first slot, the codes and values
        of its slots and the rows' scales (None for float32 values): what every row reader decodes.

        ``buffers(slots)`` gives the codes and values arrays of ``slots`` slots to read into (the caller's,
        or reused scratch); None: new arrays.
        """
        sp = self.read_slotptr(start, stop)
        lo, hi = int(sp[0]), int(sp[-1])
        codes, values = (buffers or self._new_slots)(hi - lo)
        if hi > lo:
            with setup_times.phase("read", nbytes=codes.nbytes + values.nbytes):
                self._read_into("codes", lo, hi, codes)
                self._read_into("values", lo, hi, values)
        scale = self._read("scale", start, stop) if not self.lossless else None
        return sp, lo, codes, values, scale

    def read_scale(self, start: int, stop: int) -> np.ndarray | None:
        """The row scales of rows ``[start, stop)`` (float32; 16-bit values only), None for float32 values."""
        start, stop = check_range(start, stop, self.shape[0], self.source)
        return self._read("scale", start, stop) if not self.lossless else None

    #: a range's row pointer comes from the decoded one (there is no /indptr)
    row_pointer = RowBlockReader.row_pointer

    def read_rows_into(self, start: int, stop: int, indices: np.ndarray, data: np.ndarray, *,
                       validate: bool = True) -> np.ndarray:
        """Rows ``[start, stop)`` decoded straight into the front of ``indices`` (int32) and ``data`` (float32);
        the range's row pointer from 0 (:meth:`RowBlockReader.read_rows_into`; checked as :meth:`read_rows`).

        The encoded slots pass through this thread's scratch arrays, kept for its next call (a pass over the
        matrix with reused buffers, ``iter_chunks(reuse=True)``, faults in no new pages); other dtypes are
        decoded into a new block and copied.
        """
        if indices.dtype != np.int32 or data.dtype != np.float32:
            return RowBlockReader.read_rows_into(self, start, stop, indices, data, validate=validate)
        start, stop = check_range(start, stop, self.shape[0], self.source)
        sp, lo, codes, values, scale = self._read_slots(start, stop, self._scratch)
        block = decode_slots(sp, codes, values, scale, self.shape[1], source=self.source, row0=start, slot0=lo,
                             check_values=validate, out=(indices, data))
        return np.asarray(block.indptr, dtype=np.int64)

    def _new_slots(self, slots: int) -> tuple[np.ndarray, np.ndarray]:
        """New codes and values arrays of ``slots`` slots (the datasets' dtypes, in this machine's byte order)."""
        return (np.empty(slots, dtype=self._ds["codes"].dtype.newbyteorder("=")),
                np.empty(slots, dtype=self._ds["values"].dtype.newbyteorder("=")))

    def _scratch(self, slots: int) -> tuple[np.ndarray, np.ndarray]:
        """This thread's codes and values arrays for ``slots`` slots (grown, never shrunk)."""
        local = self.__dict__.setdefault("_scratch_local", threading.local())
        have = getattr(local, "arrays", None)
        if have is None or len(have[0]) < slots:
            have = local.arrays = self._new_slots(slots)
        return have[0][:slots], have[1][:slots]

    def read_rows(self, start: int, stop: int, *, validate: bool = True) -> CSRMatrix:
        """Rows ``[start, stop)`` decoded into CSR (``indptr`` from 0).

        The column range is always checked (the decoder must stay inside the
        image); ``validate`` also checks the values.
        """
        start, stop = check_range(start, stop, self.shape[0], self.source)
        sp, lo, codes, values, scale = self._read_slots(start, stop)
        return decode_slots(
            sp, codes, values, scale, self.shape[1], source=self.source, row0=start, slot0=lo, check_values=validate
        )

    def read_element_bits(self, start: int, stop: int, *, validate: bool = True) -> ElementRows:
        """Rows ``[start, stop)`` decoded, with each element's stored value bits and the rows' scales.

        The form in which a stage moves rows or renames columns without
        rounding a value again (:meth:`CompressedH5Writer.write_element_bits`
        encodes it back). Checked as :meth:`read_rows` checks.
        """
        start, stop = check_range(start, stop, self.shape[0], self.source)
        sp, lo, codes, values, scale = self._read_slots(start, stop)
        block = decode_slots(
            sp, codes, values, scale, self.shape[1], source=self.source, row0=start, slot0=lo, check_values=validate
        )
        bits = np.ascontiguousarray(_value_bits(values)[codes < self.code_high])
        return ElementRows(block, bits, scale)

    def iter_element_bits(self, max_nnz: int = DEFAULT_CHUNK_NNZ) -> Iterator[tuple[int, int, ElementRows]]:
        """``(r0, r1, rows)`` for consecutive row blocks of at most ``max_nnz`` slots, in file order
        (:meth:`read_element_bits`; block k + 1 is read while the caller works on block k)."""
        bounds = self.chunk_bounds(max_nnz) if self.shape[0] else []
        for (r0, r1), rows in zip(bounds, prefetched(lambda r: self.read_element_bits(*r), bounds)):
            yield r0, r1, rows

    def compute_checksum(self) -> str:
        """The checksum of the decoded matrix, decoding it piece by piece; also checks the element count.

        Piece k + 1 is read and decoded while piece k is hashed.
        """
        c = checksum_for(self.checksum_method)
        c.update("indptr", np.zeros(1, dtype=np.int64))
        done = 0
        bounds = chunk_bounds(self.read_slotptr(), PIECE_SLOTS)
        for block in prefetched(lambda r: self.read_rows(*r, validate=False), bounds):
            c.update_rows(block.indptr[1:] + done, block.indices, block.data)
            done += block.nnz
        if done != self.nnz:
            raise self._fault(f"the codes hold {done} elements, attribute nnz = {self.nnz}")
        return c.hexdigest()


@dataclass
class ElementRows:
    """Row block of a compressed matrix as decoded CSR plus what the encoding stores per element and row.

    ``csr`` is the decoded block (the values a kernel computes with),
    ``bits`` the elements' value slots (uint32 or uint16, element order) and
    ``scale`` the rows' float32 scales (16-bit formats; else None). Moving
    rows moves their slices of all three; renaming columns changes only
    ``csr.indices``; no value is rounded again.
    """

    csr: CSRMatrix
    bits: np.ndarray
    scale: np.ndarray | None


SUBCLASSES.update(dict.fromkeys(FORMATS, CompressedH5))  # MatrixH5(path) opens a compressed file as CompressedH5


# --------------------------------------------------------------------------- writer
class CompressedH5Writer(RowBlockWriter):
    """Streaming, atomic writer of a compressed container; encodes CSR row blocks as they come.

    Takes the same arguments as :class:`~mlemlib.formats.h5.MatrixH5Writer`
    plus ``fmt`` and ``code_bits``; :meth:`write_rows` takes CSR blocks
    (columns sorted within rows), :meth:`write_encoded` already encoded ones.
    Each block is encoded on its own (rows are independent), so peak memory is
    about one block. The checksum is that of the decoded matrix (equal to the
    CSR container's for ``compressed``).

    One file has one code width. With ``code_bits=None`` the first block that
    holds an element decides (the smaller encoding of that block, see
    :func:`mlemlib.compressed.choose_code_bits`) and every later block is
    encoded with it; a caller that knows the whole matrix better (``mlem
    convert`` samples rows spread over it, :func:`sample_code_bits`) passes
    ``code_bits``. A matrix without elements gets 8.

    Parameters
    ----------
    path, shape, nnz, source, grid, voxel_size, scanner_block, **attrs
        As for :class:`~mlemlib.formats.h5.MatrixH5Writer`.
    fmt
        ``compressed`` (lossless), ``compressed-f16`` or ``compressed-u16`` (lossy).
    code_bits
        8 or 16, or None (decided by the first block with an element).

    Raises
    ------
    ValueError
        A reserved attribute name, an unknown ``fmt``, an inconsistent grid.
    MatrixFormatError
        A block that does not fit, fails validation or has unsorted rows.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        shape: tuple[int, int],
        nnz: int | None,
        *,
        fmt: str = "compressed",
        code_bits: int | None = None,
        source: str = "",
        grid: tuple[int, int, int] | None = None,
        voxel_size: tuple[float, float, float] | None = None,
        scanner_block: bytes | None = None,
        **attrs,
    ) -> None:
        import h5py

        if fmt not in FORMAT_ATTRS:
            raise ValueError(f"unknown compressed format {fmt!r}, expected one of {', '.join(FORMAT_ATTRS)}")
        if code_bits is not None and code_bits not in CODE_DTYPES:
            raise ValueError(f"code_bits must be 8 or 16, not {code_bits!r}")
        self.fmt = fmt
        self.code_bits: int | None = None
        self.path = Path(path)
        m, n = int(shape[0]), int(shape[1])
        self.shape = (m, n)
        self.nnz = None if nnz is None else int(nnz)  # None: learnt from the blocks (set on close)
        if m < 0 or n < 0 or (self.nnz is not None and self.nnz < 0):
            raise ValueError(f"bad shape {shape} or nnz {nnz}")
        if n > np.iinfo(np.int32).max:
            raise ValueError(f"n = {n} exceeds the int32 column index range")
        bad = RESERVED.intersection(attrs)
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
        self._slots = 0
        self._rowbase = np.zeros(rowbase_length(m), dtype=np.int64)
        self._checksum = _Checksum()
        self._stack = contextlib.ExitStack()
        self._tmp = self._stack.enter_context(atomic_path(self.path))
        self._open = True
        try:
            f = self._f = h5py.File(self._tmp, "w")
            dts = _datasets(fmt, 8)
            for name in ("rowbase", "rowoff", "scale"):
                if name in dts:
                    size = {"rowbase": rowbase_length(m), "rowoff": m + 1, "scale": m}[name]
                    f.create_dataset(name, shape=(size,), dtype=dts[name], chunks=_chunk(size, dts[name].itemsize))
            self._slot_dataset("values", dts["values"])
            if code_bits is not None:
                self._set_code_bits(int(code_bits))
            f.attrs["format"] = FORMAT_ATTRS[fmt]
            f.attrs["version"] = np.int64(VERSION)
            f.attrs["shape"] = np.array([m, n], dtype=np.int64)
            f.attrs["source"] = str(source)
            f.attrs["checksum_method"] = CHECKSUM_METHOD + ", of the decoded CSR arrays"
            f.attrs["encoding"] = ENCODING
            if grid is not None:
                f.attrs["grid"] = np.array(grid, dtype=np.int64)
            if voxel_size is not None:
                f.attrs["voxel_size"] = np.array(voxel_size, dtype=np.float64)
            if scanner_block is not None:
                f.attrs["scanner_block"] = np.void(bytes(scanner_block))
            for k, v in attrs.items():
                f.attrs[k] = v
            f["rowoff"][0:1] = np.zeros(1, dtype=np.uint32)
            self._checksum.update("indptr", np.zeros(1, dtype=np.int64))
        except BaseException:
            self.abort()
            raise

    def _slot_dataset(self, name: str, dtype: np.dtype) -> None:
        per_chunk = CHUNK_BYTES // dtype.itemsize
        self._f.create_dataset(
            name, shape=(0,), maxshape=(None,), dtype=dtype,
            chunks=(per_chunk if self.nnz is None else max(1, min(per_chunk, self.nnz)),),
        )

    def _set_code_bits(self, code_bits: int) -> None:
        """Fix the file's code width: create ``/codes`` and the ``code_bits`` attribute."""
        self.code_bits = code_bits
        self._slot_dataset("codes", CODE_DTYPES[code_bits].newbyteorder("<"))
        self._f.attrs["code_bits"] = np.int64(code_bits)

    def set_code_bits(self, code_bits: int) -> None:
        """Fix the file's code width before the first block with an element (a caller that chose it from
        more rows than the first block holds); ValueError once a width is fixed."""
        if code_bits not in CODE_DTYPES:
            raise ValueError(f"code_bits must be 8 or 16, not {code_bits!r}")
        if self.code_bits is not None:
            raise ValueError(f"{self.path}: the code width is fixed already ({self.code_bits} bits)")
        self._set_code_bits(int(code_bits))

    @property
    def checksum(self) -> str:
        """The checksum of the decoded matrix written so far (final once every row is written)."""
        return self._checksum.hexdigest()

    @property
    def slots(self) -> int:
        """Slots written so far."""
        return self._slots

    def write_rows(self, block: CSRMatrix, *, validate: bool = True, source: str | os.PathLike | None = None) -> None:
        """Encode and append the next CSR row block (``indptr`` may start anywhere).

        ``source`` is the file named if the block's columns are not sorted
        (default: the output file).
        """
        bnnz = self._accept(block, validate=validate)
        enc = self.encode_rows(block, source=source, row0=self._rows)
        self._append(enc, self.decoded(enc, block), bnnz)

    def encode_rows(
        self, block: CSRMatrix, *, source: str | os.PathLike | None = None, row0: int | None = None
    ) -> CompressedMatrix:
        """Encode a row block in the file's format and code width (the first block with slots sets the width).

        With :meth:`append_encoded_rows`, the two halves of :meth:`write_rows`
        for a writer that encodes block k + 1 while block k is written (the
        generator): blocks must be encoded in order, one at a time. ``row0``:
        the block's first row, for messages.
        """
        try:
            enc = CompressedMatrix.from_csr(
                block, self.fmt, code_bits=self.code_bits, validate=False,
                source=self.path if source is None else source, row0=self._rows if row0 is None else row0,
            )
            if self.code_bits is None and enc.slots:
                self._set_code_bits(enc.code_bits)
        except BaseException:
            self.abort()
            raise
        return enc

    def append_encoded_rows(self, enc: CompressedMatrix, block: CSRMatrix, decoded: CSRMatrix | None = None) -> None:
        """Append the next row block, ``enc`` being :meth:`encode_rows` of ``block`` (not validated again);
        ``decoded``: :meth:`decoded` of the two, if the caller made it (the generator, on its own threads)."""
        bnnz = self._accept(block, validate=False)
        self._append(enc, self.decoded(enc, block) if decoded is None else decoded, bnnz)

    def decoded(self, enc: CompressedMatrix, block: CSRMatrix) -> CSRMatrix:
        """The matrix the file will hold for these rows (its checksum's input): ``block`` itself when
        lossless, else its columns with the decoded 16-bit values (:meth:`CompressedMatrix.decoded_values`)."""
        if self.fmt == "compressed":
            return block  # lossless: the decoded block is the block itself
        return CSRMatrix(block.indptr, block.indices, enc.decoded_values(block.indptr), block.shape)

    def write_element_bits(
        self, indptr: np.ndarray, indices: np.ndarray, bits: np.ndarray, scale: np.ndarray | None
    ) -> None:
        """Encode and append the next row block given as columns, element value bits and row scales.

        The values are stored as given (:func:`mlemlib.compressed.encode_bits`:
        nothing is rounded again), with the file's code width (the first block
        with an element decides where none was given). The rows come from a
        validated reader (:meth:`CompressedH5.read_element_bits`) of a file of
        this format: they are not validated again, only their columns' order.
        """
        k = len(indptr) - 1
        ip = np.ascontiguousarray(indptr, dtype=np.int64)
        ip = ip - ip[0] if len(ip) and ip[0] else ip
        try:
            enc = encode_bits(ip, indices, bits, scale, self.shape[1], self.fmt, code_bits=self.code_bits,
                              source=self.path, row0=self._rows)
            if self.code_bits is None and enc.slots:
                self._set_code_bits(enc.code_bits)
        except BaseException:
            self.abort()
            raise
        values = bits.view(np.float32) if self.fmt == "compressed" else enc.decoded_values(ip)
        decoded = CSRMatrix(ip, indices, values, (k, self.shape[1]))
        self._append(enc, decoded, self._accept(decoded, validate=False))

    def write_encoded(self, block: CompressedMatrix, *, validate: bool = True) -> None:
        """Append the next row block, already encoded (its format must be the writer's).

        A block of another code width than the file's is re-encoded (values bit for bit).
        """
        if block.format != self.fmt:
            raise ValueError(f"{self.path}: a {block.format} block for a {self.fmt} file")
        decoded = block.to_csr(validate=validate, source=self.path)
        bnnz = self._accept(decoded, validate=False)
        if bnnz != block.nnz:
            raise MatrixFormatError(self.path, f"encoded block decodes to {bnnz} elements, says nnz = {block.nnz}")
        try:
            if block.slots:
                if self.code_bits is None:
                    self._set_code_bits(block.code_bits)
                block = block.with_code_bits(self.code_bits)
        except BaseException:
            self.abort()
            raise
        self._append(block, decoded, bnnz)

    def _append(self, enc: CompressedMatrix, decoded: CSRMatrix, bnnz: int) -> None:
        k = enc.shape[0]
        try:
            lp = enc.slotptr()
            gp = lp - lp[0] + self._slots  # absolute slot offsets of rows _rows .. _rows + k
            rows = np.arange(self._rows, self._rows + k + 1, dtype=np.int64)
            starts = rows[rows % ROW_BLOCK == 0]
            self._rowbase[starts >> ROW_SHIFT] = gp[starts - self._rows]
            off = gp - self._rowbase[rows >> ROW_SHIFT]
            if off.size and int(off.max()) > MAX_BLOCK_SLOTS:
                raise MatrixFormatError(
                    self.path,
                    f"a block of {ROW_BLOCK} rows spans more than {MAX_BLOCK_SLOTS} slots (32-bit row offsets); "
                    "store this matrix as csr",
                )
            def write() -> None:
                if k:
                    self._dataset("rowoff")[self._rows + 1 : self._rows + k + 1] = off[1:].astype(np.uint32)
                s = enc.slots
                if s:
                    lo, hi = self._slots, self._slots + s
                    for name, arr in (("codes", enc.codes), ("values", enc.values)):
                        ds = self._dataset(name)
                        ds.resize((hi,))
                        ds[lo:hi] = arr
                if enc.scale is not None and k:
                    self._dataset("scale")[self._rows : self._rows + k] = enc.scale

            ends = decoded.indptr[1:] - decoded.indptr[0] + self._written
            self._checksum.update_rows(ends, decoded.indices, decoded.data, during=write)
        except BaseException:
            self.abort()
            raise
        self._rows += k
        self._written += bnnz
        self._slots += enc.slots

    def close(self) -> str:
        """Check completeness, store ``rowbase``, ``slots`` and the checksum, rename into place; return the checksum."""
        if not self._open:
            return self.checksum
        self._check_complete()
        digest = self.checksum
        self._open = False
        try:
            if self.code_bits is None:  # no element: nothing decided the width
                self._set_code_bits(8)
            self._f["rowbase"][...] = self._rowbase
            self._f.attrs["nnz"] = np.int64(self.nnz)
            self._f.attrs["slots"] = np.int64(self._slots)
            self._f.attrs["checksum"] = digest
            self._close_h5()
        except BaseException as exc:
            with contextlib.suppress(Exception):
                self._close_h5()  # where the error came before the close
            self._stack.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._stack.close()
        log.debug(
            "wrote %s (%s, %d x %d, nnz %d, %d slots, %d-bit codes)",
            self.path, self.fmt, *self.shape, self.nnz, self._slots, self.code_bits,
        )  # fmt: skip
        return digest

    def abort(self) -> None:
        """Discard the partial file (the target is left untouched)."""
        if not self._open:
            return
        self._open = False
        with contextlib.suppress(Exception):
            self._close_h5()
        self._stack.__exit__(RuntimeError, RuntimeError("aborted"), None)


def write_compressed_h5(
    path: str | os.PathLike,
    matrix: CSRMatrix | CompressedMatrix,
    *,
    fmt: str | None = None,
    code_bits: int | None = None,
    max_nnz: int = DEFAULT_CHUNK_NNZ,
    **attrs,
) -> str:
    """Write a matrix (CSR, or already compressed) as a compressed container, atomically; return its checksum.

    ``fmt`` defaults to the compressed matrix's own format, else ``compressed``.
    ``code_bits`` defaults to the compressed matrix's own width, else the
    smaller encoding of the whole CSR matrix
    (:func:`mlemlib.compressed.choose_code_bits`). ``attrs`` go to
    :class:`CompressedH5Writer`.
    """
    if isinstance(matrix, CompressedMatrix):
        fmt = fmt or matrix.format
        if fmt != matrix.format:
            matrix = matrix.to_csr()
        elif code_bits is None:
            code_bits = matrix.code_bits
    fmt = fmt or "compressed"
    if not isinstance(matrix, CompressedMatrix):
        from mlemlib.formats._check import check_block, split_rows

        check_block(matrix, path)
        if code_bits is None:
            code_bits = choose_code_bits(matrix, fmt, source=path)
    with CompressedH5Writer(path, matrix.shape, matrix.nnz, fmt=fmt, code_bits=code_bits, **attrs) as w:
        if isinstance(matrix, CompressedMatrix):
            for r0, r1 in chunk_bounds(matrix.slotptr(), max_nnz) if matrix.shape[0] else []:
                w.write_encoded(matrix.row_range(r0, r1))
        else:
            for block in split_rows(matrix, max_nnz):
                w.write_rows(block, validate=False)
    return w.checksum


def sample_code_bits(
    reader,
    fmt: str = "compressed",
    *,
    sample_nnz: int = SAMPLE_NNZ,
    pieces: int = SAMPLE_PIECES,
) -> int:
    """The code width for a streamed encoding of a whole matrix, from a sample of its rows.

    Reads ``pieces`` row ranges spread evenly over the matrix (each from an
    evenly spaced row on, about ``sample_nnz / pieces`` elements; the whole
    matrix when it holds at most ``sample_nnz`` elements), and returns the
    width (8 or 16) whose encoding of those rows is smaller (8 on a tie, or
    without elements).

    Parameters
    ----------
    reader
        An opened matrix (``read_indptr()``, ``read_rows(start, stop)``), e.g.
        from :func:`mlemlib.formats.open_matrix`.
    fmt
        ``compressed``, ``compressed-f16`` or ``compressed-u16``.

    Raises
    ------
    MatrixFormatError
        A fault of the rows read, or columns not sorted within a row.
    """
    indptr = reader.read_indptr()
    m = len(indptr) - 1
    total = int(indptr[-1]) if m else 0
    if total == 0:
        return 8
    if total <= sample_nnz:
        ranges = [(0, m)]
    else:
        per = max(1, sample_nnz // pieces)
        ranges = []
        for q in range(pieces):
            r0 = q * m // pieces
            r1 = int(np.searchsorted(indptr, indptr[r0] + per, side="left"))
            r1 = min(m, max(r0 + 1, r1))
            if ranges and r0 < ranges[-1][1]:
                ranges[-1] = (ranges[-1][0], max(ranges[-1][1], r1))
            else:
                ranges.append((r0, r1))
    sums = {8: 0, 16: 0}
    for r0, r1 in ranges:
        nb = encoded_nbytes(reader.read_rows(r0, r1), fmt, source=getattr(reader, "source", "<matrix>"), row0=r0)
        for k in sums:
            sums[k] += nb[k]
    return pick_code_bits(sums)


def read_compressed_h5(path: str | os.PathLike) -> CompressedMatrix:
    """Read a whole compressed container as a :class:`CompressedMatrix`, validated."""
    with CompressedH5(path) as f:
        return f.read_encoded(0, f.shape[0])


def copy_compressed(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    code_bits: int | None = None,
    keep_rows: np.ndarray | None = None,
    attach: tuple[dict, dict] | None = None,
    max_nnz: int = DEFAULT_CHUNK_NNZ,
) -> dict:
    """Stream a compressed container into a new one of the same format, keeping every stored value bit for bit.

    What :func:`mlemlib.formats.convert` does for a compressed input whose
    format is kept (``mlem convert``, ``mlem fold``): each row block is read
    with its value bits and row scales (:meth:`CompressedH5.read_element_bits`,
    validated) and encoded again from them, so a lossy (16-bit) matrix is not
    rounded a second time. One block in memory at a time; the input is checked
    against its stored checksum; the output is written atomically.

    Parameters
    ----------
    src, out
        The compressed container and the container to write.
    code_bits
        The output's code width; default the input's.
    keep_rows, attach
        As for :func:`mlemlib.formats.convert`: write only these rows (a
        boolean mask over the input's rows); extra ``(datasets, attributes)``.
    max_nnz
        Slots per streamed block.

    Returns
    -------
    dict
        The summary of :func:`mlemlib.formats.convert` (same keys).

    Raises
    ------
    MatrixFormatError
        A fault of the input (nothing is written), or an input that is not a compressed container.
    """
    if max_nnz < 1:
        raise ValueError(f"max_nnz must be >= 1, got {max_nnz}")
    src, out = Path(src), Path(out)
    if src.resolve() == out.resolve():
        raise MatrixFormatError(out, "output would overwrite the input")
    t0 = time.perf_counter()
    with MatrixH5(src) as reader:
        if not isinstance(reader, CompressedH5):
            raise MatrixFormatError(src, f"is a {getattr(reader, 'format', 'csr')} container, not a compressed one")
        fmt = reader.format
        m, n = reader.shape
        first = None
        m_out, nnz_out = m, reader.nnz
        if keep_rows is not None:
            first = np.asarray(keep_rows, dtype=bool).reshape(-1)
            if first.shape[0] != m:
                raise ValueError(f"keep_rows has {first.shape[0]} entries, the input has {m} rows")
            m_out = int(first.sum())
            nnz_out = int(np.diff(reader.read_indptr())[first].sum())
        skip = {"format", "version", "shape", "nnz", "checksum", "checksum_method", "source"}
        skip |= {"grid", "voxel_size", "scanner_block", "slots", "encoding", "code_bits"}
        extra = {"kind": "matrix"}
        extra.update({k: v for k, v in reader.attrs.items() if k not in skip})
        code_bits = reader.code_bits if code_bits is None else code_bits
        log.info("copying %s (%s, %d x %d, nnz %d) -> %s, values kept bit for bit", src, fmt, m, n, reader.nnz, out)
        input_sum = checksum_for(reader.checksum_method)
        input_sum.update("indptr", np.zeros(1, dtype=np.int64))
        done = chunks = 0
        with CompressedH5Writer(
            out, (m_out, n), nnz_out, fmt=fmt, code_bits=code_bits, source=src.name, grid=reader.grid,
            voxel_size=reader.voxel_size, scanner_block=reader.scanner_block, **extra,
        ) as writer:
            for r0, r1, rows in reader.iter_element_bits(max_nnz):
                block, bits, scale = rows.csr, rows.bits, rows.scale
                input_sum.update_rows(block.indptr[1:] + done, block.indices, block.data)
                if first is not None:
                    keep = np.flatnonzero(first[r0:r1])
                    ip, sel = row_elements(block.indptr, keep)
                    writer.write_element_bits(ip, block.indices[sel], bits[sel],
                                              scale[keep] if scale is not None else None)
                else:
                    writer.write_element_bits(block.indptr, block.indices, bits, scale)
                done += block.nnz
                chunks += 1
            if attach is not None:
                writer.attach(*attach)
            got = input_sum.hexdigest()
            if got != reader.checksum:
                raise MatrixFormatError(
                    src, f"checksum mismatch: attribute says {reader.checksum}, data gives {got} (file corrupted)"
                )
        grid, voxel_size = reader.grid, reader.voxel_size
    seconds = time.perf_counter() - t0
    with CompressedH5(out) as f:
        nbytes = f.nbytes
    summary = conversion_summary(src, out, shape=(m_out, n), nnz=nnz_out, chunks=chunks, seconds=seconds,
                                 checksum=writer.checksum, grid=grid, voxel_size=voxel_size, fmt=fmt,
                                 lossless=fmt == "compressed", nbytes=nbytes, code_bits=code_bits,
                                 input_shape=(m, n) if first is not None else None)
    log.info("copied %s -> %s: nnz %d in %.1f s", src, out, nnz_out, seconds)
    return summary


def conversion_summary(src: Path, out: Path, *, shape: tuple[int, int], nnz: int, chunks: int, seconds: float,
                       checksum: str, grid, voxel_size, fmt: str, lossless: bool, nbytes: int,
                       code_bits: int | None, input_shape: tuple[int, int] | None) -> dict:
    """What a conversion (:func:`mlemlib.formats.convert`, :func:`copy_compressed`) reports: shape, nnz,
    blocks, seconds, both files' sizes, checksum, geometry, format and bytes per non-zero
    (``input_shape`` where rows were left out)."""
    summary = {
        "source": os.fspath(src),
        "output": os.fspath(out),
        "shape": [shape[0], shape[1]],
        "nnz": nnz,
        "chunks": chunks,
        "seconds": seconds,
        "bytes": out.stat().st_size,
        "input_bytes": src.stat().st_size,
        "checksum": checksum,
        "grid": list(grid) if grid else None,
        "voxel_size": list(voxel_size) if voxel_size else None,
        "format": fmt,
        "lossless": lossless,
        "bytes_per_nnz": nbytes / nnz if nnz else None,
        "code_bits": code_bits,
    }
    if input_shape is not None:
        summary["input_shape"] = [input_shape[0], input_shape[1]]
    return summary
