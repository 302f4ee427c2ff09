"""Folded matrices (mlemlib.fold): the map, the content hash, the generator's and convert's folds, and MLEM
through them against the unfolded matrix (CPU; the GPU case is marked ``gpu``)."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from mlemlib import fold as F
from mlemlib.errors import ConfigError, MatrixFormatError
from mlemlib.formats import open_matrix
from mlemlib.formats.h5 import write_matrix_h5
from mlemlib.formats.lmsino import read_lmsino, write_lmsino
from mlemlib.image import read_image
from mlemlib.matrix import CSRMatrix
from mlemlib.mlem import reconstruct
from mlemlib.norm import compute_norm
from mlemlib.phantom import simulate
from mlemlib.problem import ModelSpec, RunSettings
from mlemlib.scanner.system import estimate, generate


def _csr(rows: list[list[tuple[int, float]]], n: int) -> CSRMatrix:
    indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=indptr[1:])
    idx = np.array([c for r in rows for c, _ in r], dtype=np.int32)
    dat = np.array([v for r in rows for _, v in r], dtype=np.float32)
    return CSRMatrix(indptr, idx, dat, (len(rows), n))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# --------------------------------------------------------------------------- the map


def test_fold_unfold_by_hand():
    fold = F.RowFold(np.array([0, -1, 1, 0, 1, 2]), 3, "content").check("<here>")
    assert fold.m_user == 6
    np.testing.assert_array_equal(fold.multiplicity(), [2, 2, 1])
    g = np.array([1, 5, 2, 3, 4, 9], dtype=np.int32)
    folded = fold.fold(g)
    assert folded.dtype == np.int32
    np.testing.assert_array_equal(folded, [4, 6, 9])  # the empty row's 5 counts are dropped
    np.testing.assert_array_equal(fold.fold(g.astype(np.float32)), [4.0, 6.0, 9.0])
    np.testing.assert_array_equal(fold.unfold(np.array([7.0, 8.0, 1.5], np.float32)), [7, 0, 8, 7, 8, 1.5])
    with pytest.raises(ConfigError, match="6"):
        fold.fold(g[:3])  # a measurement of the stored rows, not the user's
    big = np.array([2**31 - 1, 0, 0, 1, 0, 0], dtype=np.int32)
    with pytest.raises(ConfigError, match="range"):
        fold.fold(big)


@pytest.mark.parametrize(
    ("row_map", "m_stored", "fault"),
    [
        ([0, 3, 1], 2, "outside"),
        ([0, -2, 1], 2, "outside"),
        ([0, 0, -1], 2, "stored row 1"),
    ],
)
def test_bad_maps_are_refused(row_map, m_stored, fault):
    with pytest.raises(MatrixFormatError, match=f"m.h5.*{fault}"):
        F.RowFold(np.array(row_map), m_stored, "content").check("m.h5")


def test_pair_fold_by_hand():
    # 3 crystals: rows i*3+j; LOR (0, 2) misses the grid
    counts = np.array([0, 4, 0, 4, 0, 7, 0, 7, 0])
    fold, stored = F.pair_fold(3, counts)
    np.testing.assert_array_equal(stored, [1, 5])  # (0,1) and (1,2)
    np.testing.assert_array_equal(fold.row_map, [-1, 0, -1, 0, -1, 1, -1, 1, -1])
    assert fold.method == "pairs"


def test_content_hash_tells_rows_apart():
    rows = [
        [(0, 1.0), (2, 0.5)],
        [],
        [(0, 1.0), (2, 0.5)],
        [(0, 1.0), (2, np.nextafter(np.float32(0.5), np.float32(1)))],  # one value bit
        [(0, 1.0), (3, 0.5)],  # one column
        [(0, 1.0)],  # a prefix
        [(0, 1.0), (2, 0.5)],
    ]
    a = _csr(rows, 4)
    fold = F.find_duplicates(a)
    np.testing.assert_array_equal(fold.row_map, [0, -1, 0, 1, 2, 3, 0])
    assert fold.m_stored == 4
    h = F.row_hashes(a)
    assert len({tuple(x) for x in h[[0, 3, 4, 5]].tolist()}) == 4


# --------------------------------------------------------------------------- files


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The small preset unfolded, traced folded, and content-folded (CSR and compressed)."""
    d = tmp_path_factory.mktemp("fold")
    generate("small", d / "a.h5")
    gen = generate("small", d / "p.h5", fold=True)
    conv = F.fold_file(d / "a.h5", d / "c.h5")
    F.fold_file(d / "a.h5", d / "cz.h5", fmt="compressed")
    simulate(d / "a.h5", "nema", d / "g.lmsino", d / "t.h5", seed=3)
    return d, gen, conv


