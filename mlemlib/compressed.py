"""The compressed system matrix: 8-bit column deltas, exact float32 values (host memory; NumPy and Numba).

A :class:`CompressedMatrix` holds the same matrix as a CSR
(:class:`mlemlib.matrix.CSRMatrix`) in about 5 bytes per non-zero instead of
8: each column index becomes its difference from the previous column of the
row (one byte), and the few differences that do not fit a byte travel in a
*marker* slot placed just before the element, whose value slot holds the
difference instead of a value. The layout (docs/formats.md, "The compressed
matrix"), for ``m`` rows and ``S`` slots (non-zeros plus markers):

==========  =====================  ==============================================
array       dtype, length          content
==========  =====================  ==============================================
``rowbase``  int64[m // 64 + 1]     slot offset of rows 0, 64, 128, ...
``rowoff``   uint32[m + 1]          slot offset of row r minus ``rowbase[r >> 6]``
``codes``    uint8[S]               per slot: 0..253 a column delta; 254, 255 markers
``values``   float32[S] / float16   per slot: the value, or a marker's delta bits
``scale``    float32[m]             ``compressed-f16`` only: power-of-two row scale
==========  =====================  ==============================================

Row ``r`` occupies slots ``[p(r), p(r+1))`` with ``p(r) = rowbase[r >> 6] +
rowoff[r]``. Decoding a row keeps a running column ``col`` (0 at the row's
start) and, slot by slot: code ``c <= 253`` adds ``c`` to ``col`` and the slot
is the element ``(col, value)``; code 255 adds the slot's value bits (read as
an unsigned integer: 32 bits, or 16 in ``compressed-f16``) and code 254 adds
those bits shifted left by 16 (``compressed-f16`` only), and the slot holds no
element. Every delta is >= 0 (columns are sorted within a row). The encoder
gives a delta of 254 or more to a marker (float32: one code-255 marker;
float16: one code-255 marker below 65,536, else a 254 marker with the high
16 bits and a 255 marker with the low 16 bits) and the element itself the
delta 0.

Because codes and values are aligned slot for slot, a GPU warp decodes 32
consecutive slots of a row with one coalesced byte load and one coalesced
value load per lane and an inclusive warp prefix sum of the deltas (plus the
running column of the previous 32 slots); rows are independent, so any row
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
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from mlemlib.errors import MatrixFormatError
from mlemlib.matrix import CSRMatrix, chunk_bounds, validate_csr_arrays

# mlemlib.formats (which reads and writes this format) imports this module: its
# helpers are imported inside the functions that use them.

#: Rows per block of the two-level row pointer (``rowbase`` has one entry per block).
ROW_SHIFT = 6
ROW_BLOCK = 1 << ROW_SHIFT
#: Largest column delta stored in a code byte.
MAX_DIRECT = 253
#: Marker codes: delta += bits << 16 (float16 slots), delta += bits.
CODE_HIGH = 254
CODE_MARK = 255
#: Matrix format names (``mlem convert --format``) -> value dtype.
VALUE_DTYPES = {"compressed": np.dtype(np.float32), "compressed-f16": np.dtype(np.float16)}
#: Largest slot offset within one row block (``rowoff`` is uint32).
MAX_BLOCK_SLOTS = (1 << 32) - 1
#: Slots decoded per piece by the whole-matrix helpers (bounds their scratch memory).
PIECE_SLOTS = 1 << 22


# --------------------------------------------------------------------------- Numba kernels
@njit(cache=True, nogil=True, inline="always")
def half_bits_to_float32(h):  # pragma: no cover - compiled
    """The float32 value of IEEE binary16 bits ``h`` (exact)."""
    h = np.int64(h)
    e = (h >> 10) & 0x1F
    f = h & 0x3FF
    if e == 0:
        v = math.ldexp(np.float64(f), -24)
    elif e == 31:
        v = np.inf if f == 0 else np.nan
    else:
        v = math.ldexp(np.float64(f + 1024), int(e) - 25)
    if h & 0x8000:
        v = -v
    return np.float32(v)


@njit(parallel=True, cache=True, nogil=True)
def _count_markers(indptr, indices, half, markers, unsorted):  # pragma: no cover - compiled
    """Markers each row needs (``markers[r]``); ``unsorted[r]`` = 1 + position of a decreasing column, else 0."""
    m = markers.shape[0]
    base = indptr[0]
    for r in prange(m):
        prev = np.int64(0)
        cnt = np.int64(0)
        bad = np.int64(0)
        s = indptr[r] - base
        for k in range(s, indptr[r + 1] - base):
            c = np.int64(indices[k])
            d = c - prev
            if d < 0:
                if bad == 0:
                    bad = k - s + 1
            elif d > 253:
                if half and d > 65535:
                    cnt += 2
                else:
                    cnt += 1
            prev = c
        markers[r] = cnt
        unsorted[r] = bad


@njit(parallel=True, cache=True, nogil=True)
def _fill(indptr, indices, bits_in, slotptr, half, codes, bits_out):  # pragma: no cover - compiled
    """Write codes and value slots of rows (``slotptr`` from :func:`_count_markers`, starting at 0)."""
    m = slotptr.shape[0] - 1
    base = indptr[0]
    for r in prange(m):
        p = slotptr[r]
        prev = np.int64(0)
        for k in range(indptr[r] - base, indptr[r + 1] - base):
            c = np.int64(indices[k])
            d = c - prev
            prev = c
            if d <= 253:
                codes[p] = d
            else:
                if half and d > 65535:
                    codes[p] = 254
                    bits_out[p] = d >> 16
                    p += 1
                    codes[p] = 255
                    bits_out[p] = d & 0xFFFF
                else:
                    codes[p] = 255
                    bits_out[p] = d
                p += 1
                codes[p] = 0
            bits_out[p] = bits_in[k]
            p += 1


@njit(parallel=True, cache=True, nogil=True)
def _row_scales(indptr, data, scale, scaled):  # pragma: no cover - compiled
    """Power-of-two row scales (``scale``) and the values divided by them in float64 (``scaled``)."""
    m = scale.shape[0]
    base = indptr[0]
    for r in prange(m):
        s = indptr[r] - base
        e = indptr[r + 1] - base
        vmax = np.float64(0.0)
        for k in range(s, e):
            v = np.float64(data[k])
            if v > vmax:
                vmax = v
        k2 = 0
        if vmax > 0:
            _, ex = math.frexp(vmax)  # vmax < 2**ex
            k2 = max(ex - 15, -149)
        scale[r] = np.float32(math.ldexp(1.0, k2))
        inv = math.ldexp(1.0, -k2)
        for k in range(s, e):
            scaled[k] = np.float64(data[k]) * inv


@njit(parallel=True, cache=True, nogil=True)
def _real_counts(slotptr, codes, counts):  # pragma: no cover - compiled
    """Elements (slots that are not markers) of each row."""
    m = counts.shape[0]
    base = slotptr[0]
    for r in prange(m):
        c = np.int64(0)
        for k in range(slotptr[r] - base, slotptr[r + 1] - base):
            if codes[k] < 254:
                c += 1
        counts[r] = c


@njit(parallel=True, cache=True, nogil=True)
def _decode(slotptr, codes, vf, vb, scale, half, n, indptr, cols, vals, bad_slot, bad_col):  # pragma: no cover
    """Decode rows into CSR arrays; a running column >= n stops the row and is reported.

    ``indptr`` (from :func:`_real_counts`) gives each row's output offset;
    ``bad_slot[r]`` is 1 + the slot (within the row) where the running column
    left ``[0, n)``, ``bad_col[r]`` that column, both 0 for a good row.
    """
    m = indptr.shape[0] - 1
    base = slotptr[0]
    for r in prange(m):
        q = indptr[r]
        col = np.int64(0)
        s = slotptr[r] - base
        bad_slot[r] = 0
        bad_col[r] = 0
        for k in range(s, slotptr[r + 1] - base):
            cd = codes[k]
            if cd < 254:
                col += cd
            elif cd == 254:
                col += np.int64(vb[k]) << 16
            else:
                col += np.int64(vb[k])
            if col >= n:
                bad_slot[r] = k - s + 1
                bad_col[r] = col
                break
            if cd < 254:
                cols[q] = col
                if half:
                    vals[q] = half_bits_to_float32(vb[k]) * scale[r]
                else:
                    vals[q] = vf[k]
                q += 1


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


# --------------------------------------------------------------------------- encode / decode
def _value_bits(values: np.ndarray) -> np.ndarray:
    """The slots' bits as unsigned integers (uint32 for float32, uint16 for float16), a view."""
    return values.view(np.uint32 if values.dtype == np.float32 else np.uint16)


