"""The workflow on a real SLURM cluster through profiles/slurm.

Needs a running SLURM with accounting (sacct); on one machine,
``tools/slurm/start.sh`` makes one (see docs/cluster.md), and
``tools/slurm/run_test.sh`` starts it and runs this file. Without SLURM
every test here is skipped with the reason.

What is checked, against a local run of the same workflow on this machine:

1. The default workflow through ``--profile profiles/slurm``: every Snakemake
   job became exactly one SLURM job (sacct, by the rule name in the job's
   comment) that completed, wrote its SLURM log, and asked for no GPU; every
   artifact equals the local run's (HDF5 datasets, measurements and raw
   images bit for bit: the CPU backend is deterministic).
2. A GPU run is submitted with its GPUs (``--gpus``, optional ``gpu_model``)
   and CPUs per GPU: SLURM allocates them (the test cluster's GPUs are fake,
   so the job itself then fails for want of CUDA, as it should).
3. ``scancel`` of a running MLEM job after its first checkpoint, then a
   rerun: the job resumes from the checkpoint (its log says so), no upstream
   artifact is recomputed (same mtimes, no SLURM job for them), no output of
   the killed job is left under its final name, and the image equals an
   uninterrupted run's bit for bit.

Settings (environment): MLEM_SLURM_ACCOUNT (default ``mlem``) and
MLEM_SLURM_PARTITION (default ``debug``), as tools/slurm/start.sh makes them;
MLEM_SLURM_TMP, a directory the compute nodes see (default: pytest's).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEFILE = REPO / "Snakefile"
PROFILE = REPO / "profiles" / "slurm"
ACCOUNT = os.environ.get("MLEM_SLURM_ACCOUNT", "mlem")
PARTITION = os.environ.get("MLEM_SLURM_PARTITION", "debug")
#: Seconds before the plugin's first status poll and its base interval (the
#: profile's 40 s suit a real cluster; a test wants answers sooner).
STATUS_SECONDS = "2"
#: The run of config/config.yaml's settings (mlem: 20 iterations, 3 repetitions, checkpoints every 10).
RUN_DIR = "results/small/runs/nema-seed1/cpu-auto-auto-it20-rep3-ck10/gpus-1-local"
#: The long run that test_scancel_then_rerun_resumes_from_checkpoint interrupts.
LONG_RUN_DIR = "results/small/runs/nema-seed1/cpu-auto-auto-it15000-rep1-ck1000/gpus-1-local"


def _slurm_missing() -> str | None:
    """Why the SLURM tests cannot run here, or None when they can."""
    for tool in ("sinfo", "sbatch", "sacct", "scancel", "squeue", "scontrol"):
        if shutil.which(tool) is None:
            return f"SLURM is not installed ({tool} not on PATH); start one with tools/slurm/start.sh"
    try:
        import snakemake_executor_plugin_slurm  # noqa: F401
    except ImportError:
        return "snakemake-executor-plugin-slurm is not installed (pip install -e '.[workflow]')"
    down = os.environ.get("MLEM_TEST_SLURM_DOWN")  # tests/conftest.py's finding (SLURM_CONF then refuses)
    if down is not None:
        return f"slurmctld is not running ({down}); start it with tools/slurm/start.sh"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20, check=False)
        if "UP" not in ping.stdout:  # before sinfo, which then waits for its connection timeout
            return f"slurmctld is not running ({ping.stdout.strip() or ping.stderr.strip()}); start it with tools/slurm/start.sh"
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20, check=False)
        acct = subprocess.run(["sacct", "-n", "-X", "-S", "now"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"SLURM does not answer ({exc}); start it with tools/slurm/start.sh"
    if not any(s.startswith(("idle", "mixed", "allocated")) for s in states.stdout.split()):
        return f"no usable SLURM node (states: {states.stdout.split()}); see tools/slurm/start.sh"
    if acct.returncode != 0:
        return f"SLURM accounting (sacct) does not work: {acct.stderr.strip()}; the executor plugin needs slurmdbd"
    return None


_MISSING = _slurm_missing()
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""),
]


# ------------------------------------------------------------------ helpers


def default_config() -> dict:
    with open(REPO / "config" / "config.yaml") as f:
        return yaml.safe_load(f)


def snakemake_cmd(workdir: Path, *args: str, config: dict | None = None, slurm: bool = False) -> list[str]:
    """The snakemake command line for this repository's workflow in ``workdir``."""
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(SNAKEFILE), "--directory", str(workdir)]
    if config is not None:
        path = workdir / f"config-{abs(hash(yaml.safe_dump(config, sort_keys=True))):x}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        cmd += ["--configfile", str(path)]
    if slurm:
        cmd += [
            "--profile",
            str(PROFILE),
            "--default-resources",
            f"slurm_account={ACCOUNT}",
            f"slurm_partition={PARTITION}",
            "--slurm-init-seconds-before-status-checks",
            STATUS_SECONDS,
        ]
    else:
        cmd += ["--cores", "2"]
    return cmd + list(args)


