"""Tests of the Snakemake workflow: lint, format, config validation, and the
rerun rules (which stages a changed setting reruns), proved by dry runs
against a working directory whose outputs a real run of a tiny config made.

The real run (``small`` preset, 2 iterations, CPU only) takes well under a
minute on 2 cores; every other test is a dry run or a lint (a few seconds).
"""

from __future__ import annotations

import base64
import copy
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEFILE = REPO / "Snakefile"

#: The stages that make the problem and never depend on runs or iterations.
UPSTREAM = {"generate_matrix", "convert_matrix", "compute_norm", "transpose_matrix"}

#: The mlem settings of TINY in its runs' directories (RUN_KEY in rules/common.smk).
KEY = "it2-rep1-ck0"

#: A tiny config: every stage, CPU only, two runs (one with the stored
#: transpose, one without), a reference, one phantom.
TINY = {
    "use_gpu": False,
    "matrices": {"small": {"preset": "small"}},
    "transpose": {"method": "scantrans", "compare": []},
    "partition": {"parts": [2]},
    "simulation": {"phantoms": ["nema"], "seeds": [1], "noiseless": False, "counts": None},
    "mlem": {"iterations": 2, "checkpoint_every": 0, "repetitions": 1, "reference": True},
    "runs": [
        {"backend": "cpu", "fp": "auto", "bp": "auto"},
        {"backend": "cpu", "fp": "auto", "bp": "notrans"},
    ],
    "bench": {"spmv": False},
}


def snakemake(workdir: Path, *args: str, config: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run snakemake on this repository's workflow in ``workdir``; return the finished process.

    ``config`` is written to ``workdir/<name>.yaml`` and passed with
    ``--configfile`` (which replaces the embedded default, see Snakefile).
    """
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "--directory", str(workdir)]
    if config is not None:
        path = workdir / f"config-{abs(hash(yaml.safe_dump(config)))}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        cmd += ["--configfile", str(path)]
    cmd += list(args)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout, env=env)


def planned_jobs(proc: subprocess.CompletedProcess) -> dict[str, int]:
    """Parse the "Job stats" table of a dry run: rule -> job count (``all`` left out).

    An up-to-date workflow prints "Nothing to be done" and gives ``{}``.
    """
    assert proc.returncode == 0, f"dry run failed:\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout + proc.stderr
    if "Job stats:" not in out:
        assert "Nothing to be done" in out, out
        return {}
    lines = out.split("Job stats:", 1)[1].splitlines()
    jobs: dict[str, int] = {}
    # header "job  count", a rule of dashes, then "name  count" rows up to "total".
    for line in lines[3:]:
        fields = line.split()
        if not fields or fields[0] == "total":
            break
        name, count = fields
        jobs[name] = int(count)
    jobs.pop("all", None)
    return jobs


def dry_run(workdir: Path, config: dict, *targets: str) -> dict[str, int]:
    """Jobs a dry run of ``config`` in ``workdir`` would run."""
    return planned_jobs(snakemake(workdir, "--dry-run", "--quiet", "rules", *targets, config=config))


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The one line a workflow stopped by a bad input prints (Snakemake's own "Using ... profile" aside):
    no traceback, no "WorkflowError in file ...common.smk" header."""
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Traceback" not in out and "WorkflowError" not in out and "common.smk" not in out, out
    lines = [line for line in out.splitlines() if line.strip() and not line.startswith("Using workflow specific profile")]
    assert len(lines) == 1, out
    return lines[0]


def changed(**sections) -> dict:
    """TINY with some sections' keys replaced (``mlem={"iterations": 3}``...)."""
    config = copy.deepcopy(TINY)
    for section, values in sections.items():
        if isinstance(values, dict):
            config[section].update(values)
        else:
            config[section] = values
    return config


# --------------------------------------------------------------------- static


def test_lint_reports_nothing(tmp_path):
    proc = snakemake(tmp_path, "--lint")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Lints for" not in proc.stdout + proc.stderr


def test_snakefmt_check_passes():
    proc = subprocess.run(
        [sys.executable, "-m", "snakefmt", "--check", "Snakefile", "rules"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "config").glob("*.yaml") if p.name != "schema.yaml"))
def test_every_shipped_config_validates_and_plans(tmp_path, name):
    """The configs the README and docs name pass validation (kernels, GPU counts, layouts) and plan a DAG.

    config/thesis.yaml once asked for bp=notrans in the thesis layout, which the registry refuses:
    its documented command stopped before any job.
    """
    path = REPO / "config" / name
    # A config with use_gpu: true plans its GPU jobs where GPUs are given (here, without one, --resources gpu=N).
    gpus = ("--resources", "gpu=8") if yaml.safe_load(path.read_text()).get("use_gpu") is True else ()
    proc = snakemake(tmp_path, "--dry-run", "--quiet", "rules", "--configfile", str(path), *gpus)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "summarize" in planned_jobs(proc)