def test_generated_fold_stores_each_lor_once(small):
    d, gen, _ = small
    with open_matrix(d / "a.h5") as s:
        a = s.to_csr()
    with open_matrix(d / "p.h5") as s:
        p = s.to_csr()
    fold = F.fold_of(d / "p.h5")
    assert fold is not None and fold.method == "pairs" and fold.m_user == a.shape[0]
    assert gen["stored_rows"] == p.shape[0] == fold.m_stored
    assert gen["unfolded_nnz"] == a.nnz == 2 * p.nnz
    # every user row equals its stored row; the unmapped ones are empty
    sa, sp = a.to_scipy(), p.to_scipy()
    users = np.flatnonzero(fold.row_map >= 0)
    assert (sa[users] != sp[fold.row_map[users]]).nnz == 0
    assert sa[np.flatnonzero(fold.row_map < 0)].nnz == 0
    assert F.fold_of(d / "a.h5") is None


def test_content_fold_is_exact_and_at_most_the_pairs(small):
    d, _, conv = small
    with open_matrix(d / "a.h5") as s:
        sa = s.to_csr().to_scipy()
    for name in ("c.h5", "cz.h5"):
        fold = F.fold_of(d / name)
        with open_matrix(d / name) as s:
            sc = s.to_csr().to_scipy()
        users = np.flatnonzero(fold.row_map >= 0)
        assert (sa[users] != sc[fold.row_map[users]]).nnz == 0
        assert sa[np.flatnonzero(fold.row_map < 0)].nnz == 0
        # first occurrences, in order
        first = F.first_rows(fold)
        assert (sa[np.flatnonzero(first)] != sc).nnz == 0
    assert conv["user_rows"] == sa.shape[0]
    assert conv["shape"][0] <= F.fold_of(d / "p.h5").m_stored  # rows equal by content fold further


def test_norm_and_simulation_are_the_unfolded_ones(small, tmp_path):
    d, _, _ = small
    na = compute_norm(d / "a.h5", tmp_path / "na.h5")
    for name in ("p.h5", "c.h5", "cz.h5"):
        np.testing.assert_allclose(compute_norm(d / name, tmp_path / f"n{name}"), na, rtol=1e-13, atol=0)
    simulate(d / "p.h5", "nema", tmp_path / "gp.lmsino", tmp_path / "tp.h5", seed=3)
    np.testing.assert_array_equal(read_lmsino(tmp_path / "gp.lmsino"), read_lmsino(d / "g.lmsino"))


def test_mlem_through_a_folded_matrix_is_the_unfolded_image(small, tmp_path):
    d, _, _ = small
    images = {}
    for name in ("a.h5", "p.h5", "c.h5", "cz.h5"):
        out = tmp_path / f"i{name}"
        reconstruct(ModelSpec(d / name, d / "g.lmsino"), RunSettings(50, backend="cpu"), out,
                    timings_out=tmp_path / f"t{name}.json")
        images[name] = read_image(out)[0]
    for name in ("p.h5", "c.h5", "cz.h5"):
        assert _rel(images[name], images["a.h5"]) < 1e-6, name
    import json

    t = json.loads((tmp_path / "tp.h5.json").read_text())
    assert t["fold"] == {"user_rows": 36864, "method": "pairs"}
    assert json.loads((tmp_path / "ta.h5.json").read_text())["fold"] is None


def test_reordered_folded_matrix(small, tmp_path):
    from mlemlib.reorder import reorder_file

    d, _, _ = small
    reorder_file(d / "p.h5", tmp_path / "r.h5", "rows+voxels")
    fold = F.fold_of(tmp_path / "r.h5")
    assert fold is not None and fold.checksum == F.fold_of(d / "p.h5").checksum
    reconstruct(ModelSpec(d / "a.h5", d / "g.lmsino"), RunSettings(50, backend="cpu"), tmp_path / "ia.h5")
    reconstruct(ModelSpec(tmp_path / "r.h5", d / "g.lmsino"), RunSettings(50, backend="cpu"), tmp_path / "ir.h5")
    assert _rel(read_image(tmp_path / "ir.h5")[0], read_image(tmp_path / "ia.h5")[0]) < 1e-6
    np.testing.assert_allclose(compute_norm(tmp_path / "r.h5", tmp_path / "nr.h5").sum(),
                               compute_norm(d / "a.h5", tmp_path / "na.h5").sum(), rtol=1e-12)


def test_measurement_of_the_stored_rows_is_refused(small, tmp_path):
    d, _, _ = small
    stored = F.fold_of(d / "p.h5").m_stored
    write_lmsino(tmp_path / "short.lmsino", np.ones(stored, dtype=np.int32))
    with pytest.raises(Exception, match="36864"):
        reconstruct(ModelSpec(d / "p.h5", tmp_path / "short.lmsino"), RunSettings(1, backend="cpu"),
                    tmp_path / "x.h5")
    assert not (tmp_path / "x.h5").exists()


