"""Tests of mlemlib.norm: float64 column sums against SciPy, determinism, norm.h5 and its validation."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib.cli import main
from mlemlib.errors import ConfigError, MatrixFormatError
from mlemlib.formats.h5 import MatrixH5, write_matrix_h5
from mlemlib.matrix import CSRMatrix
from mlemlib.norm import column_sums, compute_norm, read_norm


def wide_matrix(rng, m: int = 3000, n: int = 400, density: float = 0.02) -> CSRMatrix:
    """Random matrix whose values span 40 decades, so the summation order changes the float64 bits."""
    a = sp.random(m, n, density=density, format="csr", dtype=np.float32, random_state=rng)
    a.data = (10.0 ** rng.uniform(-20, 20, a.nnz)).astype(np.float32)
    a.sort_indices()
    return CSRMatrix.from_scipy(a)


def scipy_sums(a: CSRMatrix) -> np.ndarray:
    s = sp.csr_matrix((a.data, a.indices, a.indptr), shape=a.shape).astype(np.float64)
    return np.asarray(s.sum(axis=0)).ravel()


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float64).view(np.uint64)


def test_sums_equal_float64_scipy_exactly(rng):
    a = wide_matrix(rng)
    np.testing.assert_array_equal(bits(column_sums(a)), bits(scipy_sums(a)))


def test_the_order_matters_for_this_data(rng):
    # guards the test above: summing in reverse row order gives other bits for these values
    a = wide_matrix(rng)
    rev = np.zeros(a.shape[1])
    for k in range(a.nnz - 1, -1, -1):
        rev[a.indices[k]] += np.float64(a.data[k])
    assert (bits(rev) != bits(column_sums(a))).any()


def test_same_bits_for_one_and_two_threads(rng):
    a = wide_matrix(rng)
    one = column_sums(a, threads=1)
    two = column_sums(a, threads=2)
    np.testing.assert_array_equal(bits(one), bits(two))


def test_hand_computed():
    # [[1, 0, 2], [0, 0, 3], [4, 0, 0]] -> column sums 5, 0, 5; a float32 value stays exact in float64
    a = CSRMatrix(np.array([0, 2, 3, 4]), np.array([0, 2, 2, 0]), np.array([1, 2, 3, 4.1]), (3, 3))
    np.testing.assert_array_equal(column_sums(a), [1 + float(np.float32(4.1)), 0.0, 5.0])


def test_empty_matrix_and_empty_columns():
    a = CSRMatrix(np.zeros(4, dtype=np.int64), np.array([], np.int32), np.array([], np.float32), (3, 5))
    np.testing.assert_array_equal(column_sums(a), np.zeros(5))


def test_out_of_range_index():
    a = CSRMatrix(np.array([0, 1]), np.array([7]), np.array([1.0]), (1, 3))
    with pytest.raises(MatrixFormatError, match=r"column index 7 out of range \[0, 3\)"):
        column_sums(a)


# --------------------------------------------------------------------------- the file stage


@pytest.fixture
def matrix_h5(tmp_path, rng):
    a = wide_matrix(rng)
    path = tmp_path / "matrix.h5"
    write_matrix_h5(path, a, source="m.csr4")
    return path, a


@pytest.mark.parametrize("chunk_nnz,threads", [(1 << 26, 2), (1, 1), (97, 2), (5000, 1)])
def test_compute_norm_file(matrix_h5, tmp_path, chunk_nnz, threads):
    path, a = matrix_h5
    out = tmp_path / "norm.h5"
    norm = compute_norm(path, out, chunk_nnz=chunk_nnz, threads=threads)
    ref = scipy_sums(a)
    np.testing.assert_array_equal(bits(norm), bits(ref))
    np.testing.assert_array_equal(bits(read_norm(out, a.shape[1])), bits(ref))
    with h5py.File(out) as f, MatrixH5(path) as m:
        assert f["norm"].dtype == np.float64
        assert f.attrs["source"] == "matrix.h5"
        assert f.attrs["checksum"] == m.checksum
        assert list(f.attrs["shape"]) == list(a.shape) and f.attrs["nnz"] == a.nnz
    read_norm(out, a.shape[1], expected_checksum=MatrixH5(path).checksum)


def test_compute_norm_corrupt_matrix_leaves_nothing(matrix_h5, tmp_path):
    path, _ = matrix_h5
    with h5py.File(path, "r+") as f:
        f["data"][5] = -1.0
    with pytest.raises(MatrixFormatError, match=f"{path}: negative value"):
        compute_norm(path, tmp_path / "norm.h5")
    assert not (tmp_path / "norm.h5").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["matrix.h5"]


def test_compute_norm_bad_chunk(matrix_h5, tmp_path):
    with pytest.raises(ConfigError, match="chunk_nnz"):
        compute_norm(matrix_h5[0], tmp_path / "n.h5", chunk_nnz=0)


# --------------------------------------------------------------------------- read_norm validation


def _norm_file(path, values, name="norm"):
    with h5py.File(path, "w") as f:
        f.create_dataset(name, data=values)
        f.attrs["checksum"] = "abc"
    return path


def test_read_norm_ok(tmp_path):
    p = _norm_file(tmp_path / "n.h5", np.array([0.0, 1.5, 2.0]))
    np.testing.assert_array_equal(read_norm(p), [0.0, 1.5, 2.0])
    assert read_norm(p, 3).dtype == np.float64


@pytest.mark.parametrize(
    "values,expected,fault",
    [
        (np.array([1.0, 2.0]), 3, "has 2 entries, expected 3"),
        (np.array([1.0, np.nan, 2.0]), None, "non-finite norm nan at voxel 1"),
        (np.array([1.0, 2.0, np.inf]), None, "non-finite norm inf at voxel 2"),
        (np.array([1.0, -0.5]), None, "negative norm -0.5 at voxel 1"),
        (np.ones((2, 2)), None, r"shape \(2, 2\), expected a vector"),
        (np.array([1, 2], dtype=np.int64), None, "dtype int64, expected float64"),
    ],
)
def test_read_norm_faults(tmp_path, values, expected, fault):
    p = _norm_file(tmp_path / "n.h5", values)
    with pytest.raises(MatrixFormatError, match=fault) as exc:
        read_norm(p, expected)
    assert str(exc.value).startswith(f"{p}: ")


def test_read_norm_file_faults(tmp_path):
    with pytest.raises(MatrixFormatError, match="no such norm file"):
        read_norm(tmp_path / "missing.h5")
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(MatrixFormatError, match="not a readable HDF5 file"):
        read_norm(junk)
    other = _norm_file(tmp_path / "o.h5", np.ones(3), name="image")
    with pytest.raises(MatrixFormatError, match="no dataset 'norm'"):
        read_norm(other)
    p = _norm_file(tmp_path / "n.h5", np.ones(3))
    with pytest.raises(MatrixFormatError, match="norm of matrix with checksum abc, expected def"):
        read_norm(p, 3, expected_checksum="def")


def test_cli_norm(matrix_h5, tmp_path, capsys):
    path, a = matrix_h5
    out = tmp_path / "norm.h5"
    assert main(["norm", str(path), "--out", str(out), "--threads", "1", "--chunk-nnz", "1000"]) == 0
    assert f"{a.shape[1]} voxels" in capsys.readouterr().out
    np.testing.assert_array_equal(bits(read_norm(out)), bits(scipy_sums(a)))
    assert main(["norm", str(tmp_path / "norm.h5"), "--out", str(tmp_path / "x.h5")]) == 2
    err = capsys.readouterr().err  # a norm.h5 is not a matrix: one line naming file and fault
    assert err == (f"mlem: error: {tmp_path / 'norm.h5'}: attribute format is 'mlem-norm', expected 'mlem-csr': "
                   "a norm (mlem norm), not a matrix\n")


def test_weighted_sums_in_row_order_bit_for_bit(rng):
    """Folded rows' weights, many more bins than columns in some ranges: each column's products summed in row order
    (np.add.at adds in element order), bit for bit; the sums do not depend on the threads."""
    from mlemlib.norm import ColumnScratch, accumulate_column_sums

    a = wide_matrix(rng, m=2000, n=37)
    w = rng.integers(1, 5, a.shape[0]).astype(np.float64)
    want = np.zeros(a.shape[1])
    np.add.at(want, a.indices, a.data.astype(np.float64) * np.repeat(w, np.diff(a.indptr)))
    scratch = ColumnScratch()
    for threads in (1, 2):
        from mlemlib.transpose import numba_threads

        got = np.zeros(a.shape[1])
        with numba_threads(threads):
            accumulate_column_sums(got, a, row_weights=w, scratch=scratch)
        np.testing.assert_array_equal(bits(got), bits(want))


def test_out_of_range_index_leaves_the_sums():
    from mlemlib.norm import accumulate_column_sums

    a = CSRMatrix(np.array([0, 2, 3]), np.array([1, 2, 9]), np.array([1.0, 2.0, 3.0], np.float32), (2, 4))
    sums = np.full(4, 0.5)
    with pytest.raises(MatrixFormatError, match=r"m\.h5: column index 9 out of range \[0, 4\)"):
        accumulate_column_sums(sums, a, source="m.h5")
    np.testing.assert_array_equal(sums, 0.5)


@pytest.mark.parametrize("fmt", ["csr", "compressed", "compressed-u16"])
def test_reused_blocks_equal_new_ones(tmp_path, rng, fmt):
    """iter_chunks(reuse=True) gives the blocks iter_chunks gives (a row longer than the buffers too), in
    buffers reused in turn."""
    from mlemlib.compressed import CompressedMatrix
    from mlemlib.formats import open_matrix, write_compressed_h5

    a = wide_matrix(rng, m=500, n=300, density=0.05)
    a.data[:] = np.abs(a.data) % 100 + 0.5
    long = sp.csr_matrix((np.ones(300, np.float32), (np.zeros(300, int), np.arange(300))), shape=(1, 300))
    s = sp.vstack([sp.csr_matrix((a.data, a.indices, a.indptr), shape=a.shape), long]).tocsr()
    b = CSRMatrix.from_scipy(s)
    path = tmp_path / "m.h5"
    if fmt == "csr":
        write_matrix_h5(path, b, source="m")
    else:
        write_compressed_h5(path, CompressedMatrix.from_csr(b, fmt))
    with open_matrix(path) as src:
        plain = [(r0, r1, blk.indptr.copy(), blk.indices.copy(), blk.data.copy())
                 for r0, r1, blk in src.iter_chunks(max_nnz=211)]
        seen = set()
        for (r0, r1, blk), (p0, p1, ip, idx, val) in zip(src.iter_chunks(max_nnz=211, reuse=True), plain, strict=True):
            assert (r0, r1) == (p0, p1)
            np.testing.assert_array_equal(np.asarray(blk.indptr) - blk.indptr[0], ip - ip[0])
            np.testing.assert_array_equal(blk.indices[: blk.nnz], idx[: len(idx)])
            np.testing.assert_array_equal(blk.data[: blk.nnz], val[: len(val)])
            seen.add(blk.indices.__array_interface__["data"][0] if blk.nnz <= 211 else None)
        assert len(seen - {None}) == 2  # two buffers, used in turn