def test_every_schema_property_has_description_and_default():
    schema = yaml.safe_load((REPO / "config/schema.yaml").read_text())
    missing = []

    def walk(node: dict, where: str) -> None:
        for key, sub in node.get("properties", {}).items():
            here = f"{where}.{key}".lstrip(".")
            if "description" not in sub or "default" not in sub:
                missing.append(here)
            walk(sub, here)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            walk(extra, f"{where}.*")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{where}[]")

    walk(schema, "")
    assert schema["additionalProperties"] is False
    assert not missing, f"schema properties without description or default: {missing}"


def test_default_config_plans_every_cpu_stage(tmp_path):
    # The embedded default (no --configfile), here without a GPU.
    jobs = planned_jobs(snakemake(tmp_path, "--dry-run", "--quiet", "rules", "--config", "use_gpu=false"))
    for rule in UPSTREAM | {
        "compare_transpose",
        "partition_matrix",
        "simulate_measurement",
        "reference_mlem",
        "run_mlem",
        "summarize",
    }:
        assert jobs.get(rule, 0) >= 1, (rule, jobs)
    # Without a GPU: only the two cpu runs, no benchmark.
    assert jobs["run_mlem"] == 2
    assert "bench_spmv" not in jobs


@pytest.mark.parametrize("fmt", ["compressed-u16", "compressed-f16", "compressed"])
def test_lossy_format_adds_the_exact_matrix_reference(tmp_path, fmt):
    # A matrix with rounded values: one more float64 reference, on the .csr4 it is converted from, for the
    # summary's accuracy cost; a lossless format needs none.
    config = changed(matrices={"small": {"preset": "small", "format": fmt}})
    config["runs"] = [{"backend": "cpu", "fp": "auto", "bp": "auto"}, {"backend": "cpu", "bp": "onepass_chunked"}]
    proc = snakemake(tmp_path, "--dry-run", "--printshellcmds", config=config)  # its job stats and its jobs
    jobs = planned_jobs(proc)
    assert jobs["reference_mlem"] == 1
    assert jobs.get("exact_reference_mlem", 0) == (0 if fmt == "compressed" else 1), jobs
    if fmt != "compressed":
        plan = proc.stdout
        rule = plan.split("rule exact_reference_mlem:", 1)[1].split("\n\n", 1)[0]
        assert "input: resources/small.csr4" in rule and "reference-exact-it2/image.h5" in rule, rule


def test_use_gpu_true_adds_every_cuda_run_and_the_benchmark(tmp_path):
    config = changed(
        use_gpu=True,
        runs=[
            {"backend": "cpu"},
            {"backend": "cuda", "fp": "csr_vector", "bp": "csr_vector", "gpus": [1, 2, 4], "layout": ["local", "thesis"]},
            {"backend": "cuda", "fp": "merge", "bp": "notrans", "secsize": 8},
        ],
        bench={"spmv": True, "formats": ["csr", "compressed", "compressed-u16"]},
    )
    jobs = dry_run(tmp_path, config, "--resources", "gpu=4")
    # cpu 1 + csr_vector: gpus 1 (local only) + 2 x 2 layouts + 4 x 2 layouts = 5 + merge 1.
    assert jobs["run_mlem"] == 1 + 5 + 1
    # Plans for parts 2 (partition.parts, also a GPU count) and 4.
    assert jobs["partition_matrix"] == 2
    assert jobs["bench_spmv"] == 1


def planned_job_settings(proc: subprocess.CompletedProcess) -> list[dict[str, object]]:
    """Each job a dry run prints: rule, threads (1 where not printed), priority (0 where not printed)."""
    assert proc.returncode == 0, f"dry run failed:\n{proc.stdout}\n{proc.stderr}"
    jobs: list[dict[str, object]] = []
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.startswith(("rule ", "localrule ")) and line.rstrip().endswith(":"):
            jobs.append({"rule": line.split()[1].rstrip(":"), "threads": 1, "priority": 0})
        elif jobs and line.strip().startswith(("threads:", "priority:")):
            key, value = line.strip().split(":", 1)
            jobs[-1][key] = int(value)
    return jobs


