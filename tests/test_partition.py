"""Tests of mlemlib.partition: the split rule, imbalance, A_k^T files, plan.json and its validation."""

from __future__ import annotations

import json
import os
import shutil
from fractions import Fraction

import h5py
import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib.cli import main
from mlemlib.errors import ConfigError, MatrixFormatError
from mlemlib.formats.h5 import MatrixH5, write_matrix_h5
from mlemlib.matrix import CSRMatrix
from mlemlib.partition import (
    balanced_bounds,
    imbalance,
    make_plan,
    part_nnz,
    partition_file,
    read_plan,
    split_transpose,
)
from mlemlib.transpose import transpose_file


def random_matrix(rng, m: int, n: int, density: float) -> CSRMatrix:
    a = sp.random(m, n, density=density, format="csr", dtype=np.float32, random_state=rng)
    a.data = rng.uniform(0.1, 2.0, a.nnz).astype(np.float32)
    a.sort_indices()
    return CSRMatrix.from_scipy(a)


def to_scipy(a: CSRMatrix):
    return sp.csr_matrix((a.data, a.indices, a.indptr), shape=a.shape)


def assert_identical(t: CSRMatrix, ref) -> None:
    assert t.shape == ref.shape
    np.testing.assert_array_equal(t.indptr, ref.indptr)
    np.testing.assert_array_equal(t.indices, ref.indices)
    np.testing.assert_array_equal(t.data, ref.data)


# --------------------------------------------------------------------------- the split rule

# rows with 3, 1, 4, 1, 5, 9, 2, 6 non-zeros: nnz 31; P = 3 -> targets 31/3 = 10.33 and 62/3 = 20.67
HAND_INDPTR = np.array([0, 3, 4, 8, 9, 14, 23, 25, 31])


def test_hand_computed_bounds_and_imbalance():
    b = balanced_bounds(HAND_INDPTR, 3)
    # first row whose cumulative count reaches 10.33 is row 5 (indptr 14); reaching 20.67: row 6 (23)
    np.testing.assert_array_equal(b, [0, 5, 6, 8])
    np.testing.assert_array_equal(part_nnz(HAND_INDPTR, b), [14, 9, 8])
    assert imbalance([14, 9, 8]) == pytest.approx(14 / (31 / 3))  # = 42/31
    assert imbalance([14, 9, 8]) == pytest.approx(float(Fraction(42, 31)), rel=1e-15)


def test_target_hit_exactly_starts_the_part_there():
    # nnz 12, P = 4: targets 3, 6, 9 are row pointer values, so those rows start the parts
    indptr = np.array([0, 3, 6, 9, 12])
    np.testing.assert_array_equal(balanced_bounds(indptr, 4), [0, 1, 2, 3, 4])
    assert imbalance(part_nnz(indptr, balanced_bounds(indptr, 4))) == 1.0


@pytest.mark.parametrize("parts", [1, 2, 3, 5, 8, 13])
def test_bounds_cover_rows_once_and_follow_the_rule(rng, parts):
    for _ in range(20):
        m = int(rng.integers(1, 60))
        counts = rng.integers(0, 10, m) * (rng.random(m) < 0.7)  # many empty rows
        indptr = np.concatenate([[0], np.cumsum(counts)])
        nnz = int(indptr[-1])
        b = balanced_bounds(indptr, parts)
        assert len(b) == parts + 1 and b[0] == 0 and b[-1] == m
        assert np.all(np.diff(b) >= 0)  # contiguous, ordered: every row in exactly one part
        owner = np.repeat(np.arange(parts), np.diff(b))
        assert len(owner) == m
        assert part_nnz(indptr, b).sum() == nnz
        for s in range(1, parts):  # the rule, in exact rational arithmetic
            r = int(b[s])
            target = Fraction(s * nnz, parts)
            assert indptr[r] >= target  # reaches the target ...
            if r > 0:
                assert indptr[r - 1] < target  # ... and is the first row that does