def _spans(fold, labels) -> np.ndarray:
    """Stored rows whose LORs carry more than one of ``labels`` (the user's LOR order)."""
    rm = fold.row_map
    users = np.flatnonzero(rm >= 0)
    lo = np.full(fold.m_stored, np.iinfo(np.int64).max)
    hi = np.full(fold.m_stored, -1)
    np.minimum.at(lo, rm[users], labels[users])
    np.maximum.at(hi, rm[users], labels[users])
    return np.flatnonzero(lo != hi)


def test_angle_subsets_of_a_folded_matrix(small, tmp_path):
    """LOR (i, j) and (j, i) share their angle, so a pairs fold never splits a stored row between subsets; a
    content fold also merges mirror-image LORs (equal rows of A at other angles): such a row takes its first LOR's
    subset. A subset file that gives one stored row two labels is refused in one line."""
    from mlemlib.subsets import angle_labels, labels_for, scanner_of

    d, _, _ = small
    with open_matrix(d / "a.h5") as s:
        lor_labels = angle_labels(scanner_of(s), 4)
    pairs, content = F.fold_of(d / "p.h5"), F.fold_of(d / "c.h5")
    assert _spans(pairs, lor_labels).size == 0
    mixed = _spans(content, lor_labels)
    assert mixed.size > 0
    with open_matrix(d / "c.h5") as s:
        labels, method = labels_for(s, 4)
    assert method == "angle"
    first = F.first_rows(content)
    np.testing.assert_array_equal(labels[content.row_map[first]], lor_labels[first])
    with open_matrix(d / "p.h5") as s:
        labels, _ = labels_for(s, 4)
    np.testing.assert_array_equal(labels[pairs.row_map[pairs.row_map >= 0]], lor_labels[pairs.row_map >= 0])
    lor_labels.astype("<i4").tofile(tmp_path / "s.i32")
    with open_matrix(d / "c.h5") as s, pytest.raises(ConfigError, match=r"^\S*s\.i32: LOR \d+ has subset label .*"
                                                                        r"a stored row takes one subset label"):
        labels_for(s, 4, subset_file=tmp_path / "s.i32")


def _copy(src, dst):
    dst.write_bytes(src.read_bytes())
    return dst


def test_corrupt_fold_is_refused(small, tmp_path):
    d, _, _ = small
    bad = _copy(d / "p.h5", tmp_path / "bad.h5")
    with h5py.File(bad, "a") as f:
        f[F.DATASET][5] = 0 if f[F.DATASET][5] != 0 else 1
    with pytest.raises(MatrixFormatError, match="bad.h5.*checksum mismatch"):
        F.fold_of(bad)
    gone = _copy(d / "p.h5", tmp_path / "gone.h5")
    with h5py.File(gone, "a") as f:
        del f[F.DATASET]
    with pytest.raises(MatrixFormatError, match="gone.h5.*no dataset"):
        reconstruct(ModelSpec(gone, d / "g.lmsino"), RunSettings(1, backend="cpu"), tmp_path / "x.h5")
    short = _copy(d / "p.h5", tmp_path / "short.h5")
    with h5py.File(short, "a") as f:
        rm = f[F.DATASET][()]
        del f[F.DATASET]
        f.create_dataset(F.DATASET, data=rm[:-1])
    with pytest.raises(MatrixFormatError, match="short.h5.*shape"):
        F.fold_of(short)


def test_folding_twice_or_after_reordering_is_refused(small, tmp_path):
    from mlemlib.reorder import reorder_file

    d, _, _ = small
    with pytest.raises(MatrixFormatError, match="p.h5.*folded already"):
        F.fold_file(d / "p.h5", tmp_path / "pp.h5")
    reorder_file(d / "a.h5", tmp_path / "r.h5", "rows")
    with pytest.raises(MatrixFormatError, match="r.h5.*reordered"):
        F.fold_file(tmp_path / "r.h5", tmp_path / "rf.h5")
    assert not (tmp_path / "pp.h5").exists() and not (tmp_path / "rf.h5").exists()


def test_fold_needs_the_container(tmp_path):
    with pytest.raises(ConfigError, match="csr4"):
        generate("small", tmp_path / "a.csr4", fold=True)
    assert not (tmp_path / "a.csr4").exists()


def test_fold_of_a_csr4_and_the_cli(small, tmp_path, capsys):
    from mlemlib.cli import main

    d, _, _ = small
    generate("small", tmp_path / "a.csr4")
    assert main(["fold", str(tmp_path / "a.csr4"), "-o", str(tmp_path / "f.h5")]) == 0
    assert '"user_rows": 36864' in capsys.readouterr().out
    with open_matrix(tmp_path / "f.h5") as s, open_matrix(d / "c.h5") as c:
        assert s.checksum == c.checksum  # the same rows as the container's fold
    assert F.fold_of(tmp_path / "f.h5").checksum == F.fold_of(d / "c.h5").checksum


