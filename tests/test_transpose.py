"""Tests of mlemlib.transpose: ScanTrans against SciPy and a hand-computed case, streaming, the stage and CLI."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib.backends import cuda_available
from mlemlib.cli import main
from mlemlib.errors import ConfigError, DeviceError, MatrixFormatError
from mlemlib.formats.h5 import MatrixH5, write_matrix_h5
from mlemlib.matrix import CSRMatrix
from mlemlib.transpose import (
    ScanTransScatter,
    column_counts,
    histogram_total,
    iter_row_chunks,
    numba_threads,
    scantrans,
    transpose,
    transpose_file,
)

# --------------------------------------------------------------------------- matrices


def random_matrix(rng, m: int, n: int, density: float) -> CSRMatrix:
    """A random CSR matrix with sorted columns and positive float32 values of many magnitudes."""
    a = sp.random(m, n, density=density, format="csr", dtype=np.float32, random_state=rng)
    a.data = (10.0 ** rng.uniform(-6, 6, a.nnz)).astype(np.float32)
    a.sort_indices()
    return CSRMatrix.from_scipy(a)


def pet_like_matrix(n_det: int = 24, grid: int = 12, extra_cols: int = 5) -> CSRMatrix:
    """A small PET-like system matrix: LORs between detectors on a ring through a square voxel grid.

    Only voxels inside a disc are in the field of view, so corner voxels (and
    ``extra_cols`` appended voxels) are empty columns; LORs between nearby
    detectors miss the disc and are empty rows. Each row has sorted columns;
    values are the sampled path length through each voxel.
    """
    ang = 2 * np.pi * np.arange(n_det) / n_det
    det = np.stack([np.cos(ang), np.sin(ang)], axis=1)
    t = (np.arange(800) + 0.5) / 800
    indptr, indices, data = [0], [], []
    for i in range(n_det):
        for j in range(i + 1, n_det):
            pts = det[i] + t[:, None] * (det[j] - det[i])
            inside = np.hypot(pts[:, 0], pts[:, 1]) < 0.55
            ij = np.floor((pts[inside] + 0.6) / 1.2 * grid).astype(np.int64).clip(0, grid - 1)
            vox, counts = np.unique(ij[:, 1] * grid + ij[:, 0], return_counts=True)
            step = np.linalg.norm(det[j] - det[i]) / len(t)
            indices.extend(vox.tolist())
            data.extend((counts * step).tolist())
            indptr.append(len(indices))
    m = len(indptr) - 1
    return CSRMatrix(np.array(indptr), np.array(indices), np.array(data), (m, grid * grid + extra_cols))


def reference(a: CSRMatrix):
    """SciPy's transpose (float32 values, as scipy computes it)."""
    return sp.csr_matrix((a.data, a.indices, a.indptr), shape=a.shape).T.tocsr()


def assert_identical(t: CSRMatrix, ref) -> None:
    assert t.shape == ref.shape
    assert t.indptr.dtype == np.int64 and t.indices.dtype == np.int32 and t.data.dtype == np.float32
    np.testing.assert_array_equal(t.indptr, ref.indptr)
    np.testing.assert_array_equal(t.indices, ref.indices)
    np.testing.assert_array_equal(t.data.view(np.uint32), np.asarray(ref.data, dtype=np.float32).view(np.uint32))


# --------------------------------------------------------------------------- hand-computed case

# A (4 x 4):  row 0: (1)=1 (3)=2;  row 1: (0)=3;  row 2: empty;  row 3 (unsorted): (3)=4 (1)=5 (0)=6
HAND = CSRMatrix(np.array([0, 2, 3, 3, 6]), np.array([1, 3, 0, 3, 1, 0]), np.array([1, 2, 3, 4, 5, 6.0]), (4, 4))
# A^T by hand: col 0 -> rows 1 (3), 3 (6); col 1 -> rows 0 (1), 3 (5); col 2 empty; col 3 -> rows 0 (2), 3 (4)
HAND_T = (np.array([0, 2, 4, 4, 6]), np.array([1, 3, 0, 3, 0, 3]), np.array([3, 6, 1, 5, 2, 4.0], dtype=np.float32))


@pytest.mark.parametrize("chunk_nnz", [None, 1, 2, 3, 100])
@pytest.mark.parametrize("threads", [1, 2])
def test_scantrans_hand_computed(chunk_nnz, threads):
    t = scantrans(HAND, threads=threads, chunk_nnz=chunk_nnz)
    assert t.shape == (4, 4)
    np.testing.assert_array_equal(t.indptr, HAND_T[0])
    np.testing.assert_array_equal(t.indices, HAND_T[1])
    np.testing.assert_array_equal(t.data, HAND_T[2])