def run(cmd: list[str], workdir: Path, *, timeout: float = 1200, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout, check=False)
    with open(workdir / "snakemake-runs.log", "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if check:
        assert proc.returncode == 0, f"snakemake failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return proc


def planned_jobs(workdir: Path, *args: str, config: dict | None = None) -> Counter:
    """Jobs a dry run plans in ``workdir``: rule -> count (without ``all``)."""
    proc = run(snakemake_cmd(workdir, "--dry-run", *args, config=config), workdir)
    out = proc.stdout + proc.stderr
    jobs: Counter = Counter()
    if "Job stats:" not in out:
        return jobs
    for line in out.split("Job stats:", 1)[1].splitlines()[3:]:
        fields = line.split()
        if not fields or fields[0] == "total":
            break
        jobs[fields[0]] = int(fields[1])
    jobs.pop("all", None)
    return jobs


def started() -> dt.datetime:
    """Now, less a second, to the second: what :func:`slurm_jobs` takes as the start of a test's jobs."""
    return (dt.datetime.now() - dt.timedelta(seconds=1)).replace(microsecond=0)


def slurm_jobs(workdir: Path, since: dt.datetime) -> list[dict]:
    """SLURM jobs (allocations, not steps) submitted since ``since`` from ``workdir`` (sacct's ``-S`` also lists
    earlier jobs that were still running then, such as the previous test's last one: those are left out)."""
    fields = ["JobIDRaw", "State", "WorkDir", "Comment", "ReqTRES", "AllocTRES", "Timelimit", "ExitCode", "Submit"]
    proc = subprocess.run(
        ["sacct", "-X", "-P", "-n", "-S", since.strftime("%Y-%m-%dT%H:%M:%S"), f"--format={','.join(fields)}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    jobs = []
    for line in proc.stdout.splitlines():
        values = line.split("|")
        if len(values) != len(fields):
            continue
        job = dict(zip(fields, values))
        try:
            submitted = dt.datetime.strptime(job["Submit"], "%Y-%m-%dT%H:%M:%S")
        except ValueError:
            submitted = since
        if Path(job["WorkDir"]).resolve() == workdir.resolve() and submitted >= since:
            jobs.append(job)
    return jobs


def rule_of(comment: str, rules: set[str]) -> str:
    """The rule named by the plugin's job comment ``rule_<name>[_wildcards_...]``."""
    for name in sorted(rules, key=len, reverse=True):
        if comment == f"rule_{name}" or comment.startswith(f"rule_{name}_wildcards_"):
            return name
    raise AssertionError(f"SLURM job comment {comment!r} names none of the rules {sorted(rules)}")


def submitted_resources(log: str) -> dict[str, dict[str, str]]:
    """SLURM job id -> the resources Snakemake printed for the job it submitted as that id."""
    by_snakemake_job: dict[str, dict[str, str]] = {}
    out: dict[str, dict[str, str]] = {}
    current = None
    for line in log.splitlines():
        if m := re.match(r"\s+jobid: (\d+)$", line):
            current = m[1]
        elif (m := re.match(r"\s+resources: (.*)$", line)) and current is not None:
            by_snakemake_job[current] = dict(item.split("=", 1) for item in m[1].split(", ") if "=" in item)
        elif m := re.search(r"Job (\d+) has been submitted with SLURM jobid (\d+)", line):
            out[m[2]] = by_snakemake_job[m[1]]
    return out


def minutes(timelimit: str) -> int:
    """sacct's Timelimit ``[D-]HH:MM:SS`` in minutes."""
    days, _, clock = timelimit.rpartition("-")
    h, m, sec = (int(x) for x in clock.split(":"))
    return (int(days) if days else 0) * 1440 + h * 60 + m + (1 if sec else 0)


def tres(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(",") if "=" in item)


def queued_jobs(workdir: Path) -> list[dict]:
    """Jobs of ``workdir`` that SLURM still holds (squeue: pending, running, completing).

    sacct records a job's comment only when the job ends; squeue shows it at once.
    """
    fields = ["JobIDRaw", "State", "Comment", "WorkDir"]
    proc = subprocess.run(
        ["squeue", "-h", "-o", "%i|%T|%k|%Z"], capture_output=True, text=True, timeout=60, check=True
    )
    jobs = []
    for line in proc.stdout.splitlines():
        values = line.split("|")
        if len(values) == len(fields) and Path(values[3]).resolve() == workdir.resolve():
            jobs.append(dict(zip(fields, values)))
    return jobs


def wait_for_jobs_to_leave_queue(workdir: Path, timeout: float = 120) -> None:
    """Wait until no job of ``workdir`` is pending or running (after a cancel)."""
    deadline = time.monotonic() + timeout
    while queued_jobs(workdir):
        assert time.monotonic() < deadline, f"jobs of {workdir} still queued after {timeout} s"
        time.sleep(1)


def artifacts(workdir: Path) -> dict[str, Path]:
    """Files the workflow wrote under results/ (relative name -> path), plots and hidden files left out."""
    root = workdir / "results"
    return {
        str(p.relative_to(workdir)): p
        for p in root.rglob("*")
        if p.is_file() and not p.name.startswith(".") and "plots" not in p.parts
    }


def h5_datasets(path: Path) -> dict[str, np.ndarray]:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[...]) if isinstance(obj, h5py.Dataset) else None)
    return out


def assert_same_artifact(local: Path, remote: Path) -> None:
    name = local.name
    if name.endswith(".h5"):
        a, b = h5_datasets(local), h5_datasets(remote)
        assert a.keys() == b.keys(), f"{name}: datasets {sorted(a)} != {sorted(b)}"
        for key in a:
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, f"{name}/{key}"
            assert np.array_equal(a[key], b[key]), f"{name}/{key} differs between the local and the SLURM run"
    elif name.endswith((".LMsino", ".raw", ".csr4")):
        assert local.read_bytes() == remote.read_bytes(), f"{name} differs between the local and the SLURM run"


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = os.environ.get("MLEM_SLURM_TMP")
    if root:
        path = Path(root) / f"mlem-slurm-test-{os.getpid()}"
        path.mkdir(parents=True)
        return path
    return tmp_path_factory.mktemp("slurm")


@pytest.fixture(scope="module")
def default_runs(base) -> dict:
    """The default workflow run locally and through SLURM, from the same code."""
    local, remote = base / "local", base / "slurm"
    local.mkdir()
    remote.mkdir()
    planned = planned_jobs(remote)
    run(snakemake_cmd(local), local)
    since = started()
    proc = run(snakemake_cmd(remote, slurm=True), remote)
    return {"local": local, "slurm": remote, "planned": planned, "since": since, "proc": proc}


# --------------------------------------------------------------------- tests


#: Rules the workflow runs in the main process (``localrules``), not as cluster jobs.
LOCAL_RULES = {"summarize"}


def test_every_job_is_a_slurm_job(default_runs):
    """Every job but the local rules' is one SLURM job; the summary runs in the main process."""
    remote, planned = default_runs["slurm"], default_runs["planned"]
    assert planned["run_mlem"] >= 1 and planned["convert_matrix"] == 1 and planned["summarize"] == 1, planned
    planned = Counter({rule: n for rule, n in planned.items() if rule not in LOCAL_RULES})
    jobs = slurm_jobs(remote, default_runs["since"])
    by_rule = Counter(rule_of(job["Comment"], set(planned)) for job in jobs)
    assert by_rule == planned, f"SLURM jobs per rule {dict(by_rule)} != Snakemake jobs {dict(planned)}"
    out = default_runs["proc"].stdout + default_runs["proc"].stderr
    asked = submitted_resources(out)
    sized = 0
    for job in jobs:
        assert job["State"] == "COMPLETED", job
        assert "gres/gpu" not in job["AllocTRES"], f"CPU-only job asked for a GPU: {job}"
        assert int(tres(job["AllocTRES"])["cpu"]) >= 1
        # What the rule's resource functions computed is what SLURM was asked for.
        resources = asked[job["JobIDRaw"]]
        if "mem_mb" in resources and resources["mem_mb"].isdigit():
            assert tres(job["ReqTRES"])["mem"] == f"{resources['mem_mb']}M", (job, resources)
        if "runtime" in resources:
            assert minutes(job["Timelimit"]) == int(resources["runtime"]), (job, resources)
            sized += 1
    # Every rule that reads the matrix has a run time from mlemlib.cluster.
    assert sized >= sum(n for rule, n in planned.items() if rule != "generate_matrix"), asked
    # The main log names one SLURM job per Snakemake job; each left its log.
    assert out.count("has been submitted with SLURM jobid") == sum(planned.values())
    logs = list((remote / "logs" / "slurm").rglob("*.log"))
    assert {p.relative_to(remote / "logs" / "slurm").parts[0] for p in logs} == {f"rule_{r}" for r in planned}
    assert len(logs) == sum(planned.values())


def test_slurm_results_equal_local_results(default_runs):
    local, remote = artifacts(default_runs["local"]), artifacts(default_runs["slurm"])
    assert local.keys() == remote.keys()
    compared = 0
    for name, path in local.items():
        if path.suffix in (".h5", ".LMsino", ".raw"):
            assert_same_artifact(path, remote[name])
            compared += 1
    # matrix, norm, transposes, parts, measurement + truth, reference + run images.
    assert compared >= 10
    with h5py.File(default_runs["local"] / "results/small/matrix.h5") as a, h5py.File(
        default_runs["slurm"] / "results/small/matrix.h5"
    ) as b:
        assert a.attrs["checksum"] == b.attrs["checksum"]
    assert (default_runs["slurm"] / RUN_DIR / "image.h5").is_file()


def _node_gpus() -> tuple[int, str | None]:
    """Most GPUs (GRES gpu) of one node, and their model (type) if SLURM names one."""
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%G"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    best: tuple[int, str | None] = (0, None)
    for m in re.finditer(r"gpu(?::([A-Za-z0-9_.]+))?:(\d+)", out):
        best = max(best, (int(m[2]), m[1]), key=lambda x: x[0])
    return best


def test_gpu_run_is_submitted_with_its_gpus(default_runs):
    count, model = _node_gpus()
    if count < 2:
        pytest.skip("no SLURM node has 2 GPUs (tools/slurm/start.sh gives 2 fake ones where mknod works)")
    remote = default_runs["slurm"]
    config = default_config()
    config["use_gpu"] = True
    config["runs"] = [{"backend": "cuda", "fp": "csr_vector", "bp": "csr_vector", "gpus": 2, "layout": "local"}]
    target = "results/small/runs/nema-seed1/cuda-csr_vector-csr_vector-it20-rep3-ck10/gpus-2-local/image.h5"
    # the kernels' warm-up as done (a GPU job of its own, tried elsewhere): only the run is submitted here
    warm = remote / "results" / "kernels" / f"{config.get('name', 'default')}.json"
    warm.parent.mkdir(parents=True, exist_ok=True)
    warm.write_text("{}\n")
    # planned here as on the cluster (its GPUs are on the nodes: the dry run on this host is told how many)
    assert planned_jobs(remote, target, "--resources", "gpu=2", config=config) == Counter(run_mlem=1), \
        "upstream would be recomputed"
    since = started()
    cmd = snakemake_cmd(
        remote,
        target,
        "--set-resources",
        *([f"run_mlem:gpu_model={model}"] if model else []),
        "run_mlem:cpus_per_gpu=1",
        config=config,
        slurm=True,
    )
    proc = run(cmd, remote, check=False)
    jobs = slurm_jobs(remote, since)
    assert len(jobs) == 1, jobs
    job = jobs[0]
    assert rule_of(job["Comment"], {"run_mlem"}) == "run_mlem"
    alloc = tres(job["AllocTRES"])
    assert alloc.get("gres/gpu") == "2", f"the GPU run did not get its 2 GPUs: {job}"
    assert alloc["cpu"] == "2", f"1 CPU per GPU expected: {job}"
    if model == "fake":
        # tools/slurm/start.sh's GPUs are device nodes of /dev/null: the job must
        # fail (no CUDA), and Snakemake must report it, not take it as done.
        assert job["State"] == "FAILED", job
        assert proc.returncode != 0
        assert not (remote / target).exists()
    else:  # real GPUs: the run either works or fails, and Snakemake agrees
        assert (job["State"] == "COMPLETED") == (proc.returncode == 0) == (remote / target).exists(), job


def test_summary_with_runs_left_out_runs_in_the_main_process(default_runs):
    """``--resources gpu=1`` leaves a 2-GPU run out; the summary (a local rule) is made in the main process, which
    decided that, from the runs that exist. As a SLURM job it would parse the workflow without --resources (Snakemake
    does not pass it on) and wait for the left-out run's image."""
    remote = default_runs["slurm"]
    config = default_config()
    config["use_gpu"] = True
    config["bench"]["spmv"] = False
    cpu_runs = [run for run in config["runs"] if run["backend"] == "cpu"]
    config["runs"] = [*cpu_runs, {"backend": "cuda", "fp": "csr_vector", "bp": "csr_vector", "gpus": 2}]
    since = started()
    proc = run(snakemake_cmd(remote, "--resources", "gpu=1", "--forcerun", "summarize", "--until", "summarize",
                             config=config, slurm=True), remote)
    out = proc.stdout + proc.stderr
    assert "runs left out, 1 (they need more GPUs than --resources gpu=1" in out, out[-3000:]
    assert slurm_jobs(remote, since) == [], "the summary went to SLURM"
    runs = (remote / "results" / "summary" / "default" / "runs.csv").read_text()
    assert "cuda" not in runs and "cpu" in runs, runs


def test_scancel_then_rerun_resumes_from_checkpoint(default_runs, base):
    remote = default_runs["slurm"]
    config = default_config()
    config["mlem"] = {"iterations": 15000, "checkpoint_every": 1000, "repetitions": 1, "reference": False}
    config["runs"] = [{"backend": "cpu", "fp": "auto", "bp": "auto"}]
    target = f"{LONG_RUN_DIR}/image.h5"
    run_dir = remote / LONG_RUN_DIR
    checkpoint = run_dir / "checkpoint.h5"
    upstream = {p: p.stat().st_mtime_ns for p in artifacts(remote).values() if run_dir not in p.parents}
    assert len(upstream) >= 8
    assert planned_jobs(remote, target, config=config) == Counter(run_mlem=1)

    since = started()
    cmd = snakemake_cmd(remote, target, config=config, slurm=True)
    with open(remote / "interrupted.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=remote, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 600
            while not checkpoint.exists():
                assert proc.poll() is None, "snakemake ended before the first checkpoint"
                assert time.monotonic() < deadline, "no checkpoint after 600 s"
                time.sleep(0.2)
            running = [j for j in queued_jobs(remote) if j["State"] == "RUNNING"]
            assert len(running) == 1 and rule_of(running[0]["Comment"], {"run_mlem"}) == "run_mlem", running
            subprocess.run(["scancel", running[0]["JobIDRaw"]], check=True, timeout=60)
            # Snakemake must notice the cancelled job (not wait for it forever)
            # and report it failed, not take it as done.
            assert proc.wait(timeout=600) != 0, "snakemake took the cancelled job as done"
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    wait_for_jobs_to_leave_queue(remote)
    (cancelled,) = slurm_jobs(remote, since)
    assert cancelled["State"].startswith("CANCELLED"), cancelled
    # Nothing of the killed job is left under a final name; the checkpoint is kept.
    assert checkpoint.is_file()
    for name in ("image.h5", "image.raw", "timings.json"):
        assert not (run_dir / name).exists(), f"{name} of the cancelled job was left behind"
    with h5py.File(checkpoint) as f:
        saved = {k: f.attrs[k] for k in f.attrs}
    saved_iteration = int(saved["iteration"])
    assert 1000 <= saved_iteration < 15000 and saved_iteration % 1000 == 0, saved

    since = started()
    run(cmd, remote)
    rerun = slurm_jobs(remote, since)
    assert [rule_of(j["Comment"], {"run_mlem"}) for j in rerun] == ["run_mlem"], rerun
    assert rerun[0]["State"] == "COMPLETED"
    mlem_log = (remote / "logs/mlem/small/nema-seed1/cpu-auto-auto-it15000-rep1-ck1000-gpus-1-local.log").read_text()
    assert "resuming from" in mlem_log and f"iteration {saved_iteration}" in mlem_log, mlem_log[-3000:]
    assert not checkpoint.exists(), "the checkpoint outlived the finished run"
    changed = [str(p) for p, mtime in upstream.items() if p.stat().st_mtime_ns != mtime]
    assert not changed, f"upstream artifacts were recomputed: {changed}"

    # The same run, uninterrupted, on this machine (its upstream is already there).
    local = default_runs["local"]
    run(snakemake_cmd(local, target, config=config), local)
    resumed = h5_datasets(run_dir / "image.h5")
    straight = h5_datasets(local / LONG_RUN_DIR / "image.h5")
    assert resumed.keys() == straight.keys()
    for key in straight:
        assert np.array_equal(resumed[key], straight[key]), f"resumed {key} differs from the uninterrupted run"
    assert (run_dir / "image.raw").read_bytes() == (local / LONG_RUN_DIR / "image.raw").read_bytes()
