"""tools/device_workflow/job_times.py: a workflow run's per-job times and critical path (issue 40; no GPU needed).

A hand-made run (Snakemake's log, metadata written an hour off the logs'
local time, benchmark files, job logs and an input of 2 GB that takes no
disk) checks every number of the tables against values worked out here; a
real CPU reconstruction's log checks that the lines it looks for are the
ones mlemlib writes; dry runs check that the time-to-result config plans
issue 40's jobs.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import yaml
from conftest import load_device_tool

from mlemlib.logs import LOG_FORMAT
from mlemlib.problem import ModelSpec, RunSettings

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "device_workflow"


J = load_device_tool("job_times")

#: The logs' local time is UTC+1 here: the metadata's Unix times must be mapped back by the offset.
OFFSET = timedelta(hours=1)


def epoch(clock: str) -> float:
    """The Unix time of 2026-11-27 ``clock`` (H:M:S[.f]) in the logs' local time (UTC+1)."""
    fmt = "%H:%M:%S.%f" if "." in clock else "%H:%M:%S"
    t = datetime.combine(datetime(2026, 11, 27).date(), datetime.strptime(clock, fmt).time())
    return (t - OFFSET).replace(tzinfo=UTC).timestamp()


def stamp(clock: str) -> str:
    return f"[Fri Nov 27 {clock} 2026]"


def job_block(clock, rule, jobid, output, *, inputs=(), log=None, benchmark=None, wildcards=None, threads=None, gpu=0):
    lines = [stamp(clock), f"localrule {rule}:"]
    if inputs:
        lines.append(f"    input: {', '.join(inputs)}")
    lines.append(f"    output: {output}")
    if log:
        lines.append(f"    log: {log}")
    lines.append(f"    jobid: {jobid}")
    if benchmark:
        lines.append(f"    benchmark: {benchmark}")
    lines.append(f"    reason: Missing output files: {output}")
    if wildcards:
        lines.append(f"    wildcards: {wildcards}")
    if threads:
        lines.append(f"    threads: {threads}")
    lines.append(f"    resources: tmpdir=/tmp, mem_mb=1000, gpu={gpu}, runtime=10")
    return lines


def finished(clock, jobid, rule):
    return [stamp(clock), f"Finished jobid: {jobid} (Rule: {rule})"]


def mlem_line(clock: str, msg: str, logger: str = "mlemlib.mlem") -> str:
    return f"2026-11-27 {clock} INFO {logger}: {msg}"


CSR4 = "resources/m.csr4"
RUN_OUT = "results/m/runs/g/run/gpus-1-local/image.h5"
REF_OUT = "results/m/runs/g/reference-it50/image.h5"
RUN_LOG = "logs/mlem/m/g/run-gpus-1-local.log"
BENCH = "benchmarks/mlem/m/g/run-gpus-1-local.tsv"