def encode_csr(
    block: CSRMatrix, fmt: str = "compressed", *, source: str | os.PathLike = "<matrix>", row0: int = 0
) -> dict:
    """Encode CSR rows; return the arrays of :class:`CompressedMatrix` (``slotptr`` instead of the row pointer pair).

    Parameters
    ----------
    block
        Rows (``indptr`` may start anywhere), columns sorted within each row.
    fmt
        ``compressed`` or ``compressed-f16``.
    source, row0
        File and global number of the block's first row, named in error messages.

    Returns
    -------
    dict
        ``slotptr`` (int64, m+1, from 0), ``codes``, ``values``, ``scale`` (or None), ``nnz``.

    Raises
    ------
    MatrixFormatError
        Columns that decrease within a row (the format stores deltas >= 0).
    """
    if fmt not in VALUE_DTYPES:
        raise ValueError(f"unknown compressed format {fmt!r}, expected one of {', '.join(VALUE_DTYPES)}")
    half = fmt == "compressed-f16"
    m = block.shape[0]
    indptr = np.ascontiguousarray(block.indptr, dtype=np.int64)
    indices = np.ascontiguousarray(block.indices, dtype=np.int32)
    data = np.ascontiguousarray(block.data, dtype=np.float32)
    markers = np.empty(m, dtype=np.int64)
    unsorted = np.empty(m, dtype=np.int64)
    _count_markers(indptr, indices, half, markers, unsorted)
    if m and unsorted.any():
        r = int(np.argmax(unsorted > 0))
        k = int(indptr[r] - indptr[0] + unsorted[r] - 1)
        raise MatrixFormatError(
            source,
            f"columns of row {row0 + r} are not sorted (column {int(indices[k])} after {int(indices[k - 1])}); "
            "the compressed format stores sorted rows: sort the rows' columns first",
        )
    lens = np.diff(indptr)
    slotptr = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(lens + markers, out=slotptr[1:])
    slots = int(slotptr[-1])
    codes = np.empty(slots, dtype=np.uint8)
    values = np.empty(slots, dtype=VALUE_DTYPES[fmt])
    scale = None
    if half:
        scale = np.empty(m, dtype=np.float32)
        scaled = np.empty(len(data), dtype=np.float64)
        _row_scales(indptr, data, scale, scaled)
        bits_in = scaled.astype(np.float16).view(np.uint16)  # round to nearest even
        del scaled
    else:
        bits_in = data.view(np.uint32)
    _fill(indptr, indices, bits_in, slotptr, half, codes, _value_bits(values))
    return {"slotptr": slotptr, "codes": codes, "values": values, "scale": scale, "nnz": int(lens.sum())}


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
) -> CSRMatrix:
    """Decode encoded rows into a :class:`CSRMatrix`, validating as it goes.

    Parameters
    ----------
    slotptr
        int64 slot pointer of the rows (may start anywhere; ``codes``/``values`` start at ``slotptr[0]``).
    codes, values, scale
        The rows' slots (and row scales for float16 values).
    n
        Columns: every running column must stay below ``n``.
    source, row0, slot0
        File, first row and first slot in the file, for messages.
    check_values
        Also reject non-finite or negative values (and row scales that are not
        finite and positive).

    Raises
    ------
    MatrixFormatError
        A delta stream that leaves ``[0, n)``, a bad value or row scale.
    """
    slotptr = np.ascontiguousarray(slotptr, dtype=np.int64)
    m = len(slotptr) - 1
    half = values.dtype == np.float16
    if check_values:
        check_encoded_values(slotptr, codes, values, scale, source, row0=row0, slot0=slot0)
    counts = np.empty(m, dtype=np.int64)
    _real_counts(slotptr, codes, counts)
    indptr = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    nnz = int(indptr[-1])
    cols = np.empty(nnz, dtype=np.int32)
    vals = np.empty(nnz, dtype=np.float32)
    bad_slot = np.empty(m, dtype=np.int64)
    bad_col = np.empty(m, dtype=np.int64)
    vf = values if not half else np.empty(0, dtype=np.float32)
    sc = scale if half else np.empty(0, dtype=np.float32)
    _decode(slotptr, codes, vf, _value_bits(values), sc, half, int(n), indptr, cols, vals, bad_slot, bad_col)
    if m and bad_slot.any():
        r = int(np.argmax(bad_slot > 0))
        k = int(slotptr[r] - slotptr[0] + bad_slot[r] - 1)
        raise MatrixFormatError(
            source,
            f"row {row0 + r}: the column deltas decode to column {int(bad_col[r])} at slot {slot0 + k}, "
            f"outside [0, {n})",
        )
    return CSRMatrix(indptr, cols, vals, (m, int(n)))


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
    """Raise :class:`MatrixFormatError` unless every element's value is finite and >= 0 (and every row scale finite, > 0)."""
    if values.dtype == np.float16:
        if scale is None or len(scale) != len(slotptr) - 1:
            raise MatrixFormatError(source, "float16 values without one row scale per row")
        if len(scale):
            ok = np.isfinite(scale) & (scale > 0)
            if not ok.all():
                r = int(np.argmax(~ok))
                raise MatrixFormatError(
                    source, f"row scale {float(scale[r])!r} of row {row0 + r} is not a finite positive number"
                )
    if len(codes) == 0:
        return
    real = codes < CODE_HIGH
    v = values if values.dtype == np.float32 else values.astype(np.float32)
    bad = real & ~(v >= 0)  # NaN, negative
    bad |= real & np.isinf(v)
    if bad.any():
        k = int(np.argmax(bad))
        r = int(np.searchsorted(slotptr - slotptr[0], k, side="right")) - 1
        what = "non-finite" if not np.isfinite(v[k]) else "negative"
        raise MatrixFormatError(source, f"{what} value {float(v[k])!r} at slot {slot0 + k} (row {row0 + r})")