def test_norm_simulate_and_the_benchmark_start_together_after_the_conversion(tmp_path):
    """On 64 cores and 4 GPUs, once the matrix is converted: norm and simulate (every run waits for both)
    come before the partitions and leave the benchmark (the longest GPU job) its core."""
    config = changed(use_gpu=True, runs=[{"backend": "cuda", "fp": "auto", "bp": "auto", "gpus": [1, 2, 4]}],
                     bench={"spmv": True})
    proc = snakemake(tmp_path, "--dry-run", "--cores", "64", "--resources", "gpu=4", config=config)
    jobs = {(j["rule"]): j for j in planned_job_settings(proc)}
    norm, sim, bench, part = (jobs[r] for r in ("compute_norm", "simulate_measurement", "bench_spmv",
                                                 "partition_matrix"))
    assert norm["threads"] + sim["threads"] + bench["threads"] <= 64
    assert norm["threads"] == sim["threads"] == 31
    assert min(norm["priority"], sim["priority"]) > max(part["priority"], bench["priority"])


def dag_edges(proc: subprocess.CompletedProcess) -> list[tuple[str, str]]:
    """The edges of ``snakemake --dag`` (Graphviz): (upstream job, downstream job), each job as its node's
    label (the rule, then its wildcards, one per line as ``name: value``)."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    labels, edges = {}, []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if "[label = " in line:
            labels[line.split("[", 1)[0]] = line.split('label = "', 1)[1].split('"', 1)[0].replace("\\n", "\n")
        elif " -> " in line:
            edges.append(tuple(x.strip() for x in line.split(" -> ")))
    return [(labels[a], labels[b]) for a, b in edges]


def test_gpu_jobs_wait_for_the_kernels_compiled_once_and_cpu_workflows_have_none(tmp_path):
    """warm_kernels (no input) runs where a GPU job does; every cuda run and the benchmark wait for it (its
    record is their input, through the checkpoint: <TBD> in a dry run until it has run); the cpu runs and the
    reference do not; a workflow without GPUs plans none."""
    config = changed(use_gpu=True, runs=[{"backend": "cuda", "fp": "auto", "bp": "auto", "gpus": [1, 2]},
                                         {"backend": "cpu"}], bench={"spmv": True})
    args = ("--cores", "8", "--resources", "gpu=2")
    proc = snakemake(tmp_path, "--dry-run", "--printshellcmds", *args, config=config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = "results/kernels/default.json"  # the config's name (schema default)
    blocks = (proc.stdout + proc.stderr).split("\n\n")
    inputs = {}
    for block in blocks:
        lines = [line.strip() for line in block.splitlines()]
        rule = next((line.split()[1].rstrip(":") for line in lines if line.startswith(("rule ", "checkpoint "))),
                    None)
        got = next((line[len("input: "):] for line in lines if line.startswith("input: ")), "")
        out = next((line[len("output: "):] for line in lines if line.startswith("output: ")), "")
        if rule:
            inputs.setdefault(rule, []).append((got, out))
    assert [o for _, o in inputs["warm_kernels"]] == [record] and inputs["warm_kernels"][0][0] == ""
    runs = inputs["run_mlem"]
    assert sum("<TBD>" in i for i, o in runs if "/cuda-" in o) == 2
    assert not any("<TBD>" in i or record in i for i, o in runs if "/cpu-" in o)
    assert all("<TBD>" in i for i, _ in inputs["bench_spmv"])
    assert not any("<TBD>" in i or record in i for i, _ in inputs["reference_mlem"])
    waiting = [down for up, down in dag_edges(snakemake(tmp_path, "--dag", *args, config=config))
               if up == "warm_kernels"]
    assert sorted(w.split("\n", 1)[0] for w in waiting) == ["bench_spmv", "run_mlem", "run_mlem"]
    assert all("run: cuda-" in w for w in waiting if w.startswith("run_mlem"))
    (tmp_path / "cpu").mkdir()
    assert "warm_kernels" not in dry_run(tmp_path / "cpu", changed(use_gpu=False))


def test_a_convergence_study_on_the_gpu_waits_for_the_kernels_too(tmp_path):
    config = changed(use_gpu=True, runs=[{"backend": "cpu"}])
    config["convergence"] = {"enabled": True, "backend": "cuda", "subsets": [1, 4]}
    proc = snakemake(tmp_path, "--dag", "--cores", "4", "--resources", "gpu=1", config=config)
    waiting = [down.split("\n", 1)[0] for up, down in dag_edges(proc) if up == "warm_kernels"]
    assert waiting == ["study_convergence"]


def test_cpu_run_on_several_gpus_is_refused(tmp_path):
    proc = snakemake(tmp_path, "--dry-run", config=changed(runs=[{"backend": "cpu", "gpus": [1, 2]}]))
    assert proc.returncode != 0
    assert "runs[0].gpus" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (changed(mlem={"iteratons": 3}), "'iteratons' was unexpected"),
        ({**TINY, "phantom": "nema"}, "'phantom' was unexpected"),
        (changed(runs=[{"backend": "cpu", "layuot": "local"}]), "runs[0]"),
        (changed(matrices={"small": {"preset": "small", "path": "a.mtx"}}), "matrices.small"),
        (changed(simulation={"phantoms": ["shepp"]}), "simulation.phantoms[0]"),
        (changed(bench={"formats": ["csr", "compressed-u8"]}), "bench.formats[1]"),
    ],
)
def test_bad_config_stops_before_any_job(tmp_path, config, named):
    proc = snakemake(tmp_path, "--cores", "1", config=config)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    line = one_line(proc)
    assert line.startswith("config ") and named in line, out
    assert line.endswith("config/schema.yaml lists the keys and their allowed values")
    for made in ("results", "resources", "logs"):
        assert not (tmp_path / made).exists()


@pytest.mark.parametrize(
    ("entry", "reorder", "named"),
    [
        ({"preset": "small", "voxel_order": "hilbert"}, "none", "written straight into the container (csr4: false)"),
        ({"preset": "small", "csr4": False, "voxel_order": "hilbert"}, "rows", "reorder: rows would reorder"),
    ],
)
def test_voxel_order_needs_a_direct_preset_and_no_reorder(tmp_path, entry, reorder, named):
    proc = snakemake(tmp_path, "--cores", "1", config=changed(matrices={"small": entry}, reorder=reorder))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "config matrices.small.voxel_order: hilbert" in out and named in out, out
    assert not (tmp_path / "results").exists()


def test_voxel_order_runs_every_stage_on_the_generated_container(tmp_path):
    # The Matrix 3 config's kind of matrix (folded, compressed, written by the generator in Hilbert voxel
    # order) through every CPU stage: norm, transpose, partition, simulation, MLEM, summary.
    entry = {"preset": "small", "csr4": False, "format": "compressed", "fold": True, "voxel_order": "hilbert"}
    config = changed(matrices={"small": entry}, reorder="none")
    jobs = dry_run(tmp_path, config)
    assert jobs["generate_container"] == 1 and "convert_matrix" not in jobs and "reorder_matrix" not in jobs
    proc = snakemake(tmp_path, "--cores", "2", config=config, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "results/summary/default/runs.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    runs = [r for r in rows if r["reference_mode"] == "False"]
    assert len(runs) == 2 and "notrans" in {r["bp"] for r in runs}
    for r in runs:  # the images (in the grid's order) against the float64 reference of the same matrix
        assert float(r["rel_l2_reference"]) < 1e-5, r
    from mlemlib.reorder import permutation_of, voxel_permutation
    from mlemlib.scanner import get_preset

    perm = permutation_of(tmp_path / "results" / "small" / "matrix.h5")
    np.testing.assert_array_equal(perm.voxels, voxel_permutation(tuple(get_preset("small").grid)))


# ------------------------------------------------- bad files stop the dry run


def user_files(tmp_path: Path, counts: np.ndarray | None = None) -> dict:
    """A config of a user's 40 x 12 Matrix Market matrix and a measurement (``counts``, default 0..39)."""
    import scipy.io
    import scipy.sparse as sp

    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    scipy.io.mmwrite(data / "mine.mtx", sp.random(40, 12, density=0.3, random_state=1, format="coo"))
    (np.arange(40) if counts is None else counts).astype("<i4").tofile(data / "scan.LMsino")
    return {
        **copy.deepcopy(MINE),
        "matrices": {"mine": {"path": "data/mine.mtx", "measurements": {"scan": "data/scan.LMsino"}}},
    }


