"""OSEM subsets, multiplicative factors m and background b (issue 39) on the cpu backend and in the workflow (CPU only).

The yardstick is an independent dense NumPy float64 implementation of the
numerical contract (DESIGN.md), written here: ``ybar = m (A f) + b``,
``c = m g / ybar`` (0 where ``ybar == 0``), ``f <- f * A_k^T c / s^k`` per
subset, ``f`` kept where ``s^k_j == 0 < s_j`` and 0 where ``s_j == 0``.
"""

from __future__ import annotations

import copy

import h5py
import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib import metrics
from mlemlib.backends.cpu import CpuBackend
from mlemlib.corrections import background, read_factors
from mlemlib.errors import ConfigError
from mlemlib.formats.h5 import write_matrix_h5
from mlemlib.image import read_image
from mlemlib.matrix import CSRMatrix
from mlemlib.mlem import reconstruct, reference
from mlemlib.norm import compute_norm, read_norm, read_subset_norms, sensitivities
from mlemlib.problem import ModelSpec, RunSettings
from mlemlib.reorder import compute_permutation, permutation_of, read_permutation, reorder_file
from mlemlib.subsets import (
    angle_labels,
    bounds_of,
    index_labels,
    labels_for,
    order,
    read_subset_file,
    update_norms,
)
from test_workflow import dry_run, one_line, snakemake, user_files

S = 4
M, N = 160, 14
KEPT = 12  # seen by subset 0's rows only: kept in sub-iterations 1..3
UNSEEN = 13  # seen by no LOR: s = 0


def _problem(seed: int = 3):
    """A matrix whose rows i mod S form the subsets, with a voxel only subset 0 sees and one nobody sees; g, m (with
    gaps) and b."""
    rng = np.random.default_rng(seed)
    d = sp.random(M, N, density=0.3, random_state=seed, format="lil", dtype=np.float64)
    d[:, UNSEEN] = 0.0
    d[:, KEPT] = 0.0
    for i in range(0, M, 2 * S):  # rows of subset 0 only
        d[i, KEPT] = rng.uniform(0.5, 2.0)
    a = d.tocsr().astype(np.float32)
    a.eliminate_zeros()
    m = rng.uniform(0.2, 1.0, M).astype(np.float32)
    m[[3, 17, 50]] = 0.0  # gaps
    b = rng.uniform(0.0, 2.0, M).astype(np.float32)
    b[[17, 60]] = 0.0  # a gap with b = 0 too, and a LOR without background
    f_true = rng.uniform(1.0, 4.0, N)
    g = rng.poisson(m * (a.astype(np.float64) @ f_true) * 5.0 + b).astype(np.int32)
    return CSRMatrix.from_scipy(a), g, m, b


def dense_osem(a: CSRMatrix, g, m, b, labels, subsets: int, iterations: int) -> np.ndarray:
    """The contract in dense float64, subsets visited 0 .. S-1."""
    d = a.to_scipy().toarray().astype(np.float64)
    g, m, b = (np.asarray(v, dtype=np.float64) for v in (g, m, b))
    sk = np.stack([(d[labels == k] * m[labels == k, None]).sum(axis=0) for k in range(subsets)])
    s = sk.sum(axis=0)
    f = np.full(d.shape[1], g.sum() / s.sum())
    for _ in range(iterations):
        for k in range(subsets):
            rows = labels == k
            ybar = m[rows] * (d[rows] @ f) + b[rows]
            c = np.zeros_like(ybar)
            c[ybar != 0] = (m[rows] * g[rows])[ybar != 0] / ybar[ybar != 0]
            bp = d[rows].T @ c
            upd = np.where(sk[k] != 0, f * bp / np.where(sk[k] != 0, sk[k], 1.0), f)
            f = np.where(s == 0, f * bp, upd)
    return f


@pytest.fixture(scope="module")
def problem():
    return _problem()