@pytest.mark.parametrize("chunk_nnz", [None, 1, 2])
def test_duplicates_keep_input_order(chunk_nnz):
    # row 1 holds column 0 twice (3 then 7): the transpose keeps them in that order
    a = CSRMatrix(np.array([0, 1, 3]), np.array([0, 0, 0]), np.array([1.0, 3.0, 7.0]), (2, 1))
    t = scantrans(a, threads=2, chunk_nnz=chunk_nnz)
    np.testing.assert_array_equal(t.indptr, [0, 3])
    np.testing.assert_array_equal(t.indices, [0, 1, 1])
    np.testing.assert_array_equal(t.data, [1.0, 3.0, 7.0])
    assert_identical(t, reference(a))


# --------------------------------------------------------------------------- against SciPy


@pytest.mark.parametrize("shape,density", [((300, 200), 0.02), ((50, 1000), 0.05), ((1000, 30), 0.1)])
@pytest.mark.parametrize("chunk_nnz", [None, 1, 37, 500, 10**9])
@pytest.mark.parametrize("threads", [1, 2])
def test_scantrans_equals_scipy_random(rng, shape, density, chunk_nnz, threads):
    a = random_matrix(rng, *shape, density)
    assert_identical(scantrans(a, threads=threads, chunk_nnz=chunk_nnz), reference(a))


@pytest.mark.parametrize("chunk_nnz", [None, 5, 64, 1000])
@pytest.mark.parametrize("threads", [1, 2])
def test_scantrans_equals_scipy_pet_like(chunk_nnz, threads):
    a = pet_like_matrix()
    counts = np.diff(a.indptr)
    assert (counts == 0).any() and (counts > 0).sum() > 100  # empty rows present
    assert (np.bincount(a.indices, minlength=a.shape[1]) == 0).any()  # empty columns present
    assert_identical(scantrans(a, threads=threads, chunk_nnz=chunk_nnz), reference(a))


def test_unsorted_rows_give_sorted_transpose(rng):
    a = random_matrix(rng, 200, 150, 0.05)
    perm = a.indices.copy()
    for r in range(a.shape[0]):  # shuffle the columns inside every row
        lo, hi = a.indptr[r], a.indptr[r + 1]
        order = rng.permutation(hi - lo)
        perm[lo:hi] = a.indices[lo:hi][order]
        a.data[lo:hi] = a.data[lo:hi][order]
    a.indices = perm
    t = scantrans(a, threads=2, chunk_nnz=100)
    assert_identical(t, reference(a))
    for r in range(t.shape[0]):
        assert np.all(np.diff(t.indices[t.indptr[r] : t.indptr[r + 1]]) > 0)


@pytest.mark.parametrize(
    "a",
    [
        CSRMatrix(np.array([0, 3]), np.array([0, 2, 4]), np.array([1.0, 2, 3]), (1, 6)),  # a single row
        CSRMatrix(np.array([0, 1, 1, 2, 3]), np.array([0, 0, 0]), np.array([1.0, 2, 3]), (4, 1)),  # a single column
        CSRMatrix(np.zeros(5, dtype=np.int64), np.array([], np.int32), np.array([], np.float32), (4, 3)),  # nnz = 0
        CSRMatrix(np.zeros(1, dtype=np.int64), np.array([], np.int32), np.array([], np.float32), (0, 3)),  # m = 0
        CSRMatrix(np.zeros(4, dtype=np.int64), np.array([], np.int32), np.array([], np.float32), (3, 0)),  # n = 0
    ],
    ids=["single-row", "single-column", "nnz0", "m0", "n0"],
)
@pytest.mark.parametrize("chunk_nnz", [None, 1])
def test_edge_shapes(a, chunk_nnz):
    t = scantrans(a, threads=2, chunk_nnz=chunk_nnz)
    assert_identical(t, reference(a))


def test_transpose_twice_is_identity(rng):
    a = random_matrix(rng, 120, 90, 0.1)
    back = scantrans(scantrans(a, chunk_nnz=50), chunk_nnz=70)
    assert_identical(back, sp.csr_matrix((a.data, a.indices, a.indptr), shape=a.shape))


def test_methods_agree(rng):
    a = pet_like_matrix()
    s = transpose(a, "scantrans")
    p = transpose(a, "scipy")
    for name in ("indptr", "indices", "data"):
        np.testing.assert_array_equal(getattr(s, name), getattr(p, name))
        assert getattr(s, name).dtype == getattr(p, name).dtype


def test_unknown_method():
    with pytest.raises(ConfigError, match="unknown transposition method 'mkl'"):
        transpose(HAND, "mkl")


@pytest.mark.skipif(cuda_available(), reason="a GPU is present")
def test_cusparse_without_gpu_is_a_clear_device_error():
    with pytest.raises(DeviceError, match="cusparse transposition needs"):
        transpose(HAND, "cusparse")


