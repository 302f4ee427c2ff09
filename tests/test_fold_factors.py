"""A folded matrix with per-LOR factors (issue 53): ``m`` and ``b`` summed over each stored row's LORs.

A stored row stands for the LORs ``L_r`` whose rows of ``A`` are equal; its
measurement is their counts' sum ``G_r``, Poisson with mean
``M_r (A f)_r + B_r`` (``M_r``, ``B_r``: the sums of ``m`` and ``b`` over
``L_r``). The yardstick is a dense NumPy float64 OSEM of that summed model,
written here from the distinct rows the test builds (not from the fold's map),
and the unfolded run where ``b = 0``.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib import metrics
from mlemlib.corrections import background, factors_checksum, stored_values, summed_factors
from mlemlib.errors import ConfigError
from mlemlib.fold import RowFold, fold_file, fold_of
from mlemlib.formats.h5 import write_matrix_h5
from mlemlib.image import read_image
from mlemlib.matrix import CSRMatrix
from mlemlib.mlem import reconstruct, reference
from mlemlib.norm import compute_norm, read_subset_norms
from mlemlib.problem import ModelSpec, RunSettings
from mlemlib.reorder import permutation_of, reorder_file

U, N = 36, 12  # distinct rows, voxels
ITERATIONS = 6


# --------------------------------------------------------------------------- by hand


def test_summed_factors_by_hand():
    fold = RowFold(np.array([0, -1, 1, 0, 1, 2]), 3, "content").check("<here>")
    m = np.array([1.0, 9.0, 2.0, 3.0, 4.0, 5.0], dtype=np.float32)
    b = np.array([0.5, 7.0, 1.0, 0.25, 2.0, 3.0], dtype=np.float32)
    big_m, big_b = summed_factors(fold, m, b)
    np.testing.assert_array_equal(big_m, [4.0, 6.0, 5.0])  # LOR 1 is an empty row: no stored row has it
    np.testing.assert_array_equal(big_b, [0.75, 3.0, 3.0])
    assert big_m.dtype == big_b.dtype == np.float64
    # m = 1: each row's multiplicity; no b: None
    big_m, big_b = summed_factors(fold, None, None)
    np.testing.assert_array_equal(big_m, [2.0, 2.0, 1.0])
    assert big_b is None
    # what the backends add: b' = B / M, +inf where every LOR of the row is a gap
    big_m, big_b = summed_factors(fold, np.array([0, 1, 0.5, 0, 1.5, 2], np.float32), b)
    np.testing.assert_array_equal(background(big_m, big_b, 3, np.float64), [np.inf, 3.0 / 2.0, 1.5])


def test_a_stored_row_takes_one_label():
    fold = RowFold(np.array([0, -1, 1, 0, 1, 2]), 3, "content").check("<here>")
    np.testing.assert_array_equal(stored_values(np.array([3, 9, 1, 3, 1, 2]), fold, "x", "subset label"), [3, 1, 2])
    labels = np.array([3, 9, 1, 2, 1, 2])  # LORs 0 and 3 share stored row 0
    np.testing.assert_array_equal(stored_values(labels, fold, "s.i32", "subset label", first=True), [3, 1, 2])
    with pytest.raises(ConfigError, match=r"^s\.i32: LOR 3 has subset label 2, another LOR of its stored row has 3 "
                                          r"\(the matrix is folded: a stored row takes one subset label\)"):
        stored_values(labels, fold, "s.i32", "subset label")


# --------------------------------------------------------------------------- a folded problem


def _build(seed: int = 11):
    """``U`` distinct random rows, each repeated 1..4 times (the user's LORs, shuffled), and three empty LORs.

    Returns the user's matrix, ``src_row[i]`` (the distinct row of LOR i, -1 for an empty one), the distinct
    rows and the true image.
    """
    rng = np.random.default_rng(seed)
    rows = (rng.uniform(0.1, 2.0, (U, N)) * (rng.random((U, N)) < 0.4)).astype(np.float32)
    rows[np.arange(U), rng.integers(0, N, U)] = rng.uniform(0.5, 1.5, U).astype(np.float32)  # no row is empty
    rows[:, N - 1] = 0.0
    rows[::5, N - 1] = 0.7  # voxel N-1 seen by rows 0, 5, ... only (label u % 2 = 0 or 1 alternately)
    src_row = np.concatenate([np.repeat(np.arange(U), rng.integers(1, 5, U)), [-1, -1, -1]])
    rng.shuffle(src_row)
    dense = np.zeros((src_row.size, N), dtype=np.float32)
    dense[src_row >= 0] = rows[src_row[src_row >= 0]]
    f_true = rng.uniform(1.0, 5.0, N)
    return CSRMatrix.from_scipy(sp.csr_matrix(dense)), src_row, rows, f_true


def dense_summed_osem(rows, src_row, g, m, b, labels_u, subsets: int, iterations: int) -> np.ndarray:
    """OSEM in float64 on the explicitly summed model: row u of ``rows`` with ``G_u``, ``M_u``, ``B_u``."""
    d = rows.astype(np.float64)
    lors = src_row >= 0
    G = np.bincount(src_row[lors], weights=np.asarray(g, np.float64)[lors], minlength=U)
    M = np.bincount(src_row[lors], weights=np.asarray(m, np.float64)[lors], minlength=U)
    B = np.bincount(src_row[lors], weights=np.asarray(b, np.float64)[lors], minlength=U)
    sk = np.stack([(d[labels_u == k] * M[labels_u == k, None]).sum(axis=0) for k in range(subsets)])
    s = sk.sum(axis=0)
    f = np.full(N, G.sum() / s.sum())
    for _ in range(iterations):
        for k in range(subsets):
            r = labels_u == k
            ybar = M[r] * (d[r] @ f) + B[r]
            c = np.where(ybar > 0, M[r] * G[r] / np.where(ybar > 0, ybar, 1.0), 0.0)
            bp = d[r].T @ c
            f = np.where(sk[k] > 0, f * bp / np.where(sk[k] > 0, sk[k], 1.0), f)
            f = np.where(s > 0, f, 0.0)
    return f


@pytest.fixture(scope="module")
def folded(tmp_path_factory):
    """The user's matrix and its content fold, both grouped into 2 subsets by one subset file (the label of a
    LOR is its distinct row's, u mod 2: a stored row's LORs share it); m varies inside every stored row."""
    a, src_row, rows, f_true = _build()
    d = tmp_path_factory.mktemp("foldfactors")
    write_matrix_h5(d / "a.h5", a)
    fold_file(d / "a.h5", d / "f.h5")
    assert fold_of(d / "f.h5").m_stored == U
    labels_u = (np.arange(U) % 2).astype(np.int32)
    np.where(src_row >= 0, labels_u[np.maximum(src_row, 0)], 0).astype("<i4").tofile(d / "s.i32")
    for name in ("a", "f"):
        reorder_file(d / f"{name}.h5", d / f"{name}1.h5", "rows")
        reorder_file(d / f"{name}.h5", d / f"{name}2.h5", "rows", subsets=2, subset_file=d / "s.i32")
    assert permutation_of(d / "f2.h5") is not None and fold_of(d / "f2.h5") is not None
    rng = np.random.default_rng(5)
    m = rng.uniform(0.3, 1.6, src_row.size).astype(np.float32)
    m[np.flatnonzero(src_row >= 0)[:2]] = 0.0  # two gaps
    b = rng.uniform(0.5, 3.0, src_row.size).astype(np.float32)
    m.tofile(d / "m.f32")
    b.tofile(d / "b.f32")
    lam = np.where(src_row >= 0, m * (rows.astype(np.float64) @ f_true)[np.maximum(src_row, 0)], 0.0)
    g0 = rng.poisson(20.0 * lam).astype(np.int32)  # b = 0: no counts at the gaps
    gb = rng.poisson(20.0 * lam + b * (src_row >= 0)).astype(np.int32)
    assert g0[m == 0].sum() == 0 and gb.sum() > g0.sum()
    return d, src_row, rows, labels_u, m, b, g0, gb


def _image(path) -> np.ndarray:
    return read_image(path)[0]


@pytest.mark.parametrize("subsets", [1, 2])
def test_without_background_the_folded_run_is_the_unfolded_one(folded, tmp_path, subsets):
    d, src_row, rows, labels_u, m, b, g0, gb = folded
    kw = dict(subsets=subsets, multiplicative=d / "m.f32")
    if subsets > 1:
        kw["subset_file"] = d / "s.i32"
    settings = RunSettings(ITERATIONS, checkpoint_every=0, backend="cpu")
    reference(ModelSpec(d / f"a{subsets}.h5", g0, **kw), settings, tmp_path / "ra.h5")
    reference(ModelSpec(d / f"f{subsets}.h5", g0, **kw), settings, tmp_path / "rf.h5")
    ref = _image(tmp_path / "ra.h5")
    assert metrics.relative_l2(_image(tmp_path / "rf.h5"), ref) < 1e-10
    reconstruct(ModelSpec(d / f"f{subsets}.h5", g0, **kw), settings, tmp_path / "if.h5")
    assert metrics.relative_l2(_image(tmp_path / "if.h5"), ref) < 1e-5
    # the summed model agrees (with b = 0 it is the unfolded one)
    expected = dense_summed_osem(rows, src_row, g0, m, np.zeros_like(b), labels_u % subsets, subsets, ITERATIONS)
    assert metrics.relative_l2(ref, expected) < 1e-10


@pytest.mark.parametrize("subsets", [1, 2])
def test_with_background_the_folded_run_is_the_ml_image_of_the_summed_counts(folded, tmp_path, subsets):
    d, src_row, rows, labels_u, m, b, g0, gb = folded
    kw = dict(subsets=subsets, multiplicative=d / "m.f32", additive=d / "b.f32")
    if subsets > 1:
        kw["subset_file"] = d / "s.i32"
    settings = RunSettings(ITERATIONS, checkpoint_every=0, backend="cpu")
    expected = dense_summed_osem(rows, src_row, gb, m, b, labels_u % subsets, subsets, ITERATIONS)
    reference(ModelSpec(d / f"f{subsets}.h5", gb, **kw), settings, tmp_path / "rf.h5")
    ref = _image(tmp_path / "rf.h5")
    assert metrics.relative_l2(ref, expected) < 1e-10
    reconstruct(ModelSpec(d / f"f{subsets}.h5", gb, **kw), settings, tmp_path / "if.h5")
    assert metrics.relative_l2(_image(tmp_path / "if.h5"), expected) < 1e-5
    # another model than the unfolded run's (per-LOR b inside a stored row): the yardstick tells them apart
    reference(ModelSpec(d / f"a{subsets}.h5", gb, **kw), settings, tmp_path / "ra.h5")
    assert metrics.relative_l2(_image(tmp_path / "ra.h5"), expected) > 1e-6


def test_background_without_m_is_summed_over_the_multiplicity(folded, tmp_path):
    d, src_row, rows, labels_u, m, b, g0, gb = folded
    ones = np.ones_like(m)
    expected = dense_summed_osem(rows, src_row, gb, ones, b, labels_u * 0, 1, ITERATIONS)
    reference(ModelSpec(d / "f1.h5", gb, additive=d / "b.f32"), RunSettings(ITERATIONS, checkpoint_every=0),
              tmp_path / "rf.h5")
    assert metrics.relative_l2(_image(tmp_path / "rf.h5"), expected) < 1e-10


def test_the_sensitivities_use_the_summed_m(folded, tmp_path):
    d, src_row, rows, labels_u, m, b, g0, gb = folded
    lors = src_row >= 0
    M = np.bincount(src_row[lors], weights=m[lors].astype(np.float64), minlength=U)
    expected = np.stack([(rows[labels_u == k].astype(np.float64) * M[labels_u == k, None]).sum(axis=0)
                         for k in range(2)])
    for name in ("a2", "f2"):  # rows grouped by the labels 0, 1; reordered by rows only: voxels in the user's order
        compute_norm(d / f"{name}.h5", tmp_path / f"n{name}.h5", multiplicative=d / "m.f32")
        sk = read_subset_norms(tmp_path / f"n{name}.h5", permutation_of(d / f"{name}.h5").subsets,
                               factors_checksum(m))
        assert sk is not None
        np.testing.assert_allclose(sk, expected, rtol=1e-13, atol=0)


# --------------------------------------------------------------------------- the workflow


def _mixed(fold, values) -> np.ndarray:
    """Stored rows whose LORs carry more than one of ``values`` (the user's LOR order)."""
    rm = fold.row_map
    users = np.flatnonzero(rm >= 0)
    lo = np.full(fold.m_stored, np.inf)
    hi = np.full(fold.m_stored, -np.inf)
    np.minimum.at(lo, rm[users], values[users])
    np.maximum.at(hi, rm[users], values[users])
    return np.flatnonzero(lo != hi)


@pytest.mark.slow
def test_workflow_folded_compressed_reordered_osem_with_realistic_data(tmp_path):
    """Issue 53, failure 1: ``fold: true``, compressed, ``reorder: rows+voxels``, S = 4 and the simulation's
    attenuation, normalisation, randoms and scatter run through (the content fold merges mirror-image LORs of
    other angles and other factors) to an image within 1e-5 of the float64 reference of the same model."""
    from conftest import run_workflow

    from mlemlib.formats import open_matrix
    from mlemlib.subsets import angle_labels, scanner_of

    config = {
        "use_gpu": False,
        "reorder": "rows+voxels",
        "matrices": {"small": {"preset": "small", "fold": True, "format": "compressed"}},
        "transpose": {"method": "scantrans", "compare": []},
        "partition": {"parts": [2]},
        "simulation": {"phantoms": ["nema"], "seeds": [1], "noiseless": False, "counts": None, "attenuation": True,
                       "normalisation_spread": 0.1, "randoms_fraction": 0.2, "scatter_fraction": 0.3},
        "mlem": {"iterations": 3, "checkpoint_every": 0, "repetitions": 1, "reference": True, "subsets": 4},
        "runs": [{"backend": "cpu"}],
        "bench": {"spmv": False},
    }
    run_workflow(tmp_path, config, "--cores", "2")
    res = tmp_path / "results/small"
    fold = fold_of(res / "matrix.h5")
    assert fold is not None and fold.m_user == 36864
    # the case of the issue: stored rows whose LORs differ in m, and (a content fold) lie at several angles
    assert _mixed(fold, np.fromfile(next(res.glob("data/*.mult.f32")), dtype="<f4")).size > 0
    with open_matrix(res / "converted.h5") as s:
        assert _mixed(fold, angle_labels(scanner_of(s), 4)).size > 0
    runs = list(res.glob("runs/*/*/*/image.h5"))
    refs = list(res.glob("runs/*/reference-*/image.h5"))
    assert len(runs) == 1 and len(refs) == 1 and "osem4_m" in str(runs[0]) and "_b" in str(runs[0])
    image, ref = read_image(runs[0])[0], read_image(refs[0])[0]
    assert ref.dtype == np.float64 and image.dtype == np.float32
    assert metrics.relative_l2(image, ref) < 1e-5
