"""The compressed system matrix: 8- or 16-bit column deltas, exact float32 (or 16-bit) values (host memory; NumPy and Numba).

A :class:`CompressedMatrix` holds the same matrix as a CSR
(:class:`mlemlib.matrix.CSRMatrix`) in about 5 bytes per non-zero instead of
8: each column index becomes its difference from the previous column of the
row (one *code* of ``code_bits`` = 8 or 16 bits), and the few differences
that do not fit a code travel in a *marker* slot placed just before the
element, whose value slot holds the difference instead of a value. Layout
version 2 (docs/formats.md, "The compressed matrix"), for ``m`` rows and
``S`` slots (non-zeros, markers and pads):

==========  ==========================  ==========================================
array       dtype, length               content
==========  ==========================  ==========================================
``rowbase``  int64[m // 64 + 1]          slot offset of rows 0, 64, 128, ...
``rowoff``   uint32[m + 1]               slot offset of row r minus ``rowbase[r >> 6]``
``codes``    uint8[S] / uint16[S]        per slot (``code_bits`` 8 / 16): a column delta or a marker
``values``   float32[S] / 16-bit[S]      per slot: the value, or a marker's delta bits
``scale``    float32[m]                  16-bit values only: row scale (a power of two in -f16)
==========  ==========================  ==========================================

With ``B = code_bits``: :func:`max_direct` ``= 2**B - 3`` (253 / 65533) is
the largest delta a code holds, :func:`code_high` ``= 2**B - 2`` (254 /
65534) and :func:`code_mark` ``= 2**B - 1`` (255 / 65535) are the markers.
Row ``r`` occupies slots ``[p(r), p(r+1))`` with ``p(r) = rowbase[r >> 6] +
rowoff[r]``; every ``p(r)`` is a multiple of :data:`SLOT_ALIGN` (4), so
every row starts at a multiple of 4 and holds a multiple of 4 slots.
Decoding a row keeps a running column ``col`` (0 at the row's start) and,
slot by slot: code ``c <= max_direct`` adds ``c`` to ``col`` and the slot is
the element ``(col, value)``; ``code_mark`` adds the slot's value bits (read
as an unsigned integer: 32 bits, or 16 with 16-bit values) and
``code_high`` adds those bits shifted left by 16 (16-bit values only;
refused in a float32 matrix), and the slot holds no element. Every delta is
>= 0 (columns are sorted within a row). The encoder gives a delta above
``max_direct`` to a marker (float32: one ``code_mark`` marker; 16-bit values: one
``code_mark`` marker below 65,536, else a ``code_high`` marker with the high
16 bits and a ``code_mark`` marker with the low 16 bits) and the element
itself the delta 0, then pads the row to a multiple of 4 slots with *pad*
slots: ``code_mark`` with value bits 0 (a marker of delta 0: no element,
moves nothing). An empty row has no slot.

``code_bits`` is one per matrix; :meth:`CompressedMatrix.from_csr` takes the
width whose encoding is smaller (markers and pads counted): 8 bits for rows
of small deltas (rows of ``A``: a tube's voxels), 16 bits where most deltas
lie in 254..65,533 (rows of ``A^T``: a voxel's LORs ``i * N + j``, where an
8-bit code would need a marker for about every second element).

Because codes and values are aligned slot for slot and rows are aligned to 4
slots, a GPU lane decodes 4 consecutive slots of a row with one 4-byte (or
8-byte) code load and one 16-byte (or 8-byte) value load, and a warp forms
the columns with a prefix sum of the deltas; rows are independent, so any row
range (a GPU's row block, a streamed chunk) is encoded and decoded on its own
and encoded blocks concatenate. The two-level row pointer costs 4.125 bytes
per row (a 64-bit pointer would cost 8, most of the overhead on matrices with
many empty rows); a block of 64 rows may span at most ``2**32 - 1`` slots.

``compressed-f16`` (lossy, never the default) stores each value ``v`` of row
``r`` as the float16 ``round(v / scale[r])`` with ``scale[r]`` the power of
two ``2**(e - 15)``, ``2**(e-1) <= max(row) < 2**e``: the largest value of a
row maps below 32,768, every value keeps float16's 11 significant bits
(relative error <= 2**-11) down to ``2**-29`` of its row's largest, and
decoding (``float32(half) * scale``) is exact.

``compressed-u16`` (lossy, never the default) stores each value as the
unsigned 16-bit integer ``q = rint(v / scale[r])`` with ``scale[r]`` the
float32 nearest ``max(row) / 65,535``: a per-row fixed point whose grid spans
the row, absolute error at most ``scale[r] / 2`` (about ``max(row) /
131,070``) on every value (float16 keeps relative precision instead, 11
bits). The decoded value is ``float32(q) * scale[r]`` rounded once to
float32, which every kernel computes the same way, so kernels on the encoding
give the decoded CSR's sums; and ``q`` is ``rint(decoded / scale[r])`` again
(the product's rounding is below half a step), so the encoding is recovered
from the decoded values and the row scales. On MLEM images it loses less
than float16, whose relative precision wastes bits on a row's small values.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from mlemlib.errors import MatrixFormatError
from mlemlib.matrix import CSRMatrix, validate_csr_arrays
from mlemlib.setup_times import timed

# mlemlib.formats (which reads and writes this format) imports this module, so
# this module imports nothing of mlemlib.formats (no import circle).

#: Layout version (the container's ``version`` attribute).
LAYOUT_VERSION = 2
#: Rows per block of the two-level row pointer (``rowbase`` has one entry per block).
ROW_SHIFT = 6
ROW_BLOCK = 1 << ROW_SHIFT
#: Every row starts at a slot offset that is a multiple of this, and holds a multiple of it slots.
SLOT_ALIGN = 4
#: Code widths -> dtype of ``codes``.
CODE_DTYPES = {8: np.dtype(np.uint8), 16: np.dtype(np.uint16)}
#: Matrix format names (``mlem convert --format``) -> value dtype (each format's description,
#: :mod:`mlemlib.formats.spec`, reads its value facts from this table and :data:`LOSSY_FORMATS`).
VALUE_DTYPES = {
    "compressed": np.dtype(np.float32),
    "compressed-f16": np.dtype(np.float16),
    "compressed-u16": np.dtype(np.uint16),
}
#: The compressed formats whose values are rounded to 16 bits (never the default).
LOSSY_FORMATS = ("compressed-f16", "compressed-u16")


def _kernels():
    """:mod:`mlemlib._compressed_kernels`, imported (with Numba) on first use."""
    from mlemlib import _compressed_kernels

    return _compressed_kernels


def exact_format(fmt: str) -> str:
    """The format that holds a matrix's decoded values exactly: ``fmt`` itself, or ``compressed`` (float32
    values) for a lossy one, whose values a second encoding would round again (the transpose of a lossy
    matrix is written in it, so that ``A^T`` is exactly ``A``'s transpose)."""
    return "compressed" if fmt in LOSSY_FORMATS else fmt

#: Value dtype -> the value kind the Numba and CUDA kernels take (0 float32; 1 float16 times the row's
#: power-of-two scale; 2 uint16 times the row's float32 scale).
VALUE_KINDS = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.uint16): 2}
#: Value dtype -> its compressed format name.
FORMAT_OF_VALUES = {dtype: fmt for fmt, dtype in VALUE_DTYPES.items()}
#: Largest slot offset within one row block (``rowoff`` is uint32).
MAX_BLOCK_SLOTS = (1 << 32) - 1
#: Slots decoded per piece by the whole-matrix helpers (bounds their scratch memory).
PIECE_SLOTS = 1 << 22


