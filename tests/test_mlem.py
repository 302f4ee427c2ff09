"""MLEM loop, CPU backend, checkpoints/resume and accuracy measures (CPU only)."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib import metrics
from mlemlib.backends.cpu import CpuBackend, spmv, spmv_t
from mlemlib.errors import ConfigError, DeviceError, InputError
from mlemlib.matrix import CSRMatrix
from mlemlib.backends import make_backend
from mlemlib.formats import InMemoryMatrix
from mlemlib.image import read_image
from mlemlib.mlem import reconstruct, reference
from mlemlib.problem import ModelSpec, RunSettings

GRID = (6, 5, 4)  # gridX, gridY, gridZ: n = 120


def _problem(seed: int = 7, m: int = 400):
    """A small sparse problem with an empty row (fp == 0) and an empty column (norm == 0)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(GRID))
    a = sp.random(m, n, density=0.08, random_state=seed, format="lil", dtype=np.float64)
    a[5, :] = 0.0  # LOR seeing nothing
    a[:, 17] = 0.0  # voxel seen by no LOR
    a = a.tocsr().astype(np.float32)
    a.eliminate_zeros()
    f_true = rng.uniform(0.5, 3.0, n)
    g = rng.poisson(a.astype(np.float64) @ f_true * 20.0).astype(np.int32)
    g[5] = 3  # counts on a LOR whose forward projection is 0: must be ignored
    return CSRMatrix.from_scipy(a), g


def dense_mlem(a: CSRMatrix, g: np.ndarray, iterations: int) -> np.ndarray:
    """Independent float64 MLEM on the dense matrix (thesis eq. 3.1-3.7)."""
    d = a.to_scipy().toarray().astype(np.float64)
    g = g.astype(np.float64)
    norm = d.sum(axis=0)
    f = np.full(d.shape[1], g.sum() / norm.sum())
    for _ in range(iterations):
        fp = d @ f
        c = np.zeros_like(fp)
        c[fp != 0] = g[fp != 0] / fp[fp != 0]
        bp = d.T @ c
        f = np.where(norm != 0, f * bp / np.where(norm != 0, norm, 1.0), f * bp)
    return f


def _transpose(a: CSRMatrix) -> CSRMatrix:
    return CSRMatrix.from_scipy(a.to_scipy().T.tocsr())


@pytest.fixture(scope="module")
def problem():
    a, g = _problem()
    return a, g, dense_mlem(a, g, 50)


@pytest.mark.parametrize(
    "fp,bp,with_t",
    [("numba", "numba", False), ("scipy", "scipy", False), ("numba", "numba", True), ("scipy", "scipy", True),
     ("numba", "notrans", True), ("auto", "auto", False)],
)
def test_cpu_matches_dense_float64(problem, tmp_path, fp, bp, with_t):
    a, g, expected = problem
    t = reconstruct(ModelSpec(a, g, transpose=_transpose(a) if with_t else None),
                    RunSettings(50, checkpoint_every=0, backend="cpu", fp=fp, bp=bp), tmp_path / "image.h5")
    img, attrs = read_image(tmp_path / "image.h5")
    assert img.dtype == np.float32
    assert metrics.relative_l2(img, expected) < 1e-5
    assert img[17] == 0.0  # norm 0: f * bp with bp 0
    assert attrs["iterations"] == 50
    assert t["repetitions"][0]["accuracy"]["image_sum"] == pytest.approx(float(np.sum(img, dtype=np.float64)), rel=1e-12)


def test_reference_mode_is_float64(problem, tmp_path):
    a, g, expected = problem
    reference(ModelSpec(a, g), RunSettings(50, checkpoint_every=0), tmp_path / "reference.h5")
    img, attrs = read_image(tmp_path / "reference.h5")
    assert img.dtype == np.float64
    assert attrs["reference"] is True or attrs["reference"] == 1
    assert metrics.relative_l2(img, expected) < 1e-12
    assert not (tmp_path / "reference.raw").exists()  # the reference is its own artifact only


