"""The priors of MAP reconstruction (mlemlib.prior), the float64 MAP references (mlemlib.map_reference) and
``mlem convert --grid``: against brute force over all voxel pairs, finite differences, hand-computed cases
and an independent L-BFGS-B solution of the MAP objective."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib.errors import ConfigError
from mlemlib.map_reference import MapProblem, PairPrior, bsrem, gradient, objective, osl, solve_map
from mlemlib.prior import make_prior, neighbour_pairs, read_kappa, require_grid

# --------------------------------------------------------------------------- brute force

GRIDS = [(1, 1, 1), (3, 1, 1), (1, 4, 1), (1, 1, 3), (3, 2, 1), (2, 1, 3), (1, 3, 2), (2, 3, 4), (4, 3, 3)]


def brute_pairs(grid):
    """Every pair of voxels j < k, kept where the voxels touch (Chebyshev distance 1), with 1/distance."""
    nx, ny, nz = grid
    coords = [(x, y, z) for z in range(nz) for y in range(ny) for x in range(nx)]  # j = x + nx*(y + ny*z)
    out = []
    for j, k in itertools.combinations(range(len(coords)), 2):
        d = [abs(a - b) for a, b in zip(coords[j], coords[k])]
        if max(d) == 1:
            out.append((j, k, 1.0 / math.sqrt(sum(v * v for v in d))))
    return out


def brute_value(f, grid, kind, gamma=0.0, eps=0.0, kappa=None):
    kappa = np.ones(len(f)) if kappa is None else kappa
    total = 0.0
    for j, k, w in brute_pairs(grid):
        a, b = float(f[j]), float(f[k])
        phi = 0.5 * (a - b) ** 2 if kind == "quadratic" else (a - b) ** 2 / (a + b + gamma * abs(a - b) + eps)
        total += float(kappa[j]) * float(kappa[k]) * w * phi
    return total


def fd_gradient(fun, f, h=1e-6):
    g = np.empty_like(f)
    for j in range(f.size):
        e = np.zeros_like(f)
        e[j] = h * max(1.0, abs(f[j]))
        g[j] = (fun(f + e) - fun(f - e)) / (2 * e[j])
    return g


CASES = [("rdp", 2.0, 0.1), ("rdp", 0.0, 0.5), ("quadratic", 2.0, None)]


def test_pairs_are_the_26_neighbourhood_once():
    for grid in GRIDS:
        j, k, w = neighbour_pairs(grid)
        got = sorted(zip(j.tolist(), k.tolist(), w.tolist()))
        want = sorted(brute_pairs(grid))
        assert [p[:2] for p in got] == [p[:2] for p in want], grid
        np.testing.assert_allclose([p[2] for p in got], [p[2] for p in want], rtol=1e-15)
    # a 3x3x3 grid: 3 axes x 18 + 6 face diagonals x 12 + 4 space diagonals x 8 pairs
    assert len(neighbour_pairs((3, 3, 3))[0]) == 3 * 18 + 6 * 12 + 4 * 8


@pytest.mark.parametrize("kind,gamma,eps", CASES)
@pytest.mark.parametrize("grid", GRIDS)
def test_value_and_gradient_match_brute_force(grid, kind, gamma, eps, rng):
    n = math.prod(grid)
    f = rng.uniform(0.0, 3.0, n)
    f[rng.random(n) < 0.2] = 0.0  # zeros: the RDP's denominator is epsilon there
    kappa = rng.uniform(0.2, 2.0, n)
    p = make_prior(kind, grid, beta=1.0, gamma=gamma, epsilon=eps, kappa=kappa)
    k32 = kappa.astype(np.float32).astype(np.float64)  # the prior keeps kappa in float32
    want = brute_value(f, grid, kind, gamma, eps or 0.0, k32)
    assert p.value(f) == pytest.approx(want, rel=1e-12, abs=1e-300)
    fd = fd_gradient(lambda x: brute_value(x, grid, kind, gamma, eps or 0.0, k32), f)
    np.testing.assert_allclose(p.gradient(f), fd, rtol=1e-6, atol=1e-7 * max(1.0, np.abs(fd).max()))
    pairs = PairPrior(p)  # the reference's vectorised pair list agrees with the stencil to rounding
    assert pairs.value(f) == pytest.approx(p.value(f), rel=1e-12, abs=1e-300)
    np.testing.assert_allclose(pairs.gradient(f), p.gradient(f), rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("kind,gamma,eps", CASES)
def test_curvature_is_the_derivative_of_the_gradient(kind, gamma, eps, rng):
    grid = (3, 2, 2)
    f = rng.uniform(0.1, 3.0, 12)
    p = make_prior(kind, grid, beta=1.0, gamma=gamma, epsilon=eps, kappa=rng.uniform(0.5, 1.5, 12))
    h = 1e-6
    fd = np.array([(p.gradient(f + h * e)[j] - p.gradient(f - h * e)[j]) / (2 * h) for j, e in enumerate(np.eye(12))])
    np.testing.assert_allclose(p.curvature(f), fd, rtol=1e-6, atol=1e-8)
    assert (p.curvature(f) >= 0).all()  # both priors are convex


def test_quadratic_prior_by_hand():
    # 2x2x1, x fastest: f(0,0) = 1, f(1,0) = 2, f(0,1) = 3, f(1,1) = 5; four edges (w = 1), two diagonals (1/sqrt 2)
    f = np.array([1.0, 2.0, 3.0, 5.0])
    p = make_prior("quadratic", (2, 2, 1), beta=1.0)
    edges = (1**2 + 2**2 + 2**2 + 3**2) / 2  # pairs (0,1), (2,3), (0,2), (1,3)
    diagonals = (4**2 + 1**2) / 2 / math.sqrt(2)  # pairs (0,3), (1,2)
    assert p.value(f) == pytest.approx(edges + diagonals, rel=1e-15)
    s2 = 1 / math.sqrt(2)
    want = [(1 - 2) + (1 - 3) + s2 * (1 - 5), (2 - 1) + (2 - 5) + s2 * (2 - 3),
            (3 - 1) + (3 - 5) + s2 * (3 - 2), (5 - 2) + (5 - 3) + s2 * (5 - 1)]  # fmt: skip
    np.testing.assert_allclose(p.gradient(f), want, rtol=1e-15)
    np.testing.assert_allclose(p.curvature(f), [2 + s2] * 4, rtol=1e-15)


def test_rdp_by_hand():
    # two voxels, f = (1, 3), gamma 2, epsilon 1: d = -2, denominator 1 + 3 + 2*2 + 1 = 9
    p = make_prior("rdp", (2, 1, 1), beta=1.0, gamma=2.0, epsilon=1.0)
    f = np.array([1.0, 3.0])
    assert p.value(f) == pytest.approx(4 / 9, rel=1e-15)
    # d phi / da = 2d/D - d^2 (1 + gamma sign d) / D^2 = -4/9 + 4/81; d phi / db = -2d/D - d^2 (1 - gamma sign d) / D^2
    np.testing.assert_allclose(p.gradient(f), [-4 / 9 + 4 / 81, 4 / 9 - 12 / 81], rtol=1e-14)
    assert p.value(np.array([2.0, 2.0])) == 0.0


def test_one_voxel_and_flat_images_have_no_penalty():
    p = make_prior("rdp", (1, 1, 1), beta=1.0, epsilon=0.1)
    assert p.value(np.array([3.0])) == 0.0 and p.gradient(np.array([3.0]))[0] == 0.0
    p = make_prior("rdp", (3, 2, 2), beta=1.0, epsilon=0.1)
    flat = np.full(12, 2.5, dtype=np.float32)
    assert p.value(flat) == 0.0 and not p.gradient(flat).any()


def test_float32_images_accumulate_in_float64(rng):
    grid = (7, 5, 3)
    f32 = rng.uniform(0.0, 4.0, 105).astype(np.float32)
    p = make_prior("rdp", grid, beta=1.0, epsilon=1e-3)
    assert p.value(f32) == p.value(f32.astype(np.float64))  # widened as read, the same float64 terms
    g32 = p.gradient(f32)
    assert g32.dtype == np.float32
    np.testing.assert_array_equal(g32, p.gradient(f32.astype(np.float64)).astype(np.float32))  # rounded once
    out = np.empty_like(f32)
    assert p.gradient(f32, out=out) is out


def test_results_do_not_depend_on_the_thread_count(rng):
    import numba

    grid = (40, 30, 9)  # 10800 voxels: several blocks of the value's sum
    f = rng.uniform(0.0, 2.0, math.prod(grid)).astype(np.float32)
    p = make_prior("rdp", grid, beta=1.0, epsilon=1e-2)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        v1, g1 = p.value(f), p.gradient(f)
        numba.set_num_threads(max(2, before))
        v2, g2 = p.value(f), p.gradient(f)
    finally:
        numba.set_num_threads(before)
    assert v1 == v2
    np.testing.assert_array_equal(g1, g2)


# --------------------------------------------------------------------------- kappa and the permuted order


def test_kappa_weights_each_pair_by_both_ends(rng):
    grid = (3, 3, 2)
    f = rng.uniform(0.5, 2.0, 18)
    kappa = np.ones(18)
    kappa[4] = 0.0  # voxel 4 leaves the prior: no pair with it counts
    p = make_prior("rdp", grid, beta=1.0, epsilon=0.1, kappa=kappa)
    want = sum(w * (f[j] - f[k]) ** 2 / (f[j] + f[k] + 2 * abs(f[j] - f[k]) + 0.1)
               for j, k, w in brute_pairs(grid) if 4 not in (j, k))  # fmt: skip
    assert p.value(f) == pytest.approx(want, rel=1e-12)
    assert p.gradient(f)[4] == 0.0
    unit = make_prior("rdp", grid, beta=1.0, epsilon=0.1)
    assert make_prior("rdp", grid, beta=1.0, epsilon=0.1, kappa=np.full(18, 2.0)).value(f) == pytest.approx(4 * unit.value(f))


@pytest.mark.parametrize("kind", ["rdp", "quadratic"])
def test_permuted_voxel_order(kind, rng):
    """A prior built with the matrix's voxel permutation acts on the user's grid while taking and giving images in
    the stored order: f'[j'] = f[voxels[j']], gradient'[j'] = gradient[voxels[j']]."""
    from mlemlib.permutation import Permutation, image_to_permuted_order, image_to_user_order

    grid = (4, 3, 3)
    n = 36
    voxels = rng.permutation(n)
    perm = Permutation(np.arange(5), voxels, "rows+voxels", (5, n), 0, "")
    f_user = rng.uniform(0.0, 3.0, n).astype(np.float32)
    kappa = rng.uniform(0.5, 1.5, n)  # in the user's order
    user = make_prior(kind, grid, beta=1.0, epsilon=0.05, kappa=kappa)
    stored = make_prior(kind, grid, beta=1.0, epsilon=0.05, kappa=kappa, voxels=perm.voxels)
    f_perm = image_to_permuted_order(f_user, perm)
    assert stored.value(f_perm) == pytest.approx(user.value(f_user), rel=1e-12)
    np.testing.assert_array_equal(image_to_user_order(stored.gradient(f_perm), perm), user.gradient(f_user))
    np.testing.assert_array_equal(image_to_user_order(stored.curvature(f_perm), perm), user.curvature(f_user))
    # the reference's pair list follows the permutation too
    np.testing.assert_allclose(PairPrior(stored).gradient(f_perm.astype(np.float64)),
                               stored.gradient(f_perm.astype(np.float64)), rtol=1e-11, atol=1e-13)  # fmt: skip


@pytest.mark.parametrize("kind", ["rdp", "quadratic"])
def test_gradient_and_curvature_in_one_pass_are_the_separate_ones(kind, rng):
    """BSREM's hessian preconditioner takes both stencils from one pass over the neighbours on the CPU: the same
    bits as gradient() and curvature() alone (kappa and a voxel permutation; float32 and float64 images), and both
    against the pair list's float64 gradient."""
    grid = (5, 4, 3)
    n = 60
    kappa = rng.uniform(0.5, 1.5, n)
    prior = make_prior(kind, grid, beta=1.0, gamma=2.0, epsilon=0.05, kappa=kappa, voxels=rng.permutation(n))
    for dtype in (np.float32, np.float64):
        f = rng.uniform(0.0, 3.0, n).astype(dtype)
        grad, curv = prior.gradient_and_curvature(f)
        assert grad.dtype == curv.dtype == dtype
        np.testing.assert_array_equal(grad, prior.gradient(f))
        np.testing.assert_array_equal(curv, prior.curvature(f))
    f64 = f.astype(np.float64)
    np.testing.assert_allclose(prior.gradient_and_curvature(f64)[0], PairPrior(prior).gradient(f64), rtol=1e-11,
                               atol=1e-13)


def test_read_kappa_files(tmp_path):
    import h5py

    k = np.linspace(0.0, 2.0, 24, dtype=np.float32)
    raw = tmp_path / "kappa.f32"
    k.tofile(raw)
    np.testing.assert_array_equal(read_kappa(raw, 24), k)
    with h5py.File(tmp_path / "k.h5", "w") as f:
        f["maps/kappa"] = k.reshape(4, 3, 2).astype(np.float64)
        f["other"] = np.zeros(3)
    np.testing.assert_array_equal(read_kappa(f"{tmp_path}/k.h5:/maps/kappa", 24), k)
    p = make_prior("rdp", (2, 3, 4), beta=1, epsilon=1, kappa=raw)
    np.testing.assert_array_equal(p.kappa, k)

    def fault(spec, n=24):
        with pytest.raises(ConfigError) as exc:
            read_kappa(spec, n)
        msg = str(exc.value)
        assert "\n" not in msg and msg.startswith(str(spec))
        return msg

    assert "25" in fault(raw, 25) and "24 kappa values" in fault(raw, 25)
    (tmp_path / "odd.f32").write_bytes(b"\0" * 10)
    assert "multiple of 4" in fault(tmp_path / "odd.f32")
    bad = k.copy()
    bad[5] = np.nan
    bad.tofile(tmp_path / "nan.f32")
    assert "NaN" in fault(tmp_path / "nan.f32") and "voxel 5" in fault(tmp_path / "nan.f32")
    bad[5] = -1
    bad.tofile(tmp_path / "neg.f32")
    assert "negative kappa -1.0 at voxel 5" in fault(tmp_path / "neg.f32")
    assert "no such kappa file" in fault(tmp_path / "missing.f32")
    assert "holds 2 datasets" in fault(tmp_path / "k.h5")


def test_parameters_are_checked_in_one_line():
    def fault(**kw):
        args = {"kind": "rdp", "grid": (2, 2, 2), "beta": 1.0, "epsilon": 0.1} | kw
        with pytest.raises(ConfigError) as exc:
            make_prior(args.pop("kind"), args.pop("grid"), **args)
        assert "\n" not in str(exc.value)
        return exc.value.source, exc.value.fault

    assert fault(beta=-1)[0] == "prior.beta"
    assert fault(beta=float("nan"))[0] == "prior.beta"
    assert fault(gamma=-0.5)[0] == "prior.gamma"
    assert fault(epsilon=0)[0] == "prior.epsilon"
    assert fault(epsilon=None)[0] == "prior.epsilon"
    assert fault(kind="tv")[0] == "prior.type"
    assert fault(grid=(2, 0, 2))[0] == "prior.grid"
    assert fault(kappa=np.ones(7)) == ("prior.kappa", "7 kappa values, expected one per voxel (8, the matrix's columns)")
    assert fault(voxels=np.array([0, 1, 2, 3, 4, 5, 6, 6]))[0] == "prior.voxels"
    make_prior("quadratic", (2, 2, 2), beta=0.0)  # no epsilon needed; beta 0 allowed
    with pytest.raises(ConfigError, match="expected a vector of 8 voxels"):
        make_prior("quadratic", (2, 2, 2), beta=1.0).value(np.ones(9))


# --------------------------------------------------------------------------- the grid of a matrix


def _npz(tmp_path, n=24):
    path = tmp_path / "a.npz"
    sp.save_npz(path, sp.random(10, n, density=0.3, random_state=1, format="csr", dtype=np.float32))
    return path


def test_convert_records_a_grid(tmp_path, capsys):
    from mlemlib.cli import main
    from mlemlib.formats.h5 import MatrixH5

    src = _npz(tmp_path)
    out = tmp_path / "m.h5"
    with pytest.raises(ConfigError, match=r"a.npz: has no voxel grid, which a prior needs: record one with 'mlem convert"):
        require_grid(src)
    assert main(["convert", str(src), "--grid", "2", "3", "4", "--voxel-size", "1", "1", "2.5", "--out", str(out)]) == 0
    with MatrixH5(out) as f:
        assert (f.grid, f.voxel_size) == ((2, 3, 4), (1.0, 1.0, 2.5))
    assert require_grid(out) == (2, 3, 4)
    # a compressed container without a grid gets one too (its values copied bit for bit)
    plain, comp = tmp_path / "plain.h5", tmp_path / "c.h5"
    assert main(["convert", str(src), "--format", "compressed", "--out", str(plain)]) == 0
    assert main(["convert", str(plain), "--grid", "4", "3", "2", "--out", str(comp)]) == 0
    assert require_grid(comp) == (4, 3, 2)
    capsys.readouterr()
    for argv, words in [
        (["--grid", "2", "3", "5"], "a.npz: --grid 2x3x5 = 30 voxels, but the matrix has n = 24 columns"),
        (["--voxel-size", "1", "1", "1"], "a.npz: --voxel-size without a grid: give --grid NX NY NZ as well"),
        (["--grid", "2", "3", "4", "--voxel-size", "1", "-1", "1"], "a.npz: --voxel-size [1.0, -1.0, 1.0], expected three"),
        (["--grid", "2", "3", "4", "--fold"], "--grid: not with --fold"),
    ]:
        assert main(["convert", str(src), *argv, "--out", str(tmp_path / "bad.h5")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("mlem: error: ") and words in err[-1], err
        assert not (tmp_path / "bad.h5").exists()
    assert main(["convert", str(out), "--grid", "4", "3", "2", "--out", str(tmp_path / "bad.h5")]) == 2
    assert "records grid 2x3x4, --grid gives 4x3x2" in capsys.readouterr().err


# --------------------------------------------------------------------------- MAP: references and algorithms


@pytest.fixture(scope="module")
def map_problem():
    """60 voxels (5x4x3), 240 LORs in 8 subsets of 30 rows; m with about 10% gaps (m = b = 0, no counts), b > 0
    elsewhere; Poisson counts of a two-level phantom; the RDP with beta 0.3 (the MAP image is about 25% from
    the ML image: the prior matters, the image is not flat)."""
    rng = np.random.default_rng(7)
    grid, n, m = (5, 4, 3), 60, 240
    A = sp.random(m, n, density=0.2, random_state=rng, data_rvs=lambda k: rng.uniform(0.1, 1, k)).tocsr()
    truth = np.ones(n)
    truth[[7, 8, 12, 13, 27, 28]] = 4.0
    mult = rng.uniform(0.5, 1.5, m)
    mult[rng.random(m) < 0.1] = 0.0
    clean = 20 * mult * (A @ truth)
    add = np.where(mult > 0, 0.2 * clean[mult > 0].mean(), 0.0)
    g = rng.poisson(clean + add).astype(np.float64)
    prior = make_prior("rdp", grid, beta=0.3, gamma=2.0, epsilon=2.0)
    problem = MapProblem(A, g, mult, add, prior)
    return problem, solve_map(problem), np.arange(0, m + 1, m // 8)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_lbfgsb_solution_is_the_maximiser(map_problem):
    """KKT conditions of max Phi over f >= 0 at the reference: dPhi/df_j = 0 where f_j > 0, <= 0 where f_j = 0."""
    problem, fmap, _ = map_problem
    grad = gradient(problem, fmap) - problem.beta * problem.prior_gradient(fmap)
    scale = np.abs(gradient(problem, problem.initial())).max()
    assert (fmap > 0).all()  # b > 0 and the prior keep this solution interior
    assert np.abs(grad).max() < 1e-12 * scale
    ml = solve_map(MapProblem(problem.A, problem.g, problem.mult, problem.add))
    assert rel(fmap, ml) > 0.1  # the prior matters on this problem
    assert objective(problem, fmap)[0] > objective(problem, ml)[0]


def test_bsrem_converges_to_the_maximiser(map_problem):
    problem, fmap, subsets = map_problem
    f, hist = bsrem(problem, subsets, 2000)
    assert rel(f, fmap) < 1e-3
    assert len(hist.phi) == 2001
    phi = np.array(hist.phi)
    assert (np.diff(phi) >= 0).all(), f"Phi decreases at pass {int(np.argmin(np.diff(phi))) + 1}"
    assert phi[-1] <= objective(problem, fmap)[0] + 1e-9 * abs(phi[-1])
    np.testing.assert_allclose(hist.loglik[-1] - problem.beta * hist.prior[-1], phi[-1], rtol=1e-15)


def test_bsrem_without_relaxation_stays_off(map_problem):
    """The relaxation is what converges: with a constant step the subset iterates cycle off the maximiser."""
    problem, fmap, subsets = map_problem
    f, _ = bsrem(problem, subsets, 200, relaxation=(1.0, math.inf))
    assert rel(f, fmap) > 1e-2


def test_bsrem_pass_mean_is_nearer_the_maximiser_and_converges_to_it(map_problem):
    """Each pass's mean of its sub-iterates: under a constant step it sits nearer the maximiser than the cycle's
    last point; with the relaxation it converges to the maximiser, Phi never decreasing."""
    problem, fmap, subsets = map_problem
    last, _ = bsrem(problem, subsets, 200, relaxation=(1.0, math.inf))
    mean, _ = bsrem(problem, subsets, 200, relaxation=(1.0, math.inf), average=True)
    assert rel(mean, fmap) < 0.75 * rel(last, fmap)
    f, hist = bsrem(problem, subsets, 2000, average=True)
    assert rel(f, fmap) < 1e-3
    assert (np.diff(np.array(hist.phi)) >= 0).all()


def test_bsrem_with_halving_subsets_converges_to_the_maximiser(map_problem):
    """The reference's subset schedule (8 subsets halving after passes 100, 200 and 400, the last passes over
    every row at once): the maximiser after 2000 passes, Phi never decreasing; a schedule 8 subsets cannot
    follow is refused."""
    problem, fmap, subsets = map_problem
    f, hist = bsrem(problem, subsets, 2000, halving=(100, 200, 400))
    assert rel(f, fmap) < 1e-3
    assert (np.diff(np.array(hist.phi)) >= 0).all()
    with pytest.raises(ConfigError, match="halving"):
        bsrem(problem, subsets, 1, halving=(1, 2, 3, 4))


def test_osl_stays_off_the_maximiser_with_subsets(map_problem):
    problem, fmap, subsets = map_problem
    f1, _ = osl(problem, [0, problem.A.shape[0]], 1500)
    assert rel(f1, fmap) < 1e-6  # one subset: OSL's fixed point is the maximiser, and it gets there here
    f200, _ = osl(problem, subsets, 200)
    f400, hist = osl(problem, subsets, 400)
    assert rel(f200, fmap) > 5e-2 and rel(f400, fmap) > 5e-2  # eight: a limit cycle, not nearer with more passes
    assert abs(rel(f400, fmap) - rel(f200, fmap)) < 1e-3
    assert hist.phi[-1] < objective(problem, fmap)[0]


def test_reference_arguments_are_checked(map_problem):
    problem, _, _ = map_problem
    with pytest.raises(ConfigError, match="subsets"):
        bsrem(problem, [0, 100, 90, 240], 1)
    with pytest.raises(ConfigError, match="relaxation"):
        bsrem(problem, [0, 240], 1, relaxation=(0.0, 10.0))
    with pytest.raises(ConfigError, match="prior.grid"):
        MapProblem(problem.A[:, :59], problem.g, prior=problem.prior)


# --------------------------------------------------------------------------- the CUDA stencil


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rdp", "quadratic"])
@pytest.mark.parametrize("permuted", [False, True])
def test_cuda_matches_cpu(kind, permuted, rng):
    import cupy as cp

    grid = (37, 29, 11)  # several value blocks, a ragged last one
    n = math.prod(grid)
    f = rng.uniform(0.0, 5.0, n).astype(np.float32)
    f[rng.random(n) < 0.05] = 0.0
    p = make_prior(kind, grid, beta=0.5, gamma=2.0, epsilon=1e-2, kappa=rng.uniform(0.5, 1.5, n),
                   voxels=rng.permutation(n) if permuted else None)  # fmt: skip
    fd = cp.asarray(f)
    assert p.value(fd) == pytest.approx(p.value(f), rel=1e-12)
    g = p.gradient(fd)
    assert isinstance(g, cp.ndarray) and g.dtype == cp.float32
    # the same double terms in the same order, rounded once: equal up to the last float32 bit
    np.testing.assert_allclose(cp.asnumpy(g), p.gradient(f), rtol=2e-7, atol=1e-6 * float(np.abs(p.gradient(f)).max()))
    cpu = p.curvature(f)
    np.testing.assert_allclose(cp.asnumpy(p.curvature(fd)), cpu, rtol=2e-7, atol=1e-6 * float(np.abs(cpu).max()))
    assert p.value(fd) == p.value(fd)  # no atomics: repeatable bit for bit
    np.testing.assert_array_equal(cp.asnumpy(p.gradient(fd)), cp.asnumpy(g))
    g64 = p.gradient(f.astype(np.float64))
    np.testing.assert_allclose(cp.asnumpy(p.gradient(cp.asarray(f, dtype=cp.float64))), g64, rtol=1e-13, atol=1e-13)