@pytest.fixture(scope="module")
def grouped(problem, tmp_path_factory):
    """The problem's container, the same grouped by subset (i mod S), and the m and b files."""
    a, g, m, b = problem
    d = tmp_path_factory.mktemp("osem")
    write_matrix_h5(d / "a.h5", a)
    summary = reorder_file(d / "a.h5", d / "r.h5", "none", subsets=S)
    assert summary["subsets"] == S
    m.tofile(d / "m.f32")
    b.tofile(d / "b.f32")
    return d


def _run(d, g, out, model=(), settings=(), **call):
    """Five OSEM iterations of ``d / r.h5`` on the cpu: S subsets with m and b (``model`` overrides these),
    no checkpoints (``settings`` overrides these); ``call``: reconstruct's other arguments."""
    model = {"multiplicative": d / "m.f32", "additive": d / "b.f32", **dict(model)}
    model = ModelSpec(d / "r.h5", g, subsets=S, **model)
    settings = RunSettings(5, **{"checkpoint_every": 0, "backend": "cpu", **dict(settings)})
    return reconstruct(model, settings, out, **call)


# ------------------------------------------------------------------ against the dense contract


def test_reference_matches_the_dense_contract(problem, grouped, tmp_path):
    a, g, m, b = problem
    expected = dense_osem(a, g, m, b, index_labels(M, S), S, 5)
    reference(ModelSpec(grouped / "r.h5", g, subsets=S, multiplicative=grouped / "m.f32", additive=grouped / "b.f32"),
              RunSettings(5, checkpoint_every=0), tmp_path / "ref.h5")
    img, attrs = read_image(tmp_path / "ref.h5")
    assert img.dtype == np.float64 and attrs["subsets"] == S
    assert metrics.relative_l2(img, expected) < 1e-12
    assert img[UNSEEN] == 0.0 and img[KEPT] > 0


@pytest.mark.parametrize("fp,bp,with_t", [("numba", "numba", False), ("numba", "numba", True),
                                          ("scipy", "scipy", True), ("scipy", "scipy", False),
                                          ("numba", "notrans", False), ("auto", "onepass", False)])
def test_cpu_kernels_match_the_dense_contract(problem, grouped, tmp_path, fp, bp, with_t):
    a, g, m, b = problem
    expected = dense_osem(a, g, m, b, index_labels(M, S), S, 5)
    transpose = None
    if with_t:
        reordered = permutation_of(grouped / "r.h5")
        at = a.to_scipy()[reordered.rows].T.tocsr()
        transpose = CSRMatrix.from_scipy(at)
    _run(grouped, g, tmp_path / "img.h5", model={"transpose": transpose}, settings={"fp": fp, "bp": bp})
    img, _ = read_image(tmp_path / "img.h5")
    assert img.dtype == np.float32
    assert metrics.relative_l2(img, expected) < 1e-5


def test_chunked_one_pass_takes_subsets_and_gaps_and_refuses_a_background(problem, grouped, tmp_path):
    a, g, m, b = problem
    expected = dense_osem(a, g, m, np.zeros(M), index_labels(M, S), S, 5)
    # m's gaps: counts of 0
    _run(grouped, g, tmp_path / "img.h5", model={"additive": None}, settings={"bp": "onepass_chunked"})
    assert metrics.relative_l2(read_image(tmp_path / "img.h5")[0], expected) < 1e-5
    with pytest.raises(ConfigError, match="onepass_chunked on the cpu takes no additive background"):
        _run(grouped, g, tmp_path / "img2.h5", settings={"bp": "onepass_chunked"})


def test_compressed_matrix_runs_the_same_subsets(problem, tmp_path):
    a, g, m, b = problem
    from mlemlib.formats import convert

    write_matrix_h5(tmp_path / "a.h5", a)
    convert(tmp_path / "a.h5", tmp_path / "c.h5", fmt="compressed")
    reorder_file(tmp_path / "c.h5", tmp_path / "r.h5", "none", subsets=S)
    m.tofile(tmp_path / "m.f32")
    b.tofile(tmp_path / "b.f32")
    expected = dense_osem(a, g, m, b, index_labels(M, S), S, 5)
    for bp in ("numba", "onepass"):
        _run(tmp_path, g, tmp_path / f"{bp}.h5", settings={"bp": bp})
        assert metrics.relative_l2(read_image(tmp_path / f"{bp}.h5")[0], expected) < 1e-5