def fabricate(root: Path) -> None:
    """A run started at 10:00:00 (local): generate (1-11 s), the GPU run (11.25-31.15 s), the reference
    (12-20 s, 64 threads), summarize (32-33 s), and a bench job still running (from 21 s)."""
    text = [
        "Assuming unrestricted shared filesystem usage.",
        "",
        "SNAKEMAKE",
        "=========",
        "  Date: 2026-11-27 10:00:00",
        "Building DAG of jobs...",
        "Select jobs to execute...",
        *job_block("10:00:01", "generate_matrix", 3, CSR4, log="logs/matrix/m-generate.log",
                   benchmark="benchmarks/matrix/m-generate.tsv", wildcards="matrix=m", threads=64),
        *finished("10:00:11", 3, "generate_matrix"),
        "1 of 5 steps (20%) done",
        *job_block("10:00:11", "run_mlem", 2, RUN_OUT, inputs=[CSR4], log=RUN_LOG, benchmark=BENCH,
                   wildcards="matrix=m, data=g, run=cuda-auto-auto, iterations=50, gpus=1", gpu=1),
        *job_block("10:00:12", "reference_mlem", 4, REF_OUT, inputs=[CSR4], log="logs/mlem/m/g/reference-it50.log",
                   benchmark="benchmarks/mlem/m/g/reference-it50.tsv", wildcards="matrix=m, data=g, iterations=50",
                   threads=64),
        *finished("10:00:20", 4, "reference_mlem"),
        *job_block("10:00:21", "bench_spmv", 5, "results/m/bench/spmv.csv", inputs=[CSR4],
                   log="logs/bench/m-spmv.log", wildcards="matrix=m", gpu=1),
        *finished("10:00:31", 2, "run_mlem"),
        *job_block("10:00:32", "summarize", 1, "results/summary/t/runs.csv", inputs=[RUN_OUT, REF_OUT, BENCH]),
        *finished("10:00:33", 1, "summarize"),
        stamp("10:00:33"),
        "localrule all:",
        "    input: results/summary/t/runs.csv",
        "    jobid: 0",
        *finished("10:00:33", 0, "all"),
        "Elapsed time: 0:00:34.100000",
    ]
    log_dir = root / ".snakemake" / "log"
    log_dir.mkdir(parents=True)
    (log_dir / "2026-11-27T100000.000000.snakemake.log").write_text("\n".join(text) + "\n")
    # Snakemake's metadata for the run's output only: its start to the microsecond, its end before the script's.
    meta = root / ".snakemake" / "metadata"
    meta.mkdir()
    key = base64.urlsafe_b64encode(RUN_OUT.encode()).decode()
    (meta / key).write_text(json.dumps({"rule": "run_mlem", "starttime": epoch("10:00:11.25"),
                                        "endtime": epoch("10:00:30.5")}))
    # A record cut into folders (a long path): "@" + chunk / rest.
    key = base64.urlsafe_b64encode(b"results/m/other.h5").decode()
    (meta / ("@" + key[:8])).mkdir()
    (meta / ("@" + key[:8]) / key[8:]).write_text(json.dumps({"starttime": 1.0, "endtime": 2.0}))
    header = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
    for path, s in [("benchmarks/matrix/m-generate.tsv", 9.8), (BENCH, 19.9), ("benchmarks/mlem/m/g/reference-it50.tsv", 7.5)]:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(header + f"{s:.2f}\t0:00:{int(s):02d}\t1\t1\t1\t1\t0\t0\t50\t1\n")
    (root / CSR4).parent.mkdir(parents=True)
    with open(root / CSR4, "wb") as f:  # 2 GB that take no disk
        f.truncate(2_000_000_000)
    (root / RUN_LOG).parent.mkdir(parents=True)
    (root / RUN_LOG).write_text("\n".join([
        mlem_line("10:00:11,900", "leased GPU(s) 0 (PCI 00000000:18:00.0; pid 7; lock dir /tmp/l)", "mlemlib.dist.lease"),
        mlem_line("10:00:12,250", "loaded problem abc: 10 x 10, 20 nnz (0.30 s)", "mlemlib.problem"),
        mlem_line("10:00:15,240", "cuda backend: set-up 3.00 s: read 2.0 GB in 1.60 s (1.25 GB/s), to GPU 0.80 s, "
                                  "other 0.30 s", "mlemlib.setup_times"),
        mlem_line("10:00:15,250", "backend cuda ready (3.00 s): {'backend': 'cuda'}"),
        mlem_line("10:00:15,400", "GPU 0: copy bandwidth 3000.0 GB/s (median of 5 copies of 256 MiB)", "mlemlib.devices"),
        mlem_line("10:00:16,250", "repetition 1/2 iteration 2/50: 1.000 ms/iteration (fp 0.5 ms), ETA 98 ms"),
        mlem_line("10:00:16,300", "repetition 1/2 iteration 4/50: 1.000 ms/iteration (fp 0.5 ms), ETA 96 ms"),
        mlem_line("10:00:20,250", "repetition 1/2 done: mean 1.000 ms/iteration, image sum 1"),
        mlem_line("10:00:30,250", "repetition 2/2 done: mean 1.000 ms/iteration, image sum 1"),
        mlem_line("10:00:30,300", "releasing GPU lease 0", "mlemlib.dist.lease"),
    ]) + "\n")


@pytest.fixture
def fabricated(tmp_path):
    fabricate(tmp_path)
    return tmp_path


def table_row(lines: list[str], first_cells: str) -> list[str]:
    """The cells of the table row that starts with ``| first_cells |``."""
    rows = [ln for ln in lines if ln.startswith(f"| {first_cells} |")]
    assert len(rows) == 1, (first_cells, rows)
    return [c.strip() for c in rows[0].strip("|").split("|")]


