"""Tests of mlemlib.formats: readers, writers, validation, convert/info and their CLI.

Test files are encoded by hand here (struct/numpy/h5py, independently of the
library's writers) so the readers are checked against an independent encoding,
and the writers against the bytes the readers accept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import scipy.io
import scipy.sparse as sp

from mlemlib.cli import main
from mlemlib.errors import MatrixFormatError, SinogramFormatError
from mlemlib.formats import (
    Csr4File,
    Csr4Writer,
    MatrixH5,
    MatrixH5Writer,
    ScannerGeometry,
    convert,
    file_kind,
    info,
    open_matrix,
    read_lmsino,
    read_mtx,
    read_npz,
    write_csr4,
    write_lmsino,
    write_matrix_h5,
)
from mlemlib.formats.h5 import CHECKSUM_METHOD
from mlemlib.matrix import CSRMatrix

GRID = (4, 3, 2)
N = 24  # = prod(GRID)
VOXEL = (1.5, 1.5, 2.0)

# --------------------------------------------------------------------------- hand encoders


def scanner_bytes(grid=GRID, voxel=VOXEL, n_layers=1, block_size=3, n_rings=2) -> bytes:
    """A scanner block, encoded field by field as csr4.md describes."""
    b = struct.pack("<I", n_layers)
    for k in range(n_layers):
        b += struct.pack("<5f", 2.0, 2.0, 10.0 + k, 50.0 + 10 * k, 0.096)
    b += struct.pack("<II", 8, block_size)
    b += struct.pack(f"<{block_size - 1}f", *[0.25 * (i + 1) for i in range(block_size - 1)])
    b += struct.pack("<I", n_rings)
    b += struct.pack(f"<{n_rings - 1}f", *[0.5] * (n_rings - 1))
    b += struct.pack("<3f", *voxel)
    b += struct.pack("<3I", *grid)
    return b


def encode_csr4(
    indptr,
    cols,
    vals,
    m,
    n=N,
    *,
    scanner: bytes | None = None,
    magic=b"PCSR",
    version=4,
    flags=0,
    nnz=None,
    s_field=None,
    ends=None,
) -> bytes:
    """Encode a .csr4 file with struct: header, scanner block, row ends, (col, val) pairs."""
    scanner = scanner_bytes() if scanner is None else scanner
    nnz = len(cols) if nnz is None else nnz
    s_field = len(scanner) if s_field is None else s_field
    out = magic + struct.pack("<BBHIIQI", version, flags, 0, m, n, nnz, s_field) + scanner
    ends = list(indptr[1:]) if ends is None else ends
    out += b"".join(struct.pack("<Q", int(e)) for e in ends)
    out += b"".join(struct.pack("<If", int(c), float(v)) for c, v in zip(cols, vals))
    return out


def reference_matrix(m=13, n=N, seed=7) -> sp.csr_matrix:
    """A float32 matrix with empty rows at the start, middle (a run of two) and end."""
    rng = np.random.default_rng(seed)
    dense = rng.random((m, n)).astype(np.float32)
    dense[dense < 0.7] = 0
    dense[[0, 5, 6, m - 1]] = 0
    dense[3, 7] = 0.0  # an explicit zero must survive as a stored element below
    a = sp.csr_matrix(dense)
    a.sort_indices()
    return a


def write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.fixture
def ref() -> sp.csr_matrix:
    return reference_matrix()


@pytest.fixture
def csr4_file(tmp_path, ref) -> Path:
    return write_bytes(tmp_path / "a.csr4", encode_csr4(ref.indptr, ref.indices, ref.data, ref.shape[0], flags=5))


def h5_by_hand(path: Path, indptr, indices, data, attrs: dict | None = None, *, dtypes=("<i8", "<i4", "<f4")) -> Path:
    """Write a container with plain h5py (no library code)."""
    indptr = np.asarray(indptr)
    with h5py.File(path, "w") as f:
        f.create_dataset("indptr", data=np.asarray(indptr, dtype=dtypes[0]))
        f.create_dataset("indices", data=np.asarray(indices, dtype=dtypes[1]))
        f.create_dataset("data", data=np.asarray(data, dtype=dtypes[2]))
        base = {
            "format": "mlem-csr",
            "version": 1,
            "shape": np.array([len(indptr) - 1, N]),
            "nnz": len(indices),
            "source": "hand",
            "checksum": "0" * 64,
        }
        base.update(attrs or {})
        for k, v in base.items():
            if v is not None:
                f.attrs[k] = v
    return path


def independent_checksum(indptr, indices, data, *, piece: int = 1 << 20) -> str:
    """The checksum as docs/formats.md defines it ("sha256-tree/2"), computed directly with hashlib."""

    def tree(a, dt) -> bytes:
        b = np.asarray(a, dtype=dt)
        digests = [hashlib.sha256(b[k : k + piece].tobytes()).digest() for k in range(0, len(b), piece)]
        return hashlib.sha256(b"".join(digests)).digest()

    parts = [tree(a, dt) for a, dt in ((indptr, "<i8"), (indices, "<i4"), (data, "<f4"))]
    return hashlib.sha256(b"".join(parts)).hexdigest()


def legacy_checksum(indptr, indices, data) -> str:
    """The checksum of containers written before the tree (BLAKE2b of each whole array), with hashlib."""
    parts = [
        hashlib.blake2b(np.asarray(a, dtype=dt).tobytes(), digest_size=32).digest()
        for a, dt in ((indptr, "<i8"), (indices, "<i4"), (data, "<f4"))
    ]
    return hashlib.blake2b(b"".join(parts), digest_size=32).hexdigest()


def assert_csr_equal(got: CSRMatrix, want: sp.csr_matrix) -> None:
    assert got.shape == want.shape
    assert got.indptr.dtype == np.int64 and got.indices.dtype == np.int32 and got.data.dtype == np.float32
    np.testing.assert_array_equal(got.indptr, want.indptr)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.data, want.data)


# --------------------------------------------------------------------------- csr4


def test_csr4_reader_matches_hand_encoding(csr4_file, ref):
    with Csr4File(csr4_file) as f:
        assert f.shape == (13, N)
        assert f.nnz == ref.nnz
        assert f.header.flags == 5
        assert f.header.scanner_block == scanner_bytes()
        assert f.header.data_offset == 28 + len(scanner_bytes())
        assert f.grid == GRID
        assert f.voxel_size == VOXEL
        g = f.geometry
        assert g.n_blocks == 8 and g.block_size == 3 and g.block_gaps == [0.25, 0.5]
        assert g.n_rings == 2 and g.ring_gaps == [0.5]
        assert len(g.layers) == 1 and g.layers[0][:4] == (2.0, 2.0, 10.0, 50.0)
        full = f.to_csr()
    assert_csr_equal(full, ref)
    np.testing.assert_array_equal(full.to_scipy().toarray(), ref.toarray())


def test_scanner_geometry_round_trip():
    b = scanner_bytes(n_layers=2, block_size=4, n_rings=3)
    g = ScannerGeometry.from_bytes(b, "x")
    assert len(g.layers) == 2 and g.block_gaps == [0.25, 0.5, 0.75] and g.ring_gaps == [0.5, 0.5]
    assert g.to_bytes() == b
    assert g.n_voxels == N


@pytest.mark.parametrize("max_nnz", [1, 4, 10_000])
def test_csr4_read_write_is_byte_identical(csr4_file, tmp_path, max_nnz):
    original = csr4_file.read_bytes()
    out = tmp_path / "copy.csr4"
    with (
        Csr4File(csr4_file) as f,
        Csr4Writer(out, *f.shape, f.nnz, scanner_block=f.header.scanner_block, flags=f.header.flags) as w,
    ):
        for _, _, block in f.iter_chunks(max_nnz):
            w.write_rows(block)
    assert out.read_bytes() == original
    out2 = tmp_path / "copy2.csr4"
    with Csr4File(csr4_file) as f:
        write_csr4(out2, f.to_csr(), scanner_block=f.header.scanner_block, flags=5, max_nnz=max_nnz)
    assert out2.read_bytes() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csr4", "copy.csr4", "copy2.csr4"]


def test_csr4_writer_incomplete_leaves_nothing(tmp_path, ref):
    out = tmp_path / "w.csr4"
    w = Csr4Writer(out, 13, N, ref.nnz, scanner_block=scanner_bytes())
    w.write_rows(CSRMatrix(ref.indptr[:4], ref.indices[: ref.indptr[3]], ref.data[: ref.indptr[3]], (3, N)))
    with pytest.raises(MatrixFormatError, match=r"w\.csr4: writer closed after 3 of 13 rows"):
        w.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="boom"), Csr4Writer(out, 13, N, ref.nnz, scanner_block=scanner_bytes()):
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_csr4_writer_rejects_scanner_grid_mismatch(tmp_path):
    with pytest.raises(MatrixFormatError, match=r"w\.csr4: scanner block grid .* disagrees with n = 25"):
        Csr4Writer(tmp_path / "w.csr4", 2, 25, 0, scanner_block=scanner_bytes())
    assert list(tmp_path.iterdir()) == []


def test_csr4_writer_rejects_invalid_block(tmp_path):
    out = tmp_path / "w.csr4"
    with (
        pytest.raises(MatrixFormatError, match=r"w\.csr4: negative value -1.0 at element 1"),
        Csr4Writer(out, 1, N, 2, scanner_block=scanner_bytes()) as w,
    ):
        w.write_rows(CSRMatrix([0, 2], [1, 2], [0.5, -1.0], (1, N)))
    assert list(tmp_path.iterdir()) == []


def test_csr4_range_read_only_validates_the_range(tmp_path, ref):
    """A NaN in row 9 does not stop reading rows 0..9, and reading it names its global element."""
    data = ref.data.copy()
    k = int(ref.indptr[9]) + 1
    data[k] = np.nan
    p = write_bytes(tmp_path / "nan.csr4", encode_csr4(ref.indptr, ref.indices, data, 13))
    with Csr4File(p) as f:
        assert_csr_equal(f.read_rows(0, 9), ref[0:9])
        with pytest.raises(MatrixFormatError, match=rf"nan\.csr4: non-finite value nan at element {k}$"):
            f.read_rows(8, 11)
        block = f.read_rows(9, 10, validate=False)
        assert np.isnan(block.data[1])


# --------------------------------------------------------------------------- row ranges and chunks (every reader)


@pytest.fixture(params=["csr4", "h5", "npz", "mtx"])
def reader(request, tmp_path, ref):
    kind = request.param
    if kind == "csr4":
        p = write_bytes(tmp_path / "m.csr4", encode_csr4(ref.indptr, ref.indices, ref.data, 13))
    elif kind == "h5":
        p = h5_by_hand(tmp_path / "m.h5", ref.indptr, ref.indices, ref.data)
    elif kind == "npz":
        p = tmp_path / "m.npz"
        sp.save_npz(p, ref)
    else:
        p = tmp_path / "m.mtx"
        scipy.io.mmwrite(p, ref)
    with open_matrix(p) as r:
        yield r


RANGES = [(0, 13), (0, 1), (12, 13), (5, 7), (4, 8), (0, 0), (13, 13), (6, 6), (1, 12), (3, 4)]


@pytest.mark.parametrize(("start", "stop"), RANGES)
def test_read_rows_equals_slice(reader, ref, start, stop):
    block = reader.read_rows(start, stop)
    want = ref[start:stop]
    assert block.shape == (stop - start, N)
    np.testing.assert_array_equal(block.to_scipy().toarray(), want.toarray())
    assert block.indptr[0] == 0 and block.nnz == want.nnz
    np.testing.assert_array_equal(block.indptr, want.indptr)


@pytest.mark.parametrize(("start", "stop"), RANGES)
def test_read_rows_into_fills_the_front_of_the_buffers(reader, ref, start, stop):
    """The columns and values of the rows land at the front of the caller's buffers (the rest untouched); the
    row pointer from 0 says how many; buffers too short for the range are refused before any read."""
    want = ref[start:stop]
    idx = np.full(want.nnz + 3, -7, dtype=np.int32)
    val = np.full(want.nnz + 3, -7, dtype=np.float32)
    indptr = reader.read_rows_into(start, stop, idx, val)
    np.testing.assert_array_equal(indptr, want.indptr)
    ip, base = reader.row_pointer(start, stop)
    np.testing.assert_array_equal(ip, want.indptr)
    assert base == ref.indptr[start]
    np.testing.assert_array_equal(idx[: want.nnz], want.indices)
    np.testing.assert_array_equal(val[: want.nnz], want.data)
    assert (idx[want.nnz :] == -7).all() and (val[want.nnz :] == -7).all()
    if want.nnz:
        with pytest.raises(ValueError, match=f"cannot hold {want.nnz}"):
            reader.read_rows_into(start, stop, idx[: want.nnz - 1], val)


def test_iter_chunks_reads_the_next_block_while_the_caller_works(reader, monkeypatch):
    """Block k + 1 is read on a helper thread while the caller holds block k; stopping early leaves no thread."""
    import threading
    import time

    events = []
    real = type(reader).read_rows

    def read_rows(self, r0, r1, **kw):
        events.append(("read", r0, threading.current_thread() is threading.main_thread()))
        return real(self, r0, r1, **kw)

    monkeypatch.setattr(type(reader), "read_rows", read_rows)
    # Another test's abandoned reader (held by a kept traceback until the next garbage collection) may still
    # have its helper; only this reader's is asserted on.
    before = set(threading.enumerate())
    it = reader.iter_chunks(2)
    r0, _, _ = next(it)
    events.append(("use", r0, True))
    deadline = time.monotonic() + 10
    while len([e for e in events if e[0] == "read"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)  # the read-ahead of block 1 runs while block 0 is in use
    reads = [e for e in events if e[0] == "read"]
    assert len(reads) == 2 and not any(on_main for _, _, on_main in reads)
    it.close()  # the helper is joined
    assert not [t for t in threading.enumerate() if t.name.startswith("read-ahead") and t not in before]


def test_read_rows_rejects_bad_range(reader):
    for start, stop in [(-1, 2), (3, 2), (0, 14)]:
        with pytest.raises(IndexError, match="row range"):
            reader.read_rows(start, stop)


@pytest.mark.parametrize("max_nnz", [1, 2, 5, 17, 10**9])
def test_iter_chunks_covers_every_row_once(reader, ref, max_nnz):
    chunks = list(reader.iter_chunks(max_nnz))
    rows = [r for r0, r1, _ in chunks for r in range(r0, r1)]
    assert rows == list(range(13))
    row_nnz = np.diff(ref.indptr)
    for r0, r1, block in chunks:
        assert block.shape == (r1 - r0, N)
        assert block.nnz == row_nnz[r0:r1].sum()
        assert block.nnz <= max_nnz or r1 - r0 == 1  # only a single long row may exceed
    stacked = sp.vstack([b.to_scipy() for _, _, b in chunks]).tocsr()
    assert (stacked != ref).nnz == 0
    if max_nnz >= ref.nnz:
        assert len(chunks) == 1


# --------------------------------------------------------------------------- h5 container


def test_h5_round_trip_attrs_and_checksum(tmp_path, ref):
    p = tmp_path / "m.h5"
    mat = CSRMatrix.from_scipy(ref)
    digest = write_matrix_h5(
        p,
        mat,
        source="a.csr4",
        grid=GRID,
        voxel_size=VOXEL,
        scanner_block=scanner_bytes(),
        kind="transpose",
        method="scantrans",
    )
    assert digest == independent_checksum(ref.indptr, ref.indices, ref.data)
    with h5py.File(p, "r") as f:  # layout checked with plain h5py
        assert f["indptr"].dtype == np.int64 and f["indices"].dtype == np.int32 and f["data"].dtype == np.float32
        assert f["data"].chunks is not None and f["data"].compression is None
        assert f.attrs["format"] == "mlem-csr" and f.attrs["version"] == 1
        assert list(f.attrs["shape"]) == [13, N] and f.attrs["nnz"] == ref.nnz
        assert f.attrs["checksum"] == digest
    with MatrixH5(p) as r:
        assert_csr_equal(r.to_csr(), ref)
        assert r.grid == GRID and r.voxel_size == VOXEL
        assert r.scanner_block == scanner_bytes()
        assert r.attrs["kind"] == "transpose" and r.attrs["method"] == "scantrans" and r.attrs["source"] == "a.csr4"
        np.testing.assert_array_equal(r.read_indptr(), ref.indptr)
        r.verify_checksum()


@pytest.mark.parametrize("block_rows", [1, 3, 13])
def test_h5_streaming_writer_matches_one_shot(tmp_path, ref, block_rows):
    p = tmp_path / "s.h5"
    with MatrixH5Writer(p, ref.shape, ref.nnz, source="x") as w:
        for r0 in range(0, 13, block_rows):
            w.write_rows(CSRMatrix.from_scipy(ref[r0 : r0 + block_rows]))
    assert w.checksum == independent_checksum(ref.indptr, ref.indices, ref.data)
    with MatrixH5(p) as r:
        assert_csr_equal(r.to_csr(), ref)
        assert r.checksum == w.checksum


def test_write_functions_split_a_row_block_of_a_larger_matrix(tmp_path, ref):
    # rows 2..10 of ref as a block whose row pointer starts mid-matrix, written in pieces of <= 3 elements
    lo, hi = ref.indptr[2], ref.indptr[11]
    block = CSRMatrix(ref.indptr[2:12], ref.indices[lo:hi], ref.data[lo:hi], (9, N))
    expected = ref[2:11]
    digest = write_matrix_h5(tmp_path / "b.h5", block, max_nnz=3)
    assert digest == independent_checksum(expected.indptr, expected.indices, expected.data)
    write_csr4(tmp_path / "b.csr4", block, scanner_block=scanner_bytes(), max_nnz=3)
    with MatrixH5(tmp_path / "b.h5") as a, Csr4File(tmp_path / "b.csr4") as b:
        assert_csr_equal(a.to_csr(), expected)
        assert_csr_equal(b.to_csr(), expected)


def test_h5_checksum_detects_corruption(tmp_path, ref):
    p = tmp_path / "m.h5"
    write_matrix_h5(p, CSRMatrix.from_scipy(ref))
    with h5py.File(p, "r+") as f:
        f["data"][3] = f["data"][3] + 1.0
    with MatrixH5(p) as r, pytest.raises(MatrixFormatError, match=r"m\.h5: checksum mismatch"):
        r.verify_checksum()
    out = tmp_path / "out.h5"
    with pytest.raises(MatrixFormatError, match=r"m\.h5: checksum mismatch"):
        convert(p, out)
    assert not out.exists()


@pytest.mark.parametrize("block_rows", [1, 4, 13])
def test_h5_checksum_pieces_span_row_blocks(tmp_path, ref, block_rows, monkeypatch):
    # pieces of 5 elements hashed on the pool threads (nothing inline): piece boundaries fall inside
    # blocks and across them, and the digests still come in piece order
    from mlemlib.formats import h5 as h5mod

    monkeypatch.setattr(h5mod, "CHECKSUM_PIECE", 5)
    monkeypatch.setattr(h5mod, "_INLINE_BYTES", 0)
    want = independent_checksum(ref.indptr, ref.indices, ref.data, piece=5)
    assert want != independent_checksum(ref.indptr, ref.indices, ref.data)  # the piece size matters
    p = tmp_path / "s.h5"
    with MatrixH5Writer(p, ref.shape, ref.nnz) as w:
        for r0 in range(0, 13, block_rows):
            w.write_rows(CSRMatrix.from_scipy(ref[r0 : r0 + block_rows]))
    assert w.checksum == want
    assert h5mod.checksum_arrays(ref.indptr, ref.indices, ref.data) == want
    monkeypatch.setattr(h5mod, "_HASH_PIECE", 3)  # verification reads pieces of 3 elements
    with MatrixH5(p) as r:
        assert r.compute_checksum() == want


def legacy_container(path: Path, ref, *, corrupt: bool = False) -> Path:
    """A container as versions before the tree checksum wrote it (plain h5py, BLAKE2b checksum)."""
    from mlemlib.formats.h5 import LEGACY_CHECKSUM_METHOD

    data = ref.data.copy()
    checksum = legacy_checksum(ref.indptr, ref.indices, data)
    if corrupt:
        data[2] += 1.0
    return h5_by_hand(path, ref.indptr, ref.indices, data,
                      {"checksum": checksum, "checksum_method": LEGACY_CHECKSUM_METHOD, "nnz": ref.nnz})


def test_h5_legacy_checksum_verified_and_converted_to_the_tree(tmp_path, ref):
    old = legacy_container(tmp_path / "old.h5", ref)
    with MatrixH5(old) as r:
        r.verify_checksum()
    s = convert(old, tmp_path / "new.h5")
    assert s["checksum"] == independent_checksum(ref.indptr, ref.indices, ref.data)
    with MatrixH5(tmp_path / "new.h5") as r:
        assert r.checksum_method.startswith("sha256-tree/2")
        r.verify_checksum()
    bad = legacy_container(tmp_path / "bad.h5", ref, corrupt=True)
    with MatrixH5(bad) as r, pytest.raises(MatrixFormatError, match=r"bad\.h5: checksum mismatch"):
        r.verify_checksum()
    with pytest.raises(MatrixFormatError, match=r"bad\.h5: checksum mismatch"):
        convert(bad, tmp_path / "out.h5")
    assert not (tmp_path / "out.h5").exists()


def test_h5_unknown_checksum_method_refused(tmp_path, ref):
    p = h5_by_hand(tmp_path / "u.h5", ref.indptr, ref.indices, ref.data,
                   {"checksum_method": "crc32 of everything", "nnz": ref.nnz})
    with pytest.raises(MatrixFormatError, match=r"u\.h5: unknown checksum_method 'crc32 of everything'"):
        MatrixH5(p)


def test_h5_writer_rejects_reserved_attr(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        MatrixH5Writer(tmp_path / "x.h5", (1, N), 0, checksum="abc")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["csr4", "csr", "compressed", "compressed-u16"])
def test_writers_learn_an_unknown_element_count_from_the_blocks(tmp_path, ref, kind):
    """nnz=None (the generator's one pass): the same file as with the count given, or nothing if incomplete."""
    from mlemlib.formats.compressed_h5 import CompressedH5Writer

    def writer(path, nnz):
        if kind == "csr4":
            return Csr4Writer(path, 13, N, nnz, scanner_block=scanner_bytes())
        if kind == "csr":
            return MatrixH5Writer(path, ref.shape, nnz)
        return CompressedH5Writer(path, ref.shape, nnz, fmt=kind)

    ext = "csr4" if kind == "csr4" else "h5"
    for name, nnz in (("known", ref.nnz), ("unknown", None)):
        with writer(tmp_path / f"{name}.{ext}", nnz) as w:
            for r0 in range(0, 13, 4):
                w.write_rows(CSRMatrix.from_scipy(ref[r0 : r0 + 4]))
        assert w.nnz == ref.nnz
    known, unknown = tmp_path / f"known.{ext}", tmp_path / f"unknown.{ext}"
    if kind == "csr4":
        assert unknown.read_bytes() == known.read_bytes()
    else:
        with open_matrix(known) as a, open_matrix(unknown) as b:
            assert b.nnz == a.nnz == ref.nnz and b.checksum == a.checksum
            b.verify_checksum()
            assert_csr_equal(b.to_csr(), a.to_csr().to_scipy())
    w = writer(tmp_path / f"short.{ext}", None)
    w.write_rows(CSRMatrix.from_scipy(ref[:5]))
    with pytest.raises(MatrixFormatError, match=rf"short\.{ext}: writer closed after 5 of 13 rows and \d+ elements"):
        w.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"known.{ext}", f"unknown.{ext}"]