def test_one_subset_with_m_and_b_is_mlem_with_them(problem, tmp_path):
    a, g, m, b = problem
    m.tofile(tmp_path / "m.f32")
    b.tofile(tmp_path / "b.f32")
    expected = dense_osem(a, g, m, b, np.zeros(M, dtype=np.int32), 1, 5)
    reconstruct(ModelSpec(a, g, multiplicative=tmp_path / "m.f32", additive=tmp_path / "b.f32"),
                RunSettings(5, checkpoint_every=0, backend="cpu"), tmp_path / "img.h5")
    assert metrics.relative_l2(read_image(tmp_path / "img.h5")[0], expected) < 1e-5


def test_checkpointed_osem_resumes_bit_identical(problem, grouped, tmp_path):
    a, g, m, b = problem
    _run(grouped, g, tmp_path / "whole.h5")
    ckpt = tmp_path / "ck.h5"
    half = {"checkpoint_every": 2}
    _run(grouped, g, tmp_path / "half.h5", settings=half, checkpoint=ckpt, keep_checkpoint=True)
    with h5py.File(ckpt, "r") as f:
        assert int(f.attrs["iteration"]) == 4  # the last checkpoint: after iteration 4's last subset
    _run(grouped, g, tmp_path / "again.h5", settings=half, checkpoint=ckpt)
    assert np.array_equal(read_image(tmp_path / "whole.h5")[0], read_image(tmp_path / "again.h5")[0])


# ------------------------------------------------------------------ S = 1, m = 1, b = 0: today's bits


@pytest.mark.parametrize("fp,bp,with_t", [("numba", "numba", False), ("numba", "numba", True),
                                          ("scipy", "scipy", True), ("scipy", "scipy", False),
                                          ("numba", "notrans", False), ("auto", "onepass", False),
                                          ("auto", "onepass_chunked", False)])
def test_explicit_single_subset_and_zero_background_give_todays_bits(problem, fp, bp, with_t):
    a, g, _, _ = problem
    norm = a.to_scipy().astype(np.float64).sum(axis=0).A1
    t = CSRMatrix.from_scipy(a.to_scipy().T.tocsr()) if with_t else None

    def image(**kw):
        be = CpuBackend(a, g, kw.pop("norm", norm), transpose=t, fp=fp, bp=bp, **kw)
        f = be.initial_image()
        for _ in range(4):
            f = be.iterate(f)
        return f

    today = image()
    zero = None if bp == "onepass_chunked" else np.zeros(M, dtype=np.float32)
    assert np.array_equal(image(norm=norm[None, :], subsets=np.array([0, M]), background=zero), today)
    # update_norms' float32 s: the same update, but f0's float64 sum is over the rounded s (docs/reconstruction.md)
    f32 = image(norm=update_norms(norm[None, :]), subsets=np.array([0, M]))
    assert metrics.relative_l2(f32, today) < 1e-6


def test_reconstruct_with_subsets_1_writes_todays_image(problem, tmp_path):
    a, g, _, _ = problem
    reconstruct(ModelSpec(a, g), RunSettings(4, checkpoint_every=0, backend="cpu"), tmp_path / "a.h5")
    reconstruct(ModelSpec(a, g, subsets=1), RunSettings(4, checkpoint_every=0, backend="cpu"), tmp_path / "b.h5")
    (img_a, attrs_a), (img_b, attrs_b) = read_image(tmp_path / "a.h5"), read_image(tmp_path / "b.h5")
    assert np.array_equal(img_a, img_b) and attrs_a["problem"] == attrs_b["problem"]


# ------------------------------------------------------------------ the subsets and the reorder stage


