"""Tests of the compressed matrix format (layout version 2): encoding, container, validation, CLI, CPU kernels (and GPU ones on a GPU).

The encoding is checked against an independent per-row Python encoder
(:func:`encode_by_hand`) written from the layout in docs/formats.md (8- and
16-bit codes, rows padded to 4 slots), the CPU kernels against float64 SciPy
products and against the CSR Numba kernels (bit for bit where the summation
order is the same).
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib.backends import _compressed_cpu as cc
from mlemlib.backends import cpu
from mlemlib.cli import main
from mlemlib.compressed import (
    ROW_BLOCK,
    SLOT_ALIGN,
    CompressedMatrix,
    check_slots,
    choose_code_bits,
    code_high,
    code_mark,
    csr_bytes_per_nnz,
    encoded_nbytes,
    max_direct,
    pack_rowptr,
    rowbase_length,
    unpack_rowptr,
)
from mlemlib.errors import MatrixFormatError
from mlemlib.formats import (
    CompressedH5,
    CompressedH5Writer,
    MatrixH5,
    convert,
    info,
    open_matrix,
    read_compressed_h5,
    sample_code_bits,
    write_compressed_h5,
    write_matrix_h5,
)
from mlemlib.formats.h5 import checksum_arrays
from mlemlib.matrix import CSRMatrix

FORMATS = ("compressed", "compressed-f16", "compressed-u16")
CODE_BITS = (None, 8, 16)  # None: the encoder chooses


# --------------------------------------------------------------------------- matrices
def random_csr(m: int, n: int, seed: int = 0, *, density: float = 0.05, empty_every: int = 5) -> CSRMatrix:
    """A random matrix with empty rows, rows of one element, a long row and column jumps of every size."""
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(m):
        if empty_every and r % empty_every == 1:
            k = 0
        elif r % 7 == 3:
            k = 1
        elif r == m // 2:
            k = min(n, 1500)  # a long row: many trips of a warp
        else:
            k = int(rng.binomial(n, density))
        cols = np.sort(rng.choice(n, size=k, replace=False)) if k else np.zeros(0, np.int64)
        rows.append(cols)
    indptr = np.zeros(m + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(c) for c in rows])
    indices = np.concatenate(rows).astype(np.int32) if m else np.zeros(0, np.int32)
    data = rng.random(len(indices)).astype(np.float32) * np.float32(3.0)
    data[::17] = 0.0  # explicit zeros are elements too
    return CSRMatrix(indptr, indices, data, (m, n))


def jumpy_csr() -> CSRMatrix:
    """Rows whose deltas need markers: 253/254 at the edge, 16-bit, above 16 bits, near 2**31; a row starting at 0."""
    n = 2**31 - 1
    rows = [
        [0, 253, 507, 508],  # 253 direct, 254 a marker
        [254],  # first column needs a marker
        [5, 65535 + 5, 65536 + 65535 + 5, 2 * 65536 + 65535 + 5 + 65536],  # 16-bit and 17-bit deltas
        [],
        [n - 1],  # the largest column: a 31-bit delta
        [0, 1, 2, 3, 2**20, 2**30, n - 2, n - 1],
        [7],
    ]
    indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(r) for r in rows])
    indices = np.array([c for r in rows for c in r], dtype=np.int64).astype(np.int32)
    data = np.linspace(0.5, 7.0, len(indices)).astype(np.float32)
    return CSRMatrix(indptr, indices, data, (len(rows), n))


def far_csr(m: int = 40, k: int = 400, seed: int = 0, lo: int = 300, hi: int = 60000) -> CSRMatrix:
    """Rows of ``k`` elements whose column deltas lie in ``[lo, hi]`` (rows of A^T: a voxel's LORs)."""
    rng = np.random.default_rng(seed)
    deltas = rng.integers(lo, hi + 1, size=(m, k))
    cols = np.cumsum(deltas, axis=1)
    n = int(cols.max()) + 1
    indptr = np.arange(m + 1, dtype=np.int64) * k
    data = rng.random(m * k).astype(np.float32) + np.float32(0.01)
    return CSRMatrix(indptr, cols.reshape(-1).astype(np.int32), data, (m, n))


def hand_row_values(vals: np.ndarray, fmt: str) -> tuple[np.float32, np.ndarray]:
    """A row's scale and 16-bit value bits as docs/formats.md states them (compressed-f16, compressed-u16)."""
    vmax = float(vals.max()) if len(vals) else 0.0
    if fmt == "compressed-f16":
        k = max(np.frexp(vmax)[1] - 15, -149) if vmax > 0 else 0
        return np.float32(2.0**k), (vals / 2.0**k).astype(np.float16).view(np.uint16)
    sc = np.float32(vmax / 65535) if vmax > 0 else np.float32(1)  # the row's grid: its largest value at 65,535
    if sc == 0:
        sc = np.float32(2.0**-149)
    q = np.minimum(np.rint(vals / np.float64(sc)), 65535)
    return sc, q.astype(np.uint16)


def encode_by_hand(a: CSRMatrix, fmt: str, code_bits: int | None = 8):
    """The layout of docs/formats.md, row by row in plain Python: (slotptr, codes, value bits, scale, code_bits).

    ``code_bits`` None encodes with 8 and with 16 bits and keeps the smaller (8 on a tie).
    """
    half = fmt != "compressed"  # 16-bit value slots
    if code_bits is None:
        e8, e16 = encode_by_hand(a, fmt, 8), encode_by_hand(a, fmt, 16)
        vb = 2 if half else 4
        return e16 if len(e16[1]) * (2 + vb) < len(e8[1]) * (1 + vb) else e8
    direct, high, mark = 2**code_bits - 3, 2**code_bits - 2, 2**code_bits - 1
    codes, bits, slotptr, scale = [], [], [0], []
    for r in range(a.shape[0]):
        lo, hi = int(a.indptr[r]), int(a.indptr[r + 1])
        vals = a.data[lo:hi].astype(np.float64)
        if half:
            sc, q = hand_row_values(vals, fmt)
            scale.append(sc)
        else:
            q = a.data[lo:hi].view(np.uint32)
        prev = 0
        for j, col in enumerate(a.indices[lo:hi]):
            d = int(col) - prev
            prev = int(col)
            if d <= direct:
                codes.append(d)
            else:
                if half and d > 65535:
                    codes += [high, mark]
                    bits += [d >> 16, d & 0xFFFF]
                else:
                    codes.append(mark)
                    bits.append(d)
                codes.append(0)
            bits.append(int(q[j]))
        while len(codes) % 4:  # pads: markers of delta 0
            codes.append(mark)
            bits.append(0)
        slotptr.append(len(codes))
    dtype = np.uint8 if code_bits == 8 else np.uint16
    return (np.array(slotptr), np.array(codes, dtype=dtype), np.array(bits, dtype=np.uint64), np.array(scale),
            code_bits)


def assert_csr_equal(x: CSRMatrix, y: CSRMatrix) -> None:
    assert x.shape == y.shape
    np.testing.assert_array_equal(x.indptr - x.indptr[0], y.indptr - y.indptr[0])
    np.testing.assert_array_equal(x.indices, y.indices)
    np.testing.assert_array_equal(x.data.view(np.uint32), y.data.view(np.uint32))


def stored_reference(a: CSRMatrix, fmt: str) -> CSRMatrix:
    """The matrix a format stores: ``a`` itself (compressed), or its values rounded to 16 bits relative to a
    power-of-two row scale (compressed-f16: 11 significant bits; compressed-u16: a 16-bit integer)."""
    if fmt == "compressed":
        return a
    out = a.data.astype(np.float64).copy()
    for r in range(a.shape[0]):
        lo, hi = int(a.indptr[r]), int(a.indptr[r + 1])
        if hi > lo:
            sc, q = hand_row_values(a.data[lo:hi].astype(np.float64), fmt)
            if fmt == "compressed-f16":  # float16 times a power of two: exact
                out[lo:hi] = q.view(np.float16).astype(np.float64) * np.float64(sc)
            else:  # the integer times the row scale, rounded once to float32
                out[lo:hi] = q.astype(np.float32) * sc
    return CSRMatrix(a.indptr, a.indices, out.astype(np.float32), a.shape)


MATRICES = {
    "random": lambda: random_csr(150, 700, 1),
    "blocks": lambda: random_csr(ROW_BLOCK * 3, 300, 2, density=0.2),  # m a multiple of 64
    "one_row": lambda: random_csr(1, 2000, 3, empty_every=0),
    "jumpy": jumpy_csr,
    "empty_rows": lambda: CSRMatrix(np.zeros(70, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32), (69, 5)),
    "no_rows": lambda: CSRMatrix(np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32), (0, 5)),
}


# --------------------------------------------------------------------------- encoding
MATRICES["far"] = far_csr  # deltas 300..60000: 16-bit codes