def test_user_files_that_read_well_plan_every_stage(tmp_path):
    assert dry_run(tmp_path, user_files(tmp_path))["run_mlem"] == 1


def test_negative_count_stops_the_dry_run(tmp_path):
    counts = np.arange(40)
    counts[7] = -3
    proc = snakemake(tmp_path, "--dry-run", config=user_files(tmp_path, counts))
    assert one_line(proc) == "config matrices.mine.measurements.scan: data/scan.LMsino: negative count -3 at LOR 7"
    # a real run stops the same way, before any job
    assert one_line(snakemake(tmp_path, "--cores", "1", config=user_files(tmp_path, counts))).endswith("at LOR 7")
    assert not (tmp_path / "results").exists()


def test_mtx_index_out_of_range_stops_the_dry_run(tmp_path):
    config = user_files(tmp_path)
    path = tmp_path / "data/mine.mtx"
    lines = path.read_text().splitlines()
    body = next(k for k, line in enumerate(lines) if not line.startswith("%") and line.strip()) + 1
    lines[body] = "41 " + lines[body].split(None, 1)[1]  # row 41 of 40
    path.write_text("\n".join(lines) + "\n")
    line = one_line(snakemake(tmp_path, "--dry-run", config=config))
    assert line.startswith("config matrices.mine.path: data/mine.mtx: ") and "out of bounds" in line, line


