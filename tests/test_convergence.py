"""The convergence study (issue 39): passes to reach MLEM's contrast recovery, the study on the small preset, the bias
of ignoring m and b, the summary's table and figure, the workflow's rule; and runs.csv's model columns (CPU only)."""

from __future__ import annotations

import copy
import csv
import json
import math

import numpy as np
import pytest

from mlemlib.convergence import passes_to_reach, read_study, study, study_rows
from mlemlib.errors import ConfigError, InputError
from mlemlib.phantom import ScannerEffects, simulate
from mlemlib.report import summarize
from mlemlib.report.rows import config_label, model_columns, run_rows
from test_workflow import TINY, dry_run, snakemake


# ------------------------------------------------------------------ passes to reach


def test_passes_to_reach_is_the_first_recorded_pass_at_or_above_the_target():
    passes = [1, 2, 3, 4, 5, 6]
    crc = [0.1, 0.25, 0.4, 0.38, 0.5, 0.45]
    assert passes_to_reach(passes, crc, 0.4) == 3  # reached exactly
    assert passes_to_reach(passes, crc, 0.39) == 3
    assert passes_to_reach(passes, crc, 0.45) == 5  # not the dip back below at 4
    assert passes_to_reach(passes, crc, 0.6) is None  # never
    assert passes_to_reach(passes, crc, None) is None and passes_to_reach(passes, crc, math.nan) is None
    # every k passes: the answer is a recorded pass (an upper bound)
    assert passes_to_reach([5, 10, 15], [0.2, 0.41, 0.5], 0.4) == 10
    # NaN values (an empty region) never count
    assert passes_to_reach([1, 2], [math.nan, 0.5], 0.4) == 2


def _series(s, corrected, crc, error=None):
    n = len(crc)
    return {"subsets": s, "corrected": corrected, "passes": list(range(1, n + 1)), "crc_hot": crc,
            "crc_cold": [0.5] * n, "rel_error": error or [0.3] * n, "centre_to_edge": [1.0] * n,
            "contrast_recovery": [{}] * n, "profile": [0.0, 1.0], "seconds": 0.1}


def test_a_multi_gpu_or_osem_image_is_measured_by_its_first_copy():
    """The multi-GPU and OSEM backends hand the study a list (the same image on every GPU): it is measured by
    its first entry; a device array by its get(), a NumPy array as it is."""
    from mlemlib.convergence import _host

    class Device:
        def __init__(self, a):
            self.a = a

        def get(self):
            return self.a.copy()

    a = np.arange(4.0)
    assert _host(a) is a
    np.testing.assert_array_equal(_host(Device(a)), a)
    np.testing.assert_array_equal(_host([Device(a), Device(a + 1)]), a)
    np.testing.assert_array_equal(_host((a, a + 1)), a)


def test_study_rows_count_against_the_corrected_mlem_run_after_its_last_pass():
    record = {"matrix": "m", "data": "d", "series": [
        _series(1, True, [0.1, 0.2, 0.3, 0.35]),
        _series(1, False, [0.2, 0.4, 0.5, 0.6]),
        _series(8, True, [0.3, 0.36, 0.4, 0.41], error=[0.5, 0.2, 0.25, 0.3]),
        _series(16, True, [0.2, 0.3, 0.34, 0.33]),
    ]}
    rows = {(r["subsets"], r["corrections"]): r for r in study_rows([record])}
    assert rows[(1, "modelled")]["passes_to_mlem_crc"] == 4 and rows[(1, "modelled")]["mlem_crc_hot"] == 0.35
    assert rows[(8, "modelled")]["passes_to_mlem_crc"] == 2
    assert rows[(16, "modelled")]["passes_to_mlem_crc"] is None  # never reached
    assert rows[(1, "ignored")]["passes_to_mlem_crc"] is None  # not counted for the biased runs
    assert rows[(8, "modelled")]["min_rel_error"] == 0.2 and rows[(8, "modelled")]["min_rel_error_pass"] == 2
    # without an MLEM run there is no target
    no_mlem = {**record, "series": record["series"][2:]}
    assert all(r["passes_to_mlem_crc"] is None for r in study_rows([no_mlem]))


