"""Tests of the benchmarks (host side): the cases file, the smoke case end to end on the CPU backend, the
performance page, the synthetic matrix, the per-kernel report; the GPU parts skip without CuPy."""

from __future__ import annotations

import csv
import os
import shutil
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from mlemlib.bench import runner
from mlemlib.bench.cases import Case, MatrixSpec, load_cases, parse_cases, parse_pair, select
from mlemlib.bench.page import build_page, load_peers, write_page
from mlemlib.bench.prepare import prepare
from mlemlib.bench.spmv import format_csv, format_markdown
from mlemlib.bench.synthetic import shuffle_rows, tor_geometry, tor_matrix
from mlemlib.bench.timing import floor_bytes
from mlemlib.cli import main
from mlemlib.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
CASES = REPO / "perf" / "cases.yaml"
PEERS = REPO / "perf" / "peers.yaml"


def _cupy_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


gpu = pytest.mark.skipif(not _cupy_gpu(), reason="needs CuPy and a GPU")


# --------------------------------------------------------------------------- the cases file
def test_the_repository_cases_file_loads_with_the_named_cases():
    cases = {c.name: c for c in load_cases(CASES)}
    for name in ("smoke", "madpet2-own-csr", "madpet2-folded-reordered-auto", "matrix3-onepass", "tor-1e9-random"):
        assert name in cases
    m3 = cases["matrix3-onepass"]
    assert (m3.matrix.preset, m3.fold, m3.voxel_order, m3.format) == ("matrix3", True, "hilbert", "compressed")
    assert m3.kernels == (("auto", "onepass"), ("auto", "onepass_fixed")) and not m3.cusparse
    assert cases["madpet2-own-csr"].pairs()[-1] == ("cusparse", "cusparse")
    assert cases["madpet2-own-csr"].kernels[0] == ("csr_vector", "csr_vector")
    assert cases["smoke"].backend == "cpu" and cases["smoke"].pairs() == list(cases["smoke"].kernels)
    tor = cases["tor-1e9-random"]
    assert tor.matrix.tor == (140, 140, 40, 240, 180) and tor.order == "shuffled"
    assert cases["madpet2-folded-reordered-auto"].order == "reordered"


def _doc(**case):
    return {"cases": [{"name": "c", "matrix": {"tor": [4, 4, 2, 3, 3]}, **case}]}


@pytest.mark.parametrize("case, where", [
    ({"format": "zip"}, "case c: format"),
    ({"order": "sideways"}, "case c: order"),
    ({"kernels": ["warp9"]}, "case c: kernels[0]"),
    ({"kernels": ["auto", "numba/notakernel"]}, "case c: kernels[1]"),
    ({"kernels": ["delta_vector"], "format": "csr"}, "case c: kernels[0]"),
    ({"gpus": [0]}, "case c: gpus"),
    ({"gpus": [1, 2], "backend": "cpu"}, "case c: gpus"),
    ({"iterations": "many"}, "case c: iterations"),
    ({"fold": "yes"}, "case c: fold"),
    ({"colour": "red"}, "case c: colour"),
    ({"matrix": {"preset": "nope"}}, "case c: matrix.preset"),
    ({"matrix": {"tor": [1, 2, 3]}}, "case c: matrix.tor"),
    ({"matrix": {"tor": [4, 4, 2, 3, 3], "rays": 4}}, "case c: matrix.rays"),
    ({"matrix": {"path": "a.h5", "preset": "small"}}, "case c: matrix"),
    ({"voxel_order": "hilbert"}, "case c: voxel_order"),
])
def test_a_bad_case_is_one_error_naming_the_file_and_key(case, where):
    with pytest.raises(ConfigError) as exc:
        parse_cases(_doc(**case), "perf/x.yaml")
    msg = str(exc.value)
    assert msg.startswith(f"perf/x.yaml: {where}: "), msg
    assert "\n" not in msg


def test_case_file_structure_faults():
    with pytest.raises(ConfigError, match=r"^f.yaml: cases: expected a non-empty list"):
        parse_cases({"cases": []}, "f.yaml")
    with pytest.raises(ConfigError, match=r"^f.yaml: extra: unknown top-level key"):
        parse_cases({"cases": [], "extra": 1}, "f.yaml")
    with pytest.raises(ConfigError, match=r"^f.yaml: defaults: gpu: unknown key"):
        parse_cases({"defaults": {"gpu": 1}, **_doc()}, "f.yaml")
    with pytest.raises(ConfigError, match=r"^f.yaml: cases\[1\].name"):
        parse_cases({"cases": [_doc()["cases"][0], {"name": "bad name!", "matrix": "small"}]}, "f.yaml")
    with pytest.raises(ConfigError, match=r"^f.yaml: case c: name: used by two cases"):
        parse_cases({"cases": _doc()["cases"] * 2}, "f.yaml")
    with pytest.raises(ConfigError, match=r"^f.yaml: case c: matrix: missing"):
        parse_cases({"cases": [{"name": "c"}]}, "f.yaml")


