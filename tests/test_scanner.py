"""Tests of the synthetic scanner and its exact ray tracer (mlemlib.scanner), CPU only.

The references are independent of the tracer: hand-computed rows for rays
along the axes and along a diagonal, and a plain-NumPy slab intersection of
each ray with each voxel box (per voxel) and with the whole grid (row sums).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib.cli import main as mlem_main
from mlemlib.errors import ConfigError
from mlemlib.formats.csr4 import Csr4File
from mlemlib.scanner import (
    PRESETS,
    Layer,
    ScannerConfig,
    box_bounds,
    crystal_coords,
    crystal_faces,
    face_points,
    generate,
    get_preset,
    lor_index,
    trace_rows,
    voxel_index,
)

SMALL = PRESETS["small"]


# --------------------------------------------------------------------------- NumPy references


def slab_chords(p0: np.ndarray, p1: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Length of segment p0->p1 inside each box [lo, hi) (float64, plain NumPy).

    ``p0, p1``: (R, 3); ``lo, hi``: (B, 3). Returns (R, B). An axis the ray is
    parallel to keeps the ray iff lo <= p < hi (the tracer's convention).
    """
    d = (p1 - p0)[:, None, :]  # (R, 1, 3)
    p = p0[:, None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        ta = (lo[None] - p) / d
        tb = (hi[None] - p) / d
    par = d == 0
    inside = (p >= lo[None]) & (p < hi[None])
    tmin = np.where(par, np.where(inside, -np.inf, np.inf), np.minimum(ta, tb))
    tmax = np.where(par, np.where(inside, np.inf, -np.inf), np.maximum(ta, tb))
    t0 = np.maximum(tmin.max(axis=2), 0.0)
    t1 = np.minimum(tmax.min(axis=2), 1.0)
    length = np.linalg.norm(p1 - p0, axis=1)[:, None]
    return np.clip(t1 - t0, 0.0, None) * length


def tube_rays(cfg: ScannerConfig, row: int) -> tuple[np.ndarray, np.ndarray]:
    """All k**4 ray end points of a row, rebuilt from the face geometry by hand."""
    i, j = divmod(row, cfg.n_crystals)
    centres, tangents, sizes = crystal_faces(cfg)
    k = cfg.face_points
    off = (np.arange(k) + 0.5) / k - 0.5

    def pts(c):
        return np.array(
            [
                centres[c] + a * sizes[c, 0] * tangents[c] + b * sizes[c, 1] * np.array([0.0, 0.0, 1.0])
                for a in off
                for b in off
            ]
        )

    pi, pj = pts(i), pts(j)
    return np.repeat(pi, len(pj), axis=0), np.tile(pj, (len(pi), 1))


def voxel_boxes(cfg: ScannerConfig) -> tuple[np.ndarray, np.ndarray]:
    """Lower/upper corners of every voxel in column order (x fastest)."""
    gx, gy, gz = cfg.grid
    vs = np.asarray(cfg.voxel_size, dtype=np.float64)
    z, y, x = np.meshgrid(np.arange(gz), np.arange(gy), np.arange(gx), indexing="ij")
    idx = np.stack([x.ravel(), y.ravel(), z.ravel()], axis=1).astype(np.float64)
    lo = -0.5 * np.asarray(cfg.grid) * vs + idx * vs
    return lo, lo + vs


def dense_row(a, q: int, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.float64)
    s, e = a.indptr[q], a.indptr[q + 1]
    out[a.indices[s:e]] = a.data[s:e]
    return out


# --------------------------------------------------------------------------- fixtures


def line_scanner(n_blocks: int, grid, voxel_size, radius: float = 10.0) -> ScannerConfig:
    """One ring of single-crystal blocks, thin lines: block b's face centre at angle 2*pi*b/n_blocks."""
    return ScannerConfig(
        name="lines",
        layers=(Layer(width=1.0, height=1.0, depth=5.0, radius=radius, mu=0.0),),
        n_blocks=n_blocks,
        block_size=1,
        block_gaps=(),
        n_rings=1,
        ring_gaps=(),
        voxel_size=voxel_size,
        grid=grid,
        rays=1,
    ).validate()


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("scanner") / "small.csr4"
    summary = generate("small", path)
    return path, summary


@pytest.fixture(scope="module")
def small_matrix(small_file):
    path, _ = small_file
    with Csr4File(path) as f:
        return f.to_csr()


# --------------------------------------------------------------------------- hand-computed rows


def test_rays_along_axes_through_voxel_centres():
    # grid 3 x 5 x 3 of 1.0 x 2.0 x 0.5 mm: voxel (1, 2, 1) is centred on the origin.
    cfg = line_scanner(4, grid=(3, 5, 3), voxel_size=(1.0, 2.0, 0.5))
    # crystal 0 at +x, 1 at +y, 2 at -x, 3 at -y
    a = trace_rows(cfg, [lor_index(cfg, 0, 2), lor_index(cfg, 1, 3), lor_index(cfg, 0, 0), lor_index(cfg, 0, 1)])
    # along x at y = z = 0: voxels x = 0..2 of row y = 2, slice z = 1, 1.0 mm each
    np.testing.assert_array_equal(a.indices[a.indptr[0] : a.indptr[1]], [21, 22, 23])
    np.testing.assert_array_equal(a.data[a.indptr[0] : a.indptr[1]], [1.0, 1.0, 1.0])
    # along y at x = z = 0: voxels y = 0..4 of column x = 1, slice z = 1, 2.0 mm each
    np.testing.assert_array_equal(a.indices[a.indptr[1] : a.indptr[2]], [16, 19, 22, 25, 28])
    np.testing.assert_array_equal(a.data[a.indptr[1] : a.indptr[2]], [2.0] * 5)
    assert voxel_index(cfg, 1, 4, 1) == 28
    # i == j is empty; a pair whose line misses the grid (+x to +y at radius 10) is empty
    assert a.indptr[3] == a.indptr[2] and a.indptr[4] == a.indptr[3]


def test_diagonal_ray_through_voxel_corners_has_no_slivers():
    # The line from 45 to 225 degrees runs along x = y through the corners of a 4 x 4 grid.
    cfg = line_scanner(8, grid=(4, 4, 1), voxel_size=(1.0, 1.0, 1.0))
    a = trace_rows(cfg, [lor_index(cfg, 1, 5)])
    np.testing.assert_array_equal(a.indices, [0, 5, 10, 15])
    np.testing.assert_allclose(a.data, [math.sqrt(2.0)] * 4, rtol=1e-6)


def test_crystal_faces_hand_computed():
    centres, tangents, sizes = crystal_faces(SMALL)
    # a block of 4 crystals of 2 mm with 0.3 mm gaps spans 8.9 mm: first centre at -3.45;
    # 4 rings of 2 mm with 0.3 mm gaps: first ring at z = -3.45
    np.testing.assert_allclose(centres[0], [30.0, -3.45, -3.45], atol=1e-12)
    np.testing.assert_allclose(centres[3], [30.0, 3.45, -3.45], atol=1e-12)
    assert crystal_coords(SMALL, 3) == (0, 0, 0, 3)
    # crystal 4 is block 1 (30 degrees), k = 0
    phi = math.radians(30.0)
    u, t = np.array([math.cos(phi), math.sin(phi)]), np.array([-math.sin(phi), math.cos(phi)])
    np.testing.assert_allclose(centres[4, :2], 30.0 * u - 3.45 * t, atol=1e-12)
    np.testing.assert_allclose(tangents[4, :2], t, atol=1e-12)
    # crystal 48 is ring 1 (z = -3.45 + 2.3)
    assert crystal_coords(SMALL, 48) == (0, 1, 0, 0)
    np.testing.assert_allclose(centres[48, 2], -1.15, atol=1e-12)
    assert sizes.shape == (192, 2) and (sizes == 2.0).all()
    # face points: 2 x 2 grid at +-0.5 mm (a quarter of the 2 mm face) around each centre
    pts = face_points(SMALL)
    assert pts.shape == (192, 4, 3)
    np.testing.assert_allclose(pts[0, 0], centres[0] - 0.5 * tangents[0] + [0, 0, -0.5], atol=1e-12)
    np.testing.assert_allclose(pts[0, 3], centres[0] + 0.5 * tangents[0] + [0, 0, 0.5], atol=1e-12)


def test_madpet2_preset_has_thesis_matrix2_dimensions():
    cfg = get_preset("madpet2")
    assert cfg.n_crystals == 1152
    assert cfg.shape == (1_327_104, 784_000)
    assert cfg.grid == (140, 140, 40)
    _, hi = box_bounds(cfg)
    # the grid fits inside the front layer (71 mm) and inside the rings' axial extent
    assert math.hypot(hi[0], hi[1]) < 71.0
    centres, _, sizes = crystal_faces(cfg)
    assert hi[2] <= centres[:, 2].max() + 0.5 * sizes[:, 1].max()


# --------------------------------------------------------------------------- invariants on rows


def test_rows_match_per_voxel_slab_reference(rng):
    """Every value of sampled tube rows equals the mean over rays of the slab chord through that voxel."""
    cfg = SMALL
    rows = rng.choice(cfg.n_lors, size=400, replace=False)
    a = trace_rows(cfg, rows)
    lo, hi = voxel_boxes(cfg)
    nonempty = np.flatnonzero(np.diff(a.indptr))[:40]
    assert len(nonempty) >= 20
    for q in nonempty:
        p0, p1 = tube_rays(cfg, int(rows[q]))
        ref = slab_chords(p0, p1, lo, hi).sum(axis=0) / len(p0)
        got = dense_row(a, q, cfg.n_voxels)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
        assert (got[ref <= 1e-7] == 0).all()


@pytest.mark.parametrize("preset, rays, count", [("small", None, 3000), ("madpet2", 1, 300), ("madpet2", 16, 60)])
def test_row_sums_equal_box_chords(preset, rays, count, rng):
    """Row sum == mean over the tube's rays of its chord through the grid's box (NumPy slab)."""
    cfg = get_preset(preset, rays=rays)
    rows = rng.choice(cfg.n_lors, size=count, replace=False)
    a = trace_rows(cfg, rows)
    lo, hi = box_bounds(cfg)
    row_of = np.repeat(np.arange(count), np.diff(a.indptr))
    sums = np.bincount(row_of, weights=a.data.astype(np.float64), minlength=count)
    ref = np.empty(count)
    for q, r in enumerate(rows):
        p0, p1 = tube_rays(cfg, int(r))
        ref[q] = slab_chords(p0, p1, lo[None], hi[None]).sum() / len(p0)
    assert (ref > 0).sum() >= count // 10  # the sample is not all empty rows
    np.testing.assert_allclose(sums, ref, rtol=2e-6, atol=1e-6)
    assert ((np.diff(a.indptr) == 0) == (ref <= 1e-6)).all()


# --------------------------------------------------------------------------- the generated file


def test_small_file_structure(small_file, small_matrix):
    path, summary = small_file
    a = small_matrix
    cfg = SMALL
    assert a.shape == cfg.shape == (36864, 3200)
    assert summary["nnz"] == a.nnz
    assert 1e5 <= a.nnz <= 2e6
    a.validate(path)
    assert a.indices.min() >= 0 and a.indices.max() < cfg.n_voxels
    # columns strictly increasing within each row (sorted, duplicates merged)
    d = np.diff(a.indices.astype(np.int64))
    row_start = np.zeros(a.nnz, dtype=bool)
    row_start[a.indptr[:-1][np.diff(a.indptr) > 0]] = True
    assert (d[~row_start[1:]] > 0).all()
    assert (a.data > 0).all() and a.data.dtype == np.float32
    # no value exceeds the longest chord through one voxel (its diagonal)
    assert a.data.max() <= math.sqrt(3.0) + 1e-6
    # i == j rows are empty
    n = cfg.n_crystals
    diag = np.arange(n) * n + np.arange(n)
    assert (a.indptr[diag + 1] == a.indptr[diag]).all()


def test_small_rows_symmetric_in_detector_pair(small_matrix):
    a = small_matrix
    n = SMALL.n_crystals
    r = np.arange(SMALL.n_lors)
    swapped = (r % n) * n + r // n
    b = a.to_scipy()[swapped]
    np.testing.assert_array_equal(b.indptr, a.indptr)
    np.testing.assert_array_equal(b.indices, a.indices)
    np.testing.assert_array_equal(b.data, a.data)  # bit-identical


def test_madpet2_rows_symmetric_in_detector_pair(rng):
    cfg = get_preset("madpet2", rays=16)
    n = cfg.n_crystals
    i, j = rng.integers(0, n, size=(2, 300))
    a = trace_rows(cfg, np.concatenate([i * n + j, j * n + i]))
    assert a.nnz > 0
    top = a.to_scipy()[:300]
    bottom = a.to_scipy()[300:]
    np.testing.assert_array_equal(top.indptr, bottom.indptr)
    np.testing.assert_array_equal(top.indices, bottom.indices)
    np.testing.assert_array_equal(top.data, bottom.data)


@pytest.mark.parametrize("threads", [1, 3])
def test_repeated_rows_trace_alike_on_any_thread_count(threads, rng):
    """A row asked for twice (one after the other, or far apart) is traced twice alike: the
    per-thread accumulator starts every row from zeros, whichever rows the thread traced before
    (the scratch once marked voxels with the row number, and a repeat on the same thread came
    out empty). Also through the one-pass arenas, with a chunk cut where a row does not fit."""
    from mlemlib.scanner.system import Tracer

    cfg = get_preset("madpet2", rays=16)
    once = rng.choice(cfg.n_lors, 40, replace=False)
    rows = np.concatenate([np.repeat(once, 2), once])
    ref = trace_rows(cfg, once, threads=1).to_scipy()
    expect = sp.vstack([ref[np.repeat(np.arange(40), 2)], ref]).tocsr()
    assert expect.nnz > 0
    for got in (trace_rows(cfg, rows, threads=threads), Tracer(cfg, threads).fill_prefix(rows, 10**9)):
        got = got.to_scipy()
        np.testing.assert_array_equal(got.indptr, expect.indptr)
        np.testing.assert_array_equal(got.indices, expect.indices)
        np.testing.assert_array_equal(got.data, expect.data)
    tracer = Tracer(cfg, threads)
    first = tracer.fill_prefix(rows, 1)  # each slot's first row only: the others are traced and dropped
    again = tracer.fill_prefix(rows, 10**9)
    assert 1 <= first.shape[0] < len(rows)  # rows were traced past the cut and dropped
    np.testing.assert_array_equal(again.to_scipy().indptr, expect.indptr)
    np.testing.assert_array_equal(again.to_scipy().data, expect.data)


def test_small_every_voxel_seen_by_many_lors(small_matrix):
    per_voxel = np.bincount(small_matrix.indices, minlength=SMALL.n_voxels)
    assert per_voxel.min() >= 20


def test_scanner_block_parses_back(small_file):
    path, _ = small_file
    with Csr4File(path) as f:
        g = f.geometry
        assert f.header.scanner_block == SMALL.scanner_block()
    assert g.grid == SMALL.grid
    assert g.voxel_size == pytest.approx(SMALL.voxel_size)
    assert (g.n_blocks, g.block_size, g.n_rings) == (12, 4, 4)
    assert g.layers[0] == pytest.approx((2.0, 2.0, 6.0, 30.0, 0.087))
    assert g.block_gaps == pytest.approx([0.3] * 3) and g.ring_gaps == pytest.approx([0.3] * 3)


def test_same_configuration_same_bytes(small_file, tmp_path):
    """Deterministic: bytes do not depend on the thread count or the chunk size."""
    path, _ = small_file
    again = tmp_path / "again.csr4"
    generate("small", again, threads=1, max_nnz=50_000)
    assert hashlib.sha256(again.read_bytes()).hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()


def test_one_pass_generation_equals_counted_rows_and_survives_cut_chunks(small_file, small_matrix, tmp_path):
    """The generator traces each row once into arenas; the rows equal the count-then-fill tracer's, and
    chunks cut where a row did not fit (a tiny max_nnz) change no byte."""
    _, summary = small_file
    ref = trace_rows("small", np.arange(SMALL.n_lors))  # counted, then filled into arrays of that size
    np.testing.assert_array_equal(small_matrix.indptr, ref.indptr)
    np.testing.assert_array_equal(small_matrix.indices, ref.indices)
    np.testing.assert_array_equal(small_matrix.data, ref.data)
    lengths = np.diff(ref.indptr)
    assert summary["empty_rows"] == int((lengths == 0).sum()) and summary["max_row_nnz"] == int(lengths.max())
    assert summary["unfolded_nnz"] == summary["nnz"] == ref.nnz
    cut = generate("small", tmp_path / "cut.csr4", threads=3, max_nnz=600)
    assert cut["fill_cut_chunks"] > 0
    assert (tmp_path / "cut.csr4").read_bytes() == small_file[0].read_bytes()


@pytest.mark.parametrize("preset, sample", [("small", None), ("madpet2", 4000), ("matrix3", 3000)])
def test_tube_clipping_finds_exactly_the_nonempty_rows(preset, sample, rng):
    """The scan that picks a folded matrix's stored rows (clipping only) agrees with the traced counts."""
    from mlemlib.scanner.system import Tracer, _resolve

    cfg = _resolve(preset, None)
    rows = np.arange(cfg.n_lors) if sample is None else np.sort(rng.choice(cfg.n_lors, sample, replace=False))
    tracer = Tracer(cfg, 2)
    hits = tracer.hits(rows)
    counts = tracer.count(rows)
    assert 0 < hits.sum() < len(rows)
    np.testing.assert_array_equal(hits, (counts > 0).astype(np.int8))


def test_rays_override_changes_the_tube(tmp_path):
    thin = trace_rows("small", np.arange(SMALL.n_lors), rays=1)
    tube = trace_rows("small", np.arange(SMALL.n_lors))
    assert 0 < thin.nnz < tube.nnz
    # tubes reach voxels the centre line misses; row sums stay close (the same chords on average)
    s_thin = thin.to_scipy().sum(axis=1).A.ravel()
    s_tube = tube.to_scipy().sum(axis=1).A.ravel()
    both = (s_thin > 5) & (s_tube > 5)
    assert np.median(np.abs(s_thin[both] - s_tube[both]) / s_tube[both]) < 0.1


def test_failed_generation_leaves_no_file(tmp_path, monkeypatch):
    from mlemlib.scanner import system

    calls = {"n": 0}
    real_fill = system.Tracer.fill_prefix

    def failing_fill(self, rows, max_nnz):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated failure")
        return real_fill(self, rows, max_nnz)

    monkeypatch.setattr(system.Tracer, "fill_prefix", failing_fill)
    out = tmp_path / "broken.csr4"
    with pytest.raises(RuntimeError, match="simulated"):
        generate("small", out, max_nnz=100_000)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- configuration errors


@pytest.mark.parametrize(
    "change, fault",
    [
        ({"rays": 15}, "rays = 15 is not a fourth power"),
        ({"block_gaps": (0.3,)}, "block_gaps has 1 entries, expected block_size - 1 = 3"),
        ({"ring_gaps": ()}, "ring_gaps has 0 entries"),
        ({"grid": (60, 60, 8)}, "not inside the innermost layer's radius 30"),
        ({"voxel_size": (1.0, 0.0, 1.0)}, "voxel_size"),
        ({"n_blocks": 40}, "overlap"),
        ({"layers": ()}, "at least one layer"),
    ],
)
def test_invalid_configuration_is_one_clear_error(change, fault):
    with pytest.raises(ConfigError, match=fault):
        dataclasses.replace(SMALL, **change).validate()


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'big'"):
        get_preset("big")


# --------------------------------------------------------------------------- command line


def test_cli_generate(tmp_path, capsys):
    out = tmp_path / "thin.csr4"
    assert mlem_main(["generate", "--preset", "small", "--rays", "1", "--threads", "1", "--out", str(out)]) == 0
    with Csr4File(out) as f:
        assert f.shape == SMALL.shape
        a = f.to_csr()
    b = trace_rows("small", np.arange(SMALL.n_lors), rays=1)
    np.testing.assert_array_equal(a.indptr, b.indptr)
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.data, b.data)
    assert f'"nnz": {b.nnz}' in capsys.readouterr().out