def max_direct(code_bits: int) -> int:
    """Largest column delta a code holds: ``2**code_bits - 3`` (253 or 65,533)."""
    return (1 << code_bits) - 3


def code_high(code_bits: int) -> int:
    """The high marker (16-bit values only; delta += bits << 16): ``2**code_bits - 2`` (254 or 65,534)."""
    return (1 << code_bits) - 2


def code_mark(code_bits: int) -> int:
    """The marker (delta += bits; with bits 0 a pad): ``2**code_bits - 1`` (255 or 65,535)."""
    return (1 << code_bits) - 1


def code_bits_of(codes: np.ndarray) -> int:
    """The code width of a codes array (8 for uint8, 16 for uint16)."""
    for bits, dtype in CODE_DTYPES.items():
        if codes.dtype == dtype:
            return bits
    raise TypeError(f"codes must be uint8 or uint16, not {codes.dtype}")


def value_kind(dtype) -> int:
    """The value kind of a values dtype (:data:`VALUE_KINDS`); TypeError for another dtype."""
    try:
        return VALUE_KINDS[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"values must be float32, float16 or uint16, not {np.dtype(dtype)}") from None


def format_of_values(dtype) -> str:
    """The compressed format name of a values dtype (``compressed``, ``compressed-f16``, ``compressed-u16``)."""
    value_kind(dtype)  # TypeError for another dtype
    return FORMAT_OF_VALUES[np.dtype(dtype)]


def _check_code_bits(code_bits) -> int:
    if code_bits not in CODE_DTYPES:
        raise ValueError(f"code_bits must be 8 or 16, not {code_bits!r}")
    return int(code_bits)