def test_snakemake_log_jobs_and_metadata(fabricated):
    run = J.parse_snakemake_log(next((fabricated / ".snakemake" / "log").iterdir()).read_text())
    assert sorted(run.jobs) == [1, 2, 3, 4, 5]  # not "all": it has no output
    assert run.date == datetime(2026, 11, 27, 10, 0, 0) and run.elapsed_s == pytest.approx(34.1)
    run_job = run.jobs[2]
    assert (run_job.rule, run_job.gpus, run_job.threads, run_job.inputs) == ("run_mlem", 1, 1, [CSR4])
    assert run.jobs[4].threads == 64 and run.jobs[5].logged_end is None
    meta = J.read_metadata(fabricated / ".snakemake" / "metadata")
    assert meta[RUN_OUT] == (epoch("10:00:11.25"), epoch("10:00:30.5"))
    assert meta["results/m/other.h5"] == (1.0, 2.0)
    assert J.local_offset(run.jobs.values(), meta) == OFFSET


def test_error_block_marks_the_job_failed():
    text = "\n".join([
        *job_block("10:00:01", "run_mlem", 7, "a.h5", log="a.log"),
        stamp("10:00:04"),
        "Error in rule run_mlem:",
        "    jobid: 7",
        "    output: a.h5",
    ])
    job = J.parse_snakemake_log(text).jobs[7]
    assert job.failed and job.logged_end == datetime(2026, 11, 27, 10, 0, 4)


def test_the_reference_target_judges_its_iterations_where_its_log_times_them(fabricated, capsys):
    """Issue 40's reference target is its iterations (<= 20 s for 50): from "backend ready" to the last
    repetition's end in its log; the job's seconds (with loading the matrix) beside them."""
    log = fabricated / "logs/mlem/m/g/reference-it50.log"
    log.write_text("\n".join([
        mlem_line("10:00:12,500", "loaded problem abc: 10 x 10, 20 nnz (0.30 s)", "mlemlib.problem"),
        mlem_line("10:00:14,000", "backend cpu ready (1.20 s): {'backend': 'cpu'}"),
        mlem_line("10:00:14,100", "repetition 1/1 iteration 1/50: 100.000 ms/iteration (fp 50 ms), ETA 4900 ms"),
        mlem_line("10:00:19,250", "repetition 1/1 done: mean 100.000 ms/iteration, image sum 1"),
    ]) + "\n")
    J.main([str(fabricated), "--started", str(epoch("10:00:00")), "--total", "34.5", "--target-reference", "5"])
    lines = capsys.readouterr().out.splitlines()
    assert ("- float64 reference [4] (64 threads): its iterations 5.2 s, target <= 5 s: MISSED (the job, with "
            "loading the matrix: 8.0 s)") in lines