def test_more_parts_than_nonempty_rows():
    indptr = np.array([0, 0, 5, 5, 5, 7, 7, 8, 8])  # 3 non-empty rows (1, 4, 6) of 8
    b = balanced_bounds(indptr, 5)
    nnz = part_nnz(indptr, b)
    assert nnz.sum() == 8 and len(nnz) == 5
    assert (nnz == 0).sum() >= 2
    assert b[0] == 0 and b[-1] == 8 and np.all(np.diff(b) >= 0)
    # every non-empty row lies in a part of its own
    assert sorted(nnz[nnz > 0].tolist()) == [1, 2, 5]


def test_more_parts_than_rows_and_no_nonzeros():
    b = balanced_bounds(np.array([0, 2, 3]), 6)
    assert b[0] == 0 and b[-1] == 2 and np.all(np.diff(b) >= 0)
    assert part_nnz(np.array([0, 2, 3]), b).sum() == 3
    z = balanced_bounds(np.zeros(4, dtype=np.int64), 3)
    np.testing.assert_array_equal(z, [0, 0, 0, 3])
    assert imbalance([0, 0, 0]) == 1.0


@pytest.mark.parametrize("parts", [0, -1, 2.5, True])
def test_bad_parts(parts):
    with pytest.raises(ConfigError, match="parts"):
        balanced_bounds(HAND_INDPTR, parts)


def test_make_plan_offsets_are_references():
    t_indptr = np.array([0, 10, 20, 31])
    plan = make_plan(HAND_INDPTR, t_indptr, 3, (8, 3))
    assert plan["rows"] == [[0, 5], [5, 6], [6, 8]]
    assert plan["nnz_per_part"] == [14, 9, 8]
    assert plan["nnz_offsets"] == [0, 14, 23]  # indptr[r0]
    assert plan["transpose_rows"] == [[0, 2], [2, 3], [3, 3]]  # targets 10.33, 20.67 in [0, 10, 20, 31]
    assert plan["transpose_nnz_per_part"] == [20, 11, 0]
    assert plan["imbalance"] == pytest.approx(42 / 31)


# --------------------------------------------------------------------------- splitting A^T


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_split_transpose_equals_scipy_block_transposes(rng, parts):
    a = random_matrix(rng, 500, 80, 0.05)
    at = to_scipy(a).T.tocsr()
    bounds = balanced_bounds(a.indptr, parts)
    pieces = split_transpose(CSRMatrix.from_scipy(at), bounds)
    for k, piece in enumerate(pieces):
        r0, r1 = bounds[k], bounds[k + 1]
        assert_identical(piece, to_scipy(a)[r0:r1].T.tocsr())


def test_split_transpose_rejects_unsorted_rows():
    at = CSRMatrix(np.array([0, 2, 4]), np.array([0, 3, 5, 1]), np.ones(4), (2, 6))
    with pytest.raises(MatrixFormatError, match="row 11 of the transpose has unsorted column indices"):
        split_transpose(at, np.array([0, 3, 6]), row0=10)


# --------------------------------------------------------------------------- the stage


def pet_like_matrix(n_det: int = 20, grid: int = 10) -> CSRMatrix:
    """Detector-ring LORs through a disc of voxels: empty rows (near chords) and empty columns (corners)."""
    ang = 2 * np.pi * np.arange(n_det) / n_det
    det = np.stack([np.cos(ang), np.sin(ang)], axis=1)
    t = (np.arange(500) + 0.5) / 500
    indptr, indices, data = [0], [], []
    for i in range(n_det):
        for j in range(i + 1, n_det):
            pts = det[i] + t[:, None] * (det[j] - det[i])
            pts = pts[np.hypot(pts[:, 0], pts[:, 1]) < 0.55]
            ij = np.floor((pts + 0.6) / 1.2 * grid).astype(np.int64).clip(0, grid - 1)
            vox, counts = np.unique(ij[:, 1] * grid + ij[:, 0], return_counts=True)
            indices.extend(vox.tolist())
            data.extend((counts / 500).tolist())
            indptr.append(len(indices))
    return CSRMatrix(np.array(indptr), np.array(indices), np.array(data), (len(indptr) - 1, grid * grid))


