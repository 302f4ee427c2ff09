"""Realistic simulated data: attenuation, normalisation, randoms and scatter (mlemlib.phantom.simulate with
ScannerEffects), their m and b files, and the workflow that makes them."""

from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest

from mlemlib.errors import ConfigError
from mlemlib.formats import InMemoryMatrix
from mlemlib.formats.h5 import write_matrix_h5
from mlemlib.formats.lmsino import read_lmsino
from mlemlib.matrix import CSRMatrix
from mlemlib.phantom import (
    MU_WATER,
    ScannerEffects,
    attenuation_map,
    crystal_efficiencies,
    forward_project,
    phantom_shapes,
    simulate,
)
from mlemlib.scanner import Layer, ScannerConfig, trace_rows
from test_phantom import _ring_matrix
from test_workflow import TINY, changed, one_line, planned_jobs, snakemake

#: A tiny scanner: 2 rings of 6 blocks of 2 crystals (24 crystals, 576 LORs) around an 8 x 8 x 2 grid.
TINY_SCANNER = ScannerConfig(
    name="tiny",
    layers=(Layer(width=2.0, height=2.0, depth=6.0, radius=12.0),),
    n_blocks=6,
    block_size=2,
    block_gaps=(0.3,),
    n_rings=2,
    ring_gaps=(0.3,),
    voxel_size=(1.0, 1.0, 1.0),
    grid=(8, 8, 2),
    rays=1,
).validate("tiny")

ALL = ScannerEffects(attenuation=True, normalisation_spread=0.1, randoms_fraction=0.2, scatter_fraction=0.3)


def _factors(path) -> np.ndarray:
    return np.fromfile(path, dtype="<f4")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny scanner's matrix as a container that keeps its scanner block."""
    d = tmp_path_factory.mktemp("tiny")
    a = trace_rows(TINY_SCANNER, np.arange(TINY_SCANNER.n_lors))
    path = d / "tiny.h5"
    write_matrix_h5(path, a, grid=list(TINY_SCANNER.grid), voxel_size=list(TINY_SCANNER.voxel_size),
                    scanner_block=TINY_SCANNER.scanner_block())
    return path, a


# --------------------------------------------------------------------------- attenuation


def test_one_lor_through_water_is_attenuated_by_exp_mu_l(tmp_path):
    # LOR 0 crosses 2 + 3 mm of water, LOR 1 1.5 mm of air, LOR 2 4 mm of water and 1 of air
    a = CSRMatrix(np.array([0, 2, 3, 5]), np.array([0, 1, 2, 1, 3]),
                  np.array([2.0, 3.0, 1.5, 4.0, 1.0], np.float32), (3, 4))
    mu = np.array([MU_WATER, MU_WATER, 0.0, 0.0])
    simulate(a, np.ones(4), tmp_path / "g.LMsino", seed=1, noiseless=True, effects=ScannerEffects(attenuation=True),
             mu_map=mu, out_multiplicative=tmp_path / "m.f32")
    m = _factors(tmp_path / "m.f32")
    np.testing.assert_array_equal(m, np.float32([math.exp(-0.0096 * 5.0), 1.0, math.exp(-0.0096 * 4.0)]))


def test_named_phantom_attenuates_by_its_water_chord(tmp_path):
    # One LOR along x through the centre of the uniform cylinder (radius 0.85 R = 17 mm): the two voxel rows
    # next to y = 0 (centres y = -0.5, 0.5 mm) at half weight each, so the LOR crosses the chord at |y| = 0.5.
    grid, vs = (40, 40, 4), (1.0, 1.0, 1.0)
    gx, gy, _ = grid
    cols = [x + gx * (y + gy * 1) for y in (19, 20) for x in range(gx)]
    a = CSRMatrix(np.array([0, len(cols)]), np.array(sorted(cols)), np.full(len(cols), 0.5, np.float32),
                  (1, int(np.prod(grid))))
    src = InMemoryMatrix(a, grid=grid, voxel_size=vs)
    simulate(src, "uniform", tmp_path / "g.LMsino", noiseless=True, effects=ScannerEffects(attenuation=True),
             out_multiplicative=tmp_path / "m.f32")
    chord = 2 * math.sqrt(17.0**2 - 0.5**2)
    assert _factors(tmp_path / "m.f32")[0] == pytest.approx(math.exp(-MU_WATER * chord), rel=2e-3)


