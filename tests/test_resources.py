"""What each stage needs, and the refusal of runs the node cannot hold (mlemlib.cluster, rules/common.smk).

Unit tests of the model and the check with fake limits, and dry runs of the
workflow (config/thesis-matrix3.yaml and the default) against fake nodes:
before any job, one line naming the stage and the shortfall.
"""

from __future__ import annotations

import math
import os
from collections import Counter
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mlemlib import cluster
from mlemlib.cluster import MatrixSize, NodeLimits, StageNeed, detect_node, shortfalls, stage_need

REPO = Path(__file__).resolve().parents[1]
GB = 10**9

#: Matrix 3 as the preset estimates it.
M3 = MatrixSize(rows=5_308_416, cols=2_592_000, nnz=12_366_460_674)


def test_matrix_bytes_per_format():
    assert cluster.matrix_bytes(M3, "csr") == M3.csr_bytes
    assert 98 * GB < M3.csr_bytes < 100 * GB
    assert 62 * GB < cluster.matrix_bytes(M3, "compressed") < 64 * GB
    with pytest.raises(Exception, match="unknown matrix format"):
        cluster.matrix_bytes(M3, "zip")


def test_gpu_memory_follows_the_device_format_and_the_transpose():
    csr = cluster.estimate_gpu_mem_mb(M3, parts=1, stored_transpose=False)
    cmp = cluster.estimate_gpu_mem_mb(M3, parts=1, stored_transpose=False, fmt="compressed")
    both = cluster.estimate_gpu_mem_mb(M3, parts=1, stored_transpose=True)
    two = cluster.estimate_gpu_mem_mb(M3, parts=2, stored_transpose=False)
    assert 99_000 < csr * 1.048576 < 104_000 < both * 1.048576 / 1.9  # MB -> 10^6 bytes
    assert cmp < 0.65 * csr and two < 0.52 * csr


def test_generated_size_of_matrix3_is_at_least_its_estimate():
    size = cluster.generated_size("matrix3")
    assert (size.rows, size.cols) == (M3.rows, M3.cols)
    assert M3.nnz < size.nnz <= 1.03 * M3.nnz
    # the statement's size: the recorded non-zeros plus 2% (madpet2's are exact: 960,942,960)
    assert cluster.preset_size("matrix3") == size
    assert cluster.preset_size("madpet2").nnz == math.ceil(960_942_960 * 1.02)


def test_partition_by_reference_needs_only_the_row_pointers():
    plain = cluster.peak_host_bytes("partition", M3, parts=2, stored_transpose=False)
    assert plain == 2 * 8 * M3.rows + 8 * M3.cols  # no chunk of the matrix at all
    assert cluster.peak_host_bytes("partition", M3, parts=2, stored_transpose=True) > plain


def _need(**kw) -> StageNeed:
    base = dict(stage="run_mlem", label="m, 1 GPU", disk_bytes=0, host_bytes=GB, gpu_bytes=0, gpus=0, mem_mb=1024)
    base.update(kw)
    return StageNeed(**base)


def test_shortfalls_name_the_stage_and_the_amount():
    node = NodeLimits(disk_free_bytes=10 * GB, host_bytes=8 * GB, gpu_bytes=80 * GB, gpus=2, sources={})
    ok = [_need(disk_bytes=4 * GB), _need(disk_bytes=5 * GB, gpus=2, gpu_bytes=70 * GB)]
    assert shortfalls(ok, node) == []
    # disk: cumulative over the stages still to run; done ones need nothing new
    disk = [_need(stage="a", disk_bytes=6 * GB), _need(stage="b", disk_bytes=6 * GB), _need(stage="c", disk_bytes=1)]
    (line,) = shortfalls(disk, node)
    assert line.startswith("stage b (m, 1 GPU) writes 6.0 GB") and "short by 2.0 GB" in line
    assert shortfalls([_need(stage="a", disk_bytes=6 * GB, done=True)] + disk[1:], node) == []
    (line,) = shortfalls([_need(host_bytes=9 * GB)], node)
    assert line == "stage run_mlem (m, 1 GPU) needs 9.0 GB of host memory, the node has 8.0 GB (short by 1.0 GB)"
    (line,) = shortfalls([_need(gpus=1, gpu_bytes=100 * GB)], node)
    assert "needs 100.0 GB of GPU memory per GPU, the node's GPUs have 80.0 GB (short by 20.0 GB)" in line
    assert shortfalls([_need(gpus=4, gpu_bytes=1)], node) == ["stage run_mlem (m, 1 GPU) needs 4 GPUs, the node has 2"]
    # a scheduler: the job's request must fit the node; --resources limits
    assert "asks for mem_mb=9000" in shortfalls([_need(mem_mb=9000)], node, scheduler=True)[0]
    node2 = NodeLimits(slurm_mem_mb=500, slurm_gpus=1, sources={})
    lines = shortfalls([_need(mem_mb=1024, gpus=2, gpu_bytes=1)], node2)
    assert any("--resources gives mem_mb=500" in x for x in lines) and any("gpu=1" in x for x in lines)
    # unknown limits are not checked
    assert shortfalls([_need(host_bytes=10**15, gpus=9, gpu_bytes=10**15)], NodeLimits(sources={})) == []