def test_info_describes_the_fold_and_checks_the_measurement_against_the_users_rows(small, capsys):
    from mlemlib.cli import main

    d, _, _ = small
    assert main(["info", str(d / "p.h5")]) == 0
    out = capsys.readouterr().out
    assert "folded       5,248 stored rows hold the 36,864 LORs" in out and "row fold" in out
    assert main(["info", str(d / "g.lmsino"), "--matrix", str(d / "p.h5")]) == 0
    assert "matches the matrix" in capsys.readouterr().out


def test_hand_matrix_round_trip(tmp_path):
    rows = [[(0, 1.0), (1, 2.0)], [(2, 1.0)], [], [(0, 1.0), (1, 2.0)], [(2, 1.0)], [(1, 3.0)]]
    a = _csr(rows, 3)
    write_matrix_h5(tmp_path / "a.h5", a)
    s = F.fold_file(tmp_path / "a.h5", tmp_path / "f.h5")
    assert s["shape"] == [3, 3] and s["nnz"] == 4 and s["user_rows"] == 6
    g = np.array([1, 2, 3, 4, 5, 6], dtype=np.int32)
    reconstruct(ModelSpec(tmp_path / "a.h5", g), RunSettings(20, backend="cpu"), tmp_path / "ia.h5")
    reconstruct(ModelSpec(tmp_path / "f.h5", g), RunSettings(20, backend="cpu"), tmp_path / "if.h5")
    assert _rel(read_image(tmp_path / "if.h5")[0], read_image(tmp_path / "ia.h5")[0]) < 1e-6


def test_estimate_and_sizes_halve():
    from mlemlib.cluster import preset_size

    full = estimate("small", sample=2000)
    half = estimate("small", sample=2000, fold=True)
    assert half["nnz_estimate"] == pytest.approx(full["nnz_estimate"] / 2)
    assert half["stored_rows_estimate"] < full["shape"][0] / 2
    assert preset_size("matrix3", fold=True).nnz * 2 >= preset_size("matrix3").nnz
    assert preset_size("matrix3", fold=True).rows == preset_size("matrix3").rows // 2


@pytest.mark.gpu
def test_cuda_mlem_through_a_folded_matrix(small, tmp_path):
    d, _, _ = small
    reconstruct(ModelSpec(d / "a.h5", d / "g.lmsino"), RunSettings(50, backend="cpu"), tmp_path / "ia.h5")
    ref = read_image(tmp_path / "ia.h5")[0]
    for name, bp in (("p.h5", "notrans"), ("cz.h5", "auto"), ("p.h5", "onepass")):
        out = tmp_path / f"i{name}{bp}.h5"
        reconstruct(ModelSpec(d / name, d / "g.lmsino"), RunSettings(50, backend="cuda", bp=bp), out)
        assert _rel(read_image(out)[0], ref) < 1e-5, (name, bp)


@pytest.mark.slow
@pytest.mark.parametrize("csr4", [False, True])
def test_workflow_with_fold(tmp_path, csr4):
    """``fold: true``: traced folded (csr4: false) or folded by the conversion (csr4: true), reordered,
    partitioned, simulated in the user's LOR order, and reconstructed to the unfolded image."""
    from conftest import run_workflow

    config = {
        "use_gpu": False,
        "reorder": "rows+voxels",
        "matrices": {"small": {"preset": "small", "fold": True, "csr4": csr4}},
        "transpose": {"method": "scantrans", "compare": []},
        "partition": {"parts": [2]},
        "mlem": {"iterations": 20, "checkpoint_every": 0, "repetitions": 1, "reference": True},
        "runs": [{"backend": "cpu"}],
        "bench": {"spmv": False},
    }
    run_workflow(tmp_path, config, "--cores", "2")
    res = tmp_path / "results/small"
    fold = F.fold_of(res / "matrix.h5")
    assert fold is not None and fold.m_user == 36864
    assert fold.method == ("content" if csr4 else "pairs")
    sinos = sorted(tmp_path.glob("results/small/data/*.LMsino"))
    assert sinos and all(read_lmsino(s).size == 36864 for s in sinos)
    images = [p for p in res.glob("**/image.h5") if "reference" not in str(p)]
    assert images
    unfolded = tmp_path / "a.h5"
    generate("small", unfolded)
    reconstruct(ModelSpec(unfolded, sinos[0]), RunSettings(20, backend="cpu"), tmp_path / "ia.h5")
    ref = read_image(tmp_path / "ia.h5")[0]
    for img in images:
        assert _rel(read_image(img)[0], ref) < 1e-6, img