def test_mu_map_is_water_inside_the_body_and_lung_in_the_insert():
    grid, vs = (32, 32, 8), (1.0, 1.0, 1.0)
    ph = phantom_shapes("nema", grid, vs)
    mu = attenuation_map(ph, grid, vs)
    assert mu.dtype == np.float32 and mu.shape == (8, 32, 32)
    assert mu[4, 16, 16] == pytest.approx(0.0029)  # the lung insert on the axis
    assert mu[4, 16, 8] == pytest.approx(MU_WATER)  # background water (a cold sphere is water too)
    assert mu[4, 0, 0] == 0.0  # air outside the body
    derenzo = attenuation_map(phantom_shapes("derenzo", grid, vs), grid, vs)
    assert derenzo[4, 16, 16] == pytest.approx(MU_WATER)  # the cold body is water without activity


# --------------------------------------------------------------------------- normalisation


def test_crystal_efficiency_product_per_lor(tiny, tmp_path):
    path, a = tiny
    effects = ScannerEffects(normalisation_spread=0.15, normalisation_seed=7)
    r = simulate(path, "uniform", tmp_path / "g.LMsino", noiseless=True, effects=effects,
                 out_multiplicative=tmp_path / "m.f32")
    m = _factors(tmp_path / "m.f32")
    nc = TINY_SCANNER.n_crystals
    eps = crystal_efficiencies(nc, 0.15, 7)
    i, j = np.divmod(np.arange(nc * nc), nc)
    expected = np.where(i == j, 0.0, eps[i] * eps[j]).astype(np.float32)
    np.testing.assert_array_equal(m, expected)
    assert r["effects"]["normalisation"] == "crystal pairs" and r["effects"]["crystals"] == nc
    # symmetric: LOR (i, j) and (j, i) share their factor (a folded matrix's stored row stands for both)
    np.testing.assert_array_equal(m.reshape(nc, nc), m.reshape(nc, nc).T)


def test_a_csr4_scanner_block_gives_the_same_crystal_pairs(tiny, tmp_path):
    from mlemlib.scanner import generate

    path, _ = tiny
    generate(TINY_SCANNER, tmp_path / "tiny.csr4")
    effects = ScannerEffects(attenuation=True, normalisation_spread=0.1)
    for name, matrix in (("h5", path), ("csr4", tmp_path / "tiny.csr4")):
        r = simulate(matrix, "nema", tmp_path / f"{name}.LMsino", noiseless=True, effects=effects,
                     out_multiplicative=tmp_path / f"{name}.m")
        assert r["effects"]["normalisation"] == "crystal pairs"
    np.testing.assert_array_equal(_factors(tmp_path / "csr4.m"), _factors(tmp_path / "h5.m"))


def test_crystal_efficiencies_have_mean_one_and_the_spread():
    eps = crystal_efficiencies(200_000, 0.1, 3)
    assert eps.mean() == pytest.approx(1.0, abs=2e-3) and eps.std() == pytest.approx(0.1, rel=0.02)
    assert (eps > 0).all()
    np.testing.assert_array_equal(eps, crystal_efficiencies(200_000, 0.1, 3))


def test_without_a_scanner_geometry_each_lor_draws_its_own_factor(tmp_path):
    grid = (8, 8, 4)
    src = InMemoryMatrix(_ring_matrix(grid, m=3000), grid=grid, voxel_size=(1.0, 1.0, 1.0))
    r = simulate(src, "uniform", tmp_path / "g.LMsino", noiseless=True, out_multiplicative=tmp_path / "m.f32",
                 effects=ScannerEffects(normalisation_spread=0.2))
    m = _factors(tmp_path / "m.f32")
    assert r["effects"]["normalisation"] == "per LOR" and r["effects"]["crystals"] is None
    assert (m > 0).all() and m.std() / m.mean() == pytest.approx(0.2, rel=0.1)


# --------------------------------------------------------------------------- background


