"""Every stage keeps the matrix's format: convert, fold, reorder and partition of a CSR or compressed container
(``compressed``, ``compressed-f16``, ``compressed-u16``) write a container of the same format (CPU).

What is compared, per format:

- ``csr`` and ``compressed`` (lossless): the output is the matrix the stage must give, computed here with SciPy
  from the original matrix, bit for bit; a compressed output also has exactly the encoding of that matrix
  (:meth:`CompressedMatrix.from_csr` with the output's code width: codes, values, row pointer).
- ``compressed-f16`` and ``compressed-u16`` (lossy 16-bit values with a row scale): a stage moves stored values,
  it never rounds them again. The output decodes to exactly the SciPy result on the *decoded* input, and its
  value slots and row scales are the input's. For convert, fold and reorder, rows keep their sets of values, so
  the output also has exactly the encoding of the stage's result on the original float32 matrix (encoding
  commutes with moving rows and renaming columns). The fixture holds a row whose float16 encoding changes when
  its decoded values are encoded again (its largest value rounds up to the next power of two, so the row
  scale doubles and the smallest values lose bits): a stage that decoded and re-encoded would fail these tests.
  A part's ``A_k^T`` keeps the row scales of ``A^T`` (not those a fresh encoding of the part would choose).
"""

from __future__ import annotations

import shlex

import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib.compressed import CompressedMatrix
from mlemlib.formats import write_csr4, write_lmsino
from mlemlib.formats.compressed_h5 import CompressedH5, write_compressed_h5
from mlemlib.formats.h5 import MatrixH5, write_matrix_h5
from mlemlib.matrix import CSRMatrix

FORMATS = ("csr", "compressed", "compressed-f16", "compressed-u16")
LOSSY = ("compressed-f16", "compressed-u16")
GRID = (8, 8, 6)  # n = 384: column deltas above 253 need markers with 8-bit codes
DUPLICATES = range(10, 20)  # rows copied to 60..69: what fold finds


def _matrix() -> CSRMatrix:
    """Random rows with sorted columns, an empty row, duplicated rows, a wide row and the float16 trap row."""
    n = int(np.prod(GRID))
    rng = np.random.default_rng(5)
    a = sp.random(90, n, density=0.05, random_state=7, format="lil", dtype=np.float64)
    a[3, :] = 0.0
    a[5, :] = 0.0
    a[5, 0] = 0.25
    a[5, n - 1] = 0.5
    # the float16 trap: 0.99999 rounds up to 1.0 (row scale 2**-15 -> 2**-14 when encoded again), and the
    # smallest values are float16 subnormals of that row, which lose a bit under the doubled scale
    cols = np.sort(rng.choice(n, 24, replace=False))
    a[8, :] = 0.0
    for k, c in enumerate(cols):
        a[8, c] = 0.99999 if k == 0 else float(rng.uniform(1e-10, 4e-9))
    a = a.tocsr()
    a = sp.vstack([a[:60], a[DUPLICATES.start : DUPLICATES.stop], a[60:]]).tocsr().astype(np.float32)
    a.eliminate_zeros()
    a.sort_indices()
    return CSRMatrix.from_scipy(a)


@pytest.fixture(scope="module")
def original() -> CSRMatrix:
    a = _matrix()
    enc = CompressedMatrix.from_csr(a, "compressed-f16")
    again = CompressedMatrix.from_csr(enc.to_csr(), "compressed-f16")
    assert not np.array_equal(again.to_csr().data, enc.to_csr().data), "the fixture lost its float16 trap"
    return a


def _write(path, a: CSRMatrix, fmt: str, **attrs):
    if fmt == "csr":
        write_matrix_h5(path, a, **attrs)
    else:
        write_compressed_h5(path, a, fmt=fmt, **attrs)
    return path


def _format(path) -> str:
    with MatrixH5(path) as f:
        return getattr(f, "format", "csr")