@pytest.fixture
def files(tmp_path):
    a = pet_like_matrix()
    m = tmp_path / "matrix.h5"
    write_matrix_h5(m, a)
    t = tmp_path / "transpose.h5"
    transpose_file(m, t)
    return m, t, a


@pytest.mark.parametrize("parts,chunk_nnz", [(1, 1 << 26), (3, 50), (4, 1), (8, 333)])
def test_partition_file(files, tmp_path, parts, chunk_nnz):
    mpath, tpath, a = files
    out = tmp_path / f"parts-{parts}"
    plan = partition_file(mpath, tpath, parts, out, chunk_nnz=chunk_nnz, local_transpose=True)
    m, n = a.shape
    assert plan["parts"] == parts and plan["shape"] == [m, n] and plan["nnz"] == a.nnz
    # row blocks: contiguous, covering, referenced (offsets into matrix.h5), balanced by the rule
    b = balanced_bounds(a.indptr, parts)
    assert plan["rows"] == [[int(b[k]), int(b[k + 1])] for k in range(parts)]
    assert plan["nnz_offsets"] == [int(a.indptr[r0]) for r0, _ in plan["rows"]]
    assert plan["nnz_per_part"] == [int(a.indptr[r1] - a.indptr[r0]) for r0, r1 in plan["rows"]]
    assert plan["imbalance"] == pytest.approx(max(plan["nnz_per_part"]) / (a.nnz / parts))
    # local layout: part-k.h5 is the transpose of row block k, column indices local to the block
    total = 0
    for k, (r0, r1) in enumerate(plan["rows"]):
        with MatrixH5(plan["local_transpose"][k]) as f:
            assert f.shape == (n, r1 - r0)
            assert f.attrs["kind"] == "local_transpose" and f.attrs["part"] == k
            assert f.attrs["rows"] == [r0, r1]
            assert_identical(f.to_csr(), to_scipy(a)[r0:r1].T.tocsr())
            total += f.nnz
    assert total == a.nnz  # one copy of A^T on disk in all
    # thesis layout: contiguous row blocks of transpose.h5 that cover A^T
    with MatrixH5(tpath) as t:
        t_indptr = t.read_indptr()
        at = t.to_csr()
    rows_t = plan["transpose_rows"]
    assert rows_t[0][0] == 0 and rows_t[-1][1] == n
    assert all(rows_t[k][1] == rows_t[k + 1][0] for k in range(parts - 1))
    assert plan["transpose_nnz_offsets"] == [int(t_indptr[c0]) for c0, _ in rows_t]
    blocks = [to_scipy(at)[c0:c1] for c0, c1 in rows_t]
    assert_identical(CSRMatrix.from_scipy(sp.vstack(blocks, format="csr")), to_scipy(a).T.tocsr())
    assert sorted(p.name for p in out.iterdir()) == sorted(["plan.json"] + [f"part-{k}.h5" for k in range(parts)])


def test_plan_paths_are_relative_and_relocatable(files, tmp_path):
    mpath, tpath, _ = files
    out = tmp_path / "parts-2"
    partition_file(mpath, tpath, 2, out, local_transpose=True)
    raw = json.loads((out / "plan.json").read_text())
    assert raw["matrix"] == "../matrix.h5" and raw["transpose"] == "../transpose.h5"
    assert raw["local_transpose"] == ["part-0.h5", "part-1.h5"]
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for name in ("matrix.h5", "transpose.h5", "parts-2"):
        shutil.move(tmp_path / name, moved / name)
    plan = read_plan(moved / "parts-2")
    assert plan["matrix"] == os.fspath(moved / "matrix.h5")
    assert plan["local_transpose"][1] == os.fspath(moved / "parts-2" / "part-1.h5")
    assert plan["plan"] == os.fspath(moved / "parts-2" / "plan.json")