def test_h5_writer_incomplete_leaves_nothing(tmp_path, ref):
    w = MatrixH5Writer(tmp_path / "x.h5", ref.shape, ref.nnz)
    w.write_rows(CSRMatrix.from_scipy(ref[:5]))
    with pytest.raises(MatrixFormatError, match=r"x\.h5: writer closed after 5 of 13 rows"):
        w.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["csr", "compressed"])
def test_h5_writers_keep_one_handle_per_dataset_and_close_it_with_the_file(tmp_path, ref, kind):
    """A handle made for each write is closed as soon as it is dropped, and on a full disk that close
    fails where nothing reports it (the writer went on writing); the writers keep one handle per
    dataset, which the file's close closes."""
    from mlemlib.formats.compressed_h5 import CompressedH5Writer

    name = "indices" if kind == "csr" else "codes"
    make = (lambda p: MatrixH5Writer(p, ref.shape, None)) if kind == "csr" else (
        lambda p: CompressedH5Writer(p, ref.shape, ref.nnz, fmt="compressed"))
    w = make(tmp_path / "ok.h5")
    w.write_rows(CSRMatrix.from_scipy(ref[:5]))
    ds = w._dataset(name)
    w.write_rows(CSRMatrix.from_scipy(ref[5:]))
    assert w._dataset(name) is ds and ds.id.valid  # the same open handle for every block
    if kind == "csr":
        w.nnz = ref.nnz
    w.close()
    assert not ds.id.valid and "_datasets" not in w.__dict__
    with open_matrix(tmp_path / "ok.h5") as f:
        assert (f.to_csr().to_scipy() != ref).nnz == 0
    # aborted on a bad block: the handles closed with the file, nothing left
    w = make(tmp_path / "bad.h5")
    w.write_rows(CSRMatrix.from_scipy(ref[:5]))
    ds = w._dataset(name)
    with pytest.raises(MatrixFormatError):
        w.write_rows(CSRMatrix.from_scipy(ref[:9]))  # 9 more rows: past m = 13
    w.abort()
    assert not ds.id.valid and sorted(p.name for p in tmp_path.iterdir()) == ["ok.h5"]