def test_reorder_groups_rows_subset_major_keeping_the_locality_order(problem, grouped, tmp_path):
    a, _, _, _ = problem
    labels = index_labels(M, S)
    perm = permutation_of(grouped / "r.h5")
    assert perm.subset_method == "index"
    assert np.array_equal(perm.subsets, [0, 40, 80, 120, 160])
    assert (np.diff(labels[perm.rows]) >= 0).all()
    # rows+voxels: the locality order inside each subset, and the bounds in the standalone perm.h5 too
    write_matrix_h5(tmp_path / "g.h5", a, grid=(7, 2, 1))
    reorder_file(tmp_path / "g.h5", tmp_path / "r.h5", "rows+voxels", subsets=S, perm_out=tmp_path / "perm.h5")
    local = compute_permutation(tmp_path / "g.h5", "rows+voxels").rows
    got = read_permutation(tmp_path / "perm.h5")
    assert np.array_equal(got.subsets, permutation_of(tmp_path / "r.h5").subsets)
    for k in range(S):
        part = got.rows[got.subsets[k] : got.subsets[k + 1]]
        assert np.array_equal(part, local[labels[local] == k])


def test_order_and_bounds():
    labels = np.array([2, 0, 1, 0, 2, 1, 1])
    rows, bounds = order(labels)
    assert rows.tolist() == [1, 3, 2, 5, 6, 0, 4] and bounds.tolist() == [0, 2, 5, 7]
    rows, bounds = order(labels, within=np.array([6, 5, 4, 3, 2, 1, 0]))
    assert rows.tolist() == [3, 1, 6, 5, 2, 4, 0]
    assert bounds_of(labels[rows], 3, "x").tolist() == [0, 2, 5, 7]
    with pytest.raises(ConfigError, match=r"^m\.h5: rows are not grouped by the 3 subsets \(row 1 is in subset 0"):
        bounds_of(labels, 3, "m.h5")


def test_update_norms():
    sk = np.array([[1.0, 0.0, 0.0, 2.0], [3.0, 0.0, 5.0, 1e-50]])
    out = update_norms(sk)
    assert out.dtype == np.float32
    assert out[0, 0] == 1 and out[1, 0] == 3 and out[0, 1] == 0 and out[1, 1] == 0  # s = 0
    assert np.isnan(out[0, 2]) and out[1, 2] == 5  # s^k = 0 < s: kept
    assert out[1, 3] > 0  # a positive s^k below float32's range stays positive
    assert update_norms(sk, np.float64)[1, 3] == 1e-50


def test_sensitivities_of_update_norms_round_trip():
    """The sensitivities come back from update_norms (NaN: 0), with their sum and 1/s (0 where s = 0)."""
    from mlemlib.subsets import sensitivities_of

    sk = np.array([[1.0, 0.0, 0.0, 2.0], [3.0, 0.0, 5.0, 0.5]])
    back, s, inv_s = sensitivities_of(update_norms(sk))
    np.testing.assert_array_equal(back, sk)
    np.testing.assert_array_equal(s, [4.0, 0.0, 5.0, 2.5])
    np.testing.assert_array_equal(inv_s, [0.25, 0.0, 0.2, 0.4])
    one = sensitivities_of(np.array([2.0, 0.0]))  # S = 1's (n,) norm
    assert one[0].shape == (1, 2) and list(one[2]) == [0.5, 0.0]


def test_angle_subsets_of_a_preset_pair_both_directions_and_interleave_views():
    from mlemlib.scanner import get_preset

    cfg = get_preset("small")
    labels = angle_labels(cfg, 8)
    nc = cfg.n_crystals
    i, j = np.divmod(np.arange(nc * nc), nc)
    assert np.array_equal(labels, labels[j * nc + i])  # the LOR (i, j) is the LOR (j, i)
    counts = np.bincount(labels, minlength=8)
    assert counts.min() > 0.8 * counts.mean()  # interleaved views: balanced subsets