def test_tables_critical_path_and_targets_by_hand(fabricated, capsys):
    status = J.main([
        str(fabricated), "--started", str(epoch("10:00:00")), "--total", "34.5", "--disk-bw", "1e9",
        "--disk-note", "dd, direct", "--target-total", "120", "--target-reference", "20",
        "--target-first-iteration", "1.5",
    ])
    out = capsys.readouterr().out
    assert status == J.EXIT_OK, out
    lines = out.splitlines()
    assert lines[0].startswith("Total wall time: 34.5 s (5 jobs, 1 of them unfinished); times in s after 2026-11-27 10:00:00")
    assert "Wildcards shared by every job that has them (left out below): matrix=m, data=g, iterations=50." in out
    # generate: the log's seconds (1, 11); its script ran 9.8 s, which ends no later than the log says.
    assert table_row(lines, "3 | generate_matrix") == ["3", "generate_matrix", "resources/m.csr4", "64", "0", "1.0", "11.0",
                                                       "10.00", "9.80", "-", "-"]
    # the run: the metadata's start 11.25 (UTC+1 undone), end = start + 19.9 s of script = 31.15 (after the log's 31
    # and the metadata's 30.5); 2 GB of input; first iteration (it. 2) at 16.25 - 11.25 = 5.00 s.
    assert table_row(lines, "2 | run_mlem") == ["2", "run_mlem", "run=cuda-auto-auto, gpus=1", "1", "1", "11.2", "31.1",
                                                "19.90", "19.90", "2.000", "5.00"]
    # the reference: the log's 12 s; its end the log's 20 (12 + 7.5 is earlier).
    assert table_row(lines, "4 | reference_mlem")[5:9] == ["12.0", "20.0", "8.00", "7.50"]
    assert table_row(lines, "5 | bench_spmv")[5:8] == ["21.0", "unfinished", "-"]
    # From the run's log: leased 0.65, loaded 1.00, ready 4.00, 1st iteration 5.00 (it. 2); load + set-up 3.30; what
    # the set-up line read; 2 GB / 4 s = 0.50 GB/s; 2 GB at 1 GB/s = 2.00 s; 5.00 / 2.00 = 2.50; iterations from
    # ready (15.25) to 30.25.
    mlem = lines[lines.index("MLEM jobs from their start to their first iteration (s after the job's start, from its log):"):]
    assert table_row(mlem[:5], "2 | run_mlem run=cuda-auto-auto, gpus=1")[2:] == [
        "1", "0.65", "1.00", "4.00", "5.00 (it. 2)", "3.30", "read 2.0 GB in 1.60 s (1.25 GB/s)", "0.50", "2.00", "2.50",
        "15.00"]
    assert "Disk: 1.00 GB/s sequential read; dd, direct." in out
    assert "- whole workflow: 34.5 s, target <= 120 s: met" in lines
    assert "- float64 reference [4] (64 threads): 8.0 s, target <= 20 s: met" in lines
    assert ("- GPU run [2] on 1 GPU(s): first iteration at 5.00 s, 2.50x the 2.00 s to read its 2.00 GB of inputs at "
            "disk speed, target <= 1.5x (3.00 s): MISSED") in lines
    # Critical path: summarize (ends last) <- the run (ended 31.15, after the reference's 20) <- generate.
    start = lines.index("| jobid | job | start | end | s | gap before s |")
    assert lines[start + 2:start + 5] == [
        "| 3 | generate_matrix resources/m.csr4 | 1.0 | 11.0 | 10.00 | 1.00 |",
        "| 2 | run_mlem run=cuda-auto-auto, gpus=1 | 11.2 | 31.1 | 19.90 | 0.25 |",
        "| 1 | summarize results/summary/t/runs.csv | 32.0 | 33.0 | 1.00 | 0.85 |",
    ]
    # 10 + 19.9 + 1 = 30.9 s in jobs, 1 + 0.25 + 0.85 = 2.1 s in gaps, 34.5 - 33 = 1.5 s after: 34.5 s.
    assert ("3 jobs: 30.9 s in jobs + 2.1 s in gaps (the first: from the workflow's start, Snakemake building the DAG) "
            "+ 1.5 s after the last job = 34.5 s (total 34.5 s).") in lines
    assert ("Longest chain of dependencies by job seconds: 30.9 s (generate_matrix [3] -> run_mlem [2] -> "
            "summarize [1])") in out
    assert "Unfinished: bench_spmv results/m/bench/spmv.csv [5]." in lines


def test_without_measured_times_the_banner_and_elapsed_time_count(fabricated, capsys):
    assert J.main([str(fabricated)]) == J.EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("Total wall time: 34.1 s (5 jobs, 1 of them unfinished); times in s after 2026-11-27 10:00:00")
    assert "Targets" not in out and "Disk:" not in out


def test_command_line_errors(tmp_path, capsys):
    assert J.main([str(tmp_path / "missing")]) == J.EXIT_INPUT
    assert J.main([str(tmp_path)]) == J.EXIT_INPUT
    assert "no .snakemake/log/*.snakemake.log" in capsys.readouterr().err
    (tmp_path / "empty.log").write_text("Building DAG of jobs...\n")
    assert J.main([str(tmp_path), "--snakemake-log", str(tmp_path / "empty.log")]) == J.EXIT_INPUT


def test_parses_what_a_real_reconstruction_logs(tmp_path):
    """mlemlib's own lines (loaded problem, backend ready, every 2nd iteration of 50, repetitions done)."""
    from mlemlib.matrix import CSRMatrix
    from mlemlib.mlem import reconstruct

    a = sp.random(300, 60, density=0.1, random_state=3, format="csr", dtype=np.float32)
    g = np.random.default_rng(3).poisson(a @ np.ones(60, np.float32) * 20).astype(np.int32)
    path = tmp_path / "job.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        reconstruct(ModelSpec(CSRMatrix.from_scipy(a), g),
                    RunSettings(50, repetitions=2, checkpoint_every=0, backend="cpu"), tmp_path / "image.h5")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()
    got = J.parse_job_log(path.read_text())
    assert got.loaded is not None and got.load_s is not None
    assert got.ready is not None and got.setup_s is not None
    assert got.first_iteration_number == 2 and got.first_iteration >= got.ready
    assert got.done is not None and got.done >= got.first_iteration and got.leased is None


