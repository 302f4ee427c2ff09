"""Bad inputs refused before any work, in one line naming the file and the fault (issue 40; CPU only).

A float32 file given as ``.LMsino``, a negative count, an ``--out`` that is a
directory, ``--iterations 0``, an ``.npz`` without a sparse matrix and an
``.mtx`` with an index out of range: each stops ``mlem`` with exit status 2,
one line ``mlem: error: ...``, and nothing written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import yaml

from mlemlib.cli import main
from mlemlib.errors import MatrixFormatError, SinogramFormatError
from mlemlib.formats.lmsino import MAX_PLAUSIBLE_COUNT, looks_like_float32, read_lmsino, write_lmsino
from mlemlib.formats.mtx import read_mtx
from mlemlib.formats.npz import read_npz
from mlemlib.matrix import CSRMatrix
from mlemlib.problem import ModelSpec, RunSettings

ROOT = Path(__file__).resolve().parents[1]
M, N = 30, 8


@pytest.fixture()
def files(tmp_path):
    """A small matrix (.npz), its int32 measurement, and the same counts as float32 bytes."""
    a = sp.random(M, N, density=0.4, random_state=3, format="csr", dtype=np.float32)
    a.data += 0.1
    sp.save_npz(tmp_path / "m.npz", a)
    rng = np.random.default_rng(3)
    g = rng.poisson(a.astype(np.float64) @ np.full(N, 20.0)).astype(np.int32)
    g[:2] = 0
    write_lmsino(tmp_path / "g.LMsino", g)
    g.astype("<f4").tofile(tmp_path / "float.LMsino")
    return tmp_path, g


def run_cli(capsys, *argv) -> tuple[int, list[str]]:
    """``mlem argv``: its exit status and its stderr lines."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's parse-time errors
        rc = exc.code
    return rc, capsys.readouterr().err.strip().splitlines()


def reconstruct_args(d: Path, sino: str = "g.LMsino", out: str = "run/image.h5", iterations: str = "3"):
    return ["reconstruct", "-m", d / "m.npz", "-s", d / sino, "-n", iterations, "-b", "cpu", "-o", f"{d}/{out}"]


def written(d: Path, *keep: str) -> list[str]:
    """Files under d other than the inputs."""
    inputs = {"m.npz", "g.LMsino", "float.LMsino", *keep}
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name not in inputs)


# --------------------------------------------------------------------------- float32 given as .LMsino
def test_float32_lmsino_is_refused_in_one_line_before_any_work(files, capsys):
    d, g = files
    with pytest.raises(SinogramFormatError) as err:
        read_lmsino(d / "float.LMsino", expected_length=M)
    text = str(err.value)
    assert text.startswith(f"{d / 'float.LMsino'}: looks like float32 counts, not int32")
    assert f"from 1 to {g.max()}" in text or f"from {g[g > 0].min()} to {g.max()}" in text
    assert "convert with" in text and "np.rint(np.fromfile(" in text and "\n" not in text
    rc, err_lines = run_cli(capsys, *reconstruct_args(d, sino="float.LMsino"))
    assert rc == 2 and len(err_lines) == 1
    assert err_lines[0].startswith(f"mlem: error: {d / 'float.LMsino'}: looks like float32 counts, not int32")
    assert written(d) == []


def test_the_suggested_conversion_gives_the_int32_counts(files):
    d, g = files
    np.rint(np.fromfile(d / "float.LMsino", "<f4")).astype("<i4").tofile(d / "counts.LMsino")
    np.testing.assert_array_equal(read_lmsino(d / "counts.LMsino", M), g)


def test_float32_lmsino_with_a_negative_value_is_named_as_floats(tmp_path):
    np.array([0, 2.5, -1.5, 7.0], "<f4").tofile(tmp_path / "neg.LMsino")
    with pytest.raises(SinogramFormatError, match=r"neg\.LMsino: looks like float32 values, not int32 counts, and "
                       r"holds a negative value \(-1\.5 at LOR 2\)"):
        read_lmsino(tmp_path / "neg.LMsino")
    np.array([0, 3, -2, 7], "<i4").tofile(tmp_path / "negint.LMsino")
    with pytest.raises(SinogramFormatError, match=r"negint\.LMsino: negative count -2 at LOR 2$"):
        read_lmsino(tmp_path / "negint.LMsino")