@pytest.mark.parametrize(("randoms", "scatter"), [(0.25, 0.0), (0.0, 0.35), (0.2, 0.3)])
def test_background_fractions_of_the_expected_counts(tiny, tmp_path, randoms, scatter):
    path, a = tiny
    effects = ScannerEffects(attenuation=True, randoms_fraction=randoms, scatter_fraction=scatter)
    total = 1e6
    r = simulate(path, "nema", tmp_path / "g.LMsino", tmp_path / "t.h5", counts=total, seed=4, effects=effects,
                 out_multiplicative=tmp_path / "m.f32", out_additive=tmp_path / "b.f32")
    m, b = _factors(tmp_path / "m.f32").astype(np.float64), _factors(tmp_path / "b.f32").astype(np.float64)
    with h5py.File(tmp_path / "t.h5") as f:
        truth = f["image"][...].astype(np.float64)
    trues = m * forward_project(path, truth)
    expected = trues + b
    # the truth scales so that m * A truth + b is the expectation, whose total is the configured counts
    assert expected.sum() == pytest.approx(total, rel=1e-6)
    assert b.sum() / expected.sum() == pytest.approx(randoms + scatter, rel=1e-6)
    assert trues.sum() / expected.sum() == pytest.approx(1 - randoms - scatter, rel=1e-6)
    filled = np.diff(a.indptr) > 0
    assert (b[~filled] == 0).all()
    if scatter == 0:
        np.testing.assert_array_equal(b[filled], b[filled][0])  # uniform randoms over the LORs that see the grid
    g = read_lmsino(tmp_path / "g.LMsino")
    assert abs(int(g.sum()) - total) < 5 * math.sqrt(total)
    assert r["effects"]["expected_randoms"] == pytest.approx(randoms * total)
    assert r["effects"]["expected_scatter"] == pytest.approx(scatter * total)


def test_scatter_is_smooth_and_reaches_beyond_the_body(tmp_path):
    # LORs along x at every y: the scatter's profile over y is smooth and non-zero outside the cylinder
    grid, vs = (40, 40, 2), (1.0, 1.0, 1.0)
    gx, gy, _ = grid
    rows = [[x + gx * y for x in range(gx)] for y in range(gy)]
    indptr = np.arange(0, gx * gy + 1, gx)
    a = CSRMatrix(indptr, np.concatenate(rows), np.ones(gx * gy, np.float32), (gy, int(np.prod(grid))))
    src = InMemoryMatrix(a, grid=grid, voxel_size=vs)
    simulate(src, "uniform", tmp_path / "g.LMsino", noiseless=True, effects=ScannerEffects(scatter_fraction=0.3),
             out_additive=tmp_path / "b.f32")
    b = _factors(tmp_path / "b.f32").astype(np.float64)
    assert b[0] > 0 and b[-1] > 0  # |y| = 19.5 mm, outside the 17 mm body
    assert np.abs(np.diff(b, 2)).max() < 0.02 * b.max()  # no edges
    assert int(np.argmax(b)) in (19, 20)


# --------------------------------------------------------------------------- files and reproducibility


def test_factor_files_format(tiny, tmp_path):
    path, a = tiny
    simulate(path, "nema", tmp_path / "g.LMsino", seed=2, effects=ALL, out_multiplicative=tmp_path / "m.f32",
             out_additive=tmp_path / "b.f32")
    nc, m_lors = TINY_SCANNER.n_crystals, TINY_SCANNER.n_lors
    for name in ("m.f32", "b.f32"):
        assert (tmp_path / name).stat().st_size == 4 * m_lors  # float32 per LOR, no header
    m, b = _factors(tmp_path / "m.f32"), _factors(tmp_path / "b.f32")
    assert np.isfinite(m).all() and np.isfinite(b).all() and (b >= 0).all()
    gaps = np.arange(m_lors) % (nc + 1) == 0  # LOR (i, i)
    assert (m[gaps] == 0).all() and (m[~gaps] > 0).all()
    assert m[~gaps].max() < 2.0 and b.sum() > 0
    # the reading side accepts them
    read_factors = pytest.importorskip("mlemlib.corrections").read_factors
    np.testing.assert_array_equal(read_factors(tmp_path / "m.f32", m_lors, "multiplicative"), m)
    np.testing.assert_array_equal(read_factors(tmp_path / "b.f32", m_lors, "additive"), b)