def test_npz_without_a_sparse_matrix_stops_the_dry_run(tmp_path):
    config = user_files(tmp_path)
    np.savez(tmp_path / "data/dense.npz", a=np.ones(3))
    config["matrices"]["mine"]["path"] = "data/dense.npz"
    line = one_line(snakemake(tmp_path, "--dry-run", config=config))
    assert line.startswith("config matrices.mine.path: data/dense.npz: not a SciPy sparse .npz file"), line


def test_a_file_is_read_once_per_version(tmp_path):
    config = user_files(tmp_path)
    assert dry_run(tmp_path, config)["run_mlem"] == 1
    checked = json.loads((tmp_path / ".snakemake/mlemlib/checked-files.json").read_text())
    assert sorted(key.split()[0] for key in checked) == ["matrix_rows", "measurement_ok"]
    counts = np.arange(40)
    counts[0] = -1
    counts.astype("<i4").tofile(tmp_path / "data/scan.LMsino")  # the same path, new contents: read again
    os.utime(tmp_path / "data/scan.LMsino", ns=(1, 1))
    assert one_line(snakemake(tmp_path, "--dry-run", config=config)).endswith("negative count -1 at LOR 0")


# ------------------------------------------------------------------- reruns


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A working directory where the tiny config ran to the end for real."""
    workdir = tmp_path_factory.mktemp("workflow")
    proc = snakemake(workdir, "--cores", "2", config=TINY, timeout=600)
    assert proc.returncode == 0, f"workflow failed:\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    return workdir


@pytest.mark.slow
def test_finished_run_leaves_summary_and_is_up_to_date(finished):
    summary = finished / "results/summary/default"  # TINY has no name: the default one
    for name in ("runs.csv", "summary.md", "summary.html", "runs.html"):
        assert (summary / name).stat().st_size > 0
    assert any((summary / "plots").glob("*.png"))
    for run in ("cpu-auto-auto", "cpu-auto-notrans"):
        run_dir = finished / f"results/small/runs/nema-seed1/{run}-{KEY}/gpus-1-local"
        assert (run_dir / "image.h5").exists()
        assert (run_dir / "timings.json").exists()
    assert dry_run(finished, TINY) == {}


@pytest.mark.slow
def test_iterations_rerun_only_runs_and_summary(finished):
    jobs = dry_run(finished, changed(mlem={"iterations": 3}))
    # Both runs, the reference of the one problem, the summary; nothing upstream.
    assert jobs == {"reference_mlem": 1, "run_mlem": 2, "summarize": 1}


def rule_blocks(proc: subprocess.CompletedProcess, rule: str) -> list[str]:
    """The job blocks of ``rule`` in a dry run's full output."""
    return [block.split("\n\n", 1)[0] for block in proc.stdout.split(f"rule {rule}:")[1:]]


