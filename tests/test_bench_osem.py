"""Tests of the benchmarks' OSEM subsets and synthetic factors (host side): the cases' ``subsets`` and ``factors``,
the grouped matrix and its sensitivities, the synthetic problem, the rows' ratios, the page's columns; the GPU
case skips without CuPy."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from mlemlib.bench import runner
from mlemlib.bench.cases import Case, MatrixSpec, load_cases, parse_cases
from mlemlib.bench.factors import BACKGROUND_FRACTION, bench_problem, synthetic_factors
from mlemlib.bench.page import build_page
from mlemlib.bench.prepare import prepare
from mlemlib.cli import main
from mlemlib.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
CASES = REPO / "perf" / "cases.yaml"
TOR = (16, 16, 4, 12, 16)


def _doc(**case):
    return {"cases": [{"name": "c", "matrix": {"tor": [4, 4, 2, 3, 3]}, **case}]}


# --------------------------------------------------------------------------- the cases file
def test_the_osem_cases_of_the_repository():
    cases = {c.name: c for c in load_cases(CASES)}
    osem = cases["madpet2-osem"]
    assert (osem.matrix.preset, osem.fold, osem.order, osem.format) == ("madpet2", True, "reordered", "compressed")
    assert osem.kernels == (("auto", "auto"),) and osem.graph and osem.gpus == (1, 2, 4)
    assert osem.subsets == (1, 16) and osem.factors == ("none", "synthetic") and osem.osem
    assert osem.variants() == [(1, "none"), (1, "synthetic"), (16, "none"), (16, "synthetic")]
    assert osem.pairs(16, "none") == osem.pairs(1, "synthetic") == list(osem.kernels)
    # S = 1 is the matrix of madpet2-folded-reordered-auto (prepared once); S = 16 a directory of its own
    assert osem.matrix_key() == cases["madpet2-folded-reordered-auto"].matrix_key() != osem.matrix_key(16)
    smoke = cases["smoke-osem"]
    assert smoke.backend == "cpu" and smoke.subsets == (1, 4) and smoke.factors == ("none", "synthetic")
    for name in ("smoke", "madpet2-own-csr", "matrix3-onepass", "tor-1e9-random"):
        c = cases[name]
        assert (c.subsets, c.factors, c.osem) == ((1,), ("none",), False)
        assert "subsets" not in c.matrix_settings()


@pytest.mark.parametrize("case, where", [
    ({"subsets": [0]}, "case c: subsets"),
    ({"subsets": []}, "case c: subsets"),
    ({"subsets": "many"}, "case c: subsets"),
    ({"subsets": [1, 2.5]}, "case c: subsets"),
    ({"subsets": True}, "case c: subsets"),
    ({"subsets": [1, 4], "layout": "thesis"}, "case c: subsets"),
    ({"factors": "both"}, "case c: factors"),
    ({"factors": []}, "case c: factors"),
    ({"factors": ["none", "measured"]}, "case c: factors"),
    ({"factors": 1}, "case c: factors"),
])
def test_bad_subsets_and_factors_are_one_error_naming_the_file_case_and_key(case, where):
    with pytest.raises(ConfigError) as exc:
        parse_cases(_doc(**case), "perf/x.yaml")
    msg = str(exc.value)
    assert msg.startswith(f"perf/x.yaml: {where}: "), msg
    assert "\n" not in msg


def test_a_bad_default_is_named_in_the_case_and_the_cli_refuses_it_in_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"^f.yaml: case c: factors: expected none or synthetic"):
        parse_cases({"defaults": {"factors": "random"}, **_doc()}, "f.yaml")
    path = tmp_path / "cases.yaml"
    path.write_text(yaml.safe_dump(_doc(subsets=[1, 0])))
    assert main(["bench", "run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mlem: error: {path}: case c: subsets: expected an integer >= 1")


def test_one_value_is_a_list_of_one_and_the_defaults_are_mlem():
    c = parse_cases(_doc(subsets=8, factors="synthetic"), "f.yaml")[0]
    assert (c.subsets, c.factors, c.variants()) == ((8,), ("synthetic",), [(8, "synthetic")])
    c = parse_cases(_doc(subsets=[16, 1, 16], factors=["synthetic", "none"]), "f.yaml")[0]
    assert c.subsets == (16, 1) and c.variants()[0] == (1, "none")
    plain = parse_cases(_doc(), "f.yaml")[0]
    assert (plain.subsets, plain.factors, plain.osem) == ((1,), ("none",), False)
    cuda = parse_cases(_doc(subsets=[1, 4]), "f.yaml")[0]
    assert cuda.pairs(1, "none")[-1] == ("cusparse", "cusparse")  # the reference beside MLEM only
    assert ("cusparse", "cusparse") not in cuda.pairs(4, "none") + cuda.pairs(1, "synthetic")


# --------------------------------------------------------------------------- the prepared matrix and problem
def test_the_grouped_matrix_is_the_reorder_stages_with_the_norm_stages_sensitivities(tmp_path):
    import h5py

    from mlemlib.formats import open_matrix
    from mlemlib.norm import compute_norm
    from mlemlib.subsets import update_norms

    case = Case(name="s", matrix=MatrixSpec(tor=(8, 8, 2, 6, 8)), backend="cpu", kernels=(("auto", "onepass"),))
    plain, grouped = prepare(case, tmp_path), prepare(case, tmp_path, subsets=4)
    assert plain.directory != grouped.directory and grouped.subsets == 4 and plain.bounds is None
    m = int(plain.facts["shape"][0])
    bounds = np.load(grouped.bounds)
    np.testing.assert_array_equal(bounds, np.arange(5) * m // 4)  # no scanner: row i in subset i mod 4
    assert grouped.facts["subset_method"] == "index"
    a, b = open_matrix(plain.matrix), open_matrix(grouped.matrix)
    rows_a, rows_b = a.read_rows(0, m).to_scipy(), b.read_rows(0, m).to_scipy()
    for k in range(4):  # subset k holds the rows k, k + 4, ... in their own order
        assert (rows_b[bounds[k]:bounds[k + 1]] != rows_a[k::4]).nnz == 0
    compute_norm(grouped.matrix, tmp_path / "norm.h5")
    with h5py.File(tmp_path / "norm.h5") as f:
        np.testing.assert_array_equal(np.load(grouped.subset_norms), f["subset_norms"][()])
    p = bench_problem(grouped)
    assert p.background is None and p.backend_options().keys() == {"subsets"}
    np.testing.assert_array_equal(p.norm, update_norms(np.load(grouped.subset_norms)))
    assert bench_problem(plain).backend_options() == {}


def test_a_reordered_case_keeps_its_locality_order_inside_each_subset(tmp_path):
    from mlemlib.formats import open_matrix
    from mlemlib.reorder import permutation_of

    case = Case(name="r", matrix=MatrixSpec(tor=(8, 8, 2, 6, 8)), order="reordered", backend="cpu")
    plain, grouped = prepare(case, tmp_path), prepare(case, tmp_path, subsets=4)
    p1, p4 = permutation_of(plain.matrix), permutation_of(grouped.matrix)
    np.testing.assert_array_equal(p4.voxels, p1.voxels)
    rows1 = np.asarray(p1.rows)
    order = np.concatenate([rows1[rows1 % 4 == k] for k in range(4)])  # the source's row i is in subset i mod 4
    np.testing.assert_array_equal(p4.rows, order)
    m = int(plain.facts["shape"][0])
    a, b = open_matrix(plain.matrix).read_rows(0, m).to_scipy(), open_matrix(grouped.matrix).read_rows(0, m).to_scipy()
    where = np.argsort(rows1)[order]  # each grouped row's place in the S = 1 matrix
    assert (b != a[where]).nnz == 0


def test_synthetic_factors_weight_the_sensitivities_and_are_cached(tmp_path, monkeypatch):
    from mlemlib.corrections import background
    from mlemlib.formats import open_matrix
    from mlemlib.norm import sensitivities
    from mlemlib.subsets import update_norms

    m = synthetic_factors(100_000, 3)
    assert m.dtype == np.float32 and 0.005 < np.mean(m == 0) < 0.015
    assert m[m > 0].min() >= 0.2 and m.max() < 1.0
    np.testing.assert_array_equal(m, synthetic_factors(100_000, 3))
    case = Case(name="s", matrix=MatrixSpec(tor=TOR), backend="cpu", seed=3)
    prep = prepare(case, tmp_path, subsets=3)
    p = bench_problem(prep, "synthetic", 3)
    g0 = np.load(prep.g)
    mf = synthetic_factors(g0.size, 3)
    b = BACKGROUND_FRACTION * float((mf.astype(np.float64) * g0).mean())
    np.testing.assert_allclose(p.g, mf * g0.astype(np.float64) + b, rtol=1e-6)
    np.testing.assert_array_equal(p.background, background(mf, np.full(g0.size, b, dtype=np.float32), g0.size))
    assert np.isinf(p.background).sum() == (mf == 0).sum() > 0
    sk = sensitivities(open_matrix(prep.matrix), np.load(prep.bounds), mf.astype(np.float64))
    np.testing.assert_array_equal(p.norm, update_norms(sk))
    one = bench_problem(prepare(case, tmp_path), "synthetic", 3)
    assert one.subsets is None and one.norm.shape == (prep.facts["shape"][1],) and one.norm.dtype == np.float64
    monkeypatch.setattr("mlemlib.bench.factors.subset_sensitivities", lambda *a, **k: pytest.fail("computed again"))
    again = bench_problem(prep, "synthetic", 3)
    np.testing.assert_array_equal(again.norm, p.norm)


# --------------------------------------------------------------------------- end to end on the CPU
def test_the_cpu_osem_case_through_mlem_bench_run_and_page(tmp_path, capsys):
    out, work = tmp_path / "results", tmp_path / "work"
    assert main(["bench", "prepare", str(CASES), "--case", "smoke-osem", "--work", str(work)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and printed[1].endswith("(S = 4)")
    assert main(["bench", "run", str(CASES), "--case", "smoke-osem", "--out", str(out), "--work", str(work)]) == 0
    doc = json.loads((out / "results.json").read_text())
    rows = doc["rows"]
    assert len(rows) == 8 and not any(r.get("error") for r in rows)
    assert {(r["subsets"], r["factors"]) for r in rows} == {(1, "none"), (1, "synthetic"), (4, "none"), (4, "synthetic")}
    with open(out / "results.csv", newline="") as fh:
        assert tuple(next(csv.reader(fh))) == runner.FIELDS + runner.OSEM_FIELDS
    by = {(r["subsets"], r["factors"], r["bp"]): r for r in rows}
    for (s, f, bp), r in by.items():
        assert r["ms"] > 0 and r["finite"] is True and r["steps_ms"]["iteration"] > 0
        assert r["describe"]["subsets"] == s and r["describe"]["background"] is (f == "synthetic")
        if s > 1:
            assert r["ms_mlem"] == by[(1, f, bp)]["ms"] and math.isfinite(r["pass_vs_mlem"]) and r["pass_vs_mlem"] > 0
        else:
            assert "pass_vs_mlem" not in r
        if f == "synthetic":
            assert r["ms_no_factors"] == by[(s, "none", bp)]["ms"] and math.isfinite(r["factors_vs_none"])
        else:
            assert "factors_vs_none" not in r
    page = tmp_path / "performance.md"
    assert main(["bench", "page", str(out), "--out", str(page)]) == 0
    text = page.read_text()
    assert ("| configuration | S | m, b | GPUs | ms per iteration (S > 1: per pass) | pass / MLEM iteration | "
            "with m, b / without | all-reduce share |") in text
    line = next(ln for ln in text.splitlines() if ln.startswith("| auto/onepass (onepass) | 4 | synthetic | 1 |"))
    cells = line.split(" | ")
    assert cells[5].endswith("x") and cells[6].endswith("x") and cells[7] == "-"  # no all-reduce on the CPU


def test_osem_rows_relate_within_their_run_and_merge_by_s_and_factors(tmp_path):
    def row(s, f, gpus, ms, **kw):
        return {"case": "o", "fp": "auto", "bp": "auto", "gpus": gpus, "device_kind": "2 x GPU", "date": "d",
                "command": "c", "subsets": s, "factors": f, "ms": ms, **kw}

    rows = [row(1, "none", 1, 2.0), row(1, "none", 2, 1.2), row(16, "none", 1, 2.2), row(16, "none", 2, 1.5),
            row(16, "synthetic", 2, 1.53), row(1, "synthetic", 2, 1.25), row(16, "synthetic", 1, None, error="x")]
    runner.fill_relations(rows)
    assert rows[3]["speedup"] == pytest.approx(2.2 / 1.5) and rows[3]["pass_vs_mlem"] == pytest.approx(1.5 / 1.2)
    assert rows[4]["pass_vs_mlem"] == pytest.approx(1.53 / 1.25) and rows[4]["factors_vs_none"] == pytest.approx(1.02)
    assert "speedup" not in rows[4]  # its 1-GPU row was not timed
    assert "pass_vs_mlem" not in rows[1] and "factors_vs_none" not in rows[2]
    runner.write_results(tmp_path, rows)
    doc = runner.write_results(tmp_path, [row(16, "none", 2, 1.4, date="e")])
    assert len(doc["rows"]) == len(rows)
    assert [r["ms"] for r in doc["rows"] if (r["subsets"], r["factors"], r["gpus"]) == (16, "none", 2)] == [1.4]
    # a row without the keys is S = 1 without factors
    old = {k: v for k, v in row(1, "none", 1, 9.0).items() if k not in ("subsets", "factors")}
    assert runner.merge_rows([old], [row(1, "none", 1, 2.0)]) == [row(1, "none", 1, 2.0)]


def test_the_page_shows_the_osem_columns_only_for_a_case_that_has_them():
    plain = {"case": "p", "fp": "auto", "bp": "auto", "gpus": 1, "ms": 1.0, "device_kind": "k", "device": "GPU",
             "of_floor": 0.5}
    osem = [{**plain, "case": "o", "subsets": 1, "factors": "none"},
            {**plain, "case": "o", "subsets": 16, "factors": "none", "ms": 1.1, "pass_vs_mlem": 1.1,
             "allreduce_share": 0.125, "gpus": 2},
            {**plain, "case": "o", "subsets": 16, "factors": "synthetic", "ms": None, "error": "out of memory"}]
    page = build_page([plain, *osem])
    plain_table = page.split("## p on k")[1]
    osem_table = page.split("## o on k")[1].split("## ")[0]
    assert "| S |" not in plain_table and "| configuration | GPUs | ms per iteration |" in plain_table
    assert "| auto | 16 | - | 2 | 1.100 | 1.10x | - | 12.5% | 50.0% |" in osem_table
    err = next(ln for ln in osem_table.splitlines() if "not run" in ln)
    assert err.startswith("| auto | 16 | synthetic | 1 | not run: out of memory |")
    head = next(ln for ln in osem_table.splitlines() if ln.startswith("| configuration"))
    assert err.count("|") == head.count("|")
    assert "*Pass / MLEM iteration*" in page
    assert "*Pass / MLEM iteration*" not in build_page([plain])


# --------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
def test_an_osem_case_on_the_gpu_times_passes_with_their_step_times(tmp_path):
    from mlemlib.bench.runner import Devices, run_cases

    gpus = [1, 2] if Devices().gpu_count() >= 2 else [1]
    cases = parse_cases(_doc(matrix={"tor": list(TOR)}, order="reordered", format="compressed",
                             kernels=["auto", "onepass_fixed"], subsets=[1, 4], factors=["none", "synthetic"],
                             gpus=gpus, graph=True, cusparse=False, warmup=2, iterations=3, repeats=2), "f.yaml")
    rows = run_cases(cases, tmp_path / "out", work=tmp_path / "work")
    assert len(rows) == 8 * len(gpus) and not [r["error"] for r in rows if r.get("error")]
    for r in rows:
        assert r["ms"] > 0 and r["finite"] and r["steps_ms"]["iteration"] > 0
        if r["subsets"] > 1:
            assert r["pass_vs_mlem"] > 0 and r["describe"]["subsets"] == 4
        if r["gpus"] > 1:
            assert 0 <= r["allreduce_share"] < 1


def test_step_times_and_the_allreduce_share_come_from_kernel_by_kernel_iterations_under_graphs():
    from mlemlib.bench.timing import time_iterations

    class Fake:
        """A backend whose graph replay reports only the iteration, and 1 ms of its 4 ms all-reduce eagerly."""

        def __init__(self):
            self.graph = True

        def initial_image(self):
            return np.ones(3, dtype=np.float32)

        def iterate(self, f):
            return f

        def last_step_times(self):
            if self.graph:
                return {"iteration": 0.003}
            return {"bp": 0.002, "allreduce": 0.001, "update": 0.001, "iteration": 0.004}

        def to_host(self, f):
            return f

        def use_graph(self, on):
            self.graph = on

    be = Fake()
    timed = time_iterations(be, warmup=1, iterations=2, repeats=2, steps=True)
    assert timed["ms"] == pytest.approx(3.0) and "allreduce_share" not in timed
    case = Case(name="o", matrix=MatrixSpec(tor=TOR), subsets=(1, 4), iterations=2)
    eager = runner._eager_steps(case, be)
    assert eager["allreduce_share"] == pytest.approx(0.25) and eager["allreduce_ms"] == pytest.approx(1.0)
    assert eager["steps_iteration_ms"] == pytest.approx(4.0) and eager["steps_from"] == "kernel by kernel"
    assert set(eager["steps_ms"]) == {"bp", "allreduce", "update", "iteration"}


def test_the_cpu_map_case_times_bsrem_passes_beside_osem(tmp_path):
    """The smoke-map case: a BSREM pass with the RDP beside the same configuration's OSEM pass (prior_vs_none), a
    row per prior; the page has the MAP column; a prior name that is not one is refused naming the key."""
    out, work = tmp_path / "results", tmp_path / "work"
    assert main(["bench", "run", str(CASES), "--case", "smoke-map", "--out", str(out), "--work", str(work)]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert not any(r.get("error") for r in rows)
    by = {r["prior"]: r for r in rows}
    assert set(by) == {"none", "rdp", "rdp-fast"}
    assert by["rdp"]["describe"]["map"]["algorithm"] == "bsrem" and "map" not in by["none"]["describe"]
    assert (by["rdp"]["describe"]["map"]["preconditioner"], by["rdp"]["describe"]["map"]["averaging"]) == ("em", "last")
    fast = by["rdp-fast"]["describe"]["map"]
    assert (fast["preconditioner"], fast["preconditioner_offset"], fast["relaxation"], fast["averaging"]) == (
        "hessian", 0.35, [1.0, 30.0], "last")
    assert fast["subset_halving"] == []  # every timed pass runs all S sub-iterations
    for p in ("rdp", "rdp-fast"):
        assert by[p]["ms_no_prior"] == by["none"]["ms"] and by[p]["prior_vs_none"] > 0
    assert len(list(work.rglob("voxel_perm.npy"))) == 1  # the reordered case's voxel order, which the prior follows
    assert "prior_vs_none" not in by["none"]
    page = tmp_path / "performance.md"
    assert main(["bench", "page", str(out), "--out", str(page)]) == 0
    text = page.read_text()
    assert "| MAP pass / OSEM pass |" in text.splitlines()[next(i for i, ln in enumerate(text.splitlines())
                                                            if ln.startswith("| configuration"))]
    assert "| BSREM, rdp |" in text and "| BSREM, rdp-fast |" in text
    with pytest.raises(ConfigError, match=r"^f.yaml: case c: prior: expected none, rdp or rdp-fast"):
        parse_cases(_doc(prior="tv"), "f.yaml")