def _decoded(path) -> sp.csr_matrix:
    with MatrixH5(path) as f:
        return f.to_csr().to_scipy()


def _encoded(path) -> CompressedMatrix:
    with CompressedH5(path) as f:
        return f.read_encoded(0, f.shape[0])


def _same_csr(got: sp.csr_matrix, want: sp.csr_matrix) -> None:
    want = want.tocsr()
    want.sort_indices()
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.indptr, want.indptr)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.data.view(np.uint32), want.astype(np.float32).data.view(np.uint32))


def _same_encoding(got: CompressedMatrix, want: CompressedMatrix) -> None:
    assert (got.format, got.code_bits, got.shape, got.nnz) == (want.format, want.code_bits, want.shape, want.nnz)
    np.testing.assert_array_equal(got.slotptr(), want.slotptr())
    np.testing.assert_array_equal(got.codes, want.codes)
    np.testing.assert_array_equal(got.value_bits(), want.value_bits())
    if want.scale is None:
        assert got.scale is None
    else:
        np.testing.assert_array_equal(got.scale.view(np.uint32), want.scale.view(np.uint32))


def _check(out, fmt: str, from_original: sp.csr_matrix, from_decoded: sp.csr_matrix) -> None:
    """``out`` has format ``fmt`` and holds ``from_decoded`` (the stage's result on the decoded input); a
    compressed one is exactly the encoding of ``from_original`` (the result on the float32 original)."""
    assert _format(out) == fmt
    _same_csr(_decoded(out), from_decoded)
    if fmt != "csr":
        got = _encoded(out)
        want = from_original.tocsr()
        want.sort_indices()
        _same_encoding(got, CompressedMatrix.from_csr(CSRMatrix.from_scipy(want), fmt, code_bits=got.code_bits))


@pytest.fixture(params=FORMATS)
def source(request, tmp_path, original):
    """(format, the input container in that format, the original matrix)."""
    fmt = request.param
    path = _write(tmp_path / f"in-{fmt}.h5", original, fmt, grid=GRID, voxel_size=(1.0, 1.0, 2.0), source="m")
    return fmt, path, original


def test_convert_keeps_the_format(source, tmp_path, capsys):
    from mlemlib.cli import main

    fmt, path, a = source
    out = tmp_path / "out.h5"
    assert main(["convert", str(path), "-o", str(out), "--chunk-nnz", "200"]) == 0  # no --format: the input's
    _check(out, fmt, a.to_scipy(), _decoded(path))
    if fmt != "csr":  # a copy: the input's encoding, slot for slot
        _same_encoding(_encoded(out), _encoded(path))
    with MatrixH5(out) as f:
        assert f.grid == GRID
    assert fmt in capsys.readouterr().out


def test_fold_keeps_the_format(source, tmp_path):
    from mlemlib.fold import fold_file, fold_of

    fmt, path, a = source
    out = tmp_path / "folded.h5"
    s = fold_file(path, out, chunk_nnz=300)
    assert s["format"] == fmt
    decoded = _decoded(path)
    # each distinct non-empty row once, at its first occurrence (found here with Python's dict)
    first: dict = {}
    for r in range(decoded.shape[0]):
        lo, hi = decoded.indptr[r], decoded.indptr[r + 1]
        if hi > lo:
            first.setdefault((decoded.indices[lo:hi].tobytes(), decoded.data[lo:hi].tobytes()), r)
    keep = np.array(sorted(first.values()))
    assert len(keep) == decoded.shape[0] - len(DUPLICATES) - 1  # the duplicates and the empty row go
    _check(out, fmt, a.to_scipy()[keep], decoded[keep])
    fold = fold_of(out)
    users = np.flatnonzero(fold.row_map >= 0)
    _same_csr(_decoded(out)[fold.row_map[users]], decoded[users])


