"""tools/device_workflow/check_leases.py: the lease checker of the device demonstration (no GPU needed).

Hand-made job logs check its verdicts (leases held at the same time on
disjoint GPUs pass, on a shared GPU fail, one after the other on the same
GPU pass); real processes leasing simulated GPUs through
:mod:`mlemlib.dist.lease` check that it parses what the library logs, so the
two cannot drift apart unnoticed.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml
from conftest import load_device_tool

from mlemlib.dist import lease as L
from mlemlib.logs import LOG_FORMAT

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "device_workflow"


C = load_device_tool("check_leases")


def line(clock: str, message: str, logger: str = "mlemlib.dist.lease") -> str:
    """One log line as mlemlib.logs.LOG_FORMAT writes it, at 2026-11-23 ``clock``."""
    return f"2026-11-23 {clock} INFO {logger}: {message}"


def job_log(lease_at: str, release_at: str, devices: str, pci: str | None = None, pid: int = 100) -> str:
    """The text of a job log that held ``devices`` from ``lease_at`` to ``release_at``."""
    where = f"PCI {pci}; " if pci else ""
    return "\n".join(
        [
            line(lease_at, f"leased GPU(s) {devices} ({where}pid {pid}; lock dir /tmp/locks)"),
            line(lease_at, "loaded problem abc: 10 x 10, 20 nnz (0.01 s)", "mlemlib.mlem"),
            line(release_at, f"releasing GPU lease {devices}"),
            line(release_at, "run_mlem: wrote image.h5", "root"),
        ]
    )


def verdict(*logs: str, **options) -> C.Report:
    leases = [lease for i, text in enumerate(logs) for lease in C.parse_log(text, f"job{i}.log")]
    return C.check(leases, **options)


# --- verdicts on hand-made logs ------------------------------------------------


def test_overlapping_leases_on_disjoint_gpus_pass():
    report = verdict(job_log("10:00:00,000", "10:00:10,000", "0,1"), job_log("10:00:01,000", "10:00:09,000", "2,3"))
    assert report.status == C.EXIT_PASS, report.text
    assert "| job0.log | job1.log | 8.000 | none | disjoint |" in report.text
    assert report.text.splitlines()[-1].startswith("PASS: 1 pair(s)")


def test_overlapping_leases_sharing_a_gpu_fail():
    report = verdict(job_log("10:00:00,000", "10:00:10,000", "0,1"), job_log("10:00:05,000", "10:00:15,000", "1,2"))
    assert report.status == C.EXIT_FAIL
    assert report.failures == ["job0.log and job1.log held 1 at the same time"]
    assert "SHARED" in report.text and report.text.splitlines()[-1].startswith("FAIL: ")


def test_sequential_leases_of_the_same_gpus_pass():
    report = verdict(job_log("10:00:00,000", "10:00:10,000", "0,1"), job_log("10:00:10,500", "10:00:20,000", "0,1"))
    assert report.status == C.EXIT_PASS, report.text
    assert "(none: every lease was held alone)" in report.text
    assert C.max_concurrent(C.parse_log(job_log("10:00:00,000", "10:00:10,000", "0"), "a")) == 1


def test_hand_over_in_the_same_millisecond_is_no_overlap():
    report = verdict(job_log("10:00:00,000", "10:00:10,000", "0"), job_log("10:00:10,000", "10:00:20,000", "0"))
    assert report.status == C.EXIT_PASS, report.text


def test_pci_bus_ids_decide_over_entries():
    # Two numberings of one GPU (entries 0 and 1, one PCI bus id): shared.
    report = verdict(
        job_log("10:00:00,000", "10:00:10,000", "0", pci="00000000:18:00.0"),
        job_log("10:00:01,000", "10:00:09,000", "1", pci="0000:18:00.0"),
    )
    assert report.status == C.EXIT_FAIL
    assert report.failures == ["job0.log and job1.log held 0000:18:00.0 at the same time"]


def test_waiting_job_and_unreleased_lease_are_reported():
    waited = "\n".join([line("10:00:00,100", "waiting for 1 free GPU(s); busy: 0"), job_log("10:00:05,000", "10:00:06,000", "0")])
    killed = "\n".join(
        [
            line("10:00:00,000", "leased GPU(s) 0 (lock dir /tmp/locks)"),  # an older log: no pid
            line("10:00:04,000", "iteration 9", "mlemlib.mlem"),
            "Traceback ...",
        ]
    )
    leases = C.parse_log(waited, "w.log") + C.parse_log(killed, "k.log")
    assert [(x.waited, x.released) for x in leases] == [(True, True), (False, False)]
    assert leases[1].end.second == 4 and leases[1].pid is None
    report = C.check(leases)
    assert report.status == C.EXIT_PASS, report.text
    assert "| yes, 4.900 s |" in report.text and "(no release logged)" in report.text


def test_common_folder_of_the_job_names():
    assert C.common_folder(["mlem/small/a.log", "mlem/small/b.log"]) == "mlem/small/"
    assert C.common_folder(["mlem/small/a.log", "mlem/big/b.log"]) == "mlem/"
    assert C.common_folder(["a.log", "mlem/b.log"]) == ""
    assert C.common_folder(["mlem/a.log"]) == "mlem/"


def test_concurrency_and_job_count_expectations():
    together = (job_log("10:00:00,000", "10:00:10,000", "0"), job_log("10:00:01,000", "10:00:09,000", "1"))
    assert verdict(*together, min_concurrent=2, jobs=2).status == C.EXIT_PASS
    assert verdict(*together, max_concurrent_allowed=1).failures == ["2 leases held at once, expected at most 1"]
    assert verdict(*together, jobs=3).failures == ["2 lease(s) found, expected 3"]
    alone = (job_log("10:00:00,000", "10:00:01,000", "0"), job_log("10:00:02,000", "10:00:03,000", "1"))
    assert verdict(*alone, min_concurrent=2).failures == ["at most 1 lease(s) held at once, expected at least 2"]
    assert verdict(*alone, min_waited=1).failures == ["0 job(s) waited for free GPUs, expected at least 1"]


def test_driver_view_must_stay_inside_the_lease():
    logs = (
        job_log("10:00:00,000", "10:00:10,000", "0", pci="00000000:18:00.0", pid=11),
        job_log("10:00:01,000", "10:00:09,000", "1", pci="00000000:2A:00.0", pid=12),
    )
    apps = C.parse_apps("pid, gpu_bus_id\n11, 00000000:18:00.0\n12, 00000000:2A:00.0\n99, 00000000:2A:00.0\n[N/A], x\n")
    assert apps == {11: {"0000:18:00.0"}, 12: {"0000:2a:00.0"}, 99: {"0000:2a:00.0"}}
    report = verdict(*logs, apps=apps)
    assert report.status == C.EXIT_PASS, report.text
    assert "2 of 2 job process(es) seen by the driver, each only on its leased GPUs" in report.text
    assert "| 0000:18:00.0 |" in report.text and "Other processes seen on GPUs: pid 99 on 0000:2a:00.0." in report.text
    apps[11].add("0000:2a:00.0")
    assert verdict(*logs, apps=apps).failures == ["job0.log: pid 11 seen on 0000:2a:00.0, outside its lease"]


def test_command_line_exit_statuses(tmp_path, capsys):
    (tmp_path / "logs" / "mlem").mkdir(parents=True)
    (tmp_path / "logs" / "mlem" / "a.log").write_text(job_log("10:00:00,000", "10:00:10,000", "0,1"))
    (tmp_path / "logs" / "mlem" / "b.log").write_text(job_log("10:00:02,000", "10:00:08,000", "2,3"))
    (tmp_path / "logs" / "transpose.log").write_text(line("09:59:00,000", "wrote transpose.h5", "mlemlib.transpose"))
    assert C.main([str(tmp_path / "logs"), "--min-concurrent", "2", "--jobs", "2"]) == C.EXIT_PASS
    out = capsys.readouterr().out
    assert "job log(s) under mlem/;" in out and "| a.log | 0,1 |" in out and "Logs without a lease: 1." in out
    (tmp_path / "logs" / "mlem" / "b.log").write_text(job_log("10:00:02,000", "10:00:08,000", "1,2"))
    assert C.main([str(tmp_path / "logs")]) == C.EXIT_FAIL
    empty = tmp_path / "empty"
    empty.mkdir()
    assert C.main([str(empty)]) == C.EXIT_INPUT
    assert C.main([str(tmp_path / "logs" / "transpose.log")]) == C.EXIT_INPUT
    assert C.main([str(tmp_path / "missing")]) == C.EXIT_INPUT
    assert "check_leases: error: " in capsys.readouterr().err


# --- what mlemlib.dist.lease really logs ------------------------------------------

HOLDER = """
import sys, time
from mlemlib.logs import send_to_log
send_to_log(sys.argv[1])
from mlemlib.dist.lease import lease_gpus
with lease_gpus(int(sys.argv[2]), timeout=30):
    time.sleep(float(sys.argv[3]))
