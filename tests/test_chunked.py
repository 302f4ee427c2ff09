"""The chunk plan of a shared-memory one pass (mlemlib.chunked): its structure and its one-pass step."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib import chunked, reorder
from mlemlib.matrix import CSRMatrix


def _hand() -> CSRMatrix:
    # rows {0,1,2}, {1,2,3}, {10,11}
    return CSRMatrix.from_scipy(sp.csr_matrix(
        (np.arange(1, 9, dtype=np.float32), [0, 1, 2, 1, 2, 3, 10, 11], [0, 3, 6, 8]), shape=(3, 12)))


def _random(m=700, n=900, seed=0) -> CSRMatrix:
    rng = np.random.default_rng(seed)
    # rows that share voxels with their neighbours (a band), some empty
    rows, cols = [], []
    for i in range(m):
        if rng.random() < 0.1:
            continue
        c0 = int(i * (n - 60) / m)
        k = int(rng.integers(1, 40))
        rows += [i] * k
        cols += list(c0 + rng.choice(60, size=k, replace=False))
    a = sp.csr_matrix((rng.uniform(0.1, 1.0, len(rows)), (rows, cols)), shape=(m, n)).astype(np.float32)
    a.sort_indices()
    return CSRMatrix.from_scipy(a)


def test_plan_by_hand():
    p = chunked.build_plan(_hand(), window=4)
    assert p.chunk_rows.tolist() == [0, 2, 3]
    assert p.vptr.tolist() == [0, 4, 6]
    assert p.voxels.tolist() == [0, 1, 2, 3, 10, 11]
    assert p.local.tolist() == [0, 1, 2, 1, 2, 3, 0, 1]
    assert p.chunks == 2 and p.reuse == pytest.approx(8 / 6)
    # room for 3 voxels: every row alone
    assert chunked.build_plan(_hand(), window=3).chunk_rows.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("window", [40, 64, 300, 5000])
def test_plan_rebuilds_the_columns(window):
    a = _random()
    p = chunked.build_plan(a, window=window)
    np.testing.assert_array_equal(p.columns(a.indptr), a.indices)
    assert p.local.dtype == np.uint16 and int(p.local.max()) < window
    counts = np.diff(p.vptr)
    assert counts.max() <= window and p.chunk_rows[-1] == a.shape[0]
    for c in range(p.chunks):
        v = p.voxels[p.vptr[c] : p.vptr[c + 1]]
        assert (np.diff(v) > 0).all()  # sorted, distinct
        cols = a.indices[a.indptr[p.chunk_rows[c]] : a.indptr[p.chunk_rows[c + 1]]]
        assert set(v.tolist()) == set(cols.tolist())
    # the same chunks as voxel_reuse's count over the stored order
    assert reorder.voxel_reuse(a, window=window)["reuse"] == pytest.approx(p.reuse)
    assert p.bytes_per_nnz() > 6


def test_onepass_through_the_plan_equals_float64():
    a = _random(seed=3)
    rng = np.random.default_rng(1)
    f = rng.uniform(0.5, 1.5, a.shape[1]).astype(np.float32)
    g = rng.poisson(a.to_scipy() @ rng.uniform(0.5, 2.0, a.shape[1])).astype(np.float32)
    s64 = a.to_scipy().astype(np.float64)
    fp64 = s64 @ f.astype(np.float64)
    c64 = np.where(fp64 > 0, g / np.where(fp64 > 0, fp64, 1.0), 0.0)
    bp64 = s64.T @ c64
    for window in (40, 300):
        bp, fp = chunked.onepass(chunked.build_plan(a, window=window), a.indptr, a.data, g, f)
        assert np.linalg.norm(fp - fp64) / np.linalg.norm(fp64) < 1e-6
        assert np.linalg.norm(bp - bp64) / np.linalg.norm(bp64) < 1e-6


def test_plan_refusals_and_empty():
    with pytest.raises(ValueError, match="window must lie"):
        chunked.build_plan(_hand(), window=0)
    with pytest.raises(ValueError, match="window must lie"):
        chunked.build_plan(_hand(), window=1 << 17)
    with pytest.raises(ValueError, match="a row has 3 non-zeros, more than the window of 2"):
        chunked.build_plan(_hand(), window=2)
    empty = CSRMatrix.from_scipy(sp.csr_matrix((4, 5), dtype=np.float32))
    p = chunked.build_plan(empty)
    assert p.chunks == 1 and len(p.voxels) == 0 and p.bytes_per_nnz() == 0.0
    bp, fp = chunked.onepass(p, empty.indptr, empty.data, np.ones(4), np.ones(5))
    assert not bp.any() and not fp.any()
    with pytest.raises(ValueError, match="g must have 4 entries"):
        chunked.onepass(p, empty.indptr, empty.data, np.ones(3), np.ones(5))