def test_cli_bad_rays_exits_2(tmp_path, capsys):
    out = tmp_path / "x.csr4"
    assert mlem_main(["generate", "--preset", "small", "--rays", "5", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlem: error: rays: rays = 5 is not a fourth power") and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize(("value", "fault"), [("0", "0: must be >= 1"), ("two", "two: not an integer")])
def test_cli_counts_must_be_positive_integers(tmp_path, capsys, value, fault):
    out = tmp_path / "x.csr4"
    with pytest.raises(SystemExit) as exc:
        mlem_main(["generate", "--preset", "small", "--threads", value, "--out", str(out)])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"mlem: error: argument -t/--threads: {fault}\n"
    assert not out.exists()


def test_cli_estimate_writes_nothing(tmp_path, capsys):
    assert mlem_main(["generate", "--preset", "small", "--estimate", "2000"]) == 0
    out = capsys.readouterr().out
    assert '"nnz_estimate"' in out and '"format": "csr"' in out and '"write_seconds_estimate"' in out


@pytest.mark.parametrize("fmt", ["csr", "compressed"])
def test_estimate_times_the_writer_of_the_format(tmp_path, monkeypatch, fmt):
    # With a format, the sample goes through generate's own writer into a temporary file (deleted after):
    # the wall time per core count is the count pass plus the longer of the fill tracing with the encoding
    # and the writer, so it is never below the tracing alone, the encoding alone, nor the writer.
    import tempfile

    from mlemlib.scanner import estimate
    from mlemlib.scanner.system import writer_cores

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    plain = estimate("small", sample=2000, threads=1)
    assert "write_seconds_estimate" not in plain and "wall_seconds_by_threads" not in plain
    res = estimate("small", sample=2000, threads=1, fmt=fmt)
    assert res["format"] == fmt and res["write_seconds_estimate"] > 0
    assert (res["encode_seconds_estimate"] > 0) == (fmt != "csr")  # only the compressed formats encode
    wall, tracing = res["wall_seconds_by_threads"], res["seconds_by_threads"]
    assert set(wall) == set(tracing)
    for k in wall:
        assert wall[k] >= tracing[k] * (1 - 1e-9) and wall[k] >= res["write_seconds_estimate"]
        # the tracing and the encoding share the cores the writer's threads leave (3 of 8 or more)
        assert wall[k] >= res["encode_seconds_estimate"] * res["threads"] / (int(k) - writer_cores(int(k))) * (1 - 1e-9)
    assert [writer_cores(k) for k in (1, 4, 7, 8, 32)] == [0, 0, 0, 1, 1]
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- matrix3, and the container written directly


def test_matrix3_preset_has_thesis_matrix3_dimensions():
    from mlemlib.scanner.presets import MAX_ROW_NNZ, NNZ

    cfg = get_preset("matrix3")
    assert cfg.n_crystals == 2304
    assert cfg.shape == (5_308_416, 2_592_000)
    assert cfg.grid == (180, 180, 80)
    _, hi = box_bounds(cfg)
    assert math.hypot(hi[0], hi[1]) < 71.0  # inside the front layer
    centres, _, sizes = crystal_faces(cfg)
    assert hi[2] <= centres[:, 2].max() + 0.5 * sizes[:, 1].max()  # inside the rings
    # the recorded estimate is within 1% of Matrix 3's 12,312,716,683 non-zeros
    assert abs(NNZ["matrix3"] / 12_312_716_683 - 1) < 0.01
    assert set(NNZ) == set(MAX_ROW_NNZ) == set(PRESETS)


def test_matrix3_estimate_from_a_small_sample():
    from mlemlib.scanner import estimate

    res = estimate("matrix3", sample=1500, threads=1)
    # a coarse sample: within 5% of the documented 60,000-row estimate
    assert abs(res["nnz_estimate"] / 12_366_460_674 - 1) < 0.05
    sizes = res["bytes_by_format"]
    assert sizes["csr4"] > sizes["csr"] * 0.99 > sizes["compressed"] > sizes["compressed-f16"]
    assert sizes["compressed-u16"] == sizes["compressed-f16"]  # the same slots: 16-bit values either way
    assert 4.9 < sizes["compressed"] / res["nnz_estimate"] < 5.5
    assert res["seconds_by_threads"]["32"] == pytest.approx(res["seconds_estimate"] / 32)
    assert res["max_row_nnz_sampled"] > res["mean_nnz_per_nonempty_row"]


@pytest.mark.parametrize("fmt", ["csr", "compressed", "compressed-f16", "compressed-u16"])
def test_generate_writes_the_container_directly(tmp_path, fmt):
    """An .h5 output is the container convert would make from the .csr4: same arrays, same checksum."""
    from mlemlib.formats import MatrixH5, convert

    generate("small", tmp_path / "a.csr4", threads=2, max_nnz=100_000)
    ref = convert(tmp_path / "a.csr4", tmp_path / "ref.h5", fmt=fmt)
    res = generate("small", tmp_path / "a.h5", threads=1, max_nnz=77_777, fmt=fmt)
    assert res["format"] == fmt and res["checksum"] == ref["checksum"]
    assert res["bytes"] == (tmp_path / "a.h5").stat().st_size
    with MatrixH5(tmp_path / "a.h5") as f, MatrixH5(tmp_path / "ref.h5") as g:
        assert f.grid == g.grid == SMALL.grid and f.voxel_size == g.voxel_size
        assert f.scanner_block == g.scanner_block and f.attrs["preset"] == "small"
        f.verify_checksum()
        a, b = f.to_csr(), g.to_csr()
    np.testing.assert_array_equal(a.indptr, b.indptr)
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.data, b.data)


def test_generate_refuses_a_format_its_file_cannot_hold(tmp_path):
    with pytest.raises(ConfigError, match="a .csr4 file holds CSR"):
        generate("small", tmp_path / "a.csr4", fmt="compressed")
    with pytest.raises(ConfigError, match="unknown matrix format"):
        generate("small", tmp_path / "a.h5", fmt="zip")
    assert list(tmp_path.iterdir()) == []


def test_cli_generate_compressed_container(tmp_path, capsys):
    out = tmp_path / "m.h5"
    assert mlem_main(["generate", "-p", "small", "-f", "compressed", "-o", str(out)]) == 0
    assert '"format": "compressed"' in capsys.readouterr().out
    from mlemlib.formats import MatrixH5

    with MatrixH5(out) as f:
        assert f.format == "compressed" and f.nnz == 742_368


@pytest.mark.parametrize("fmt", ["compressed", "csr"])
def test_generate_on_a_full_disk_is_one_error_and_no_file(tmp_path, monkeypatch, capsys, fmt):
    """A write that fails (a full disk: the writer's OSError, raised on its own thread) ends the CLI with
    one line naming the output and the fault, and leaves no file; the command then ends without the
    interpreter's teardown (`cli.run`), where HDF5 would crash on a file it could not flush."""
    import errno

    from mlemlib.formats import compressed_h5, h5

    calls = {"n": 0}

    def full(real):
        def write(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] > 1:
                raise OSError(errno.ENOSPC, "Can't synchronously write data\n(file write failed: ...)")
            return real(self, *args, **kwargs)

        return write

    monkeypatch.setattr(compressed_h5.CompressedH5Writer, "_append", full(compressed_h5.CompressedH5Writer._append))
    monkeypatch.setattr(h5.MatrixH5Writer, "write_rows", full(h5.MatrixH5Writer.write_rows))
    out = tmp_path / "m.h5"
    rc = mlem_main(["generate", "--preset", "small", "-o", str(out), "-f", fmt, "--max-nnz", "50000"])
    assert rc == 1 and calls["n"] >= 2  # the write after the first one failed
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"mlem: error: {out}: No space left on device"
    assert list(tmp_path.iterdir()) == []
    from mlemlib import cli

    assert cli._refused_write  # cli.run ends the process at once


@pytest.mark.parametrize("fmt", ["compressed", "csr"])
def test_convert_on_a_full_disk_names_its_output(tmp_path, monkeypatch, capsys, fmt):
    """Any stage that writes a matrix through a writer (here `convert`) ends on a failed write with one
    line naming its output (the writer names the OSError, not the stage), and leaves no file."""
    import errno

    from mlemlib.formats import compressed_h5, h5

    src = tmp_path / "src.csr4"
    assert mlem_main(["generate", "--preset", "small", "-o", str(src)]) == 0

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "Can't synchronously write data\n(file write failed: ...)")

    monkeypatch.setattr(compressed_h5.CompressedH5Writer, "_append", full)
    monkeypatch.setattr(h5.MatrixH5Writer, "write_rows", full)
    out = tmp_path / "out" / "m.h5"
    out.parent.mkdir()
    rc = mlem_main(["convert", str(src), "--out", str(out), "--format", fmt])
    assert rc == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"mlem: error: {out}: No space left on device"
    assert list(out.parent.iterdir()) == []