@pytest.mark.parametrize(("mode", "passes"), [("rows", 1), ("rows+voxels", 2)])
def test_reorder_keeps_the_format(source, tmp_path, mode, passes):
    from mlemlib.reorder import permutation_of, reorder_file

    fmt, path, a = source
    out = tmp_path / "reordered.h5"
    s = reorder_file(path, out, mode, chunk_nnz=250, passes=passes)
    assert s["format"] == fmt
    perm = permutation_of(out)
    rows = perm.rows
    assert not np.array_equal(rows, np.arange(len(rows)))
    voxels = perm.voxels if perm.voxels is not None else np.arange(a.shape[1])
    assert (mode == "rows+voxels") == (perm.voxels is not None)
    _check(out, fmt, a.to_scipy()[rows][:, voxels], _decoded(path)[rows][:, voxels])


def test_partition_keeps_the_format(source, tmp_path):
    from mlemlib.partition import partition_file

    fmt, path, a = source
    at = a.to_scipy().T.tocsr()
    at.sort_indices()
    t_path = _write(tmp_path / f"transpose-{fmt}.h5", CSRMatrix.from_scipy(at), fmt)
    plan = partition_file(path, t_path, 3, tmp_path / "parts-3", local_transpose=True, chunk_nnz=100)
    assert plan["matrix_format"] == fmt
    t_decoded = _decoded(t_path)
    for k, (r0, r1) in enumerate(plan["rows"]):
        part = tmp_path / "parts-3" / f"part-{k}.h5"
        assert _format(part) == fmt
        _same_csr(_decoded(part), t_decoded[:, r0:r1])
        if fmt == "compressed":
            got = _encoded(part)
            _same_encoding(got, CompressedMatrix.from_csr(CSRMatrix.from_scipy(at[:, r0:r1].tocsr()), fmt,
                                                          code_bits=got.code_bits))
        elif fmt in LOSSY:  # the rows of A^T keep their scales and stored values
            got, whole = _encoded(part), _encoded(t_path)
            np.testing.assert_array_equal(got.scale, whole.scale)


def test_convert_to_its_own_format_is_a_copy(source, tmp_path):
    """:func:`mlemlib.formats.convert` of a container to its own format (no ``fmt``, or ``fmt`` its format)
    keeps it: a compressed one slot for slot (a lossy one is not rounded again: the fixture's float16 trap row
    would change), a CSR one array for array; the summary names the format."""
    from mlemlib.formats import convert

    fmt, path, a = source
    for k, asked in enumerate((None, fmt)):
        out = tmp_path / f"copy-{k}.h5"
        s = convert(path, out, fmt=asked, max_nnz=200)
        assert s["format"] == fmt and s["nnz"] == a.nnz
        _check(out, fmt, a.to_scipy(), _decoded(path))
        if fmt != "csr":
            _same_encoding(_encoded(out), _encoded(path))
            assert s["code_bits"] == _encoded(path).code_bits
        with MatrixH5(out) as f, MatrixH5(path) as g:
            assert f.checksum == g.checksum and f.grid == GRID


def _within_rounding(fmt: str, got: np.ndarray, exact: np.ndarray, scale: np.ndarray) -> None:
    """``got`` (decoded) is ``exact`` rounded once in ``fmt`` with the row scales ``scale`` (one per element):
    float16 of ``v / s`` (11 significant bits; float16 subnormals below ``2**-14 * s``) or the 16-bit integer
    ``rint(v / s)`` times ``s`` in float32."""
    exact = exact.astype(np.float64)
    err = np.abs(got.astype(np.float64) - exact)
    if fmt == "compressed-f16":
        bound = np.maximum(2.0**-11 * exact, 2.0**-25 * scale)
    else:
        bound = 0.5 * scale * (1 + 1e-6) + 2.0**-23 * np.maximum(exact, got)
    assert np.all(err <= bound), f"worst excess {np.max(err - bound)}"


