"""Summary of runs: runs.csv, summary.md, plots; timing statistics."""

from __future__ import annotations

import csv
import json
import math
import re

import numpy as np
import pytest

from mlemlib.errors import InputError
from mlemlib.problem import ModelSpec, RunSettings
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
    # thesis Table 9.3, reproduced from the samples: step, average time per iteration (ms, 3 significant digits)
    assert "| step | avg time per iteration (ms) | min (ms) | max (ms) | median (ms) |" in md
    for text in ("| bp | 2092 |", "| allreduce | 1100 |", "| fp | 16.5 |", "| update | 0.0494 |", "| corr | 0.00320 |"):
        assert text in md
    assert md.index("| bp | 2092 |") < md.index("| allreduce | 1100 |") < md.index("| fp | 16.5 |")
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
    assert names == ["accuracy.png", "time_distribution.png", "time_per_iteration.png", "time_vs_gpus.png"]
    for p in r["plots"]:
        with open(p, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(p)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
        assert img[..., :3].std() > 0.01  # not a blank canvas


def test_image_plot_and_transpose_table(tmp_path):
    from mlemlib.matrix import CSRMatrix
    from mlemlib.formats import InMemoryMatrix
    from mlemlib.mlem import reconstruct

    rng = np.random.default_rng(1)
    grid = (8, 6, 4)
    n = int(np.prod(grid))
    m = 300
    indptr = np.arange(0, 6 * m + 1, 6)
    a = CSRMatrix(indptr, rng.integers(0, n, 6 * m), rng.uniform(0.1, 1, 6 * m).astype(np.float32), (m, n))
    g = rng.poisson(5.0, m).astype(np.int32)
    truth = tmp_path / "truth.h5"
    from mlemlib.image import write_image

    write_image(truth, np.ones(n, np.float32), grid=grid, voxel_size=(1, 1, 1))
    out = tmp_path / "results" / "runs" / "x" / "image.h5"
    reconstruct(ModelSpec(InMemoryMatrix(a, grid=grid, voxel_size=(1.0, 1.0, 1.0)), g, matrix_name="tiny"),
                RunSettings(3, checkpoint_every=0, backend="cpu"), out, truth=truth)
    tsv = tmp_path / "tiny-scipy.tsv"
    tsv.write_text("s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
                   "1.5\t0:00:01\t120.5\t1\t1\t1\t0\t0\t0\t1\n2.5\t0:00:02\t130.0\t1\t1\t1\t0\t0\t0\t2\n")
    r = summarize([out.parent], tmp_path / "s", transpose_benchmarks=[tsv])
    assert any(p.endswith("image_tiny_memory.png") for p in r["plots"])
    md = (tmp_path / "s" / "summary.md").read_text()
    # A benchmark without its transpose file: the whole job only; two benchmark rows: their spread.
    head, rows = _md_section(md, "## Transposition times by method")
    assert dict(zip(head, rows[0])) == {
        "matrix": "tiny", "method": "scipy", "A^T of the runs": "", "transposition alone (s)": "", "threads": "",
        "whole job (s)": "2.00", "rest of the job (s)": "", "jobs": "2", "whole job min (s)": "1.50",
        "whole job max (s)": "2.50", "job's max RSS (MB)": "130"}


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


# --------------------------------------------------------------------------- scaling over GPUs
BYTES_PER_ITERATION = 4 * 10**9  # A and A^T of the whole matrix


def _scaling_timings(gpus, layout, reps_ms, *, steps_ms=None, graph=False, fp="csr_vector", bp="csr_vector",
                     rel=1e-7):
    """A cuda run: repetition k has 2 iterations of reps_ms[k] ms each (sum of steps_ms where given).

    Like mlem reconstruct: one GPU without graph capture is backend "cuda", else "cuda-nccl" with
    "graph" only in the backend's describe(); graph capture times only the whole iteration.
    """
    name = "cuda" if gpus == 1 and not graph else "cuda-nccl"
    reps = []
    for k, it_ms in enumerate(reps_ms):
        samples = {"iteration": [it_ms * 1e-3] * 2}
        if steps_ms and not graph:
            assert sum(steps_ms.values()) == pytest.approx(it_ms)
            samples.update({s: [v * 1e-3] * 2 for s, v in steps_ms.items()})
        reps.append({"repetition": k, "iterations": 2, "resumed_at": [], "wall_s": 1.0,
                     "steps": {s: stats(v) for s, v in samples.items()}, "samples": samples,
                     "accuracy": {"image_sum": 1000.0, "image_sha256": "ab", "rel_l2_reference": rel}})
    return {
        "format": "mlem-timings",
        "config": {"matrix": "madpet3", "data": "nema-seed1", "backend": name, "fp": fp, "bp": bp,
                   "fp_requested": fp, "bp_requested": bp, "secsize": None, "gpus": gpus, "layout": layout,
                   "iterations": 2, "repetitions": len(reps_ms), "dtype": "float32", "reference_mode": False,
                   "transpose": "results/madpet3/transpose.h5"},
        "backend": {"backend": name, "deterministic": True, "fp": fp, "bp": bp,
                    "transpose": "stored" if gpus == 1 and not graph else "local parts",
                    **({"graph": graph} if name == "cuda-nccl" else {})},
        "deterministic": True,
        "device": [{"name": "H200"}] * gpus,
        "bytes": {"A": BYTES_PER_ITERATION // 2, "AT": BYTES_PER_ITERATION // 2, "fp": BYTES_PER_ITERATION // 2,
                  "bp": BYTES_PER_ITERATION // 2, "iteration": BYTES_PER_ITERATION},
        "setup": {"load_s": 1.0, "backend_s": 1.0},
        "repetitions": reps,
    }


@pytest.fixture
def scaling_runs(tmp_path):
    """1, 2, 4 GPUs x local/thesis; graph capture on 2 and 4 GPUs only (no baseline); a cpu run; a 1-GPU-only run."""
    runs = {
        # T(1) = mean of the repetitions' means (3.9 ms, 4.1 ms) = 4.0 ms
        "csr-1-local": _scaling_timings(1, "local", [3.9, 4.1], rel=2e-7),
        "csr-2-local": _scaling_timings(2, "local", [2.0, 2.0], steps_ms={"fp": 0.5, "bp": 1.25, "allreduce": 0.25}),
        "csr-2-thesis": _scaling_timings(2, "thesis", [2.5]),
        "csr-4-local": _scaling_timings(4, "local", [1.25, 1.25], steps_ms={"fp": 0.25, "bp": 0.75, "allreduce": 0.25},
                                        rel=3e-7),
        "csr-4-thesis": _scaling_timings(4, "thesis", [1.9, 2.1]),
        "graph-2-local": _scaling_timings(2, "local", [1.6], graph=True),
        "graph-4-local": _scaling_timings(4, "local", [1.0], graph=True),
        "merge-1-local": _scaling_timings(1, "local", [5.0], fp="merge", bp="merge"),
        "cpu": _timings(backend="cpu", fp="numba", bp="numba", gpus=1, layout="local", sums=[999.0], digests=["dd"]),
    }
    root = tmp_path / "runs"
    for name, t in runs.items():
        (root / name).mkdir(parents=True)
        (root / name / "timings.json").write_text(json.dumps(t))
    return root


def _md_section(md, title, key=False):
    """Rows of the section ``title``'s full table (the first one after its "In full:" paragraph, or its first
    table where it has none), or with ``key`` its first table (the key columns), as lists of stripped cells
    (header first)."""
    from mlemlib.report.tables import MORE

    text = md[md.index(title):]
    end = text.find("\n## ", 1)
    section = text if end < 0 else text[:end]
    if not key and f"\n{MORE}" in section:
        text = section[section.index(f"\n{MORE}"):]
    lines = text.splitlines()
    start = next(k for k, ln in enumerate(lines) if ln.startswith("|"))
    table = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        table.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return table[0], table[2:]


def test_scaling_table(scaling_runs, tmp_path):
    from mlemlib.report import load_timings, run_rows, scaling_section, scaling_table

    summarize([scaling_runs], tmp_path / "s")
    md = (tmp_path / "s" / "summary.md").read_text()
    assert md.index("## Time per iteration by step") < md.index("## Scaling over GPUs") < md.index("## Accuracy")
    head, body = _md_section(md, "## Scaling over GPUs")
    # graph capture leaves fp/bp/allreduce blank; corr and update are never timed here: no columns
    assert head == ["matrix", "data", "configuration", "GPUs", "layout", "reps", "iteration (ms)", "fp (ms)", "bp (ms)",
                    "allreduce (ms)", "speed-up", "efficiency", "faster than fewer GPUs", "GB/s per GPU",
                    "rel. L2 to ref.", "deterministic"]
    got = {(r[2], r[3], r[4]): dict(zip(head, r)) for r in body}
    # cpu and the merge run (one GPU count only) are not in it; "cuda" (1 GPU) and "cuda-nccl" are one group
    assert sorted(got) == sorted([
        ("cuda csr_vector/csr_vector+AT", "1", "local"), ("cuda csr_vector/csr_vector+AT", "2", "local"),
        ("cuda csr_vector/csr_vector+AT", "2", "thesis"), ("cuda csr_vector/csr_vector+AT", "4", "local"),
        ("cuda csr_vector/csr_vector+AT", "4", "thesis"),
        ("cuda csr_vector/csr_vector+AT graph", "2", "local"), ("cuda csr_vector/csr_vector+AT graph", "4", "local")])
    # ordered by configuration, then GPUs, then layout
    assert [(r[2], r[3], r[4]) for r in body][:5] == [("cuda csr_vector/csr_vector+AT", p, lay) for p, lay in
                                                      (("1", "local"), ("2", "local"), ("2", "thesis"),
                                                       ("4", "local"), ("4", "thesis"))]

    def cols(key, *names):
        return [got[key][n] for n in names]

    c = "cuda csr_vector/csr_vector+AT"
    measures = ("reps", "iteration (ms)", "speed-up", "efficiency", "GB/s per GPU")
    # T1 = 4.0 ms; bandwidth per GPU = 4e9 B / P / T(P)
    assert cols((c, "1", "local"), *measures) == ["2", "4.00", "1.00", "1.00", "1000"]
    assert cols((c, "2", "local"), *measures) == ["2", "2.00", "2.00", "1.00", "1000"]
    assert cols((c, "2", "thesis"), *measures) == ["1", "2.50", "1.60", "0.80", "800"]
    assert cols((c, "4", "local"), *measures) == ["2", "1.25", "3.20", "0.80", "800"]
    assert cols((c, "4", "thesis"), *measures) == ["2", "2.00", "2.00", "0.50", "500"]
    assert cols((c, "4", "local"), "fp (ms)", "bp (ms)", "allreduce (ms)") == ["0.250", "0.750", "0.250"]
    assert cols((c, "1", "local"), "fp (ms)", "bp (ms)", "allreduce (ms)") == ["", "", ""]
    assert got[(c, "4", "local")]["rel. L2 to ref."] == "3.000e-07"
    assert got[(c, "1", "local")]["rel. L2 to ref."] == "2.000e-07"
    # no 1-GPU run with graph capture: no speed-up, but the bandwidth per GPU is still there
    assert cols(("cuda csr_vector/csr_vector+AT graph", "2", "local"), *measures) == ["1", "1.60", "–", "–", "1250"]
    assert cols(("cuda csr_vector/csr_vector+AT graph", "4", "local"), *measures) == ["1", "1.00", "–", "–", "1000"]

    assert [got[(c, p, lay)]["faster than fewer GPUs"] for p, lay in
            (("1", "local"), ("2", "local"), ("2", "thesis"), ("4", "local"), ("4", "thesis"))] == ["–"] + ["yes"] * 4
    # the records behind the table, unrounded
    recs = {(r["configuration"], r["gpus"], r["layout"]): r for r in scaling_table(run_rows(load_timings([scaling_runs])))}
    r4 = recs[(c, 4, "local")]
    assert r4["speedup"] == pytest.approx(3.2, rel=1e-12) and r4["efficiency"] == pytest.approx(0.8, rel=1e-12)
    assert r4["bandwidth_per_gpu_GBps"] == pytest.approx(800.0, rel=1e-12)
    assert recs[(c, 4, "thesis")]["efficiency"] == pytest.approx(0.5, rel=1e-12)
    assert recs[("cuda csr_vector/csr_vector+AT graph", 4, "local")]["speedup"] is None
    # nothing to compare: no section
    rows = run_rows(load_timings([scaling_runs / "csr-1-local", scaling_runs / "merge-1-local", scaling_runs / "cpu"]))
    assert scaling_section(rows) == "" and scaling_table(rows) == []


def test_scaling_table_says_where_more_gpus_were_slower(tmp_path):
    """A configuration slower on 2 GPUs than on 1 (all-reduce latency on a small matrix) is marked NO with the
    fewest faster GPU count and its time; 4 GPUs faster than both are marked yes."""
    from mlemlib.report import load_timings, run_rows, scaling_table

    root = tmp_path / "runs"
    for name, (p, ms) in {"a1": (1, [1.0]), "a2": (2, [1.6, 1.4]), "a4": (4, [0.9]), "a8": (8, [1.2])}.items():
        (root / name).mkdir(parents=True)
        (root / name / "timings.json").write_text(json.dumps(_scaling_timings(p, "local", ms)))
    recs = {r["gpus"]: r for r in scaling_table(run_rows(load_timings([root])))}
    assert recs[1]["slower_than"] is None and recs[4]["slower_than"] is None
    assert recs[2]["slower_than"] == (1, pytest.approx(1.0e-3, rel=1e-12))
    assert recs[8]["slower_than"] == (1, pytest.approx(1.0e-3, rel=1e-12))  # the fewest: 1 GPU, not 4
    summarize([root], tmp_path / "s")
    head, body = _md_section((tmp_path / "s" / "summary.md").read_text(), "## Scaling over GPUs")
    cell = {r[3]: dict(zip(head, r))["faster than fewer GPUs"] for r in body}
    assert cell == {"1": "–", "2": "NO (1 GPU: 1.00 ms)", "4": "yes", "8": "NO (1 GPU: 1.00 ms)"}


def test_scaling_graph_column_and_labels(scaling_runs, tmp_path):
    summarize([scaling_runs], tmp_path / "s")
    with open(tmp_path / "s" / "runs.csv", newline="") as fh:
        rows = {r["run"].split("/")[-1]: r for r in csv.DictReader(fh)}
    assert "graph" in RUN_COLUMNS
    assert rows["graph-2-local"]["graph"] == "True" and rows["csr-2-local"]["graph"] == "False"
    assert rows["cpu"]["graph"] == "False"
    # graph capture is a configuration of its own in the timing table too
    md = (tmp_path / "s" / "summary.md").read_text()
    assert "cuda csr_vector/csr_vector+AT graph x2 local" in md
    assert "cuda csr_vector/csr_vector+AT x2 local" in md


def test_auto_graph_runs_scale_against_their_one_gpu_run_with_steps_timed_kernel_by_kernel(tmp_path):
    """graph: auto replays graphs on 2 and 4 GPUs only: the three runs are one configuration of the scaling table
    (speed-up over the 1-GPU run), the multi-GPU rows take their steps from the iterations launched kernel by kernel
    after the run (marked in the timing table, named in runs.csv), and the time plot draws their whole iteration."""
    root = tmp_path / "runs"
    for gpus, ms in ((1, 4.0), (2, 2.0), (4, 1.0)):
        t = _scaling_timings(gpus, "local", [ms], graph=gpus > 1)
        t["config"].update(graph=gpus > 1, graph_requested="auto")
        if gpus > 1:  # what mlem reconstruct records after a graph run
            t["repetitions"][-1]["steps_kernel_by_kernel"] = {
                "fp": stats([0.3e-3 * 4 / gpus]), "bp": stats([0.9e-3 * 4 / gpus]), "allreduce": stats([0.2e-3])}
        (root / f"auto-{gpus}").mkdir(parents=True)
        (root / f"auto-{gpus}" / "timings.json").write_text(json.dumps(t))
    summarize([root], tmp_path / "s")
    md = (tmp_path / "s" / "summary.md").read_text()
    head, body = _md_section(md, "## Scaling over GPUs")
    got = {r[3]: dict(zip(head, r)) for r in body}
    assert sorted(got) == ["1", "2", "4"] and {r[2] for r in body} == {"cuda csr_vector/csr_vector+AT graph (auto)"}
    assert got["4"]["speed-up"] == "4.00" and got["2"]["allreduce (ms)"] == "0.200 †" and got["1"]["fp (ms)"] == ""
    head, body = _md_section(md, "## Time per iteration by step")
    rows = {r[2]: dict(zip(head, r)) for r in body}
    assert rows["cuda csr_vector/csr_vector+AT graph x4 local"]["allreduce (ms)"] == "0.200 †"
    assert rows["cuda csr_vector/csr_vector+AT x1"]["iteration (ms)"] == "4.00"
    assert "† : " not in md and "†: the run replayed each iteration as CUDA graphs" in md
    with open(tmp_path / "s" / "runs.csv", newline="") as fh:
        csv_rows = {r["run"].split("/")[-1]: r for r in csv.DictReader(fh)}
    assert csv_rows["auto-4"]["steps_from"] == "kernel by kernel" and csv_rows["auto-1"]["steps_from"] == ""
    assert csv_rows["auto-4"]["graph"] == "True" and float(csv_rows["auto-4"]["bp_mean_s"]) == pytest.approx(0.9e-3)


def test_scaling_plot(scaling_runs, tmp_path):
    import matplotlib.image as mpimg

    from mlemlib.report import load_timings, run_rows, scaling_series

    lines = scaling_series(run_rows(load_timings([scaling_runs])))
    conf = "madpet3/nema-seed1 cuda csr_vector/csr_vector+AT"
    # graph capture has no 1-GPU run: no line
    assert list(lines) == [(conf, "local"), (conf, "thesis")]
    assert [p for p, _ in lines[(conf, "local")]] == [1, 2, 4]
    assert [s for _, s in lines[(conf, "local")]] == pytest.approx([1.0, 2.0, 3.2], rel=1e-12)
    assert [p for p, _ in lines[(conf, "thesis")]] == [1, 2, 4]
    assert [s for _, s in lines[(conf, "thesis")]] == pytest.approx([1.0, 1.6, 2.0], rel=1e-12)

    r = summarize([scaling_runs], tmp_path / "s")
    path = tmp_path / "s" / "plots" / "scaling.png"
    assert str(path) in r["plots"]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img[..., :3].std() > 0.01
    assert "![Scaling over GPUs](plots/scaling.png)" in (tmp_path / "s" / "summary.md").read_text()

    # without a 1-GPU run there is no speed-up to plot: no file, and the other plots as before
    r = summarize([scaling_runs / "graph-2-local", scaling_runs / "graph-4-local"], tmp_path / "g")
    assert not (tmp_path / "g" / "plots" / "scaling.png").exists()
    assert sorted(p.split("/")[-1] for p in r["plots"]) == ["accuracy.png", "time_distribution.png",
                                                            "time_per_iteration.png", "time_vs_gpus.png"]
    md = (tmp_path / "g" / "summary.md").read_text()
    assert "## Scaling over GPUs" in md and "scaling.png" not in md


# --------------------------------------------------------------------------- what a reader sees
@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions save, by file name (the files are still written)."""
    from pathlib import Path

    from mlemlib.report import plots

    saved = {}
    real = plots._save

    def save(fig, path, dpi=110):
        saved[Path(path).name] = fig
        real(fig, path, dpi)

    monkeypatch.setattr(plots, "_save", save)
    return saved


def _iteration_timings(backend, fp, bp, iterations_ms, *, transpose="stored"):
    """A timings record of one repetition whose iterations took ``iterations_ms`` (ms)."""
    samples = {"iteration": [v * 1e-3 for v in iterations_ms]}
    rep = {"repetition": 0, "iterations": len(iterations_ms), "resumed_at": [], "wall_s": 1.0,
           "steps": {"iteration": stats(samples["iteration"])}, "samples": samples,
           "accuracy": {"image_sum": 1.0, "image_sha256": "aa"}}
    return {"config": {"matrix": "m", "data": "d", "backend": backend, "fp": fp, "bp": bp, "gpus": 1,
                       "layout": "local", "iterations": len(iterations_ms)},
            "backend": {"backend": backend, "transpose": transpose}, "repetitions": [rep]}


def test_time_plot_legend_hides_no_point_and_labels_are_explained(runs, tmp_path, figures):
    root, _, _ = runs
    summarize([root], tmp_path / "s")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figures["time_per_iteration.png"]
    ax = fig.axes[0]
    renderer = FigureCanvasAgg(fig).get_renderer()  # the saved figure's canvas is closed
    legend, frame = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
    assert legend.x0 >= frame.x1  # beside the axes, over no bar or point
    points = [x for line in ax.get_lines() for x in line.get_xdata()]
    assert len(points) == 5 and all(ax.get_xlim()[0] <= x <= ax.get_xlim()[1] for x in points)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["cuda csr_vector/notrans x8 thesis", "cpu numba/numba+AT"]
    assert "madpet3 / nema-seed1" in ax.get_title()  # the one problem, once
    key = " ".join(t.get_text() for t in fig.texts).replace("\n", " ")
    for term in ("+AT: the back projection reads a stored transpose A^T", "notrans", "xP: on P GPUs", "thesis"):
        assert term in key


def test_distribution_outliers_are_shown_but_do_not_set_the_scale(tmp_path, figures):
    from mlemlib.report import group_rows, load_timings, plot_distribution, run_rows

    rng = np.random.default_rng(3)
    a = _iteration_timings("cpu", "numba", "numba", [*rng.uniform(1.0, 2.5, 60), 7.0, 13.75])
    b = _iteration_timings("cpu", "scipy", "notrans", rng.uniform(1.5, 3.0, 60), transpose="none")
    plot_distribution(group_rows(run_rows(load_timings([a, b]))), tmp_path / "d.png")
    ax = figures["d.png"].axes[0]
    low, high = ax.get_xlim()
    assert 3.0 <= high < 4.0 and low <= 1.0  # every box and whisker, not the outliers
    notes = [t.get_text() for t in ax.texts]
    assert notes == ["2 beyond: 7, 13.75 ms"]
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_accuracy_plot_shows_sums_relative_to_the_reference(runs, tmp_path, figures):
    root, _, _ = runs
    summarize([root], tmp_path / "s")
    ax = figures["accuracy.png"].axes[0]
    points = sorted(x for line in ax.get_lines() if line.get_marker() == "o" for x in line.get_xdata())
    # image sums 1000.5, 1000.25, 1000.75 and 999 (twice) against the reference's 1000
    assert points == pytest.approx([-1e-3, -1e-3, 2.5e-4, 5e-4, 7.5e-4], rel=1e-9)
    low, high = ax.get_xlim()
    assert low == pytest.approx(-high) and high >= 1e-3
    assert "(S - S_ref) / S_ref" in ax.get_xlabel()
    assert max(abs(tick) for tick in ax.get_xticks()) < 0.01  # relative values, not sums of about 1000


def _tiny_problem(tmp_path, voxel_size):
    """A reconstruction of a random 8x6x4-voxel problem beside a truth 10x brighter; the run directory."""
    from mlemlib.matrix import CSRMatrix
    from mlemlib.formats import InMemoryMatrix
    from mlemlib.image import write_image
    from mlemlib.mlem import reconstruct

    rng = np.random.default_rng(1)
    grid = (8, 6, 4)
    n = int(np.prod(grid))
    m = 300
    indptr = np.arange(0, 6 * m + 1, 6)
    a = CSRMatrix(indptr, rng.integers(0, n, 6 * m), rng.uniform(0.1, 1, 6 * m).astype(np.float32), (m, n))
    g = rng.poisson(5.0, m).astype(np.int32)
    truth = tmp_path / "truth.h5"
    write_image(truth, np.full(n, 1000.0, np.float32), grid=grid, voxel_size=voxel_size)
    out = tmp_path / "results" / "runs" / "x" / "image.h5"
    reconstruct(ModelSpec(InMemoryMatrix(a, grid=grid, voxel_size=voxel_size), g, matrix_name="tiny"),
                RunSettings(3, checkpoint_every=0, backend="cpu"), out, truth=truth)
    return out.parent


def test_image_plot_has_mm_axes_one_colour_scale_and_units(tmp_path, figures):
    from mlemlib.image import read_image

    run = _tiny_problem(tmp_path, (2.0, 2.0, 3.0))
    summarize([run], tmp_path / "s")
    fig = figures["image_tiny_memory.png"]
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert len(images) == 6  # truth and reconstruction, three slices each
    assert {im.get_clim() for im in images} == {images[0].get_clim()}  # one colour scale
    recon, _ = read_image(run / "image.h5")
    assert images[0].get_clim()[1] == pytest.approx(max(np.percentile(recon, 99.9), 1000.0))
    # 8 x 6 x 4 voxels of 2 x 2 x 3 mm, centred on 0: x in +-8, y in +-6, z in +-6 mm
    assert [tuple(im.get_extent()) for im in images[:3]] == [(-8, 8, -6, 6), (-8, 8, -6, 6), (-6, 6, -6, 6)]
    assert [ax.get_xlabel() for ax in fig.axes[:3]] == ["x (mm)", "x (mm)", "y (mm)"]
    bars = [ax for ax in fig.axes if not ax.get_images()]
    assert len(bars) == 1 and "expected counts per LOR" in bars[0].get_ylabel()


def test_transposition_table_says_what_each_time_measures(tmp_path):
    import h5py

    from mlemlib.report import TRANSPOSE_INTRO

    # The numbers: ScanTrans 48.7 ms in a 5.62 s job, SciPy 149.6 ms in a 0.84 s job.
    files = {"transpose.h5": ("scantrans", 0.0487, 64, 5.62, "m1.tsv"),
             "transpose-scipy.h5": ("scipy", 0.1496, 1, 0.84, "m1-scipy.tsv")}
    transposes, benchmarks = [], []
    for name, (method, seconds, threads, job, tsv) in files.items():
        path = tmp_path / "results" / "m1" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(path, "w") as f:
            f.attrs.update(method=method, seconds=seconds, threads=threads)
        bench = tmp_path / "benchmarks" / "transpose" / tsv
        bench.parent.mkdir(parents=True, exist_ok=True)
        bench.write_text(f"s\th:m:s\tmax_rss\n{job}\t0:00:01\t100.0\n")
        transposes.append(path)
        benchmarks.append(bench)
    summarize([], tmp_path / "s", transposes=transposes, transpose_benchmarks=benchmarks)
    md = (tmp_path / "s" / "summary.md").read_text()
    head, rows = _md_section(md, "## Transposition times by method")
    table = {r[1]: dict(zip(head, r)) for r in rows}
    assert set(table) == {"scantrans", "scipy"} and "(configured)" not in md
    assert (table["scantrans"]["A^T of the runs"], table["scipy"]["A^T of the runs"]) == ("yes", "")
    # seconds, the unit in the header, to 3 significant digits
    assert [table["scantrans"][c] for c in ("transposition alone (s)", "whole job (s)", "rest of the job (s)")] == [
        "0.0487", "5.62", "5.57"]
    assert [table["scipy"][c] for c in ("transposition alone (s)", "whole job (s)", "rest of the job (s)")] == [
        "0.150", "0.840", "0.690"]
    assert "jobs" not in head  # one benchmark row each: no spread columns
    # the text above the table says which column compares the methods
    assert TRANSPOSE_INTRO in md and "compare methods by this column" in TRANSPOSE_INTRO


def test_html_tables_for_the_report(runs, tmp_path):
    import base64

    from mlemlib.report import markdown_page

    root, _, _ = runs
    r = summarize([root], tmp_path / "s", name="mine")
    md = (tmp_path / "s" / "summary.md").read_text()
    html = (tmp_path / "s" / "summary.html").read_text()
    assert r["summary_html"] == str(tmp_path / "s" / "summary.html")
    assert html.startswith("<!DOCTYPE html>") and "<h1>MLEM runs: summary of configuration mine</h1>" in html
    for line in md.splitlines():
        if line.startswith("## "):
            assert f"<h2>{line[3:]}</h2>" in html
    assert html.count("<table>") == sum(line.startswith("|---") for line in md.splitlines()) > 3
    assert "|---" not in html
    assert '<td style="text-align: right;">2092</td>' in html  # a time cell (ms) of the thesis table, right-aligned
    assert "<td>cuda csr_vector/notrans x8 thesis</td>" in html  # a text cell, left-aligned
    # the Plots section shows the images, embedded so that the page shows them in the Snakemake report too
    images = [p for p in r["plots"]]
    assert html.count('<img alt="') == len(images) == 4
    for p in images:
        data = base64.b64encode(open(p, "rb").read()).decode("ascii")
        assert f'src="data:image/png;base64,{data}"' in html
    assert "![Time per iteration by configuration](plots/time_per_iteration.png)" in md
    # runs.html: a header and one row per run and repetition, every column of runs.csv
    runs_page = (tmp_path / "s" / "runs.html").read_text()
    with open(tmp_path / "s" / "runs.csv", newline="") as fh:
        header = next(csv.reader(fh))
    assert runs_page.count("<tr>") == 1 + r["rows"]
    assert all(f"<th>{c}</th>" in runs_page for c in header)
    # escaped bars, code and emphasis of the Markdown the summary writes; raw HTML is shown as text
    page = markdown_page("| a | b\\|c |\n|---|---|\n| 1 | `x` \\| *y* <b>z</b> |\n", "t")
    assert "<th>b|c</th>" in page and "<td><code>x</code> | <em>y</em> &lt;b&gt;z&lt;/b&gt;</td>" in page
    # an image without its file stays a link
    assert '<img alt="p" src="plots/none.png"' in markdown_page("![p](plots/none.png)\n", "t", base=tmp_path)


def test_summary_head_counts_runs_apart_from_the_reference(runs, tmp_path):
    root, a, _ = runs
    ref = json.loads(json.dumps(a))
    ref["config"].update(reference_mode=True, backend="cpu", dtype="float64")
    summarize([root, ref], tmp_path / "s")
    md = (tmp_path / "s" / "summary.md").read_text()
    assert "2 runs and 1 float64 reference, 8 repetitions, 3 configurations." in md


def _spmv_csv(path, rows):
    cols = ["op", "kernel", "lanes", "secsize", "deterministic", "median_s", "min_s", "bytes", "bandwidth", "of_copy",
            "vs_cusparse", "rel_l2", "shape", "auto"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow(r)


def test_spmv_table_in_ms_with_kernels_named_and_choices_marked(tmp_path):
    path = tmp_path / "results" / "madpet2" / "bench" / "spmv.csv"
    _spmv_csv(path, [
        {"op": "fp", "kernel": "csr_vector", "lanes": 32, "deterministic": True, "median_s": 0.0012345678901234,
         "min_s": 0.00119876, "bytes": 7_700_000_000, "bandwidth": 4.123456789e12, "of_copy": 0.91234,
         "vs_cusparse": 1.53456, "rel_l2": 1.234567e-8, "shape": "256t", "auto": True},
        {"op": "fp", "kernel": "cusparse", "deterministic": True, "median_s": 0.0018939, "min_s": 0.00187,
         "bytes": 7_700_000_000, "bandwidth": 4.0e12, "of_copy": 0.6, "vs_cusparse": 1.0, "rel_l2": 2e-8},
        {"op": "bp", "kernel": "merge", "secsize": 5, "deterministic": False, "median_s": 0.00345, "min_s": 0.0034,
         "bytes": 7_700_000_000, "bandwidth": 2.2e12, "of_copy": 0.5, "vs_cusparse": "", "rel_l2": 3e-8},
    ])
    summarize([], tmp_path / "s", bench=[path])
    md = (tmp_path / "s" / "summary.md").read_text()
    assert "## SpMV benchmark" in md and "### madpet2" in md
    head, rows = _md_section(md, "### madpet2")
    assert head == ["operation", "kernel", "deterministic", "median (ms)", "fastest (ms)", "MB read", "GB/s",
                    "of copy", "vs cuSPARSE", "rel. L2", ""]
    assert rows[0] == ["fp", "csr_vector (32 lanes, 256t)", "yes", "1.23", "1.20", "7700", "4123", "91%", "1.53",
                       "1.235e-08", "*fastest*, *auto*"]
    assert rows[1][:4] == ["fp", "cusparse", "yes", "1.89"] and rows[1][-1] == ""
    assert rows[2][:4] == ["bp", "merge (secsize 5)", "NO (atomics)", "3.45"] and rows[2][-1] == "*fastest*"
    assert rows[2][8] == ""  # no cuSPARSE time to compare with
    assert "0.0012345678901234" not in md  # no raw seconds
    html = (tmp_path / "s" / "summary.html").read_text()
    assert '<td style="text-align: right;">1.23</td>' in html and "<em>auto</em>" in html
    # an older table without the shape and auto columns: the kernels still named, nothing marked auto
    old = tmp_path / "old" / "bench" / "spmv.csv"
    old.parent.mkdir(parents=True)
    old.write_text("op,kernel,lanes,secsize,deterministic,median_s,min_s,bytes,bandwidth,of_copy,vs_cusparse,rel_l2\n"
                   "fp,csr_vector,8,,True,0.000123456,0.00012,1000000,8.1e12,0.95,2.5,1e-8\n")
    summarize([], tmp_path / "o", bench=[old])
    head, rows = _md_section((tmp_path / "o" / "summary.md").read_text(), "### old")
    assert rows == [["fp", "csr_vector (8 lanes)", "yes", "0.123", "0.120", "1.00", "8100", "95%", "2.50", "1.000e-08",
                     "*fastest*"]]
    # a file that is not a benchmark table is named
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(InputError, match="not an SpMV benchmark table"):
        summarize([], tmp_path / "b", bench=[bad])


def test_time_plot_gives_each_scale_its_own_panel(tmp_path, figures):
    """A 3.6 s float64 reference beside GPU runs of 1-4 ms: two panels, every bar wider than a few pixels."""
    from mlemlib.report import group_rows, load_timings, plot_times, run_rows, time_panels

    assert time_panels([3.6, 1e-3, 4e-3, None, 3.0]) == [[1, 2, 3], [0, 4]]
    assert time_panels([1.0, 2.0]) == [[0, 1]]
    ref = _iteration_timings("cpu", "scipy", "scipy", [3600.0, 3600.0])
    ref["config"]["reference_mode"] = True
    gpu1 = _iteration_timings("cuda", "csr_vector", "csr_vector", [1.0, 1.2])
    gpu4 = _iteration_timings("cuda", "merge", "merge", [4.0, 4.2])
    plot_times(group_rows(run_rows(load_timings([ref, gpu1, gpu4]))), tmp_path / "t.png")
    fig = figures["t.png"]
    fast, slow = fig.axes[:2]
    assert [t.get_text() for t in fast.get_yticklabels()] == ["cuda csr_vector/csr_vector+AT x1",
                                                             "cuda merge/merge+AT x1"]
    assert [t.get_text() for t in slow.get_yticklabels()] == ["reference (float64)"]
    assert fast.get_xlabel() == "time per iteration (ms)" and slow.get_xlabel() == "time per iteration (s)"
    widths = [p.get_width() for p in fast.patches]
    assert min(widths) / fast.get_xlim()[1] > 0.2  # the 1 ms bar is a fifth of its axis at least
    assert slow.patches[0].get_width() == pytest.approx(3.6)
    assert fast.get_legend() is not None and "separate panels" in " ".join(t.get_text() for t in fig.texts)


def test_scaling_and_time_vs_gpus_plots_give_each_series_its_colour(scaling_runs, tmp_path, figures):
    from matplotlib.colors import to_hex

    summarize([scaling_runs], tmp_path / "s")
    for name in ("scaling.png", "time_vs_gpus.png"):
        ax = figures[name].axes[0]
        series = [ln for ln in ax.get_lines() if ln.get_label() and not ln.get_label().startswith("_")
                  and not ln.get_label().startswith("ideal")]
        labels = [ln.get_label() for ln in series]
        assert {lab.rsplit(", ", 1)[1] for lab in labels} == {"local layout", "thesis layout"}
        colours = [to_hex(ln.get_color()) for ln in series]
        assert len(set(colours)) == len(colours) >= 2, (name, labels, colours)
        assert ax.get_legend() is not None
        assert set(labels) <= {t.get_text() for t in ax.get_legend().get_texts()}


# --------------------------------------------------------------------------- hardware, energy, the thesis beside us
MATRIX3_SHAPE = [5_308_416, 2_592_000]


def _gpu(i, theoretical=4.8e12, copy=4.0e12):
    return {"index": i, "name": "NVIDIA H200", "theoretical_bandwidth": theoretical,
            "copy_bandwidth": {"bytes": 1 << 29, "median_s": 1e-4, "bandwidth": copy, "checked": True}}


def _gpu_run(gpus, *, shape=MATRIX3_SHAPE, scale=0.25, onepass=False, devices=None, energy=(400.0, 410.0)):
    """A cuda run on ``gpus`` H200s: TABLE_93's steps times ``scale``, energy per iteration per repetition."""
    t = _timings(backend="cuda" if gpus == 1 else "cuda-nccl", fp="csr_vector", bp="onepass" if onepass else "notrans",
                 gpus=gpus, layout="local", sums=[1000.0] * len(energy), digests=["x"] * len(energy),
                 deterministic=False, scale=scale, transpose="none")
    t["shape"] = shape
    devs = devices if devices is not None else [_gpu(i, copy=4.0e12 + 1e10 * i) for i in range(gpus)]
    t["backend"].update(format="compressed", bytes_per_nnz={"A": 5.25, "AT": None})
    if gpus == 1:
        t["backend"]["device"] = t["device"] = devs[0]
    else:
        t["backend"]["devices"] = t["device"] = devs
    for rep, e in zip(t["repetitions"], energy):
        rep.update(energy_J=4 * e, energy_per_iteration_J=e, power_W=700.0, energy_gpus=len(devs),
                   energy_note="NVML", clock_capped_s={"power": e / 1000, "thermal": 0.0})
        if onepass:  # one kernel: no separate fp (nor corr)
            for step in ("fp", "corr"):
                del rep["samples"][step], rep["steps"][step]
    return t


def test_runs_csv_hardware_and_energy_columns(tmp_path):
    one = _gpu_run(1)
    two = _gpu_run(2)
    mpi = _gpu_run(2, devices=[_gpu(0, copy=3.9e12)])  # one GPU per process: rank 0 records only its own
    cpu = _timings(backend="cpu", fp="numba", bp="numba", gpus=1, layout="local", sums=[999.0], digests=["d"])
    cpu["device"] = {"name": "host", "theoretical_bandwidth": 1e11}
    r = summarize([one, two, mpi, cpu], tmp_path / "s")
    with open(r["runs_csv"], newline="") as fh:
        rows = list(csv.DictReader(fh))
    for col in ("format", "bytes_per_nnz", "energy_per_iteration_J", "power_W", "gpu_bandwidth_theoretical_GBps",
                "gpu_bandwidth_measured_GBps"):
        assert col in RUN_COLUMNS
    r1, r2, r3, r4 = rows[0], rows[2], rows[4], rows[6]
    assert (r1["format"], float(r1["bytes_per_nnz"])) == ("compressed", 5.25)
    assert float(r1["gpu_bandwidth_theoretical_GBps"]) == pytest.approx(4800.0)
    assert float(r1["gpu_bandwidth_measured_GBps"]) == pytest.approx(4000.0)
    assert float(r2["gpu_bandwidth_theoretical_GBps"]) == pytest.approx(9600.0)  # 2 x 4800
    assert float(r2["gpu_bandwidth_measured_GBps"]) == pytest.approx(8010.0)  # 4000 + 4010
    assert float(r3["gpu_bandwidth_theoretical_GBps"]) == pytest.approx(9600.0)  # its GPU's x 2 GPUs
    assert float(r3["gpu_bandwidth_measured_GBps"]) == pytest.approx(7800.0)
    assert (float(rows[0]["energy_per_iteration_J"]), float(rows[1]["energy_per_iteration_J"])) == (400.0, 410.0)
    assert (float(r1["energy_J"]), float(r1["power_W"]), r1["energy_gpus"]) == (1600.0, 700.0, "1")
    assert r3["energy_gpus"] == "1"  # this process's GPU only
    assert (float(rows[0]["power_capped_s"]), float(rows[1]["power_capped_s"])) == (0.4, 0.41)
    assert float(r1["thermal_capped_s"]) == 0.0
    # the CPU: no GPU figures, no energy
    assert r4["backend"] == "cpu"
    for col in ("gpu_bandwidth_theoretical_GBps", "gpu_bandwidth_measured_GBps", "energy_per_iteration_J",
                "power_W", "bytes_per_nnz", "power_capped_s", "thermal_capped_s"):
        assert r4[col] == ""
    md = (tmp_path / "s" / "summary.md").read_text()
    line = next(ln for ln in md.splitlines() if ln.startswith("| madpet3 | nema-seed1 | cuda csr_vector/notrans x1 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    head = next(ln for ln in md.splitlines() if ln.startswith("| matrix | data | configuration | format (bytes/nnz) |"))
    named = dict(zip([c.strip() for c in head.strip("|").split("|")], cells))
    assert named["format (bytes/nnz)"] == "compressed (5.25)" and named["J/iteration"] == "405"


def test_thesis_section_for_matrix3_only(tmp_path):
    from mlemlib import thesis
    from mlemlib.report import run_rows, thesis_table

    # Table 9.3's steps sum to 3.208800624 s per iteration; scale 0.25: ours take a quarter, a speed-up of 4.
    assert thesis.MATRIX3_DGX1.iteration_s == pytest.approx(3.208800624, rel=1e-12)
    r = summarize([_gpu_run(1), _gpu_run(2, onepass=True, scale=0.125)], tmp_path / "s")
    md = (tmp_path / "s" / "summary.md").read_text()
    assert "## The thesis beside us: Matrix 3 (Table 4.3)" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| thesis: ") or ln.startswith("| cuda")]
    thesis_rows = [ln for ln in rows if "Table 9.3" in ln or "x8 (DGX-1)" in ln]
    assert len(thesis_rows) == 2 and "| 897 | 7176 | – | 3209 | 16.5 | 2092 | 1100 | 1.00 | 1.00 | 1.00 |" in md
    assert "| iteration (ms) | fp (ms) | bp (ms) | allreduce (ms) |" in md
    # 1 H200: speed-up 4, bandwidth ratio 4800 / (8 x 897) = 0.6689, kernel gain 4 / 0.6689 = 5.98
    assert "| 4800 | 4800 | 4000 | 802 | 4.12 | 523 | 275 | 4.00 | 0.67 | 5.98 | 405 |" in md
    # 2 H200, one pass (no fp of its own): speed-up 8, ratio 1.338, gain 5.98; "fused into bp", not 0
    two = next(ln for ln in md.splitlines() if ln.startswith("| cuda csr_vector/onepass x2 local | madpet3"))
    assert "| fused into bp |" in two and "| 0 " not in two and "| 8.00 | 1.34 | 5.98 |" in two
    recs = thesis_table(run_rows([("a", _gpu_run(1)), ("b", _gpu_run(2, onepass=True, scale=0.125))]))
    assert [rec["thesis"] for rec in recs] == [True, False, False]
    assert recs[1]["speedup"] == pytest.approx(4.0, rel=1e-12)
    assert recs[1]["bandwidth_ratio"] == pytest.approx(4800 / 7176, rel=1e-12)
    assert recs[2]["kernel_gain"] == pytest.approx(8.0 / (9600 / 7176), rel=1e-12)
    assert recs[2]["fp_s"] is None
    # any other shape: no section
    r = summarize([_gpu_run(1, shape=[5_308_416, 2_591_999])], tmp_path / "o")
    assert "thesis beside us" not in (tmp_path / "o" / "summary.md").read_text()


def test_thesis_section_takes_a_folded_run_by_its_users_shape(tmp_path):
    folded = _gpu_run(1, shape=[1_397_868, 2_592_000], scale=0.01, onepass=True)
    folded["fold"] = {"user_rows": MATRIX3_SHAPE[0], "method": "pairs"}
    other = _gpu_run(1, shape=[1_397_868, 2_592_000], scale=0.01, onepass=True)  # not folded: another shape
    summarize([folded], tmp_path / "s")
    md = (tmp_path / "s" / "summary.md").read_text()
    assert "## The thesis beside us: Matrix 3 (Table 4.3)" in md
    assert "madpet3 (folded: each LOR once, 1,397,868 stored rows) / nema-seed1" in md
    assert "| compressed (5.25), folded |" in md and "folded: the matrix stores each distinct row once" in md
    summarize([other], tmp_path / "o")
    assert "thesis beside us" not in (tmp_path / "o" / "summary.md").read_text()


def test_time_vs_gpus_plot(tmp_path):
    import matplotlib.image as mpimg

    from mlemlib.report import run_rows, time_vs_gpus_series

    runs = [("a", _gpu_run(1)), ("b", _gpu_run(2, scale=0.15))]
    lines = time_vs_gpus_series(run_rows(runs))
    assert list(lines) == [("madpet3/nema-seed1 cuda csr_vector/notrans", "local")]
    pts = lines[("madpet3/nema-seed1 cuda csr_vector/notrans", "local")]
    assert sorted(pts) == [1, 2] and pts[2] == pytest.approx([0.15 * sum(TABLE_93.values())] * 2, rel=1e-12)
    r = summarize([t for _, t in runs], tmp_path / "s")
    path = tmp_path / "s" / "plots" / "time_vs_gpus.png"
    assert str(path) in r["plots"] and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert mpimg.imread(path)[..., :3].std() > 0.01
    # a CPU-only summary has no GPU axis: no file
    cpu = _timings(backend="cpu", fp="numba", bp="numba", gpus=1, layout="local", sums=[999.0], digests=["d"])
    r = summarize([cpu], tmp_path / "c")
    assert not (tmp_path / "c" / "plots" / "time_vs_gpus.png").exists()


def test_floor_fractions_at_the_measured_copy_bandwidth(tmp_path):
    """of floor / of CSR floor: the bytes read (own format; the CSR pair) at the run's copy bandwidth over its time."""
    from mlemlib.report import csr_pair_bytes, floor_fractions

    m, n, nnz = 1000, 400, 50_000
    assert csr_pair_bytes([m, n], nnz) == 8 * 1001 + 8 * 401 + 16 * nnz  # 811,216
    t = {"shape": [m, n], "nnz": nnz, "bytes": {"iteration": 262_500}}  # 5.25 B/nnz, read once (one pass)
    own, csr = floor_fractions(t, 1e-6, 4.0e11)  # 1 us at 400 GB/s
    assert own == pytest.approx(262_500 / 4.0e11 / 1e-6)  # 0.65625
    assert csr == pytest.approx(811_216 / 4.0e11 / 1e-6)  # 2.028: faster than the CSR pair can be
    assert floor_fractions(t, 1e-6, None) == (None, None)  # no copy bandwidth measured (the CPU)
    # in runs.csv and the timing table
    run = _gpu_run(1)
    run["nnz"] = 1_000_000
    run["bytes"]["iteration"] = 5_250_000
    r = summarize([run], tmp_path / "s")
    with open(r["runs_csv"], newline="") as fh:
        row = next(csv.DictReader(fh))
    secs = float(row["iteration_mean_s"])
    assert float(row["of_floor"]) == pytest.approx(5_250_000 / 4.0e12 / secs)
    assert float(row["of_csr_floor"]) == pytest.approx(csr_pair_bytes(MATRIX3_SHAPE, 1_000_000) / 4.0e12 / secs)
    md = (tmp_path / "s" / "summary.md").read_text()
    assert "| of floor | of CSR floor |" in md


def test_lossy_section_measures_each_image_against_the_exact_matrix_reference(tmp_path):
    """The accuracy cost of lossy values: each run's image against the exact reference of its problem,
    hand-computed; problems without an exact reference are left out, and a wrong path is refused."""
    from mlemlib.errors import InputError
    from mlemlib.image import write_image
    from mlemlib.report import exact_reference_problem, lossy_section

    exact = tmp_path / "results" / "m" / "runs" / "d" / "reference-exact" / "image.h5"
    exact.parent.mkdir(parents=True)
    ref = np.array([1.0, 2.0, 2.0, 4.0])
    write_image(exact, ref)
    imgs = {"a": np.array([1.0, 2.0, 2.0, 4.5], np.float32), "b": np.array([1.0, 2.0, 2.0, 4.0], np.float32)}
    rows = []
    for name, img in imgs.items():
        write_image(tmp_path / f"{name}.h5", img)
        rows.append({"matrix": "m", "data": "d", "run": name, "backend": "cpu", "fp": "auto", "bp": name,
                     "format": "csr", "iterations": 5, "rel_l2_reference": 1e-6,
                     "_outputs": {"image": str(tmp_path / f"{name}.h5")}})
    rows.append({**rows[0], "matrix": "other", "run": "c"})  # no exact reference: not in the table
    assert exact_reference_problem(exact) == ("m", "d")
    text = lossy_section(rows, [exact])
    assert "## Accuracy cost of lossy matrix values" in text
    assert "| m | d | cpu auto/a | csr | 5 | 1.000e-01 | 1.000e-06 |" in text  # ||(0,0,0,0.5)|| / ||(1,2,2,4)|| = 0.5/5
    assert "| m | d | cpu auto/b | csr | 5 | 0.000e+00 |" in text and "other" not in text
    assert lossy_section(rows, []) == ""
    with pytest.raises(InputError, match="reference-exact/image.h5"):
        exact_reference_problem(tmp_path / "image.h5")


# --------------------------------------------------------------------------- a mixed summary: reference, CPU, GPUs
@pytest.fixture
def mixed_runs(tmp_path):
    """What issue 40's user saw: a 3.6 s float64 reference, a CPU run of about 3 ms and GPU runs of 1-4 ms on
    1, 2 and 4 GPUs in both layouts, of one problem."""
    ref = _scaling_timings(1, "local", [3600.0], steps_ms={"fp": 1500.0, "bp": 2100.0})
    ref["config"].update(backend="cpu", reference_mode=True, dtype="float64")
    runs = {
        "reference": ref,
        "cpu": _timings(backend="cpu", fp="numba", bp="numba", gpus=1, layout="local", sums=[999.0], digests=["d"],
                        scale=1e-3),
        "gpu-1": _scaling_timings(1, "local", [4.0, 4.0], steps_ms={"fp": 1.2345678, "bp": 2.7654322}),
        "gpu-2-local": _scaling_timings(2, "local", [2.0], steps_ms={"fp": 0.5, "bp": 1.25, "allreduce": 0.25}),
        "gpu-2-thesis": _scaling_timings(2, "thesis", [2.5]),
        "gpu-4-local": _scaling_timings(4, "local", [1.25], steps_ms={"fp": 0.25, "bp": 0.75, "allreduce": 0.25}),
        "gpu-4-thesis": _scaling_timings(4, "thesis", [1.9]),
    }
    root = tmp_path / "runs"
    for name, t in runs.items():
        (root / name).mkdir(parents=True)
        (root / name / "timings.json").write_text(json.dumps(t))
    return root


def _md_tables(md):
    """Every pipe table of ``md``: (header cells, rows of cells)."""
    tables, current = [], None
    for ln in md.splitlines():
        if ln.startswith("|"):
            cells = [c.strip() for c in ln.strip("|").split("|")]
            if current is None:
                current = (cells, [])
                tables.append(current)
            elif not ln.startswith("|---"):
                current[1].append(cells)
        else:
            current = None
    return tables


def _significant(cell):
    """Significant digits of a plain decimal number (``0.00320`` -> 3, ``2092`` -> 4)."""
    digits = cell.replace("-", "").replace(".", "").lstrip("0")
    return len(digits)


def test_mixed_summary_tables_name_their_units_and_round_times(mixed_runs, tmp_path):
    """Times in a column of one unit named in its header (3.6 s and 1 ms in one column: 3600 and 1.25), to 3
    significant digits (4 above 1000); no unit inside a cell; a step no run timed has no column."""
    summarize([mixed_runs], tmp_path / "s")
    md = (tmp_path / "s" / "summary.md").read_text()
    tables = _md_tables(md)
    assert len(tables) >= 8
    time_columns = 0
    for head, rows in tables:
        for k, name in enumerate(head):
            cells = [r[k] for r in rows if k < len(r)]
            assert not any(re.fullmatch(r"[\d.]+ ?(s|ms|us)", c) for c in cells), (name, cells)  # unit in the header
            if name.endswith(("(ms)", "(s)")):
                time_columns += 1
                for c in cells:
                    assert c in ("", "–") or c.startswith("fused") or (
                        re.fullmatch(r"\d+(\.\d+)?", c) and _significant(c) <= 4), (name, c)
    assert time_columns >= 20
    head, rows = _md_section(md, "## Time per iteration by step")
    named = {r[2]: dict(zip(head, r)) for r in rows}
    assert named["reference (float64)"]["iteration (ms)"] == "3600"
    assert named["cuda csr_vector/csr_vector+AT x1"]["iteration (ms)"] == "4.00"
    assert named["cuda csr_vector/csr_vector+AT x1"]["fp (ms)"] == "1.23"
    assert named["cuda csr_vector/csr_vector+AT x4 local"]["allreduce (ms)"] == "0.250"
    assert [named["cpu numba/numba"][c] for c in ("iteration (ms)", "bp (ms)", "update (ms)")] == [
        "3.21", "2.09", "0.0000494"]
    assert "format (bytes/nnz)" in head and "GB/s" in head
    # no run timed a step: no column (here every step is timed by some run)
    summarize([mixed_runs / "gpu-2-thesis"], tmp_path / "one")
    head, _ = _md_section((tmp_path / "one" / "summary.md").read_text(), "## Time per iteration by step")
    assert not any(h.startswith(("fp", "bp", "allreduce")) for h in head)
    # the count in the head leaves the reference out
    assert "6 runs and 1 float64 reference, 8 repetitions, 7 configurations." in md


def test_mixed_summary_html_shows_every_plot_and_right_aligned_times(mixed_runs, tmp_path):
    r = summarize([mixed_runs], tmp_path / "s")
    html = (tmp_path / "s" / "summary.html").read_text()
    names = sorted(p.rsplit("/", 1)[1] for p in r["plots"])
    assert names == ["accuracy.png", "scaling.png", "time_distribution.png", "time_per_iteration.png",
                     "time_vs_gpus.png"]
    assert html.count('<img alt="') == 5 and html.count('src="data:image/png;base64,') == 5
    assert '<th style="text-align: right;">iteration (ms)</th>' in html and '<td style="text-align: right;">3600</td>' in html


def test_mixed_time_plot_and_scaling_colours(mixed_runs, tmp_path, figures):
    """The time plot puts the 3.6 s reference in a panel of its own (s), the 1-4 ms runs in one of ms whose
    smallest bar is a fifth of its axis at least; scaling.png draws local and thesis in two colours."""
    from matplotlib.colors import to_hex

    summarize([mixed_runs], tmp_path / "s")
    fig = figures["time_per_iteration.png"]
    fast, slow = fig.axes[:2]
    assert [t.get_text() for t in slow.get_yticklabels()] == ["reference (float64)"]
    assert fast.get_xlabel() == "time per iteration (ms)" and slow.get_xlabel() == "time per iteration (s)"
    totals = {}
    for p in fast.patches:  # stacked bars: a configuration's total is its right-most edge
        row = round(p.get_y() + p.get_height() / 2)
        totals[row] = max(totals.get(row, 0.0), p.get_x() + p.get_width())
    assert len(totals) == 6 and min(totals.values()) / fast.get_xlim()[1] > 0.2
    ax = figures["scaling.png"].axes[0]
    series = [ln for ln in ax.get_lines() if not ln.get_label().startswith(("_", "ideal"))]
    assert [ln.get_label().rsplit(", ", 1)[1] for ln in series] == ["local layout", "thesis layout"]
    assert len({to_hex(ln.get_color()) for ln in series}) == 2
    # the key under the plots names the terms its labels use, and only those
    key = " ".join(t.get_text() for t in fig.texts).replace("\n", " ")
    assert "xP: on P GPUs with a layout" in key and "thesis: one all-reduce after each projection" in key
    assert "reference (float64)" in key and "OSEM" not in key and "+m" not in key


def test_distribution_plot_names_far_outliers_without_exponents():
    from mlemlib.report.plots import _beyond

    assert _beyond([30720.0]) == "1 beyond: 30720 ms"
    assert _beyond([7.0, 13.75]) == "2 beyond: 7, 13.75 ms"


def test_image_plot_without_a_truth_speaks_of_none(tmp_path, figures):
    """A measurement of the user's has no phantom: the figure shows the reconstruction's three slices, and
    neither titles nor the note under it speak of a truth."""
    from mlemlib.report import plot_image

    run = _tiny_problem(tmp_path, (2.0, 2.0, 3.0))
    assert plot_image(run / "image.h5", None, tmp_path / "i.png", "tiny / scan: cpu numba/numba+AT")
    fig = figures["i.png"]
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert len(images) == 3
    text = " ".join([t.get_text() for t in fig.texts] + [ax.get_title() for ax in fig.axes]
                    + [fig._suptitle.get_text()]).lower()
    assert "truth" not in text and "phantom" not in text and "both" not in text
    assert "99.9th percentile" in text
    # beside a truth the note says the two share the scale
    assert plot_image(run / "image.h5", tmp_path / "truth.h5", tmp_path / "t.png", "tiny / sim")
    note = " ".join(t.get_text() for t in figures["t.png"].texts).replace("\n", " ")
    assert "Truth and reconstruction share one grey scale" in note


def test_spmv_table_from_the_benchmarks_own_csv(tmp_path):
    """spmv.csv as mlem bench spmv writes it (format_csv, CSV_FIELDS): shape and auto reach the summary."""
    from mlemlib.bench.spmv import format_csv

    def k(op, kernel, ms, **kw):
        return {"op": op, "kernel": kernel, "deterministic": op == "fp", "median_s": ms * 1e-3, "min_s": ms * 1e-3,
                "bytes": 7.7e9, "bandwidth": 7.7e9 / ms * 1e3, "of_copy": 0.9, "rel_l2": 3e-8, **kw}

    kernels = [k("fp", "csr_vector", 2.0123456, lanes=16, shape="256t", auto=True, vs_cusparse=1.44),
               k("fp", "cusparse", 2.9, auto=False, vs_cusparse=1.0),
               k("bp_notrans", "scatter", 3.9, lanes=8, auto=True), k("bp_notrans", "scatter_vec", 3.7, lanes=8)]
    path = tmp_path / "results" / "madpet2" / "bench" / "spmv.csv"
    path.parent.mkdir(parents=True)
    path.write_text(format_csv({"kernels": kernels}))
    summarize([], tmp_path / "s", bench=[path])
    md = (tmp_path / "s" / "summary.md").read_text()
    head, rows = _md_section(md, "### madpet2")
    named = [dict(zip(head, r)) for r in rows]
    assert [(r["operation"], r["kernel"], r["median (ms)"], r[""]) for r in named] == [
        ("fp", "csr_vector (16 lanes, 256t)", "2.01", "*fastest*, *auto*"), ("fp", "cusparse", "2.90", ""),
        ("bp_notrans", "scatter (8 lanes)", "3.90", "*auto*"), ("bp_notrans", "scatter_vec (8 lanes)", "3.70",
                                                                "*fastest*")]
    assert "bp_notrans: from the rows of A" in md and "launch shape" in md


# ------------------------------------------------------------------ key columns, labels, captions (issue 56)
def _html_tables(page):
    """The tables of an HTML page outside ``<details>``, in order: each a list of rows of cell texts."""
    from html.parser import HTMLParser

    class Tables(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tables, self.folded, self.cell = [], 0, None

        def handle_starttag(self, tag, attrs):
            if tag == "details":
                self.folded += 1
            elif tag == "table" and not self.folded:
                self.tables.append([])
            elif tag == "tr" and not self.folded and self.tables:
                self.tables[-1].append([])
            elif tag in ("td", "th") and not self.folded and self.tables:
                self.cell = ""

        def handle_endtag(self, tag):
            if tag == "details":
                self.folded -= 1
            elif tag in ("td", "th") and self.cell is not None:
                self.tables[-1][-1].append(self.cell.strip())
                self.cell = None

        def handle_data(self, data):
            if self.cell is not None:
                self.cell += data

    parser = Tables()
    parser.feed(page)
    return parser.tables


def test_the_first_html_table_holds_the_key_columns_and_the_rest_is_one_click_away(tmp_path):
    """summary.html opens with one narrow table of every configuration: its time per iteration, rel. L2 to the
    reference, whether it is deterministic and its speed-up over the float64 reference; the wide tables show
    their key columns, every column sits in a <details> of the same section."""
    ref = _timings(backend="cpu", fp="numba", bp="numba", gpus=1, layout="local", sums=[999.0], digests=["r"],
                   scale=40.0)
    ref["config"]["reference_mode"] = True
    gpu = _gpu_run(1)  # 0.25 x TABLE_93: 802 ms per iteration
    gpu["repetitions"][0]["accuracy"]["rel_l2_reference"] = 2.5e-7
    cpu = _timings(backend="cpu", fp="numba", bp="numba", gpus=1, layout="local", sums=[999.0], digests=["d"],
                   rel=[4e-7], scale=10.0)
    summarize([gpu, cpu, ref], tmp_path / "s")
    page = (tmp_path / "s" / "summary.html").read_text()
    tables = _html_tables(page)
    head, *rows = tables[0]
    assert head == ["configuration", "iteration (ms)", "rel. L2 to ref.", "deterministic", "speed-up vs. reference"]
    got = {r[0]: r for r in rows}
    ms = sum(TABLE_93.values())
    assert got["cuda csr_vector/notrans x1"][1:] == [f"{ms * 0.25 * 1e3:.0f}", "2.500e-07", "NO (atomics)", "160.00x"]
    assert got["cpu numba/numba"][1:] == [f"{ms * 10 * 1e3:.0f}", "4.000e-07", "yes", "4.00x"]
    assert got["reference (float64)"][1:] == [f"{ms * 40 * 1e3:.0f}", "–", "yes", "1.00x"]
    # the timing table shows every step and the energy without the format, GB/s... which are folded
    timing = next(t for t in tables[1:] if "fp (ms)" in t[0])
    assert timing[0] == ["configuration", "iteration (ms)", "fp (ms)", "corr (ms)", "bp (ms)", "update (ms)",
                         "allreduce (ms)", "J/iteration"]
    assert [r[-1] for r in timing[1:]] == ["405", "–", "–"]  # mean of 400 and 410 J; the CPU has no counter
    assert all(len(t[0]) <= 8 for t in tables)  # no wide table outside a <details>
    # folded: the timing, accuracy and thesis tables' every column (the GPU run has Matrix 3's shape)
    assert page.count("<details>") == 3 and "<summary>In full: every column" in page
    assert "format (bytes/nnz)" in page.split("<details>", 1)[1]  # the full timing table, folded
    # the Markdown has both, the key table first
    md = (tmp_path / "s" / "summary.md").read_text()
    key_head, _ = _md_section(md, "## Time per iteration by step", key=True)
    full_head, _ = _md_section(md, "## Time per iteration by step")
    assert key_head[:2] == ["configuration", "iteration (ms)"] and full_head[:3] == ["matrix", "data", "configuration"]


def test_one_label_function_names_the_kernels_as_chosen_and_autos_choice():
    from mlemlib.report.rows import config_label, scaling_label

    def row(**kw):
        r = {"backend": "cpu", "fp": "numba", "bp": "numba", "transpose": True, "gpus": 1, "layout": "local",
             "subsets": 1, "m": "no", "b": "no", "_fp_requested": "numba", "_bp_requested": "numba"}
        r.update(kw)
        return r

    assert config_label(row(_fp_requested="auto", _bp_requested="auto")) == "cpu numba/numba+AT (auto)"
    assert config_label(row()) == "cpu numba/numba+AT"
    assert config_label(row(fp="scipy", bp="notrans", transpose=False, _fp_requested="scipy",
                            _bp_requested="notrans")) == "cpu scipy/notrans"
    assert config_label(row(_bp_requested="auto")) == "cpu numba/numba+AT (bp auto)"
    cuda = row(backend="cuda-nccl", fp="csr_vector", bp="notrans", transpose=False, gpus=4, layout="thesis",
               graph=True, _fp_requested="auto", _bp_requested="notrans", subsets=8, m="ab12cd34", b="no")
    assert config_label(cuda) == "cuda csr_vector/notrans (fp auto) graph x4 thesis OSEM S8 +m"
    assert config_label(row(backend="cuda", gpus=1)) == "cpu numba/numba+AT".replace("cpu", "cuda") + " x1"
    assert config_label(row(reference_mode=True, _fp_requested="auto")) == "reference (float64)"
    # across GPU counts: the same words without xP; auto's differing choices are listed, graph: auto is named
    one, two = row(backend="cuda", fp="csr_vector", bp="csr_vector", gpus=1), row(
        backend="cuda-nccl", fp="merge", bp="csr_vector", gpus=2, graph=True)
    assert scaling_label([two, one]) == "cuda csr_vector|merge/csr_vector+AT graph (auto)"
    assert scaling_label([one]) == config_label(one, gpus=False) == "cuda csr_vector/csr_vector+AT"


def test_workflow_runs_are_labelled_alike_in_every_table_and_plot(tmp_path, figures):
    """A run configured fp: auto, bp: auto carries one label, with auto's choice, in the tables, runs.html and
    the plots' axes."""
    t = _timings(backend="cpu", fp="numba", bp="numba", gpus=1, layout="local", sums=[999.0, 999.0],
                 digests=["d", "d"], rel=[4e-7, 4e-7], transpose=True)
    t["config"].update(fp_requested="auto", bp_requested="auto")
    summarize([t], tmp_path / "s")
    label = "cpu numba/numba+AT (auto)"
    md = (tmp_path / "s" / "summary.md").read_text()
    for section in ("## At a glance", "## Time per iteration by step", "## Accuracy over repetitions"):
        assert _md_section(md, section, key=True)[1][0][0] == label
    assert f"<td>{label}</td>" in (tmp_path / "s" / "runs.html").read_text()
    for name in ("time_per_iteration.png", "time_distribution.png", "accuracy.png"):
        assert [x.get_text() for x in figures[name].axes[0].get_yticklabels()] == [label]
        note = " ".join(x.get_text() for x in figures[name].texts).replace("\n", " ")
        # the note explains the terms the labels use, none that they do not
        assert "(auto): the kernel auto chose" in note and "+AT:" in note
        for absent in ("cuda", "GPU", "graph", "OSEM", "+m", "+b", "notrans", "reference (float64)"):
            assert absent not in note, (name, absent)


def test_energy_is_reported_or_marked_not_measured_never_zero(tmp_path):
    """A GPU run whose NVML counter did not advance (0 J over a short loop) and one without a counter show
    'not measured', never 0 J; runs.csv leaves them empty."""
    measured = _gpu_run(1)
    zero = _gpu_run(1, energy=(0.0,))
    zero["config"]["fp"] = "merge"
    for rep in zero["repetitions"]:
        rep.update(energy_J=0.0, energy_per_iteration_J=0.0, power_W=0.0)
    absent = _gpu_run(1, energy=(400.0,))
    absent["config"]["fp"] = "cusparse"
    for rep in absent["repetitions"]:
        rep.update(energy_J=None, energy_per_iteration_J=None, power_W=None)
    r = summarize([measured, zero, absent], tmp_path / "s")
    md = (tmp_path / "s" / "summary.md").read_text()
    head, body = _md_section(md, "## Time per iteration by step", key=True)
    energy = {row[0]: row[head.index("J/iteration")] for row in body}
    assert energy == {"cuda csr_vector/notrans x1": "405", "cuda merge/notrans x1": "not measured",
                      "cuda cusparse/notrans x1": "not measured"}
    head, body = _md_section(md, "## The thesis beside us", key=True)
    assert [row[head.index("J/iteration")] for row in body] == ["–", "405", "not measured", "not measured"]
    with open(r["runs_csv"], newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(row["fp"], row["energy_J"], row["energy_per_iteration_J"]) for row in rows][2] == ("merge", "", "")


def test_image_plot_is_packed_and_titled_by_the_run_label(tmp_path, figures):
    """A field of view short in z: coronal and sagittal stack beside the axial slice (their column as wide as
    the axial one), no panel further from it than a title's height; the title is the label, not the path."""
    from mlemlib.image import write_image

    grid = (20, 20, 8)
    rng = np.random.default_rng(1)
    write_image(tmp_path / "img.h5", rng.random(int(np.prod(grid)), dtype=np.float32), grid=grid,
                voxel_size=(1.0, 1.0, 1.0))
    t = _timings(backend="cpu", fp="numba", bp="numba", gpus=1, layout="local", sums=[1.0], digests=["d"])
    t["outputs"] = {"image": str(tmp_path / "img.h5")}
    summarize([t], tmp_path / "s")
    fig = figures["image_madpet3_nema-seed1.png"]
    fig.canvas.draw()
    assert fig._suptitle.get_text() == "madpet3 / nema-seed1: cpu numba/numba"
    boxes = {ax.get_title().split(": ")[1].split(",")[0]: ax.get_window_extent() for ax in fig.axes
             if ax.get_title()}
    axial, coronal, sagittal = boxes["axial"], boxes["coronal"], boxes["sagittal"]
    assert coronal.x0 > axial.x1 and abs(coronal.x0 - sagittal.x0) < 2  # one column right of the axial slice
    # no large gap: between the axial slice and the coronal one's axis labels, a few pixels
    labelled = next(ax for ax in fig.axes if ax.get_title().startswith("reconstruction: coronal")).get_tightbbox()
    assert labelled.x0 - axial.x1 < 0.1 * axial.width
    assert coronal.y1 - sagittal.y0 > 0.8 * axial.height  # the stacked pair fills the axial slice's height
    assert sagittal.y1 < coronal.y0 and coronal.y1 <= axial.y1 + 40 and sagittal.y0 >= axial.y0 - 40


def test_convergence_figure_legends_by_their_panels_and_every_axis_labelled(tmp_path):
    from mlemlib.report.plots import convergence_figure, convergence_note

    passes = [1, 2, 3]
    rec = {"matrix": "small", "data": "nema-seed1", "iterations": 3, "voxel_size": [2.0, 2.0, 2.0],
           "profile_truth": [0.0, 1.0, 1.0, 0.0],
           "series": [{"subsets": S, "corrected": c, "passes": passes, "crc_hot": [0.2, 0.4, 0.5],
                       "rel_error": [0.5, 0.4, 0.45], "profile": [0.1, 0.9, 0.8, 0.1]}
                      for S in (1, 4) for c in (True, False)]}
    fig = convergence_figure(rec)
    fig.canvas.draw()
    crc, err, prof = fig.axes[:3]
    for ax in (crc, err, prof):
        assert ax.get_xlabel() and ax.get_ylabel()
        assert any(t.get_text() for t in ax.get_yticklabels()), ax.get_title()
    assert len(fig.legends) == 0  # no figure-wide legend beside the third panel
    legends = {ax: ax.get_legend() for ax in (crc, err, prof)}
    assert legends[err] is None and legends[crc] is not None and legends[prof] is not None
    box_crc, box_prof = legends[crc].get_window_extent(), legends[prof].get_window_extent()
    assert box_crc.x0 >= crc.get_window_extent().x0 - 1 and box_crc.x1 <= err.get_window_extent().x1 + 1
    assert box_crc.y1 <= crc.get_window_extent().y0 and box_prof.x0 >= prof.get_window_extent().x0 - 1
    assert "MLEM, m and b ignored" in [t.get_text() for t in legends[crc].get_texts()]
    note = convergence_note(rec)
    assert "dashed" in note and "OSEM" in note
    # one S, corrections modelled only: the note speaks of neither subsets nor dashed lines
    rec["series"] = [s for s in rec["series"] if s["subsets"] == 1 and s["corrected"]]
    assert "dashed" not in convergence_note(rec) and "subsets" not in convergence_note(rec)


# --------------------------------------------------------------------------- MAP runs
def _map_run(timings, *, beta, metrics=None, algorithm="bsrem"):
    """``timings`` as a MAP run's: Phi, L and R per pass (entry 0 the initial image) and, where given, the
    convergence metrics of repetition 0 (``metrics``: (rmse_object, rmse_background, sphere) per pass 1..4)."""
    history = [{"pass": p, "phi": -100.0 + 10 * p, "log_likelihood": -90.0 + 10 * p, "prior": 100.0 / beta}
               for p in range(5)]
    timings["map"] = {"algorithm": algorithm, "prior": "rdp", "beta": beta, "gamma": 2.0, "epsilon": 1.0,
                      "kappa": None, "relaxation": [1.0, 10.0], "history": history}
    timings["config"]["subsets"] = 8
    if metrics is not None:
        timings["map"]["metrics"] = {"format": "mlem-map-metrics", "repetition": 0, "every": 1, "passes": [1, 2, 3, 4],
                                     "rmse_object": [v[0] for v in metrics], "rmse_background": [v[1] for v in metrics],
                                     "spheres": {"hot1": [v[2] for v in metrics]}}
    return timings


def _cpu(**kw):
    return _timings(backend="cpu", fp="numba", bp="numba", gpus=1, layout="local", sums=[1.0], digests=["d"], **kw)


def test_map_runs_get_their_table_plots_and_labels(tmp_path, figures):
    osem = _cpu()
    osem["config"]["subsets"] = 8
    reached = _map_run(_cpu(), beta=0.5, metrics=[(0.5, 0.5, 0.1), (0.02, 0.005, 0.001), (0.009, 0.009, 0.004),
                                                  (0.001, 0.001, 0.001)])
    never = _map_run(_cpu(), beta=2.0, metrics=[(0.5, 0.5, 0.1)] * 4)
    unmeasured = _map_run(_cpu(), beta=1.0, algorithm="osl")
    r = summarize([osem, reached, never, unmeasured], tmp_path / "s")
    assert r["configurations"] == 4  # one per beta and algorithm: MAP is not OSEM's configuration
    md = (tmp_path / "s" / "summary.md").read_text()
    section = md.split("## MAP", 1)[1].split("\n## ", 1)[0]
    lines = {ln.split("|")[1].strip(): [c.strip() for c in ln.strip("|").split("|")]
             for ln in section.splitlines() if ln.startswith("| cpu")}
    assert "| configuration | passes | Phi (last pass) | time to threshold (s) | passes to threshold |" in section
    # pass 3 is the first with both RMSEs below 1% and the sphere below 0.5%: the first 3 iterations' time
    it = sum(TABLE_93.values())
    assert lines["cpu numba/numba BSREM rdp beta=0.5 S8"][1:] == ["4", "-60", f"{(0.9 + 1.1 + 0.95) * it:.3g}", "3"]
    assert lines["cpu numba/numba BSREM rdp beta=2 S8"][3:] == ["never", "never"]
    assert lines["cpu numba/numba OSL rdp beta=1 S8"][3:] == ["–", "–"]
    assert not any("OSEM" in k for k in lines)  # OSEM has no MAP row
    with open(tmp_path / "s" / "runs.csv", newline="") as fh:
        rows = {row["beta"]: row for row in csv.DictReader(fh)}
    assert rows[""]["map_algorithm"] == "" and rows["0.5"]["map_algorithm"] == "bsrem"
    assert float(rows["0.5"]["phi"]) == -60.0 and rows["0.5"]["passes_to_threshold"] == "3"
    assert float(rows["0.5"]["time_to_threshold_s"]) == pytest.approx((0.9 + 1.1 + 0.95) * it, rel=1e-12)
    assert "BSREM, OSL: MAP" in md and "OSEM SK: K ordered subsets" in md

    objective, metrics = figures["map_objective.png"], figures["map_metrics.png"]
    assert [ax.get_ylabel() for ax in objective.axes] == ["Phi = L - beta R", "log-likelihood L", "prior R"]
    assert len(objective.axes[0].get_lines()) == 3  # the three MAP configurations, OSEM none
    assert list(objective.axes[0].get_lines()[0].get_xdata()) == [0, 1, 2, 3, 4]
    assert all(float(t).is_integer() for ax in (*objective.axes, *metrics.axes) for t in ax.get_xticks())  # passes
    assert list(objective.axes[2].get_lines()[1].get_ydata()) == [50.0] * 5  # R = 100 / beta, beta = 2
    assert len(metrics.axes) == 3 and all(ax.get_yscale() == "log" for ax in metrics.axes)
    lines = metrics.axes[2].get_lines()  # two measured configurations and the 0.5% threshold
    assert len(lines) == 3 and list(lines[-1].get_ydata()) == [0.005, 0.005]
    assert list(metrics.axes[0].get_lines()[-1].get_ydata()) == [0.01, 0.01]
    assert list(lines[0].get_ydata()) == [0.1, 0.001, 0.004, 0.001]


def test_a_map_runs_prior_step_is_a_step_of_its_own(tmp_path, figures):
    """A MAP run timed on the host records the prior's gradient and step as "map": the step table, runs.csv and
    the stacked bars show it, so the steps add up to the iteration."""
    run = _map_run(_cpu(), beta=0.5)
    rep = run["repetitions"][0]
    rep["samples"]["map"] = [2e-3] * 4
    rep["samples"]["iteration"] = [t + 2e-3 for t in rep["samples"]["iteration"]]
    rep["steps"] = {st: stats(v) for st, v in rep["samples"].items()}
    summarize([run], tmp_path / "s")
    md = (tmp_path / "s" / "summary.md").read_text()
    section = md.split("## Time per iteration by step", 1)[1]
    head = next(ln for ln in section.splitlines() if ln.startswith("| configuration"))
    row = next(ln for ln in section.splitlines() if ln.startswith("| cpu"))
    cells = dict(zip([c.strip() for c in head.strip("|").split("|")], [c.strip() for c in row.strip("|").split("|")]))
    assert cells["map (ms)"] == "2.00" and "map: the prior's gradient and the MAP step" in section
    assert md.startswith("# ") and "1 run, 1 repetition, 1 configuration." in md
    with open(tmp_path / "s" / "runs.csv", newline="") as fh:
        (csv_row,) = csv.DictReader(fh)
    assert float(csv_row["map_mean_s"]) == pytest.approx(2e-3)
    ax = figures["time_per_iteration.png"].axes[0]
    right = max(p.get_x() + p.get_width() for p in ax.patches)
    per_s = {"time per iteration (s)": 1.0, "time per iteration (ms)": 1e3}[ax.get_xlabel()]
    assert right == pytest.approx(float(csv_row["iteration_mean_s"]) * per_s, rel=1e-9)  # the bars fill it
    assert any(t.get_text().startswith("map:") for t in ax.get_legend().get_texts())


def test_no_map_part_without_map_runs_and_no_metrics_plot_without_metrics(runs, tmp_path):
    root, _, _ = runs
    r = summarize([root], tmp_path / "s")
    md = (tmp_path / "s" / "summary.md").read_text()
    assert "## MAP" not in md and "BSREM" not in md
    assert not any(p.rsplit("/", 1)[-1].startswith("map_") for p in r["plots"])
    r = summarize([_map_run(_cpu(), beta=1.0)], tmp_path / "t")
    names = {p.rsplit("/", 1)[-1] for p in r["plots"]}
    assert "map_objective.png" in names and "map_metrics.png" not in names
    md = (tmp_path / "t" / "summary.md").read_text()
    assert "## MAP" in md and "time to threshold" not in md


def test_image_plot_shows_the_map_image_below_osems(tmp_path, figures):
    from mlemlib.image import write_image

    grid = (6, 5, 4)
    n = int(np.prod(grid))
    write_image(tmp_path / "osem.h5", np.full(n, 1.0, np.float32), grid=grid, voxel_size=(1.0, 1.0, 1.0))
    write_image(tmp_path / "map.h5", np.full(n, 3.0, np.float32), grid=grid, voxel_size=(1.0, 1.0, 1.0))
    osem = _cpu()
    osem["config"]["subsets"] = 8
    osem["outputs"] = {"image": str(tmp_path / "osem.h5")}
    bsrem = _map_run(_cpu(), beta=0.5)
    bsrem["outputs"] = {"image": str(tmp_path / "map.h5")}
    summarize([bsrem, osem], tmp_path / "s")
    fig = figures["image_madpet3_nema-seed1.png"]
    rows = [ax.get_title().split(":")[0] for ax in fig.axes if ax.get_images()]
    assert rows == ["OSEM"] * 3 + ["MAP BSREM rdp beta=0.5"] * 3
    assert {tuple(ax.get_images()[0].get_clim()) for ax in fig.axes if ax.get_images()} == {(0.0, 3.0)}
    assert fig._suptitle.get_text() == ("madpet3 / nema-seed1: cpu numba/numba OSEM S8; "
                                        "MAP: cpu numba/numba BSREM rdp beta=0.5 S8")
    # a MAP run alone: its image, as any run's
    summarize([bsrem], tmp_path / "t")
    rows = [ax.get_title().split(":")[0] for ax in figures["image_madpet3_nema-seed1.png"].axes if ax.get_images()]
    assert rows == ["reconstruction"] * 3


def test_a_map_label_names_the_settings_that_are_not_the_defaults():
    """Two MAP runs that differ only in BSREM's preconditioner, offset, relaxation or pass mean get two labels
    (and the terms that explain them); the defaults keep the short label; a run recorded before the pass mean
    existed reads as giving its last sub-iterate."""
    from mlemlib.map import MapSettings
    from mlemlib.report.rows import label_terms, map_columns, map_label

    def row(ms, drop=()):
        rec = {k: v for k, v in ms.record().items() if k not in drop}
        return {**map_columns({"map": {**rec, "history": []}}), "subsets": 8}

    base = MapSettings("rdp", beta=0.3, epsilon=1e-3)
    fast = MapSettings("rdp", beta=0.3, epsilon=1e-3, preconditioner="hessian", preconditioner_offset=0.35,
                       relaxation=(1.0, 20.0), averaging="pass", subset_halving=(10, 20))
    assert map_label(row(base)) == " BSREM rdp beta=0.3"
    assert map_label(row(fast)) == " BSREM rdp beta=0.3 hessian offset=0.35 relax=1,20 mean halve=10,20"
    assert row(base, drop=("averaging", "subset_halving"))["_map_params"] == row(base)["_map_params"]
    terms = label_terms([row(base), row(fast)])
    assert any(t.startswith("mean:") for t in terms) and any(t.startswith("relax=") for t in terms)
    assert any(t.startswith("halve=") for t in terms)
    assert not any(t.startswith(("mean:", "hessian:")) for t in label_terms([row(base)]))