# ------------------------------------------------------------------ the study on the small preset


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The small preset's container and a realistic measurement of the NEMA-like phantom (m and b)."""
    from mlemlib.scanner import generate

    d = tmp_path_factory.mktemp("small")
    generate("small", d / "matrix.h5")
    files = {"sino": d / "nema.LMsino", "truth": d / "nema-truth.h5", "m": d / "nema.mult.f32", "b": d / "nema.add.f32"}
    effects = ScannerEffects(attenuation=True, normalisation_spread=0.1, randoms_fraction=0.2, scatter_fraction=0.3)
    simulate(d / "matrix.h5", "nema", files["sino"], files["truth"], seed=1, effects=effects,
             out_multiplicative=files["m"], out_additive=files["b"])
    return d, files


def test_a_small_study_records_every_pass_and_feeds_the_summary(small, tmp_path):
    d, f = small
    out = tmp_path / "study/convergence.json"
    record = study(d / "matrix.h5", f["sino"], f["truth"], out, subsets=[1, 4], iterations=6, record_every=2,
                   multiplicative=f["m"], additive=f["b"], matrix_name="small", data_name="nema")
    assert read_study(out)["series"] == json.loads(json.dumps(record["series"]))
    assert [(s["subsets"], s["corrected"]) for s in record["series"]] == [(1, True), (1, False), (4, True), (4, False)]
    for s in record["series"]:
        assert s["passes"] == [2, 4, 6]  # every 2 passes and the last
        assert all(math.isfinite(v) for k in ("crc_hot", "crc_cold", "rel_error", "centre_to_edge") for v in s[k])
        assert len(s["profile"]) == len(record["profile_truth"]) == 20  # the small grid's x
    assert not list(out.parent.glob(".convergence-*"))  # the grouped matrices are gone
    # OSEM with 4 subsets recovers more contrast in 6 passes than MLEM
    by = {(s["subsets"], s["corrected"]): s for s in record["series"]}
    assert by[(4, True)]["crc_hot"][-1] > by[(1, True)]["crc_hot"][-1]

    result = summarize(timings=[], out_dir=tmp_path / "summary", convergence=[out])
    rows = list(csv.DictReader(open(result["convergence_csv"], encoding="utf-8")))
    assert [(r["subsets"], r["corrections"]) for r in rows] == [("1", "modelled"), ("1", "ignored"), ("4", "modelled"),
                                                                ("4", "ignored")]
    assert rows[0]["passes_to_mlem_crc"] == "6" and rows[2]["passes_to_mlem_crc"] in ("2", "4", "6")
    assert (tmp_path / "summary/plots/convergence_small_nema.png").stat().st_size > 10_000
    md = (tmp_path / "summary/summary.md").read_text()
    assert "## Convergence and bias" in md and "passes to reach MLEM's CRC" in md


def test_without_a_study_the_summary_writes_no_convergence_table_and_names_none(tmp_path):
    """No study: no convergence.csv (not even a header), even where its path is given, no figure, no section, and
    nothing in summary.md or summary.html that points to them."""
    timings = {"config": {"matrix": "mine", "data": "scan", "backend": "cpu", "fp": "numba", "bp": "numba",
                          "gpus": 1, "layout": "local", "iterations": 2},
               "repetitions": [{"repetition": 0, "iterations": 2, "steps": {"iteration": {"mean": 1e-3}},
                                "accuracy": {"image_sum": 1.0}}]}
    given = tmp_path / "s" / "convergence.csv"
    result = summarize(timings=[timings], out_dir=tmp_path / "s", out_convergence=given)
    assert result["convergence_csv"] is None and not given.exists()
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["plots", "runs.csv", "runs.html", "summary.html",
                                                                  "summary.md"]
    assert not list((tmp_path / "s/plots").glob("convergence*"))
    for page in ("summary.md", "summary.html"):
        assert "onvergence" not in (tmp_path / "s" / page).read_text()