@pytest.mark.parametrize(
    "counts",
    [
        [0, 0, 0],  # nothing counted: nothing to tell
        [0, 1, 3000, MAX_PLAUSIBLE_COUNT],  # real counts, up to 2^24
        [5, MAX_PLAUSIBLE_COUNT + 1, 2_000_000_000],  # one small count: not every count is beyond 2^24
        [0, 0x7F800000, 0x3F800000],  # float32 bytes of inf and 1: not all finite
        [0, MAX_PLAUSIBLE_COUNT + 1],  # float32 1.5e-38: not a plausible count
    ],
)
def test_int32_counts_are_not_taken_for_floats(tmp_path, counts):
    c = np.array(counts, np.int32)
    assert looks_like_float32(c) is None
    c.tofile(tmp_path / "g.LMsino")
    np.testing.assert_array_equal(read_lmsino(tmp_path / "g.LMsino"), c)


# --------------------------------------------------------------------------- negative counts of an array measurement
@pytest.mark.parametrize(
    ("bad", "fault"),
    [(-0.5, r"sino: negative count -0\.5 at LOR 4"), (np.nan, r"sino: non-finite count nan at LOR 4"),
     (np.inf, r"sino: non-finite count inf at LOR 4")],
)
def test_array_measurement_with_a_bad_value_is_refused_naming_it(files, bad, fault):
    from mlemlib.mlem import reconstruct

    d, g = files
    sino = g.astype(np.float64)
    sino[4] = bad
    a = CSRMatrix.from_scipy(sp.load_npz(d / "m.npz"))
    with pytest.raises(SinogramFormatError, match=fault):
        reconstruct(ModelSpec(a, sino), RunSettings(2, backend="cpu"), d / "run" / "image.h5")
    assert written(d) == []


def test_float_array_measurement_is_reconstructed(files):
    from mlemlib.mlem import reconstruct

    d, g = files
    a = CSRMatrix.from_scipy(sp.load_npz(d / "m.npz"))
    t = reconstruct(ModelSpec(a, g.astype(np.float32) + 0.25), RunSettings(2, backend="cpu"), d / "run" / "image.h5")
    assert t["repetitions"][-1]["accuracy"]["image_sum"] > 0


# --------------------------------------------------------------------------- --out and --iterations at parse time
def test_out_naming_a_directory_is_refused_at_parse_time(files, capsys):
    d, _ = files
    (d / "run").mkdir()
    for out in ("run", "run/"):
        rc, err = run_cli(capsys, *reconstruct_args(d, out=out))
        assert rc == 2 and len(err) == 1
        assert err[0] == f"mlem: error: argument -o/--out: {d}/{out}: is a directory; expected the name of a file to write"
    (d / "plain").write_text("")
    rc, err = run_cli(capsys, *reconstruct_args(d, out="plain/image.h5"))
    assert rc == 2 and err == [f"mlem: error: argument -o/--out: {d / 'plain/image.h5'}: {d / 'plain'} is not a directory"]
    rc, err = run_cli(capsys, *reconstruct_args(d), "--timings", d / "run")
    assert rc == 2 and err[0].startswith("mlem: error: argument --timings: ") and "is a directory" in err[0]
    assert written(d, "plain") == []


def test_out_in_a_directory_that_cannot_be_written_is_refused(files, capsys, monkeypatch):
    import os

    d, _ = files
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == d else real(p, mode))
    rc, err = run_cli(capsys, *reconstruct_args(d, out="new/deeper/image.h5"))
    assert rc == 2 and err == [f"mlem: error: argument -o/--out: {d / 'new/deeper/image.h5'}: cannot write in {d} "
                               "(permission denied)"]
    assert written(d) == [] and not (d / "new").exists()


def test_out_in_missing_directories_is_written(files, capsys):
    d, _ = files
    rc, _ = run_cli(capsys, *reconstruct_args(d, out="new/deeper/image.h5"))
    assert rc == 0 and (d / "new/deeper/image.h5").is_file()


def test_iterations_minimum_is_the_config_schemas(files, capsys):
    schema = yaml.safe_load((ROOT / "config" / "schema.yaml").read_text())
    minimum = schema["properties"]["mlem"]["properties"]["iterations"]["minimum"]
    assert minimum == 1
    d, _ = files
    rc, err = run_cli(capsys, *reconstruct_args(d, iterations=str(minimum - 1)))
    assert rc == 2 and err == [f"mlem: error: argument -n/--iterations: {minimum - 1}: must be >= {minimum}"]
    assert written(d) == []
    rc, _ = run_cli(capsys, *reconstruct_args(d, iterations=str(minimum)))
    assert rc == 0