@pytest.mark.slow
def test_no_run_waits_for_the_reference_and_the_summary_joins_it(finished):
    plan = snakemake(finished, "--dry-run", config=changed(mlem={"iterations": 3}))
    runs, (summary,) = rule_blocks(plan, "run_mlem"), rule_blocks(plan, "summarize")
    assert len(runs) == 2 and not any("reference" in run.split("output:", 1)[0] for run in runs), runs
    assert "results/small/runs/nema-seed1/reference-it3/image.h5" in summary.split("output:", 1)[0]
    # the joined accuracy of the finished run: its image against the reference
    with open(finished / "results/summary/default/runs.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["reference_mode"] == "False"]
    assert len(rows) == 2 and all(0 < float(r["rel_l2_reference"]) < 1e-5 for r in rows), rows
    for run in ("cpu-auto-auto", "cpu-auto-notrans"):
        timings = json.loads((finished / f"results/small/runs/nema-seed1/{run}-{KEY}/gpus-1-local/timings.json").read_text())
        assert timings["config"]["reference"] is None  # the run itself had none


#: TINY with other mlem settings on the same matrix, under its own name.
TINY_IT3 = {**changed(mlem={"iterations": 3, "repetitions": 2}), "name": "it3"}


@pytest.fixture(scope="module")
def keyed(finished, tmp_path_factory) -> Path:
    """A copy of the tiny run's directory where TINY_IT3 ran to the end too."""
    import shutil

    workdir = Path(shutil.copytree(finished, tmp_path_factory.mktemp("keyed") / "w", symlinks=True))
    # Only what the other settings define: its reference, its runs, its summary.
    assert dry_run(workdir, TINY_IT3) == {"reference_mlem": 1, "run_mlem": 2, "summarize": 1}
    proc = snakemake(workdir, "--cores", "2", config=TINY_IT3, timeout=600)
    assert proc.returncode == 0, f"workflow failed:\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    return workdir


@pytest.mark.slow
def test_mlem_settings_keep_their_own_runs_side_by_side(keyed):
    # Neither makes the other stale, whichever is asked first.
    assert dry_run(keyed, TINY) == {}
    assert dry_run(keyed, TINY_IT3) == {}
    assert dry_run(keyed, TINY) == {}
    runs = keyed / "results/small/runs/nema-seed1"
    assert {p.name for p in runs.iterdir()} == {
        "reference-it2", "reference-it3", f"cpu-auto-auto-{KEY}", f"cpu-auto-notrans-{KEY}",
        "cpu-auto-auto-it3-rep2-ck0", "cpu-auto-notrans-it3-rep2-ck0",
    }  # fmt: skip
    # Each summary reads exactly its own runs.
    for name, iterations, repetitions in (("default", "2", 1), ("it3", "3", 2)):
        with open(keyed / f"results/summary/{name}/runs.csv", newline="") as fh:
            rows = list(csv.DictReader(fh))
        assert {r["iterations"] for r in rows} == {iterations}
        runs_rows = [r for r in rows if r["reference_mode"] == "False"]
        assert len(runs_rows) == 2 * repetitions
        assert all(0 < float(r["rel_l2_reference"]) < 1e-5 for r in runs_rows), runs_rows


@pytest.mark.slow
def test_repetitions_rerun_runs_but_not_the_reference(finished):
    jobs = dry_run(finished, changed(mlem={"repetitions": 2}))
    assert jobs == {"run_mlem": 2, "summarize": 1}


@pytest.mark.slow
def test_part_count_reruns_partition_and_what_follows(finished):
    jobs = dry_run(finished, changed(partition={"parts": [3]}))
    assert jobs == {"partition_matrix": 1, "summarize": 1}
    # A GPU count of the runs is planned too, and its runs depend on the plan;
    # the existing cpu runs, the data and the matrix stages stay.
    config = changed(
        use_gpu=True,
        partition={"parts": [2]},
        runs=TINY["runs"] + [{"backend": "cuda", "fp": "csr_vector", "bp": "csr_vector", "gpus": [3]}],
    )
    proc = snakemake(finished, "--dry-run", "--resources", "gpu=3", config=config)  # its job stats and its jobs
    # the first cuda run also brings the kernels' warm-up (once per configuration)
    assert planned_jobs(proc) == {"partition_matrix": 1, "run_mlem": 1, "summarize": 1, "warm_kernels": 1}
    planned = proc.stdout
    assert "results/small/parts-3/plan.json" in planned
    assert f"cuda-csr_vector-csr_vector-{KEY}/gpus-3-local" in planned


@pytest.mark.slow
def test_phantom_reruns_simulation_runs_and_summary(finished):
    jobs = dry_run(finished, changed(simulation={"phantoms": ["uniform"]}))
    assert jobs == {"simulate_measurement": 1, "reference_mlem": 1, "run_mlem": 2, "summarize": 1}


@pytest.mark.slow
def test_noise_setting_reruns_simulation_runs_and_summary(finished):
    jobs = dry_run(finished, changed(simulation={"counts": 1.0e6}))
    assert jobs == {"simulate_measurement": 1, "reference_mlem": 1, "run_mlem": 2, "summarize": 1}


@pytest.mark.slow
def test_transpose_method_reruns_only_what_reads_the_transpose(finished):
    jobs = dry_run(finished, changed(transpose={"method": "scipy"}))
    # The run with the stored transpose; not the notrans run, the reference,
    # the data, the norm, the conversion, or the plan (it references row
    # ranges of the matrix: no run on 2 GPUs reads A^T).
    assert jobs == {"transpose_matrix": 1, "run_mlem": 1, "summarize": 1}


@pytest.mark.slow
def test_format_reruns_the_conversion_and_exactly_what_reads_the_matrix(finished):
    config = changed(matrices={"small": {"preset": "small", "format": "compressed"}})
    proc = snakemake(finished, "--dry-run", config=config)  # its job stats and its jobs
    # The container in the new format and every job that reads it; not the
    # generator's .csr4, which holds the same matrix in any format.
    assert planned_jobs(proc) == {
        "convert_matrix": 1, "reorder_matrix": 1, "compute_norm": 1, "transpose_matrix": 1, "partition_matrix": 1,
        "simulate_measurement": 1, "reference_mlem": 1, "run_mlem": 2, "summarize": 1,
    }  # fmt: skip
    planned = proc.stdout
    conversion = planned.split("rule convert_matrix:", 1)[1].split("\n\n", 1)[0]
    assert "reason: Params have changed since last execution" in conversion, conversion


# ------------------------------------------------- a user's own data, several configurations
#: A second configuration, as a user writes one: their own matrix and measurement
#: (copies of the tiny run's generated matrix and simulated measurement) under
#: their own name.
MINE = {
    "name": "mine",
    "use_gpu": False,
    "matrices": {"mine": {"path": "data/mine.csr4", "measurements": {"scan": "data/scan.LMsino"}}},
    "transpose": {"method": "scantrans", "compare": []},
    "partition": {"parts": []},
    "simulation": {"phantoms": []},
    "mlem": {"iterations": 2, "checkpoint_every": 0, "repetitions": 1, "reference": True},
    "runs": [{"backend": "cpu"}],
    "bench": {"spmv": False},
}


def mine(matrix: str = "data/mine.csr4", measurement: str = "data/scan.LMsino") -> dict:
    """MINE with other paths for the matrix and the measurement."""
    config = copy.deepcopy(MINE)
    config["matrices"]["mine"].update(path=matrix, measurements={"scan": measurement})
    return config


def copy_older(src: Path, dst: Path) -> Path:
    """Copy a file and date the copy back to 2001 (older than every output)."""
    dst.write_bytes(src.read_bytes())
    os.utime(dst, (1e9, 1e9))
    return dst


@pytest.fixture(scope="module")
def two_configs(finished) -> Path:
    """The tiny run's directory, where MINE then ran to the end too, and both reports were made."""
    data = finished / "data"
    data.mkdir()
    copy_older(finished / "resources/small.csr4", data / "mine.csr4")
    copy_older(finished / "results/small/data/nema-seed1.LMsino", data / "scan.LMsino")
    proc = snakemake(finished, "--cores", "2", config=MINE, timeout=600)
    assert proc.returncode == 0, f"workflow failed:\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    for config in (TINY, MINE):
        name = config.get("name", "default")
        proc = snakemake(finished, "--report", f"results/report-{name}.html", config=config)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        # no warning the user cannot act on (a coroutine of Snakemake's default disk resource), no resource table
        assert "Warning" not in proc.stderr and "what each job needs" not in proc.stdout + proc.stderr, proc.stderr
    return finished


def fault_line(proc: subprocess.CompletedProcess) -> str:
    """The one line of a failed run that names the config key (and no "Nothing to be done")."""
    line = one_line(proc)
    assert line.startswith("config matrices."), line
    return line


@pytest.mark.slow
def test_two_configurations_keep_their_own_summary_and_report(two_configs):
    for name, matrix in (("default", "small"), ("mine", "mine")):
        summary = two_configs / "results/summary" / name
        with open(summary / "runs.csv", newline="") as fh:
            assert {row["matrix"] for row in csv.DictReader(fh)} == {matrix}
        assert f"summary of configuration {name}" in (summary / "summary.md").read_text()
    # Neither makes the other look out of date, whichever is asked first.
    assert dry_run(two_configs, TINY) == {}
    assert dry_run(two_configs, MINE) == {}
    assert dry_run(two_configs, TINY) == {}


def report_results(path: Path) -> dict:
    """The results a Snakemake report embeds: path -> {"mime_type", "data_uri", ...}."""
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line.startswith("var results = {"):
            return json.loads(line[len("var results = ") :].rstrip(";"))
    raise AssertionError(f"{path}: no results in the report")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["default", "mine"])