def test_transpose_keeps_the_format(source, tmp_path, capsys):
    """``mlem transpose`` of a container writes ``A^T`` holding exactly the values ``A`` decodes to:
    ``decode(transpose(A)) == transpose(decode(A))`` bit for bit, for every format.

    - ``csr`` and ``compressed``: in the input's format (A being lossless, ``== A.T`` of the float32 original);
      a compressed one is exactly the encoding of ``A.T``.
    - ``compressed-f16`` / ``-u16``: in the lossless ``compressed`` format (encoding ``A^T`` in 16 bits again
      would round its values a second time, at ``A^T``'s own row scales), exactly the encoding of
      ``transpose(decode(A))``.
    """
    from mlemlib.cli import main
    from mlemlib.compressed import exact_format
    from mlemlib.transpose import transpose_file

    fmt, path, a = source
    out_fmt = exact_format(fmt)
    assert out_fmt == ("compressed" if fmt.endswith("16") else fmt)
    out = tmp_path / "transpose.h5"
    s = transpose_file(path, out, chunk_nnz=150)
    assert s["format"] == out_fmt and _format(out) == out_fmt
    want = _decoded(path).T.tocsr()  # transpose(decode(A))
    want.sort_indices()
    got = _decoded(out)
    np.testing.assert_array_equal(got.indptr, want.indptr)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.data.view(np.uint32), want.data.astype(np.float32).view(np.uint32))
    with MatrixH5(out) as f, MatrixH5(path) as g:
        assert f.attrs["kind"] == "transpose" and f.attrs["source_checksum"] == g.checksum
    if fmt in ("csr", "compressed"):
        _check(out, fmt, a.to_scipy().T, want)
        with MatrixH5(out) as f, MatrixH5(path) as g:
            assert f.checksum == write_matrix_h5(tmp_path / "t-csr.h5", CSRMatrix.from_scipy(want))
    else:
        enc = _encoded(out)
        assert s["code_bits"] == enc.code_bits
        _same_encoding(enc, CompressedMatrix.from_csr(CSRMatrix.from_scipy(want), out_fmt, code_bits=enc.code_bits))
    # the CLI says what it wrote
    out2 = tmp_path / "cli" / "transpose.h5"
    assert main(["transpose", str(path), "-o", str(out2), "-c", "100"]) == 0
    assert f": {a.shape[1]} x {a.shape[0]}, nnz {a.nnz}, {out_fmt}" in capsys.readouterr().out
    assert _format(out2) == out_fmt


def test_transpose_of_a_lossy_matrix_keeps_even_its_subnormal_values(tmp_path):
    """A value of a float16 row that would be a subnormal of its row of ``A^T`` (a larger row scale there) is
    kept exactly: ``A`` = [[0.3, t], [0, 0.9]] with t = 3 * 2**-40 (row 0's scale is 2**-16: t is 3 float16
    subnormal steps); in a float16 ``A^T`` t would meet 0.9 (scale 2**-15: 1.5 steps) and round to 2 steps;
    the transpose is stored in the lossless format instead and holds t."""
    from mlemlib.transpose import transpose_file

    t = 3 * 2.0**-40
    a = CSRMatrix(np.array([0, 2, 3]), np.array([0, 1, 1], dtype=np.int32), np.array([0.3, t, 0.9], np.float32),
                  (2, 2))
    path = _write(tmp_path / "a.h5", a, "compressed-f16")
    assert _decoded(path)[0, 1] == np.float32(t)  # A holds t exactly
    transpose_file(path, tmp_path / "t.h5")
    at = _decoded(tmp_path / "t.h5")
    assert at[1, 0] == np.float32(t)
    assert at[0, 0] == _decoded(path)[0, 0] and at[1, 1] == _decoded(path)[1, 1]


# --------------------------------------------------------------------------- every stage's matrix input
#
# Every `mlem` subcommand that reads a matrix takes a .csr4, .mtx or .npz as it takes an .h5 container, or
# refuses it before any work in one line (exit 2) that names the 'mlem convert' command making what it needs;
# that command, run as written, makes an input the stage then accepts.