def test_same_seeds_same_bytes(tiny, tmp_path):
    path, _ = tiny

    def run(tag, seed=3, effects=ALL):
        simulate(path, "nema", tmp_path / f"{tag}.LMsino", tmp_path / f"{tag}.h5", seed=seed, effects=effects,
                 out_multiplicative=tmp_path / f"{tag}.m", out_additive=tmp_path / f"{tag}.b")
        return [(tmp_path / f"{tag}{ext}").read_bytes() for ext in (".LMsino", ".m", ".b")]

    a, b = run("a"), run("b")
    assert a == b
    other_noise = run("c", seed=4)
    assert other_noise[0] != a[0] and other_noise[1:] == a[1:]  # the scanner's factors do not follow the noise
    other_scanner = run("d", effects=ScannerEffects(**{**ALL.__dict__, "normalisation_seed": 1}))
    assert other_scanner[1] != a[1]
    with h5py.File(tmp_path / "a.h5") as f:
        record = json.loads(f.attrs["scanner_effects"])
    assert record["randoms_fraction"] == 0.2 and record["scatter_fraction"] == 0.3
    assert record["mu_units"] == "1/mm" and record["normalisation_seed"] == 0 and record["attenuation"] is True
    assert record["multiplicative"].endswith("a.m") and record["additive"].endswith("a.b")


def test_options_off_give_todays_bytes(tmp_path):
    grid = (12, 12, 6)
    src = InMemoryMatrix(_ring_matrix(grid), grid=grid, voxel_size=(2.0, 2.0, 2.0))
    simulate(src, "nema", tmp_path / "a.LMsino", tmp_path / "a.h5", seed=5, counts=2e5)
    simulate(src, "nema", tmp_path / "b.LMsino", tmp_path / "b.h5", seed=5, counts=2e5, effects=ScannerEffects(),
             out_multiplicative=tmp_path / "m.f32", out_additive=tmp_path / "b.f32")
    a = (tmp_path / "a.LMsino").read_bytes()
    assert a == (tmp_path / "b.LMsino").read_bytes()
    # today's recipe: Poisson(s A f), s = counts / sum(A f), default_rng(seed)
    with h5py.File(tmp_path / "a.h5") as f:
        scale = float(f.attrs["scale"])
        assert "scanner_effects" not in f.attrs
    from mlemlib.phantom import make_phantom

    expected = forward_project(src, make_phantom("nema", grid, (2.0, 2.0, 2.0)))
    assert scale == 2e5 / expected.sum()
    g = np.random.default_rng(5).poisson(expected * scale).astype(np.int32)
    assert g.tobytes() == a
    # the files asked for hold m = 1 and b = 0
    np.testing.assert_array_equal(_factors(tmp_path / "m.f32"), 1.0)
    np.testing.assert_array_equal(_factors(tmp_path / "b.f32"), 0.0)


def test_folded_and_reordered_matrices_give_the_users_factors(tmp_path):
    from mlemlib import reorder
    from mlemlib.scanner import generate

    generate("small", tmp_path / "a.h5")
    generate("small", tmp_path / "p.h5", fold=True)
    reorder.reorder_file(tmp_path / "a.h5", tmp_path / "r.h5", "rows+voxels")
    out = {}
    for name in ("a", "p", "r"):
        simulate(tmp_path / f"{name}.h5", "nema", tmp_path / f"{name}.LMsino", noiseless=True, effects=ALL,
                 out_multiplicative=tmp_path / f"{name}.m", out_additive=tmp_path / f"{name}.b")
        out[name] = [read_lmsino(tmp_path / f"{name}.LMsino"), _factors(tmp_path / f"{name}.m"),
                     _factors(tmp_path / f"{name}.b")]
    for name in ("p", "r"):
        for got, want in zip(out[name], out["a"]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_folded_matrix_without_a_geometry_gives_each_lor_its_own_factor(tmp_path):
    """Per-LOR normalisation on a folded matrix: the unfolded matrix's factors, different inside a stored row
    (the folded run sums them per stored row, mlemlib.corrections.summed_factors)."""
    import scipy.sparse as sp

    from mlemlib.fold import fold_file, fold_of

    grid = (8, 8, 4)
    half = _ring_matrix(grid, m=500).to_scipy()
    a = CSRMatrix.from_scipy(sp.vstack([half, half]).tocsr())  # LOR i + 500 repeats LOR i
    write_matrix_h5(tmp_path / "a.h5", a, grid=list(grid), voxel_size=[1.0, 1.0, 1.0])
    fold_file(tmp_path / "a.h5", tmp_path / "f.h5")
    assert fold_of(tmp_path / "f.h5").m_stored == 500
    effects = ScannerEffects(normalisation_spread=0.2, randoms_fraction=0.1)
    got = {}
    for name in ("a", "f"):
        simulate(tmp_path / f"{name}.h5", "uniform", tmp_path / f"{name}.LMsino", noiseless=True, effects=effects,
                 out_multiplicative=tmp_path / f"{name}.m", out_additive=tmp_path / f"{name}.b")
        got[name] = [_factors(tmp_path / f"{name}.m"), _factors(tmp_path / f"{name}.b"),
                     read_lmsino(tmp_path / f"{name}.LMsino")]
    for x, y in zip(got["f"], got["a"]):
        np.testing.assert_array_equal(x, y)
    m = got["f"][0]
    assert (m[:500] != m[500:]).all()


def test_bad_effects_are_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="^randoms_fraction: .*below 1"):
        ScannerEffects(randoms_fraction=0.6, scatter_fraction=0.5).check()
    with pytest.raises(ConfigError, match="^normalisation_spread: must be a number >= 0"):
        ScannerEffects(normalisation_spread=-0.1).check()
    with pytest.raises(ConfigError, match="^scatter_sigma"):
        ScannerEffects(scatter_fraction=0.1, scatter_sigma=0).check()
    a = _ring_matrix((4, 4, 2), m=50)
    with pytest.raises(ConfigError, match="^attenuation: an image phantom has no mu-map"):
        simulate(a, np.ones(32), tmp_path / "x.LMsino", effects=ScannerEffects(attenuation=True))
    with pytest.raises(ConfigError, match="^scatter_fraction: .*no voxel grid"):
        simulate(a, np.ones(32), tmp_path / "x.LMsino", effects=ScannerEffects(scatter_fraction=0.1))
    with pytest.raises(ConfigError, match="^mu_map: has 3 voxels"):
        simulate(a, np.ones(32), tmp_path / "x.LMsino", effects=ScannerEffects(attenuation=True), mu_map=np.ones(3))
    assert not (tmp_path / "x.LMsino").exists()