def test_detect_node_config_wins_and_meminfo_is_parsed(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       263921592 kB\nMemFree:        1 kB\n")
    assert cluster.host_memory_bytes(meminfo) == 263921592 * 1024
    assert cluster.host_memory_bytes(tmp_path / "none") is None
    monkeypatch.setattr(cluster, "gpu_facts", lambda: (None, None))
    node = detect_node(tmp_path / "not" / "yet", host_memory_gb=256, gpu_memory_gb="auto", gpus=2, disk_free_gb="auto")
    assert node.host_bytes == 256 * GB and node.gpus == 2 and node.gpu_bytes is None
    assert node.disk_free_bytes > 0  # of the nearest existing parent
    assert node.sources == {"disk": "detected", "host memory": "config", "GPU memory": "unknown", "GPUs": "config"}


def test_stage_need_of_a_gpu_run():
    need = stage_need("mlem", "run_mlem", "m3", M3, disk_bytes=0, backend="cuda", gpus=2, parts=2,
                      stored_transpose=False)
    assert need.gpus == 2 and 50 * GB < need.gpu_bytes < 54 * GB
    cpu = stage_need("norm", "compute_norm", "m3", M3, disk_bytes=8 * M3.cols)
    assert cpu.gpus == 0 and cpu.gpu_bytes == 0 and cpu.host_bytes < 3 * GB


# --------------------------------------------------------------------------- the workflow, dry runs

#: The node of the issue: 2 H200 (141 GB), 256 GB host memory, 128 GB disk.
H200_NODE = {"check": True, "disk_free_gb": 128, "host_memory_gb": 256, "gpu_memory_gb": 141, "gpus": 2}


def dry_run(tmp_path: Path, config: dict, *args: str, gpus: int = 2) -> subprocess.CompletedProcess:
    """A dry run of ``config`` in ``tmp_path`` on a machine that shows ``gpus`` GPUs ($MLEM_NUM_GPUS: the fake
    node's, so that use_gpu: true plans its GPU jobs here)."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [
        sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
        "--configfile", str(path), "--dry-run", "--cores", "32", *args,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), MLEM_NUM_GPUS=str(gpus))
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)


def matrix3_config(**node) -> dict:
    config = yaml.safe_load((REPO / "config/thesis-matrix3.yaml").read_text())
    config["use_gpu"] = True
    config["node"] = dict(H200_NODE, **node)
    return config


def test_thesis_matrix3_fits_the_h200_node(tmp_path):
    proc = dry_run(tmp_path, matrix3_config(), "--resources", "gpu=2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for rule in ("generate_container", "compute_norm", "partition_matrix", "simulate_measurement", "summarize"):
        assert f"rule {rule}:" in out, rule
    for rule in ("generate_matrix", "convert_matrix", "transpose_matrix", "reference_mlem", "bench_spmv"):
        assert f"rule {rule}:" not in out, rule
    assert out.count("rule run_mlem:") == 8  # 2 matrices x onepass_fixed and onepass, each on 1 and 2 GPUs
    assert "results/matrix3/transpose.h5" not in out and "part-0.h5" not in out
    # the table: every stage, sized from the preset's estimate, folded (each LOR once: half the unfolded 63.7 GB)
    assert "generate_container    matrix3, compressed" in out and "31.9 GB" in out
    assert "generate_container    matrix3u16, compressed-u16" in out and "19.3 GB" in out
    assert "node: disk free 128.0 GB (config)" in out


@pytest.mark.parametrize(
    ("node", "line"),
    [
        ({"gpu_memory_gb": 30}, "resources: stage run_mlem (matrix3, nema-seed1, cuda-auto-onepass_fixed on 1 GPU) needs "
         "33.0 GB of GPU memory per GPU, the node's GPUs have 30.0 GB (short by 3.0 GB)"),
        ({"disk_free_gb": 30}, "resources: stage generate_container (matrix3, compressed) writes 31.9 GB, and the "
         "stages up to it 31.9 GB; the disk has 30.0 GB free (short by 1.9 GB)"),
        # The compressed container streams to the GPUs piece by piece: a run needs 3.2 GB, the generator
        # (four chunks in flight, one accumulator per thread) 2.6 GB; the first job short of memory is named.
        ({"host_memory_gb": 3}, "resources: stage run_mlem (matrix3, nema-seed1, cuda-auto-onepass_fixed on 1 GPU) "
         "needs 3.2 GB of host memory, the node has 3.0 GB (short by 230.2 MB)"),
        ({"host_memory_gb": 2.5}, "resources: stage generate_container (matrix3, compressed) needs 2.6 GB of host "
         "memory, the node has 2.5 GB (short by 68.3 MB)"),
    ],
)
def test_thesis_matrix3_refused_on_a_smaller_node(tmp_path, node, line):
    proc = dry_run(tmp_path, matrix3_config(**node))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert line in out.splitlines(), out[-3000:]
    _before_any_job(out)


def test_check_false_only_logs(tmp_path):
    proc = dry_run(tmp_path, matrix3_config(gpu_memory_gb=30, check=False))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "resources (not checked, node.check: false): stage run_mlem" in out


def _job_count(out: str, rule: str) -> int:
    return out.count(f"rule {rule}:")


def _before_any_job(out: str) -> None:
    """The check ran on Snakemake's DAG (built, not run): no job planned or started, the refusal the last line."""
    assert "Building DAG of jobs" in out and "Job stats" not in out, out[-3000:]
    assert not any(x.startswith(("rule ", "checkpoint ", "localrule ")) for x in out.splitlines()), out[-3000:]
    assert out.rstrip().splitlines()[-1].startswith("resources: "), out[-3000:]


def _no_traceback(out: str) -> None:
    assert "Traceback" not in out and "WorkflowError" not in out and "common.smk" not in out, out


#: The runs of thesis-matrix3.yaml on 2 GPUs (each of them on both matrices).
MATRIX3_ON_2 = "cuda-auto-onepass_fixed on 2 GPUs local, cuda-auto-onepass on 2 GPUs local"


@pytest.mark.parametrize(
    ("node", "args", "why"),
    [({}, ("--resources", "gpu=1"), "--resources gpu=1"), ({"gpus": 1}, (), "node.gpus: 1")],
)
def test_runs_on_more_gpus_than_given_are_left_out_in_one_line(tmp_path, node, args, why):
    proc = dry_run(tmp_path, matrix3_config(**node), *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    (line,) = [x for x in out.splitlines() if x.startswith("runs left out")]
    assert line == f"runs left out, 2 (they need more GPUs than {why}; gpu_runs: all keeps them): " + MATRIX3_ON_2
    assert _job_count(out, "run_mlem") == 4  # the 1-GPU runs, both matrices
    assert "on 2 GPUs" not in out.split("what each job needs", 1)[1]


@pytest.mark.parametrize(
    ("node", "args", "line"),
    [
        ({}, ("--resources", "gpu=1"), "resources: stage run_mlem (matrix3, nema-seed1, cuda-auto-onepass_fixed on 2 "
         "GPUs, local) needs 2 GPUs, --resources gives gpu=1"),
        ({"gpus": 1}, (), "resources: stage run_mlem (matrix3, nema-seed1, cuda-auto-onepass_fixed on 2 GPUs, local) "
         "needs 2 GPUs, the node has 1"),
    ],
)
def test_gpu_runs_all_keeps_them_and_the_check_refuses_in_one_line(tmp_path, node, args, line):
    config = matrix3_config(**node)
    config["gpu_runs"] = "all"
    proc = dry_run(tmp_path, config, *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert line in out.splitlines(), out[-3000:]
    assert "runs left out" not in out
    _before_any_job(out)
    _no_traceback(out)


def test_thesis_config_on_a_4_gpu_node_leaves_out_its_8_gpu_runs(tmp_path):
    config = yaml.safe_load((REPO / "config/thesis.yaml").read_text())
    proc = dry_run(tmp_path, config, "--resources", "gpu=4")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    _no_traceback(out)
    (line,) = [x for x in out.splitlines() if x.startswith("runs left out")]
    assert line.startswith("runs left out, 10 (they need more GPUs than --resources gpu=4; gpu_runs: all keeps them): "
                           "cuda-csr_vector-csr_vector-nograph on 8 GPUs local, cuda-csr_vector-csr_vector-nograph on 8 GPUs "
                           "thesis, ")
    assert line.count(" on 8 GPUs ") == 10
    planned = out.split("what each job needs", 1)[1]
    assert " on 4 GPUs, thesis" in planned and " on 8 GPUs" not in planned


def test_the_check_sizes_every_job_of_the_dag(tmp_path):
    """The resource check sizes the jobs of the DAG Snakemake built: each rule as often as in its Job stats."""
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config.update(use_gpu=True, reorder="none", node=dict(H200_NODE, check=False))
    config["matrices"]["other"] = {"preset": "small", "format": "compressed"}
    config["simulation"]["seeds"] = [1, 2]
    config["transpose"]["compare"] = ["scipy", "cusparse"]
    config["runs"] = [
        {"backend": "cpu", "fp": "auto", "bp": "auto"},
        {"backend": "cuda", "fp": "auto", "bp": "auto", "gpus": [1, 2], "layout": ["local"]},
        {"backend": "cuda", "bp": "onepass_chunked", "gpus": [1, 2]},
    ]
    proc = dry_run(tmp_path, config)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    sized = Counter()
    for line in out.split("what each job needs", 1)[1].split("still to write", 1)[0].splitlines()[2:]:
        sized[line.split()[0]] += 1
    dag = Counter()
    for line in out.split("Job stats:", 1)[1].split("total", 1)[0].splitlines()[3:]:
        rule, count = line.split()
        dag[rule] = int(count)
    del dag["all"], dag["summarize"]
    assert {"generate_matrix", "chunk_matrix", "compare_transpose", "partition_matrix", "bench_spmv"} <= set(sized)
    assert sized == dag


def test_upload_piece_matches_the_uploader():
    """The host-memory model's piece is the size the compressed uploader reads (no CuPy needed to import it)."""
    from mlemlib.backends import _compressed_cuda

    assert cluster.UPLOAD_PIECE_SLOTS == _compressed_cuda.UPLOAD_CHUNK_NNZ


def test_compressed_container_streams_to_the_gpus():
    """A compressed container reaches the GPUs piece by piece; a CSR file one row block per GPU."""
    csr = cluster.peak_host_bytes("mlem", M3, parts=2, backend="cuda", stored_transpose=False)
    comp = cluster.peak_host_bytes(
        "mlem", M3, parts=2, backend="cuda", stored_transpose=False, source_format="compressed"
    )
    assert csr > M3.csr_bytes / 2  # half of A passes through host memory
    # two pieces of 2^26 slots at 13 bytes, two row pointers and the vectors
    vectors = 4 * 8 * (M3.rows + M3.cols)
    assert comp == 2 * 13 * (1 << 26) + 2 * 8 * M3.rows + vectors
    # a compressed run that reads a stored transpose still takes whole blocks
    assert cluster.peak_host_bytes(
        "mlem", M3, parts=2, backend="cuda", stored_transpose=True, source_format="compressed"
    ) > M3.csr_bytes