def test_h5_file_that_cannot_be_closed_is_kept_alive(tmp_path, ref, monkeypatch):
    """Where HDF5 cannot close the file being written (its close flushes; a full disk), the error
    propagates once, the temporary file goes, and the file's objects are kept referenced
    (`formats._check.ABANDONED`) instead of being dropped: dropped, each would try to close again
    and HDF5 crashes on that."""
    import errno

    from mlemlib.formats import _check

    w = MatrixH5Writer(tmp_path / "x.h5", ref.shape, ref.nnz)
    w.write_rows(CSRMatrix.from_scipy(ref))
    f, ds = w._f, w._dataset("data")
    real_close = f.close

    def full():
        raise OSError(errno.ENOSPC, "Can't close file (file write failed: ...)")

    monkeypatch.setattr(f, "close", full)
    before = len(_check.ABANDONED)
    with pytest.raises(OSError, match="Can't close file"):
        w.close()
    assert len(_check.ABANDONED) == before + 1 and _check.ABANDONED[-1][0] is f
    assert ds in _check.ABANDONED[-1][1].values() and ds.id.valid
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone
    w.abort()  # a second close is not tried
    assert len(_check.ABANDONED) == before + 1
    _check.ABANDONED.pop()
    real_close()  # this file is healthy: close it for real
    assert not ds.id.valid