# --------------------------------------------------------------------------- the type
@dataclass
class CompressedMatrix:
    """A compressed matrix (or row block) in host memory; see the module docstring for the layout.

    Build with :meth:`from_csr`; :meth:`to_csr` gives the exact CSR back
    (``compressed``) or the CSR of the float16-rounded values
    (``compressed-f16``). Arrays are NumPy; ``values`` is float32 or float16.

    Attributes
    ----------
    rowbase, rowoff, codes, values, scale
        The encoded arrays (``scale`` None for float32 values).
    shape : tuple[int, int]
    nnz : int
        Stored elements (markers not counted).
    """

    rowbase: np.ndarray
    rowoff: np.ndarray
    codes: np.ndarray
    values: np.ndarray
    scale: np.ndarray | None
    shape: tuple[int, int]
    nnz: int

    def __post_init__(self) -> None:
        self.shape = (int(self.shape[0]), int(self.shape[1]))
        self.nnz = int(self.nnz)
        m = self.shape[0]
        if self.values.dtype not in (np.float32, np.float16):
            raise TypeError(f"values must be float32 or float16, not {self.values.dtype}")
        for name, dtype in (("rowbase", np.int64), ("rowoff", np.uint32), ("codes", np.uint8)):
            if getattr(self, name).dtype != dtype:
                raise TypeError(f"{name} must be {np.dtype(dtype).name}, not {getattr(self, name).dtype}")
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
            raise ValueError("a row scale is needed exactly for float16 values")

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
    ) -> CompressedMatrix:
        """Build from a slot pointer (int64, from 0) and slot arrays (see :func:`encode_csr`)."""
        rowbase, rowoff = pack_rowptr(slotptr)
        return cls(rowbase, rowoff, codes, values, scale, shape, nnz)

    @classmethod
    def from_csr(
        cls,
        a: CSRMatrix,
        fmt: str = "compressed",
        *,
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
            ``compressed`` (lossless) or ``compressed-f16`` (lossy).
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
        enc = encode_csr(a, fmt, source=source, row0=row0)
        return cls.from_arrays(enc["slotptr"], enc["codes"], enc["values"], enc["scale"], a.shape, enc["nnz"])

    @staticmethod
    def concatenate(parts: list[CompressedMatrix]) -> CompressedMatrix:
        """Stack row blocks (encoded independently) into one matrix."""
        if not parts:
            raise ValueError("nothing to concatenate")
        n = parts[0].shape[1]
        half = parts[0].values.dtype == np.float16
        for p in parts:
            if p.shape[1] != n or (p.values.dtype == np.float16) != half:
                raise ValueError("row blocks differ in columns or value type")
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
        return CompressedMatrix.from_arrays(slotptr, codes, values, scale, (m, n), sum(p.nnz for p in parts))

    # -- facts
    @property
    def format(self) -> str:
        """``compressed`` or ``compressed-f16``."""
        return "compressed-f16" if self.values.dtype == np.float16 else "compressed"

    @property
    def lossless(self) -> bool:
        """True for float32 values (the exact matrix)."""
        return self.values.dtype == np.float32

    @property
    def slots(self) -> int:
        """Stored slots: non-zeros plus markers."""
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

    def csr_indptr(self) -> np.ndarray:
        """The CSR row pointer of the matrix (elements, not slots), from 0."""
        sp = self.slotptr()
        counts = np.empty(self.shape[0], dtype=np.int64)
        _real_counts(sp, self.codes, counts)
        out = np.zeros(self.shape[0] + 1, dtype=np.int64)
        np.cumsum(counts, out=out[1:])
        return out

    # -- conversions
    def to_csr(self, *, validate: bool = True, source: str | os.PathLike = "<matrix>") -> CSRMatrix:
        """Decode into CSR (exactly the encoded matrix for ``compressed``).

        Decodes :data:`PIECE_SLOTS` slots at a time; ``validate`` also checks
        the values (the column range is always checked).
        """

        sp = self.slotptr()
        m, n = self.shape
        blocks = []
        for r0, r1 in chunk_bounds(sp, PIECE_SLOTS) if m else [(0, 0)]:
            lo, hi = int(sp[r0] - sp[0]), int(sp[r1] - sp[0])
            sc = self.scale[r0:r1] if self.scale is not None else None
            blocks.append(
                decode_slots(
                    sp[r0 : r1 + 1], self.codes[lo:hi], self.values[lo:hi], sc, n,
                    source=source, row0=r0, slot0=lo, check_values=validate,
                )
            )
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
            (m, n),
        )

    def row_range(self, r0: int, r1: int) -> CompressedMatrix:
        """Rows ``[r0, r1)`` as a compressed matrix (slot arrays are views, the row pointer is rebuilt)."""
        m = self.shape[0]
        if not 0 <= r0 <= r1 <= m:
            raise IndexError(f"row range [{r0}, {r1}) outside [0, {m}]")
        full = self.slotptr()
        sp = full[r0 : r1 + 1]
        lo, hi = int(sp[0] - full[0]), int(sp[-1] - full[0])
        codes = self.codes[lo:hi]
        nnz = int(np.count_nonzero(codes < CODE_HIGH))
        scale = self.scale[r0:r1] if self.scale is not None else None
        return CompressedMatrix.from_arrays(sp - sp[0], codes, self.values[lo:hi], scale, (r1 - r0, self.shape[1]), nnz)

    def validate(self, source: str | os.PathLike = "<matrix>") -> None:
        """Decode everything once; raise :class:`MatrixFormatError` on any fault (also a wrong ``nnz``)."""
        sp = self.slotptr()
        if len(sp) and (sp[0] != 0 or int(sp[-1]) != self.slots or (np.diff(sp) < 0).any()):
            raise MatrixFormatError(source, f"slot pointer is not non-decreasing from 0 to {self.slots}")
        got = self.to_csr(source=source).nnz
        if got != self.nnz:
            raise MatrixFormatError(source, f"{got} elements decoded, expected nnz = {self.nnz}")

    def __repr__(self) -> str:
        m, n = self.shape
        return (
            f"CompressedMatrix({self.format}, {m} x {n}, nnz {self.nnz}, slots {self.slots}, "
            f"{self.bytes_per_nnz:.3f} B/nnz)"
        )


def csr_bytes_per_nnz(m: int, nnz: int) -> float:
    """Bytes per non-zero of the CSR form: 8 (int32 column + float32 value) plus the int64 row pointer's share."""
    return (8 * nnz + 8 * (m + 1)) / nnz if nnz else math.inf
