"""MAP reconstruction through mlem reconstruct (BSREM, OSL) on the CPU backends, against independent float64 solutions.

The problem is test_prior's: 60 voxels on a 5x4x3 grid, 240 LORs in 8 subsets of 30 rows, ``m`` with gaps,
``b > 0``, the relative difference prior. The yardsticks are :mod:`mlemlib.map_reference`'s L-BFGS-B maximiser
of ``Phi`` (BSREM must converge to it) and the float64 reference of the same algorithm (reference_mode).
"""

from __future__ import annotations

import dataclasses

import h5py
import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib.errors import ConfigError
from mlemlib.formats import convert
from mlemlib.map import MapSettings
from mlemlib.map_reference import MapProblem, objective, solve_map
from mlemlib.mlem import reconstruct
from mlemlib.prior import make_prior
from mlemlib.problem import ModelSpec, RunSettings

GRID, N, M, S = (5, 4, 3), 60, 240, 8
RDP = MapSettings("rdp", beta=0.3, gamma=2.0, epsilon=2.0)
#: The same, each pass's image the mean of its sub-iterates.
MEAN = dataclasses.replace(RDP, averaging="pass")


#: The phantom's hot voxels (4 in a flat 1).
HOT = [7, 8, 12, 13, 27, 28]


def write_case(d):
    """Write the problem into ``d``: the matrix (float32 values; ``a.npz`` and the container ``a.h5`` with its
    grid), ``m.f32`` (about 10% gaps), ``b.f32`` (> 0 but in the gaps), ``subsets.i32`` (8 blocks of 30 LORs);
    return the float64 matrix, ``g``, ``m``, ``b`` and the true image."""
    rng = np.random.default_rng(7)
    a = sp.random(M, N, density=0.2, random_state=rng, data_rvs=lambda k: rng.uniform(0.1, 1, k)).tocsr()
    a = a.astype(np.float32).astype(np.float64)
    truth = np.ones(N)
    truth[HOT] = 4.0
    mult = rng.uniform(0.5, 1.5, M).astype(np.float32)
    mult[rng.random(M) < 0.1] = 0.0
    clean = 20 * mult * (a @ truth)
    add = np.where(mult > 0, 0.2 * clean[mult > 0].mean(), 0.0).astype(np.float32)
    g = rng.poisson(clean + add).astype(np.int32)
    sp.save_npz(d / "a.npz", a.astype(np.float32))
    convert(d / "a.npz", d / "a.h5", grid=GRID)
    mult.tofile(d / "m.f32")
    add.tofile(d / "b.f32")
    (np.arange(M) // (M // S)).astype("<i4").tofile(d / "subsets.i32")
    return a, g, mult, add, truth


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The matrix (float32 values) as a container with its grid, the same reordered, m, b, the subset file, g and
    the float64 maximiser of Phi."""
    d = tmp_path_factory.mktemp("map")
    a, g, mult, add, _ = write_case(d)
    prior = make_prior("rdp", GRID, beta=RDP.beta, gamma=RDP.gamma, epsilon=RDP.epsilon)
    problem = MapProblem(a, g.astype(np.float64), mult.astype(np.float64), add.astype(np.float64), prior)
    return {"dir": d, "g": g, "problem": problem, "map": solve_map(problem)}


def _model(case, prior, matrix=None):
    """The case's MAP model: its matrix (or ``matrix``), S subsets of its subset file, m, b and ``prior``."""
    d = case["dir"]
    return ModelSpec(d / "a.h5" if matrix is None else matrix, case["g"], subsets=S, subset_file=d / "subsets.i32",
                     multiplicative=d / "m.f32", additive=d / "b.f32", map=prior)


def _run(case, out, passes, prior=RDP, *, matrix=None, reference=None, checkpoint=None, keep_checkpoint=False,
         **settings):
    settings = RunSettings(passes, **{"backend": "cpu", "checkpoint_every": 0, **settings})
    t = reconstruct(_model(case, prior, matrix), settings, out, raw_out=False, reference=reference,
                    checkpoint=checkpoint, keep_checkpoint=keep_checkpoint)
    from mlemlib.image import read_image

    return read_image(out)[0].astype(np.float64), t


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_bsrem_converges_to_the_maximiser_and_phi_never_decreases(case, tmp_path):
    # one thread: on a 60-voxel image the kernels' parallel launches cost more than they save, most of all
    # on a loaded machine
    img, t = _run(case, tmp_path / "bsrem.h5", 2000, reference_mode=True, threads=1)
    assert rel(img, case["map"]) < 1e-3
    hist = t["map"]["history"]
    assert len(hist) == 2001 and hist[0]["pass"] == 0
    phi = np.array([h["phi"] for h in hist])
    assert np.all(np.diff(phi) >= -1e-9 * np.abs(phi[1:])), np.diff(phi).min()
    # the recorded objective is the independent reference's, up to its constant (sum log g! is left out)
    want = objective(case["problem"], img)
    assert abs((hist[-1]["phi"] - hist[-2]["phi"]) - 0.0) < 1e-6 * abs(want[0]) + 1e-6
    assert hist[-1]["prior"] == pytest.approx(want[2], rel=1e-9)


def test_float32_run_matches_the_float64_reference_of_the_same_algorithm(case, tmp_path):
    for algorithm in ("bsrem", "osl"):
        ms = MapSettings("rdp", beta=0.3, gamma=2.0, epsilon=2.0, algorithm=algorithm)
        ref, _ = _run(case, tmp_path / f"ref-{algorithm}.h5", 50, ms, reference_mode=True)
        img, t = _run(case, tmp_path / f"{algorithm}.h5", 50, ms)
        assert rel(img, ref) < 1e-5, algorithm
        assert t["map"]["algorithm"] == algorithm and t["backend"]["map"]["prior"] == "rdp"


def test_osl_with_subsets_stays_off_the_maximiser(case, tmp_path):
    ms = MapSettings("rdp", beta=0.3, gamma=2.0, epsilon=2.0, algorithm="osl")
    img, _ = _run(case, tmp_path / "osl.h5", 200, ms, reference_mode=True)
    assert rel(img, case["map"]) > 1e-2


def test_the_prior_follows_the_voxel_permutation(case, tmp_path):
    from mlemlib.reorder import reorder_file

    d = case["dir"]
    reorder_file(d / "a.h5", tmp_path / "r.h5", "rows+voxels", subsets=S, subset_file=d / "subsets.i32")
    plain, _ = _run(case, tmp_path / "plain.h5", 20, reference_mode=True)
    permuted, _ = _run(case, tmp_path / "perm.h5", 20, matrix=tmp_path / "r.h5", reference_mode=True)
    assert rel(permuted, plain) < 1e-10


def test_map_refuses_a_matrix_without_a_grid(case, tmp_path):
    with pytest.raises(ConfigError, match="no voxel grid"):
        _run(case, tmp_path / "x.h5", 1, matrix=case["dir"] / "a.npz")


def test_a_map_run_is_another_problem_than_osem(case, tmp_path):
    """The prior is part of the problem's fingerprint: OSEM's float64 reference is refused as MAP's."""
    reconstruct(_model(case, None), RunSettings(2, checkpoint_every=0, reference_mode=True), tmp_path / "osem.h5")
    with pytest.raises(ConfigError):
        _run(case, tmp_path / "map.h5", 2, reference=tmp_path / "osem.h5")


@pytest.mark.parametrize("bad,key", [(dict(algorithm="em"), "algorithm"), (dict(beta=-1.0), "beta"),
                                     (dict(epsilon=None), "epsilon"), (dict(relaxation=(0.0, 10.0)), "relaxation"),
                                     (dict(preconditioner_offset=-0.1), "preconditioner_offset"),
                                     (dict(preconditioner_offset=float("nan")), "preconditioner_offset"),
                                     (dict(averaging="mean"), "averaging"),
                                     (dict(algorithm="osl", averaging="pass"), "averaging")])
def test_bad_settings_are_refused_in_one_line(bad, key):
    kw = {**dict(prior="rdp", beta=0.3, gamma=2.0, epsilon=2.0), **bad}
    with pytest.raises(ConfigError, match=key):
        MapSettings(**kw).check()


@pytest.mark.gpu
@pytest.mark.parametrize("fp,bp", [("auto", "auto"), ("csr_vector", "csr_vector"), ("auto", "scatter"),
                                   ("auto", "onepass"), ("auto", "onepass_fixed"), ("auto", "onepass_chunked")])
@pytest.mark.parametrize("algorithm", ["bsrem", "osl"])
def test_cuda_map_matches_the_float64_reference_of_the_same_algorithm(case, tmp_path, fp, bp, algorithm):
    """Every kernel family on one GPU (the MAP step on the GPU's stream, inside the pass's graph where the kernels
    allow one): within 1e-5 after 50 passes; deterministic kernels give the same bits on a rerun."""
    ms = MapSettings("rdp", beta=0.3, gamma=2.0, epsilon=2.0, algorithm=algorithm)
    ref, _ = _run(case, tmp_path / "ref.h5", 50, ms, reference_mode=True, threads=1)
    settings = RunSettings(50, checkpoint_every=0, backend="cuda", fp=fp, bp=bp)

    def run(out):
        reconstruct(_model(case, ms), settings, out, raw_out=False)
        from mlemlib.image import read_image

        return read_image(out)[0]

    img = run(tmp_path / "a.h5")
    assert rel(img.astype(np.float64), ref) < 1e-5
    if bp in ("onepass_fixed", "onepass_chunked", "csr_vector"):
        assert np.array_equal(img, run(tmp_path / "b.h5"))


def test_the_command_line_runs_map_and_refuses_bad_options_in_one_line(case, tmp_path):
    import subprocess
    import sys

    d = case["dir"]
    case["g"].astype("<i4").tofile(tmp_path / "g.LMsino")
    base = [sys.executable, "-m", "mlemlib", "reconstruct", "-m", str(d / "a.h5"), "-s", str(tmp_path / "g.LMsino"),
            "-n", "3", "--subset-file", str(d / "subsets.i32"), "--subsets", str(S), "--multiplicative",
            str(d / "m.f32"), "--additive", str(d / "b.f32"), "-b", "cpu", "-k", "0", "-o", str(tmp_path / "cli.h5")]
    ok = subprocess.run(base + ["--prior", "rdp", "--beta", "0.3", "--epsilon", "2"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    want, t = _run(case, tmp_path / "api.h5", 3)
    from mlemlib.image import read_image

    assert np.array_equal(read_image(tmp_path / "cli.h5")[0], want.astype(np.float32))
    phi = [h["phi"] for h in t["map"]["history"]]  # the last line: the objective after the last pass, its change
    assert f", Phi {phi[-1]:.12g} ({phi[-1] - phi[-2]:+.3g} in the last pass)" in ok.stdout, ok.stdout
    mean = subprocess.run(base + ["--prior", "rdp", "--beta", "0.3", "--epsilon", "2", "--averaging", "pass"],
                          capture_output=True, text=True)
    assert mean.returncode == 0, mean.stderr
    want, _ = _run(case, tmp_path / "api-mean.h5", 3, MEAN)
    assert np.array_equal(read_image(tmp_path / "cli.h5")[0], want.astype(np.float32))
    for extra, option in ((["--prior", "rdp", "--epsilon", "2"], "--beta"), (["--beta", "1"], "--beta"),
                          (["--prior", "rdp", "--beta", "0.3", "--epsilon", "2", "--algorithm", "osl", "--averaging",
                            "pass"], "--averaging"),
                          (["--prior", "rdp", "--beta", "0.3"], "--epsilon"),
                          (["--prior", "quadratic", "--beta", "-1"], "--beta"),
                          (["--prior", "rdp", "--beta", "0.3", "--epsilon", "2", "--preconditioner-offset", "-1"],
                           "--preconditioner-offset")):
        bad = subprocess.run(base + extra, capture_output=True, text=True)
        assert bad.returncode == 2, (extra, bad.stderr)
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and option in lines[0], (extra, bad.stderr)


def test_a_resumed_run_continues_the_relaxation(case, tmp_path):
    """A BSREM run resumed from its checkpoint after pass 4 takes pass 5's relaxation: the uninterrupted image,
    bit for bit."""
    whole, _ = _run(case, tmp_path / "whole.h5", 6)
    ckpt = tmp_path / "ck.h5"
    _run(case, tmp_path / "half.h5", 4, checkpoint=ckpt, checkpoint_every=4, keep_checkpoint=True)
    with h5py.File(ckpt, "r") as f:
        assert int(f.attrs["iteration"]) == 4
    again, _ = _run(case, tmp_path / "again.h5", 6, checkpoint=ckpt)
    assert np.array_equal(whole, again)


@pytest.mark.parametrize("preconditioner,offset,averaging", [("hessian", 0.0, "last"), ("em", 0.3, "last"),
                                                              ("hessian", 0.3, "last"), ("hessian", 0.35, "pass")])
def test_other_preconditioners_converge_to_the_same_maximiser(case, tmp_path, preconditioner, offset, averaging):
    """BSREM with the preconditioner f / (s + beta f H), or with f + delta in place of f (delta = 0.3 of the
    initial image's value), or giving each pass's mean image: Phi never decreases and the image reaches the
    L-BFGS-B maximiser (2000 passes, float64), as with f / s; the settings name another problem."""
    ms = MapSettings("rdp", beta=0.3, gamma=2.0, epsilon=2.0, preconditioner=preconditioner,
                     preconditioner_offset=offset, averaging=averaging)
    img, t = _run(case, tmp_path / "h.h5", 2000, ms, reference_mode=True, threads=1)
    assert rel(img, case["map"]) < 1e-3
    phi = np.array([h["phi"] for h in t["map"]["history"]])
    assert np.all(np.diff(phi) >= -1e-9 * np.abs(phi[1:])), np.diff(phi).min()
    assert (t["map"]["preconditioner"], t["map"]["preconditioner_offset"]) == (preconditioner, offset)
    assert t["map"]["averaging"] == averaging
    assert ms.identity() != RDP.identity()



def test_the_pass_image_is_the_mean_of_its_sub_iterates(case, tmp_path, monkeypatch):
    """With averaging: pass, a pass's image is the mean of the S images its sub-iterations leave (recorded here
    after each MAP step), and Phi is recorded for it; the sub-iterations themselves are those of averaging:
    last (the same last sub-iterate, bit for bit)."""
    from mlemlib.map import MapBackend

    subs = []
    step = MapBackend._step

    def spy(self, f, *args):
        step(self, f, *args)
        subs.append(np.array(f, dtype=np.float64))

    monkeypatch.setattr(MapBackend, "_step", spy)
    img, t = _run(case, tmp_path / "mean.h5", 2, MEAN, reference_mode=True, threads=1)
    assert len(subs) == 2 * S
    np.testing.assert_allclose(img, np.mean(subs[S:], axis=0), rtol=1e-13, atol=0)
    assert rel(img, subs[-1]) > 1e-3  # the mean is not the last sub-iterate
    assert t["map"]["history"][-1]["phi"] == pytest.approx(objective(case["problem"], img)[0], rel=1e-12)
    last, _ = _run(case, tmp_path / "last.h5", 2, reference_mode=True, threads=1)
    assert np.array_equal(last, subs[-1])


def test_the_pass_mean_is_nearer_the_maximiser_than_the_last_sub_iterate(case, tmp_path):
    """Under a constant relaxation BSREM with subsets ends in a limit cycle around the maximiser; the mean of a
    pass's sub-iterates cancels much of it (on this problem 0.013 from the maximiser where the last sub-iterate
    is 0.020, lambda = 0.5, 50 passes, float64)."""
    const = dataclasses.replace(RDP, relaxation=(0.5, 1e12))
    last, _ = _run(case, tmp_path / "a.h5", 50, const, reference_mode=True, threads=1)
    mean, _ = _run(case, tmp_path / "b.h5", 50, dataclasses.replace(const, averaging="pass"), reference_mode=True,
                   threads=1)
    assert rel(mean, case["map"]) < 0.75 * rel(last, case["map"])


def test_a_resumed_run_with_the_pass_mean_is_the_uninterrupted_run(case, tmp_path):
    """The checkpoint keeps the iterate the next pass starts from (the last sub-iterate, not the mean): a run
    resumed after pass 4 gives the uninterrupted run's mean image, bit for bit, in float32."""
    whole, _ = _run(case, tmp_path / "whole.h5", 6, MEAN)
    ckpt = tmp_path / "ck.h5"
    _run(case, tmp_path / "half.h5", 4, MEAN, checkpoint=ckpt, checkpoint_every=4, keep_checkpoint=True)
    last, _ = _run(case, tmp_path / "last.h5", 4)
    with h5py.File(ckpt, "r") as f:
        assert int(f.attrs["iteration"]) == 4
        assert np.array_equal(f["image"][...].astype(np.float64), last)
    again, _ = _run(case, tmp_path / "again.h5", 6, MEAN, checkpoint=ckpt)
    assert np.array_equal(whole, again)


def test_float32_pass_mean_matches_the_float64_reference(case, tmp_path):
    ms = dataclasses.replace(MEAN, preconditioner="hessian", preconditioner_offset=0.35, relaxation=(1.0, 20.0))
    ref, _ = _run(case, tmp_path / "ref.h5", 50, ms, reference_mode=True)
    img, t = _run(case, tmp_path / "img.h5", 50, ms)
    assert rel(img, ref) < 1e-5
    assert t["map"]["averaging"] == "pass"


def test_the_offset_changes_the_step_and_zero_is_no_offset(case, tmp_path):
    """An offset of 0 is the preconditioner without one (the same problem, the same bits); a positive one
    takes larger steps where the image is small: after 5 passes its image differs, by more than rounding."""
    zero = dataclasses.replace(RDP, preconditioner_offset=0.0)
    assert zero.identity() == RDP.identity()
    plain, _ = _run(case, tmp_path / "a.h5", 5, RDP, reference_mode=True, threads=1)
    again, _ = _run(case, tmp_path / "b.h5", 5, zero, reference_mode=True, threads=1)
    assert np.array_equal(plain, again)
    moved, _ = _run(case, tmp_path / "c.h5", 5, dataclasses.replace(RDP, preconditioner_offset=0.3),
                    reference_mode=True, threads=1)
    assert rel(moved, plain) > 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("preconditioner", ["em", "hessian"])
def test_cuda_map_with_an_offset_matches_the_float64_reference(case, tmp_path, preconditioner):
    """The offset in the GPU step (inside the pass's graph): within 1e-5 of the float64 run of the same settings
    after 50 passes, the same bits on a rerun."""
    ms = MapSettings("rdp", beta=0.3, gamma=2.0, epsilon=2.0, preconditioner=preconditioner,
                     preconditioner_offset=0.3)
    ref, _ = _run(case, tmp_path / "ref.h5", 50, ms, reference_mode=True, threads=1)
    settings = RunSettings(50, checkpoint_every=0, backend="cuda")
    from mlemlib.image import read_image

    imgs = []
    for name in ("a.h5", "b.h5"):
        t = reconstruct(_model(case, ms), settings, tmp_path / name, raw_out=False)
        imgs.append(read_image(tmp_path / name)[0])
    assert t["backend"]["map"]["step"] == "device" and t["map"]["preconditioner_offset"] == 0.3
    assert rel(imgs[0].astype(np.float64), ref) < 1e-5
    assert np.array_equal(imgs[0], imgs[1])


def test_the_cpu_objective_uses_the_backends_forward_projection(case, tmp_path, monkeypatch):
    """On the CPU, Phi per pass comes from the backend's own forward projection (no float64 copy of the matrix,
    so no size limit): with the copy's limit at 0 the history is still recorded and is the independent objective."""
    import mlemlib.map as mapmod

    monkeypatch.setattr(mapmod, "OBJECTIVE_NNZ_MAX", 0)
    img, t = _run(case, tmp_path / "a.h5", 5, reference_mode=True, threads=1)
    hist = t["map"]["history"]
    assert len(hist) == 6
    want = objective(case["problem"], img)
    assert hist[-1]["prior"] == pytest.approx(want[2], rel=1e-12)
    assert hist[-1]["log_likelihood"] == pytest.approx(want[1], rel=1e-12)
    assert hist[-1]["phi"] == pytest.approx(want[0], rel=1e-12)


def test_the_gpu_step_takes_the_subsets_norms_and_forms_one_over_s():
    """The GPU step is given the (S, n) update norms (NaN: the subset does not see the voxel) or S = 1's (n,)
    norm; 1 / s sums the seen ones (0 where no subset sees the voxel). Built without a GPU."""
    from mlemlib._map_cuda import DeviceMapStep

    prior = make_prior("rdp", (3, 1, 1), beta=0.3, gamma=2.0, epsilon=2.0)
    nan = np.nan
    norms = np.array([[1.0, nan, 0.0], [3.0, 0.5, nan]])
    step = DeviceMapStep("bsrem", prior, 0.3, norms, 1e-6)
    assert step.subsets == 2
    np.testing.assert_array_equal(step._inv_s, np.float32([0.25, 2.0, 0.0]))
    one = DeviceMapStep("osl", prior, 0.3, np.array([2.0, 4.0, 0.0]), 0.0)
    assert one.subsets == 1
    np.testing.assert_array_equal(one._inv_s, np.float32([0.5, 0.25, 0.0]))



def test_the_gpu_step_holds_every_group_sizes_summed_norms_and_refuses_another_size():
    """The step's norms hold, for each group size it was made with, the sub-iterations' summed norms (a NaN, not
    seen, counts as nothing; NaN where no subset of the group sees the voxel) from the row the device's state
    names; a size it was not made with, or one that does not divide S, is refused in one line."""
    from mlemlib._map_cuda import DeviceMapStep

    prior = make_prior("rdp", (3, 1, 1), beta=0.3, gamma=2.0, epsilon=2.0)
    nan = np.nan
    norms = np.array([[1.0, nan, 0.5], [2.0, nan, 0.25], [4.0, 1.0, nan], [8.0, 2.0, nan]])
    step = DeviceMapStep("bsrem", prior, 0.3, norms, 1e-6, groups=[2, 4])
    assert step.groups == (1, 2, 4) and step._base == {1: 0, 2: 4, 4: 6}
    want = np.array([*norms, [3.0, nan, 0.75], [12.0, 3.0, nan], [15.0, 3.0, 0.75]], dtype=np.float32)
    np.testing.assert_array_equal(step.merged_norms(), want)
    # what each launch does (add its bp first / after others, update, update with the sum), its sub-iteration,
    # its norm's row and the pass's sub-iterations
    np.testing.assert_array_equal(step.steps(1), [[2, k, k, 4] for k in range(4)])
    np.testing.assert_array_equal(step.steps(2), [[0, 0, 4, 2], [3, 0, 4, 2], [0, 1, 5, 2], [3, 1, 5, 2]])
    np.testing.assert_array_equal(step.steps(4), [[0, 0, 6, 1], [1, 0, 6, 1], [1, 0, 6, 1], [3, 0, 6, 1]])
    # on the user's grid (what each GPU holds): with a voxel permutation, column j' of the backend's order lands on
    # the user's voxel pos[j']
    pos = np.array([2, 0, 1])
    permuted = DeviceMapStep("bsrem", make_prior("rdp", (3, 1, 1), beta=0.3, gamma=2.0, epsilon=2.0, voxels=pos),
                             0.3, norms, 1e-6, groups=[2, 4])
    np.testing.assert_array_equal(permuted._user_norms[:, pos], want)
    np.testing.assert_array_equal(step._user_norms, want)
    step.set_group(4)  # no GPU prepared: only the step's own value
    assert step.group == 4
    with pytest.raises(ConfigError, match="prepared for 1, 2, 4"):
        step.set_group(8)
    with pytest.raises(ConfigError, match="S = 4 must be divisible by it"):
        DeviceMapStep("bsrem", prior, 0.3, norms, 1e-6, groups=[3])

HALVING = dataclasses.replace(RDP, subset_halving=(1, 2))


def test_a_halved_pass_is_the_step_over_two_subsets_rows(case, tmp_path, monkeypatch):
    """With subset_halving (1, 2) and 8 subsets, pass 1 runs 8 sub-iterations, pass 2 four (each over the rows of
    two neighbouring subsets) and pass 3 two: pass 2 is, to rounding, the BSREM step computed here by hand from
    pass 1's image with map_reference's float64 gradients over those rows (S' = 4, the bound nu)."""
    from mlemlib.map import FLOOR, MapBackend
    from mlemlib.map_reference import gradient

    calls = []
    step = MapBackend._step

    def spy(self, f, prev, grad, curv, ks, *args):
        calls.append((self.passes, tuple(ks)))
        step(self, f, prev, grad, curv, ks, *args)

    monkeypatch.setattr(MapBackend, "_step", spy)
    _run(case, tmp_path / "h3.h5", 3, HALVING, reference_mode=True, threads=1)
    assert [ks for p, ks in calls if p == 0] == [(k,) for k in range(8)]
    assert [ks for p, ks in calls if p == 1] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [ks for p, ks in calls if p == 2] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    monkeypatch.setattr(MapBackend, "_step", step)
    one, _ = _run(case, tmp_path / "h1.h5", 1, HALVING, reference_mode=True, threads=1)
    two, _ = _run(case, tmp_path / "h2.h5", 2, HALVING, reference_mode=True, threads=1)
    problem = case["problem"]
    s = problem.sensitivity()
    live = s > 0
    nu = FLOOR * problem.g.sum() / s.sum()
    lam = 1.0 / (1.0 + 1 / 10.0)  # pass 2's relaxation (n = 1)
    f = one.copy()
    rows = M // 4
    for j in range(4):
        grad = 4 * gradient(problem, f, slice(j * rows, (j + 1) * rows)) - problem.beta * problem.prior_gradient(f)
        f = np.where(live, np.maximum(nu, f + lam * np.divide(f, s, out=np.zeros_like(s), where=live) * grad), 0)
    assert rel(two, f) < 1e-12
    assert rel(two, _run(case, tmp_path / "plain.h5", 2, reference_mode=True, threads=1)[0]) > 1e-4


def test_bsrem_with_subset_halving_converges_to_the_maximiser(case, tmp_path):
    """Halving after passes 100, 200 and 400 (8 -> 4 -> 2 -> 1 subsets): the maximiser after 2000 passes, Phi never
    decreasing; the float32 run within 1e-5 of its float64 reference; the schedule names another problem."""
    ms = dataclasses.replace(RDP, subset_halving=(100, 200, 400))
    img, t = _run(case, tmp_path / "h.h5", 2000, ms, reference_mode=True, threads=1)
    assert rel(img, case["map"]) < 1e-3
    phi = np.array([h["phi"] for h in t["map"]["history"]])
    assert np.all(np.diff(phi) >= -1e-9 * np.abs(phi[1:])), np.diff(phi).min()
    assert t["map"]["subset_halving"] == [100, 200, 400] and ms.identity() != RDP.identity()
    fast = dataclasses.replace(RDP, subset_halving=(5, 10, 20), averaging="pass")
    ref, _ = _run(case, tmp_path / "r.h5", 30, fast, reference_mode=True)
    img, _ = _run(case, tmp_path / "f.h5", 30, fast)
    assert rel(img, ref) < 1e-5


@pytest.mark.parametrize("bad,key", [(dict(subset_halving=(0,)), "subset_halving"),
                                     (dict(subset_halving=(5, 5)), "subset_halving"),
                                     (dict(subset_halving=(True,)), "subset_halving"),
                                     (dict(algorithm="osl", subset_halving=(5,)), "subset_halving")])
def test_bad_subset_schedules_are_refused_in_one_line(bad, key):
    with pytest.raises(ConfigError, match=key):
        MapSettings(**{**dict(prior="rdp", beta=0.3, gamma=2.0, epsilon=2.0), **bad}).check()


def test_a_schedule_the_subsets_cannot_follow_is_refused(case, tmp_path):
    """8 subsets halve three times at most: the command line refuses a fourth in one line, for either backend,
    before any work."""
    import subprocess
    import sys

    with pytest.raises(ConfigError, match="subset_halving: 4 halvings of 8 subsets"):
        _run(case, tmp_path / "x.h5", 2, dataclasses.replace(RDP, subset_halving=(1, 2, 3, 4)))
    d = case["dir"]
    case["g"].astype("<i4").tofile(tmp_path / "g.LMsino")
    base = [sys.executable, "-m", "mlemlib", "reconstruct", "-m", str(d / "a.h5"), "-s", str(tmp_path / "g.LMsino"),
            "-n", "3", "--subset-file", str(d / "subsets.i32"), "--subsets", str(S), "-k", "0", "-o",
            str(tmp_path / "cli.h5"), "--prior", "rdp", "--beta", "0.3", "--epsilon", "2"]
    for extra, fault in ((["-b", "cpu", "--subset-halving", "1", "2", "3", "4"], "4 halvings of 8 subsets"),
                         (["-b", "cuda", "--subset-halving", "1", "2", "3", "4"], "4 halvings of 8 subsets")):
        bad = subprocess.run(base + extra, capture_output=True, text=True)
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and "--subset-halving" in lines[0] and fault in lines[0], (
            bad.stderr)


class _StepBackend:
    """A stand-in for a GPU backend that takes the MAP step as its update (the CPU-side logic of the device path):
    it records the step it is handed and each pass, and reports a fixed pass time."""

    shape = (4, 6)

    def __init__(self) -> None:
        self.handed: list[int] = []  # the step's group each time the step is handed over

    def takes_image_step(self) -> bool:
        return True

    def set_image_step(self, step) -> None:
        self.handed.append(step.group)

    def _initial_value(self) -> float:
        return 1.0

    def iterate(self, f):
        return f

    def last_step_times(self) -> dict:
        return {"iteration": 0.001}

    def synchronize(self) -> None:
        pass


def test_on_the_gpu_path_the_subsets_halve_at_their_passes_without_a_new_capture():
    """With the step on the GPUs, each halving sets the step's group (subsets per sub-iteration) at the pass after
    each listed one, and only then; the step is handed to the backend once (its pass captured once: the launches
    read the group on the device), and no pass's time holds more than the backend's pass."""
    from mlemlib.map import MapBackend

    inner = _StepBackend()
    norm = np.ones((8, 6))
    mb = MapBackend(inner, dataclasses.replace(RDP, subset_halving=(2, 3, 5)), None, norm)
    assert mb.device_step.groups == (1, 2, 4, 8)
    lams: list[float] = []
    mb.device_step.set_relaxation = lams.append  # (a device value on a GPU)
    groups, times = [], []
    f = np.ones(6, dtype=np.float32)
    for _ in range(7):
        f = mb.iterate(f)
        groups.append(mb.device_step.group)
        times.append(mb.last_step_times())
    assert groups == [1, 1, 2, 4, 4, 8, 8]
    assert lams == pytest.approx([1.0 / (1.0 + n / 10.0) for n in range(7)])
    assert inner.handed == [1]  # at construction only
    assert times == [{"iteration": 0.001}] * 7
    mb.resume_at(0)  # a run started over: S subsets per pass again
    mb.iterate(f)
    assert mb.device_step.group == 1 and inner.handed == [1]
