"""Tests of the benchmark cases' time to threshold (host side, the cpu backend): the ``threshold`` key, the simulated
measurement and converged image made once, the rows' threshold columns against the run they come from, the page's
column."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from mlemlib.bench import cases, threshold
from mlemlib.bench.cases import Threshold, load_cases, parse_cases
from mlemlib.cli import main
from mlemlib.errors import ConfigError

CASES = Path(__file__).resolve().parents[1] / "perf" / "cases.yaml"


def _case_doc(**th):
    return {"cases": [{"name": "t", "matrix": "small", "fold": True, "order": "reordered", "format": "compressed",
                       "backend": "cpu", "kernels": ["auto"], "cusparse": False, "subsets": [4],
                       "factors": ["synthetic"], "prior": ["rdp-fast"], "gpus": [1], "warmup": 0, "iterations": 1,
                       "repeats": 1, "threshold": {"counts": 1.0e6, "passes": 4, "converged_passes": 4, **th}}]}


def test_the_repositorys_threshold_case_names_the_setting_of_the_recorded_run():
    case = {c.name: c for c in load_cases(CASES)}["madpet2-map-threshold"]
    assert (case.matrix.preset, case.fold, case.order, case.format, case.subsets) == (
        "madpet2", True, "reordered", "compressed", (16,))
    assert case.prior == ("none", "rdp-fast") and case.gpus == (1, 2, 4)
    assert case.threshold == Threshold(counts=1.0e7, passes=60, converged_passes=3000, subset_halving=(30, 40))


@pytest.mark.parametrize("raw, where", [
    ({"threshold": {"passes": 10}, "prior": "none"}, "case c: threshold: a time to threshold is MAP's"),
    ({"threshold": {"passes": 0}}, "case c: threshold.passes: expected an integer >= 1"),
    ({"threshold": {"counts": -1}}, "case c: threshold.counts: expected a number of counts >= 1"),
    ({"threshold": {"subset_halving": [5, 3]}},
     "case c: threshold.subset_halving: passes after which the subsets halve: increasing integers >= 1"),
    ({"threshold": {"subset_halving": [5, 6, 7]}}, "case c: threshold.subset_halving: 3 halvings of 4 subsets"),
    ({"threshold": {"stop": 3}}, "case c: threshold.stop: unknown key"),
    ({"threshold": 60}, "case c: threshold: expected a mapping"),
])
def test_a_bad_threshold_is_one_line_naming_the_file_case_and_key(raw, where):
    doc = {"cases": [{"name": "c", "matrix": "small", "subsets": [4], "prior": ["rdp"], **raw}]}
    with pytest.raises(ConfigError) as exc:
        parse_cases(doc, "f.yaml")
    assert str(exc.value).startswith(f"f.yaml: {where}") and "\n" not in str(exc.value), str(exc.value)


def test_a_map_row_measures_its_time_to_threshold_against_the_converged_image(tmp_path, monkeypatch):
    """With the converged image's own settings (the hessian preconditioner without an offset, relaxation (1, 40))
    and as many passes, the run ends at the converged image: the thresholds are met by its last pass, and the
    time to them is its passes' times summed. The measurement and the converged image are made once."""
    monkeypatch.setattr(cases, "FAST_MAP", {"preconditioner": "hessian", "preconditioner_offset": 0.0,
                                             "relaxation": (1.0, 40.0)})
    path = tmp_path / "cases.yaml"
    path.write_text(yaml.safe_dump(_case_doc()))
    out, work = tmp_path / "out", tmp_path / "work"
    assert main(["bench", "prepare", str(path), "--work", str(work)]) == 0  # the measurement too, before any run
    (sim,) = list(work.rglob("sim-*"))
    made = (sim / "simulated.json").stat().st_mtime_ns
    assert main(["bench", "run", str(path), "--out", str(out), "--work", str(work)]) == 0
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert not row.get("error") and not row.get("threshold_error"), row
    assert 1 <= row["passes_to_threshold"] <= 4
    assert 0 < row["seconds_to_threshold"] <= 4 * 10 * row["threshold_pass_ms"] / 1e3
    assert (row["threshold_passes"], row["converged_passes"], row["threshold_halving"]) == (4, 4, [])
    # the measurement written beside the prepared matrix (by prepare; the run reused it) is `mlem simulate`'s with
    # every effect, byte for byte
    assert list(work.rglob("sim-*")) == [sim] and (sim / "simulated.json").stat().st_mtime_ns == made
    (matrix,) = list(work.rglob("matrix.h5"))
    x = tmp_path / "x"
    assert main(["simulate", str(matrix), "--attenuation", "--normalisation-spread", "0.1", "--randoms-fraction",
                 "0.2", "--scatter-fraction", "0.3", "--counts", "1000000", "-o", str(x.with_suffix(".LMsino")),
                 "-t", str(tmp_path / "truth.h5")]) == 0
    for ours, cli in (("g.LMsino", "x.LMsino"), ("m.f32", "x.mult.f32"), ("b.f32", "x.add.f32")):
        assert (sim / ours).read_bytes() == (tmp_path / cli).read_bytes(), ours
    # beta and epsilon by the rule c = 0.25 and 1e-3 of the initial image, from it
    g = np.fromfile(sim / "g.LMsino", dtype="<i4").astype(np.float64)
    m = np.fromfile(sim / "m.f32", dtype="<f4").astype(np.float64)
    from mlemlib.formats import open_matrix
    from mlemlib.norm import source_column_sums

    with open_matrix(str(matrix)) as src:
        cs = np.asarray(source_column_sums(src), dtype=np.float64)
    assert row["threshold_beta"] == pytest.approx(0.25 * cs.mean() * m.mean() / 19.1, rel=1e-12)
    assert row["threshold_epsilon"] == pytest.approx(1e-3 * g.sum() / (cs.sum() * m.mean()), rel=1e-12)
    (conv,) = list(work.rglob("converged-*.h5"))
    stamps = (sim / "simulated.json").stat().st_mtime_ns, conv.stat().st_mtime_ns
    # a second run reuses both (and gives the same passes: the runs are deterministic)
    assert main(["bench", "run", str(path), "--out", str(out), "--work", str(work)]) == 0
    (again,) = json.loads((out / "results.json").read_text())["rows"]
    assert again["passes_to_threshold"] == row["passes_to_threshold"]
    assert ((sim / "simulated.json").stat().st_mtime_ns, conv.stat().st_mtime_ns) == stamps
    page = tmp_path / "performance.md"
    assert main(["bench", "page", str(out), "--out", str(page)]) == 0
    text = page.read_text()
    assert "| to threshold (simulated NEMA) |" in text
    assert f"| pass {again['passes_to_threshold']}, {again['seconds_to_threshold']:.3f} s |" in text


def test_a_run_that_does_not_get_there_says_so():
    row = {"threshold_passes": 4, "passes_to_threshold": None, "seconds_to_threshold": None}
    assert threshold.threshold_text(row) == "not in 4 passes"
    assert threshold.threshold_text({"threshold_passes": 4, "passes_to_threshold": 3,
                                     "seconds_to_threshold": 0.01234}) == "pass 3, 0.012 s"
    assert threshold.threshold_text({}) == "-"
