"""Summary of runs: runs.csv, summary.md, plots; timing statistics."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from mlemlib.errors import InputError
from mlemlib.report import RUN_COLUMNS, summarize
from mlemlib.timing import StepTimes, format_seconds, stats

# Thesis Table 9.3 (one iteration of the large matrix on 8 V100s), seconds.
TABLE_93 = {"bp": 2.09212, "allreduce": 1.10013, "fp": 16.498e-3, "update": 49.424e-6, "corr": 3.2e-6}


def _timings(*, backend, fp, bp, gpus, layout, sums, digests, deterministic=True, rel=None, scale=1.0, transpose=False):
    """A synthetic timings.json: every repetition has 4 iterations whose step times average to TABLE_93 * scale."""
    reps = []
    for k, (s, d) in enumerate(zip(sums, digests)):
        samples = {}
        for step, t in TABLE_93.items():
            t = t * scale
            samples[step] = [t * 0.9, t * 1.1, t * 0.95, t * 1.05]  # mean t, min 0.9 t, max 1.1 t
        samples["iteration"] = [sum(samples[s][i] for s in TABLE_93) for i in range(4)]
        steps = {st: stats(v) for st, v in samples.items()}
        acc = {"image_sum": s, "image_sha256": d, "rel_l2_truth": 0.25}
        if rel is not None:
            acc.update(rel_l2_reference=rel[k], reference_sum=1000.0, sum_rel_error_reference=(s - 1000.0) / 1000.0)
        reps.append({"repetition": k, "iterations": 4, "resumed_at": [], "wall_s": 1.0, "steps": steps,
                     "samples": samples, "accuracy": acc})
    return {
        "format": "mlem-timings",
        "config": {"matrix": "madpet3", "data": "nema-seed1", "backend": backend, "fp": fp, "bp": bp, "secsize": None,
                   "gpus": gpus, "layout": layout, "iterations": 4, "repetitions": len(sums), "dtype": "float32",
                   "reference_mode": False, "transpose": None},
        "backend": {"backend": backend, "deterministic": deterministic, "transpose": transpose},
        "deterministic": deterministic,
        "device": {"name": "Tesla V100"},
        "bytes": {"A": 10**11, "AT": None, "fp": 10**11, "bp": 10**11, "iteration": 2 * 10**11},
        "setup": {"load_s": 12.0, "backend_s": 3.5},
        "repetitions": reps,
    }


@pytest.fixture
def runs(tmp_path):
    a = _timings(backend="cuda", fp="csr_vector", bp="notrans", gpus=8, layout="thesis",
                 sums=[1000.5, 1000.25, 1000.75], digests=["aa", "bb", "cc"], deterministic=False, rel=[1e-6, 2e-6, 3e-6],
                 transpose="none")
    b = _timings(backend="cpu", fp="numba", bp="numba", gpus=1, layout="local",
                 sums=[999.0, 999.0], digests=["dd", "dd"], rel=[4e-7, 4e-7], scale=10.0, transpose="stored")
    for name, t in (("a", a), ("b", b)):
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        (d / "timings.json").write_text(json.dumps(t))
    return tmp_path / "runs", a, b


def test_runs_csv(runs, tmp_path):
    root, _, _ = runs
    r = summarize([root / "a", root / "b" / "timings.json"], tmp_path / "summary")
    assert r["rows"] == 5 and r["configurations"] == 2
    with open(tmp_path / "summary" / "runs.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0])[: len(RUN_COLUMNS)] == list(RUN_COLUMNS)
    assert [row["repetition"] for row in rows] == ["0", "1", "2", "0", "1"]
    ra = rows[0]
    assert (ra["matrix"], ra["backend"], ra["fp"], ra["bp"], ra["gpus"], ra["layout"], ra["deterministic"]) == (
        "madpet3", "cuda", "csr_vector", "notrans", "8", "thesis", "False")
    it = sum(TABLE_93.values())
    assert float(ra["iteration_mean_s"]) == pytest.approx(it, rel=1e-12)
    assert float(ra["bp_mean_s"]) == pytest.approx(2.09212, rel=1e-12)
    assert float(ra["bp_min_s"]) == pytest.approx(0.9 * 2.09212, rel=1e-12)
    assert float(ra["allreduce_max_s"]) == pytest.approx(1.1 * 1.10013, rel=1e-12)
    assert float(ra["bandwidth_GBps"]) == pytest.approx(200.0 / it, rel=1e-12)  # 2e11 bytes per iteration
    assert float(ra["fp_bandwidth_GBps"]) == pytest.approx(100.0 / 16.498e-3, rel=1e-12)
    assert float(ra["image_sum"]) == 1000.5 and float(rows[2]["rel_l2_reference"]) == 3e-6
    assert float(rows[3]["iteration_mean_s"]) == pytest.approx(10 * it, rel=1e-12)
    assert rows[3]["device"] == "Tesla V100" and float(rows[3]["load_s"]) == 12.0
    # backends describe the transpose as a word: "none" means back projection with A
    assert (ra["transpose"], rows[3]["transpose"]) == ("False", "True")


def test_markdown_tables(runs, tmp_path):
    root, _, _ = runs
    summarize([root], tmp_path / "s")
    md = (tmp_path / "s" / "summary.md").read_text()
    # thesis Table 9.3, reproduced from the samples: step, average time per iteration
    for text in ("| bp | 2.0921 s |", "| allreduce | 1.1001 s |", "| fp | 16.498 ms |", "| update | 49.424 us |",
                 "| corr | 3.200 us |"):
        assert text in md
    assert md.index("| bp | 2.0921 s |") < md.index("| allreduce | 1.1001 s |") < md.index("| fp | 16.498 ms |")
    # accuracy spread: min, max, std and max-min of the image sums; distinct images
    line = next(ln for ln in md.splitlines() if "csr_vector/notrans" in ln and "1000.5 |" in ln)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4:9] == ["1000.5", "1000.25", "1000.75", f"{np.std([1000.5, 1000.25, 1000.75]):.3e}", "5.000e-01"]
    assert cells[9] == "2.000e-06" and cells[-2] == "3" and cells[-1] == "NO (atomics)"
    cpu = next(ln for ln in md.splitlines() if "cpu numba/numba" in ln and "999 |" in ln)
    cells = [c.strip() for c in cpu.strip("|").split("|")]
    assert cells[7:9] == ["0.000e+00", "0.000e+00"] and cells[-2] == "1" and cells[-1] == "yes"


def test_plots_are_valid_png(runs, tmp_path):
    import matplotlib.image as mpimg

    root, _, _ = runs
    r = summarize([root], tmp_path / "s")
    names = sorted(p.split("/")[-1] for p in r["plots"])
    assert names == ["accuracy.png", "time_distribution.png", "time_per_iteration.png"]
    for p in r["plots"]:
        with open(p, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(p)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
        assert img[..., :3].std() > 0.01  # not a blank canvas


def test_image_plot_and_transpose_table(tmp_path):
    from mlemlib.matrix import CSRMatrix
    from mlemlib.mlem import InMemorySource, reconstruct

    rng = np.random.default_rng(1)
    grid = (8, 6, 4)
    n = int(np.prod(grid))
    m = 300
    indptr = np.arange(0, 6 * m + 1, 6)
    a = CSRMatrix(indptr, rng.integers(0, n, 6 * m), rng.uniform(0.1, 1, 6 * m).astype(np.float32), (m, n))
    g = rng.poisson(5.0, m).astype(np.int32)
    truth = tmp_path / "truth.h5"
    from mlemlib.mlem import write_image

    write_image(truth, np.ones(n, np.float32), grid=grid, voxel_size=(1, 1, 1))
    out = tmp_path / "results" / "runs" / "x" / "image.h5"
    reconstruct(InMemorySource(a, grid=grid, voxel_size=(1.0, 1.0, 1.0)), g, out, iterations=3, backend="cpu",
                truth=truth, checkpoint_every=0, matrix_name="tiny")
    tsv = tmp_path / "tiny-scipy.tsv"
    tsv.write_text("s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
                   "1.5\t0:00:01\t120.5\t1\t1\t1\t0\t0\t0\t1\n2.5\t0:00:02\t130.0\t1\t1\t1\t0\t0\t0\t2\n")
    r = summarize([out.parent], tmp_path / "s", transpose_benchmarks=[tsv])
    assert any(p.endswith("image_tiny_memory.png") for p in r["plots"])
    md = (tmp_path / "s" / "summary.md").read_text()
    assert "| tiny | scipy | snakemake benchmark (whole job) | 2 | 2.0000 s | 1.5000 s | 2.5000 s | 130 |" in md


def test_bad_inputs(tmp_path):
    (tmp_path / "timings.json").write_text(json.dumps({"something": 1}))
    with pytest.raises(InputError, match="not a timings.json"):
        summarize([tmp_path / "timings.json"], tmp_path / "s")
    with pytest.raises(InputError, match="no such file"):
        summarize([tmp_path / "missing"], tmp_path / "s")
    (tmp_path / "bad.tsv").write_text("a\tb\n1\t2\n")
    with pytest.raises(InputError, match="not a Snakemake benchmark"):
        summarize([], tmp_path / "s", transpose_benchmarks=[tmp_path / "bad.tsv"])


def test_cli_summarize(runs, tmp_path):
    from mlemlib.cli import main

    root, _, _ = runs
    assert main(["summarize", str(root), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "runs.csv").exists() and (tmp_path / "out" / "plots" / "accuracy.png").exists()


def test_timing_helpers():
    s = stats([3.0, 1.0, 2.0, 10.0])
    assert (s["n"], s["mean"], s["min"], s["max"], s["median"], s["total"]) == (4, 4.0, 1.0, 10.0, 2.5, 16.0)
    assert s["std"] == pytest.approx(math.sqrt((1 + 9 + 4 + 36) / 4))
    empty = stats([])
    assert empty["n"] == 0 and math.isnan(empty["mean"])
    st = StepTimes()
    st.add({"fp": 1.0, "iteration": 2.0})
    st.add({"fp": 3.0, "bp": 1.0, "iteration": 4.0})
    assert len(st) == 2 and st.mean("fp") == 2.0 and list(st.summary()) == ["iteration", "fp", "bp"]
    assert st.summary()["bp"]["n"] == 1
    assert format_seconds(2.09212) == "2.0921 s"
    assert format_seconds(16.498e-3) == "16.498 ms"
    assert format_seconds(3.2e-6) == "3.200 us"
    assert format_seconds(float("nan")) == "n/a"
