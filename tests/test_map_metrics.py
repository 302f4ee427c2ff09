"""MAP convergence measured as PETRIC does (mlemlib.map_metrics): metrics on hand-built images, the time to
threshold on hand-built series, the phantom's regions against a brute-force rasterisation, the cached converged
image, and the per-pass recorder on a small CPU MAP run (test_map's 60-voxel problem)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from mlemlib import map_metrics as mm
from mlemlib.errors import ConfigError
from mlemlib.image import read_image, write_image
from mlemlib.map import MapSettings
from mlemlib.mlem import reconstruct
from mlemlib.problem import ModelSpec, RunSettings

GRID, N, M, S = (5, 4, 3), 60, 240, 8
RDP = MapSettings("rdp", beta=0.3, gamma=2.0, epsilon=2.0)


# --------------------------------------------------------------------------- the metrics
def _regions():
    """8 voxels: background 0-3, sphere a 4-5, sphere b 6-7, the object all of them."""
    idx = np.arange(8)
    return mm.MapRegions.of(np.ones(8, bool), idx < 4, {"a": (idx == 4) | (idx == 5), "b": idx >= 6})


def test_metrics_of_a_hand_built_image():
    ref = np.array([2, 2, 2, 2, 4, 4, 1, 1], float)
    img = np.array([2, 2, 2, 3, 4, 5, 1, 1], float)
    got = mm.pass_metrics(img, ref, _regions())
    # background: differences 0 0 0 1 -> RMSE sqrt(1/4) = 0.5 over ref's mean 2
    assert got["rmse_background"] == pytest.approx(0.25, rel=1e-15)
    # object: squared differences sum to 2 over 8 voxels -> RMSE 0.5 over ref's mean 18/8
    assert got["rmse_object"] == pytest.approx(2 / 9, rel=1e-15)
    # sphere a: mean 4.5 against 4; sphere b: equal
    assert got["spheres"] == {"a": pytest.approx(0.125, rel=1e-15), "b": 0.0}
    assert mm.pass_metrics(ref, ref, _regions()) == {"rmse_object": 0.0, "rmse_background": 0.0,
                                                     "spheres": {"a": 0.0, "b": 0.0}}


def test_metric_edge_cases():
    f, r = np.array([1.0, 2.0]), np.array([0.0, 0.0])
    assert math.isnan(mm.relative_rmse(f, r, [False, False]))
    assert mm.relative_rmse(f, r, [True, True]) == math.inf  # the converged mean is 0 and they differ
    assert mm.mean_error(r, r, [True, True]) == 0.0
    assert mm.mean_error([3.0], [-2.0], [True]) == 2.5  # divided by |mean(ref)|
    with pytest.raises(ValueError, match="sizes differ"):
        mm.pass_metrics(np.ones(7), np.ones(8), _regions())
    with pytest.raises(ValueError, match="differ in size"):
        mm.MapRegions.of(np.ones(8, bool), np.ones(7, bool))


def _m(p, obj, bg, **spheres):
    return {"pass": p, "rmse_object": obj, "rmse_background": bg, "spheres": spheres}


def test_time_to_threshold_first_pass_and_staying_below():
    series = [_m(1, 0.02, 0.005, a=0.001), _m(2, 0.009, 0.009, a=0.004),  # 2 holds
              _m(3, 0.009, 0.009, a=0.006),  # a sphere above 0.5%
              _m(4, 0.005, 0.001, a=0.001), _m(5, 0.001, 0.001, a=0.0)]
    seconds = [0.1, 0.2, 0.3, 0.4, 0.5]
    assert mm.time_to_threshold(series, seconds) == {"passes": 2, "seconds": pytest.approx(0.3, rel=1e-15)}
    assert mm.time_to_threshold(series, seconds, stay=True) == {"passes": 4, "seconds": pytest.approx(1.0, rel=1e-15)}
    # the thresholds are strict, NaN never holds, and a run that never meets them has None
    assert mm.time_to_threshold([_m(1, 0.01, 0.001, a=0.0)], [1.0]) is None
    assert mm.time_to_threshold([_m(1, 0.001, 0.001, a=0.005)], [1.0]) is None
    assert mm.time_to_threshold([_m(1, math.nan, 0.001)], [1.0]) is None
    assert mm.time_to_threshold([_m(1, 0.5, 0.5), _m(2, 0.02, 0.001)], [1.0, 1.0]) is None
    # no spheres: the RMSEs alone; the initial image (pass 0) costs no time
    assert mm.time_to_threshold([_m(0, 0.001, 0.001)], []) == {"passes": 0, "seconds": 0.0}
    # recorded every 2 passes: the time of every pass up to the one found
    assert mm.time_to_threshold([_m(2, 0.5, 0.5), _m(4, 0.001, 0.001)], [1.0, 2.0, 3.0, 4.0]) == {
        "passes": 4, "seconds": 10.0}
    # other thresholds
    assert mm.time_to_threshold([_m(1, 0.05, 0.05, a=0.01)], [2.0], rmse=0.1, sphere=0.02)["passes"] == 1
    with pytest.raises(ValueError, match="iteration times"):
        mm.time_to_threshold([_m(3, 0.0, 0.0)], [1.0, 1.0])


def test_regions_of_a_truth_against_a_brute_force_rasterisation(tmp_path):
    from mlemlib.phantom import phantom_shapes

    grid, vs = (16, 16, 6), (2.0, 2.0, 2.0)
    ph = phantom_shapes("nema", grid, vs)
    write_image(tmp_path / "truth.h5", np.ones(int(np.prod(grid)), np.float32), grid=grid, voxel_size=vs,
                attrs={"regions": ph.to_json()})
    reg = mm.regions_from_truth(tmp_path / "truth.h5")
    # the object: voxels whose every corner lies inside the body cylinder (radius and z range)
    body = ph.shapes[0]
    gx, gy, gz = grid
    want = np.zeros((gz, gy, gx), bool)
    for z in range(gz):
        for y in range(gy):
            for x in range(gx):
                xs = [(x + d - gx / 2) * vs[0] for d in (0, 1)]
                ys = [(y + d - gy / 2) * vs[1] for d in (0, 1)]
                zs = [(z + d - gz / 2) * vs[2] for d in (0, 1)]
                want[z, y, x] = (all(math.hypot(a - body.center[0], b - body.center[1]) <= body.radius
                                     for a in xs for b in ys) and min(zs) >= body.z0 and max(zs) <= body.z1)
    assert np.array_equal(reg.object, want.reshape(-1)) and reg.object.sum() > 0
    # spheres only (the lung cylinder is not one); each inside the object, apart from the background
    assert sorted(reg.spheres) == ["cold1", "cold2", "hot1", "hot2", "hot3", "hot4"]
    for m in reg.spheres.values():
        assert not (m & reg.background).any() and not (m & ~reg.object).any()
    assert not (reg.background & ~reg.object).any()
    write_image(tmp_path / "plain.h5", np.ones(int(np.prod(grid)), np.float32), grid=grid, voxel_size=vs)
    with pytest.raises(ConfigError, match="no phantom regions"):
        mm.regions_from_truth(tmp_path / "plain.h5")


# --------------------------------------------------------------------------- runs (test_map's problem)
@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from test_map import write_case

    d = tmp_path_factory.mktemp("mapm")
    _, g, _, _, truth = write_case(d)
    kw = {"subsets": S, "subset_file": d / "subsets.i32", "multiplicative": d / "m.f32", "additive": d / "b.f32"}
    idx = np.arange(N)
    spheres = {"s1": np.isin(idx, [7, 8, 12, 13]), "s2": np.isin(idx, [27, 28])}
    regions = mm.MapRegions.of(np.ones(N, bool), ~np.isin(idx, [7, 8, 12, 13, 27, 28]), spheres)
    return {"dir": d, "g": g, "kw": kw, "regions": regions, "truth": truth}


def test_converged_image_is_cached_by_problem_and_passes(case, tmp_path, monkeypatch):
    import mlemlib.mlem

    d, kw = case["dir"], case["kw"]
    cache = tmp_path / "converged.h5"
    img, attrs = mm.converged_map(ModelSpec(d / "a.h5", case["g"], map=RDP, **kw), cache, passes=30)
    # the same as the float64 BSREM of the prior with the converged image's preconditioner and relaxation
    # (not the run's em preconditioner and default relaxation), run directly
    direct = tmp_path / "direct.h5"
    conv = dataclasses.replace(RDP, preconditioner="hessian", relaxation=(1.0, 40.0))
    assert mm.converged_settings(RDP) == conv and conv != RDP
    reconstruct(ModelSpec(d / "a.h5", case["g"], map=conv, **kw),
                RunSettings(30, checkpoint_every=0, reference_mode=True), direct)
    want, want_attrs = read_image(direct)
    assert np.array_equal(img, want) and img.dtype == np.float64
    assert attrs["problem"] == want_attrs["problem"] and attrs["iterations"] == 30
    assert json.loads(attrs["converged_map"])["algorithm"] == "bsrem" and math.isfinite(attrs["phi"])

    calls = []
    real = mlemlib.mlem.reconstruct
    monkeypatch.setattr(mlemlib.mlem, "reconstruct", lambda *a, **k: calls.append(1) or real(*a, **k))
    # second call: read from the file; an OSL setting of the same prior converges to the same image (BSREM's)
    again, _ = mm.converged_map(ModelSpec(d / "a.h5", case["g"], map=MapSettings(
        "rdp", beta=0.3, gamma=2.0, epsilon=2.0, algorithm="osl"), **kw), cache, passes=30)
    assert calls == [] and np.array_equal(again, img)
    # another problem (beta), another pass count, other counts: each recomputed, never the cached image
    other, o_attrs = mm.converged_map(ModelSpec(d / "a.h5", case["g"], map=MapSettings(
        "rdp", beta=0.6, gamma=2.0, epsilon=2.0), **kw), cache, passes=30)
    assert calls == [1] and o_attrs["problem"] != attrs["problem"] and not np.array_equal(other, img)
    mm.converged_map(ModelSpec(d / "a.h5", case["g"], map=RDP, **kw), cache, passes=31)
    assert calls == [1, 1]
    mm.converged_map(ModelSpec(d / "a.h5", case["g"] + 1, map=RDP, **kw), cache, passes=31)
    assert calls == [1, 1, 1] and read_image(cache)[1]["problem"] != attrs["problem"]


def test_the_fingerprint_is_the_one_a_run_records_also_for_a_reordered_matrix(case, tmp_path):
    from mlemlib.reorder import reorder_file

    d, kw = case["dir"], case["kw"]
    reorder_file(d / "a.h5", tmp_path / "r.h5", "rows+voxels", subsets=S, subset_file=d / "subsets.i32")
    for matrix in (d / "a.h5", tmp_path / "r.h5"):
        model = ModelSpec(matrix, case["g"], map=RDP, **kw)
        reconstruct(model, RunSettings(1, checkpoint_every=0, backend="cpu"), tmp_path / "run.h5", raw_out=False,
                    timings_out=False)
        assert mm.problem_fingerprint_of(model) == read_image(tmp_path / "run.h5")[1]["problem"]
    plain = mm.problem_fingerprint_of(ModelSpec(d / "a.h5", case["g"], map=RDP))
    assert plain != mm.problem_fingerprint_of(ModelSpec(d / "a.h5", case["g"], map=RDP, **kw))


def test_the_recorder_measures_each_pass_of_a_cpu_map_run(case, tmp_path):
    d, kw = case["dir"], case["kw"]
    ref = case["truth"] * 1.01  # any fixed image of the problem's size will do as the yardstick here
    images = []
    rec = mm.MetricsRecorder(ref, case["regions"], every=2, repetition=1)

    def both(rep, it, image):
        if rep == 1:
            images.append(np.array(image, dtype=np.float64))
        rec(rep, it, image)

    reconstruct(ModelSpec(d / "a.h5", case["g"], map=RDP, **kw),
                RunSettings(6, repetitions=2, checkpoint_every=0, backend="cpu"), tmp_path / "run.h5", progress=both)
    r = rec.record()
    assert r["passes"] == [2, 4, 6] and r["repetition"] == 1 and r["every"] == 2
    for k, p in enumerate(r["passes"]):  # each pass's values are those of that pass's image, by hand
        f = images[p - 1]
        bg = case["regions"].background
        assert r["rmse_background"][k] == pytest.approx(
            np.sqrt(np.mean((f[bg] - ref[bg]) ** 2)) / ref[bg].mean(), rel=1e-12)
        assert r["rmse_object"][k] == pytest.approx(np.sqrt(np.mean((f - ref) ** 2)) / ref.mean(), rel=1e-12)
        s1 = case["regions"].spheres["s1"]
        assert r["spheres"]["s1"][k] == pytest.approx(abs(f[s1].mean() - ref[s1].mean()) / ref[s1].mean(), rel=1e-12)
    final, _ = read_image(tmp_path / "run.h5")
    assert mm.pass_metrics(final, ref, case["regions"])["rmse_object"] == pytest.approx(r["rmse_object"][-1],
                                                                                       rel=1e-12)


def test_a_run_with_metrics_writes_them_and_the_summary_reads_them(case, tmp_path):
    """On a reordered matrix (the device image in the permuted order): the metrics are of the user's image,
    against the cached converged image; timings.json carries them; the summary gives the time to threshold."""
    from mlemlib.reorder import reorder_file
    from mlemlib.report import summarize

    d, kw = case["dir"], case["kw"]
    reorder_file(d / "a.h5", tmp_path / "r.h5", "rows+voxels", subsets=S, subset_file=d / "subsets.i32")
    ref, _ = mm.converged_map(ModelSpec(d / "a.h5", case["g"], map=RDP, **kw), tmp_path / "conv.h5", passes=200)
    # a truth whose phantom is a uniform body over the 5 x 4 x 3 grid (every voxel inside it), no spheres
    from mlemlib.phantom import Cylinder, Phantom

    ph = Phantom("uniform", [Cylinder((0.0, 0.0), 10.0, -5.0, 5.0, 1.0, "background")])
    write_image(tmp_path / "truth.h5", case["truth"], grid=GRID, voxel_size=(1.0, 1.0, 1.0),
                attrs={"regions": ph.to_json()})
    out = tmp_path / "run" / "image.h5"
    t = mm.reconstruct_with_metrics(ModelSpec(tmp_path / "r.h5", case["g"], map=RDP, **kw),
                                    RunSettings(60, checkpoint_every=0, backend="cpu"), out,
                                    converged=tmp_path / "conv.h5", truth=tmp_path / "truth.h5")
    stored = json.loads((out.parent / "timings.json").read_text())
    m = stored["map"]["metrics"]
    assert m == t["map"]["metrics"] and m["format"] == mm.METRICS_FORMAT and m["passes"] == list(range(1, 61))
    assert m["reference"]["image"] == str(tmp_path / "conv.h5") and m["reference"]["passes"] == 200
    final, _ = read_image(out)
    regions = mm.regions_from_truth(tmp_path / "truth.h5")
    assert regions.object.all() and regions.spheres == {}
    assert m["rmse_object"][-1] == pytest.approx(mm.pass_metrics(final, ref, regions)["rmse_object"], rel=1e-12)
    assert m["rmse_object"][-1] < 0.01 < m["rmse_object"][0]
    want = mm.time_to_threshold(mm.series(m), stored["repetitions"][0]["samples"]["iteration"])
    assert want is not None and 1 < want["passes"] < 60

    r = summarize([out.parent], tmp_path / "s")
    md = (tmp_path / "s" / "summary.md").read_text()
    assert "## MAP" in md and "time to threshold (s)" in md
    section = md.split("## MAP", 1)[1].split("\n## ", 1)[0]
    line = next(ln for ln in section.splitlines() if "BSREM rdp beta=0.3" in ln and ln.startswith("| cpu"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "60" and float(cells[2]) == pytest.approx(stored["map"]["history"][-1]["phi"], rel=1e-8)
    assert float(cells[3]) == pytest.approx(want["seconds"], rel=5e-3) and cells[4] == str(want["passes"])
    assert {p.rsplit("/", 1)[-1] for p in r["plots"]} >= {"map_objective.png", "map_metrics.png"}