def test_labels_for_a_preset_container_are_by_angle(tmp_path):
    from mlemlib.scanner import generate

    generate("small", tmp_path / "s.csr4")
    from mlemlib.formats import convert

    convert(tmp_path / "s.csr4", tmp_path / "s.h5")
    from mlemlib.formats.h5 import MatrixH5

    with MatrixH5(tmp_path / "s.h5") as src:
        labels, method = labels_for(src, 4)
    assert method == "angle" and labels.max() == 3


def test_subset_file_refusals(tmp_path):
    path = tmp_path / "sub.i32"
    np.array([0, 1, 2, 0], dtype="<i4").tofile(path)
    assert read_subset_file(path, 4, 3).tolist() == [0, 1, 2, 0]
    cases = [(np.array([0, 1, 2], "<i4"), 3, "3 subset labels, expected one per LOR (4)"),
             (np.array([0, 1, 3, 0], "<i4"), 3, "subset label 3 at LOR 2, expected 0 .. 2"),
             (np.array([0, 1, 1, 0], "<i4"), 3, "subset 2 of 3 holds no LOR")]
    for labels, s, fault in cases:
        labels.tofile(path)
        with pytest.raises(ConfigError) as exc:
            read_subset_file(path, 4, s)
        assert str(exc.value) == f"{path}: {fault}"
    path.write_bytes(b"\0" * 7)
    with pytest.raises(ConfigError, match=r"size 7 is not a multiple of 4 bytes"):
        read_subset_file(path, 4, 3)


def test_a_run_on_rows_not_grouped_is_refused_in_one_line(problem, grouped, tmp_path):
    _, g, _, _ = problem
    with pytest.raises(ConfigError) as exc:
        reconstruct(ModelSpec(grouped / "a.h5", g, subsets=S), RunSettings(1, backend="cpu"), tmp_path / "img.h5")
    assert str(exc.value).startswith(f"{grouped / 'a.h5'}: rows are not grouped by the 4 subsets")
    assert "mlem reorder --subsets 4" in str(exc.value) and "\n" not in str(exc.value)