def test_report_shows_every_plot_and_table(two_configs, name):
    summary = f"results/summary/{name}"
    results = report_results(two_configs / f"results/report-{name}.html")
    plots = sorted(f"{summary}/plots/{p.name}" for p in (two_configs / summary / "plots").glob("*.png"))
    expected = {"time_per_iteration.png", "time_distribution.png", "accuracy.png"}
    assert expected <= {p.rsplit("/", 1)[1] for p in plots}
    if name == "default":  # a simulated measurement has a truth to show
        assert f"{summary}/plots/image_small_nema-seed1.png" in plots
    tables = [f"{summary}/summary.html", f"{summary}/runs.html"]
    assert sorted(results) == sorted(plots + tables)  # only this configuration's
    # Each opens in the report's viewer: images and HTML pages, not CSV or Markdown links.
    for path in plots:
        assert results[path]["data_uri"].startswith("data:image/png;")
        assert base64.b64decode(results[path]["data_uri"].split("base64,", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    for path in tables:
        assert results[path]["data_uri"].startswith("data:text/html;")
        page = base64.b64decode(results[path]["data_uri"].split("base64,", 1)[1]).decode()
        assert page == (two_configs / path).read_text() and "<table>" in page
    summary_page = base64.b64decode(results[tables[0]]["data_uri"].split("base64,", 1)[1]).decode()
    for section in ("Time per iteration by step", "Accuracy over repetitions", "Transposition times by method"):
        assert f"<h2>{section}</h2>" in summary_page


@pytest.mark.slow
@pytest.mark.parametrize(
    ("config", "line"),
    [
        (mine(matrix="data/my_matrx.csr4"), "config matrices.mine.path: data/my_matrx.csr4: no such file"),
        (mine(measurement="data/scna.LMsino"), "config matrices.mine.measurements.scan: data/scna.LMsino: no such file"),
        (mine(matrix="data"), "config matrices.mine.path: data: not a file (a directory?)"),
        (
            mine(matrix="data/scan.LMsino"),
            "config matrices.mine.path: data/scan.LMsino: unsupported file type, expected a system matrix: "
            ".csr4, .mtx, .mtx.gz, .npz or .h5",
        ),
        (
            mine(measurement="data/mine.csr4"),
            "config matrices.mine.measurements.scan: data/mine.csr4: unsupported file type, expected a "
            "measurement: .LMsino or .sino",
        ),
    ],
)
def test_wrong_path_stops_even_where_results_of_an_earlier_path_exist(two_configs, config, line):
    # results/mine/... of data/mine.csr4 are on disk; Snakemake alone would call them up to date.
    assert fault_line(snakemake(two_configs, "--dry-run", config=config)) == line
    assert fault_line(snakemake(two_configs, "--cores", "1", config=config)) == line


@pytest.mark.slow
def test_file_that_is_not_what_its_name_says_stops_the_dry_run(two_configs):
    data = two_configs / "data"
    (data / "truncated.csr4").write_bytes((data / "mine.csr4").read_bytes()[:100])
    (data / "fake.npz").write_bytes(b"not a zip archive")
    (data / "short.LMsino").write_bytes(bytes(4 * 10))
    (data / "odd.LMsino").write_bytes(bytes(5))
    cases = [
        (mine(matrix="data/truncated.csr4"), "config matrices.mine.path: data/truncated.csr4: truncated"),
        (mine(matrix="data/fake.npz"), "config matrices.mine.path: data/fake.npz: not a SciPy .npz (zip) file"),
        (
            mine(measurement="data/short.LMsino"),
            "config matrices.mine.measurements.scan: data/short.LMsino: 10 counts, but the matrix "
            "data/mine.csr4 has 36864 rows (LORs)",
        ),
        (
            mine(measurement="data/odd.LMsino"),
            "config matrices.mine.measurements.scan: data/odd.LMsino: size is not a multiple of 4 bytes",
        ),
    ]
    for config, start in cases:
        assert fault_line(snakemake(two_configs, "--dry-run", config=config)).startswith(start)


@pytest.fixture
def clone(two_configs, tmp_path) -> Path:
    """A copy of the finished directory (file times and Snakemake's records kept) to change files in."""
    import shutil

    return Path(shutil.copytree(two_configs, tmp_path / "clone", symlinks=True))


@pytest.mark.slow
def test_matrix_path_changed_to_another_file_reruns_its_conversion_and_what_follows(clone):
    copy_older(clone / "data/mine.csr4", clone / "data/other.csr4")
    jobs = dry_run(clone, mine(matrix="data/other.csr4"))
    assert jobs == {"convert_matrix": 1, "reorder_matrix": 1, "compute_norm": 1, "transpose_matrix": 1,
                    "reference_mlem": 1, "run_mlem": 1, "summarize": 1}
    # The other configuration is not touched.
    assert dry_run(clone, TINY) == {}


@pytest.mark.slow
def test_matrix_replaced_by_an_older_file_reruns_its_conversion(clone):
    # Same path, another (older) file, as cp -p or tar would leave it: its time is
    # older than matrix.h5's, so only the recorded size and time notice it.
    path = clone / "data/mine.csr4"
    os.utime(path, (9e8, 9e8))
    jobs = dry_run(clone, MINE)
    assert jobs == {"convert_matrix": 1, "reorder_matrix": 1, "compute_norm": 1, "transpose_matrix": 1,
                    "reference_mlem": 1, "run_mlem": 1, "summarize": 1}


@pytest.mark.slow
def test_measurement_path_changed_reruns_its_reconstructions(clone):
    copy_older(clone / "data/scan.LMsino", clone / "data/scan2.LMsino")
    assert dry_run(clone, mine(measurement="data/scan2.LMsino")) == {
        "reference_mlem": 1, "run_mlem": 1, "summarize": 1}
    os.utime(clone / "data/scan.LMsino", (9e8, 9e8))  # the same path, an older file
    assert dry_run(clone, MINE) == {"reference_mlem": 1, "run_mlem": 1, "summarize": 1}