def test_more_parts_than_nonempty_rows_in_files(tmp_path):
    a = CSRMatrix(np.array([0, 0, 2, 2, 3, 3]), np.array([1, 2, 0]), np.array([1.0, 2.0, 3.0]), (5, 3))
    write_matrix_h5(tmp_path / "m.h5", a)
    transpose_file(tmp_path / "m.h5", tmp_path / "t.h5")
    plan = partition_file(tmp_path / "m.h5", tmp_path / "t.h5", 4, tmp_path / "p", local_transpose=True)
    assert sum(plan["nnz_per_part"]) == 3 and plan["nnz_per_part"].count(0) >= 2
    for k, (r0, r1) in enumerate(plan["rows"]):
        with MatrixH5(plan["local_transpose"][k]) as f:
            assert_identical(f.to_csr(), to_scipy(a)[r0:r1].T.tocsr())


def test_partition_replaces_old_directory_only_when_complete(files, tmp_path):
    mpath, tpath, _ = files
    out = tmp_path / "parts"
    partition_file(mpath, tpath, 2, out, local_transpose=True)
    before = (out / "plan.json").read_text()
    with h5py.File(tpath, "r+") as f:  # unsort one row of the transpose
        lo, hi = f["indptr"][3], f["indptr"][4]
        assert hi - lo >= 2
        f["indices"][lo : lo + 2] = f["indices"][lo : lo + 2][::-1]
    with pytest.raises(MatrixFormatError, match="row 3 of the transpose has unsorted column indices"):
        partition_file(mpath, tpath, 3, out, local_transpose=True)
    assert (out / "plan.json").read_text() == before  # the old plan stands, nothing half-written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["matrix.h5", "parts", "transpose.h5"]


def test_partition_rejects_a_foreign_transpose(files, tmp_path):
    mpath, _, a = files
    other = CSRMatrix(a.indptr, a.indices, a.data * 2, a.shape)  # same shape and nnz, other values
    write_matrix_h5(tmp_path / "other.h5", other)
    transpose_file(tmp_path / "other.h5", tmp_path / "other_t.h5")
    with pytest.raises(MatrixFormatError, match="is the transpose of a matrix with checksum"):
        partition_file(mpath, tmp_path / "other_t.h5", 2, tmp_path / "p")
    with pytest.raises(MatrixFormatError, match="is not the transpose of"):
        partition_file(mpath, mpath, 2, tmp_path / "p")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("fmt", ["csr", "compressed"])
def test_partition_references_the_matrix_and_copies_nothing(files, tmp_path, fmt):
    """Without local_transpose the stage writes plan.json only: row ranges of matrix.h5 (MSREP's pCSR)."""
    mpath, tpath, a = files
    if fmt != "csr":
        from mlemlib.formats import convert

        convert(mpath, tmp_path / "c.h5", fmt=fmt)
        mpath = tmp_path / "c.h5"
    out = tmp_path / "parts-3"
    plan = partition_file(mpath, None, 3, out)
    assert [p.name for p in out.iterdir()] == ["plan.json"]
    assert plan["disk_bytes"] == (out / "plan.json").stat().st_size
    assert "local_transpose" not in plan and "transpose_rows" not in plan and "transpose" not in plan
    assert plan["matrix_format"] == fmt and "nothing is copied" in plan["reference"]
    with MatrixH5(mpath) as f:
        for k, (r0, r1) in enumerate(plan["rows"]):
            block = f.read_rows(r0, r1)  # what a GPU loads: its range of the one matrix file
            assert block.nnz == plan["nnz_per_part"][k] and plan["nnz_offsets"][k] == int(a.indptr[r0])
            assert_identical(block, CSRMatrix.from_scipy(to_scipy(a)[r0:r1]))
            if fmt != "csr":
                sp = f.read_slotptr()
                assert plan["slot_offsets"][k] == int(sp[r0])
                assert plan["slots_per_part"][k] == int(sp[r1] - sp[r0])
    # with the transpose: the thesis layout's row blocks of A^T, still no copy
    plan_t = partition_file(mpath, tpath, 3, tmp_path / "t3")
    assert [p.name for p in (tmp_path / "t3").iterdir()] == ["plan.json"]
    assert plan_t["transpose_rows"][-1][1] == a.shape[1] and plan_t["rows"] == plan["rows"]
    # the NCCL backend's plan reader takes it: row ranges, no part files (it transposes on the GPU if asked)
    from mlemlib.backends.nccl import build_plan

    with MatrixH5(mpath) as f:
        got = build_plan(f, None, 3, out, "local")
    assert got["rows"] == plan["rows"] and got.get("local_transpose") is None