def test_h5_close_that_fails_for_the_disk_is_an_os_error_of_the_output(tmp_path, ref, monkeypatch):
    """h5py raises a failed close (the last flush, on a full disk) as a RuntimeError whose text gives
    the errno; the writer makes it that OSError naming its output, so that `mlem` prints one line and
    ends as after any refused write, and keeps the file's objects alive."""
    from mlemlib.formats import _check

    w = MatrixH5Writer(tmp_path / "x.h5", ref.shape, ref.nnz)
    f = w._f
    real_close = f.close

    def full():
        raise RuntimeError("Can't close dataset (file write failed: time = ..., filename = 'x', file "
                           "descriptor = 4, errno = 28, error message = 'No space left on device', ...)")

    monkeypatch.setattr(f, "close", full)
    before = len(_check.ABANDONED)
    with pytest.raises(OSError) as err, w:
        w.write_rows(CSRMatrix.from_scipy(ref))
    assert (err.value.errno, err.value.strerror, err.value.filename) == (28, os.strerror(28), str(tmp_path / "x.h5"))
    assert isinstance(err.value.__cause__.__cause__, RuntimeError)
    assert len(_check.ABANDONED) == before + 1 and list(tmp_path.iterdir()) == []
    _check.ABANDONED.pop()
    real_close()
    # a failed close without an errno in its text stays what it was
    w = MatrixH5Writer(tmp_path / "y.h5", ref.shape, ref.nnz)
    f = w._f
    real_close = f.close
    monkeypatch.setattr(f, "close", lambda: (_ for _ in ()).throw(RuntimeError("Can't close file")))
    with pytest.raises(RuntimeError, match="Can't close file"), w:
        w.write_rows(CSRMatrix.from_scipy(ref))
    _check.ABANDONED.pop()
    real_close()


def test_mlem_ends_without_teardown_after_a_refused_write(tmp_path):
    """`mlem` (`cli.run`) after a write the disk refused ends the process at once, its output flushed:
    the interpreter's teardown would hand HDF5 the file it could not flush, and HDF5 crashes there
    (rc 139 after the error line). Any other failure exits normally."""
    script = """
import atexit, errno, sys
import mlemlib.cli as cli
atexit.register(lambda: print("teardown", flush=True))
def main(argv=None, _errno=int(sys.argv[1])):
    cli._refused_write = _errno in cli.REFUSED_WRITE
    print("mlem: error: out.h5: ...", file=sys.stderr)
    return 1
cli.main = main
cli.run()
"""
    for err, teardown in ((28, False), (122, False), (13, True)):  # ENOSPC, EDQUOT: at once; EACCES: normally
        proc = subprocess.run([sys.executable, "-c", script, str(err)], capture_output=True, text=True)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.strip() == "mlem: error: out.h5: ..."
        assert ("teardown" in proc.stdout) is teardown