def test_fp_kernels_agree_bitwise_and_adjoint(problem, rng):
    a, _, _ = problem
    m, n = a.shape
    x = rng.uniform(0, 1, n).astype(np.float32)
    y32 = spmv(a.indptr, a.indices, a.data, x, np.empty(m, np.float32))
    assert np.array_equal(y32, (a.to_scipy() @ x).astype(np.float32))  # same order of sums as SciPy
    # adjointness <A x, y> == <x, A^T y> in float64
    x64 = rng.uniform(0, 1, n)
    y64 = rng.uniform(0, 1, m)
    ax = spmv(a.indptr, a.indices, a.data, x64, np.empty(m))
    aty = spmv_t(a.indptr, a.indices, a.data, y64, np.empty(n), np.empty((3, n)))
    assert float(ax @ y64) == pytest.approx(float(x64 @ aty), rel=1e-13)
    # the blocked scatter equals A^T y of a dense computation, whatever the block count
    dense = a.to_scipy().toarray().astype(np.float64).T @ y64
    for blocks in (1, 4, 64):
        np.testing.assert_allclose(spmv_t(a.indptr, a.indices, a.data, y64, np.empty(n), np.empty((blocks, n))), dense, rtol=1e-13)


def test_correlation_update_initial_hand_computed():
    # A = [[1, 1, 0], [0, 0, 0], [0, 2, 2]]: row 1 sees nothing, column sums [1, 3, 2]
    a = CSRMatrix(np.array([0, 2, 2, 4]), np.array([0, 1, 1, 2]), np.array([1, 1, 2, 2], np.float32), (3, 3))
    g = np.array([4, 3, 5], np.int32)
    norm = np.array([2.0, 0.0, 4.0])  # a user's norm with a zero
    be = CpuBackend(a, g, norm, fp="scipy", bp="scipy")
    np.testing.assert_array_equal(be.initial_image(), np.full(3, 12 / 6, np.float32))
    c = be.correlate(np.array([2, 0, 4], np.float32))
    np.testing.assert_array_equal(c, [2.0, 0.0, 1.25])  # 0 where fp == 0
    f = be.update(np.array([1, 2, 3], np.float32), np.array([4, 5, 6], np.float32))
    np.testing.assert_array_equal(f, [2.0, 10.0, 4.5])  # f*bp/norm, f*bp where norm == 0
    fp = be.forward(np.array([1, 2, 3], np.float32))
    np.testing.assert_array_equal(fp, [3, 0, 10])
    np.testing.assert_array_equal(be.back(np.array([1, 7, 2], np.float32)), [1, 5, 4])


def test_outputs_and_timings(problem, tmp_path):
    a, g, _ = problem
    src = InMemoryMatrix(a, grid=GRID, voxel_size=(2.0, 2.0, 3.0))
    out = tmp_path / "run" / "image.h5"
    t = reconstruct(ModelSpec(src, g), RunSettings(7, repetitions=3, checkpoint_every=0, backend="cpu"), out)
    with h5py.File(out) as f:
        assert f["image"].shape == (4, 5, 6)  # (gridZ, gridY, gridX)
        assert list(f.attrs["voxel_size"]) == [2.0, 2.0, 3.0]
        assert list(f.attrs["grid"]) == [6, 5, 4]
        assert f.attrs["reorder"] == "none"
        img = f["image"][...].reshape(-1)
    raw = np.fromfile(out.with_suffix(".raw"), dtype="<f4")
    assert raw.size == a.shape[1] and np.array_equal(raw, img)
    on_disk = json.loads((out.parent / "timings.json").read_text())
    assert on_disk["config"]["iterations"] == 7 and on_disk["config"]["repetitions"] == 3
    assert on_disk["config"]["graph"] is False
    assert on_disk["config"]["reorder"] == "none"  # not a reordered container (tests/test_reorder.py for those)
    assert [r["repetition"] for r in on_disk["repetitions"]] == [0, 1, 2]
    for rec in on_disk["repetitions"]:
        for step in ("iteration", "fp", "corr", "bp", "update"):
            st = rec["steps"][step]
            assert st["n"] == 7 and st["min"] <= st["median"] <= st["max"] and st["min"] <= st["mean"] <= st["max"]
            assert len(rec["samples"][step]) == 7
    assert set(on_disk["setup"]) == {"load_s", "backend_s", "phases", "first_iteration_s"}
    phases = on_disk["setup"]["phases"]  # the set-up per phase (mlemlib.setup_times; tests/test_setup_times.py)
    assert phases["total"] >= phases["problem"] >= 0 and phases["read_bytes"] == 0  # a matrix in memory: no reads
    assert on_disk["setup"]["first_iteration_s"] >= phases["total"]
    assert on_disk["bytes"]["fp"] == 8 * (a.shape[0] + 1) + 8 * a.nnz
    assert on_disk["deterministic"] is True
    assert len({r["accuracy"]["image_sha256"] for r in on_disk["repetitions"]}) == 1  # bit-identical repetitions
    assert t["backend"]["backend"] == "cpu"
    assert on_disk["config"]["data"] == "memory"  # a measurement given as an array
    # the measurement's name in tables: the one given (the workflow's config key), else the file's stem
    sino = tmp_path / "scna.LMsino"
    np.asarray(g, dtype="<i4").tofile(sino)
    for name, want in ((None, "scna"), ("scan", "scan")):
        reconstruct(ModelSpec(src, sino, data_name=name), RunSettings(1, checkpoint_every=0, backend="cpu"),
                    tmp_path / "named" / "image.h5")
        assert json.loads((tmp_path / "named" / "timings.json").read_text())["config"]["data"] == want