# --------------------------------------------------------------------------- .npz and .mtx
def test_npz_without_a_sparse_matrix_one_line(tmp_path, capsys):
    np.savez(tmp_path / "dense.npz", a=np.eye(3))
    np.save(tmp_path / "arr.npy", np.eye(3))
    (tmp_path / "arr.npy").rename(tmp_path / "arr.npz")
    (tmp_path / "text.npz").write_text("1 2 3\n")
    d = sp.coo_matrix(np.eye(3))
    np.savez(tmp_path / "coo.npz", format=np.array("coo"), shape=np.array([3, 3]), row=np.array([0, 1, 7]),
             col=d.col, data=d.data)
    cases = {
        "dense.npz": "not a SciPy sparse .npz file: the archive holds the arrays [a] and no 'format' entry "
                     "(a dense array saved with numpy.savez?); save the matrix with scipy.sparse.save_npz",
        "arr.npz": "not a SciPy sparse .npz file: a NumPy .npy array; save the matrix with scipy.sparse.save_npz",
        "text.npz": "not a SciPy sparse .npz file: not a zip archive; save the matrix with scipy.sparse.save_npz",
        "coo.npz": "invalid SciPy sparse matrix (axis 0 index 7 exceeds matrix dimension 3)",
    }
    for name, fault in cases.items():
        with pytest.raises(MatrixFormatError) as err:
            read_npz(tmp_path / name)
        assert str(err.value) == f"{tmp_path / name}: {fault}"
        out = tmp_path / "out" / "matrix.h5"
        rc, lines = run_cli(capsys, "convert", tmp_path / name, "--out", out)
        assert rc == 2 and lines == [f"mlem: error: {tmp_path / name}: {fault}"]
        assert not out.parent.exists() or list(out.parent.iterdir()) == []


@pytest.mark.parametrize(
    ("element", "fault"),
    [("4 2 1.0", "row index out of bounds on line 4"), ("0 2 1.0", "row index out of bounds on line 4"),
     ("2 9 1.0", "column index out of bounds on line 4")],
)
def test_mtx_index_out_of_range_one_line(tmp_path, capsys, element, fault):
    path = tmp_path / "m.mtx"
    path.write_text(f"%%MatrixMarket matrix coordinate real general\n3 5 2\n1 1 0.5\n{element}\n")
    expected = f"{path}: {fault}: the header declares a 3 x 5 matrix (rows 1..3, columns 1..5)"
    with pytest.raises(MatrixFormatError) as err:
        read_mtx(path)
    assert str(err.value) == expected
    out = tmp_path / "out" / "matrix.h5"
    rc, lines = run_cli(capsys, "convert", path, "--out", out)
    assert rc == 2 and lines == [f"mlem: error: {expected}"]
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


# --------------------------------------------------------------------------- a user's matrix with negative values


def _negative_user_matrix(tmp_path: Path, clip: bool | None) -> dict:
    """A config of a user's 40 x 12 .npz holding three tiny negative values (clip_negative as given)."""
    from test_workflow import user_files

    config = user_files(tmp_path)
    a = sp.random(40, 12, density=0.3, random_state=1, format="csr", dtype=np.float32)
    a.data += np.float32(0.1)
    a.data[[0, 5, 9]] = np.float32([-5.4e-6, -1e-7, -2e-6])
    sp.save_npz(tmp_path / "data" / "neg.npz", a)
    entry = config["matrices"]["mine"]
    entry["path"] = "data/neg.npz"
    if clip is not None:
        entry["clip_negative"] = clip
    return config


def test_workflow_refuses_negative_matrix_values_naming_clip_negative(tmp_path):
    from test_workflow import one_line, snakemake

    line = one_line(snakemake(tmp_path, "--dry-run", config=_negative_user_matrix(tmp_path, None)))
    assert line.startswith("config matrices.mine.path: data/neg.npz: negative value -5.4"), line
    assert "matrices.<name>.clip_negative: true" in line and "--clip-negative" in line


def test_workflow_clip_negative_converts_them_to_zero(tmp_path):
    from test_workflow import snakemake

    from mlemlib.formats import read_matrix

    config = _negative_user_matrix(tmp_path, True)
    config["reorder"] = "none"  # convert_matrix then writes matrix.h5 itself
    proc = snakemake(tmp_path, "--cores", "1", "results/mine/matrix.h5", config=config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rule convert_matrix" in proc.stdout + proc.stderr
    got = read_matrix(tmp_path / "results" / "mine" / "matrix.h5").to_scipy()
    want = sp.load_npz(tmp_path / "data" / "neg.npz").tocsr()
    want.data[want.data < 0] = 0
    np.testing.assert_array_equal(got.indptr, want.indptr)
    np.testing.assert_array_equal(got.data, want.data)  # explicit zeros kept
    log = (tmp_path / "logs" / "matrix" / "mine-convert.log").read_text()
    assert "3 negative value(s) set to 0, the smallest -5.4" in log
