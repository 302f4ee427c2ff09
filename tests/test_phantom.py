"""Phantoms (geometry, antialiasing, column order) and measurement simulation."""

from __future__ import annotations

import math

import h5py
import numpy as np
import pytest

from mlemlib import metrics
from mlemlib.errors import ConfigError, MatrixFormatError
from mlemlib.matrix import CSRMatrix
from mlemlib.formats import InMemoryMatrix
from mlemlib.image import read_image
from mlemlib.phantom import (
    Cylinder,
    Sphere,
    forward_project,
    load_regions,
    make_phantom,
    phantom_shapes,
    rasterize,
    region_masks,
    simulate,
)

GRID = (64, 64, 32)  # fine enough for every sphere to hold a voxel entirely
VOXEL = (1.0, 1.0, 1.0)


@pytest.fixture(scope="module")
def nema():
    return phantom_shapes("nema", GRID, VOXEL), make_phantom("nema", GRID, VOXEL)


def test_shape_and_column_order():
    grid = (40, 20, 10)
    img = rasterize([Sphere((10.0, -4.0, 2.0), 2.0, 5.0)], grid, VOXEL, supersample=4)
    assert img.shape == (10, 20, 40) and img.dtype == np.float32  # (gridZ, gridY, gridX)
    # centre (10, -4, 2) mm lies at voxel coordinates i = c + g/2 - 0.5: (29.5, 5.5, 6.5)
    zz, yy, xx = np.indices(img.shape)
    w = img.astype(np.float64) / img.sum(dtype=np.float64)
    assert (float((w * xx).sum()), float((w * yy).sum()), float((w * zz).sum())) == pytest.approx((29.5, 5.5, 6.5), abs=1e-6)
    # column col = x + gridX * (y + gridY * z): x varies fastest in the flat image
    flat = img.reshape(-1)
    cols = np.flatnonzero(flat)
    x, y, z = cols % 40, (cols // 40) % 20, cols // 800
    np.testing.assert_array_equal(flat[cols], img[z, y, x])
    assert 26 <= x.min() and x.max() <= 33 and 2 <= y.min() and y.max() <= 9


def test_sphere_volume_and_antialiasing():
    r = 6.3
    img = rasterize([Sphere((0.3, -0.7, 0.2), r, 1.0)], (32, 32, 32), VOXEL, supersample=5)
    assert float(img.sum(dtype=np.float64)) == pytest.approx(4 / 3 * math.pi * r**3, rel=0.01)
    partial = (img > 0) & (img < 1)
    assert partial.sum() > 100  # the surface is antialiased, not a binary mask
    cyl = Cylinder((1.13, -0.37), 5.5, -4.0, 6.0, 2.0)
    img = rasterize([cyl], (32, 32, 24), (0.8, 0.8, 1.0), supersample=4)
    assert float(img.sum(dtype=np.float64)) * 0.8 * 0.8 * 1.0 == pytest.approx(2.0 * cyl.volume(), rel=0.01)


def test_nema_values(nema):
    ph, img = nema
    masks = region_masks(ph, GRID, VOXEL)
    assert set(masks.masks) == {"lung", "hot1", "hot2", "hot3", "hot4", "cold1", "cold2"}
    flat = img.reshape(-1)
    for label, mask in masks.masks.items():
        m = mask.reshape(-1)
        assert m.any()
        expected = 4.0 if label.startswith("hot") else 0.0
        np.testing.assert_array_equal(flat[m], expected)  # voxels entirely inside an insert
    np.testing.assert_array_equal(flat[masks.background.reshape(-1)], 1.0)
    assert masks.background.sum() > 0.3 * img.size
    assert 0.0 <= img.min() and img.max() == 4.0
    # spheres grow with their label and sit in the central plane
    radii = [s.radius for s in ph.shapes[2:]]
    assert radii == sorted(radii) and all(s.center[2] == 0.0 for s in ph.shapes[2:])
    # the truth's own contrast recovery is 1 for every insert
    cr = metrics.contrast_recovery(img, masks.masks, masks.background, masks.activity, masks.background_activity)
    assert all(v == pytest.approx(1.0, abs=1e-12) for v in cr.values())


def test_region_mask_of_a_sub_voxel_insert():
    from mlemlib.phantom import Phantom

    ph = Phantom("t", [Cylinder((0.0, 0.0), 7.0, -3.0, 3.0, 1.0), Sphere((2.2, -1.3, 0.4), 0.3, 4.0, "tiny")])
    masks = region_masks(ph, (16, 16, 8), VOXEL)
    m = masks.masks["tiny"]
    assert m.sum() == 1  # no voxel lies inside it: the voxel holding its centre
    assert m[4, 6, 10]  # z = 0.4 -> 4, y = -1.3 -> 6, x = 2.2 -> 10 (i = floor(c + g/2))
    assert not masks.background[4, 6, 10]


def test_derenzo_rods():
    ph = phantom_shapes("derenzo", (64, 64, 8), (0.5, 0.5, 1.0))
    rods = ph.shapes[1:]
    sectors = {s.label for s in rods}
    assert sectors == {f"rods{k}" for k in range(1, 7)}
    body = ph.body
    for s in rods:
        assert math.hypot(*s.center) + s.radius <= body.radius  # inside the body
    for i, p in enumerate(rods):  # no two rods touch
        for q in rods[i + 1:]:
            assert math.dist(p.center, q.center) > p.radius + q.radius
    img = make_phantom("derenzo", (64, 64, 8), (0.5, 0.5, 1.0))
    assert img.max() == 1.0
    # rods span z in [-3.6, 3.6] mm: 2 of the 3 sub-planes of the end slices (-4..-3 mm) are inside
    assert img[0].sum() == pytest.approx(img[4].sum() * 2 / 3, rel=1e-5)
    big = [s for s in rods if s.label == "rods6"]
    for s in big:  # the largest rods are resolved: their centre voxels hold 1
        ix = int((s.center[0] / 0.5) + 32)
        iy = int((s.center[1] / 0.5) + 32)
        assert img[4, iy, ix] == 1.0


def test_unknown_phantom_and_bad_grid():
    with pytest.raises(ConfigError, match="unknown phantom"):
        make_phantom("shepp", GRID, VOXEL)
    with pytest.raises(ConfigError, match="grid"):
        make_phantom("nema", (10, 10), VOXEL)
    with pytest.raises(ConfigError, match="voxel size"):
        make_phantom("nema", GRID, (1.0, 0.0, 1.0))


def _ring_matrix(grid, m=3000, seed=3):
    """A random sparse matrix on a grid (each LOR sees ~10 voxels)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(grid))
    k = 10
    indptr = np.arange(0, m * k + 1, k, dtype=np.int64)
    cols = np.sort(rng.choice(n, size=(m, k), replace=True), axis=1).reshape(-1)
    data = rng.uniform(0.01, 1.0, m * k).astype(np.float32)
    import scipy.sparse as sp

    a = sp.csr_matrix((data, cols, indptr), shape=(m, n))
    a.sum_duplicates()
    return CSRMatrix.from_scipy(a)


def test_simulate_deterministic_noiseless_and_truth(tmp_path):
    grid = (12, 12, 6)
    a = _ring_matrix(grid)
    src = InMemoryMatrix(a, grid=grid, voxel_size=(2.0, 2.0, 2.0))
    r1 = simulate(src, "nema", tmp_path / "a.LMsino", tmp_path / "truth.h5", seed=5, counts=2e5)
    simulate(src, "nema", tmp_path / "b.LMsino", None, seed=5, counts=2e5)
    simulate(src, "nema", tmp_path / "c.LMsino", None, seed=6, counts=2e5)
    assert (tmp_path / "a.LMsino").read_bytes() == (tmp_path / "b.LMsino").read_bytes()
    assert (tmp_path / "a.LMsino").read_bytes() != (tmp_path / "c.LMsino").read_bytes()
    g = np.fromfile(tmp_path / "a.LMsino", dtype="<i4")
    assert g.size == a.shape[0] and r1["counts"] == int(g.sum())
    assert abs(r1["counts"] - 2e5) < 5 * math.sqrt(2e5)

    truth, attrs = read_image(tmp_path / "truth.h5", expected_length=a.shape[1])
    with h5py.File(tmp_path / "truth.h5") as f:
        assert f["image"].shape == (6, 12, 12)
        assert list(f.attrs["voxel_size"]) == [2.0, 2.0, 2.0]
    # truth is scaled so that A @ truth is the expected measurement (total = counts)
    expected = forward_project(src, truth)
    assert expected.sum() == pytest.approx(2e5, rel=1e-6)
    assert attrs["phantom"] == "nema" and attrs["seed"] == 5
    regions = load_regions(attrs, attrs["grid"], attrs["voxel_size"])
    assert regions is not None and "hot1" in regions.masks

    simulate(src, "nema", tmp_path / "n.LMsino", tmp_path / "nt.h5", noiseless=True, counts=2e5)
    gn = np.fromfile(tmp_path / "n.LMsino", dtype="<i4")
    tn, _ = read_image(tmp_path / "nt.h5")
    np.testing.assert_array_equal(gn, np.rint(forward_project(src, tn.astype(np.float64))).astype(np.int32))


def test_simulate_poisson_mean_and_variance(tmp_path):
    # every LOR sees the whole uniform cylinder the same way: equal expectations
    grid = (8, 8, 4)
    n = int(np.prod(grid))
    m = 20000
    a = CSRMatrix(np.arange(0, m * n + 1, n), np.tile(np.arange(n), m), np.full(m * n, 0.01, np.float32), (m, n))
    src = InMemoryMatrix(a, grid=grid, voxel_size=(1.0, 1.0, 1.0))
    lam = 12.5
    simulate(src, "uniform", tmp_path / "u.LMsino", None, seed=11, counts=lam * m)
    g = np.fromfile(tmp_path / "u.LMsino", dtype="<i4").astype(np.float64)
    se = math.sqrt(lam / m)
    assert abs(g.mean() - lam) < 5 * se
    # variance of a Poisson draw equals its mean (sd of the sample variance ~ sqrt((lam + 2 lam^2) / m))
    assert abs(g.var() - lam) < 5 * math.sqrt((lam + 2 * lam**2) / m)


def test_simulate_errors(tmp_path):
    a = _ring_matrix((4, 4, 2), m=50)
    with pytest.raises(MatrixFormatError, match="no voxel grid"):
        simulate(InMemoryMatrix(a), "nema", tmp_path / "x.LMsino")
    src = InMemoryMatrix(a, grid=(4, 4, 2), voxel_size=(1.0, 1.0, 1.0))
    with pytest.raises(ConfigError, match="counts"):
        simulate(src, "uniform", tmp_path / "x.LMsino", counts=-3)
    with pytest.raises(ConfigError, match="int32"):
        simulate(src, "uniform", tmp_path / "x.LMsino", counts=1e15, noiseless=True)
    with pytest.raises(ConfigError, match="voxels"):
        simulate(src, np.ones(7), tmp_path / "x.LMsino")
    assert not (tmp_path / "x.LMsino").exists()


def test_cli_simulate(tmp_path):
    from mlemlib.cli import main
    from mlemlib.formats.h5 import write_matrix_h5

    grid = (10, 10, 4)
    write_matrix_h5(tmp_path / "m.h5", _ring_matrix(grid, m=500), grid=list(grid), voxel_size=[1.0, 1.0, 2.0])
    args = ["simulate", str(tmp_path / "m.h5"), "--phantom", "derenzo", "--seed", "2", "--counts", "1e4"]
    assert main([*args, "--out", str(tmp_path / "a.LMsino"), "--truth", str(tmp_path / "t.h5")]) == 0
    assert main([*args, "--out", str(tmp_path / "b.LMsino")]) == 0
    assert (tmp_path / "a.LMsino").read_bytes() == (tmp_path / "b.LMsino").read_bytes()
    assert (tmp_path / "a.LMsino").stat().st_size == 500 * 4
    assert (tmp_path / "t.h5").exists()


def test_cli_simulate_realistic_data_writes_m_and_b_beside_the_counts(tmp_path):
    from mlemlib.cli import main
    from mlemlib.formats.h5 import write_matrix_h5

    grid = (10, 10, 4)
    write_matrix_h5(tmp_path / "m.h5", _ring_matrix(grid, m=500), grid=list(grid), voxel_size=[1.0, 1.0, 2.0])
    base = ["simulate", str(tmp_path / "m.h5"), "--seed", "2", "--counts", "1e4"]
    assert main([*base, "--out", str(tmp_path / "plain.LMsino")]) == 0
    assert not (tmp_path / "plain.mult.f32").exists() and not (tmp_path / "plain.add.f32").exists()
    assert main([*base, "--out", str(tmp_path / "real.LMsino"), "--attenuation", "--normalisation-spread", "0.1",
                 "--randoms-fraction", "0.2", "--scatter-fraction", "0.1"]) == 0
    m = np.fromfile(tmp_path / "real.mult.f32", dtype="<f4")
    b = np.fromfile(tmp_path / "real.add.f32", dtype="<f4")
    assert m.size == b.size == 500 and np.all(np.isfinite(m)) and np.all(m >= 0) and np.all(b >= 0)
    assert 0 < float(np.median(m)) < 1 and b.sum() > 0  # attenuated, a background
    with pytest.raises(SystemExit):
        main([*base, "--out", str(tmp_path / "x.LMsino"), "--randoms-fraction", "1.5"])