# --- the scenario's config ------------------------------------------------------


def test_config_is_issue_40s():
    jsonschema = pytest.importorskip("jsonschema")
    config = yaml.safe_load((TOOL / "time-to-result.yaml").read_text())
    jsonschema.validate(config, yaml.safe_load((REPO / "config" / "schema.yaml").read_text()))
    assert config["matrices"] == {"madpet2": {"preset": "madpet2", "format": "csr"}} and config["reorder"] == "none"
    assert config["mlem"] == {"iterations": 50, "repetitions": 2, "reference": True} and config["bench"]["spmv"] is True
    assert config["runs"] == [{"backend": "cuda", "fp": "auto", "bp": "auto", "gpus": [1, 2, 4]}]


@pytest.mark.parametrize("gpus, planned", [(4, [1, 2, 4]), (2, [1, 2])])
def test_config_plans_runs_the_node_can_give(tmp_path, gpus, planned):
    """A dry run as on a GPU node (use_gpu=true) under --resources gpu=N: the runs that fit, the SpMV benchmark, the
    reference; no reorder stage."""
    cmd = [
        sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
        "--configfile", str(TOOL / "time-to-result.yaml"), "--config", "use_gpu=true", "--dry-run", "--cores", "64",
        "--resources", f"gpu={gpus}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    run = J.parse_snakemake_log(out)
    runs = sorted(j.gpus for j in run.jobs.values() if j.rule == "run_mlem")
    assert runs == planned
    rules = [j.rule for j in run.jobs.values()]
    assert rules.count("bench_spmv") == 1 and rules.count("reference_mlem") == 1 and "reorder_matrix" not in rules


def test_matrix3_config_is_issue_38s():
    """The matrix3 scenario's config: Matrix 3 folded, compressed, Hilbert voxels, both one passes on 1, 2, 4 GPUs."""
    jsonschema = pytest.importorskip("jsonschema")
    config = yaml.safe_load((TOOL / "matrix3.yaml").read_text())
    jsonschema.validate(config, yaml.safe_load((REPO / "config" / "schema.yaml").read_text()))
    assert config["matrices"] == {"matrix3": {"preset": "matrix3", "csr4": False, "format": "compressed",
                                              "fold": True, "voxel_order": "hilbert"}}
    assert sorted(r["bp"] for r in config["runs"]) == ["onepass", "onepass_fixed"]
    assert all(r["gpus"] == [1, 2, 4] and r["backend"] == "cuda" for r in config["runs"])
    assert config["mlem"]["reference"] is False and config["bench"]["spmv"] is False


@pytest.mark.parametrize("gpus, planned", [(4, [1, 1, 2, 2, 4, 4]), (2, [1, 1, 2, 2])])
def test_matrix3_config_plans_runs_the_node_can_give(tmp_path, gpus, planned):
    """A dry run as on a GPU node: generation, norm, measurement and the runs that fit; no conversion, transpose
    or reference (31 GB of matrix is all the disk holds of it)."""
    node = tmp_path / "node.yaml"  # the lent 4-GPU node's disk, memory and GPUs, whatever machine runs the test
    node.write_text("node: {check: true, disk_free_gb: 200, host_memory_gb: 512, gpu_memory_gb: 80, gpus: 4}\n")
    cmd = [
        sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
        "--configfile", str(TOOL / "matrix3.yaml"), str(node), "--config", "use_gpu=true",
        "--dry-run", "--cores", "64", "--resources", f"gpu={gpus}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    run = J.parse_snakemake_log(out)
    rules = [j.rule for j in run.jobs.values()]
    assert sorted(j.gpus for j in run.jobs.values() if j.rule == "run_mlem") == planned
    assert rules.count("generate_container") == 1 and rules.count("compute_norm") == 1
    assert not {"convert_matrix", "transpose_matrix", "reference_mlem", "bench_spmv"} & set(rules)