def test_main_marks_only_refused_writes(tmp_path, monkeypatch, capsys):
    import errno

    from mlemlib import cli
    from mlemlib.cli import generate

    for err, refused in ((errno.ENOSPC, True), (errno.EFBIG, True), (errno.EACCES, False)):
        def fail(args, _err=err):
            raise OSError(_err, os.strerror(_err), str(tmp_path / "m.h5"))

        monkeypatch.setattr(generate, "run", fail)
        monkeypatch.setattr(cli, "_refused_write", not refused)  # main resets it
        assert main(["generate", "--preset", "small", "-o", str(tmp_path / "m.h5")]) == 1
        assert cli._refused_write is refused
        assert capsys.readouterr().err.strip() == f"mlem: error: {tmp_path / 'm.h5'}: {os.strerror(err)}"


def test_atomic_path_yields_a_fresh_name_and_renames_or_cleans_up(tmp_path):
    """The writers create their file at a name where none exists (opening an existing file with O_TRUNC
    makes ext4 write it back when it is closed); success renames it with the umask's mode, failure leaves
    the target as it was and no temporary file."""
    from mlemlib._io import atomic_path

    target = tmp_path / "out.h5"
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and not tmp.exists() and tmp.name.startswith(".out.h5.")
        with h5py.File(tmp, "x") as f:  # "x": fails if the name were taken
            f["a"] = np.arange(3)
    with h5py.File(target, "r") as f:
        assert f["a"][...].tolist() == [0, 1, 2]
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask
    with pytest.raises(RuntimeError, match="boom"), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.h5"]
    with h5py.File(target, "r") as f:
        assert f["a"][...].tolist() == [0, 1, 2]


def test_h5_empty_matrix(tmp_path):
    p = tmp_path / "e.h5"
    write_matrix_h5(p, CSRMatrix(np.zeros(4, np.int64), [], [], (3, N)))
    with MatrixH5(p) as r:
        assert r.shape == (3, N) and r.nnz == 0
        assert [c[:2] for c in r.iter_chunks(5)] == [(0, 3)]
        r.verify_checksum()


# --------------------------------------------------------------------------- other formats


def test_lmsino_round_trip(tmp_path):
    counts = np.array([0, 3, 7, 2**31 - 1, 12], dtype=np.int64)
    p = tmp_path / "g.LMsino"
    write_lmsino(p, counts)
    assert p.read_bytes() == struct.pack("<5i", *counts.tolist())
    got = read_lmsino(p, expected_length=5)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, counts)
    write_lmsino(p, np.array([1.0, 2.0]))
    np.testing.assert_array_equal(read_lmsino(p), [1, 2])


@pytest.mark.parametrize("bad", [np.array([1, -1]), np.array([0.5]), np.array([2**31]), np.zeros((2, 2), int)])
def test_write_lmsino_rejects_bad_counts(tmp_path, bad):
    with pytest.raises(ValueError):
        write_lmsino(tmp_path / "g.LMsino", bad)
    assert list(tmp_path.iterdir()) == []


def test_mtx_and_npz_readers(tmp_path, ref):
    mtx = tmp_path / "a.mtx"
    scipy.io.mmwrite(mtx, ref.astype(np.float64))
    assert_csr_equal(read_mtx(mtx), ref)
    for fmt in ("csr", "csc", "coo"):
        p = tmp_path / f"a_{fmt}.npz"
        sp.save_npz(p, ref.asformat(fmt))
        got = read_npz(p)
        np.testing.assert_array_equal(got.to_scipy().toarray(), ref.toarray())
    # duplicates in COO are summed (a float64 reference, then float32)
    coo = sp.coo_matrix(([0.25, 0.5, 1.0], ([0, 0, 2], [3, 3, 1])), shape=(3, 4))
    sp.save_npz(tmp_path / "dup.npz", coo)
    got = read_npz(tmp_path / "dup.npz")
    np.testing.assert_array_equal(got.indptr, [0, 1, 1, 2])
    np.testing.assert_array_equal(got.indices, [3, 1])
    np.testing.assert_array_equal(got.data, np.array([0.75, 1.0], np.float32))


@pytest.mark.parametrize("kind", ["csr4", "mtx", "npz", "h5"])
def test_convert_to_h5(tmp_path, ref, kind):
    src = tmp_path / f"in.{kind}"
    if kind == "csr4":
        write_bytes(src, encode_csr4(ref.indptr, ref.indices, ref.data, 13, flags=3))
    elif kind == "mtx":
        scipy.io.mmwrite(src, ref)
    elif kind == "npz":
        sp.save_npz(src, ref)
    else:
        write_matrix_h5(src, CSRMatrix.from_scipy(ref), grid=GRID, voxel_size=VOXEL, kind="transpose")
    out = tmp_path / "res" / "matrix.h5"
    s = convert(src, out, max_nnz=7)
    assert s["shape"] == [13, N] and s["nnz"] == ref.nnz and s["bytes"] == out.stat().st_size
    with open_matrix(out) as r:
        assert s["chunks"] == len(r.chunk_bounds(7))
    assert s["checksum"] == independent_checksum(ref.indptr, ref.indices, ref.data)
    with MatrixH5(out) as r:
        assert_csr_equal(r.to_csr(), ref)
        r.verify_checksum()
        assert r.attrs["source"] == src.name
        if kind in ("csr4", "h5"):
            assert r.grid == GRID and r.voxel_size == VOXEL
        else:
            assert r.grid is None and "grid" not in r.attrs
        if kind == "csr4":
            assert r.scanner_block == scanner_bytes() and r.attrs["csr4_flags"] == 3
        if kind == "h5":
            assert r.attrs["kind"] == "transpose"
    assert sorted(p.name for p in out.parent.iterdir()) == ["matrix.h5"]


def test_convert_chunk_size_does_not_change_output(tmp_path, csr4_file):
    a = convert(csr4_file, tmp_path / "a.h5", max_nnz=1)
    b = convert(csr4_file, tmp_path / "b.h5", max_nnz=1 << 26)
    assert a["checksum"] == b["checksum"] and a["chunks"] > b["chunks"] == 1


def test_info_every_kind(tmp_path, csr4_file, ref):
    d = info(csr4_file)
    assert d["kind"] == "csr4" and d["shape"] == [13, N] and d["nnz"] == ref.nnz
    assert d["grid"] == list(GRID) and d["flags"] == 5 and d["empty_rows"] == 4
    assert d["verdict"].startswith("valid")
    h5 = tmp_path / "m.h5"
    convert(csr4_file, h5)
    d = info(h5)
    assert d["kind"] == "h5" and "checksum" in d["verdict"] and d["nnz"] == ref.nnz
    assert "(quick)" in info(h5, full=False)["verdict"]
    g = tmp_path / "g.LMsino"
    write_lmsino(g, np.arange(13))
    d = info(g, expected_length=13)
    assert d["length"] == 13 and d["total_counts"] == 78 and d["zero_counts"] == 1
    with pytest.raises(MatrixFormatError, match=r"x\.txt: unknown file type"):
        file_kind(tmp_path / "x.txt")