@pytest.mark.parametrize("threads", [0, -2, 1.5, "2"])
def test_bad_thread_count(threads):
    with pytest.raises(ConfigError, match="threads"):
        scantrans(HAND, threads=threads)


def test_too_many_threads_are_reduced_with_a_warning(caplog):
    import numba

    limit = numba.config.NUMBA_NUM_THREADS
    with caplog.at_level("WARNING"), numba_threads(limit + 5) as used:
        assert used == limit == numba.get_num_threads()
    assert f"{limit + 5} threads asked for, Numba has {limit}" in caplog.text
    np.testing.assert_array_equal(scantrans(HAND, threads=limit + 5).indices, HAND_T[1])


def test_out_of_range_column_is_an_error():
    a = CSRMatrix(np.array([0, 2]), np.array([0, 5]), np.array([1.0, 2.0]), (1, 3))
    with pytest.raises(MatrixFormatError, match=r"column index 5 out of range \[0, 3\)"):
        scantrans(a, chunk_nnz=None)
    with pytest.raises(MatrixFormatError, match=r"column index 5 out of range \[0, 3\)"):
        scantrans(a, chunk_nnz=1)


# --------------------------------------------------------------------------- streaming pieces


def test_row_chunks_cover_rows_once():
    indptr = np.array([0, 3, 3, 10, 11, 11, 11, 20])
    for chunk in (1, 3, 5, 8, 100):
        ranges = list(iter_row_chunks(indptr, chunk))
        assert ranges[0][0] == 0 and ranges[-1][1] == len(indptr) - 1
        assert all(r1 > r0 for r0, r1 in ranges)
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
        for r0, r1 in ranges:  # at most chunk non-zeros, unless the range is a single row
            assert indptr[r1] - indptr[r0] <= chunk or r1 - r0 == 1


def test_scatter_auxiliaries_are_chunk_sized(rng):
    a = random_matrix(rng, 400, 100, 0.05)
    hist = column_counts(a.indices, a.shape[1], threads=2)
    scat = ScanTransScatter(histogram_total(hist), a.shape, threads=2)
    largest = 0
    for r0, r1 in iter_row_chunks(a.indptr, 150):
        p0, p1 = a.indptr[r0], a.indptr[r1]
        largest = max(largest, p1 - p0)
        scat.add(r0, CSRMatrix(a.indptr[r0 : r1 + 1] - p0, a.indices[p0:p1], a.data[p0:p1], (r1 - r0, 100)))
        assert scat._intra.shape[0] == largest < a.nnz
        assert scat._inter.shape == (3, 100)
    assert_identical(scat.finish(), reference(a))


def test_scatter_rejects_out_of_order_and_missing_chunks(rng):
    a = random_matrix(rng, 10, 5, 0.5)
    scat = ScanTransScatter(histogram_total(column_counts(a.indices, 5)), a.shape)
    p = a.indptr
    with pytest.raises(MatrixFormatError, match="starts at row 3, expected 0"):
        scat.add(3, CSRMatrix(p[3:5] - p[3], a.indices[p[3] : p[4]], a.data[p[3] : p[4]], (2, 5)))
    scat.add(0, CSRMatrix(p[:6], a.indices[: p[5]], a.data[: p[5]], (5, 5)))
    with pytest.raises(MatrixFormatError, match="rows 5..10 were never added"):
        scat.finish()


def test_scatter_detects_more_nonzeros_than_counted():
    a = CSRMatrix(np.array([0, 2]), np.array([0, 1]), np.array([1.0, 2.0]), (1, 2))
    scat = ScanTransScatter(np.array([1, 0]), a.shape)  # column 1 counted as empty
    with pytest.raises(MatrixFormatError, match="column 1 has more non-zeros than counted"):
        scat.add(0, a)


# --------------------------------------------------------------------------- the file stage


@pytest.fixture
def pet_h5(tmp_path):
    a = pet_like_matrix()
    path = tmp_path / "matrix.h5"
    write_matrix_h5(path, a, source="pet.csr4")
    return path, a