# --------------------------------------------------------------------------- workflow

REALISTIC = {"attenuation": True, "normalisation_spread": 0.1, "randoms_fraction": 0.2, "scatter_fraction": 0.3}


def test_dry_run_with_effects_makes_m_and_b_for_every_reconstruction(tmp_path):
    config = changed(simulation={**REALISTIC, "seeds": [1, 2]})
    proc = snakemake(tmp_path, "--dry-run", "--printshellcmds", config=config)  # its job stats and its jobs
    jobs = planned_jobs(proc)
    assert jobs["simulate_measurement"] == 2 and jobs["run_mlem"] == 4 and jobs["reference_mlem"] == 2
    plan = proc.stdout
    rule = plan.split("rule simulate_measurement:", 1)[1].split("\n\n", 1)[0]
    output = rule.split("output:", 1)[1].splitlines()[0]
    assert "nema-seed" in output and ".mult.f32" in output and ".add.f32" in output, rule
    for run in plan.split("rule run_mlem:")[1:] + plan.split("rule reference_mlem:")[1:]:
        inputs = run.split("input:", 1)[1].splitlines()[0]
        data = run.split("wildcards:", 1)[1].split("data=", 1)[1].split(",", 1)[0]
        assert f"data/{data}.mult.f32" in inputs and f"data/{data}.add.f32" in inputs, inputs


def test_only_the_asked_factor_file_is_made(tmp_path):
    plan = snakemake(tmp_path, "--dry-run", "--printshellcmds",
                     config=changed(simulation={"randoms_fraction": 0.1})).stdout
    rule = plan.split("rule simulate_measurement:", 1)[1].split("\n\n", 1)[0]
    assert ".add.f32" in rule and ".mult.f32" not in rule
    plan = snakemake(tmp_path, "--dry-run", "--printshellcmds", config=TINY).stdout
    assert ".f32" not in plan


def test_fractions_that_leave_no_trues_stop_the_workflow(tmp_path):
    proc = snakemake(tmp_path, "--cores", "1", config=changed(simulation={"randoms_fraction": 0.5,
                                                                          "scatter_fraction": 0.5}))
    line = one_line(proc)
    assert line.startswith("config simulation.randoms_fraction: ") and "below 1" in line, line
    proc = snakemake(tmp_path, "--cores", "1", config=changed(simulation={"normalisation_spread": -1}))
    assert one_line(proc).startswith("config simulation.normalisation_spread: ")
    assert not (tmp_path / "results").exists()