# --------------------------------------------------------------------------- row pointer
def pack_rowptr(slotptr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split a slot pointer (int64, ``m + 1`` entries, starting at 0) into ``(rowbase, rowoff)``.

    Raises
    ------
    ValueError
        If a block of :data:`ROW_BLOCK` rows spans more than ``2**32 - 1`` slots.
    """
    slotptr = np.asarray(slotptr, dtype=np.int64)
    rowbase = np.ascontiguousarray(slotptr[::ROW_BLOCK])
    off = slotptr - np.repeat(rowbase, ROW_BLOCK)[: len(slotptr)]
    if off.size and int(off.max()) > MAX_BLOCK_SLOTS:
        r = int(np.argmax(off > MAX_BLOCK_SLOTS))
        raise ValueError(
            f"rows {r & ~(ROW_BLOCK - 1)}..{r} span {int(off[r])} slots, more than the compressed format's "
            f"32-bit row offsets hold ({MAX_BLOCK_SLOTS}); store this matrix as csr"
        )
    return rowbase, off.astype(np.uint32)


def unpack_rowptr(rowbase: np.ndarray, rowoff: np.ndarray, row0: int = 0) -> np.ndarray:
    """The int64 slot pointer of rows ``row0 .. row0 + len(rowoff) - 1``.

    ``rowbase`` holds the block bases from block ``row0 >> 6`` on (the whole
    array when ``row0`` is 0).
    """
    k = len(rowoff)
    blocks = (np.arange(row0, row0 + k, dtype=np.int64) >> ROW_SHIFT) - (row0 >> ROW_SHIFT)
    return rowbase[blocks].astype(np.int64) + rowoff.astype(np.int64)


def rowbase_length(m: int) -> int:
    """Entries of ``rowbase`` for ``m`` rows."""
    return m // ROW_BLOCK + 1


@timed("check")
def check_alignment(slotptr: np.ndarray, source: str | os.PathLike, *, row0: int = 0, slot0: int = 0) -> None:
    """Raise :class:`MatrixFormatError` unless every slot offset is a multiple of :data:`SLOT_ALIGN`.

    ``slotptr`` may start anywhere; the offset checked for row ``r`` is
    ``slot0 + slotptr[r] - slotptr[0]`` (its offset in the file or matrix).
    """
    if not len(slotptr):
        return
    rel = np.asarray(slotptr, dtype=np.int64) - int(slotptr[0]) + int(slot0)
    bad = (rel & (SLOT_ALIGN - 1)) != 0
    if bad.any():
        r = int(np.argmax(bad))
        raise MatrixFormatError(
            source, f"slot offset {int(rel[r])} of row {row0 + r} is not a multiple of {SLOT_ALIGN}"
        )


# --------------------------------------------------------------------------- encode / decode
def _value_bits(values: np.ndarray) -> np.ndarray:
    """The slots' bits as unsigned integers (uint32 for float32, uint16 for 16-bit values), a view."""
    return values.view(np.uint32 if values.dtype == np.float32 else np.uint16)


def values16(fmt: str) -> bool:
    """Whether a compressed format stores 16-bit values with a float32 scale per row.

    Its value slots are then 16 bits (markers split deltas above 65,535), its
    container has a ``scale`` dataset, and the chunked layout keeps the
    values at 2 bytes. The one test of it the code uses (the set equals
    :data:`LOSSY_FORMATS` today; that one says what the values lose). False
    for any other format name (``csr``).
    """
    dtype = VALUE_DTYPES.get(fmt)
    return dtype is not None and dtype.itemsize == 2


def _padded(slots: np.ndarray) -> np.ndarray:
    """Slot counts rounded up to a multiple of :data:`SLOT_ALIGN` (0 stays 0)."""
    return (slots + (SLOT_ALIGN - 1)) & ~np.int64(SLOT_ALIGN - 1)


def _count(indptr, indices, half, source, row0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row lengths and padded slot counts with 8-bit and 16-bit codes; refuses unsorted rows."""
    m = len(indptr) - 1
    markers8 = np.empty(m, dtype=np.int64)
    markers16 = np.empty(m, dtype=np.int64)
    unsorted = np.empty(m, dtype=np.int64)
    _kernels()._count_markers(indptr, indices, half, markers8, markers16, unsorted)
    if m and unsorted.any():
        r = int(np.argmax(unsorted > 0))
        k = int(indptr[r] - indptr[0] + unsorted[r] - 1)
        raise MatrixFormatError(
            source,
            f"columns of row {row0 + r} are not sorted (column {int(indices[k])} after {int(indices[k - 1])}); "
            "the compressed format stores sorted rows: sort the rows' columns first",
        )
    lens = np.diff(indptr)
    return lens, _padded(lens + markers8), _padded(lens + markers16)


def _csr_arrays(block: CSRMatrix) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.ascontiguousarray(block.indptr, dtype=np.int64),
        np.ascontiguousarray(block.indices, dtype=np.int32),
    )


def _slot_bytes(fmt: str, code_bits: int) -> int:
    return CODE_DTYPES[code_bits].itemsize + VALUE_DTYPES[fmt].itemsize


def encoded_nbytes(
    block: CSRMatrix, fmt: str = "compressed", *, source: str | os.PathLike = "<matrix>", row0: int = 0
) -> dict[int, int]:
    """Bytes of the encoding of CSR rows with each code width: ``{8: bytes, 16: bytes}`` (every array counted).

    One counting pass over the columns, nothing encoded. Raises
    :class:`MatrixFormatError` on columns not sorted within a row.
    """
    if fmt not in VALUE_DTYPES:
        raise ValueError(f"unknown compressed format {fmt!r}, expected one of {', '.join(VALUE_DTYPES)}")
    indptr, indices = _csr_arrays(block)
    _, s8, s16 = _count(indptr, indices, values16(fmt), source, row0)
    m = block.shape[0]
    fixed = 8 * rowbase_length(m) + 4 * (m + 1) + (4 * m if values16(fmt) else 0)
    return {
        8: fixed + int(s8.sum()) * _slot_bytes(fmt, 8),
        16: fixed + int(s16.sum()) * _slot_bytes(fmt, 16),
    }


def pick_code_bits(nbytes: dict[int, int]) -> int:
    """The code width of the smaller encoding (8 on a tie)."""
    return 16 if nbytes[16] < nbytes[8] else 8


def choose_code_bits(
    block: CSRMatrix, fmt: str = "compressed", *, source: str | os.PathLike = "<matrix>", row0: int = 0
) -> int:
    """8 or 16: the code width whose encoding of these rows takes fewer bytes (markers and pads counted; 8 on a tie)."""
    return pick_code_bits(encoded_nbytes(block, fmt, source=source, row0=row0))


def _encode_rows(indptr, indices, bits_in, half, code_bits, source, row0):
    """Slot pointer (from 0), codes and value bits of rows with given element bits; ``code_bits`` None = choose."""
    lens, s8, s16 = _count(indptr, indices, half, source, row0)
    vbytes = 2 if half else 4
    if code_bits is None:
        code_bits = 16 if int(s16.sum()) * (2 + vbytes) < int(s8.sum()) * (1 + vbytes) else 8
    m = len(lens)
    slotptr = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(s8 if code_bits == 8 else s16, out=slotptr[1:])
    slots = int(slotptr[-1])
    codes = np.empty(slots, dtype=CODE_DTYPES[code_bits])
    bits_out = np.empty(slots, dtype=np.uint16 if half else np.uint32)
    _kernels()._fill(indptr, indices, bits_in, slotptr, half, max_direct(code_bits), code_high(code_bits),
          code_mark(code_bits), codes, bits_out)
    return slotptr, codes, bits_out, code_bits, int(lens.sum())


def encode_csr(
    block: CSRMatrix,
    fmt: str = "compressed",
    *,
    code_bits: int | None = None,
    source: str | os.PathLike = "<matrix>",
    row0: int = 0,
) -> dict:
    """Encode CSR rows; return the arrays of :class:`CompressedMatrix` (``slotptr`` instead of the row pointer pair).

    Parameters
    ----------
    block
        Rows (``indptr`` may start anywhere), columns sorted within each row.
    fmt
        ``compressed``, ``compressed-f16`` or ``compressed-u16``.
    code_bits
        8 or 16; None takes the one whose encoding is smaller (8 on a tie).
    source, row0
        File and global number of the block's first row, named in error messages.

    Returns
    -------
    dict
        ``slotptr`` (int64, m+1, from 0, multiples of 4), ``codes``,
        ``values``, ``scale`` (or None), ``nnz``, ``code_bits``.

    Raises
    ------
    MatrixFormatError
        Columns that decrease within a row (the format stores deltas >= 0).
    """
    if fmt not in VALUE_DTYPES:
        raise ValueError(f"unknown compressed format {fmt!r}, expected one of {', '.join(VALUE_DTYPES)}")
    if code_bits is not None:
        code_bits = _check_code_bits(code_bits)
    half = values16(fmt)
    m = block.shape[0]
    indptr, indices = _csr_arrays(block)
    data = np.ascontiguousarray(block.data, dtype=np.float32)
    scale = None
    if half:
        scale = np.empty(m, dtype=np.float32)
        if VALUE_DTYPES[fmt].kind == "u":  # integer codes: the integers straight into 16 bits, on every thread
            bits_in = np.empty(len(data), dtype=np.uint16)
            _kernels()._row_scales(indptr, data, scale, bits_in, True)
        else:
            scaled = np.empty(len(data), dtype=np.float64)
            _kernels()._row_scales(indptr, data, scale, scaled, False)
            bits_in = scaled.astype(VALUE_DTYPES[fmt]).view(np.uint16)  # float16: round to nearest even
            del scaled
    else:
        bits_in = data.view(np.uint32)
    slotptr, codes, bits, code_bits, nnz = _encode_rows(indptr, indices, bits_in, half, code_bits, source, row0)
    values = bits.view(VALUE_DTYPES[fmt])
    return {"slotptr": slotptr, "codes": codes, "values": values, "scale": scale, "nnz": nnz, "code_bits": code_bits}


def encode_bits(
    indptr: np.ndarray,
    indices: np.ndarray,
    bits: np.ndarray,
    scale: np.ndarray | None,
    n: int,
    fmt: str,
    *,
    code_bits: int | None = None,
    source: str | os.PathLike = "<matrix>",
    row0: int = 0,
) -> CompressedMatrix:
    """Encode rows given as columns and their elements' value bits (:meth:`CompressedMatrix.element_bits`).

    No value is rounded: the value slots get ``bits`` and the rows keep the
    row scales ``scale``, so rows decoded from an encoding, moved or given
    other (sorted) column numbers, encode to the same values and scales
    (re-encoding the decoded 16-bit values could pick another row scale).

    Parameters
    ----------
    indptr, indices
        The rows' row pointer (may start anywhere) and sorted columns.
    bits
        One value slot per element (uint32: float32 bits for ``compressed``;
        uint16 for the 16-bit formats), from element ``indptr[0]`` on.
    scale
        float32 row scales (16-bit formats), else None.
    n
        Columns.
    fmt
        ``compressed``, ``compressed-f16`` or ``compressed-u16``.
    code_bits
        8 or 16; None takes the one whose encoding is smaller (8 on a tie).
    source, row0
        File and global first row, for messages.

    Raises
    ------
    MatrixFormatError
        Columns that decrease within a row.
    """
    if fmt not in VALUE_DTYPES:
        raise ValueError(f"unknown compressed format {fmt!r}, expected one of {', '.join(VALUE_DTYPES)}")
    if code_bits is not None:
        code_bits = _check_code_bits(code_bits)
    half = values16(fmt)
    want = np.uint16 if half else np.uint32
    bits = np.asarray(bits)
    if bits.dtype != want:
        raise TypeError(f"{fmt} needs {np.dtype(want).name} value bits, not {bits.dtype}")
    ip = np.ascontiguousarray(indptr, dtype=np.int64)
    ip = ip - ip[0] if len(ip) and ip[0] else ip
    m = len(ip) - 1
    if half and (scale is None or len(scale) != m):
        raise ValueError(f"{fmt} needs one row scale per row ({m})")
    slotptr, codes, out, code_bits, nnz = _encode_rows(
        ip, np.ascontiguousarray(indices, dtype=np.int32), bits, half, code_bits, source, row0
    )
    sc = np.ascontiguousarray(scale, dtype=np.float32) if half else None
    return CompressedMatrix.from_arrays(slotptr, codes, out.view(VALUE_DTYPES[fmt]), sc, (m, int(n)), nnz, code_bits)


@timed("decode")
def decode_slots(
    slotptr: np.ndarray,
    codes: np.ndarray,
    values: np.ndarray,
    scale: np.ndarray | None,
    n: int,
    *,
    source: str | os.PathLike = "<matrix>",
    row0: int = 0,
    slot0: int = 0,
    check_values: bool = True,
    store: bool = True,
    out: tuple[np.ndarray, np.ndarray] | None = None,
) -> CSRMatrix | int:
    """Decode encoded rows into a :class:`CSRMatrix`, validating as it goes (``store=False``: only check, see :func:`check_slots`).

    Parameters
    ----------
    slotptr
        int64 slot pointer of the rows (may start anywhere; ``codes``/``values`` start at ``slotptr[0]``).
    codes, values, scale
        The rows' slots (and row scales for 16-bit values); the code width
        is that of ``codes`` (uint8: 8 bits, uint16: 16).
    n
        Columns: every running column must stay below ``n``.
    source, row0, slot0
        File, first row and first slot in the file, for messages (and the
        alignment check: row ``r`` starts at ``slot0 + slotptr[r] - slotptr[0]``).
    check_values
        Also reject non-finite or negative values (and row scales that are not
        finite and positive).
    out
        int32 and float32 arrays the columns and values are written to the
        front of (the result's arrays are views of them); ``ValueError`` if
        they are shorter than the rows' elements.

    Raises
    ------
    MatrixFormatError
        A slot offset that is not a multiple of 4, a delta stream that leaves
        ``[0, n)``, a high marker in a float32 row, a bad value or row scale.
    """
    slotptr = np.ascontiguousarray(slotptr, dtype=np.int64)
    m = len(slotptr) - 1
    kind = value_kind(values.dtype)
    high = code_high(code_bits_of(codes))
    check_alignment(slotptr, source, row0=row0, slot0=slot0)
    if check_values:
        check_encoded_values(slotptr, codes, values, scale, source, row0=row0, slot0=slot0)
    counts = np.empty(m, dtype=np.int64)
    indptr = np.zeros(m + 1, dtype=np.int64)
    if store:
        _kernels()._real_counts(slotptr, codes, high, counts)
        np.cumsum(counts, out=indptr[1:])
    nnz = int(indptr[-1])
    if out is not None and store:
        if len(out[0]) < nnz or len(out[1]) < nnz:
            raise ValueError(f"buffers of {len(out[0])} and {len(out[1])} elements cannot hold {nnz}")
        cols, vals = out[0][:nnz], out[1][:nnz]
    else:
        cols = np.empty(nnz, dtype=np.int32)
        vals = np.empty(nnz, dtype=np.float32)
    bad_slot = np.empty(m, dtype=np.int64)
    bad_col = np.empty(m, dtype=np.int64)
    vf = values if kind == 0 else np.empty(0, dtype=np.float32)
    sc = scale if kind != 0 else np.empty(0, dtype=np.float32)
    _kernels()._decode(slotptr, codes, vf, _value_bits(values), sc, kind, high, int(n), indptr, cols, vals, bad_slot, bad_col,
            store, counts)
    _raise_bad_row(slotptr, bad_slot, bad_col, high, n, source, row0, slot0)
    if not store:
        return int(counts.sum())
    return CSRMatrix(indptr, cols, vals, (m, int(n)))


def _raise_bad_row(slotptr, bad_slot, bad_col, high, n, source, row0, slot0) -> None:
    """The error of the first row :func:`mlemlib._compressed_kernels._decode` marked bad, if any."""
    if not len(bad_slot) or not bad_slot.any():
        return
    r = int(np.argmax(bad_slot > 0))
    k = int(slotptr[r] - slotptr[0] + bad_slot[r] - 1)
    if bad_col[r] < 0:
        raise MatrixFormatError(
            source,
            f"row {row0 + r}: high marker (code {high}) at slot {slot0 + k} in a float32 matrix "
            "(16-bit values only)",
        )
    raise MatrixFormatError(
        source,
        f"row {row0 + r}: the column deltas decode to column {int(bad_col[r])} at slot {slot0 + k}, "
        f"outside [0, {n})",
    )


@timed("check")
def check_slots(slotptr, codes, values, scale, n, **where) -> int:
    """Check encoded rows as :func:`decode_slots` does, without decoding them; return their element count.

    The same checks and messages (alignment, values, row scales, columns in
    ``[0, n)``, high markers; ``where``: ``source``, ``row0``, ``slot0``) in
    one parallel pass that writes nothing but a count per row: what a reader
    that keeps the encoding (a GPU upload) needs.
    """
    return decode_slots(slotptr, codes, values, scale, n, store=False, **where)


def check_row_scales(slotptr: np.ndarray, values: np.ndarray, scale: np.ndarray | None, source: str | os.PathLike,
                     *, row0: int = 0) -> None:
    """Raise :class:`MatrixFormatError` unless 16-bit values come with one finite, positive scale per row."""
    if value_kind(values.dtype) == 0:
        return
    if scale is None or len(scale) != len(slotptr) - 1:
        raise MatrixFormatError(source, f"{values.dtype} values without one row scale per row")
    if len(scale):
        ok = np.isfinite(scale) & (scale > 0)
        if not ok.all():
            r = int(np.argmax(~ok))
            raise MatrixFormatError(
                source, f"row scale {float(scale[r])!r} of row {row0 + r} is not a finite positive number"
            )


def check_encoded_values(
    slotptr: np.ndarray,
    codes: np.ndarray,
    values: np.ndarray,
    scale: np.ndarray | None,
    source: str | os.PathLike,
    *,
    row0: int = 0,
    slot0: int = 0,
) -> None:
    """Raise :class:`MatrixFormatError` unless every element's value is finite and >= 0 (and every row scale finite, > 0).

    uint16 values (``compressed-u16``) are always finite and >= 0: only their row scales are checked.
    """
    kind = value_kind(values.dtype)
    check_row_scales(slotptr, values, scale, source, row0=row0)
    if len(codes) == 0 or kind == 2:
        return
    from numba import get_num_threads

    f32 = values.dtype == np.float32
    k = int(_kernels()._first_bad_value(
        codes, _value_bits(values), code_high(code_bits_of(codes)), 0x7F800000 if f32 else 0x7C00,
        0x80000000 if f32 else 0x8000, max(1, 4 * get_num_threads()),
    ))
    if k >= 0:
        v = float(values[k])
        r = int(np.searchsorted(slotptr - slotptr[0], k, side="right")) - 1
        what = "non-finite" if not math.isfinite(v) else "negative"
        raise MatrixFormatError(source, f"{what} value {v!r} at slot {slot0 + k} (row {row0 + r})")


def _pieces(slotptr: np.ndarray, max_slots: int) -> list[tuple[int, int]]:
    """Consecutive row ranges of at most ``max_slots`` slots (a longer row alone), as ``formats._check.chunk_bounds``."""
    m = len(slotptr) - 1
    out = []
    r0 = 0
    while r0 < m:
        r1 = int(np.searchsorted(slotptr, int(slotptr[r0]) + max_slots, side="right")) - 1
        r1 = min(max(r1, r0 + 1), m)
        out.append((r0, r1))
        r0 = r1
    return out


# --------------------------------------------------------------------------- the type
@dataclass
class CompressedMatrix:
    """A compressed matrix (or row block) in host memory; see the module docstring for the layout.

    Build with :meth:`from_csr`; :meth:`to_csr` gives the exact CSR back
    (``compressed``) or the CSR of the 16-bit-rounded values
    (``compressed-f16``, ``compressed-u16``). Arrays are NumPy; ``values`` is float32, float16 or uint16,
    ``codes`` uint8 or uint16.

    Attributes
    ----------
    rowbase : numpy.ndarray
        int64[m // 64 + 1].
    rowoff : numpy.ndarray
        uint32[m + 1]; every ``rowbase[r >> 6] + rowoff[r]`` a multiple of 4.
    codes : numpy.ndarray
        uint8[S] (``code_bits`` 8) or uint16[S] (16).
    values : numpy.ndarray
        float32[S], float16[S] or uint16[S].
    scale : numpy.ndarray or None
        float32[m] row scales for 16-bit values, else None.
    shape : tuple[int, int]
    nnz : int
        Stored elements (markers and pads not counted).
    code_bits : int
        8 or 16; None on construction takes it from the dtype of ``codes``.
    """

    rowbase: np.ndarray
    rowoff: np.ndarray
    codes: np.ndarray
    values: np.ndarray
    scale: np.ndarray | None
    shape: tuple[int, int]
    nnz: int
    code_bits: int | None = None

    def __post_init__(self) -> None:
        self.shape = (int(self.shape[0]), int(self.shape[1]))
        self.nnz = int(self.nnz)
        m = self.shape[0]
        value_kind(self.values.dtype)  # TypeError for another dtype
        if self.code_bits is None:
            self.code_bits = code_bits_of(self.codes)
        self.code_bits = _check_code_bits(self.code_bits)
        for name, dtype in (("rowbase", np.int64), ("rowoff", np.uint32), ("codes", CODE_DTYPES[self.code_bits])):
            if getattr(self, name).dtype != dtype:
                extra = f" (code_bits = {self.code_bits})" if name == "codes" else ""
                raise TypeError(f"{name} must be {np.dtype(dtype).name}{extra}, not {getattr(self, name).dtype}")
        if self.scale is not None and self.scale.dtype != np.float32:
            raise TypeError(f"scale must be float32, not {self.scale.dtype}")
        if len(self.rowbase) != rowbase_length(m) or len(self.rowoff) != m + 1:
            raise ValueError(
                f"rowbase/rowoff have {len(self.rowbase)}/{len(self.rowoff)} entries, "
                f"expected {rowbase_length(m)}/{m + 1} for {m} rows"
            )
        if len(self.codes) != len(self.values):
            raise ValueError(f"{len(self.codes)} codes but {len(self.values)} value slots")
        if (self.scale is None) != (self.values.dtype == np.float32):
            raise ValueError("a row scale is needed exactly for 16-bit values")

    # -- construction
    @classmethod
    def from_arrays(
        cls,
        slotptr: np.ndarray,
        codes: np.ndarray,
        values: np.ndarray,
        scale: np.ndarray | None,
        shape: tuple[int, int],
        nnz: int,
        code_bits: int | None = None,
    ) -> CompressedMatrix:
        """Build from a slot pointer (int64, from 0) and slot arrays (see :func:`encode_csr`)."""
        rowbase, rowoff = pack_rowptr(slotptr)
        return cls(rowbase, rowoff, codes, values, scale, shape, nnz, code_bits)

    @classmethod
    def from_csr(
        cls,
        a: CSRMatrix,
        fmt: str = "compressed",
        *,
        code_bits: int | None = None,
        validate: bool = True,
        source: str | os.PathLike = "<matrix>",
        row0: int = 0,
    ) -> CompressedMatrix:
        """Encode a CSR matrix or row block (columns sorted within rows).

        Parameters
        ----------
        a
            The matrix; ``indptr`` may start anywhere.
        fmt
            ``compressed`` (lossless), ``compressed-f16`` or ``compressed-u16`` (lossy).
        code_bits
            8 or 16 (forced); None takes the width whose encoding is smaller,
            markers and pads counted (8 on a tie).
        validate
            Check the CSR invariants first (row pointer, column range, values finite and >= 0).
        source, row0
            File and global number of the first row, for messages.

        Raises
        ------
        MatrixFormatError
            An invalid matrix, or columns not sorted within a row.
        """
        if validate:
            validate_csr_arrays(a.indptr, a.indices, a.data, a.shape, source, row_offset=row0)
        enc = encode_csr(a, fmt, code_bits=code_bits, source=source, row0=row0)
        return cls.from_arrays(
            enc["slotptr"], enc["codes"], enc["values"], enc["scale"], a.shape, enc["nnz"], enc["code_bits"]
        )

    def element_bits(self) -> np.ndarray:
        """The elements' value slots as unsigned integers, in element order (uint32 or uint16, a copy).

        With :attr:`scale` and the decoded columns these are the rows
        themselves: :func:`encode_bits` encodes them again without touching a
        value (what a stage that moves rows or renames columns keeps).
        """
        return np.ascontiguousarray(self.value_bits()[self.codes < self.code_high])

    def with_code_bits(self, code_bits: int) -> CompressedMatrix:
        """The same matrix (values and row scales bit for bit) encoded with ``code_bits`` (self if it already is)."""
        code_bits = _check_code_bits(code_bits)
        if code_bits == self.code_bits:
            return self
        csr = self.to_csr(validate=False)
        return encode_bits(csr.indptr, csr.indices, self.element_bits(), self.scale, self.shape[1], self.format,
                           code_bits=code_bits)

    @staticmethod
    def concatenate(parts: list[CompressedMatrix], code_bits: int | None = None) -> CompressedMatrix:
        """Stack row blocks (encoded independently) into one matrix.

        ``code_bits`` None: the blocks with slots must share one code width
        (else ValueError); given: blocks of another width are re-encoded.
        """
        if not parts:
            raise ValueError("nothing to concatenate")
        n = parts[0].shape[1]
        dtype = parts[0].values.dtype
        half = dtype != np.float32
        for p in parts:
            if p.shape[1] != n or p.values.dtype != dtype:
                raise ValueError("row blocks differ in columns or value type")
        if code_bits is None:
            widths = sorted({p.code_bits for p in parts if p.slots})
            if len(widths) > 1:
                raise ValueError(f"row blocks differ in code_bits ({widths}); pass code_bits= to re-encode")
            code_bits = widths[0] if widths else parts[0].code_bits
        parts = [p.with_code_bits(code_bits) for p in parts]
        ptrs = [np.zeros(1, dtype=np.int64)]
        total = 0
        for p in parts:
            sp = p.slotptr()
            ptrs.append(sp[1:] - sp[0] + total)
            total += int(sp[-1] - sp[0])
        slotptr = np.concatenate(ptrs)
        codes = np.concatenate([p.codes for p in parts])
        values = np.concatenate([p.values for p in parts])
        scale = np.concatenate([p.scale for p in parts]) if half else None
        m = sum(p.shape[0] for p in parts)
        return CompressedMatrix.from_arrays(
            slotptr, codes, values, scale, (m, n), sum(p.nnz for p in parts), code_bits
        )

    # -- facts
    @property
    def format(self) -> str:
        """``compressed``, ``compressed-f16`` or ``compressed-u16``."""
        return format_of_values(self.values.dtype)

    @property
    def lossless(self) -> bool:
        """True for float32 values (the exact matrix)."""
        return self.values.dtype == np.float32

    @property
    def max_direct(self) -> int:
        """Largest delta a code holds (253 or 65,533)."""
        return max_direct(self.code_bits)

    @property
    def code_high(self) -> int:
        """The high marker code (254 or 65,534)."""
        return code_high(self.code_bits)

    @property
    def code_mark(self) -> int:
        """The marker (and pad) code (255 or 65,535)."""
        return code_mark(self.code_bits)

    @property
    def slots(self) -> int:
        """Stored slots: non-zeros, markers and pads."""
        return len(self.codes)

    @property
    def nbytes(self) -> int:
        """Bytes of the encoded arrays."""
        extra = self.scale.nbytes if self.scale is not None else 0
        return self.rowbase.nbytes + self.rowoff.nbytes + self.codes.nbytes + self.values.nbytes + extra

    @property
    def bytes_per_nnz(self) -> float:
        """``nbytes / nnz`` (inf for a matrix without non-zeros)."""
        return self.nbytes / self.nnz if self.nnz else math.inf

    def slotptr(self) -> np.ndarray:
        """The int64 slot pointer (``m + 1`` entries)."""
        return unpack_rowptr(self.rowbase, self.rowoff)

    def value_bits(self) -> np.ndarray:
        """The value slots as unsigned integers (a view: uint32 or uint16)."""
        return _value_bits(self.values)

    def decoded_values(self, indptr: np.ndarray | None = None) -> np.ndarray:
        """The elements' values as :meth:`to_csr` gives them (float32[nnz]; ``values`` itself when lossless),
        without decoding the columns: row ``r``'s from ``indptr[r] - indptr[0]`` on (default
        :meth:`csr_indptr`; a CSR block this matrix encodes has the same)."""
        ip = self.csr_indptr() if indptr is None else np.asarray(indptr, dtype=np.int64)
        if len(ip) != self.shape[0] + 1 or int(ip[-1] - ip[0]) != self.nnz:
            raise ValueError(f"indptr of {len(ip) - 1} rows and {int(ip[-1] - ip[0])} elements for a matrix of "
                             f"{self.shape[0]} rows and {self.nnz} elements")
        if self.lossless:
            return self.values[self.codes < self.code_high]
        vals = np.empty(self.nnz, dtype=np.float32)
        _kernels()._slot_values(self.slotptr(), self.codes, self.value_bits(), self.scale, value_kind(self.values.dtype),
                     self.code_high, ip, vals)  # fmt: skip
        return vals

    def csr_indptr(self) -> np.ndarray:
        """The CSR row pointer of the matrix (elements, not slots), from 0."""
        sp = self.slotptr()
        counts = np.empty(self.shape[0], dtype=np.int64)
        _kernels()._real_counts(sp, self.codes, self.code_high, counts)
        out = np.zeros(self.shape[0] + 1, dtype=np.int64)
        np.cumsum(counts, out=out[1:])
        return out

    # -- conversions
    def decode_rows(self, r0: int, r1: int, *, validate: bool = True, source: str | os.PathLike = "<matrix>",
                    slotptr: np.ndarray | None = None) -> CSRMatrix:
        """Rows ``[r0, r1)`` decoded into CSR (row pointer from 0); ``slotptr`` (:meth:`slotptr`) saves recomputing it."""
        sp = self.slotptr() if slotptr is None else slotptr
        lo, hi = int(sp[r0] - sp[0]), int(sp[r1] - sp[0])
        sc = self.scale[r0:r1] if self.scale is not None else None
        return decode_slots(
            sp[r0 : r1 + 1], self.codes[lo:hi], self.values[lo:hi], sc, self.shape[1],
            source=source, row0=r0, slot0=lo, check_values=validate,
        )

    def to_csr(self, *, validate: bool = True, source: str | os.PathLike = "<matrix>") -> CSRMatrix:
        """Decode into CSR (exactly the encoded matrix for ``compressed``).

        Decodes :data:`PIECE_SLOTS` slots at a time; ``validate`` also checks
        the values (the column range and the row alignment are always checked).
        """
        sp = self.slotptr()
        m = self.shape[0]
        blocks = [
            self.decode_rows(r0, r1, validate=validate, source=source, slotptr=sp)
            for r0, r1 in (_pieces(sp - sp[0], PIECE_SLOTS) if m else [(0, 0)])
        ]
        if len(blocks) == 1:
            return blocks[0]
        indptr = [np.zeros(1, dtype=np.int64)]
        total = 0
        for b in blocks:
            indptr.append(b.indptr[1:] + total)
            total += b.nnz
        return CSRMatrix(
            np.concatenate(indptr),
            np.concatenate([b.indices for b in blocks]),
            np.concatenate([b.data for b in blocks]),
            (m, int(self.shape[1])),
        )

    def row_range(self, r0: int, r1: int) -> CompressedMatrix:
        """Rows ``[r0, r1)`` as a compressed matrix (slot arrays are views, the row pointer is rebuilt).

        Every row starts at a multiple of 4 slots, so the range keeps the alignment.
        """
        m = self.shape[0]
        if not 0 <= r0 <= r1 <= m:
            raise IndexError(f"row range [{r0}, {r1}) outside [0, {m}]")
        full = self.slotptr()
        sp = full[r0 : r1 + 1]
        lo, hi = int(sp[0] - full[0]), int(sp[-1] - full[0])
        codes = self.codes[lo:hi]
        nnz = int(np.count_nonzero(codes < self.code_high))
        scale = self.scale[r0:r1] if self.scale is not None else None
        return CompressedMatrix.from_arrays(
            sp - sp[0], codes, self.values[lo:hi], scale, (r1 - r0, self.shape[1]), nnz, self.code_bits
        )

    def validate(self, source: str | os.PathLike = "<matrix>") -> None:
        """Decode everything once; raise :class:`MatrixFormatError` on any fault (also a wrong ``nnz``)."""
        sp = self.slotptr()
        if len(sp) and (sp[0] != 0 or int(sp[-1]) != self.slots or (np.diff(sp) < 0).any()):
            raise MatrixFormatError(source, f"slot pointer is not non-decreasing from 0 to {self.slots}")
        check_alignment(sp, source)
        got = self.to_csr(source=source).nnz
        if got != self.nnz:
            raise MatrixFormatError(source, f"{got} elements decoded, expected nnz = {self.nnz}")

    def __repr__(self) -> str:
        m, n = self.shape
        return (
            f"CompressedMatrix({self.format}, {m} x {n}, nnz {self.nnz}, slots {self.slots}, "
            f"{self.code_bits}-bit codes, {self.bytes_per_nnz:.3f} B/nnz)"
        )


def csr_bytes_per_nnz(m: int, nnz: int) -> float:
    """Bytes per non-zero of the CSR form: 8 (int32 column + float32 value) plus the int64 row pointer's share."""
    return (8 * nnz + 8 * (m + 1)) / nnz if nnz else math.inf