def test_ignoring_attenuation_darkens_the_centre(small, tmp_path):
    """Attenuation alone, noiseless: the reconstruction with m = 1 has a darker centre, relative to the truth, than the
    one that models m; the one that models m is the closer to the phantom."""
    d, _ = small
    sino, truth, mult = tmp_path / "a.LMsino", tmp_path / "a-truth.h5", tmp_path / "a.mult.f32"
    simulate(d / "matrix.h5", "nema", sino, truth, seed=1, noiseless=True, effects=ScannerEffects(attenuation=True),
             out_multiplicative=mult)
    record = study(d / "matrix.h5", sino, truth, tmp_path / "c.json", subsets=[1], iterations=20,
                   multiplicative=mult)
    corrected, ignored = record["series"]
    assert corrected["corrected"] and not ignored["corrected"]
    assert ignored["centre_to_edge"][-1] < corrected["centre_to_edge"][-1] - 0.03
    assert ignored["rel_error"][-1] > corrected["rel_error"][-1]
    centre = len(record["profile_truth"]) // 2  # the profile through the centre: darker there without m
    assert ignored["profile"][centre] < corrected["profile"][centre]


def test_a_measurement_without_factors_has_no_biased_run_and_bad_settings_are_refused(small, tmp_path):
    d, f = small
    record = study(d / "matrix.h5", f["sino"], f["truth"], tmp_path / "c.json", subsets=[2], iterations=1)
    assert [s["corrected"] for s in record["series"]] == [True]
    with pytest.raises(ConfigError, match="convergence.subsets"):
        study(d / "matrix.h5", f["sino"], f["truth"], tmp_path / "c.json", subsets=[0])
    with pytest.raises(ConfigError, match="convergence.record_every"):
        study(d / "matrix.h5", f["sino"], f["truth"], tmp_path / "c.json", record_every=0)
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(InputError, match="not a convergence record"):
        read_study(tmp_path / "x.json")


# ------------------------------------------------------------------ runs.csv's model columns


def _timings(subsets=1, method=None, m=None, b=None, reference_mode=False):
    return {"config": {"matrix": "mine", "data": "scan", "backend": "cpu", "fp": "numba", "bp": "numba", "gpus": 1,
                       "layout": "local", "dtype": "float32", "reference_mode": reference_mode, "iterations": 5,
                       "subsets": subsets, "subset_method": method, "multiplicative_checksum": m,
                       "additive_checksum": b},
            "repetitions": [{"repetition": 0, "iterations": 5, "steps": {}, "accuracy": {"image_sum": 1.0}}]}


def test_the_runs_table_names_the_model():
    rows = run_rows([("mlem", _timings()), ("osem", _timings(8, "angle", "ab12cd34ef", "0123456789")),
                     ("ref", _timings(8, "angle", "ab12cd34ef", None, reference_mode=True))])
    assert [(r["subsets"], r["subset_method"], r["m"], r["b"]) for r in rows] == [
        (1, None, "no", "no"), (8, "angle", "ab12cd34", "01234567"), (8, "angle", "ab12cd34", "no")]
    assert config_label(rows[0]) == "cpu numba/numba"
    assert config_label(rows[1]) == "cpu numba/numba OSEM S8 +m +b"
    assert config_label(rows[2]) == "reference (float64) OSEM S8 +m"
    assert model_columns({}) == {"subsets": 1, "subset_method": None, "m": "no", "b": "no"}


def test_runs_csv_has_the_model_columns(tmp_path):
    result = summarize(timings=[_timings(4, "index", "ff00ff00aa")], out_dir=tmp_path)
    row = next(csv.DictReader(open(result["runs_csv"], encoding="utf-8")))
    assert (row["subsets"], row["subset_method"], row["m"], row["b"]) == ("4", "index", "ff00ff00", "no")


# ------------------------------------------------------------------ the workflow


def _study_config(**study):
    config = copy.deepcopy(TINY)
    config["name"] = "study"
    config["simulation"] = {**config["simulation"], "attenuation": True, "randoms_fraction": 0.2}
    config["convergence"] = {"enabled": True, "subsets": [1, 2], "iterations": 3, **study}
    config["runs"] = config["runs"][:1]
    return config