class _CountingSource(InMemoryMatrix):
    reads = 0

    def read_rows(self, start, stop, *, validate=True):
        type(self).reads += 1
        return super().read_rows(start, stop, validate=validate)


def test_repetitions_load_once(problem, tmp_path):
    a, g, _ = problem
    counts = []
    for reps in (1, 4):
        _CountingSource.reads = 0
        reconstruct(ModelSpec(_CountingSource(a), g, norm=np.asarray(a.to_scipy().sum(axis=0)).ravel()),
                    RunSettings(2, repetitions=reps, checkpoint_every=0, backend="cpu"), tmp_path / f"r{reps}.h5")
        counts.append(_CountingSource.reads)
    assert counts[0] == counts[1] >= 1


class _PipelinedCpu(CpuBackend):
    """The CPU backend read as a GPU one that pipelines: iteration k's times are (k ms, ...), readable
    through previous_step_times after iteration k+1 is queued; every read is logged."""

    pipelines = True

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.done: list[dict[str, float]] = []
        self.log: list[tuple[str, int]] = []

    def iterate(self, f):
        f = super().iterate(f)
        self.done.append({"fp": 0.5e-3, "iteration": (len(self.done) + 1) * 1e-3})
        self.log.append(("iterate", len(self.done)))
        return f

    def last_step_times(self):
        self.log.append(("last", len(self.done)))
        return dict(self.done[-1])

    def previous_step_times(self):
        self.log.append(("previous", len(self.done) - 1))
        return dict(self.done[-2]) if len(self.done) > 1 else None


def test_a_pipelining_backend_has_each_iterations_times_read_one_iteration_late(problem, tmp_path, monkeypatch):
    from mlemlib import mlem

    a, g, _ = problem
    made = []

    def make(name, matrix, g, norm, transpose=None, **kw):
        made.append(_PipelinedCpu(matrix, g, norm, transpose=transpose, fp="numba", bp="numba", dtype=kw["dtype"]))
        return made[-1]

    monkeypatch.setattr(mlem, "make_backend", make)
    out = tmp_path / "piped" / "image.h5"
    t = reconstruct(ModelSpec(a, g), RunSettings(7, repetitions=1, checkpoint_every=3, backend="cpu"), out)
    be = made[0]
    # every iteration's own times, in order: none shifted by the late reading, none lost
    assert t["repetitions"][0]["samples"]["iteration"] == pytest.approx([k * 1e-3 for k in range(1, 8)])
    # iteration k's times are read after k+1 is queued, except before a checkpoint (3, 6) and at the end (7)
    reads = [e for e in be.log if e[0] != "iterate"]
    assert reads == [("previous", 1), ("previous", 2), ("last", 3), ("previous", 4), ("previous", 5), ("last", 6),
                     ("last", 7)]
    for k in (1, 2, 4, 5):
        assert be.log.index(("iterate", k + 1)) < be.log.index(("previous", k))
    # the image is the plain loop's, bit for bit
    plain = tmp_path / "plain" / "image.h5"
    monkeypatch.undo()
    reconstruct(ModelSpec(a, g), RunSettings(7, checkpoint_every=3, backend="cpu", fp="numba", bp="numba"), plain)
    assert read_image(out)[0].tobytes() == read_image(plain)[0].tobytes()