def test_subset_file_through_reorder_and_run(problem, tmp_path):
    a, g, m, b = problem
    labels = (np.arange(M) * 7 // M % 3).astype("<i4")
    labels.tofile(tmp_path / "sub.i32")
    write_matrix_h5(tmp_path / "a.h5", a)
    reorder_file(tmp_path / "a.h5", tmp_path / "r.h5", "rows", subsets=3, subset_file=tmp_path / "sub.i32")
    t = reconstruct(ModelSpec(tmp_path / "r.h5", g, subsets=3, subset_file=tmp_path / "sub.i32"),
                    RunSettings(3, checkpoint_every=0, backend="cpu"), tmp_path / "img.h5")
    assert t["config"]["subset_method"] == "file"
    expected = dense_osem(a, g, np.ones(M), np.zeros(M), labels, 3, 3)
    assert metrics.relative_l2(read_image(tmp_path / "img.h5")[0], expected) < 1e-5


# ------------------------------------------------------------------ the factors


def test_factor_refusals_name_the_file_in_one_line(tmp_path):
    path = tmp_path / "m.f32"
    cases = [(np.ones(3), "multiplicative", "3 multiplicative factors, expected one per LOR (4, the measurement's length)"),
             (np.array([1, np.nan, 1, 1]), "multiplicative", "multiplicative factor nan at LOR 1 (NaN or Inf)"),
             (np.array([1, 1, np.inf, 1]), "additive", "additive background inf at LOR 2 (NaN or Inf)"),
             (np.array([1, 1, 1, -2]), "additive", "negative additive background -2.0 at LOR 3"),
             (np.zeros(4), "multiplicative", "every multiplicative factor is 0: no LOR counts")]
    for values, kind, fault in cases:
        values.astype("<f4").tofile(path)
        with pytest.raises(ConfigError) as exc:
            read_factors(path, 4, kind)
        assert str(exc.value) == f"{path}: {fault}"
    path.write_bytes(b"\0" * 10)
    with pytest.raises(ConfigError, match=r"m\.f32: size 10 is not a multiple of 4 bytes"):
        read_factors(path, 4, "additive")
    with pytest.raises(ConfigError, match="no such multiplicative factor file"):
        read_factors(tmp_path / "none.f32", 4, "multiplicative")


def test_factors_from_hdf5(tmp_path):
    with h5py.File(tmp_path / "f.h5", "w") as f:
        f["corr/m"] = np.array([1.0, 0.5, 0.0, 2.0])
    assert read_factors(tmp_path / "f.h5", 4, "multiplicative").tolist() == [1.0, 0.5, 0.0, 2.0]
    assert read_factors(f"{tmp_path / 'f.h5'}:/corr/m", 4, "multiplicative")[1] == 0.5
    with h5py.File(tmp_path / "f.h5", "a") as f:
        f["b"] = np.zeros(4)
    with pytest.raises(ConfigError, match="holds 2 datasets; name one as"):
        read_factors(tmp_path / "f.h5", 4, "additive")
    with pytest.raises(ConfigError, match="no dataset '/x'"):
        read_factors(f"{tmp_path / 'f.h5'}:/x", 4, "additive")


def test_background_is_b_over_m_and_inf_at_a_gap():
    bg = background(np.array([2.0, 0.0, 1.0, 0.0], np.float32), np.array([1.0, 3.0, 0.0, 0.0], np.float32), 4)
    assert bg.dtype == np.float32 and bg.tolist() == [0.5, np.inf, 0.0, np.inf]
    assert background(None, None, 2).tolist() == [0.0, 0.0]


def test_a_bad_factor_file_stops_the_cli_in_one_line(problem, grouped, tmp_path, capsys):
    from mlemlib.cli import main

    _, g, _, _ = problem
    g.astype("<i4").tofile(tmp_path / "g.LMsino")
    np.ones(5, "<f4").tofile(tmp_path / "bad.f32")
    rc = main(["reconstruct", "-m", str(grouped / "r.h5"), "-s", str(tmp_path / "g.LMsino"), "-n", "1",
               "--subsets", "4", "--multiplicative", str(tmp_path / "bad.f32"), "-b", "cpu",
               "-o", str(tmp_path / "img.h5")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == (f"mlem: error: {tmp_path / 'bad.f32'}: 5 multiplicative factors, expected one per "
                                   f"LOR ({M}, the measurement's length)")


def test_a_reference_of_other_factors_is_refused(problem, grouped, tmp_path):
    _, g, _, _ = problem
    reference(ModelSpec(grouped / "r.h5", g, subsets=S), RunSettings(5, checkpoint_every=0), tmp_path / "ref.h5")
    with pytest.raises(ConfigError, match="reference of another problem"):
        _run(grouped, g, tmp_path / "img.h5", reference=tmp_path / "ref.h5")


# ------------------------------------------------------------------ the norm stage


def test_norm_stage_writes_the_subsets_sensitivities(problem, grouped, tmp_path):
    a, _, m, _ = problem
    norm = compute_norm(grouped / "r.h5", tmp_path / "norm.h5")
    plain = compute_norm(grouped / "a.h5", tmp_path / "plain.h5")
    perm = permutation_of(grouped / "r.h5")
    assert np.array_equal(norm, plain)  # m = 1: the column sums as ever (here the voxels keep their order)
    sk = read_subset_norms(tmp_path / "norm.h5", perm.subsets, "")
    d = a.to_scipy().toarray().astype(np.float64)
    labels = index_labels(M, S)
    assert np.allclose(sk, [d[labels == k].sum(axis=0) for k in range(S)], rtol=1e-12)
    assert read_subset_norms(tmp_path / "norm.h5", np.array([0, M]), "") is None  # other subsets: none
    compute_norm(grouped / "r.h5", tmp_path / "norm-m.h5", multiplicative=grouped / "m.f32")
    from mlemlib.corrections import factors_checksum

    skm = read_subset_norms(tmp_path / "norm-m.h5", perm.subsets, factors_checksum(m))
    assert np.allclose(skm, [(d[labels == k] * m[labels == k, None]).sum(axis=0) for k in range(S)], rtol=1e-12)
    assert np.allclose(read_norm(tmp_path / "norm-m.h5"), skm.sum(axis=0), rtol=1e-15)


def test_a_run_reads_the_norm_stages_sensitivities(problem, grouped, tmp_path, monkeypatch):
    _, g, _, _ = problem
    compute_norm(grouped / "r.h5", tmp_path / "norm.h5", multiplicative=grouped / "m.f32")
    import mlemlib.norm

    calls = []
    monkeypatch.setattr(mlemlib.norm, "sensitivities", lambda *a, **k: calls.append(1))
    _run(grouped, g, tmp_path / "img.h5", model={"norm": tmp_path / "norm.h5"})
    assert not calls


def test_sensitivities_of_one_subset_are_the_norms_bits(problem, grouped):
    from mlemlib.formats.h5 import MatrixH5
    from mlemlib.norm import source_column_sums

    with MatrixH5(grouped / "r.h5") as src:
        assert np.array_equal(sensitivities(src, np.array([0, M]))[0], source_column_sums(src))


# ------------------------------------------------------------------ the workflow


def _osem_config(tmp_path, m_values=None, **measurement):
    config = user_files(tmp_path)
    (np.ones(40) if m_values is None else m_values).astype("<f4").tofile(tmp_path / "data/m.f32")
    np.full(40, 0.5, "<f4").tofile(tmp_path / "data/b.f32")
    config["matrices"]["mine"]["measurements"] = {
        "scan": {"counts": "data/scan.LMsino", "multiplicative": "data/m.f32", "additive": "data/b.f32", **measurement}
    }
    config["mlem"] = {**config["mlem"], "subsets": 2}
    config["reorder"] = "none"
    return config


def test_workflow_plans_subsets_and_factors(tmp_path):
    jobs = dry_run(tmp_path, _osem_config(tmp_path))
    assert jobs["reorder_matrix"] == 1 and jobs["compute_measurement_norm"] == 1 and jobs["run_mlem"] == 1
    assert "compute_norm" not in jobs  # the one measurement has its own sensitivities


def test_workflow_runs_osem_and_names_the_model_in_the_paths(tmp_path):
    config = _osem_config(tmp_path)
    proc = snakemake(tmp_path, "--cores", "2", config=config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = sorted(p.name for p in (tmp_path / "results/mine/runs/scan").iterdir())
    assert len(runs) == 2 and all("-osem2_m" in r and "_b" in r for r in runs), runs
    # other factors: other directories (the first run's outputs stay), the matrix's stages kept
    other = copy.deepcopy(config)
    other["matrices"]["mine"]["measurements"]["scan"]["multiplicative"] = "data/m2.f32"
    np.full(40, 0.5, "<f4").tofile(tmp_path / "data/m2.f32")
    assert dry_run(tmp_path, other) == {"compute_measurement_norm": 1, "reference_mlem": 1, "run_mlem": 1,
                                        "summarize": 1}
    # other subsets: the reorder stage groups the rows again
    other = copy.deepcopy(config)
    other["mlem"]["subsets"] = 3
    assert dry_run(tmp_path, other)["reorder_matrix"] == 1


@pytest.mark.parametrize("role", ["multiplicative", "additive"])
def test_a_factor_file_of_the_wrong_length_stops_the_dry_run(tmp_path, role):
    config = _osem_config(tmp_path)
    np.ones(7, "<f4").tofile(tmp_path / "data/short.f32")
    config["matrices"]["mine"]["measurements"]["scan"][role] = "data/short.f32"
    line = one_line(snakemake(tmp_path, "--dry-run", config=config))
    assert line == (f"config matrices.mine.measurements.scan.{role}: data/short.f32: 7 values, but the matrix has "
                    "40 rows (LORs)")


@pytest.mark.parametrize(
    ("role", "values", "fault"),
    [
        ("multiplicative", [1.0] * 7 + [np.nan] + [1.0] * 32, "multiplicative factor nan at LOR 7 (NaN or Inf)"),
        ("multiplicative", [0.0] * 40, "every multiplicative factor is 0: no LOR counts"),
        ("additive", [0.5] * 9 + [-1.0] + [0.5] * 30, "negative additive background -1.0 at LOR 9"),
    ],
)
def test_a_factor_files_values_are_read_by_the_dry_run(tmp_path, role, values, fault):
    """Read as the runs read them: a NaN, a negative value or an all-zero m stops the dry run, not a job."""
    config = _osem_config(tmp_path)
    np.array(values, "<f4").tofile(tmp_path / "data/bad.f32")
    config["matrices"]["mine"]["measurements"]["scan"][role] = "data/bad.f32"
    line = one_line(snakemake(tmp_path, "--dry-run", config=config))
    assert line == f"config matrices.mine.measurements.scan.{role}: data/bad.f32: {fault}"


def test_a_missing_subset_file_stops_the_dry_run(tmp_path):
    config = _osem_config(tmp_path)
    config["mlem"]["subset_file"] = "data/none.i32"
    assert one_line(snakemake(tmp_path, "--dry-run", config=config)) == "config mlem.subset_file: data/none.i32: no such file"


def test_a_subset_files_labels_are_read_by_the_dry_run(tmp_path):
    config = _osem_config(tmp_path)
    config["mlem"]["subset_file"] = "data/s.i32"
    for labels, fault in [
        ([0, 1] * 19 + [2, 0], "subset label 2 at LOR 38, expected 0 .. 1"),
        ([0] * 40, "subset 1 of 2 holds no LOR"),
        ([0, 1] * 10, "20 subset labels, expected one per LOR (40)"),
    ]:
        np.array(labels, "<i4").tofile(tmp_path / "data/s.i32")
        assert one_line(snakemake(tmp_path, "--dry-run", config=config)) == (
            f"config mlem.subset_file (matrix mine): data/s.i32: {fault}")
    np.array([0, 1] * 20, "<i4").tofile(tmp_path / "data/s.i32")
    assert dry_run(tmp_path, config)["run_mlem"] == 1



def test_a_cpu_chunked_run_with_a_background_stops_the_dry_run(tmp_path):
    config = _osem_config(tmp_path)
    config["runs"] = [{"backend": "cpu", "bp": "onepass_chunked"}]
    assert one_line(snakemake(tmp_path, "--dry-run", config=config)) == (
        "config runs[0].bp: onepass_chunked on the cpu takes no additive background (b); use onepass or numba")


def test_a_folded_matrix_takes_factors_its_lors_share(problem, tmp_path):
    """Shared factors: the folded model is the unfolded one (differing ones: tests/test_fold_factors.py)."""
    from mlemlib.fold import fold_file, fold_of

    a, g, m, b = problem
    d = a.to_scipy().tolil()
    for i in range(0, M, 10):  # LOR i + 1 repeats LOR i: folded into one stored row
        d[i + 1] = d[i]
    a2 = CSRMatrix.from_scipy(d.tocsr())
    m2, b2 = m.copy(), b.copy()
    m2[1::10], b2[1::10] = m2[0::10], b2[0::10]
    write_matrix_h5(tmp_path / "a.h5", a2)
    fold_file(tmp_path / "a.h5", tmp_path / "f.h5")
    reorder_file(tmp_path / "f.h5", tmp_path / "r.h5", "none", subsets=2)
    m2.tofile(tmp_path / "m.f32")
    b2.tofile(tmp_path / "b.f32")
    reconstruct(ModelSpec(tmp_path / "r.h5", g, subsets=2, multiplicative=tmp_path / "m.f32",
                          additive=tmp_path / "b.f32"),
                RunSettings(4, checkpoint_every=0, backend="cpu"), tmp_path / "img.h5")
    row_map = fold_of(tmp_path / "r.h5").row_map
    labels = np.where(row_map >= 0, row_map % 2, 0)  # i mod S over the stored rows, taken to their LORs
    expected = dense_osem(a2, g, m2, b2, labels, 2, 4)
    assert metrics.relative_l2(read_image(tmp_path / "img.h5")[0], expected) < 1e-5