"""


@pytest.mark.parametrize("gpus, expect_together", [(2, 2), (1, 1)])
def test_real_lease_logs_parse(tmp_path, gpus, expect_together):
    """Two processes that lease 1 GPU each at once: together on 2 GPUs, one after the other on 1."""
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "MLEM_NUM_GPUS": str(gpus),
        "MLEM_LOCK_DIR": str(tmp_path / "locks"),
    }
    logs = [tmp_path / f"job{i}.log" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER, str(log), "1", "2"], env=env) for log in logs]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    leases = [lease for log in logs for lease in C.parse_log(log.read_text(), log.name)]
    assert len(leases) == 2 and all(x.released and x.pid for x in leases)
    assert sorted(x.pid for x in leases) == sorted(p.pid for p in procs)
    report = C.check(
        leases, min_concurrent=expect_together, max_concurrent_allowed=expect_together, jobs=2, min_waited=2 - expect_together
    )
    assert report.status == C.EXIT_PASS, report.text
    assert sum(x.waited for x in leases) == (1 if gpus == 1 else 0)


def test_lease_log_names_pci_bus_ids(gpus_with_nvml, caplog):
    caplog.set_level(logging.INFO, logger="mlemlib.dist.lease")
    with L.acquire(2):
        pass
    text = "\n".join(logging.Formatter(LOG_FORMAT).format(r) for r in caplog.records)
    (lease,) = C.parse_log(text, "job.log")
    assert lease.devices == ("0", "1") and lease.pci == ("0000:18:00.0", "0000:2a:00.0")
    assert lease.released


@pytest.fixture
def gpus_with_nvml(tmp_path, monkeypatch):
    """Two GPUs known to a stand-in NVML by UUID and PCI bus id."""
    bus = {"GPU-aaaa": b"00000000:18:00.0", "GPU-bbbb": "00000000:2A:00.0"}
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: uuid,
        nvmlDeviceGetPciInfo=lambda handle: types.SimpleNamespace(busId=bus[handle]),
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(L, "_nvml_uuids", lambda: list(bus))
    monkeypatch.setenv("MLEM_LOCK_DIR", str(tmp_path / "locks"))
    for name in ("MLEM_NUM_GPUS", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(name, raising=False)


# --- the demonstration's configs -------------------------------------------------


@pytest.mark.parametrize("name", ["one-gpu.yaml", "two-gpu.yaml"])
def test_configs_are_valid_cuda_only_and_long(name):
    jsonschema = pytest.importorskip("jsonschema")
    config = yaml.safe_load((TOOL / name).read_text())
    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    jsonschema.validate(config, schema)
    assert {run["backend"] for run in config["runs"]} == {"cuda"}
    assert config["bench"]["spmv"] is False and config["mlem"]["reference"] is False
    assert config["mlem"]["iterations"] * config["mlem"]["repetitions"] >= 10_000


@pytest.mark.parametrize("name, runs, gpus", [("one-gpu.yaml", 4, 1), ("two-gpu.yaml", 2, 2)])
def test_configs_plan_the_gpu_runs(tmp_path, name, runs, gpus):
    """A dry run (as on a GPU machine: use_gpu=true) plans the runs, each asking for its GPUs."""
    cmd = [
        sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
        "--configfile", str(TOOL / name), "--config", "use_gpu=true", "--dry-run", "--cores", "4",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLEM_NUM_GPUS": str(gpus)}  # the GPU machine's GPUs
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("rule run_mlem:") == runs
    assert out.count("checkpoint warm_kernels:") == 1  # one GPU, before the runs
    assert out.count(f"gpu={gpus}") == runs + (1 if gpus == 1 else 0)
    assert "rule reference_mlem:" not in out and "rule bench_spmv:" not in out


def test_madpet2_config_plans_every_stage_and_six_runs(tmp_path):
    """The thesis-scale scenario: valid, every stage, 1 and 2 GPUs x layouts x graph (6 runs, 4 of them on 2 GPUs)."""
    jsonschema = pytest.importorskip("jsonschema")
    config = yaml.safe_load((TOOL / "madpet2.yaml").read_text())
    jsonschema.validate(config, yaml.safe_load((REPO / "config" / "schema.yaml").read_text()))
    assert config["matrices"] == {"madpet2": {"preset": "madpet2"}} and config["mlem"]["reference"] is False
    cmd = [
        sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
        "--configfile", str(TOOL / "madpet2.yaml"), "--config", "use_gpu=true", "--dry-run", "--cores", "4",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLEM_NUM_GPUS": "2"}  # the GPU machine's GPUs
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for rule in ("generate_matrix", "convert_matrix", "compute_norm", "transpose_matrix", "partition_matrix", "summarize"):
        assert f"rule {rule}:" in out, rule
    assert out.count("rule run_mlem:") == 6
    assert out.count("gpu=2") == 4


def test_wheel_pins_match_the_installed_snakemake():
    """The wheels carried to GPU nodes are the Snakemake the tests run with (one version per package)."""
    from importlib.metadata import version

    text = (Path(__file__).resolve().parents[1] / "tools" / "device_workflow" / "wheels.txt").read_text()
    pins = dict(line.strip().split("==") for line in text.splitlines() if line.strip() and not line.startswith("#"))
    assert pins["snakemake"] == version("snakemake")
    assert len(pins) == len([ln for ln in text.splitlines() if "==" in ln])  # no package pinned twice