@pytest.mark.parametrize("method", ["scantrans", "scipy"])
@pytest.mark.parametrize("chunk_nnz", [7, 300, 1 << 26])
def test_transpose_file(pet_h5, tmp_path, method, chunk_nnz):
    path, a = pet_h5
    out = tmp_path / "transpose.h5"
    info = transpose_file(path, out, method, threads=2, chunk_nnz=chunk_nnz)
    with MatrixH5(out) as f:
        assert f.shape == (a.shape[1], a.shape[0]) and f.nnz == a.nnz
        assert f.attrs["kind"] == "transpose" and f.attrs["method"] == method
        assert f.attrs["source"] == "matrix.h5"
        with MatrixH5(path) as src:
            assert f.attrs["source_checksum"] == src.checksum
        assert f.attrs["seconds"] == info["seconds"] > 0
        f.verify_checksum()
        assert_identical(f.to_csr(), reference(a))
    assert info["shape"] == [a.shape[1], a.shape[0]] and info["nnz"] == a.nnz
    assert info["seconds_total"] >= info["seconds"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["matrix.h5", "transpose.h5"]


def test_transpose_file_same_bits_for_any_threads_and_chunks(tmp_path, rng):
    # 600 rows: chunks of one row (600 chunks, each read and scattered on its own) stay a few seconds
    a = random_matrix(rng, 600, 300, 0.02)
    path = tmp_path / "m.h5"
    write_matrix_h5(path, a)
    checksums = set()
    for threads, chunk in ((1, 1 << 26), (2, 1000), (2, 1)):
        out = tmp_path / f"t-{threads}-{chunk}.h5"
        transpose_file(path, out, threads=threads, chunk_nnz=chunk)
        with MatrixH5(out) as f:
            checksums.add(f.checksum)
    transpose_file(path, tmp_path / "s.h5", "scipy")
    with MatrixH5(tmp_path / "s.h5") as f:
        checksums.add(f.checksum)
    assert len(checksums) == 1


def test_transpose_file_corrupt_input_leaves_nothing(pet_h5, tmp_path):
    path, a = pet_h5
    with h5py.File(path, "r+") as f:  # a column index out of range, checksum left stale
        f["indices"][10] = a.shape[1] + 3
    out = tmp_path / "transpose.h5"
    for method in ("scantrans", "scipy"):
        with pytest.raises(MatrixFormatError, match=str(path)):
            transpose_file(path, out, method)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["matrix.h5"]


def test_transpose_file_bad_arguments(pet_h5, tmp_path):
    path, _ = pet_h5
    with pytest.raises(ConfigError, match="method"):
        transpose_file(path, tmp_path / "t.h5", "fast")
    with pytest.raises(ConfigError, match="chunk_nnz"):
        transpose_file(path, tmp_path / "t.h5", chunk_nnz=0)
    with pytest.raises(MatrixFormatError, match="no such file"):
        transpose_file(tmp_path / "missing.h5", tmp_path / "t.h5")


def test_cli_transpose(pet_h5, tmp_path, capsys):
    path, a = pet_h5
    out = tmp_path / "t.h5"
    assert main(["transpose", str(path), "--method", "scantrans", "--out", str(out), "-t", "1", "-c", "100"]) == 0
    assert "scantrans" in capsys.readouterr().out
    with MatrixH5(out) as f:
        assert_identical(f.to_csr(), reference(a))
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not hdf5")
    assert main(["transpose", str(bad), "--out", str(tmp_path / "u.h5")]) == 2
    assert capsys.readouterr().err.startswith(f"mlem: error: {bad}: not a readable HDF5 file")


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "pet", "unsorted", "edge"])
def test_cusparse_equals_scantrans(rng, kind, tmp_path):
    if kind == "random":
        a = random_matrix(rng, 3000, 2000, 0.01)
    elif kind == "pet":
        a = pet_like_matrix(n_det=48, grid=24)
    elif kind == "unsorted":
        a = random_matrix(rng, 500, 400, 0.05)
        for r in range(a.shape[0]):
            lo, hi = a.indptr[r], a.indptr[r + 1]
            a.indices[lo:hi] = a.indices[lo:hi][::-1].copy()
            a.data[lo:hi] = a.data[lo:hi][::-1].copy()
    else:
        a = CSRMatrix(np.array([0, 0, 2, 2]), np.array([3, 0]), np.array([1.0, 2.0]), (3, 5))
    c = transpose(a, "cusparse")
    s = transpose(a, "scantrans", chunk_nnz=997)
    for name in ("indptr", "indices", "data"):
        np.testing.assert_array_equal(getattr(c, name), getattr(s, name))
        assert getattr(c, name).dtype == getattr(s, name).dtype
    if kind == "pet":  # the file stage too
        path = tmp_path / "m.h5"
        write_matrix_h5(path, a)
        info = transpose_file(path, tmp_path / "t.h5", "cusparse")
        assert info["seconds"] > 0
        with MatrixH5(tmp_path / "t.h5") as f:
            assert f.attrs["method"] == "cusparse"
            assert_identical(f.to_csr(), reference(a))


def test_usable_threads_cuts_to_numba_and_rejects_nonsense(caplog):
    import numba

    from mlemlib.transpose import usable_threads

    limit = numba.config.NUMBA_NUM_THREADS
    assert usable_threads(1) == 1
    with caplog.at_level("WARNING"):
        assert usable_threads(limit + 63) == limit  # snakemake --cores 64 on a smaller node
    assert "NUMBA_NUM_THREADS" in caplog.text
    for bad in (0, -2, 1.5, True, "4"):
        with pytest.raises(ConfigError):
            usable_threads(bad)