KINDS = ("csr4", "mtx", "npz")
#: subcommand -> its arguments for matrix M in directory D (outputs under D/out).
STAGES = {
    "info": lambda m, d: ["info", m],
    "convert": lambda m, d: ["convert", m, "-o", f"{d}/out/c.h5"],
    "fold": lambda m, d: ["fold", m, "-o", f"{d}/out/f.h5"],
    "chunk": lambda m, d: ["chunk", m, "-o", f"{d}/out/chunks.h5"],
    "reorder": lambda m, d: ["reorder", m, "-o", f"{d}/out/r.h5", "--subsets", "4"],
    "norm": lambda m, d: ["norm", m, "-o", f"{d}/out/n.h5"],
    "transpose": lambda m, d: ["transpose", m, "-o", f"{d}/out/t.h5"],
    "partition": lambda m, d: ["partition", m, "--parts", "2", "-o", f"{d}/out/parts"],
    "simulate": lambda m, d: ["simulate", m, "-o", f"{d}/out/s.LMsino", "--seed", "1", "--supersample", "1"],
    "reconstruct": lambda m, d: ["reconstruct", "--matrix", m, "--sino", f"{d}/g.LMsino", "-n", "2",
                                 "-o", f"{d}/out/img.h5", "--backend", "cpu"],
    "reconstruct --subsets": lambda m, d: ["reconstruct", "--matrix", m, "--sino", f"{d}/g.LMsino", "-n", "2",
                                           "-o", f"{d}/out/img.h5", "--backend", "cpu", "--subsets", "4"],
    "convergence": lambda m, d: ["convergence", m, "-s", f"{d}/truth-data.LMsino", "-t", f"{d}/truth.h5",
                                 "--subsets", "1", "2", "-n", "1", "--no-ignored", "-o", f"{d}/out/c.json"],
    "bench spmv": lambda m, d: ["bench", "spmv", m, "-o", f"{d}/out/b.json", "-n", "1", "-w", "1", "--no-check"],
}
#: What each stage must do with a .csr4 / .mtx / .npz: "works", or "convert" (refused, naming 'mlem convert').
EXPECTED = {
    "info": dict.fromkeys(KINDS, "works"),
    "convert": dict.fromkeys(KINDS, "works"),
    "fold": dict.fromkeys(KINDS, "works"),
    "chunk": dict.fromkeys(KINDS, "works"),
    "reconstruct": dict.fromkeys(KINDS, "works"),
    "bench spmv": dict.fromkeys(KINDS, "works"),
    "simulate": {"csr4": "works", "mtx": "convert", "npz": "convert"},  # .mtx and .npz hold no voxel grid
    # read a container's own records (checksum, format, permutations, subsets): a container only
    "reorder": dict.fromkeys(KINDS, "convert"),
    "norm": dict.fromkeys(KINDS, "convert"),
    "transpose": dict.fromkeys(KINDS, "convert"),
    "partition": dict.fromkeys(KINDS, "convert"),
    "convergence": dict.fromkeys(KINDS, "convert"),
    # rows of a file in its own order are not grouped by subsets: grouping them takes a container
    "reconstruct --subsets": dict.fromkeys(KINDS, "convert"),
}
STAGE_GRID = (4, 3, 2)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The same 60 x 24 matrix as .h5 (with its grid), .csr4 (with a scanner block), .mtx and .npz, a measurement,
    and a simulated measurement with its phantom (for convergence)."""
    import scipy.io

    from test_formats import scanner_bytes

    d = tmp_path_factory.mktemp("stage-inputs")
    n = int(np.prod(STAGE_GRID))
    a = sp.random(60, n, density=0.3, random_state=3, format="csr", dtype=np.float32)
    a.data += np.float32(0.125)
    a.sort_indices()
    c = CSRMatrix.from_scipy(a)
    write_matrix_h5(d / "m.h5", c, grid=STAGE_GRID, voxel_size=(1.5, 1.5, 2.0))
    write_csr4(d / "m.csr4", c, scanner_block=scanner_bytes(grid=STAGE_GRID, voxel=(1.5, 1.5, 2.0)))
    scipy.io.mmwrite(d / "m.mtx", a)
    sp.save_npz(d / "m.npz", a)
    write_lmsino(d / "g.LMsino", np.random.default_rng(0).poisson(20.0, 60).astype(np.int32))
    from mlemlib.cli import main

    assert main(["simulate", str(d / "m.h5"), "-o", str(d / "truth-data.LMsino"), "-t", str(d / "truth.h5"),
                 "--seed", "2", "--supersample", "1"]) == 0
    return d, a


def _run(argv: list[str], capsys) -> tuple[int, str]:
    from mlemlib.cli import main

    capsys.readouterr()
    rc = main(argv)
    return rc, capsys.readouterr().err


def _needs_gpu(stage: str) -> None:
    if stage == "bench spmv":
        pytest.importorskip("cupy", reason="mlem bench spmv times GPU kernels")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stage", list(STAGES))
def test_every_stage_takes_any_matrix_or_names_mlem_convert(stage, kind, inputs, tmp_path, capsys):
    _needs_gpu(stage)
    d, _ = inputs
    (tmp_path / "out").mkdir()
    for f in ("g.LMsino", "truth-data.LMsino", "truth.h5"):
        (tmp_path / f).symlink_to(d / f)
    src = tmp_path / f"m.{kind}"
    src.symlink_to(d / f"m.{kind}")
    rc, err = _run(STAGES[stage](str(src), str(tmp_path)), capsys)
    if EXPECTED[stage][kind] == "works":
        assert rc == 0, err
        assert any((tmp_path / "out").iterdir()) or stage == "info"
        return
    # refused before any work, in one line naming the file and the convert command that makes its input
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"mlem: error: {src}: ")
    assert "'mlem convert " in lines[0]
    assert not any((tmp_path / "out").iterdir())
    # the named command, run as written (options to fill in filled), makes what the stage accepts
    command = lines[0].split("'mlem convert ", 1)[1].split("'", 1)[0]
    args = shlex.split(command.replace("NX NY NZ", " ".join(map(str, STAGE_GRID))).replace("X Y Z", "1.5 1.5 2.0"))
    assert args[-2:] == ["--out", str(tmp_path / "m.h5")]
    assert _run(["convert", *args], capsys)[0] == 0
    argv = STAGES[stage](str(tmp_path / "m.h5"), str(tmp_path))
    if stage == "reconstruct --subsets":  # the message goes on: group the container's rows with mlem reorder
        reorder = lines[0].split("then 'mlem reorder ", 1)[1].split("'", 1)[0].replace("OUT.h5", str(tmp_path / "r.h5"))
        assert _run(["reorder", *shlex.split(reorder)], capsys)[0] == 0
        argv = STAGES[stage](str(tmp_path / "r.h5"), str(tmp_path))
    rc, err = _run(argv, capsys)
    assert rc == 0, err


@pytest.mark.parametrize("kind", KINDS)
def test_reconstruct_gives_the_same_image_from_every_matrix_file(kind, inputs, tmp_path, capsys):
    """The image does not depend on the file the matrix came in (the values survive every format exactly)."""
    import h5py

    d, _ = inputs
    images = []
    for k in ("h5", kind):
        out = tmp_path / f"img-{k}.h5"
        rc, err = _run(["reconstruct", "--matrix", str(d / f"m.{k}"), "--sino", str(d / "g.LMsino"), "-n", "3",
                        "-o", str(out), "--backend", "cpu"], capsys)
        assert rc == 0, err
        with h5py.File(out, "r") as f:
            images.append(np.asarray(f["image"]))
    assert images[0].size == int(np.prod(STAGE_GRID)) and images[0].sum() > 0
    np.testing.assert_array_equal(images[1].ravel(), images[0].ravel())  # .mtx and .npz know no grid: flat
