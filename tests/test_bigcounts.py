"""Counts above 2**32: row pointers, file positions, slot offsets and plan offsets stay exact.

A real matrix with more than 2**32 elements (34 GB as CSR) does not fit a
test. Instead, the writers' element counters are patched forward past 2**32,
so that a small tail of real rows lands at file positions beyond 2**32 in
files whose first row (never written: HDF5 reads unwritten chunks as the fill
value 0, a sparse file holds zeros) holds the 2**32 elements before it. The
readers, the compressed format's two-level row pointer, the partition plan
and the Numba kernels then handle the real tail at those offsets; every file
stays a few MB on disk.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlemlib.compressed import CompressedMatrix
from mlemlib.formats.compressed_h5 import CompressedH5, CompressedH5Writer
from mlemlib.formats.h5 import MatrixH5, MatrixH5Writer
from mlemlib.matrix import CSRMatrix
from mlemlib.partition import make_plan, partition_file, read_plan, split_transpose

BIG = 2**32 + 5  # elements before the tail: past every 32-bit count


def tail_block(rng, rows: int = 70, n: int = 500) -> CSRMatrix:
    counts = rng.integers(0, 12, size=rows)
    indptr = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    cols = [np.sort(rng.choice(n, size=c, replace=False)) for c in counts]
    indices = np.concatenate(cols).astype(np.int32) if cols else np.zeros(0, np.int32)
    data = rng.uniform(0.01, 1.0, size=int(indptr[-1])).astype(np.float32)
    return CSRMatrix(indptr, indices, data, (rows, n))


def same(a: CSRMatrix, b: CSRMatrix) -> None:
    assert a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a.indptr) - a.indptr[0], np.asarray(b.indptr) - b.indptr[0])
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.data, b.data)


def test_csr_container_beyond_2_32_elements(tmp_path, rng):
    tail = tail_block(rng)
    m, n = tail.shape[0] + 1, tail.shape[1]
    path = tmp_path / "big.h5"
    with MatrixH5Writer(path, (m, n), BIG + tail.nnz, source="test") as w:
        w._f["indptr"][1] = BIG  # row 0: BIG elements, never written (the fill value: column 0, value 0)
        w._rows, w._written = 1, BIG  # the patched counters: the tail's file positions lie past 2**32
        w.write_rows(tail)
    assert path.stat().st_size < 50 * 2**20  # sparse: only the tail's chunks exist
    with MatrixH5(path) as f:
        assert f.nnz == BIG + tail.nnz
        indptr = f.read_indptr()
        assert indptr.dtype == np.int64 and int(indptr[1]) == BIG and int(indptr[-1]) == BIG + tail.nnz
        same(f.read_rows(1, m), tail)
        same(f.read_rows(m - 3, m), CSRMatrix(tail.indptr[-4:], tail.indices[tail.indptr[-4]:],
                                              tail.data[tail.indptr[-4]:], (3, n)))
    # the partition stage reads only the row pointer: its plan's offsets are exact int64 / JSON ints
    plan = partition_file(path, None, 3, tmp_path / "parts-3")
    assert plan["nnz"] == BIG + tail.nnz and sum(plan["nnz_per_part"]) == plan["nnz"]
    assert plan["rows"][0] == [0, 1] and plan["nnz_offsets"][1] == BIG  # row 0 alone is a third
    assert all(o > 2**32 for o in plan["nnz_offsets"][1:])
    raw = json.loads((tmp_path / "parts-3" / "plan.json").read_text())
    assert raw["nnz_offsets"] == plan["nnz_offsets"] and isinstance(raw["nnz_offsets"][2], int)
    # and the part read back through its reference is the tail's rows
    r0, r1 = plan["rows"][2]
    with MatrixH5(path) as f:
        block = f.read_rows(r0, r1)
    lo = int(tail.indptr[r0 - 1])
    assert block.nnz == plan["nnz_per_part"][2]
    np.testing.assert_array_equal(block.indices, tail.indices[lo : lo + block.nnz])


def test_compressed_container_beyond_2_32_slots(tmp_path, rng):
    """rowbase (int64) carries offsets past 2**32; rowoff (uint32) stays relative to its 64-row block."""
    BIG4 = 2**32 + 8  # slot offsets of version 2 are multiples of 4
    tail = tail_block(rng, rows=150)
    head = 128  # rows 63 and 127 hold the 2**32 + 8 unwritten slots (2**31 and 2**31 + 8: rows start at multiples of 4 slots)
    m, n = head + tail.shape[0], tail.shape[1]
    path = tmp_path / "big_c.h5"
    with CompressedH5Writer(path, (m, n), BIG4 + tail.nnz, fmt="compressed", source="test") as w:
        w._rowbase[1] = 2**31  # rows 64..127 start at slot 2**31
        w._rows, w._written, w._slots = head, BIG4, BIG4
        w.write_rows(tail)
    assert path.stat().st_size < 50 * 2**20
    with CompressedH5(path) as f:
        assert f.slots >= BIG4 + tail.nnz  # plus the tail's markers
        sp = f.read_slotptr(head - 1, m)
        assert int(sp[0]) == 2**31 and int(sp[1]) == BIG4 and sp.dtype == np.int64
        same(f.read_rows(head, m), tail)
        enc = f.read_encoded(head, m)
        same(enc.to_csr(), tail)
        same(f.read_rows(head + 70, m), CSRMatrix(tail.indptr[70:], tail.indices[tail.indptr[70]:],
                                                  tail.data[tail.indptr[70]:], (tail.shape[0] - 70, n)))


def test_compressed_writer_limit_is_patchable_and_refuses_with_one_line(tmp_path, rng, monkeypatch):
    import mlemlib.formats.compressed_h5 as ch5
    from mlemlib.errors import MatrixFormatError

    monkeypatch.setattr(ch5, "MAX_BLOCK_SLOTS", 40)  # a 64-row block may hold 40 slots
    tail = tail_block(rng, rows=64)
    assert tail.nnz > 40
    with pytest.raises(MatrixFormatError, match="spans more than 40 slots .* store this matrix as csr"):
        ch5.write_compressed_h5(tmp_path / "x.h5", tail)
    assert not (tmp_path / "x.h5").exists()


def test_kernels_take_blocks_whose_offsets_pass_2_32(rng):
    """Row blocks may start anywhere: a block at element 2**33 encodes, decodes and splits like one at 0."""
    tail = tail_block(rng, rows=40, n=300)
    shifted = CSRMatrix(tail.indptr + 2**33, tail.indices, tail.data, tail.shape)
    # the compressed encoder reads indptr[r] - indptr[0] with int64 arithmetic
    a, b = CompressedMatrix.from_csr(tail), CompressedMatrix.from_csr(shifted)
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.slotptr(), b.slotptr())
    same(b.to_csr(), tail)
    # the transpose split used by the partition stage (sorted rows of A^T, block starting past 2**32)
    bounds = np.array([0, 100, 180, 300], dtype=np.int64)
    for p, q in zip(split_transpose(tail, bounds), split_transpose(shifted, bounds, row0=2**33)):
        same(p, q)


def test_plan_of_a_matrix_with_1e12_elements():
    """make_plan on a row pointer alone: counts past 2**40 stay exact integers through JSON."""
    rows = 1000
    indptr = np.arange(rows + 1, dtype=np.int64) * (2**30 + 7)
    plan = make_plan(indptr, None, 7, (rows, 5))
    assert plan["nnz"] == rows * (2**30 + 7) > 2**39
    assert sum(plan["nnz_per_part"]) == plan["nnz"]
    assert plan["nnz_offsets"] == [int(indptr[r0]) for r0, _ in plan["rows"]]
    back = json.loads(json.dumps(plan))
    assert back["nnz_offsets"] == plan["nnz_offsets"]


def test_read_plan_accepts_offsets_past_2_32(tmp_path):
    rows = 10
    indptr = np.arange(rows + 1, dtype=np.int64) * 2**31
    plan = make_plan(indptr, None, 4, (rows, 3))
    plan.update(matrix="matrix.h5", paths="relative to the plan's directory")
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    got = read_plan(tmp_path)
    assert got["nnz_offsets"][-1] > 2**32 and got["nnz"] == 10 * 2**31


def test_csr4_beyond_2_32_elements(tmp_path, rng):
    """A sparse .csr4 whose row 0 holds 2**32 + 5 zero elements: the tail is read at byte 8 * 2**32 and on."""
    from mlemlib.formats.csr4 import Csr4File, Csr4Writer, ScannerGeometry

    tail = tail_block(rng, rows=20, n=500)
    m, n = tail.shape[0] + 1, tail.shape[1]
    geo = ScannerGeometry(layers=[(2.0, 2.0, 6.0, 30.0, 0.0)], n_blocks=12, block_size=1, block_gaps=[],
                          n_rings=1, ring_gaps=[], voxel_size=(1.0, 1.0, 1.0), grid=(n, 1, 1))
    path = tmp_path / "big.csr4"
    w = Csr4Writer(path, m, n, BIG + tail.nnz, scanner_block=geo.to_bytes())
    with w:
        if w._tmp.stat().st_blocks * 512 > 2**30:  # the file system does not keep the hole sparse
            w.abort()
            pytest.skip("no sparse files on this file system")
        w._f.seek(w._ends_offset)
        w._f.write(np.array([BIG], dtype="<u8").tobytes())  # row 0 ends at BIG (its elements: zero bytes)
        w._rows, w._written = 1, BIG
        w.write_rows(tail)
    with Csr4File(path) as f:
        assert f.nnz == BIG + tail.nnz
        same(f.read_rows(1, m), tail)
        assert int(f.read_indptr()[1]) == BIG