def test_yaml_syntax_error_and_unknown_case_name(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cases:\n  - name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: line \d+: not valid YAML"):
        load_cases(bad)
    cases = parse_cases(_doc(), "f.yaml")
    with pytest.raises(ConfigError, match="--case nope: no such case; known: c"):
        select(cases, ["nope"], "f.yaml")
    assert select(cases, [], "f.yaml") == cases


def test_cli_reports_a_bad_case_on_one_line(tmp_path, capsys):
    path = tmp_path / "cases.yaml"
    path.write_text(yaml.safe_dump(_doc(format="zip")))
    assert main(["bench", "run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mlem: error: {path}: case c: format: expected one of csr,")
    assert not (tmp_path / "out").exists()


def test_pairs_and_defaults():
    assert parse_pair("auto", "f", "k") == ("auto", "auto")
    assert parse_pair("onepass_fixed", "f", "k") == ("auto", "onepass_fixed")
    assert parse_pair("csr_vector/scatter", "f", "k") == ("csr_vector", "scatter")
    assert parse_pair(["merge", "cusparse"], "f", "k") == ("merge", "cusparse")
    c = parse_cases({"defaults": {"iterations": 7, "gpus": [1, 2]}, **_doc(gpus=4)}, "f.yaml")[0]
    assert (c.iterations, c.gpus, c.repeats, c.format, c.order) == (7, (4,), 3, "csr", "own")


def test_matrix_key_follows_the_matrix_settings_only():
    a = Case(name="a", matrix=MatrixSpec(tor=(4, 4, 2, 3, 3)), kernels=(("auto", "auto"),))
    b = Case(name="b", matrix=MatrixSpec(tor=(4, 4, 2, 3, 3)), kernels=(("numba", "numba"),), gpus=(1, 2))
    c = Case(name="c", matrix=MatrixSpec(tor=(4, 4, 2, 3, 3)), format="compressed")
    d = Case(name="d", matrix=MatrixSpec(tor=(4, 4, 2, 3, 3)), order="shuffled", seed=1)
    assert a.matrix_key() == b.matrix_key()
    assert len({a.matrix_key(), c.matrix_key(), d.matrix_key()}) == 3
    assert a.matrix_key().startswith("tor-")


# --------------------------------------------------------------------------- the smoke case, end to end
def test_smoke_case_end_to_end_on_the_cpu_backend(tmp_path, monkeypatch):
    cases = select(load_cases(CASES), ["smoke"], str(CASES))
    out, work = tmp_path / "results", tmp_path / "work"
    rows = runner.run_cases(cases, out, work=work, command="mlem bench run perf/cases.yaml --case smoke")
    case = cases[0]
    assert len(rows) == len(case.pairs()) == 3
    with open(out / "results.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    doc = json.loads((out / "results.json").read_text())
    assert len(table) == len(doc["rows"]) == 3
    assert tuple(next(csv.reader(open(out / "results.csv")))) == runner.FIELDS
    for r in doc["rows"]:
        assert r["case"] == "smoke" and r["backend"] == "cpu" and not r.get("error")
        assert r["format"] == "compressed" and r["order"] == "reordered" and r["gpus"] == 1
        assert r["ms"] > 0 and r["ms_min"] <= r["ms"] <= r["ms_max"] and len(r["ms_repeats"]) == 2
        assert 0 < r["of_floor"] < 1 and r["floor_ms"] == pytest.approx(r["floor_bytes"] / r["copy_bandwidth"] * 1e3)
        assert r["nnz"] > 0 and r["m"] == 576 and 3 < r["bytes_per_nnz"] < 8
        assert r["command"].startswith("mlem bench run") and r["date"] and r["device"].startswith("CPU")
        assert r["finite"] is True
    one_pass = next(r for r in doc["rows"] if r["bp"] == "onepass")
    pair = next(r for r in doc["rows"] if r["fp"] == "numba")
    assert one_pass["floor_bytes"] < pair["floor_bytes"]  # A once against A and A^T
    # a rerun reuses the prepared matrix and replaces its rows
    record = next(work.glob("*/prepared.json"))
    stamp = record.stat().st_mtime_ns
    monkeypatch.setattr("mlemlib.bench.prepare._source", lambda *a, **k: pytest.fail("prepared again"))
    runner.run_cases(cases, out, work=work, command="again")
    assert record.stat().st_mtime_ns == stamp
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["rows"]) == 3 and {r["command"] for r in doc["rows"]} == {"again"}
    page = write_page([out], tmp_path / "performance.md", peers=PEERS)
    assert "## smoke on " in page and "| auto/onepass (onepass) | 1 |" in page


def test_prepare_shuffles_and_folds_through_the_stages(tmp_path):
    from mlemlib.formats import open_matrix

    case = Case(name="s", matrix=MatrixSpec(tor=(8, 8, 2, 6, 8)), order="shuffled", format="compressed-u16",
                backend="cpu", kernels=(("auto", "onepass"),), seed=3)
    prep = prepare(case, tmp_path)
    assert sorted(p.name for p in prep.directory.iterdir()) == ["g.npy", "matrix.h5", "norm.npy", "prepared.json"]
    src = open_matrix(prep.matrix)
    assert src.format == "compressed-u16"
    ref, rows = shuffle_rows(tor_matrix(8, 8, 2, 6, 8), 3)
    got = src.read_rows(0, src.shape[0])
    np.testing.assert_array_equal(got.indptr, ref.indptr)
    np.testing.assert_array_equal(got.indices, ref.indices)
    g, norm = prep.load_problem()
    assert g.shape == (src.shape[0],) and norm.shape == (src.shape[1],) and (g >= 0).all()
    assert prep.facts["format"] == "compressed-u16" and prep.facts["nnz"] == ref.nnz


def test_shuffle_rows_moves_whole_rows():
    a = tor_matrix(6, 5, 2, 4, 5)
    b, rows = shuffle_rows(a, 7)
    assert sorted(rows.tolist()) == list(range(a.shape[0])) and not np.array_equal(rows, np.arange(a.shape[0]))
    for r in range(a.shape[0]):
        s, e = a.indptr[rows[r]], a.indptr[rows[r] + 1]
        np.testing.assert_array_equal(b.indices[b.indptr[r]:b.indptr[r + 1]], a.indices[s:e])
        np.testing.assert_array_equal(b.data[b.indptr[r]:b.indptr[r + 1]], a.data[s:e])


def test_floor_bytes_counts_what_the_iteration_reads():
    facts = {"nnz": 100, "bytes": 900}
    assert floor_bytes({"onepass": True, "bytes_per_nnz": {"A": 5.0}}, facts, "cuda", "onepass", None) == 500
    assert floor_bytes({"bytes_per_nnz": {"A": 8.0, "AT": 8.5}}, facts, "cuda", "csr_vector", None) == 1650
    assert floor_bytes({"bytes_per_nnz": {"A": 8.0, "AT": None}}, facts, "cuda", "scatter", None) == 1600
    assert floor_bytes({}, facts, "cpu", "numba", 880) == 1780


# --------------------------------------------------------------------------- the page
def _row(**kw):
    base = {"case": "madpet2-own-csr", "description": "madpet2 in its own order", "matrix": "madpet2",
            "order": "own", "format": "csr", "folded": False, "m": 1327104, "n": 784000, "nnz": 960942960,
            "bytes_per_nnz": 8.01, "backend": "cuda", "fp": "csr_vector", "bp": "csr_vector",
            "fp_kernel": "csr_vector", "bp_kernel": "csr_vector", "deterministic": True, "gpus": 1,
            "warmup": 5, "iterations": 20, "repeats": 3, "ms": 3.8, "of_floor": 0.93,
            "device": "NVIDIA H200", "device_kind": "4 x NVIDIA H200", "date": "2026-11-28T10:00:00+00:00",
            "command": "mlem bench run perf/cases.yaml --case madpet2-own-csr --out perf/results/h200x4",
            "commit": "abc1234"}
    return {**base, **kw}


def _hand_made_rows():
    rows = [
        _row(),
        _row(gpus=2, ms=2.0, of_floor=0.88),
        _row(fp="auto", bp="auto", fp_kernel="csr_vector", bp_kernel="csr_vector", ms=3.9),
        _row(fp="cusparse", bp="cusparse", fp_kernel="cusparse", bp_kernel="cusparse", ms=5.0,
             deterministic=False),
        _row(fp="cusparse", bp="cusparse", fp_kernel="cusparse", bp_kernel="cusparse", gpus=2, ms=2.7,
             deterministic=False),
        _row(fp="auto", bp="onepass_chunked", fp_kernel=None, bp_kernel=None, gpus=2, ms=None, error="onepass_chunked has no multi-GPU form"),
        _row(case="tor-1e9-random", matrix="TOR 140x140x40x240x180", order="shuffled", ms=6.0,
             device="NVIDIA H100 80GB HBM3", device_kind="2 x NVIDIA H100 80GB HBM3"),
    ]
    runner.fill_relations(rows)
    return rows


def test_fill_relations_takes_the_same_runs_1gpu_and_cusparse_times():
    rows = _hand_made_rows()
    two = rows[1]
    assert two["ms_1gpu"] == 3.8 and two["speedup"] == pytest.approx(1.9) and two["cusparse_ms"] == 2.7
    assert rows[0]["cusparse_ms"] == 5.0 and "speedup" not in rows[0]
    assert "cusparse_ms" not in rows[-1]  # another case


def test_page_has_one_table_per_device_and_case_with_every_column(tmp_path):
    peers = tmp_path / "peers.yaml"
    peers.write_text(yaml.safe_dump({"peers": [
        {"case": "madpet2-own-csr", "device": "H200", "gpus": 2, "ms": 2.872, "source": "PERFORMANCE.md"},
        {"case": "matrix3-onepass", "device": "H100", "gpus": 1, "ms": 30.0, "source": "somewhere", "note": "n"},
    ]}))
    page = build_page(_hand_made_rows(), load_peers(peers), sources=["perf/results/h200x4"])
    assert page.count("\n## ") == 3  # two tables and the peers awaiting a run
    assert "## madpet2-own-csr on 4 x NVIDIA H200" in page and "## tor-1e9-random on 2 x NVIDIA H100 80GB HBM3" in page
    assert ("- date 2026-11-28T10:00:00+00:00; device NVIDIA H200 (4 x NVIDIA H200); commit abc1234; command: "
            "`mlem bench run perf/cases.yaml --case madpet2-own-csr --out perf/results/h200x4`") in page
    assert ("| configuration | GPUs | ms per iteration | share of its floor | speed-up vs 1 GPU | "
            "cuSPARSE, same run (ms) | thesis code (ms) |") in page
    assert "| csr_vector | 1 | 3.800 | 93.0% | - | 5.000 | - |" in page
    assert "| csr_vector | 2 | 2.000 | 88.0% | 1.90x | 2.700 | 2.872 |" in page
    assert "| auto (csr_vector) | 1 | 3.900 |" in page
    assert "| cusparse, non-det. | 2 | 2.700 |" in page
    assert "| auto/onepass_chunked | 2 | not run: onepass_chunked has no multi-GPU form |" in page
    assert "| matrix3-onepass | H100 | 1 | 30.000 | somewhere (n) |" in page
    table = page.split("## madpet2-own-csr")[1].split("## ")[0]
    body = [ln for ln in table.splitlines() if ln.startswith("| ") and "configuration" not in ln]
    assert [ln.split(" | ")[1] for ln in body] == ["1", "1", "1", "2", "2", "2"]  # GPUs, cuSPARSE last in each
    assert body[2].startswith("| cusparse") and body[5].startswith("| cusparse")


def test_scaling_line_names_each_configuration_slower_on_more_gpus():
    from mlemlib.bench.page import scaling_line

    rows = [_row(gpus=1, ms=4.0), _row(gpus=2, ms=2.0), _row(gpus=4, ms=1.0),
            _row(fp="auto", bp="auto", gpus=1, ms=1.6), _row(fp="auto", bp="auto", gpus=2, ms=1.7),
            _row(fp="auto", bp="auto", gpus=4, ms=1.65),  # slower than 1 GPU, though faster than 2
            _row(fp="auto", bp="auto", gpus=4, ms=None, subsets=16, error="x"),  # not timed: not counted
            _row(fp="auto", bp="onepass", gpus=1, ms=9.0)]  # one GPU count only
    assert scaling_line(rows) == ("More GPUs never slower: no: auto on 2 GPUs 1.700 ms against 1.600 on 1; "
                                  "auto on 4 GPUs 1.650 ms against 1.600 on 1.")
    assert scaling_line(rows[:3]) == ("More GPUs never slower: yes, every configuration timed on 1, 2, 4 GPUs "
                                      "is no slower on more.")
    assert scaling_line([_row(gpus=1, ms=4.0), _row(gpus=2, ms=4.0)]).startswith("More GPUs never slower: yes")
    assert scaling_line(rows[-1:]) is None
    # OSEM and factors are configurations of their own
    osem = [_row(fp="auto", bp="auto", gpus=1, ms=2.0, subsets=16),
            _row(fp="auto", bp="auto", gpus=2, ms=2.5, subsets=16, factors="synthetic")]
    assert scaling_line(osem) is None
    page = build_page(_hand_made_rows())
    assert "More GPUs never slower: yes, every configuration timed on 1, 2 GPUs" in page


def test_results_of_several_commits_of_one_case_get_a_table_each_oldest_first():
    old = [_row(commit="old1234", date="2026-11-27T10:00:00+00:00", ms=4.0),
           _row(gpus=2, commit="old1234", date="2026-11-27T10:00:00+00:00", ms=2.5)]
    new = [_row(commit="new5678", date="2026-11-28T10:00:00+00:00", ms=3.0),
           _row(gpus=2, commit="new5678", date="2026-11-28T10:00:00+00:00", ms=1.5)]
    runner.fill_relations(old)
    runner.fill_relations(new)
    page = build_page(new + old)
    heads = [ln for ln in page.splitlines() if ln.startswith("## ")]
    assert heads == ["## madpet2-own-csr on 4 x NVIDIA H200, commit old1234",
                     "## madpet2-own-csr on 4 x NVIDIA H200, commit new5678"]
    first, second = page.split("commit old1234\n")[1].split("## ")[0], page.split("commit new5678\n")[1]
    assert "| csr_vector | 2 | 2.500 |" in first and "1.60x" in first and "1.500" not in first
    assert "| csr_vector | 2 | 1.500 |" in second and "2.00x" in second and "2.500" not in second
    # one commit: no commit in the heading
    assert "## madpet2-own-csr on 4 x NVIDIA H200\n" in build_page(new)


def test_write_page_from_a_results_directory(tmp_path):
    runner.write_results(tmp_path / "r", _hand_made_rows())
    text = write_page([tmp_path / "r"], tmp_path / "docs" / "performance.md", peers=PEERS)
    assert (tmp_path / "docs" / "performance.md").read_text() == text
    assert "| csr_vector | 2 | 2.000 | 88.0% | 1.90x | 2.700 | 2.872 |" in text  # perf/peers.yaml's H200 figure
    with pytest.raises(ConfigError, match="no results.json"):
        write_page([tmp_path], tmp_path / "p.md")


def test_results_merge_replaces_rows_of_the_same_key(tmp_path):
    rows = _hand_made_rows()
    runner.write_results(tmp_path, rows)
    newer = [_row(ms=3.5, date="2026-11-29T00:00:00+00:00")]
    doc = runner.write_results(tmp_path, newer)
    assert len(doc["rows"]) == len(rows)
    assert [r["ms"] for r in doc["rows"] if r["fp"] == "csr_vector" and r["gpus"] == 1
            and r["case"] == "madpet2-own-csr"] == [3.5]
    assert len(doc["runs"]) == 2


def test_peers_file_faults(tmp_path):
    p = tmp_path / "peers.yaml"
    p.write_text(yaml.safe_dump({"peers": [{"case": "c", "device": "H100", "gpus": 1, "ms": -1, "source": "s"}]}))
    with pytest.raises(ConfigError, match=r"peers.yaml: peers\[0\].ms: expected milliseconds"):
        load_peers(p)
    p.write_text(yaml.safe_dump({"peers": [{"case": "c", "device": "H100", "gpus": 1, "ms": 1, "source": "s",
                                            "when": 1}]}))
    with pytest.raises(ConfigError, match=r"peers\[0\].when: unknown key"):
        load_peers(p)
    assert len(load_peers(PEERS)) >= 5


def test_the_committed_page_is_generated_from_the_committed_results():
    page = (REPO / "docs" / "performance.md").read_text()
    assert page.startswith("# Performance") and "mlem bench page" in page
    results = sorted((REPO / "perf" / "results").glob("*/results.json"))
    assert results
    rows = [r for p in results for r in json.loads(p.read_text())["rows"]]
    for case in {r["case"] for r in rows}:
        assert f"## {case} on " in page
    for chk in sorted((REPO / "perf" / "results").glob("*/checks.json")):
        for c in json.loads(chk.read_text())["checks"]:
            assert f"## {c['title']}" in page


def test_before_after_lines_become_a_checks_section_of_the_page(tmp_path):
    """perf/before_after.py table pairs the before and after lines of each configuration; the page shows each
    pair's times, their change and whether the images are the same bits."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("before_after", REPO / "perf" / "before_after.py")
    ba = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ba)
    lines = tmp_path / "l.jsonl"
    recs = [dict(label="before", matrix="M", fp_asked="auto", bp_asked="auto", bp="onepass_fixed", gpus=1,
                 median_ms=2.0, image_sha="aa"),
            dict(label="after", matrix="M", fp_asked="auto", bp_asked="auto", bp="onepass_fixed", gpus=1,
                 median_ms=1.9, image_sha="aa"),
            dict(label="before", matrix="M", fp_asked="auto", bp_asked="auto", gpus=2, error="ConfigError: no"),
            dict(label="after", matrix="M", fp_asked="auto", bp_asked="auto", bp="onepass_chunked", gpus=2,
                 median_ms=1.0, image_sha="bb")]
    lines.write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = tmp_path / "res"
    assert ba.main(["table", str(lines), "--title", "A check", "--device", "D", "-o", str(res / "checks.json")]) == 0
    runner.write_results(res, [dict(case="c", device="D", device_kind="D", gpus=1, fp="auto", bp="auto", ms=1.0,
                             date="d", command="x")])
    text = write_page([res], tmp_path / "p.md")
    assert "## A check" in text
    assert "| M | auto/auto (onepass_fixed) | 1 | 2.000 | 1.900 | -5.0% | same bits |" in text
    assert "| M | auto/auto (onepass_chunked) | 2 | - | 1.000 | - | - (before: ConfigError: no) |" in text
    (res / "checks.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="checks.json: not a checks file"):
        write_page([res], tmp_path / "p.md")


# --------------------------------------------------------------------------- synthetic matrix
def _brute_force_tor(nx, ny, nz, na, no, width=3.0):
    g = tor_geometry(nx, ny, nz, na, no, width)
    rows_c, rows_v = [], []
    for r in range(g["m"]):
        p, a, o = r // (na * no), (r % (na * no)) // no, r % no
        s = (o - (no - 1) * 0.5) * g["ds"]
        cols, vals = [], []
        for z in (p, p + 1) if nz > 1 else (0,):
            for y in range(ny):
                for x in range(nx):
                    d = abs((x - g["cx"]) * g["cs"][a] + ((y - g["cy"]) * g["sn"][a] - s))
                    if d < g["w"]:
                        cols.append((z * ny + y) * nx + x)
                        vals.append(1.0 - d / g["w"])
        rows_c.append(cols)
        rows_v.append(vals)
    return g, rows_c, rows_v


@pytest.mark.parametrize("dims", [(12, 9, 3, 6, 10), (7, 7, 1, 5, 4), (4, 15, 2, 8, 9)])
def test_tor_matrix_matches_its_definition(dims):
    a = tor_matrix(*dims)
    a.validate("tor")
    g, cols, vals = _brute_force_tor(*dims)
    assert a.shape == (g["m"], g["n"])
    for r in range(g["m"]):
        k0, k1 = a.indptr[r], a.indptr[r + 1]
        assert a.indices[k0:k1].tolist() == cols[r], r
        np.testing.assert_array_equal(a.data[k0:k1], np.asarray(vals[r], dtype=np.float32))
    assert a.data.min() > 0 and a.data.max() <= 1


def test_tor_matrix_has_empty_rows_and_sinogram_order():
    a = tor_matrix(16, 12, 3, 10, 14)
    lengths = np.diff(a.indptr).reshape(2, 10, 14)  # (plane, angle, offset)
    # the outermost offsets run along the image diagonal's ends and miss the grid at most angles
    assert (lengths == 0).sum() == 20
    assert (lengths[:, :, 0] == 0).any() and not (lengths[:, :, 7] == 0).any()
    # both planes see the same 2-D geometry: equal lengths plane by plane
    np.testing.assert_array_equal(lengths[0], lengths[1])


def test_tor_geometry_rejects_bad_sizes():
    with pytest.raises(ConfigError, match="n_angles"):
        tor_geometry(4, 4, 1, 0, 3)
    with pytest.raises(ConfigError, match="width"):
        tor_geometry(4, 4, 1, 2, 3, width=0)



# --------------------------------------------------------------------------- mlem bench spmv
def _result():
    return {
        "date": "2026-11-22",
        "device": {"name": "NVIDIA H100 80GB HBM3", "theoretical_bandwidth": 3.352e12},
        "copy": {"bandwidth": 3.0e12, "bytes": 1 << 32, "median_s": 1.43e-3},
        "repeat": 30,
        "warmup": 5,
        "matrix": {
            "label": "m.h5",
            "shape": [10, 20],
            "nnz": 50,
            "bytes": 488,
            "mean_row_length": 5.0,
            "max_row_length": 9,
            "empty_rows": 1,
            "empty_cols": 2,
        },
        "kernels": [
            {
                "op": "fp",
                "kernel": "cusparse",
                "deterministic": True,
                "median_s": 2.0e-3,
                "bandwidth": 2.7e12,
                "of_copy": 0.9,
                "vs_cusparse": 1.0,
                "rel_l2": 3e-8,
                "bytes": 5_400_000_000,
            },
            {
                "op": "fp",
                "kernel": "csr_vector",
                "deterministic": True,
                "median_s": 2.5e-3,
                "bandwidth": 2.16e12,
                "of_copy": 0.72,
                "vs_cusparse": 0.8,
                "rel_l2": 4e-8,
                "bytes": 5_400_000_000,
            },
            {
                "op": "bp_notrans",
                "kernel": "merge",
                "secsize": 5,
                "deterministic": False,
                "median_s": 9e-3,
                "bandwidth": 6e11,
                "of_copy": 0.2,
                "vs_cusparse": None,
                "rel_l2": None,
                "bytes": 5_400_000_000,
            },
        ],
        "iterations": [
            {
                "fp": "csr_vector",
                "bp": "csr_vector",
                "deterministic": True,
                "fused": ["corr into fp"],
                "median_s": 6e-3,
                "floor_s": 5.4e-3,
                "of_floor": 0.9,
            },
        ],
    }



def test_spmv_markdown_and_csv():
    res = _result()
    res["kernels"].append({"op": "bp", "kernel": "merge", "secsize": 5, "deterministic": False, "error": "no"})
    md = format_markdown(res)
    assert "### forward A x" in md and "| csr_vector | yes | 2.500 |" in md and "| merge (secsize 5) | no |" in md
    assert "not run: no" in md and "### one MLEM iteration" in md
    rows = list(csv.DictReader(format_csv(res).splitlines()))
    assert [r["kernel"] for r in rows] == ["cusparse", "csr_vector", "merge"]  # kernels not run left out
    assert {"op", "kernel", "median_s", "of_copy"} <= set(rows[0])


def test_spmv_csv_names_each_kernels_launch_shape_and_marks_autos_choice(monkeypatch):
    """The kernel rows carry lanes and launch shape from the backend's describe() and the kernel auto picks
    (fp/bp: fp=auto bp=auto; bp_notrans: the notrans selector), through a stand-in backend (no GPU)."""
    import types

    import mlemlib.bench.timing
    from mlemlib.bench import spmv

    class Backend:
        def __init__(self, fp, bp):
            self.fp_kernel = "csr_vector" if fp == "auto" else fp
            self.bp_kernel = {"auto": "csr_vector", "notrans": "scatter_smem"}.get(bp, bp)

        def describe(self):
            vec = {"csr_vector"}
            return {"lanes_fp": 16 if self.fp_kernel in vec else None,
                    "shape_fp": "256t" if self.fp_kernel in vec else None,
                    "lanes_bp": 32 if self.bp_kernel in vec | {"scatter"} else None,
                    "shape_bp": "1024t row1024 mb2" if self.bp_kernel in vec else "-"}

        def forward(self, v):
            return v

        back = forward

    monkeypatch.setattr(spmv, "_backend", lambda src, g, norm, tsrc, fp, bp, device, secsize=None, resident=None: Backend(fp, bp))
    monkeypatch.setattr(spmv, "_device_vector", lambda be, v: v)
    monkeypatch.setattr(spmv, "_free", lambda device: None)
    monkeypatch.setattr(mlemlib.bench.timing, "time_calls", lambda call, repeat, warmup: np.full(3, 1e-3))
    a = types.SimpleNamespace(shape=(10, 20), nnz=50)
    rows = spmv._kernel_rows(a, a, None, None, fp_kernels=("csr_vector", "cusparse"),
                             bp_kernels=("csr_vector", "merge"), notrans_kernels=("scatter", "scatter_smem"),
                             secsizes=(5,), repeat=3, warmup=1, bw=1e12, check=False, device=0)
    table = list(csv.DictReader(format_csv({"kernels": rows}).splitlines()))
    got = [(r["op"], r["kernel"], r["lanes"], r["shape"], r["secsize"], r["auto"]) for r in table]
    assert got == [("fp", "csr_vector", "16", "256t", "", "True"), ("fp", "cusparse", "", "", "", "False"),
                   ("bp", "csr_vector", "32", "1024t row1024 mb2", "", "True"), ("bp", "merge", "", "", "5", "False"),
                   ("bp_notrans", "scatter", "32", "", "", "False"), ("bp_notrans", "scatter_smem", "", "", "", "True")]
    assert tuple(next(csv.reader(format_csv({"kernels": rows}).splitlines()))) == spmv.CSV_FIELDS


def test_kernel_rows_check_every_product_against_the_float64_products_asked_for_after_the_timing(monkeypatch):
    """The float64 products may still be computed on the host while the kernels are timed: _kernel_rows asks
    for them once, after the last kernel, and each row's error is against its own operation's product
    (bp_notrans against A^T c)."""
    import types

    import mlemlib.bench.timing
    from mlemlib.bench import spmv

    events = []

    class Backend:
        fp_kernel = bp_kernel = "csr_vector"

        def __init__(self, scale):
            self.scale = scale

        def describe(self):
            return {}

        def forward(self, v):
            return v * self.scale

        back = forward

    scales = {"csr_vector": 1.0, "merge": 1.5, "scatter": 2.0}
    monkeypatch.setattr(spmv, "_backend", lambda src, g, norm, tsrc, fp, bp, device, secsize=None, resident=None:
                        Backend(scales.get(bp if fp == spmv.PARTNER else fp, 1.0)))
    monkeypatch.setattr(spmv, "_device_vector", lambda be, v: v.astype(np.float64))
    monkeypatch.setattr(spmv, "_host", lambda y: np.asarray(y, dtype=np.float64))
    monkeypatch.setattr(spmv, "_free", lambda device: None)
    monkeypatch.setattr(mlemlib.bench.timing, "time_calls",
                        lambda call, repeat, warmup: events.append("timed") or np.full(3, 1e-3))
    m, n = 6, 4
    x, c = spmv.bench_vectors(m, n)

    def refs():
        events.append("refs")
        return {"fp": x.astype(np.float64), "bp": c.astype(np.float64)}

    a = types.SimpleNamespace(shape=(m, n), nnz=10)
    rows = spmv._kernel_rows(a, a, None, None, fp_kernels=("csr_vector", "merge"), bp_kernels=("csr_vector",),
                             notrans_kernels=("scatter",), secsizes=(5,), repeat=3, warmup=1, bw=1e12, check=True,
                             device=0, refs=refs)
    assert events == ["timed"] * 4 + ["refs"]
    err = {(r["op"], r["kernel"]): r["rel_l2"] for r in rows}
    assert err[("fp", "csr_vector")] == 0.0 and err[("bp", "csr_vector")] == 0.0
    assert err[("fp", "merge")] == pytest.approx(0.5) and err[("bp_notrans", "scatter")] == pytest.approx(1.0)


def test_the_benchmark_compiles_ahead_every_kernel_it_runs(monkeypatch):
    """_prefetch hands the build prefetch every cuda kernel the benchmark names (the kernels, their partner,
    the pairs' kernels, the compressed formats' where they run); a GPU it cannot use is left to the backends."""
    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.bench import spmv

    asked = []
    monkeypatch.setattr(ck, "prefetch_kernels", lambda kernels, device: asked.append(({k.name for k in kernels}, device)))
    spmv._prefetch(("cusparse",), ("merge",), ("scatter_vec",), (("auto", "onepass_chunked"),), (), 3)
    names, device = asked[-1]
    assert device == 3 and names == {"csr_vector", "cusparse", "merge", "scatter_vec", "onepass_chunked"}
    spmv._prefetch((), (), (), (), spmv.FORMAT_ITERATION_BENCH, 0)
    assert "delta_vector" in asked[-1][0] and "onepass_fixed" in asked[-1][0]

    def no_gpu(kernels, device):
        raise RuntimeError("cudaErrorInvalidDevice")

    monkeypatch.setattr(ck, "prefetch_kernels", no_gpu)
    spmv._prefetch(spmv.FP_BENCH, (), (), (), (), 7)  # not raised: the backend's own check names the GPU


def test_cli_bench_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for sub in ("run", "prepare", "page", "spmv"):
        assert sub in out


def test_cli_bench_spmv_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "spmv", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--transpose" in out and "--repeat" in out and "--markdown" in out and "--synthetic" in out


def test_cli_bench_spmv_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "spmv", str(tmp_path / "nope.h5"), "--out", str(tmp_path / "b.json")])
    assert exc.value.code == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_bench_spmv_needs_one_input(tmp_path, capsys):
    code = main(["bench", "spmv", "--out", str(tmp_path / "b.json")])
    assert code == 2
    assert "either MATRIX or --synthetic" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def test_cli_bench_spmv_rejects_bad_lists(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "spmv", "--synthetic", "1,2,3", "--out", str(tmp_path / "b.json")])
    assert exc.value.code == 2
    assert "NX,NY,NZ,ANGLES,OFFSETS" in capsys.readouterr().err


# --------------------------------------------------------------------------- on a GPU
@gpu
def test_runner_on_the_gpu_times_every_pair_beside_cusparse(tmp_path):
    case = Case(name="g", matrix=MatrixSpec(tor=(24, 24, 3, 16, 33)), order="shuffled-reordered",
                kernels=(("auto", "auto"), ("csr_vector", "csr_vector"), ("auto", "onepass_fixed")),
                warmup=1, iterations=3, repeats=2)
    rows = runner.run_cases([case], tmp_path / "r", work=tmp_path / "w", command="test", copy_bytes=1 << 24)
    assert len(rows) == 4 and not [r for r in rows if r.get("error")]
    ref = next(r for r in rows if r["fp"] == "cusparse")
    for r in rows:
        assert r["ms"] > 0 and r["cusparse_ms"] == ref["ms"] and 0 < r["of_floor"] and r["finite"]


@gpu
def test_bench_spmv_on_the_gpu_through_the_public_api(tmp_path):
    from mlemlib.bench.spmv import bench_spmv

    res = bench_spmv(tor_matrix(24, 24, 3, 16, 33), repeat=3, warmup=1, copy_bytes=1 << 24,
                     iterations=(("auto", "auto"), ("csr_vector", "csr_vector")),
                     out_json=tmp_path / "b.json", out_md=tmp_path / "b.md", out_csv=tmp_path / "b.csv")
    done = [r for r in res["kernels"] if "median_s" in r]
    assert {r["op"] for r in done} == {"fp", "bp", "bp_notrans"}
    assert all(r["rel_l2"] < 1e-5 for r in done)
    assert len(res["iterations"]) == 2 and (tmp_path / "b.csv").exists()


@gpu
def test_tor_matrix_on_the_device_equals_the_cpu_one():
    host = tor_matrix(20, 16, 3, 12, 18)
    dev = tor_matrix(20, 16, 3, 12, 18, device=True).to_host()
    np.testing.assert_array_equal(dev.indptr, host.indptr)
    np.testing.assert_array_equal(dev.indices, host.indices)


def test_resident_copies_each_host_matrix_once_for_kernels_that_read_it_as_it_is(monkeypatch):
    """The benchmark's backends of named kernels share one GPU copy of A (and of A^T); auto, the one passes
    and the chunked pass get the host matrix (they choose or build their own layout)."""
    import contextlib
    import types

    import scipy.sparse as sp

    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.bench import spmv
    from mlemlib.matrix import CSRMatrix

    fake_cp = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda d: contextlib.nullcontext()))
    monkeypatch.setattr(ck, "cupy", lambda: fake_cp)
    copies = []
    monkeypatch.setattr(ck.DeviceCSR, "from_host", classmethod(lambda cls, a: copies.append(a) or ("gpu", id(a))))
    a = CSRMatrix.from_scipy(sp.random(20, 10, density=0.3, format="csr", random_state=1, dtype=np.float32))
    at = CSRMatrix.from_scipy(a.to_scipy().T.tocsr())
    r = spmv._Resident(0)
    assert r.get(a, "csr_vector", "csr_vector") == ("gpu", id(a))
    assert r.get(a, "merge", "csr_vector") == ("gpu", id(a))
    assert r.get(at, "csr_vector", "cusparse") == ("gpu", id(at))
    assert r.get(a, "csr_vector", "scatter") == ("gpu", id(a))
    assert len(copies) == 2  # one copy of A and one of A^T for all of them
    for fp, bp in [("auto", "auto"), ("csr_vector", "auto"), ("auto", "onepass"), ("auto", "onepass_fixed"),
                   ("auto", "onepass_chunked")]:
        assert r.get(a, fp, bp) is a, (fp, bp)
    assert r.get(None, "csr_vector", "csr_vector") is None
    r.clear()
    r.get(a, "csr_vector", "csr_vector")
    assert len(copies) == 3


def test_reference_products_are_float64_row_sums_of_a_and_its_transpose():
    """The benchmark's yardstick: A x and A^T c summed in float64 (Numba on CSR), against SciPy in float64."""
    import scipy.sparse as sp

    from mlemlib.bench import spmv
    from mlemlib.matrix import CSRMatrix

    s = sp.random(300, 120, density=0.1, format="csr", random_state=3, dtype=np.float32)
    a, at = CSRMatrix.from_scipy(s), CSRMatrix.from_scipy(s.T.tocsr())
    rng = np.random.default_rng(0)
    x, c = rng.uniform(0.5, 1.5, 120).astype(np.float32), rng.uniform(0.5, 1.5, 300).astype(np.float32)
    refs = spmv._reference_products(a, at, x, c)
    s64 = s.astype(np.float64)
    np.testing.assert_allclose(refs["fp"], s64 @ x.astype(np.float64), rtol=1e-14)
    np.testing.assert_allclose(refs["bp"], s64.T @ c.astype(np.float64), rtol=1e-14)
    assert refs["fp"].dtype == refs["bp"].dtype == np.float64


def test_the_host_work_beside_the_timed_kernels_gives_the_problem_and_the_products():
    """_host_work (run in a thread of its own while the kernels are timed): problem_arrays' g and norm and,
    with check, the float64 products of the benchmark's vectors, bit for bit as computed alone."""
    import concurrent.futures

    import scipy.sparse as sp

    from mlemlib.bench import spmv
    from mlemlib.bench.prepare import problem_arrays
    from mlemlib.matrix import CSRMatrix

    s = sp.random(200, 90, density=0.1, format="csr", random_state=5, dtype=np.float32)
    a, at = CSRMatrix.from_scipy(s), CSRMatrix.from_scipy(s.T.tocsr())
    x, c = spmv.bench_vectors(200, 90)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    g, norm, refs, seconds = pool.submit(spmv._host_work, a, at, x, c, True).result()
    assert pool.submit(spmv._host_work, a, at, x, c, False).result()[2] == {}
    pool.shutdown()
    g0, norm0 = problem_arrays(a)
    want = spmv._reference_products(a, at, x, c)
    np.testing.assert_array_equal(g, g0)
    np.testing.assert_array_equal(norm, norm0)
    np.testing.assert_array_equal(refs["fp"], want["fp"])
    np.testing.assert_array_equal(refs["bp"], want["bp"])
    assert seconds >= 0


def test_the_commit_recorded_is_that_of_the_code_that_runs(tmp_path):
    """A checkout names its own commit; a tree exported by git archive (here inside no checkout; on a device
    inside another one) names the commit it was exported from, not the enclosing checkout's."""
    import subprocess
    import sys

    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("needs the repository's git checkout")
    head = subprocess.run([git, "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert runner.git_commit().split("+")[0] == head
    archive = subprocess.run([git, "archive", "HEAD", "mlemlib"], cwd=REPO, capture_output=True, check=True).stdout
    outer = tmp_path / "outer"  # another checkout, the export in its git-ignored build/ (as on a device)
    outer.mkdir()
    (outer / ".gitignore").write_text("build/\n")
    who = ["-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([git, "init", "-q"], cwd=outer, check=True)
    subprocess.run([git, *who, "add", ".gitignore"], cwd=outer, check=True)
    subprocess.run([git, *who, "commit", "-q", "-m", "outer"], cwd=outer, check=True)
    for tree in (tmp_path / "after", outer / "build" / "after"):
        tree.mkdir(parents=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        out = subprocess.run([sys.executable, "-c", "from mlemlib.bench.runner import git_commit; print(git_commit())"],
                             cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                             check=True).stdout.strip()
        assert out == head, tree