def test_local_transpose_needs_the_transpose(files, tmp_path):
    mpath, _, _ = files
    with pytest.raises(ConfigError, match="needs the transpose"):
        partition_file(mpath, None, 2, tmp_path / "p", local_transpose=True)
    assert not (tmp_path / "p").exists()


def test_partition_cli_without_transpose(files, tmp_path, capsys):
    mpath, tpath, _ = files
    assert main(["partition", str(mpath), "-p", "2", "-o", str(tmp_path / "p2")]) == 0
    assert "imbalance" in capsys.readouterr().out and (tmp_path / "p2" / "plan.json").is_file()
    assert main(["partition", str(mpath), "-T", str(tpath), "-p", "2", "-L", "-o", str(tmp_path / "q")]) == 0
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == ["part-0.h5", "part-1.h5", "plan.json"]


# --------------------------------------------------------------------------- read_plan validation


def test_read_plan_faults(files, tmp_path):
    mpath, tpath, _ = files
    out = tmp_path / "p"
    partition_file(mpath, tpath, 3, out, local_transpose=True)
    good = json.loads((out / "plan.json").read_text())

    def broken(drop=None, **change):
        plan = dict(good, **change)
        plan.pop(drop, None)
        (out / "plan.json").write_text(json.dumps(plan))
        with pytest.raises(MatrixFormatError) as exc:
            read_plan(out)
        assert str(exc.value).startswith(f"{out / 'plan.json'}: ")
        return str(exc.value)

    r = good["rows"]
    assert "must be contiguous" in broken(rows=[r[0], [r[1][0] + 1, r[1][1]], r[2]])
    assert "'rows' ends at" in broken(rows=[r[0], r[1], [r[2][0], r[2][1] - 1]])
    assert "disagree" in broken(nnz_per_part=[good["nnz_per_part"][0] + 1] + good["nnz_per_part"][1:])
    assert "missing field 'imbalance'" in broken(drop="imbalance")
    assert "'imbalance' is 0.5" in broken(imbalance=0.5)
    assert "not a partition plan" in broken(format="other")
    assert "'parts' is 0" in broken(parts=0)
    os.remove(out / "part-2.h5")
    (out / "plan.json").write_text(json.dumps(good))
    with pytest.raises(MatrixFormatError, match="part-2.h5 is missing"):
        read_plan(out)
    (out / "plan.json").write_text("{not json")
    with pytest.raises(MatrixFormatError, match="not a readable JSON plan"):
        read_plan(out / "plan.json")
    with pytest.raises(MatrixFormatError, match="no such plan file"):
        read_plan(tmp_path / "nowhere")


def test_cli_partition(files, tmp_path, capsys):
    mpath, tpath, _ = files
    out = tmp_path / "parts-2"
    assert main(["partition", str(mpath), "--transpose", str(tpath), "--parts", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 part(s), imbalance" in text and "part 1: rows" in text
    assert read_plan(out)["parts"] == 2
    assert main(["partition", str(tpath), "-T", str(tpath), "-p", "2", "-o", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith(f"mlem: error: {tpath}: shape")