# --------------------------------------------------------------------------- bad inputs


def _bad_csr4_cases(ref):
    ip, ix, dv, m = ref.indptr, ref.indices, ref.data, ref.shape[0]
    good = encode_csr4(ip, ix, dv, m)
    ends = list(ip[1:])
    dec = ends.copy()
    dec[4], dec[5] = dec[5], dec[4] - 1  # row 5 ends before it starts
    big = ends.copy()
    big[2] = len(ix) + 5
    col_bad = ix.copy()
    col_bad[-1] = N
    col_huge = ix.astype(np.int64)
    col_huge[1] = 2**31  # would turn negative if cast to int32 before the check
    nan = dv.copy()
    nan[2] = np.nan
    inf = dv.copy()
    inf[4] = np.inf
    neg = dv.copy()
    neg[6] = -0.5
    two_layers = struct.pack("<I", 3) + scanner_bytes()[4:]  # nLayers 3 -> needs 40 more bytes
    return {
        "magic": (encode_csr4(ip, ix, dv, m, magic=b"PCSX"), r"bad magic b'PCSX'"),
        "version": (encode_csr4(ip, ix, dv, m, version=3), r"unsupported \.csr4 version 3, expected 4"),
        "tiny": (good[:20], r"truncated: 20 bytes, shorter than the 28-byte"),
        "truncated": (good[:-3], r"truncated: file has \d+ bytes, header .* needs \d+"),
        "trailing": (good + b"\0" * 8, r"file size \d+ disagrees with header.* 8 extra"),
        "s_small": (
            encode_csr4(ip, ix, dv, m, s_field=40, scanner=scanner_bytes()[:40]),
            r"scanner block too short: header says 40 bytes",
        ),
        "s_beyond": (good[:28] + good[28:60], r"truncated: 60 bytes, the header and \d+-byte scanner block need"),
        "block_fields": (encode_csr4(ip, ix, dv, m, scanner=two_layers), r"scanner block too short: nLayers = 3"),
        "grid": (
            encode_csr4(ip, ix, dv, m, scanner=scanner_bytes(grid=(5, 3, 2))),
            r"grid 5x3x2 = 30 voxels disagrees with nCols = 24",
        ),
        "grid_zero": (
            encode_csr4(ip, ix, dv, m, scanner=scanner_bytes()[:-8] + b"\0" * 8),
            r"grid 4x0x0 = 0 voxels disagrees with nCols = 24",
        ),
        "decreasing": (encode_csr4(ip, ix, dv, m, ends=dec), r"row pointer is not non-decreasing at row 5"),
        "beyond_nnz": (encode_csr4(ip, ix, dv, m, ends=big), rf"row pointer value {len(ix) + 5} at row 2 exceeds nnz"),
        "last_end": (
            encode_csr4(ip, ix, dv, m, ends=ends[:-1] + [ends[-1] - 1]),
            rf"row pointer ends at {len(ix) - 1} \(last row end\), expected nnz = {len(ix)}",
        ),
        "column": (
            encode_csr4(ip, col_bad, dv, m),
            rf"column index {N} at element {len(ix) - 1} out of range \[0, {N}\)",
        ),
        "column_huge": (encode_csr4(ip, col_huge, dv, m), rf"column index {2**31} at element 1 out of range"),
        "nan": (encode_csr4(ip, ix, nan, m), r"non-finite value nan at element 2"),
        "inf": (encode_csr4(ip, ix, inf, m), r"non-finite value inf at element 4"),
        "negative": (encode_csr4(ip, ix, neg, m), r"negative value -0.5 at element 6"),
        "blocksize0": (
            encode_csr4(ip, ix, dv, m, scanner=scanner_bytes()[:24] + struct.pack("<II", 8, 0) + scanner_bytes()[32:]),
            r"blocksize is 0",
        ),
    }


BAD_CSR4 = list(_bad_csr4_cases(reference_matrix()))


def read_everything(path):
    with open_matrix(path) as r:
        for _ in r.iter_chunks(3):
            pass


