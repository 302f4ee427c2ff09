"""The workflow's plan for GPU jobs, proved on the CPU (issue "Every configuration composes", failures 2-4).

- A rerun after a failure, with the GPU warm-up's params changed by the config, runs every missing job and the
  summary (the warm-up is a checkpoint: the GPU jobs are looked at again once it has run). The GPU jobs run here
  through a stand-in of ``mlemlib.mlem.reconstruct`` that reconstructs on the CPU (a ``sitecustomize`` on the
  jobs' ``PYTHONPATH``); the warm-up finds no GPU and records so, as it does wherever compiling fails.
- ``use_gpu: true`` on local execution without a visible GPU is refused in the dry run, in one line; with a
  cluster profile (GPUs on the compute nodes), ``--resources gpu=N`` or a visible GPU the GPU jobs are planned.
- OSEM with a stored-transpose back projection on a compressed matrix is refused in the dry run; a one-GPU run
  with CUDA graphs and such a kernel on a compressed matrix reads the partition's part files (a 1-part plan).
- ``--unlock`` does not print the resource table.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_workflow import KEY, TINY, one_line, planned_jobs

REPO = Path(__file__).resolve().parents[1]

#: Reconstructions of backend cuda on the CPU, for the jobs of the rerun test (imported by every Python process
#: started with its directory on PYTHONPATH; it patches only the run_mlem script's process).
STAND_IN = '''
import sys

if sys.argv and sys.argv[0].endswith("run_mlem.py"):
    import mlemlib.mlem as _mlem

    import dataclasses

    _reconstruct = _mlem.reconstruct

    def _on_the_cpu(model, settings, *args, **kw):
        settings = dataclasses.replace(settings, backend="cpu", gpus=1, layout="local", fp="auto", bp="auto",
                                       graph=None, secsize=None)
        return _reconstruct(model, settings, *args, **kw)

    _mlem.reconstruct = _on_the_cpu
'''


def gpu_config(*runs: dict, **sections) -> dict:
    """TINY with use_gpu: true and the given runs (cuda by default), no reference, no transpose."""
    config = copy.deepcopy(TINY)
    config["use_gpu"] = True
    config["mlem"]["reference"] = False
    config["runs"] = [{"backend": "cuda", **run} for run in runs]
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(config.get(section), dict):
            config[section].update(values)
        else:
            config[section] = values
    return config


def snakemake(workdir: Path, config: dict, *args: str, gpus: int | None = None, stand_in: bool = False,
              timeout: float = 600) -> subprocess.CompletedProcess:
    """Snakemake on this repository's workflow in ``workdir`` with ``config``; ``gpus``: the GPUs this machine
    shows ($MLEM_NUM_GPUS; None: as it is, none here); ``stand_in``: the cuda runs reconstruct on the CPU."""
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [sys.executable, "-m", "snakemake", *args, "--snakefile", str(REPO / "Snakefile"), "--directory",
           str(workdir), "--configfile", str(path)]  # last: --resources and --configfile take several values
    pythonpath = [str(REPO)]
    if stand_in:
        site = workdir / "stand-in"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(STAND_IN)
        pythonpath.insert(0, str(site))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath), MLEM_LOCK_DIR=str(workdir / "locks"))
    env.pop("MLEM_NUM_GPUS", None)
    if gpus is not None:
        env["MLEM_NUM_GPUS"] = str(gpus)
    return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout, env=env)


def run_path(name: str, what: str = "image.h5") -> str:
    """A run's output of TINY's matrix and measurement, on one GPU."""
    return f"results/small/runs/nema-seed1/{name}-{KEY}/gpus-1-local/{what}"


SUMMARY = "results/summary/default/runs.csv"


# ------------------------------------------------------------------ failure 3: a rerun after a failure


@pytest.mark.slow
def test_rerun_with_changed_warm_up_params_runs_every_missing_job_and_the_summary(tmp_path):
    first = gpu_config({"fp": "auto", "bp": "auto"}, {"fp": "csr_vector", "bp": "csr_vector"},
                       {"fp": "auto", "bp": "notrans"})
    # The first invocation stops after the warm-up and one run (as a failing run stops it): two runs and the
    # summary are missing.
    proc = snakemake(tmp_path, first, run_path("cuda-auto-auto"), "--cores", "2", "--resources", "gpu=1",
                     stand_in=True, gpus=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    done = tmp_path / run_path("cuda-auto-auto")
    assert done.exists() and (tmp_path / "results/kernels/default.json").exists()
    assert not (tmp_path / run_path("cuda-csr_vector-csr_vector")).exists()
    stamp = done.stat().st_mtime_ns

    # The run that "failed" is removed from the config: the warm-up's params change (its runs), the rest is missing.
    second = gpu_config({"fp": "auto", "bp": "auto"}, {"fp": "csr_vector", "bp": "csr_vector"})
    proc = snakemake(tmp_path, second, "--cores", "2", "--resources", "gpu=1", stand_in=True, gpus=1)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Params have changed" in out  # the warm-up reran for its params
    assert (tmp_path / run_path("cuda-csr_vector-csr_vector")).exists(), out[-3000:]
    assert (tmp_path / SUMMARY).exists(), out[-3000:]
    assert done.stat().st_mtime_ns == stamp  # the finished run is not made again
    assert not (tmp_path / run_path("cuda-auto-notrans")).exists()

    # Nothing is left to do.
    proc = snakemake(tmp_path, second, "--cores", "2", "--resources", "gpu=1", "--dry-run", stand_in=True, gpus=1)
    assert planned_jobs(proc) == {}, proc.stdout[-3000:]


# ------------------------------------------------------------------ failure 4: use_gpu: true without a GPU


def test_use_gpu_true_without_a_gpu_is_refused_in_the_dry_run(tmp_path):
    proc = snakemake(tmp_path, gpu_config({"fp": "auto", "bp": "auto"}), "--dry-run", gpus=0)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    line = out.rstrip().splitlines()[-1]
    assert line.startswith("config use_gpu: true, but no GPU is visible here for the 2 GPU jobs to run"), out
    assert "Traceback" not in out and "Job stats" not in out
    assert not any(x.startswith(("rule ", "checkpoint ")) for x in out.splitlines())
    # a quiet dry run is refused too (the check runs when the DAG is built, not when jobs are printed)
    quiet = snakemake(tmp_path, gpu_config({"fp": "auto", "bp": "auto"}), "--dry-run", "--quiet", "rules", gpus=0)
    assert quiet.returncode != 0 and (quiet.stdout + quiet.stderr).rstrip().splitlines()[-1] == line


@pytest.mark.parametrize(
    ("args", "gpus"),
    [
        (("--profile", str(REPO / "profiles" / "slurm")), 0),  # the GPUs are on the compute nodes
        (("--resources", "gpu=1"), 0),  # the user gives the GPU count
        ((), 1),  # a GPU is visible here
    ],
)
def test_use_gpu_true_plans_the_gpu_jobs_where_they_can_run(tmp_path, args, gpus):
    proc = snakemake(tmp_path, gpu_config({"fp": "auto", "bp": "auto"}), "--dry-run", *args, gpus=gpus)
    jobs = planned_jobs(proc)
    assert jobs["warm_kernels"] == 1 and jobs["run_mlem"] == 1, jobs


def test_use_gpu_auto_without_a_gpu_leaves_the_cuda_runs_out(tmp_path):
    config = gpu_config({"fp": "auto", "bp": "auto"}, use_gpu="auto")
    config["runs"].append({"backend": "cpu"})
    proc = snakemake(tmp_path, config, "--dry-run", gpus=0)
    jobs = planned_jobs(proc)
    assert jobs["run_mlem"] == 1 and "warm_kernels" not in jobs, jobs
    assert "runs left out, 1 (they need more GPUs than use_gpu: auto (0 visible here)): cuda-auto-auto on 1 GPU" in (
        proc.stdout + proc.stderr)


# ------------------------------------------------------------------ failure 2: the stored-transpose pair


def test_osem_with_the_stored_transpose_pair_on_a_compressed_matrix_is_refused(tmp_path):
    config = gpu_config({"fp": "delta_vector", "bp": "delta_vector"}, mlem={"subsets": 16},
                        matrices={"small": {"preset": "small", "format": "compressed"}})
    line = one_line(snakemake(tmp_path, config, "--dry-run", "--resources", "gpu=1"))
    assert line.startswith("config runs[0].bp: delta_vector back-projects on a stored A^T, which OSEM "
                           "(subsets 16) cannot have on the GPUs for a compressed matrix; use bp: auto"), line
    # the one passes and auto run with subsets on a compressed matrix; the pair on CSR transposes on the GPUs
    for fp, bp, fmt in (("auto", "auto", "compressed"), ("auto", "onepass_fixed", "compressed"),
                        ("csr_vector", "csr_vector", "csr")):
        config = gpu_config({"fp": fp, "bp": bp}, mlem={"subsets": 4},
                            matrices={"small": {"preset": "small", "format": fmt}})
        jobs = planned_jobs(snakemake(tmp_path, config, "--dry-run", "--quiet", "rules", "--resources", "gpu=1"))
        assert jobs["run_mlem"] == 1, (fp, bp, fmt, jobs)


def _blocks(proc: subprocess.CompletedProcess, rule: str) -> list[str]:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return [b for b in re.split(r"\n(?=\[)|\n\n", out) if f"rule {rule}:" in b]  # a block opens with its time


def test_one_gpu_graphed_pair_on_a_compressed_matrix_reads_the_partitions_part_files(tmp_path):
    """One GPU with graph: true runs the several-GPU backend, whose local layout reads A_k^T of a compressed
    matrix from the partition's part files: the 1-part plan (with its A_k^T, made from transpose.h5) is an input."""
    config = gpu_config({"fp": "delta_vector", "bp": "delta_vector", "graph": True},
                        {"fp": "delta_vector", "bp": "delta_vector"},
                        matrices={"small": {"preset": "small", "format": "compressed"}}, partition={"parts": []})
    proc = snakemake(tmp_path, config, "--dry-run", "--resources", "gpu=1")
    (part,) = _blocks(proc, "partition_matrix")
    assert "output: results/small/parts-1/plan.json" in part and "results/small/transpose.h5" in part, part
    assert "A_k^T" in (proc.stdout + proc.stderr).split("what each job needs", 1)[1].split("Job stats", 1)[0]
    runs = {re.search(r"output: results/small/runs/nema-seed1/(\S+)/gpus-1-local/", b).group(1): b
            for b in _blocks(proc, "run_mlem")}
    graphed, plain = runs[f"cuda-delta_vector-delta_vector-graph-{KEY}"], runs[f"cuda-delta_vector-delta_vector-{KEY}"]
    assert "results/small/parts-1/plan.json" in graphed and "results/small/transpose.h5" not in graphed
    # without graphs one GPU runs the one-GPU backend, which reads the whole A^T
    assert "results/small/transpose.h5" in plain and "plan.json" not in plain


# ------------------------------------------------------------------ issue 56: --unlock


def test_unlock_prints_no_resource_table(tmp_path):
    proc = snakemake(tmp_path, gpu_config({"fp": "auto", "bp": "auto"}), "--unlock", gpus=0)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "what each job needs" not in out and "runs left out" not in out and "use_gpu" not in out
    assert "Unlocked working directory" in out


# ------------------------------------------------------------------ the DAG check, whatever the target


@pytest.mark.parametrize("target", [(), ("results/small/norm.h5",)])
def test_the_dag_check_refuses_in_one_last_line_for_any_target(tmp_path, target):
    """The check of the DAG against the node runs once the DAG is built, for the whole workflow or one file."""
    config = copy.deepcopy(TINY)
    config["node"] = {"host_memory_gb": 0.5}
    proc = snakemake(tmp_path, config, *target, "--dry-run")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("resources: stage generate_matrix (small) needs ") and last.endswith(
        "of host memory, the node has 500.0 MB (short by " + last.rsplit("(short by ", 1)[-1]), out[-2000:]
    assert "Exception" not in out and "Traceback" not in out and "Job stats" not in out