@pytest.mark.parametrize("code_bits", CODE_BITS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", sorted(MATRICES))
def test_encoding_matches_hand_encoder_and_round_trips(name, fmt, code_bits):
    a = MATRICES[name]()
    c = CompressedMatrix.from_csr(a, fmt, code_bits=code_bits)
    sp_, codes, bits, scale, bits_chosen = encode_by_hand(a, fmt, code_bits)
    assert c.code_bits == bits_chosen and c.codes.dtype == codes.dtype
    np.testing.assert_array_equal(c.slotptr(), sp_)
    np.testing.assert_array_equal(c.codes, codes)
    np.testing.assert_array_equal(c.value_bits().astype(np.uint64), bits)
    if fmt != "compressed":
        np.testing.assert_array_equal(c.scale, scale.astype(np.float32))
    assert c.nnz == a.nnz and c.shape == a.shape and c.lossless == (fmt == "compressed") and c.format == fmt
    back = c.to_csr()
    assert_csr_equal(back, stored_reference(a, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", sorted(MATRICES))
def test_decoded_values_alone_equal_the_decoded_matrix(name, fmt):
    """The values without the columns (the generator's checksum input) are the decoder's bit for bit, for a
    row block whose row pointer starts anywhere; a row pointer of another matrix is refused."""
    a = MATRICES[name]()
    c = CompressedMatrix.from_csr(a, fmt, code_bits=16 if name == "far" else None)
    ref = stored_reference(a, fmt).data
    np.testing.assert_array_equal(c.decoded_values().view(np.uint32), ref.view(np.uint32))
    np.testing.assert_array_equal(c.decoded_values(a.indptr + 12345).view(np.uint32), ref.view(np.uint32))
    with pytest.raises(ValueError, match="indptr of"):
        c.decoded_values(np.zeros(a.shape[0] + 2, dtype=np.int64))


@pytest.mark.parametrize("fmt", FORMATS)
def test_to_csr_decodes_piece_by_piece(monkeypatch, fmt):
    # to_csr decodes PIECE_SLOTS slots at a time: a matrix of many pieces is joined back into the same CSR
    # as one piece gives (its shape too).
    import mlemlib.compressed as cm

    a = random_csr(300, 70, 5)
    c = CompressedMatrix.from_csr(a, fmt)
    whole = c.to_csr()
    monkeypatch.setattr(cm, "PIECE_SLOTS", 64)
    pieces = c.to_csr()
    assert pieces.shape == a.shape == whole.shape
    assert_csr_equal(pieces, whole)
    assert_csr_equal(pieces, stored_reference(a, fmt))


def test_f16_relative_error_bound():
    a = random_csr(120, 500, 4)
    a.data[:] = np.random.default_rng(0).lognormal(0, 2, a.nnz).astype(np.float32)  # 4 to 7 decades per row
    back = CompressedMatrix.from_csr(a, "compressed-f16").to_csr()
    nz = a.data > 0
    rel = np.abs(back.data[nz].astype(np.float64) - a.data[nz]) / a.data[nz]
    assert rel.max() <= 2.0**-11 * (1 + 1e-6)
    assert np.all(back.data[~nz] == 0)


def test_u16_absolute_error_bound_per_row():
    """compressed-u16: every value within half a step (and the decode's float32 rounding) of its row's grid,
    the step max(row) / 65,535; the row's largest value stored as 65,535; the integers recovered from the
    decoded values and the row scales."""
    from mlemlib.chunked import half_rows

    a = random_csr(120, 500, 4)
    a.data[:] = np.random.default_rng(0).lognormal(0, 2, a.nnz).astype(np.float32)
    c = CompressedMatrix.from_csr(a, "compressed-u16")
    back = c.to_csr()
    lengths = np.diff(a.indptr)
    step = np.repeat(c.scale.astype(np.float64), lengths)
    rowmax = np.array([a.data[a.indptr[r]:a.indptr[r + 1]].max(initial=0) for r in range(a.shape[0])])
    err = np.abs(back.data.astype(np.float64) - a.data)
    assert np.all(err <= step / 2 + np.abs(a.data) * 2.0**-23)
    np.testing.assert_allclose(c.scale[rowmax > 0], rowmax[rowmax > 0] / 65535, rtol=2**-23)
    nz = lengths > 0
    assert np.all(c.values[c.codes < c.code_high].reshape(-1)[np.cumsum(lengths)[nz] - 1] <= 65535)
    scale, q = half_rows(back, "compressed-u16", scale=c.scale)
    np.testing.assert_array_equal(q, c.values[c.codes < c.code_high])
    tiny = CSRMatrix(np.array([0, 2], np.int64), np.array([0, 3], np.int32),
                     np.array([1e-44, 0.0], np.float32), (1, 4))  # max / 65535 rounds to 0: the smallest scale
    t = CompressedMatrix.from_csr(tiny, "compressed-u16")
    assert t.scale[0] == np.float32(2.0**-149) and list(t.to_csr().data) == [np.float32(1e-44), 0.0]


def test_constants_of_both_code_widths():
    assert (max_direct(8), code_high(8), code_mark(8)) == (253, 254, 255)
    assert (max_direct(16), code_high(16), code_mark(16)) == (65533, 65534, 65535)
    assert SLOT_ALIGN == 4
    c = CompressedMatrix.from_csr(random_csr(10, 50, 0), code_bits=16)
    assert (c.max_direct, c.code_high, c.code_mark, c.codes.dtype) == (65533, 65534, 65535, np.uint16)


@pytest.mark.parametrize("code_bits", [8, 16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_padding_invariants(fmt, code_bits):
    """Every row starts at a multiple of 4 slots and holds a multiple of 4; pads close a row, empty rows have none."""
    a = random_csr(130, 900, 20)
    c = CompressedMatrix.from_csr(a, fmt, code_bits=code_bits)
    slotptr = c.slotptr()
    assert np.all(slotptr % 4 == 0) and np.all(c.rowbase % 4 == 0) and np.all(c.rowoff % 4 == 0)
    per_row = np.diff(slotptr)
    lens = np.diff(a.indptr)
    assert np.all(per_row[lens == 0] == 0) and np.all(per_row[lens > 0] >= 4)
    bits = c.value_bits()
    real = c.codes < c.code_high
    counts = np.add.reduceat(real.astype(np.int64), slotptr[:-1][per_row > 0]) if c.slots else np.zeros(0)
    np.testing.assert_array_equal(counts, lens[lens > 0])
    pads_total = 0
    for r in np.flatnonzero(per_row):
        row = slice(slotptr[r], slotptr[r + 1])
        last = int(np.flatnonzero(real[row])[-1])  # the row's last element; after it only pads
        tail_codes, tail_bits = c.codes[row][last + 1 :], bits[row][last + 1 :]
        assert len(tail_codes) < 4
        assert np.all(tail_codes == c.code_mark) and np.all(tail_bits == 0)
        pads_total += len(tail_codes)
    deltas = np.diff(np.concatenate([[0], a.indices.astype(np.int64)]))
    deltas[a.indptr[:-1][lens > 0]] = a.indices[a.indptr[:-1][lens > 0]]  # each row starts from column 0
    markers = np.count_nonzero(deltas > c.max_direct)
    if fmt != "compressed":
        markers += np.count_nonzero(deltas > 65535)
    assert pads_total == c.slots - c.nnz - markers
    assert_csr_equal(c.to_csr(), stored_reference(a, fmt))
    c.validate()


def test_code_bits_chosen_per_matrix():
    """Deltas mostly 300..60000 (rows of A^T) take 16-bit codes, about 6 bytes per non-zero; small deltas take 8."""
    far = far_csr(60, 500, 1)
    c = CompressedMatrix.from_csr(far)
    assert c.code_bits == 16 and choose_code_bits(far) == 16
    assert c.slots - c.nnz < 0.01 * c.nnz  # no markers (deltas <= 65533), few pads
    assert 6.0 <= c.bytes_per_nnz < 6.1
    c8 = CompressedMatrix.from_csr(far, code_bits=8)  # a marker for every element: 10 bytes per non-zero
    assert c8.code_bits == 8 and c8.codes.dtype == np.uint8 and 10.0 <= c8.bytes_per_nnz < 10.1
    nb = encoded_nbytes(far)
    assert nb == {8: c8.nbytes, 16: c.nbytes}
    h = CompressedMatrix.from_csr(far, "compressed-f16")
    assert h.code_bits == 16 and 4.0 <= h.bytes_per_nnz < 4.15
    assert encoded_nbytes(far, "compressed-f16")[16] == h.nbytes
    near = random_csr(200, 400, 6, density=0.3)
    c = CompressedMatrix.from_csr(near)
    assert c.code_bits == 8 and choose_code_bits(near) == 8 and c.codes.dtype == np.uint8
    assert c.nbytes < CompressedMatrix.from_csr(near, code_bits=16).nbytes
    empty = MATRICES["empty_rows"]()
    assert CompressedMatrix.from_csr(empty).code_bits == 8  # a tie: 8
    with pytest.raises(ValueError, match=r"code_bits must be 8 or 16, not 12"):
        CompressedMatrix.from_csr(near, code_bits=12)


@pytest.mark.parametrize("fmt", FORMATS)
def test_with_code_bits_keeps_every_bit(fmt):
    a = random_csr(150, 70000, 21, density=0.001)  # a mix of small and 16-bit deltas
    a = CSRMatrix(a.indptr, a.indices, a.data * np.float32(1e3), a.shape)
    for src in (8, 16):
        c = CompressedMatrix.from_csr(a, fmt, code_bits=src)
        for dst in (8, 16):
            t = c.with_code_bits(dst)
            direct = CompressedMatrix.from_csr(a, fmt, code_bits=dst)
            assert t.code_bits == dst and (t is c) == (src == dst)
            for field in ("rowbase", "rowoff", "codes"):
                np.testing.assert_array_equal(getattr(t, field), getattr(direct, field))
            np.testing.assert_array_equal(t.value_bits(), direct.value_bits())
            if fmt != "compressed":
                np.testing.assert_array_equal(t.scale, c.scale)


def test_codes_dtype_must_match_code_bits():
    c = CompressedMatrix.from_csr(random_csr(10, 50, 0))
    with pytest.raises(TypeError, match=r"codes must be uint16 \(code_bits = 16\), not uint8"):
        CompressedMatrix(c.rowbase, c.rowoff, c.codes, c.values, None, c.shape, c.nnz, 16)
    with pytest.raises(TypeError, match=r"codes must be uint8 or uint16, not int16"):
        CompressedMatrix(c.rowbase, c.rowoff, c.codes.astype(np.int16), c.values, None, c.shape, c.nnz)
    assert CompressedMatrix(c.rowbase, c.rowoff, c.codes, c.values, None, c.shape, c.nnz).code_bits == 8


def test_misaligned_rows_and_high_markers_in_float32_are_refused():
    a = random_csr(20, 300, 22)
    c = CompressedMatrix.from_csr(a)
    sp_ = c.slotptr()
    r = int(np.flatnonzero(np.diff(sp_))[0]) + 1  # the row after the first non-empty one
    bad = sp_.copy()
    bad[r] -= 1
    codes = np.delete(c.codes, bad[r])  # one slot fewer, so the pointer still ends at the slot count
    vals = np.delete(c.values, bad[r])
    bad[r + 1 :] -= 1
    m = CompressedMatrix.from_arrays(bad, codes, vals, None, c.shape, c.nnz)
    with pytest.raises(MatrixFormatError, match=rf"<matrix>: slot offset {int(bad[r])} of row {r} is not a multiple of 4"):
        m.to_csr()
    with pytest.raises(MatrixFormatError, match=r"is not a multiple of 4"):
        m.validate()
    pad = int(np.flatnonzero((c.codes == 255) & (c.value_bits() == 0))[0])
    codes = c.codes.copy()
    codes[pad] = 254
    h = CompressedMatrix(c.rowbase, c.rowoff, codes, c.values, None, c.shape, c.nnz)
    with pytest.raises(MatrixFormatError, match=rf"high marker \(code 254\) at slot {pad} in a float32 matrix"):
        h.to_csr()


def test_row_blocks_encode_independently_and_concatenate():
    a = random_csr(300, 400, 5)
    for fmt in FORMATS:
        for code_bits in (8, 16):
            whole = CompressedMatrix.from_csr(a, fmt, code_bits=code_bits)
            cuts = [0, 1, 64, 65, 200, 300]
            blocks = [
                CSRMatrix(a.indptr[r0 : r1 + 1], a.indices[a.indptr[r0] : a.indptr[r1]],
                          a.data[a.indptr[r0] : a.indptr[r1]], (r1 - r0, a.shape[1]))
                for r0, r1 in zip(cuts[:-1], cuts[1:])
            ]
            parts = [CompressedMatrix.from_csr(b, fmt, code_bits=code_bits) for b in blocks]
            joined = CompressedMatrix.concatenate(parts)
            mixed = [CompressedMatrix.from_csr(b, fmt, code_bits=(8, 16)[i % 2]) for i, b in enumerate(blocks)]
            with pytest.raises(ValueError, match=r"row blocks differ in code_bits \(\[8, 16\]\)"):
                CompressedMatrix.concatenate(mixed)
            for j in (joined, CompressedMatrix.concatenate(mixed, code_bits=code_bits)):
                assert j.code_bits == code_bits
                for field in ("rowbase", "rowoff", "codes"):
                    np.testing.assert_array_equal(getattr(j, field), getattr(whole, field))
                np.testing.assert_array_equal(j.value_bits(), whole.value_bits())
            ref = whole.to_csr()
            for r0, r1 in [(0, 0), (0, 300), (63, 64), (64, 190), (299, 300), (5, 5), (7, 131)]:
                part = whole.row_range(r0, r1)
                assert part.code_bits == code_bits and np.all(part.slotptr() % 4 == 0)
                lo, hi = ref.indptr[r0], ref.indptr[r1]
                assert_csr_equal(part.to_csr(), CSRMatrix(ref.indptr[r0 : r1 + 1] - lo, ref.indices[lo:hi],
                                                          ref.data[lo:hi], (r1 - r0, a.shape[1])))
                assert part.nnz == hi - lo
                part.validate()


@pytest.mark.parametrize("code_bits", [8, 16])
def test_bytes_per_nnz_accounting(code_bits):
    a = random_csr(200, 400, 6, density=0.3)
    c = CompressedMatrix.from_csr(a, code_bits=code_bits)
    m = a.shape[0]
    cb = code_bits // 8
    assert c.nbytes == 8 * rowbase_length(m) + 4 * (m + 1) + (cb + 4) * c.slots
    assert c.bytes_per_nnz == pytest.approx(c.nbytes / a.nnz)
    assert c.bytes_per_nnz < 5.5 + (cb - 1) < csr_bytes_per_nnz(m, a.nnz)
    h = CompressedMatrix.from_csr(a, "compressed-f16", code_bits=code_bits)
    assert h.nbytes == 8 * rowbase_length(m) + 4 * (m + 1) + (cb + 2) * h.slots + 4 * m
    assert csr_bytes_per_nnz(m, a.nnz) == pytest.approx(8 + 8 * (m + 1) / a.nnz)


def test_bytes_per_nnz_on_scanner_rows():
    """Tube-of-response rows of the small preset (and their transpose): under CSR's 8 bytes per non-zero."""
    from mlemlib.scanner.system import trace_rows

    a = trace_rows("small", np.arange(0, 36864, 7))
    c = CompressedMatrix.from_csr(a)
    assert c.code_bits == 8 and c.bytes_per_nnz < 5.9
    assert CompressedMatrix.from_csr(a, "compressed-f16").bytes_per_nnz < 3.9
    assert_csr_equal(c.to_csr(), a)
    t = CSRMatrix.from_scipy(a.to_scipy().T.tocsr())
    ct = CompressedMatrix.from_csr(t)
    assert ct.bytes_per_nnz < 8 and ct.nbytes == min(encoded_nbytes(t).values())
    assert_csr_equal(ct.to_csr(), t)


def test_unsorted_rows_are_refused():
    a = CSRMatrix([0, 2, 4], [1, 3, 5, 2], [1, 1, 1, 1], (2, 8))
    with pytest.raises(MatrixFormatError, match=r"<matrix>: columns of row 1 are not sorted \(column 2 after 5\)"):
        CompressedMatrix.from_csr(a)


def test_row_pointer_packing_and_64_bit_offsets():
    sp_ = np.array([0, 3, 3, 10], dtype=np.int64)
    rb, ro = pack_rowptr(sp_)
    assert rb.tolist() == [0] and ro.tolist() == [0, 3, 3, 10] and ro.dtype == np.uint32
    big = np.arange(0, 200, dtype=np.int64) * (2**26) + 2**33  # slots beyond 2**32 in absolute terms
    big -= big[0]
    rb, ro = pack_rowptr(big)
    np.testing.assert_array_equal(unpack_rowptr(rb, ro), big)
    np.testing.assert_array_equal(unpack_rowptr(rb[1:], ro[70:150], 70), big[70:150])
    too_big = np.array([0, 2**31, 2**32 + 5], dtype=np.int64)
    with pytest.raises(ValueError, match=r"span 4294967301 slots"):
        pack_rowptr(too_big)


# --------------------------------------------------------------------------- CPU kernels
def _vectors(a: CSRMatrix, seed=0):
    rng = np.random.default_rng(seed)
    m, n = a.shape
    f = (rng.random(n) + 0.1).astype(np.float32)
    f[rng.random(n) < 0.1] = 0
    g = rng.poisson(4, m).astype(np.float32)
    return f, g


@pytest.mark.parametrize("code_bits", [8, 16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["random", "blocks", "one_row", "empty_rows", "far"])
def test_cpu_kernels_match_csr_kernels_bit_for_bit(name, fmt, code_bits):
    a = MATRICES[name]()
    c = CompressedMatrix.from_csr(a, fmt, code_bits=code_bits)
    r = a if fmt == "compressed" else c.to_csr()
    m, n = a.shape
    f, g = _vectors(a)
    y = cc.spmv(c, f)
    y0 = cpu.spmv(r.indptr, r.indices, r.data, f, np.empty(m, np.float32))
    np.testing.assert_array_equal(y, y0)
    part = np.empty((cc.DEFAULT_BLOCKS, n), np.float32)
    b = cc.spmv_t(c, g)
    b0 = cpu.spmv_t(r.indptr, r.indices, r.data, g, np.empty(n, np.float32), part)
    np.testing.assert_array_equal(b, b0)
    # the one-pass step equals forward + correlate + back projection, bit for bit (same row blocks)
    corr = np.zeros(m, np.float32)
    np.divide(g, y0, out=corr, where=y0 != 0)
    bp_ref = cpu.spmv_t(r.indptr, r.indices, r.data, corr, np.empty(n, np.float32), part)
    bp, fp = cc.onepass(c, g, f)
    np.testing.assert_array_equal(fp, y0)
    np.testing.assert_array_equal(bp, bp_ref)
    bp2, fp2 = cc.csr_onepass(r.indptr, r.indices, r.data, g, f)
    np.testing.assert_array_equal(fp2, y0)
    np.testing.assert_array_equal(bp2, bp_ref)


@pytest.mark.parametrize("code_bits", [8, 16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_kernels_against_float64_scipy(fmt, code_bits):
    a = random_csr(180, 900, 7, density=0.1)
    c = CompressedMatrix.from_csr(a, fmt, code_bits=code_bits)
    r = a if fmt == "compressed" else c.to_csr()
    s = sp.csr_matrix((r.data.astype(np.float64), r.indices, r.indptr), shape=r.shape)
    f, g = _vectors(a, 1)
    fp64 = s @ f.astype(np.float64)
    np.testing.assert_allclose(cc.spmv(c, f), fp64, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(cc.spmv_t(c, g, blocks=3), s.T @ g.astype(np.float64), rtol=2e-5, atol=1e-6)
    corr = np.divide(g, fp64, out=np.zeros_like(fp64), where=fp64 != 0)
    bp, fp = cc.onepass(c, g, f, blocks=5)
    np.testing.assert_allclose(fp, fp64, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(bp, s.T @ corr, rtol=1e-4, atol=1e-5)
    # back projection on a stored compressed transpose: the forward kernel on A^T
    t = CSRMatrix.from_scipy(s.T.tocsr().astype(np.float32))
    ct = CompressedMatrix.from_csr(t, fmt, code_bits=code_bits)
    np.testing.assert_allclose(cc.spmv(ct, g), s.T @ g.astype(np.float64), rtol=1e-4, atol=1e-5)


def test_cpu_kernels_with_a_row_pointer_beyond_2_31():
    """Kernels subtract the row pointer's base: offsets above 2**31 (and 2**32) work the same."""
    a = random_csr(130, 300, 8)
    c = CompressedMatrix.from_csr(a)
    shifted = CompressedMatrix(c.rowbase + 2**33 + 8, c.rowoff, c.codes, c.values, None, c.shape, c.nnz)
    f, g = _vectors(a)
    np.testing.assert_array_equal(cc.spmv(shifted, f), cc.spmv(c, f))
    np.testing.assert_array_equal(cc.spmv_t(shifted, g), cc.spmv_t(c, g))
    np.testing.assert_array_equal(cc.onepass(shifted, g, f)[0], cc.onepass(c, g, f)[0])
    ip = a.indptr + 2**32 + 3
    np.testing.assert_array_equal(cc.csr_onepass(ip, a.indices, a.data, g, f)[0],
                                  cc.csr_onepass(a.indptr, a.indices, a.data, g, f)[0])


def test_cpu_kernels_check_sizes():
    c = CompressedMatrix.from_csr(random_csr(10, 20, 9))
    with pytest.raises(ValueError, match=r"x has 19 entries, expected 20"):
        cc.spmv(c, np.ones(19, np.float32))
    with pytest.raises(ValueError, match=r"partial must be"):
        cc.spmv_t(c, np.ones(10), partial=np.zeros((2, 3), np.float32))


# --------------------------------------------------------------------------- the container
@pytest.mark.parametrize("code_bits", CODE_BITS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("max_nnz", [1, 37, 10**9])
def test_container_round_trip(tmp_path, fmt, max_nnz, code_bits):
    a = random_csr(150, 700, 10)
    p = tmp_path / "c.h5"
    digest = write_compressed_h5(p, a, fmt=fmt, max_nnz=max_nnz, code_bits=code_bits, grid=(7, 10, 10),
                                 voxel_size=(1, 2, 3), kind="matrix")
    c_mem = CompressedMatrix.from_csr(a, fmt, code_bits=code_bits)
    want = a if fmt == "compressed" else c_mem.to_csr()
    assert digest == checksum_arrays(want.indptr, want.indices, want.data)
    with MatrixH5(p) as f:  # the CSR reader's entry point opens a compressed file too
        assert isinstance(f, CompressedH5) and f.format == fmt and f.lossless == (fmt == "compressed")
        assert f.attrs["version"] == 2 and f.attrs["code_bits"] == f.code_bits == c_mem.code_bits
        assert f._ds["codes"].dtype == c_mem.codes.dtype and f.slots % 4 == 0
        assert f.shape == a.shape and f.nnz == a.nnz and f.slots == c_mem.slots
        assert f.grid == (7, 10, 10) and f.voxel_size == (1.0, 2.0, 3.0) and f.attrs["kind"] == "matrix"
        assert f.nbytes == c_mem.nbytes and f.bytes_per_nnz == pytest.approx(c_mem.bytes_per_nnz)
        np.testing.assert_array_equal(f.read_indptr(), a.indptr)
        assert_csr_equal(f.to_csr(), want)
        f.verify_checksum()
        for r0, r1 in [(0, 0), (3, 70), (64, 128), (149, 150)]:
            lo, hi = want.indptr[r0], want.indptr[r1]
            assert_csr_equal(f.read_rows(r0, r1), CSRMatrix(want.indptr[r0 : r1 + 1] - lo, want.indices[lo:hi],
                                                            want.data[lo:hi], (r1 - r0, a.shape[1])))
            enc = f.read_encoded(r0, r1)
            ref = c_mem.row_range(r0, r1)
            assert enc.code_bits == c_mem.code_bits and enc.codes.dtype == c_mem.codes.dtype
            for field in ("rowbase", "rowoff", "codes"):
                np.testing.assert_array_equal(getattr(enc, field), getattr(ref, field))
            np.testing.assert_array_equal(enc.value_bits(), ref.value_bits())
            assert enc.nnz == ref.nnz
        seen = []
        for r0, r1, block in f.iter_chunks(max_nnz):
            assert block.nnz <= max_nnz or r1 - r0 == 1
            seen.append((r0, r1))
        assert seen[0][0] == 0 and seen[-1][1] == a.shape[0]
        assert all(x[1] == y[0] for x, y in zip(seen[:-1], seen[1:]))
    whole = read_compressed_h5(p)
    np.testing.assert_array_equal(whole.codes, c_mem.codes)
    assert whole.code_bits == c_mem.code_bits
    with open_matrix(p) as f:
        assert isinstance(f, CompressedH5)


def test_lossless_container_has_the_csr_checksum_and_streaming_writer(tmp_path):
    a = random_csr(100, 300, 11)
    csr = tmp_path / "a.h5"
    digest = write_matrix_h5(csr, a)
    out = tmp_path / "c.h5"
    with CompressedH5Writer(out, a.shape, a.nnz) as w:
        for r0, r1 in [(0, 1), (1, 64), (64, 65), (65, 100)]:
            lo, hi = a.indptr[r0], a.indptr[r1]
            w.write_rows(CSRMatrix(a.indptr[r0 : r1 + 1], a.indices[lo:hi], a.data[lo:hi], (r1 - r0, 300)))
    assert w.checksum == digest
    with MatrixH5(out) as f:
        assert f.checksum == digest
        np.testing.assert_array_equal(f.read_encoded(0, 100).codes, CompressedMatrix.from_csr(a).codes)
    # encoded blocks written as they are
    out2 = tmp_path / "e.h5"
    write_compressed_h5(out2, CompressedMatrix.from_csr(a), max_nnz=50)
    with MatrixH5(out2) as f:
        assert f.checksum == digest


def test_writer_code_bits_one_per_file(tmp_path):
    """The first block with an element decides the width (unless given); later blocks follow it."""
    near, far = random_csr(70, 300, 30), far_csr(30, 200, 31)
    n = far.shape[1]
    near = CSRMatrix(near.indptr, near.indices, near.data, (70, n))
    empty = CSRMatrix(np.zeros(5, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32), (4, n))
    whole = CSRMatrix.from_scipy(sp.vstack([empty.to_scipy(), far.to_scipy(), near.to_scipy()]).tocsr())
    for blocks, given, want in [((empty, far, near), None, 16), ((empty, near, far), None, 8),
                                ((empty, far, near), 8, 8), ((empty,), None, 8)]:
        shape = (sum(b.shape[0] for b in blocks), n)
        nnz = sum(b.nnz for b in blocks)
        for encoded in (False, True):
            out = tmp_path / f"w{want}{given}{encoded}{len(blocks)}.h5"
            with CompressedH5Writer(out, shape, nnz, code_bits=given) as w:
                for b in blocks:
                    if encoded:  # blocks of their own best width, re-encoded to the file's
                        w.write_encoded(CompressedMatrix.from_csr(b))
                    else:
                        w.write_rows(b)
            assert w.code_bits == want
            with CompressedH5(out) as f:
                assert f.code_bits == want and f.attrs["code_bits"] == want
                assert f.read_encoded(0, shape[0]).code_bits == want
                ref = whole if len(blocks) == 3 and blocks[1] is far else None
                if ref is not None:
                    assert_csr_equal(f.to_csr(), ref)
                    np.testing.assert_array_equal(
                        f.read_encoded(0, shape[0]).codes, CompressedMatrix.from_csr(ref, code_bits=want).codes
                    )
    # write_compressed_h5 of a CSR matrix chooses from the whole matrix
    write_compressed_h5(tmp_path / "whole.h5", whole, max_nnz=100)
    with CompressedH5(tmp_path / "whole.h5") as f:
        assert f.code_bits == choose_code_bits(whole)
    with pytest.raises(ValueError, match=r"code_bits must be 8 or 16"):
        CompressedH5Writer(tmp_path / "x.h5", (1, 1), 0, code_bits=4)


def test_writer_incomplete_or_unsorted_leaves_nothing(tmp_path):
    a = random_csr(10, 30, 12)
    out = tmp_path / "c.h5"
    with pytest.raises(MatrixFormatError, match=r"writer closed after 0 of 10 rows"):
        with CompressedH5Writer(out, a.shape, a.nnz):
            pass
    bad = CSRMatrix([0, 2], [5, 1], [1, 1], (1, 30))
    with pytest.raises(MatrixFormatError, match=r"in\.csr4: columns of row 3 are not sorted"):
        with CompressedH5Writer(out, (4, 30), 2) as w:
            w.write_rows(CSRMatrix([0, 0, 0, 0], [], [], (3, 30)))
            w.write_rows(bad, source="in.csr4")
    assert list(tmp_path.iterdir()) == []


def test_stages_stream_a_compressed_matrix(tmp_path):
    """norm and transpose open the container with MatrixH5: a compressed one gives the same results."""
    from mlemlib.norm import compute_norm
    from mlemlib.transpose import transpose_file

    a = random_csr(90, 120, 13)
    csr, cmp_ = tmp_path / "a.h5", tmp_path / "c.h5"
    write_matrix_h5(csr, a)
    write_compressed_h5(cmp_, a)
    n1 = compute_norm(csr, tmp_path / "n1.h5", chunk_nnz=100)
    n2 = compute_norm(cmp_, tmp_path / "n2.h5", chunk_nnz=100)
    np.testing.assert_array_equal(n1, n2)
    transpose_file(csr, tmp_path / "t1.h5", chunk_nnz=100)
    transpose_file(cmp_, tmp_path / "t2.h5", chunk_nnz=100)
    with MatrixH5(tmp_path / "t1.h5") as t1, MatrixH5(tmp_path / "t2.h5") as t2:
        assert t1.checksum == t2.checksum


# --------------------------------------------------------------------------- bad files
def _good(tmp_path, fmt="compressed", name="good.h5", code_bits=8):
    a = random_csr(80, 600, 14)
    p = tmp_path / name
    write_compressed_h5(p, a, fmt=fmt, code_bits=code_bits)
    return p, a


def _edit(p, fn):
    with h5py.File(p, "r+") as f:
        fn(f)
    return p


def _replace(f, name, data):
    del f[name]
    f.create_dataset(name, data=data)


def _bits(f, vals=None):
    vals = f["values"][...] if vals is None else vals
    return vals.view(np.uint32 if vals.dtype == np.float32 else np.uint16)


def _first_big_delta(f):
    """Slot of a marker (not a pad)."""
    mark = code_mark(int(f.attrs["code_bits"]))
    big = (f["codes"][...] == mark) & (_bits(f) != 0)
    assert big.any()
    return int(np.argmax(big))


def _first_pad(f):
    mark = code_mark(int(f.attrs["code_bits"]))
    pad = (f["codes"][...] == mark) & (_bits(f) == 0)
    assert pad.any()
    return int(np.argmax(pad))


def _bad_cases():
    """name -> (fmt, edit of the good file, pattern of the message)."""

    def attr(key, value):
        def fn(f):
            if value is None:
                del f.attrs[key]
            else:
                f.attrs[key] = value

        return fn

    def code_edit(f):  # a direct delta raised so that the running column reaches n = 600
        codes = f["codes"][...]
        bits = _bits(f)
        high = code_high(int(f.attrs["code_bits"]))
        sp_ = unpack_rowptr(f["rowbase"][...], f["rowoff"][...])
        for r in range(len(sp_) - 1):
            col = 0
            for k in range(sp_[r], sp_[r + 1]):
                col += int(codes[k]) if codes[k] < high else int(bits[k])
                if codes[k] < high and int(codes[k]) + 600 - col <= high - 1:
                    codes[k] = int(codes[k]) + 600 - col
                    _replace(f, "codes", codes)
                    return
        raise AssertionError("no element to corrupt")

    def marker_small(f):  # a marker whose delta leads just outside the image
        vals = f["values"][...]
        vals.view(np.uint32)[_first_big_delta(f)] = 600
        _replace(f, "values", vals)

    def pad_600(f):  # a pad that moves the column: beyond the image at the row's end
        vals = f["values"][...]
        _bits(f, vals)[_first_pad(f)] = 600
        _replace(f, "values", vals)

    def marker_huge(f):
        vals = f["values"][...]
        vals.view(np.uint32)[_first_big_delta(f)] = 0xFFFFFFF0
        _replace(f, "values", vals)

    def nan_value(f):
        vals = f["values"][...]
        k = int(np.argmax(f["codes"][...] < code_high(int(f.attrs["code_bits"]))))
        vals[k] = np.nan
        _replace(f, "values", vals)

    def neg_value(f):
        vals = f["values"][...]
        k = int(np.argmax((f["codes"][...] < code_high(int(f.attrs["code_bits"]))) & (vals > 0)))
        vals[k] = -1.5
        _replace(f, "values", vals)

    def half_nan(f):
        vals = f["values"][...]
        k = int(np.argmax(f["codes"][...] < code_high(int(f.attrs["code_bits"]))))
        vals.view(np.uint16)[k] = 0x7E00
        _replace(f, "values", vals)

    def u16_value(f):  # one stored integer off by one: the decoded matrix's checksum no longer matches
        vals = f["values"][...]
        k = int(np.argmax((f["codes"][...] < code_high(int(f.attrs["code_bits"]))) & (vals > 0)))
        vals[k] -= 1
        _replace(f, "values", vals)

    def scale(value):
        def fn(f):
            s = f["scale"][...]
            s[3] = value
            _replace(f, "scale", s)

        return fn

    def count(f):  # an element code turned into a pad: one element fewer than nnz
        codes = f["codes"][...]
        vals = f["values"][...]
        k = int(np.argmax(codes == 0))
        codes[k] = code_mark(int(f.attrs["code_bits"]))
        _bits(f, vals)[k] = 0
        _replace(f, "codes", codes)
        _replace(f, "values", vals)

    def checksum(f):
        vals = f["values"][...]
        k = int(np.argmax((f["codes"][...] < code_high(int(f.attrs["code_bits"]))) & (vals > 0)))
        vals[k] = np.nextafter(vals[k], np.float32(10))
        _replace(f, "values", vals)

    def rowoff_end(f):
        ro = f["rowoff"][...]
        ro[-1] -= 1
        _replace(f, "rowoff", ro)

    def rowoff_dec(f):
        ro = f["rowoff"][...]
        ro[10] = ro[9] - 1 if ro[9] > 0 else 0
        ro[9] = ro[10] + 3
        _replace(f, "rowoff", ro)

    def short(name):
        def fn(f):
            _replace(f, name, f[name][...][:-1])

        return fn

    def dtype(f):
        _replace(f, "values", f["values"][...].astype(np.float64))

    def group(f):
        del f["codes"]
        f.create_group("codes")

    def missing_scale(f):
        del f["scale"]

    def version_1(f):  # what a version-1 file holds: no code_bits
        f.attrs["version"] = 1
        del f.attrs["code_bits"]

    def codes_dtype(f):
        _replace(f, "codes", f["codes"][...].astype(np.uint16))

    def misaligned(f):  # a row moved back by one slot (non-decreasing, ends right): not a multiple of 4
        ro = f["rowoff"][...]
        r = next(r for r in range(1, len(ro) - 1) if r % 64 and ro[r] - ro[r - 1] >= 4)
        ro[r] -= 1
        _replace(f, "rowoff", ro)

    def slots_attr(f):
        f.attrs["slots"] = f.attrs["slots"] + 2

    def high_marker(f):  # a pad turned into a high marker of a float32 matrix
        codes = f["codes"][...]
        codes[_first_pad(f)] = code_high(int(f.attrs["code_bits"]))
        _replace(f, "codes", codes)

    return {
        "no_format": ("compressed", attr("format", None), r"missing attribute 'format'"),
        "format": ("compressed", attr("format", "mlem-compressed-x"),
                   r"attribute format is 'mlem-compressed-x', expected 'mlem-csr'"),
        "version": ("compressed", attr("version", 3), r"unsupported container version 3, expected 2$"),
        "version_1": ("compressed", version_1,
                      r"compressed container version 1 \(8-bit codes, rows not aligned to 4 slots\) is no longer "
                      r"read; re-run `mlem convert --format compressed` on the source matrix to write version 2$"),
        "version_1_f16": ("compressed-f16", version_1, r"re-run `mlem convert --format compressed-f16`"),
        "no_code_bits": ("compressed", attr("code_bits", None), r"missing attribute 'code_bits'"),
        "code_bits": ("compressed", attr("code_bits", 12), r"attribute code_bits is 12, expected 8 or 16$"),
        "code_bits_16": ("compressed", attr("code_bits", 16),
                         r"dataset /codes is uint8\[\d+\], expected 1-D uint16 \(attribute code_bits = 16\)$"),
        "codes_dtype": ("compressed", codes_dtype,
                        r"dataset /codes is uint16\[\d+\], expected 1-D uint8 \(attribute code_bits = 8\)$"),
        "slots_align": ("compressed", slots_attr, r"attribute slots = \d+ is not a multiple of 4$"),
        "misaligned": ("compressed", misaligned, r"slot offset \d+ of row \d+ is not a multiple of 4$"),
        "high_marker": ("compressed", high_marker,
                        r"row \d+: high marker \(code 254\) at slot \d+ in a float32 matrix \(16-bit values only\)$"),
        "no_slots": ("compressed", attr("slots", None), r"missing attribute 'slots'"),
        "nnz_slots": ("compressed", attr("nnz", 10**6), r"attribute nnz = 1000000 exceeds slots"),
        "codes_size": ("compressed", short("codes"), r"dataset /codes has \d+ entries, but attribute slots = \d+"),
        "values_size": ("compressed", short("values"), r"dataset /values has \d+ entries, but attribute slots"),
        "rowoff_size": ("compressed", short("rowoff"), r"dataset /rowoff has 80 entries, but attribute shape\[0\] \+ 1 = 81"),
        "rowbase_size": ("compressed", short("rowbase"), r"dataset /rowbase has 1 entries, but attribute shape\[0\] // 64 \+ 1 = 2"),
        "dtype": ("compressed", dtype, r"dataset /values is float64\[\d+\], expected 1-D float32"),
        "group": ("compressed", group, r"/codes is a group, expected a dataset"),
        "slot_end": ("compressed", rowoff_end, r"slot pointer ends at \d+, expected slots = \d+"),
        "slot_decreasing": ("compressed", rowoff_dec, r"slot pointer is not non-decreasing at row 9"),
        "column": ("compressed", code_edit, r"row \d+: the column deltas decode to column 600 at slot \d+, outside \[0, 600\)"),
        "marker_600": ("compressed", marker_small, r"the column deltas decode to column \d+ at slot \d+, outside \[0, 600\)"),
        "marker": ("compressed", marker_huge, r"the column deltas decode to column 42949\d+ at slot \d+, outside \[0, 600\)"),
        "nan": ("compressed", nan_value, r"non-finite value nan at slot \d+ \(row \d+\)"),
        "negative": ("compressed", neg_value, r"negative value -1\.5 at slot \d+ \(row \d+\)"),
        "count": ("compressed", count, r"the codes hold \d+ elements, attribute nnz = \d+"),
        "checksum": ("compressed", checksum, r"checksum mismatch"),
        "f16_nan": ("compressed-f16", half_nan, r"non-finite value nan at slot \d+"),
        "f16_scale_zero": ("compressed-f16", scale(0.0), r"row scale 0\.0 of row 3 is not a finite positive number"),
        "f16_scale_inf": ("compressed-f16", scale(np.inf), r"row scale inf of row 3 is not a finite positive number"),
        "f16_no_scale": ("compressed-f16", missing_scale, r"missing dataset /scale"),
        "f16_dtype": ("compressed-f16", lambda f: _replace(f, "values", f["values"][...].astype(np.float32)),
                      r"dataset /values is float32\[\d+\], expected 1-D float16"),
        "u16_scale_zero": ("compressed-u16", scale(0.0), r"row scale 0\.0 of row 3 is not a finite positive number"),
        "u16_scale_nan": ("compressed-u16", scale(np.nan), r"row scale nan of row 3 is not a finite positive number"),
        "u16_no_scale": ("compressed-u16", missing_scale, r"missing dataset /scale"),
        "u16_dtype": ("compressed-u16", lambda f: _replace(f, "values", f["values"][...].view(np.float16)),
                      r"dataset /values is float16\[\d+\], expected 1-D uint16"),
        "u16_value": ("compressed-u16", u16_value, r"checksum mismatch"),
        "u16_format": ("compressed-u16", attr("format", "mlem-compressed-u8"),
                       r"attribute format is 'mlem-compressed-u8', expected"),
        # files of 16-bit codes
        "column_16": ("compressed", code_edit, r"the column deltas decode to column 600 at slot \d+, outside", 16),
        "pad_16": ("compressed", pad_600, r"the column deltas decode to column \d+ at slot \d+, outside", 16),
        "pad": ("compressed", pad_600, r"the column deltas decode to column \d+ at slot \d+, outside"),
        "count_16": ("compressed", count, r"the codes hold \d+ elements, attribute nnz = \d+", 16),
        "codes_dtype_16": ("compressed", lambda f: _replace(f, "codes", f["codes"][...].astype(np.uint8)),
                           r"dataset /codes is uint8\[\d+\], expected 1-D uint16 \(attribute code_bits = 16\)$", 16),
        "misaligned_16": ("compressed", misaligned, r"slot offset \d+ of row \d+ is not a multiple of 4$", 16),
        "high_marker_16": ("compressed", high_marker, r"high marker \(code 65534\) at slot \d+ in a float32 matrix", 16),
        "f16_nan_16": ("compressed-f16", half_nan, r"non-finite value nan at slot \d+", 16),
        "u16_column_16": ("compressed-u16", code_edit, r"the column deltas decode to column 600 at slot \d+, outside", 16),
    }


BAD = _bad_cases()


def read_everything(p):
    with open_matrix(p) as f:
        f.read_indptr()
        for _ in f.iter_chunks(50):
            pass
        f.verify_checksum()


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_compressed_file_one_clear_error(tmp_path, case):
    fmt, edit, pattern, *code_bits = BAD[case]
    p, _ = _good(tmp_path, fmt, f"bad_{case}.h5", *code_bits)
    _edit(p, edit)
    with pytest.raises(MatrixFormatError) as e:
        read_everything(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: ") and "\n" not in msg, msg
    assert re.search(pattern, msg), msg


def test_truncated_compressed_file(tmp_path):
    p, _ = _good(tmp_path)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(MatrixFormatError, match=re.escape(str(p)) + r": not a readable HDF5 file"):
        read_everything(p)


def test_read_encoded_validates_its_range(tmp_path):
    p, a = _good(tmp_path)
    _edit(p, BAD["nan"][1])
    with CompressedH5(p) as f:
        bad_row = int(re.search(r"row (\d+)", str(pytest.raises(MatrixFormatError, f.read_encoded, 0, 80).value))[1])
        f.read_encoded(bad_row + 1, 80)  # other rows read fine
        f.read_encoded(0, 80, validate=False)
    with pytest.raises(MatrixFormatError, match=r"attribute format is 'mlem-csr', expected one of"):
        q = tmp_path / "csr.h5"
        write_matrix_h5(q, a)
        CompressedH5(q)


# --------------------------------------------------------------------------- convert / info / CLI
def scanner_bytes(grid=(4, 3, 2)) -> bytes:
    """A .csr4 scanner block (as tests/test_formats.py encodes it): one layer, 8 blocks of 3, 2 rings."""
    b = struct.pack("<I", 1) + struct.pack("<5f", 2.0, 2.0, 10.0, 50.0, 0.096)
    b += struct.pack("<II", 8, 3) + struct.pack("<2f", 0.25, 0.5)
    b += struct.pack("<I", 2) + struct.pack("<1f", 0.5)
    return b + struct.pack("<3f", 1.5, 1.5, 2.0) + struct.pack("<3I", *grid)


def encode_csr4(indptr, cols, vals, m, n=24) -> bytes:
    """A .csr4 file byte by byte: header, scanner block, row ends, (column, value) pairs."""
    sb = scanner_bytes()
    out = b"PCSR" + struct.pack("<BBHIIQI", 4, 0, 0, m, n, len(cols), len(sb)) + sb
    out += b"".join(struct.pack("<Q", int(e)) for e in indptr[1:])
    return out + b"".join(struct.pack("<If", int(c), float(v)) for c, v in zip(cols, vals))


@pytest.fixture
def csr4_file(tmp_path):
    a = random_csr(90, 24, 15, density=0.3)
    p = tmp_path / "a.csr4"
    p.write_bytes(encode_csr4(a.indptr, a.indices, a.data, 90))
    return p, a


def test_convert_formats_and_back(tmp_path, csr4_file):
    src, a = csr4_file
    s_csr = convert(src, tmp_path / "a.h5")
    s_c = convert(src, tmp_path / "c.h5", fmt="compressed", max_nnz=40)
    s_h = convert(src, tmp_path / "h.h5", fmt="compressed-f16", max_nnz=40)
    assert s_c["checksum"] == s_csr["checksum"] and s_c["lossless"] and not s_h["lossless"]
    assert s_c["format"] == "compressed" and s_c["bytes_per_nnz"] < s_csr["bytes_per_nnz"]
    assert s_csr["bytes_per_nnz"] == pytest.approx(8 + 8 * 91 / a.nnz)
    back = convert(tmp_path / "c.h5", tmp_path / "back.h5")  # compressed -> csr, checked against its checksum
    assert back["checksum"] == s_csr["checksum"]
    h2c = convert(tmp_path / "h.h5", tmp_path / "h2c.h5", fmt="compressed")  # f16 values, stored exactly
    assert h2c["checksum"] == s_h["checksum"]
    with MatrixH5(tmp_path / "back.h5") as f:
        assert f.attrs["grid"] == [4, 3, 2] and f.attrs["source"] == "c.h5"
    for p, fmt, lossless in [(tmp_path / "c.h5", "compressed", True), (tmp_path / "h.h5", "compressed-f16", False),
                             (tmp_path / "a.h5", "csr", True), (src, "csr", True)]:
        d = info(p)
        assert d["matrix_format"] == fmt and d["lossless"] is lossless and d["verdict"].startswith("valid")
        assert d["nnz"] == a.nnz and d["empty_rows"] == int(np.sum(np.diff(a.indptr) == 0))


def test_convert_chooses_code_bits_from_a_sample(tmp_path, capsys):
    far = far_csr(64, 300, 40)
    n = far.shape[1]
    near = random_csr(64, 2000, 41, density=0.2)
    near = CSRMatrix(near.indptr, near.indices, near.data, (64, n))
    for name, a, want in [("far", far, 16), ("near", near, 8)]:
        src = tmp_path / f"{name}.h5"
        write_matrix_h5(src, a)
        for fmt in FORMATS:
            s = convert(src, tmp_path / f"{name}_{fmt}.h5", fmt=fmt, max_nnz=1000)
            assert s["code_bits"] == want
            with CompressedH5(tmp_path / f"{name}_{fmt}.h5") as f:
                assert f.code_bits == want and f.bytes_per_nnz == pytest.approx(s["bytes_per_nnz"])
                assert f.nbytes == encoded_nbytes(a, fmt)[want]
        forced = convert(src, tmp_path / f"{name}_forced.h5", fmt="compressed", code_bits=24 - want)
        as_csr = convert(src, tmp_path / f"{name}_csr.h5")
        assert forced["code_bits"] == 24 - want and as_csr["code_bits"] is None
        assert forced["checksum"] == as_csr["checksum"]
        with CompressedH5(tmp_path / f"{name}_forced.h5") as f:
            assert f.code_bits == 24 - want
            assert_csr_equal(f.to_csr(), a)
    # the CLI: --code-bits forces, info shows the width
    out = tmp_path / "cli.h5"
    assert main(["convert", str(tmp_path / "far.h5"), "--out", str(out), "-f", "compressed", "--code-bits", "8"]) == 0
    assert "8-bit codes" in capsys.readouterr().out
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mlem-compressed container version 2 (lossless, 8-bit codes)" in text
    with pytest.raises(ValueError, match=r"code_bits must be 8 or 16"):
        convert(tmp_path / "far.h5", tmp_path / "x.h5", fmt="compressed", code_bits=7)


def test_sample_code_bits_reads_rows_spread_over_the_matrix():
    """A matrix whose first rows have small deltas and most rows large ones: the sample sees both."""
    from mlemlib.formats import InMemoryMatrix

    far = far_csr(200, 100, 42)
    n = far.shape[1]
    near = random_csr(20, 2000, 43, density=0.3)
    near = CSRMatrix(near.indptr, near.indices, near.data, (20, n))
    a = CSRMatrix.from_scipy(sp.vstack([near.to_scipy(), far.to_scipy()]).tocsr())
    reader = InMemoryMatrix(a)
    assert sample_code_bits(reader, sample_nnz=1600, pieces=16) == 16  # 16 pieces of 100: 2 of 16 near rows
    assert sample_code_bits(reader, sample_nnz=1600, pieces=1) == 8  # the first rows only
    assert sample_code_bits(reader, sample_nnz=10**9) == choose_code_bits(a) == 16  # the whole matrix
    empty = InMemoryMatrix(MATRICES["empty_rows"]())
    assert sample_code_bits(empty) == 8


def test_convert_f16_of_a_corrupt_h5_is_refused(tmp_path):
    a = random_csr(40, 50, 16)
    p = tmp_path / "a.h5"
    write_matrix_h5(p, a)
    with h5py.File(p, "r+") as f:
        d = f["data"][...]
        d[3] = np.nextafter(d[3], np.float32(9))
        f["data"][...] = d
    with pytest.raises(MatrixFormatError, match=r"a\.h5: checksum mismatch"):
        convert(p, tmp_path / "h.h5", fmt="compressed-f16")
    assert not (tmp_path / "h.h5").exists()


def test_cli_convert_and_info(tmp_path, csr4_file, capsys):
    src, a = csr4_file
    out = tmp_path / "c.h5"
    assert main(["convert", str(src), "--out", str(out), "--format", "compressed"]) == 0
    line = capsys.readouterr().out
    assert "compressed (" in line and "bytes per non-zero" in line
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    bpn = float(re.search(r"^  bytes per non-zero: ([\d.]+)$", text, re.M)[1])
    assert bpn < 8 and re.search(r"^  lossless: yes$", text, re.M) and "mlem-compressed container" in text
    assert main(["convert", str(src), "--out", str(tmp_path / "h.h5"), "-f", "compressed-f16"]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "h.h5"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["lossless"] is False and d["matrix_format"] == "compressed-f16"
    assert main(["convert", str(src), "--out", str(tmp_path / "u.h5"), "-f", "compressed-u16"]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "u.h5")]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^  lossless: no$", text, re.M) and "mlem-compressed-u16 container" in text
    assert float(re.search(r"^  bytes per non-zero: ([\d.]+)$", text, re.M)[1]) < bpn
    assert main(["info", str(src)]) == 0
    text = capsys.readouterr().out
    assert f"  bytes per non-zero: {8 + 8 * 91 / a.nnz:.3f}" in text and "  lossless: yes" in text


def test_cli_help_lists_formats():
    """``convert --help`` lists every format and says what no ``--format`` gives: an .h5 input's own, else csr."""
    r = subprocess.run([sys.executable, "-m", "mlemlib", "convert", "--help"], capture_output=True, text=True, check=True)
    text = " ".join(r.stdout.split())  # the help as one line, however argparse wrapped it
    assert "{csr,compressed,compressed-f16,compressed-u16}" in text
    assert "(default: an .h5 input's own format, with a compressed one's stored values kept bit for bit; " \
        "csr for any other input)" in text


def test_cli_unsorted_input_exit_2(tmp_path, capsys):
    p = tmp_path / "u.csr4"
    p.write_bytes(encode_csr4([0, 2, 3], [5, 1, 2], [1.0, 1.0, 1.0], 2))
    out = tmp_path / "c.h5"
    assert main(["convert", str(p), "--out", str(out), "-f", "compressed"]) == 2
    assert capsys.readouterr().err == f"mlem: error: {p}: columns of row 0 are not sorted (column 1 after 5); " \
        "the compressed format stores sorted rows: sort the rows' columns first\n"
    assert not out.exists()
    assert main(["convert", str(p), "--out", str(out)]) == 0  # csr keeps the order it was given


# --------------------------------------------------------------------------- the CUDA side without a GPU
def test_cuda_launcher_imports_without_cupy():
    code = (
        "import sys; import mlemlib.backends._compressed_cuda as m; "
        "assert 'cupy' not in sys.modules; print(m.kernel_source().count('extern \"C\"'))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(r.stdout) >= 5


def test_kernel_sources_include_the_shared_epilogue_once():
    from mlemlib.backends import _compressed_cuda as cc
    from mlemlib.backends._build import kernel_source

    header = (Path(__file__).resolve().parents[1] / "mlemlib" / "kernels" / "epilogue.cuh").read_text()
    for text in (kernel_source("spmv"), cc.kernel_source()):
        assert not re.search(r'^#include "', text, re.M)  # NVRTC gets no include it would have to find
        assert text.count(header) == 1 and text.count("struct RowAux") == 1
        assert text.index(header) < text.index("write_row(mode")  # defined before its first use


def test_fixed_point_scale_and_lanes():
    from mlemlib.backends._compressed_cuda import choose_lanes, fixed_scale

    for bound in (1e-30, 0.7, 1.0, 3.0, 1e12):
        s = fixed_scale(bound)
        assert s == 2.0 ** round(np.log2(s)) and bound * s < 2.0**62 <= 2 * bound * s
    assert fixed_scale(0) == 2.0**62
    with pytest.raises(ValueError):
        fixed_scale(float("nan"))
    assert [choose_lanes(x) for x in (0, 3, 5, 16, 17, 700)] == [4, 4, 8, 16, 32, 32]
    assert choose_lanes(700, cap=16) == 16


def test_fixed_limits_hand_computed():
    from mlemlib.backends._compressed_cuda import fixed_limits

    assert fixed_limits(3) == (3074457345618258602, 2**63)  # 2^63 // 3, by hand
    assert fixed_limits(0, 4) == (2**63, 2**61)
    assert fixed_limits(2**20, 2) == (2**43, 2**62)
    for bad in ((-1, 1), (5, 0)):
        with pytest.raises(ValueError, match="fixed_limits"):
            fixed_limits(*bad)


def _model_adds(terms, gpu_of, red_lim, sum_lim):
    """add_term's fixed-point adds as exact integers: (each GPU's sum, whether a flag was set)."""
    sums = [0] * (max(gpu_of) + 1)
    flag = False
    for u, p in zip(terms, gpu_of):
        old = sums[p]
        sums[p] = old + u
        if u >= red_lim and old + u >= sum_lim:
            flag = True
    return sums, flag


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_fixed_limits_leave_no_sum_to_wrap_unflagged(gpus):
    """Adversarial term sequences into one output, up to K terms over P GPUs: while no flag is set, neither
    a GPU's sum nor the all-reduced sum reaches 2^64 (what lets the small terms skip the read-back)."""
    from mlemlib.backends._compressed_cuda import fixed_limits

    rng = np.random.default_rng(gpus)
    k = 40
    red, top = fixed_limits(k, gpus)
    unflagged = 0
    for _ in range(3000):
        n = int(rng.integers(1, k + 1))
        kind = rng.integers(0, 3, n)  # largest term below red_lim, a term just at red_lim, a random large one
        terms = [red - 1 if t == 0 else red if t == 1 else int(rng.integers(red, 2**64 - 1, dtype=np.uint64))
                 for t in kind]
        sums, flag = _model_adds(terms, [int(p) for p in rng.integers(0, gpus, n)], red, top)
        if not flag:
            unflagged += 1
            assert max(sums) < 2**64 and sum(sums) < 2**64
    assert unflagged > 100
    # the limits are tight: k terms of red_lim - 1 never flag, and a sum at sum_lim does
    assert _model_adds([red - 1] * k, [0] * k, red, top) == ([k * (red - 1)], False)
    assert _model_adds([top], [0], red, top)[1]


# --------------------------------------------------------------------------- GPU (skipped without one)
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_kernels_match_numba(fmt):
    import cupy as cp

    from mlemlib.backends import _compressed_cuda as gpu

    a = random_csr(300, 800, 17)
    c = CompressedMatrix.from_csr(a, fmt)
    r = a if fmt == "compressed" else c.to_csr()
    d = gpu.DeviceCompressed.from_host(c)
    f, g = _vectors(a, 2)
    fd, gd = cp.asarray(f), cp.asarray(g)
    want_fp = cc.spmv(c, f)
    bp_ref, _ = cc.onepass(c, g, f)
    corr = np.zeros_like(want_fp)
    np.divide(g, want_fp, out=corr, where=want_fp != 0)
    for lanes in gpu.LANE_CHOICES:
        np.testing.assert_allclose(gpu.spmv(d, fd, lanes=lanes).get(), want_fp, rtol=1e-5, atol=1e-6)
        for det in (False, True):
            sc = gpu.scatter(d, cp.asarray(corr), lanes=lanes, deterministic=det).get()
            np.testing.assert_allclose(sc, cc.spmv_t(c, corr), rtol=1e-5, atol=1e-6)
            for m_ in (d, gpu.upload_csr(r)):
                bp, fp = gpu.onepass(m_, gd, fd, lanes=lanes, deterministic=det)
                np.testing.assert_allclose(fp.get(), want_fp, rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(bp.get(), bp_ref, rtol=1e-4, atol=1e-5)
                if det:
                    again, _ = gpu.onepass(m_, gd, fd, lanes=lanes, deterministic=True)
                    np.testing.assert_array_equal(bp.get(), again.get())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_fixed_point_limits(fmt):
    """The fixed-point one pass adds the same integers whether its terms go as reductions (below red_lim) or
    as checked atomics, and flags exactly where a checked sum reaches sum_lim; each column's element count
    (the limits' K) is numpy's, on the compressed matrix and on CSR."""
    import cupy as cp

    from mlemlib.backends import _compressed_cuda as gpu

    a = random_csr(300, 800, 23)
    c = CompressedMatrix.from_csr(a, fmt)
    r = a if fmt == "compressed" else c.to_csr()
    f, g = _vectors(a, 5)
    fd, gd = cp.asarray(f), cp.asarray(g)
    want_k = int(np.bincount(np.asarray(r.indices), minlength=800).max())
    for m_ in (gpu.DeviceCompressed.from_host(c), gpu.upload_csr(r)):
        assert gpu.column_count_max(m_) == want_k
        scale = gpu.fixed_scale(gpu.onepass_bound(gd, fd))
        fp = cp.empty(300, dtype=cp.float32)

        def run(limits, lanes):
            acc = cp.zeros(800, dtype=cp.uint64)
            flag = cp.zeros(1, dtype=cp.int32)
            gpu.onepass_fixed(m_, gd, fd, acc, fp, scale, flag, lanes=lanes, limits=limits)
            return acc.get(), int(flag.get()[0])

        for lanes in gpu.LANE_CHOICES:
            checked, bad = run((0, 2**64 - 1), lanes)  # every add returns the old sum
            assert bad == 0 and checked.max() > 2**20
            for limits in (None, (2**63, 2**63), gpu.fixed_limits(want_k, 4)):
                got, bad = run(limits, lanes)
                assert bad == 0
                np.testing.assert_array_equal(got, checked)
            top = int(checked.max())
            assert run((0, top), lanes)[1] == 2  # the largest sum reaches a limit of itself
            assert run((0, top + 1), lanes)[1] == 0
            assert run((2**63, top), lanes)[1] == 0  # reductions are not checked


@pytest.mark.gpu
@pytest.mark.parametrize("code_bits", [8, 16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_onepass_on_long_rows_with_far_jumps_in_an_l2_window(fmt, code_bits):
    """The one pass decodes each row a second time for its scatter, from the row's end back
    (MLEM_CMP_REVERSE: the running column before a trip is the one after it less the trip's total): on
    rows of thousands of elements with column jumps beyond 8 and 16 bits (marks and high codes), fp and bp
    equal float64's, with the atomic target in a persisting L2 window on the stream; the fixed point
    repeats bit for bit."""
    import cupy as cp

    from mlemlib.backends import _compressed_cuda as gpu

    rng = np.random.default_rng(11)
    m, n = 48, 300_000
    rows = []
    for r in range(m):  # a dense start, then a jump of ~200,000 columns, then a sparse tail
        cols = np.union1d(rng.choice(3000, 900 + 40 * r, replace=False),
                          rng.choice(np.arange(200_000, n), 1500, replace=False))
        rows.append(np.sort(cols))
    indptr = np.concatenate([[0], np.cumsum([len(c) for c in rows])]).astype(np.int64)
    a = CSRMatrix(indptr, np.concatenate(rows).astype(np.int32),
                  rng.uniform(0.1, 1.0, indptr[-1]).astype(np.float32), (m, n))
    c = CompressedMatrix.from_csr(a, fmt, code_bits=code_bits)
    ref = c.to_csr().to_scipy().astype(np.float64)  # the stored (decoded) values
    f, g = _vectors(a, 3)
    want_fp = ref @ f.astype(np.float64)
    corr = np.divide(g, want_fp, out=np.zeros(m), where=want_fp != 0)
    want_bp = ref.T @ corr
    d = gpu.DeviceCompressed.from_host(c)
    fd, gd = cp.asarray(f), cp.asarray(g)
    stream = cp.cuda.Stream()
    bp = cp.empty(n, dtype=cp.float32)
    acc = cp.empty(n, dtype=cp.uint64)
    for det in (False, True):
        target = acc if det else bp
        window = gpu.persist_in_l2(stream, target)
        can = int(cp.cuda.runtime.deviceGetAttribute(108, cp.cuda.Device().id)) > 0
        assert (window is not None) == can  # the device's own word on L2 persistence
        if window:
            assert window["window_bytes"] == target.nbytes and 0 < window["hit_ratio"] <= 1
        with stream:
            got_bp, got_fp = gpu.onepass(d, gd, fd, bp=bp, deterministic=det, acc=acc if det else None)
            np.testing.assert_allclose(got_fp.get(), want_fp, rtol=2e-5)
            np.testing.assert_allclose(got_bp.get(), want_bp, rtol=2e-5, atol=1e-9)
            if det:
                first = got_bp.get()
                again, _ = gpu.onepass(d, gd, fd, bp=bp, deterministic=True, acc=acc)
                np.testing.assert_array_equal(again.get(), first)
        gpu.release_l2()


class _HostArray(np.ndarray):
    """A NumPy array with CuPy's ``set``/``get``: a stand-in for device memory (views write through)."""

    def set(self, a, stream=None):
        self[...] = a

    def get(self):
        return np.asarray(self).copy()


class _FakeDevice:
    def __init__(self, index=None):
        self.id = 0 if index is None else int(index)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fake_cupy():
    """The few CuPy calls DeviceCompressed.upload makes, on host arrays (the host logic, tested without a GPU)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        empty=lambda n, dtype: np.empty(n, dtype=dtype).view(_HostArray),
        asarray=lambda a: np.array(a).view(_HostArray),
        float32=np.float32,
        cuda=SimpleNamespace(Device=_FakeDevice, Stream=_FakeStream, get_current_stream=_FakeStream),
    )


class _FakeStream:
    """A stream whose copies are done when issued (the host stand-in's ``set`` copies at once)."""

    def __init__(self, non_blocking=False):
        pass

    def record(self):
        return self

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass


def _host_device_check(a):
    """The device check's verdict computed on the host stand-in's arrays, row by row with the host's checks."""
    sp = unpack_rowptr(np.asarray(a.rowbase), np.asarray(a.rowoff))
    codes, values = np.asarray(a.codes), np.asarray(a.values)
    first, nnz = None, 0
    for r in range(a.shape[0]):
        lo, hi = int(sp[r]), int(sp[r + 1])
        scale = None if a.scale is None else np.asarray(a.scale)[r : r + 1]
        try:
            nnz += check_slots(sp[r : r + 2] - lo, codes[lo:hi], values[lo:hi], scale, a.shape[1])
        except MatrixFormatError:
            first = r if first is None else first
    return first, nnz


#: The streamed upload on host arrays (its logic, in CI) and on a GPU.
UPLOAD_ON = ("host", pytest.param("gpu", marks=pytest.mark.gpu))


def _upload_on(where, monkeypatch):
    from mlemlib.backends import _compressed_cuda as gpu

    if where == "host":
        monkeypatch.setattr(gpu, "cupy", _fake_cupy)
        monkeypatch.setattr(gpu, "pinned", lambda n, dtype: np.empty(n, dtype=dtype))
        monkeypatch.setattr(gpu, "device_check", _host_device_check)
    monkeypatch.setattr(gpu, "UPLOAD_CHUNK_NNZ", 97)  # many pieces
    return gpu


@pytest.mark.parametrize("where", UPLOAD_ON)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("r0", "r1"), [(0, 300), (41, 257), (9, 9)])
def test_streamed_upload_places_every_piece(tmp_path, monkeypatch, where, fmt, r0, r1):
    """A compressed container reaches the device piece by piece (read ahead), equal to the whole rows' arrays."""
    from mlemlib.formats.compressed_h5 import CompressedH5

    a = random_csr(300, 800, 31)
    c = CompressedMatrix.from_csr(a, fmt)
    path = tmp_path / "m.h5"
    write_compressed_h5(path, c, max_nnz=500)
    gpu = _upload_on(where, monkeypatch)
    with CompressedH5(path) as src:
        got = gpu.DeviceCompressed.upload(src, (r0, r1))
    want = c.row_range(r0, r1)
    wrb, wro = pack_rowptr(want.slotptr() - want.slotptr()[0])
    assert got.shape == want.shape and got.nnz == want.nnz and got.code_bits == want.code_bits
    np.testing.assert_array_equal(got.rowbase.get(), wrb)
    np.testing.assert_array_equal(got.rowoff.get(), wro)
    np.testing.assert_array_equal(got.codes.get(), want.codes)
    np.testing.assert_array_equal(got.values.get().view(np.uint8), np.asarray(want.values).view(np.uint8))
    if fmt == "compressed":
        assert got.scale is None
    else:
        np.testing.assert_array_equal(got.scale.get(), want.scale)


@pytest.mark.gpu
def test_streamed_upload_comes_after_the_current_streams_work(tmp_path):
    """The upload copies on a stream of its own, after what the current stream queued before it: a kernel still
    running there that then overwrites the memory the pool gives the upload's codes does not reach them."""
    pytest.importorskip("cupy")
    sys.path.insert(0, str(Path(__file__).parent))
    from test_cuda_kernels import late_overwrite

    from mlemlib.backends import _compressed_cuda as gpu
    from mlemlib.formats.compressed_h5 import CompressedH5

    c = CompressedMatrix.from_csr(random_csr(300, 800, 31), "compressed")
    write_compressed_h5(tmp_path / "m.h5", c)
    with CompressedH5(tmp_path / "m.h5") as src:
        late_overwrite(c.codes.nbytes)
        got = gpu.DeviceCompressed.upload(src)
        got.codes.device.synchronize()
    np.testing.assert_array_equal(got.codes.get(), c.codes)
    np.testing.assert_array_equal(got.values.get().view(np.uint8), np.asarray(c.values).view(np.uint8))


@pytest.mark.parametrize("where", UPLOAD_ON)
def test_streamed_upload_of_a_corrupt_piece_names_the_file(tmp_path, monkeypatch, where):
    from mlemlib.formats.compressed_h5 import CompressedH5

    path = tmp_path / "bad.h5"
    write_compressed_h5(path, random_csr(300, 800, 37))
    with h5py.File(path, "r+") as f:
        v = f["values"][...]
        real = np.flatnonzero(f["codes"][...] < code_high(int(f.attrs["code_bits"])))
        v[real[len(real) // 2]] = -1.0
        f["values"][...] = v
    gpu = _upload_on(where, monkeypatch)
    with CompressedH5(path) as src, pytest.raises(MatrixFormatError, match=r"bad\.h5.*negative value -1\.0 at slot"):
        gpu.DeviceCompressed.upload(src)


def _corrupt(path, fault):
    """Spoil one element of a compressed container in place: a value, or a column past the last one."""
    with h5py.File(path, "r+") as f:
        codes, v = f["codes"][...], f["values"][...]
        high = code_high(int(f.attrs["code_bits"]))
        real = np.flatnonzero(codes < high)
        k = int(real[len(real) // 2])
        if fault == "nan":
            v[k] = np.nan
        elif fault == "negative":
            v[k] = -1e-30
        elif fault == "negative zero":  # passes: -0.0 >= 0
            v[k] = -0.0
        elif fault == "column":  # a marker that jumps past the grid
            codes[k] = high + 1
            v.view(np.uint32)[k] = 1 << 30
        elif fault == "high marker":  # 16-bit values only: not in a float32 row
            codes[k] = high
        f["codes"][...] = codes
        f["values"][...] = v


@pytest.mark.parametrize("where", UPLOAD_ON)
@pytest.mark.parametrize(("fault", "message"), [
    ("nan", r"non-finite value nan at slot"), ("negative", r"negative value -1\.0+\d*e-30 at slot"),
    ("column", r"row \d+: .*column"), ("high marker", r"high marker"),
])
def test_upload_check_names_each_fault(tmp_path, monkeypatch, where, fault, message):
    """Each fault the host's check knows is found by the upload's check (on the GPU there) and reported in the
    host's words, naming the file."""
    from mlemlib.formats.compressed_h5 import CompressedH5

    path = tmp_path / "bad.h5"
    write_compressed_h5(path, random_csr(300, 800, 41))
    _corrupt(path, fault)
    gpu = _upload_on(where, monkeypatch)
    with CompressedH5(path) as src, pytest.raises(MatrixFormatError, match=r"bad\.h5.*" + message):
        gpu.DeviceCompressed.upload(src)


@pytest.mark.parametrize("where", UPLOAD_ON)
def test_upload_check_passes_negative_zero(tmp_path, monkeypatch, where):
    """-0.0 is a value >= 0: the upload takes it, and counts every element."""
    from mlemlib.formats.compressed_h5 import CompressedH5

    path = tmp_path / "z.h5"
    write_compressed_h5(path, random_csr(300, 800, 47))
    _corrupt(path, "negative zero")
    gpu = _upload_on(where, monkeypatch)
    with CompressedH5(path) as src:
        got = gpu.DeviceCompressed.upload(src)
        assert got.nnz == src.nnz


def test_upload_check_disagreeing_with_the_host_is_refused(tmp_path, monkeypatch):
    """A row the device check refuses and the host's passes is still refused, naming the row."""
    from mlemlib.formats.compressed_h5 import CompressedH5

    path = tmp_path / "m.h5"
    write_compressed_h5(path, random_csr(300, 800, 43))
    gpu = _upload_on("host", monkeypatch)
    monkeypatch.setattr(gpu, "device_check", lambda a: (217, 0))
    with CompressedH5(path) as src, pytest.raises(MatrixFormatError, match=r"m\.h5.*row 217: .*fail the check on the GPU"):
        gpu.DeviceCompressed.upload(src)


@pytest.mark.parametrize("waves", [0, 1, 3])
@pytest.mark.parametrize(("m", "lanes"), [(1, 32), (10_000_000, 32), (999_999, 8), (5, 4)])
def test_row_launch_grid(monkeypatch, waves, m, lanes):
    """One lane group per row when uncapped or asked (waves=0: the CSR one pass has no row loop); else capped at
    ``waves`` full waves; the default (WAVES) is uncapped."""
    from mlemlib.backends import _compressed_cuda as gpu

    monkeypatch.setattr(gpu, "_device_shape", lambda device_id: (132, 2048))  # an H100's SMs and threads per SM
    monkeypatch.setattr(gpu, "cupy", _fake_cupy)
    grids = []
    gpu._launch_rows(lambda grid, block, args: grids.append((grid, block)), m, lanes, (), waves=waves)
    gpu._launch_rows(lambda grid, block, args: grids.append((grid, block)), m, lanes, (), waves=0)
    per_block = gpu.THREADS // lanes
    needed = -(-m // per_block)
    cap = 132 * (2048 // gpu.THREADS) * waves
    (capped, block1), (full, block2) = grids
    assert block1 == block2 == (gpu.THREADS,)
    assert full == (needed,)  # every row has its group
    assert gpu.WAVES == 0
    assert capped == ((needed,) if waves == 0 else (min(needed, cap),))
    assert full[0] * per_block >= m > (full[0] - 1) * per_block


def test_fixed_to_float_launches_blocks(monkeypatch):
    """The fixed-point conversion launches one block per THREADS entries (uncapped: WAVES = 0)."""
    from types import SimpleNamespace

    from mlemlib.backends import _compressed_cuda as gpu

    monkeypatch.setattr(gpu, "_device_shape", lambda device_id: (132, 2048))
    monkeypatch.setattr(gpu, "cupy", lambda: SimpleNamespace(
        uint64=np.uint64, float32=np.float32, cuda=SimpleNamespace(Device=_FakeDevice)))
    launched = []
    monkeypatch.setattr(gpu, "function", lambda name: lambda grid, block, args: launched.append((name, grid)))
    n = 3_000_000
    gpu.fixed_to_float(np.zeros(n, np.uint64), np.zeros(n, np.float32), 2.0**40)
    needed = -(-n // gpu.THREADS)
    assert launched == [("fixed_to_float", (needed,))]


def test_values16_names_the_formats_with_16_bit_values_and_row_scales():
    from mlemlib.compressed import LOSSY_FORMATS, VALUE_DTYPES, values16

    assert [f for f in VALUE_DTYPES if values16(f)] == ["compressed-f16", "compressed-u16"]
    assert not values16("compressed") and not values16("csr") and not values16("no-such-format")
    assert set(LOSSY_FORMATS) == {f for f in VALUE_DTYPES if values16(f)}  # equal today (see values16)


class _FakeDriver:
    """The four libcuda calls of persist_in_l2 / release_l2, recorded; ``fail`` names one that returns 1."""

    def __init__(self, fail=None):
        self.calls = []
        self.fail = fail

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            return 1 if name == self.fail else 0

        return call


def _l2_fakes(monkeypatch, max_aside=32_768_000, max_window=134_217_728, fail=None):
    """persist_in_l2 on a fake device (its two attributes) and a fake driver: no GPU needed."""
    import ctypes
    from types import SimpleNamespace

    from mlemlib.backends import _compressed_cuda as gpu

    class _RuntimeError(Exception):
        pass

    attrs = {108: max_aside, 109: max_window}
    fake_cp = SimpleNamespace(cuda=SimpleNamespace(
        Device=_FakeDevice,
        runtime=SimpleNamespace(deviceGetAttribute=lambda attr, dev: attrs[attr], CUDARuntimeError=_RuntimeError)))
    driver = _FakeDriver(fail)
    monkeypatch.setattr(gpu, "cupy", lambda: fake_cp)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver)
    return gpu, driver


def _buffer(nbytes, ptr=0x7F0000000000):
    from types import SimpleNamespace

    return SimpleNamespace(nbytes=nbytes, data=SimpleNamespace(ptr=ptr))


@pytest.mark.parametrize(("nbytes", "window", "aside"), [
    (20_736_000, 20_736_000, 20_736_000),  # Matrix 3's fixed-point acc: fits the set-aside
    (50_000_000, 50_000_000, 32_768_000),  # above the set-aside: the hit ratio scaled down
    (200_000_000, 134_217_728, 32_768_000),  # above the largest window: the window capped
])
def test_l2_window_sizes_and_the_driver_calls(monkeypatch, nbytes, window, aside):
    """The set-aside is the window (at most the device's maximum), the hit ratio the part of the window it
    holds; the window struct reaches cuStreamSetAttribute as CUaccessPolicyWindow (hits persisting, misses
    streaming) after the earlier persisting lines are dropped."""
    import struct
    from types import SimpleNamespace

    gpu, drv = _l2_fakes(monkeypatch)
    got = gpu.persist_in_l2(SimpleNamespace(ptr=0x1234), _buffer(nbytes))
    assert got == {"window_bytes": window, "set_aside_bytes": aside, "hit_ratio": round(aside / window, 4),
                   "max_set_aside_bytes": 32_768_000}
    names = [c[0] for c in drv.calls]
    assert names == ["cuCtxResetPersistingL2Cache", "cuCtxSetLimit", "cuStreamSetAttribute"]
    limit, size = drv.calls[1][1]
    assert (limit.value, size.value) == (6, aside)  # CU_LIMIT_PERSISTING_L2_CACHE_SIZE
    stream, attr, value = drv.calls[2][1]
    assert (stream.value, attr.value) == (0x1234, 1)  # CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW
    base, num, hit, hit_prop, miss_prop = struct.unpack_from("<QQfii", bytes(value))
    assert (base, num, hit_prop, miss_prop) == (0x7F0000000000, window, 2, 1)
    assert hit == pytest.approx(aside / window, rel=1e-6)


def test_l2_window_falls_back_to_none_and_leaves_nothing_set(monkeypatch):
    """No window where the device allows none (set-aside maximum 0: MIG, MPS), where the driver refuses
    (the set-aside given back), or for an empty buffer; then release_l2 drops the
    lines and the set-aside."""
    from types import SimpleNamespace

    stream = SimpleNamespace(ptr=1)
    gpu, drv = _l2_fakes(monkeypatch, max_aside=0)
    assert gpu.persist_in_l2(stream, _buffer(1 << 20)) is None and drv.calls == []
    gpu, drv = _l2_fakes(monkeypatch, fail="cuStreamSetAttribute")
    assert gpu.persist_in_l2(stream, _buffer(1 << 20)) is None
    assert [c[0] for c in drv.calls][-1] == "cuCtxSetLimit" and drv.calls[-1][1][1].value == 0
    gpu, drv = _l2_fakes(monkeypatch)
    assert gpu.persist_in_l2(stream, _buffer(0)) is None and drv.calls == []
    gpu.release_l2()
    assert [c[0] for c in drv.calls] == ["cuCtxResetPersistingL2Cache", "cuCtxSetLimit"]
    assert drv.calls[-1][1][1].value == 0


def _spread_rows(w, p, u, m):
    """NumPy mirror of ``spread_rows`` in epilogue.cuh."""
    w = np.asarray(w, dtype=np.int64)
    if p == 1:
        return w
    units = -(-m // u)
    return ((w // u) * p) % units * u + w % u


@pytest.mark.parametrize("unit", [0, 1, 8, 32])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 64, 1000, 4097, 30030])
def test_spread_launch_order_takes_every_row_once(monkeypatch, unit, m):
    from mlemlib.backends import _compressed_cuda as gpu

    groups, (p, u) = gpu.spread(m, unit)
    assert gpu.spread(m) == gpu.spread(m, 0)  # the one passes' default: rows in order
    taken = _spread_rows(np.arange(groups), int(p), int(u), m)
    rows = taken[taken < m]  # the last unit's tail is no row
    assert np.array_equal(np.sort(rows), np.arange(m))
    if unit == 0:
        assert (int(p), int(u), groups) == (1, 1, m)
    if unit and m >= 1000:  # the units in flight together lie far apart, each unit's rows together
        assert int(p) > 1 and int(u) == unit and groups % unit == 0
        assert np.abs(np.diff(taken[: 16 * unit : unit])).min() > m // 10
        assert np.array_equal(taken[:unit], np.arange(unit) + taken[0])


def test_the_fused_correlation_takes_the_background_only_where_there_is_one():
    from mlemlib.backends import _cuda_kernels as ck

    g, bg = object(), object()
    assert ck.correlation_epilogue(g) == {"mode": ck.MODE_CORR, "aux0": g}
    assert ck.correlation_epilogue(g, bg) == {"mode": ck.MODE_CORR_BG, "aux0": g, "aux1": bg}


def test_compressed_container_gives_a_row_range_into_the_callers_buffers(tmp_path):
    """CompressedH5 (no /indptr) answers row_pointer and read_rows_into from its decoded rows: the GPU upload's
    staging path takes a compressed file as CSR."""
    from mlemlib.formats import convert, open_matrix, write_matrix_h5

    a = sp.random(500, 300, density=0.05, format="csr", dtype=np.float32, random_state=1)
    write_matrix_h5(tmp_path / "a.h5", CSRMatrix.from_scipy(a))
    convert(tmp_path / "a.h5", tmp_path / "c.h5", fmt="compressed")
    with open_matrix(tmp_path / "c.h5") as c:
        ip, base = c.row_pointer(100, 200)
        assert base == a.indptr[100]
        np.testing.assert_array_equal(ip, a.indptr[100:201] - a.indptr[100])
        idx, val = np.zeros(ip[-1] + 2, np.int32), np.zeros(ip[-1] + 2, np.float32)
        np.testing.assert_array_equal(c.read_rows_into(100, 200, idx, val), ip)
        np.testing.assert_array_equal(idx[: ip[-1]], a[100:200].indices)
        np.testing.assert_array_equal(val[: ip[-1]], a[100:200].data)  # compressed (lossless) keeps float32


def test_fingerprint_of_a_container_reads_no_codes(tmp_path, monkeypatch):
    """A compressed container's fingerprint hashes its checksum and stored slot pointer: it reads no code (the
    element row pointer would mean every code, a fifth of the file); it is the same for the same file and differs
    for another matrix."""
    from mlemlib.provenance import matrix_fingerprint

    p1, p2 = tmp_path / "a.h5", tmp_path / "b.h5"
    write_compressed_h5(p1, CompressedMatrix.from_csr(random_csr(300, 800, 51), "compressed"))
    write_compressed_h5(p2, CompressedMatrix.from_csr(random_csr(300, 800, 52), "compressed"))

    def no_codes(self):
        raise AssertionError("the fingerprint read every code")

    monkeypatch.setattr(CompressedH5, "read_indptr", no_codes)
    with CompressedH5(p1) as a, CompressedH5(p1) as again, CompressedH5(p2) as b:
        assert matrix_fingerprint(a) == matrix_fingerprint(again) != matrix_fingerprint(b)


@pytest.mark.parametrize(("slots", "piece"), [
    (6_233_060_612, 1 << 26),  # Matrix 3 on one GPU
    (3_116_541_592, 1 << 25),  # a GPU's half
    (1_558_000_000, 1 << 24),  # a GPU's quarter
    (10_000, 1 << 22), (0, 1 << 22),
])
def test_upload_piece_keeps_many_pieces(slots, piece):
    """At least UPLOAD_PIECES pieces of a power of two of slots, within [UPLOAD_MIN_PIECE, UPLOAD_CHUNK_NNZ]."""
    from mlemlib.backends import _compressed_cuda as gpu

    assert gpu.upload_piece(slots) == piece


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_encoded_into_equals_read_encoded(tmp_path, fmt):
    """The rows read into the caller's buffers are read_encoded's, checked alike; check=False leaves the
    columns and values (nnz 0) and still refuses a bad row scale; short buffers are a ValueError."""
    from mlemlib.compressed import CODE_DTYPES, VALUE_DTYPES

    c = CompressedMatrix.from_csr(random_csr(300, 800, 61), fmt)
    path = tmp_path / "m.h5"
    write_compressed_h5(path, c)
    with CompressedH5(path) as src:
        codes = np.empty(src.slots, dtype=CODE_DTYPES[src.code_bits])
        values = np.empty(src.slots, dtype=VALUE_DTYPES[fmt])
        want = src.read_encoded(41, 257)
        got = src.read_encoded_into(41, 257, codes, values)
        assert got.nnz == want.nnz and np.shares_memory(got.codes, codes)
        np.testing.assert_array_equal(got.codes, want.codes)
        np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8), np.asarray(want.values).view(np.uint8))
        assert src.read_encoded_into(41, 257, codes, values, check=False).nnz == 0
        with pytest.raises(ValueError, match="buffers"):
            src.read_encoded_into(0, 300, codes[:10], values)
    if fmt != "compressed":
        with h5py.File(path, "r+") as f:
            f["scale"][7] = np.nan
        with CompressedH5(path) as src, pytest.raises(MatrixFormatError, match=r"row scale nan of row 7"):
            src.read_encoded_into(0, 300, codes, values, check=False)