@pytest.mark.slow
def test_the_study_is_off_by_default_and_planned_once_per_simulated_measurement(tmp_path):
    assert "study_convergence" not in dry_run(tmp_path, copy.deepcopy(TINY))
    assert dry_run(tmp_path, _study_config())["study_convergence"] == 1
    # a cuda study without GPUs (use_gpu: false) is left out
    assert "study_convergence" not in dry_run(tmp_path, _study_config(backend="cuda"))


@pytest.mark.slow
def test_the_workflow_runs_the_study_into_the_summary(tmp_path):
    config = _study_config()
    proc = snakemake(tmp_path, "--cores", "2", config=config, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = list((tmp_path / "results/small/convergence/nema-seed1").glob("*/convergence.json"))
    assert [p.parent.name for p in records] == ["cpu-auto-auto-it3-s1_2-every1-ignore"]
    summary = tmp_path / "results/summary/study"
    rows = list(csv.DictReader(open(summary / "convergence.csv", encoding="utf-8")))
    assert [(r["subsets"], r["corrections"]) for r in rows] == [("1", "modelled"), ("1", "ignored"),
                                                                ("2", "modelled"), ("2", "ignored")]
    assert (summary / "plots/convergence_small_nema-seed1.png").exists()
    runs = list(csv.DictReader(open(summary / "runs.csv", encoding="utf-8")))
    assert {(r["subsets"], r["m"] != "no", r["b"] != "no") for r in runs} == {("1", True, True)}
    # another pass count: the study alone (and the summary) reruns
    assert dry_run(tmp_path, _study_config(iterations=4)) == {"study_convergence": 1, "summarize": 1}


def test_the_cli_runs_the_study_and_summarize_takes_its_record(small, tmp_path, capsys):
    from mlemlib.cli import main

    d, f = small
    out = tmp_path / "c.json"
    assert main(["convergence", str(d / "matrix.h5"), "-s", str(f["sino"]), "-t", str(f["truth"]), "--subsets", "1",
                 "4", "-n", "3", "--multiplicative", str(f["m"]), "--additive", str(f["b"]), "-o", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("S = 1: contrast recovery ")
    assert main(["summarize", str(out.parent), "-o", str(tmp_path / "s"), "--convergence", str(out)]) == 0
    assert (tmp_path / "s/convergence.csv").read_text().count("\n") == 5


def test_each_run_is_measured_against_the_reference_of_its_own_model(small, tmp_path):
    """The summary joins a run with the float64 reference of the same problem: the same S, m and b."""
    from mlemlib.mlem import reconstruct, reference
    from mlemlib.problem import ModelSpec, RunSettings
    from mlemlib.reorder import reorder_file

    d, f = small
    reorder_file(d / "matrix.h5", tmp_path / "g4.h5", "none", subsets=4)
    models = {"mlem": (d / "matrix.h5", 1, {}),
              "osem4_mb": (tmp_path / "g4.h5", 4, {"multiplicative": f["m"], "additive": f["b"]})}
    timings, refs = [], []
    for name, (matrix, s, factors) in models.items():
        model = ModelSpec(matrix, f["sino"], subsets=s, **factors)
        reconstruct(model, RunSettings(3, checkpoint_every=0, backend="cpu"), tmp_path / name / "image.h5")
        reference(model, RunSettings(3, checkpoint_every=0), tmp_path / name / "ref" / "image.h5",
                  timings_out=tmp_path / name / "ref" / "timings.json")
        timings.append(tmp_path / name / "timings.json")
        refs += [tmp_path / name / "ref" / "timings.json", tmp_path / name / "ref" / "image.h5"]
    result = summarize(timings=timings, references=refs, out_dir=tmp_path / "s")
    rows = list(csv.DictReader(open(result["runs_csv"], encoding="utf-8")))
    runs = {(r["subsets"], r["m"] != "no"): r for r in rows if r["reference_mode"] == "False"}
    assert set(runs) == {("1", False), ("4", True)}
    for r in runs.values():  # float32 against its own model's float64 reference (another's is not joined)
        assert float(r["rel_l2_reference"]) < 1e-5