@pytest.mark.parametrize("case", BAD_CSR4)
def test_bad_csr4_one_clear_error(tmp_path, ref, case):
    data, pattern = _bad_csr4_cases(ref)[case]
    p = write_bytes(tmp_path / f"bad_{case}.csr4", data)
    with pytest.raises(MatrixFormatError) as e:
        read_everything(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: ")
    assert e.value.source == str(p)
    assert re.search(pattern, msg), msg
    assert "\n" not in msg


@pytest.mark.parametrize("case", ["column", "nan", "negative", "decreasing", "truncated"])
def test_convert_bad_csr4_leaves_no_output(tmp_path, ref, case):
    data, pattern = _bad_csr4_cases(ref)[case]
    src = write_bytes(tmp_path / "bad.csr4", data)
    out = tmp_path / "results" / "matrix.h5"
    with pytest.raises(MatrixFormatError, match=pattern):
        convert(src, out, max_nnz=2)  # several chunks written before a fault in the elements is met
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


def _bad_h5_cases(tmp_path, ref):
    ip, ix, dv = ref.indptr, ref.indices, ref.data
    dec = ip.copy()
    dec[6] = dec[5] - 1
    col = ix.copy()
    col[3] = -1
    nan = dv.copy()
    nan[1] = np.nan
    neg = dv.copy()
    neg[0] = -2.0
    cases = {
        "no_format": ((ip, ix, dv), {"format": None}, r"missing attribute 'format'"),
        "format": ((ip, ix, dv), {"format": "other"}, r"attribute format is 'other', expected 'mlem-csr'"),
        "version": ((ip, ix, dv), {"version": 2}, r"unsupported container version 2"),
        "no_nnz": ((ip, ix, dv), {"nnz": None}, r"missing attribute 'nnz'"),
        "no_checksum": ((ip, ix, dv), {"checksum": None}, r"missing attribute 'checksum'"),
        "nnz_size": (
            (ip, ix, dv),
            {"nnz": len(ix) + 1},
            rf"dataset /indices has {len(ix)} entries, but attribute nnz = {len(ix) + 1}",
        ),
        "shape_size": (
            (ip, ix, dv),
            {"shape": np.array([12, N])},
            r"dataset /indptr has 14 entries, but attribute shape\[0\] \+ 1 = 13",
        ),
        "data_size": (
            (ip, ix, dv[:-1]),
            {},
            rf"dataset /data has {len(ix) - 1} entries, but attribute nnz = {len(ix)}",
        ),
        "start": ((ip + 1, ix, dv), {}, r"row pointer starts at 1, expected 0"),
        "end": (
            (np.r_[ip[:-1], ip[-1] - 1], ix, dv),
            {},
            rf"row pointer ends at {len(ix) - 1}, expected nnz = {len(ix)}",
        ),
        "decreasing": ((dec, ix, dv), {}, r"row pointer is not non-decreasing at row 5"),
        "column": ((ip, col, dv), {}, r"column index -1 at element 3 out of range"),
        "nan": ((ip, ix, nan), {}, r"non-finite value nan at element 1"),
        "negative": ((ip, ix, neg), {}, r"negative value -2.0 at element 0"),
        "grid": ((ip, ix, dv), {"grid": np.array([2, 3, 5])}, r"attribute grid 2x3x5 = 30 disagrees with n = 24"),
        "shape_attr": ((ip, ix, dv), {"shape": np.array([13])}, r"attribute shape is \[13\], expected two"),
    }
    out = {}
    for name, (arrays, attrs, pattern) in cases.items():
        out[name] = (h5_by_hand(tmp_path / f"bad_{name}.h5", *arrays, attrs), pattern)
    p = tmp_path / "bad_dtype.h5"
    h5_by_hand(p, ip, ix, dv, dtypes=("<i8", "<i8", "<f4"))
    out["dtype"] = (p, r"dataset /indices is int64\[\d+\], expected 1-D int32")
    p = tmp_path / "bad_missing.h5"
    h5_by_hand(p, ip, ix, dv)
    with h5py.File(p, "r+") as f:
        del f["data"]
    out["missing"] = (p, r"missing dataset /data")
    out["not_hdf5"] = (write_bytes(tmp_path / "bad_not.h5", b"hello world"), r"not a readable HDF5 file")
    return out


BAD_H5 = [
    "no_format",
    "format",
    "version",
    "no_nnz",
    "no_checksum",
    "nnz_size",
    "shape_size",
    "data_size",
    "start",
    "end",
    "decreasing",
    "column",
    "nan",
    "negative",
    "grid",
    "shape_attr",
    "dtype",
    "missing",
    "not_hdf5",
]


@pytest.mark.parametrize("case", BAD_H5)
def test_bad_h5_one_clear_error(tmp_path, ref, case):
    p, pattern = _bad_h5_cases(tmp_path, ref)[case]
    with pytest.raises(MatrixFormatError) as e:
        read_everything(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: ") and "\n" not in msg
    assert re.search(pattern, msg), msg


def test_bad_lmsino(tmp_path):
    p = write_bytes(tmp_path / "g.LMsino", struct.pack("<3i", 1, 2, 3) + b"\0\0")
    with pytest.raises(SinogramFormatError, match=r"g\.LMsino: file size 14 bytes is not a multiple of 4"):
        read_lmsino(p)
    p = write_bytes(tmp_path / "h.LMsino", struct.pack("<3i", 1, 2, 3))
    with pytest.raises(SinogramFormatError, match=r"h\.LMsino: sinogram has 3 counts but the matrix has 4 rows"):
        read_lmsino(p, expected_length=4)
    p = write_bytes(tmp_path / "n.LMsino", struct.pack("<3i", 1, -7, 3))
    with pytest.raises(SinogramFormatError, match=r"n\.LMsino: negative count -7 at LOR 1"):
        read_lmsino(p)
    with pytest.raises(SinogramFormatError, match=r"none\.LMsino: no such file"):
        read_lmsino(tmp_path / "none.LMsino")


def test_bad_mtx_and_npz(tmp_path):
    cases = {
        "garbage.mtx": (b"this is not a matrix\n1 2 3\n", r"not a valid Matrix Market file"),
        "neg.mtx": (
            b"%%MatrixMarket matrix coordinate real general\n2 2 1\n1 2 -1.5\n",
            r"negative value -1.5 at element 0",
        ),
        "nan.mtx": (b"%%MatrixMarket matrix coordinate real general\n2 2 1\n2 1 nan\n", r"non-finite value nan"),
        "big.mtx": (b"%%MatrixMarket matrix coordinate real general\n2 2 1\n2 1 1e300\n", r"non-finite value inf"),
        "cplx.mtx": (b"%%MatrixMarket matrix coordinate complex general\n2 2 1\n1 1 1.0 2.0\n", r"complex values"),
        "zip.npz": (b"PK not really", r"not a SciPy sparse \.npz file"),
    }
    for name, (content, pattern) in cases.items():
        p = write_bytes(tmp_path / name, content)
        with pytest.raises(MatrixFormatError, match=re.escape(name) + ": .*" + pattern):
            read_everything(p)
    np.savez(tmp_path / "plain.npz", x=np.arange(3))
    with pytest.raises(MatrixFormatError, match=r"plain\.npz: not a SciPy sparse \.npz file"):
        read_npz(tmp_path / "plain.npz")
    # a CSR whose column index lies outside the shape (scipy does not check on load)
    np.savez(
        tmp_path / "col.npz",
        format=np.array("csr"),
        shape=np.array([2, 3]),
        data=np.array([1.0, 2.0]),
        indices=np.array([0, 7]),
        indptr=np.array([0, 1, 2]),
    )
    with pytest.raises(MatrixFormatError, match=r"col\.npz: column index 7 out of range \[0, 3\)"):
        read_npz(tmp_path / "col.npz")


# --------------------------------------------------------------------------- CLI


def test_cli_info_and_convert(tmp_path, csr4_file, ref, capsys):
    assert main(["info", str(csr4_file)]) == 0
    text = capsys.readouterr().out
    assert "13 x 24" in text and "grid         4 x 3 x 2" in text and "verdict      valid" in text
    out = tmp_path / "r" / "matrix.h5"
    assert main(["convert", str(csr4_file), "--out", str(out), "--chunk-nnz", "4"]) == 0
    assert f"nnz {ref.nnz}" in capsys.readouterr().out
    assert main(["info", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["nnz"] == ref.nnz and d["shape"] == [13, N] and d["attrs"]["source"] == "a.csr4"
    g = tmp_path / "g.LMsino"
    write_lmsino(g, np.ones(12, np.int32))
    assert main(["info", str(g), "--matrix", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"mlem: error: {g}: sinogram has 12 counts but the matrix has 13 rows (LORs)\n"


def test_cli_bad_file_exit_2_no_output(tmp_path, ref, capsys):
    data, _ = _bad_csr4_cases(ref)["nan"]
    bad = write_bytes(tmp_path / "bad.csr4", data)
    assert main(["info", str(bad)]) == 2
    assert capsys.readouterr().err == f"mlem: error: {bad}: non-finite value nan at element 2\n"
    out = tmp_path / "out" / "matrix.h5"
    assert main(["convert", str(bad), "--out", str(out), "-c", "2"]) == 2
    err = capsys.readouterr().err
    assert err == f"mlem: error: {bad}: non-finite value nan at element 2\n"
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_cli_subprocess_exit_status(tmp_path, ref):
    data, _ = _bad_csr4_cases(ref)["magic"]
    bad = write_bytes(tmp_path / "bad.csr4", data)
    out = tmp_path / "m.h5"
    r = subprocess.run(
        [sys.executable, "-m", "mlemlib", "convert", str(bad), "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert r.returncode == 2
    assert (
        r.stderr.strip().splitlines()[-1]
        == f"mlem: error: {bad}: bad magic b'PCSX', expected b'PCSR' (not a .csr4 file)"
    )
    assert r.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.csr4"]


@pytest.mark.parametrize(("m", "rows"), [(0, []), (3, [0, 0, 0])])
def test_csr4_without_elements(tmp_path, m, rows):
    """No rows, or rows but no elements: readable, chunkable, and written back byte for byte."""
    p = write_bytes(tmp_path / "e.csr4", encode_csr4([0, *rows], [], [], m))
    with Csr4File(p) as f:
        assert f.shape == (m, N) and f.nnz == 0
        assert [c[:2] for c in f.iter_chunks(4)] == ([(0, m)] if m else [])
        block = f.read_rows(0, m)
        np.testing.assert_array_equal(block.indptr, np.zeros(m + 1))
        out = tmp_path / "o.csr4"
        write_csr4(out, block, scanner_block=f.header.scanner_block)
    assert out.read_bytes() == p.read_bytes()


# --------------------------------------------------------------------------- negative values: --clip-negative

#: Where a projector's export put its tiny negative values (element index -> value), as in the use case.
NEGATIVES = {2: -5.4e-6, 9: -1.0e-7, 20: -2.5e-6, 21: -3.0e-9}


def negative_matrix(tmp_path: Path, kind: str) -> tuple[Path, sp.csr_matrix]:
    """``reference_matrix`` with :data:`NEGATIVES` written into its values, encoded by hand as ``kind``."""
    a = reference_matrix(m=13)
    for k, v in NEGATIVES.items():
        a.data[k] = np.float32(v)
    path = tmp_path / f"neg.{kind}"
    if kind == "csr4":
        write_bytes(path, encode_csr4(a.indptr, a.indices, a.data, a.shape[0]))
    elif kind == "mtx":
        scipy.io.mmwrite(path, a, precision=9)
    elif kind == "npz":
        sp.save_npz(path, a)
    else:  # a container written by another tool: no writer of ours stores a negative value
        h5_by_hand(path, a.indptr, a.indices, a.data, {"checksum": independent_checksum(a.indptr, a.indices, a.data),
                                                        "checksum_method": CHECKSUM_METHOD})
    return path, a


@pytest.mark.parametrize("kind", ["csr4", "mtx", "npz", "h5"])
def test_convert_refuses_negative_values_naming_clip_negative(tmp_path, kind, capsys):
    path, a = negative_matrix(tmp_path, kind)
    out = tmp_path / "out.h5"
    assert main(["convert", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"mlem: error: {path}: negative value -5.4")
    assert "--clip-negative" in err[0]
    assert not out.exists()
    with pytest.raises(MatrixFormatError, match=r"'mlem convert --clip-negative' \(the workflow: "
                       r"matrices\.<name>\.clip_negative: true\) sets negative values to 0\)$"):
        convert(path, out)


@pytest.mark.parametrize("kind", ["csr4", "mtx", "npz", "h5"])
def test_convert_clip_negative_sets_them_to_zero_and_logs_count_and_minimum(tmp_path, kind, caplog, capsys):
    path, a = negative_matrix(tmp_path, kind)
    out = tmp_path / "out.h5"
    with caplog.at_level(logging.INFO, logger="mlemlib.formats"):
        assert main(["convert", str(path), "--out", str(out), "--clip-negative", "--chunk-nnz", "7"]) == 0
    # the same structure (explicit zeros kept) with exactly the negative values replaced by 0
    with MatrixH5(out) as f:
        got = f.to_csr()
    np.testing.assert_array_equal(got.indptr, a.indptr)
    np.testing.assert_array_equal(got.indices, a.indices)
    want = a.data.copy()
    want[list(NEGATIVES)] = 0
    np.testing.assert_array_equal(got.data, want)
    assert got.nnz == a.nnz and int((got.data == 0).sum()) == len(NEGATIVES)
    logged = [r.getMessage() for r in caplog.records if "set to 0" in r.getMessage()]
    assert logged == [f"{path}: 4 negative value(s) set to 0, the smallest {float(np.float32(-5.4e-6)):.9g} "
                      "(kept as explicit zeros)"]
    assert "4 negative value(s) set to 0 (smallest -5.4e-06)" in capsys.readouterr().out
    # the container validates (no negative value left) and records the clipped values' checksum
    assert info(out)["verdict"].startswith("valid")
    with MatrixH5(out) as f:
        assert f.checksum == independent_checksum(a.indptr, a.indices, want)


def test_convert_clip_negative_summary_and_matrix_without_negatives(tmp_path, ref, caplog):
    path, a = negative_matrix(tmp_path, "npz")
    s = convert(path, tmp_path / "c.h5", clip_negative=True, fmt="compressed")
    assert (s["clipped"], s["clipped_min"]) == (4, float(np.float32(-5.4e-6)))
    with MatrixH5(tmp_path / "c.h5") as f:
        assert f.format == "compressed" and float(f.to_csr().data.min()) == 0.0
    # nothing to clip: the same container as without the option, and a log line that says so
    clean = write_bytes(tmp_path / "clean.csr4", encode_csr4(ref.indptr, ref.indices, ref.data, ref.shape[0]))
    with caplog.at_level(logging.INFO, logger="mlemlib.formats"):
        s1 = convert(clean, tmp_path / "a.h5", clip_negative=True)
    s0 = convert(clean, tmp_path / "b.h5")
    assert (s1["clipped"], s1["clipped_min"]) == (0, None) and "clipped" not in s0
    assert s1["checksum"] == s0["checksum"]
    assert any(r.getMessage() == f"{clean}: no negative value to set to 0" for r in caplog.records)


def test_convert_fold_clip_negative_folds_the_clipped_matrix(tmp_path, capsys):
    """--fold --clip-negative: rows equal once clipped are stored once, as SciPy finds them."""
    from mlemlib.fold import fold_of

    a = reference_matrix(m=13)
    b = sp.vstack([a, a[[4]]]).tocsr()  # row 13 repeats row 4 ...
    lo = b.indptr[13]
    b.data[lo] = np.float32(-1e-6)  # ... except for a negative value where row 4 holds a positive one
    b.data[b.indptr[4]] = 0.0  # which becomes 0 in row 4 too: after clipping they are equal
    path = tmp_path / "f.npz"
    sp.save_npz(path, b)
    out = tmp_path / "folded.h5"
    assert main(["convert", str(path), "--out", str(out), "--fold", "--clip-negative"]) == 0
    assert "1 negative value(s) set to 0" in capsys.readouterr().out
    clipped = b.copy()
    clipped.data[clipped.data < 0] = 0
    def distinct_rows(x: sp.csr_matrix) -> int:
        return len({(x.indices[x.indptr[r]:x.indptr[r + 1]].tobytes(), x.data[x.indptr[r]:x.indptr[r + 1]].tobytes())
                    for r in range(x.shape[0]) if x.indptr[r + 1] > x.indptr[r]})

    assert distinct_rows(clipped) == distinct_rows(b) - 1  # clipping made rows 4 and 13 equal
    with MatrixH5(out) as f:
        got = f.to_csr().to_scipy()
    fold = fold_of(out)
    assert got.shape[0] == distinct_rows(clipped)
    users = np.flatnonzero(fold.row_map >= 0)
    np.testing.assert_array_equal(got[fold.row_map[users]].toarray(), clipped[users].toarray())
    assert fold.row_map[13] == fold.row_map[4]
    assert not list(tmp_path.glob(".*clipped*"))  # the temporary container is gone


def test_another_mlem_file_given_as_the_matrix_is_named(tmp_path):
    """An image (the true phantom given to -t, which is --transpose) or a norm where a matrix belongs: one line
    saying what the file is; the names are the writers' own format attributes."""
    from mlemlib.formats.h5 import OTHER_FILES
    from mlemlib.image import IMAGE_FORMAT, write_image
    from mlemlib.norm import NORM_FORMAT
    from mlemlib.permutation import PERM_FORMAT

    assert set(OTHER_FILES) == {IMAGE_FORMAT, NORM_FORMAT, PERM_FORMAT}
    write_image(tmp_path / "truth.h5", np.ones(8, dtype=np.float32))
    with pytest.raises(MatrixFormatError) as exc:
        open_matrix(tmp_path / "truth.h5")
    assert str(exc.value) == (f"{tmp_path / 'truth.h5'}: attribute format is 'mlem-image', expected 'mlem-csr': an "
                              "image (mlem reconstruct, mlem simulate's truth), not a matrix")