KILLER = """
import os, signal, sys
import numpy as np
from mlemlib.mlem import reconstruct
from mlemlib.problem import ModelSpec, RunSettings
def progress(rep, it, f):
    if rep == {rep} and it == {it}:
        os.kill(os.getpid(), signal.SIGKILL)
reconstruct(ModelSpec({matrix!r}, {sino!r}), RunSettings(20, repetitions=2, checkpoint_every=5, backend="cpu"), {out!r},
            progress=progress)
"""


@pytest.mark.parametrize("kill_rep,kill_it", [(0, 17), (1, 6)])
def test_resume_after_kill_is_bit_identical(problem, tmp_path, kill_rep, kill_it):
    from mlemlib.formats.h5 import write_matrix_h5
    from mlemlib.formats.lmsino import write_lmsino

    a, g, _ = problem
    write_matrix_h5(tmp_path / "matrix.h5", a)
    write_lmsino(tmp_path / "g.LMsino", g)
    killed = tmp_path / "killed" / "image.h5"
    script = tmp_path / "killer.py"
    script.write_text(textwrap.dedent(KILLER.format(rep=kill_rep, it=kill_it, matrix=str(tmp_path / "matrix.h5"),
                                                    sino=str(tmp_path / "g.LMsino"), out=str(killed))))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ckpt = killed.with_name("image.checkpoint.h5")
    assert ckpt.exists() and not killed.exists()
    with h5py.File(ckpt) as f:
        assert (int(f.attrs["repetition"]), int(f.attrs["iteration"])) == (kill_rep, kill_it // 5 * 5)

    t = reconstruct(ModelSpec(tmp_path / "matrix.h5", tmp_path / "g.LMsino"),
                    RunSettings(20, repetitions=2, checkpoint_every=5, backend="cpu"), killed)
    whole = tmp_path / "whole" / "image.h5"
    reconstruct(ModelSpec(tmp_path / "matrix.h5", tmp_path / "g.LMsino"),
                RunSettings(20, repetitions=2, checkpoint_every=5, backend="cpu"), whole)
    a_img, _ = read_image(killed)
    b_img, _ = read_image(whole)
    assert a_img.tobytes() == b_img.tobytes()
    assert not ckpt.exists()  # removed once the outputs are written
    rec = t["repetitions"][kill_rep]
    assert rec["resumed_at"] == [kill_it // 5 * 5]
    assert len(rec["samples"]["iteration"]) == 20  # timings of both halves kept
    assert len(t["repetitions"]) == 2


def test_checkpoint_of_another_problem_is_refused(problem, tmp_path):
    a, g, _ = problem

    def stop(rep, it, f):
        if it == 4:
            raise KeyboardInterrupt

    out = tmp_path / "image.h5"
    with pytest.raises(KeyboardInterrupt):
        reconstruct(ModelSpec(a, g), RunSettings(10, checkpoint_every=3, backend="cpu"), out, progress=stop)
    assert out.with_name("image.checkpoint.h5").exists()
    other = g.copy()
    other[0] += 1
    with pytest.raises(ConfigError, match="another problem"):
        reconstruct(ModelSpec(a, other), RunSettings(10, checkpoint_every=3, backend="cpu"), out)
    assert not out.exists()
    with pytest.raises(ConfigError, match="beyond this run"):
        reconstruct(ModelSpec(a, g), RunSettings(2, checkpoint_every=3, backend="cpu"), out)


def test_reference_comparison_and_mismatch(problem, tmp_path):
    a, g, expected = problem
    reference(ModelSpec(a, g), RunSettings(50, checkpoint_every=0), tmp_path / "ref.h5")
    t = reconstruct(ModelSpec(a, g), RunSettings(50, checkpoint_every=0, backend="cpu"), tmp_path / "img.h5",
                    reference=tmp_path / "ref.h5", truth=expected.astype(np.float32))
    acc = t["repetitions"][0]["accuracy"]
    img, _ = read_image(tmp_path / "img.h5")
    ref, _ = read_image(tmp_path / "ref.h5")
    assert acc["rel_l2_reference"] == pytest.approx(metrics.relative_l2(img, ref), rel=1e-12)
    assert 0 < acc["rel_l2_reference"] < 1e-5
    assert acc["rel_l2_truth"] < 1e-5
    with pytest.raises(ConfigError, match="after 50 iterations"):
        reconstruct(ModelSpec(a, g), RunSettings(49, backend="cpu"), tmp_path / "img2.h5",
                    reference=tmp_path / "ref.h5")
    other = g.copy()
    other[1] += 2
    with pytest.raises(ConfigError, match="another problem"):
        reconstruct(ModelSpec(a, other), RunSettings(50, backend="cpu"), tmp_path / "img3.h5",
                    reference=tmp_path / "ref.h5")


@pytest.mark.parametrize("given,message", [
    ({"iterations": -1}, "iterations: must be an integer >= 0, got -1"),
    ({"iterations": 2.5}, "iterations: must be an integer >= 0, got 2.5"),
    ({"iterations": True}, "iterations: must be an integer >= 0, got True"),
    ({"iterations": 2, "repetitions": 0}, "repetitions: must be an integer >= 1, got 0"),
    ({"iterations": 2, "checkpoint_every": -3}, "checkpoint_every: must be an integer >= 0, got -3"),
    ({"iterations": 2, "backend": "opencl"}, "backend: unknown backend 'opencl', expected auto, cpu or cuda"),
    ({"iterations": 2, "layout": "ring"}, "layout: unknown layout 'ring', expected one of local, thesis"),
    ({"iterations": 2, "gpus": 0}, "gpus: must be an integer >= 1, got 0"),
    ({"iterations": 2, "gpus": 2, "reference_mode": True}, "gpus: the reference runs on the cpu (gpus 1)"),
])
def test_run_settings_are_refused_in_one_line_when_made(given, message):
    """A bad count or name stops the run before any work: when its settings are made, not after the problem
    is loaded (the unknown backend was refused by make_backend, after the matrix had been read)."""
    with pytest.raises(ConfigError) as exc:
        RunSettings(**given)
    assert str(exc.value) == message


def test_model_and_settings_values(problem, tmp_path):
    """The model's subset count and prior are checked when it is made; reference mode runs float64 on the cpu;
    both values are frozen."""
    from mlemlib.map import MapSettings

    a, g, _ = problem
    with pytest.raises(ConfigError, match="^subsets: must be an integer >= 1, got 0$"):
        ModelSpec(a, g, subsets=0)
    with pytest.raises(ConfigError, match="^prior.beta: must be >= 0, got -1$"):
        ModelSpec(a, g, map=MapSettings("quadratic", beta=-1))
    with pytest.raises(ConfigError, match="^prior.gamma: must be a finite number >= 0, got -2.0$"):
        ModelSpec(a, g, map=MapSettings("rdp", beta=1, gamma=-2.0, epsilon=1e-3))
    ref = RunSettings(3, backend="cuda", fp=None, reference_mode=True)
    assert (ref.backend, ref.gpus, ref.fp, ref.dtype) == ("cpu", 1, "auto", np.dtype(np.float64))
    plain = RunSettings(3)
    assert (plain.backend, plain.repetitions, plain.checkpoint_every, plain.dtype) == ("auto", 1, 10, np.float32)
    assert RunSettings(3, checkpoint_every=None).checkpoint_every == 0
    with pytest.raises(AttributeError):
        plain.iterations = 4
    with pytest.raises(AttributeError):
        ModelSpec(a, g).sino = g


def test_a_workflow_jobs_model_takes_its_inputs_and_model_params():
    """ModelSpec.of_job: the named inputs a job has (a missing norm, transpose or subset file is None) and the
    params' subsets, factor files and MAP fields, as the rules give them."""
    from mlemlib.map import MapSettings

    class Inputs(dict):  # a Snakemake job's named input: attributes and get
        __getattr__ = dict.__getitem__

    params = {"subsets": 4, "factors": {"multiplicative": "m.f32", "additive": "b.h5:/b"}, "iterations": 3,
              "map": {"prior": "rdp", "beta": 0.5, "epsilon": 0.01, "relaxation": (1.0, 40.0)}}
    run = ModelSpec.of_job(Inputs(matrix="a.h5", sino="g.LMsino", norm="n.h5", transpose="t.h5",
                                  subset_file="s.i32"), params, matrix_name="A", data_name="scan")
    assert (run.matrix, run.sino, run.norm, run.transpose, run.subsets, run.subset_file) == (
        "a.h5", "g.LMsino", "n.h5", "t.h5", 4, "s.i32")
    assert (run.multiplicative, run.additive, run.matrix_name, run.data_name) == ("m.f32", "b.h5:/b", "A", "scan")
    assert run.map == MapSettings("rdp", beta=0.5, epsilon=0.01, relaxation=(1.0, 40.0))
    exact = ModelSpec.of_job(Inputs(matrix="a.csr4", sino="g.LMsino"), {"subsets": 1, "factors": {}})
    assert (exact.norm, exact.transpose, exact.subset_file, exact.multiplicative, exact.map) == (None,) * 5


def test_make_backend_errors(problem, monkeypatch):
    a, g, _ = problem
    norm = np.ones(a.shape[1])
    with pytest.raises(ConfigError, match="gpus"):
        make_backend("cpu", a, g, norm, gpus=2)
    with pytest.raises(ConfigError, match="unknown forward-projection kernel .merge. for backend cpu; valid: auto, numba, scipy"):
        make_backend("cpu", a, g, norm, fp="merge")
    with pytest.raises(ConfigError, match="unknown backend"):
        make_backend("opencl", a, g, norm)
    monkeypatch.setitem(sys.modules, "mlemlib.backends.cuda", None)  # import fails as without CuPy
    with pytest.raises(DeviceError):
        make_backend("cuda", a, g, norm)


def test_cli_reconstruct_and_bad_sino(problem, tmp_path, capsys):
    from mlemlib.cli import main
    from mlemlib.formats.h5 import write_matrix_h5
    from mlemlib.formats.lmsino import write_lmsino

    a, g, expected = problem
    write_matrix_h5(tmp_path / "m.h5", a, grid=list(GRID), voxel_size=[1.0, 1.0, 1.0])
    write_lmsino(tmp_path / "g.LMsino", g)
    out = tmp_path / "run" / "image.h5"
    rc = main(["reconstruct", "-m", str(tmp_path / "m.h5"), "-s", str(tmp_path / "g.LMsino"), "-n", "50",
               "-b", "cpu", "-r", "2", "-o", str(out)])
    assert rc == 0
    img, _ = read_image(out)
    assert metrics.relative_l2(img, expected) < 1e-5
    assert (out.parent / "timings.json").exists() and out.with_suffix(".raw").exists()
    write_lmsino(tmp_path / "short.LMsino", g[:-1])
    rc = main(["reconstruct", "-m", str(tmp_path / "m.h5"), "-s", str(tmp_path / "short.LMsino"), "-n", "3",
               "-b", "cpu", "-o", str(tmp_path / "bad" / "image.h5")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("mlem: error: ") and "short.LMsino" in err[-1]
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


# --------------------------------------------------------------------------- metrics
def test_metrics_hand_computed():
    f = np.array([1.0, 2.0, 2.0], np.float32)
    r = np.array([1.0, 2.0, 0.0])
    assert metrics.image_sum(f) == 5.0
    assert metrics.relative_l2(f, r) == pytest.approx(2.0 / math.sqrt(5.0), rel=1e-15)
    assert metrics.relative_sum_error(f, r) == pytest.approx(2.0 / 3.0, rel=1e-15)
    assert metrics.relative_l2(np.zeros(3), np.zeros(3)) == 0.0
    assert metrics.relative_l2(f, np.zeros(3)) == math.inf
    with pytest.raises(ValueError):
        metrics.relative_l2(f, np.zeros(4))
    # float64 accumulation: 1e8 + 16 ones stays exact, which float32 accumulation would not give
    big = np.array([1e8] + [1.0] * 16, np.float32)
    assert metrics.image_sum(big) == 1e8 + 16
    assert metrics.image_digest(f) == metrics.image_digest(f.astype(np.float64))
    assert metrics.image_digest(f) != metrics.image_digest(f + np.float32(1e-7))
    s = metrics.spread([1.0, 3.0, 2.0])
    assert (s["min"], s["max"], s["range"], s["mean"]) == (1.0, 3.0, 2.0, 2.0)
    assert s["std"] == pytest.approx(math.sqrt(2.0 / 3.0))


def test_contrast_recovery_hand_computed():
    img = np.array([8.0, 8.0, 2.0, 2.0, 1.0, 3.0])  # hot region, background, cold region
    masks = {"hot": np.array([1, 1, 0, 0, 0, 0], bool), "cold": np.array([0, 0, 0, 0, 1, 0], bool)}
    bg = np.array([0, 0, 1, 1, 0, 0], bool)
    cr = metrics.contrast_recovery(img, masks, bg, {"hot": 4.0, "cold": 0.0}, 1.0)
    assert cr["hot"] == pytest.approx((8.0 / 2.0 - 1.0) / (4.0 - 1.0))  # = 1
    assert cr["cold"] == pytest.approx(1.0 - 1.0 / 2.0)
    with pytest.raises(ValueError):
        metrics.contrast_recovery(img, masks, bg, {"hot": 4.0, "cold": 0.0}, 0.0)


def test_read_image_errors(tmp_path):
    with pytest.raises(InputError, match="no such image file"):
        read_image(tmp_path / "missing.h5")
    (tmp_path / "junk.h5").write_bytes(b"not hdf5")
    with pytest.raises(InputError, match="not a readable HDF5"):
        read_image(tmp_path / "junk.h5")
    with h5py.File(tmp_path / "noimage.h5", "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(InputError, match="no dataset /image"):
        read_image(tmp_path / "noimage.h5")


# --------------------------------------------------------------------------- tiny image values (issue 40)
def test_update_flushes_subnormals_and_matches_numpy_elsewhere(rng):
    """The CPU update is f * bp / norm with numpy's roundings; a result below the smallest normal is 0."""
    from mlemlib.backends.cpu import update_flush

    for dt in (np.float32, np.float64):
        tiny = np.finfo(dt).tiny
        f = rng.uniform(0.0, 10.0, 1000).astype(dt)
        bp = rng.uniform(0.0, 2.0, 1000).astype(dt)
        norm = rng.uniform(0.5, 3.0, 1000).astype(dt)
        f[:3] = [3 * tiny, 1.5 * tiny, np.nan]
        bp[:3] = [0.25, 1.0, 1.0]
        norm[:3] = [1.0, 1.0, 1.0]
        expected = f * bp / norm
        assert 0 < expected[0] < tiny and expected[1] >= tiny  # the first would be subnormal, the second not
        out = update_flush(f.copy(), bp, norm)
        assert out[0] == 0 and out[1] == expected[1] and np.isnan(out[2])
        np.testing.assert_array_equal(out[3:], expected[3:])  # bit for bit where nothing is flushed


def test_cpu_image_never_subnormal_and_within_1e6_of_float64():
    """A voxel halved each iteration (seen by an empty LOR and a LOR another voxel explains) decays into the
    float32 subnormal range: the CPU backend makes it 0 instead, and the image stays within 1e-6 of float64."""
    # row 0: voxel 0 alone, no counts; row 1: voxels 0 and 1, 100 counts. norm = (2, 1): f_0 <- f_0 * c_1 / 2.
    a = CSRMatrix(np.array([0, 1, 3], np.int64), np.array([0, 0, 1], np.int32), np.ones(3, np.float32), (2, 2))
    g = np.array([0, 100], np.int32)
    norm = np.array([2.0, 1.0])
    be32 = CpuBackend(a, g, norm, dtype=np.float32)
    be64 = CpuBackend(a, g, norm, dtype=np.float64, fp="numba", bp="numba")
    f32, f64 = be32.initial_image(), be64.initial_image()
    tiny = np.finfo(np.float32).tiny
    flushed = 0
    for _ in range(160):  # f_0 falls below 1.2e-38 after about 130 iterations, below 1.4e-45 after about 150
        f32, f64 = be32.iterate(f32), be64.iterate(f64)
        assert f32[0] == 0 or f32[0] >= tiny  # never subnormal
        flushed += int(f32[0] == 0 and 0 < f64[0] < tiny)  # float64 holds what float32 could only hold subnormal
        assert np.max(np.abs(f32.astype(np.float64) - f64)) <= 1e-6 * np.max(np.abs(f64))
    assert flushed > 10
    assert f32[1] == pytest.approx(100.0, rel=1e-6)


def test_reference_blocks_depend_on_the_image_alone_and_keep_the_sums():
    """The float64 reference scatters over 64 row blocks (one per core of a 64-core node) where their private
    images fit 4 GiB, fewer (at least 16) for bigger images; float32 runs keep 16. The blocks fix the sums: the
    same image for 1 and 2 threads, and within float64 rounding of 16 blocks' image."""
    import numba

    from mlemlib.backends.cpu import DEFAULT_BLOCKS, REFERENCE_BLOCKS, default_blocks

    assert default_blocks(np.float32, 10) == DEFAULT_BLOCKS == 16
    assert default_blocks(np.float64, 784_000) == REFERENCE_BLOCKS == 64
    assert default_blocks(np.float64, 2**32 // (8 * 40)) == 40  # 40 private images fill the 4 GiB
    assert default_blocks(np.float64, 10**9) == 16
    rng = np.random.default_rng(5)
    s = sp.random(500, 90, density=0.08, format="csr", random_state=rng, dtype=np.float32)
    a = CSRMatrix.from_scipy(s)
    g = rng.poisson(5.0, 500).astype(np.int32)
    norm = np.asarray(s.sum(axis=0), dtype=np.float64).ravel()
    images = {}
    for threads in (1, 2):
        be = CpuBackend(a, g, norm, dtype=np.float64, fp="numba", bp="numba", threads=threads)
        assert be.blocks == 64 and be.describe()["bp_path"] == "blocked scatter (64 blocks)"
        f = be.initial_image()
        for _ in range(5):
            f = be.iterate(f)
        images[threads] = f
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert np.array_equal(images[1], images[2])
    be16 = CpuBackend(a, g, norm, dtype=np.float64, fp="numba", bp="numba", blocks=16)
    f = be16.initial_image()
    for _ in range(5):
        f = be16.iterate(f)
    np.testing.assert_allclose(images[1], f, rtol=1e-12)


def test_a_graph_run_times_its_steps_over_iterations_launched_kernel_by_kernel():
    """_steps_kernel_by_kernel: after a run that replayed graphs (which time only the whole iteration), a few more
    iterations without them give the steps; the backend replays graphs again afterwards; none without graphs."""
    from mlemlib import mlem

    class Graphed:
        graph = True

        def __init__(self):
            self.eager_iterations = 0

        def use_graph(self, on):
            self.graph = on

        def iterate(self, f):
            self.eager_iterations += not self.graph
            return f + 1

        def last_step_times(self):
            return {"iteration": 4e-3} if self.graph else {"bp": 3e-3, "allreduce": 2e-3, "iteration": 5e-3}

    be = Graphed()
    got = mlem._steps_kernel_by_kernel(be, 0, iterations=20)
    assert be.graph and be.eager_iterations == mlem.STEP_SAMPLE_ITERATIONS
    assert got["allreduce"]["n"] == mlem.STEP_SAMPLE_ITERATIONS and got["allreduce"]["mean"] == pytest.approx(2e-3)
    assert got["bp"]["mean"] == pytest.approx(3e-3) and got["iteration"]["mean"] == pytest.approx(5e-3)
    assert mlem._steps_kernel_by_kernel(be, 0, iterations=2)["bp"]["n"] == 2  # never more than the run's
    assert mlem._steps_kernel_by_kernel(be, 0, iterations=0) is None
    be.graph = False
    assert mlem._steps_kernel_by_kernel(be, 0, iterations=20) is None and be.eager_iterations == 7
