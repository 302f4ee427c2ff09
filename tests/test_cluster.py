"""Tests of mlemlib.cluster (resource estimates sized from the matrix), of the
pinned conda environments envs/*.yaml and of the SLURM profile's structure.

The conda environments cannot be built here (no conda, no conda-forge), so
their YAML is checked for structure and exact pins instead.
"""

from __future__ import annotations

import math
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import scipy.sparse
import yaml

from mlemlib import cluster
from mlemlib.cluster import (
    MatrixSize,
    estimate_mem_mb,
    estimate_runtime_min,
    matrix_size,
)
from mlemlib.errors import ConfigError, MatrixFormatError
from mlemlib.matrix import CSRMatrix

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20


def _random_csr(rng, m: int, n: int, density: float = 0.2) -> scipy.sparse.csr_matrix:
    a = scipy.sparse.random(m, n, density=density, format="csr", random_state=rng, dtype=np.float32)
    a.data += 0.5  # no explicit zeros
    return a


def _to_csr_matrix(a: scipy.sparse.csr_matrix) -> CSRMatrix:
    return CSRMatrix(
        a.indptr.astype(np.int64), a.indices.astype(np.int32), a.data.astype(np.float32), a.shape
    )


# ---------------------------------------------------------------- matrix_size


def test_matrix_size_h5(tmp_path, rng):
    from mlemlib.formats.h5 import write_matrix_h5

    a = _random_csr(rng, 37, 23)
    path = tmp_path / "matrix.h5"
    write_matrix_h5(path, _to_csr_matrix(a))
    assert matrix_size(path) == MatrixSize(rows=37, cols=23, nnz=a.nnz)


def test_matrix_size_csr4(tmp_path, rng):
    from mlemlib.formats.csr4 import ScannerGeometry, write_csr4

    a = _random_csr(rng, 30, 2 * 3 * 4)
    geometry = ScannerGeometry(
        layers=[(2.0, 2.0, 10.0, 50.0, 0.09)],
        n_blocks=4,
        block_size=2,
        block_gaps=[0.1],
        n_rings=2,
        ring_gaps=[0.2],
        voxel_size=(1.0, 1.0, 1.0),
        grid=(2, 3, 4),
    )
    path = tmp_path / "m.csr4"
    write_csr4(path, _to_csr_matrix(a), scanner_block=geometry.to_bytes())
    assert matrix_size(path) == MatrixSize(rows=30, cols=24, nnz=a.nnz)


def test_matrix_size_mtx_and_gz(tmp_path, rng):
    import gzip
    import shutil

    a = _random_csr(rng, 19, 11)
    path = tmp_path / "m.mtx"
    scipy.io.mmwrite(path, a)
    assert matrix_size(path) == MatrixSize(rows=19, cols=11, nnz=a.nnz)
    gz = tmp_path / "m.mtx.gz"
    with open(path, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    assert matrix_size(gz) == MatrixSize(rows=19, cols=11, nnz=a.nnz)


def test_matrix_size_mtx_hand_written(tmp_path):
    path = tmp_path / "hand.mtx"
    path.write_text("%%MatrixMarket matrix coordinate real general\n% a comment\n\n4 5 3\n1 1 1.0\n2 3 2.0\n4 5 3.0\n")
    assert matrix_size(path) == MatrixSize(rows=4, cols=5, nnz=3)


def test_matrix_size_npz(tmp_path, rng):
    a = _random_csr(rng, 13, 29)
    path = tmp_path / "m.npz"
    scipy.sparse.save_npz(path, a)
    assert matrix_size(path) == MatrixSize(rows=13, cols=29, nnz=a.nnz)
    # The uncompressed variant too.
    path2 = tmp_path / "u.npz"
    scipy.sparse.save_npz(path2, a, compressed=False)
    assert matrix_size(path2) == MatrixSize(rows=13, cols=29, nnz=a.nnz)


def test_matrix_size_compressed_h5(tmp_path, rng):
    from mlemlib.formats import write_compressed_h5

    a = _random_csr(rng, 31, 17)
    path = tmp_path / "matrix.h5"
    write_compressed_h5(path, _to_csr_matrix(a), fmt="compressed")
    assert matrix_size(path) == MatrixSize(rows=31, cols=17, nnz=a.nnz)


def test_matrix_size_is_what_formats_reads(tmp_path):
    # A symmetric Matrix Market file stores one triangle; the size is the
    # expanded matrix's, as mlem convert will write it.
    path = tmp_path / "sym.mtx"
    path.write_text("%%MatrixMarket matrix coordinate real symmetric\n3 3 3\n1 1 1.0\n2 1 2.0\n3 2 3.0\n")
    assert matrix_size(path) == MatrixSize(rows=3, cols=3, nnz=5)
    # A dense (array) Matrix Market file is read as convert reads it: its non-zeros.
    dense = tmp_path / "dense.mtx"
    dense.write_text("%%MatrixMarket matrix array real general\n2 2\n1\n0\n3\n4\n")
    assert matrix_size(dense) == MatrixSize(rows=2, cols=2, nnz=3)


def test_matrix_size_follows_a_rewritten_file(tmp_path, rng):
    import os

    path = tmp_path / "m.npz"
    scipy.sparse.save_npz(path, _random_csr(rng, 5, 7))
    first = matrix_size(path)
    b = _random_csr(rng, 9, 4)
    scipy.sparse.save_npz(path, b)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new state even within the clock's resolution
    assert first.rows == 5
    assert matrix_size(path) == MatrixSize(rows=9, cols=4, nnz=b.nnz)


@pytest.mark.parametrize(
    ("name", "content", "fault"),
    [
        ("m.txt", b"whatever", "unknown file type"),
        ("m.mtx", b"1 2 3\n", "not a valid Matrix Market file"),
        ("m.mtx", b"%%MatrixMarket matrix coordinate real general\n% only comments\n", "not a valid Matrix Market"),
        ("m.mtx", b"%%MatrixMarket matrix coordinate real general\n4 x 3\n", "not a valid Matrix Market"),
        ("m.npz", b"not a zip", "not a SciPy sparse .npz"),
        ("m.h5", b"not hdf5", "HDF5"),
        ("m.csr4", b"PCSR\x05" + bytes(23), "version"),
        ("g.LMsino", bytes(16), "measurements, not a system matrix"),
    ],
)
def test_matrix_size_rejects_bad_files(tmp_path, name, content, fault):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(MatrixFormatError) as err:
        matrix_size(path)
    assert str(path) in str(err.value)
    assert fault in str(err.value)


def test_matrix_size_missing_file_and_foreign_h5(tmp_path):
    import h5py

    with pytest.raises(MatrixFormatError, match="no such file"):
        matrix_size(tmp_path / "absent.h5")
    path = tmp_path / "image.h5"
    with h5py.File(path, "w") as f:
        f["image"] = np.zeros(3)
    with pytest.raises(MatrixFormatError, match="not an mlem matrix container"):
        matrix_size(path)


# ------------------------------------------------------------------ the model


def test_matrix_size_bytes_hand_computed():
    s = MatrixSize(rows=10, cols=4, nnz=7)
    assert s.csr_bytes == 7 * 8 + 11 * 8
    assert s.csr_t_bytes == 7 * 8 + 5 * 8
    with pytest.raises(ConfigError):
        MatrixSize(rows=-1, cols=4, nnz=7)
    with pytest.raises(ConfigError):
        MatrixSize(rows=1.5, cols=4, nnz=7)


def test_mem_cpu_mlem_hand_computed():
    # CPU MLEM holds A, A^T and four float64 vectors of each length:
    # A = 8*1e8 + 8*(1e6+1), A^T = 8*1e8 + 8*(1e5+1), vectors = 4*8*(1e6+1e5).
    s = MatrixSize(rows=1_000_000, cols=100_000, nnz=100_000_000)
    peak = 1_600_000_000 + 8_000_008 + 800_008 + 35_200_000  # 1,644,000,016 bytes
    assert cluster.peak_host_bytes("mlem", s, backend="cpu") == peak
    mb = (1024 + peak / MB) * 1.5  # 3,887.8... -> next multiple of 256
    assert estimate_mem_mb("mlem", s, backend="cpu") == 3840 + 256 == math.ceil(mb / 256) * 256
    # Without a stored transpose, A^T is not held.
    assert cluster.peak_host_bytes("mlem", s, backend="cpu", stored_transpose=False) == peak - 800_800_008


def test_runtime_cpu_mlem_hand_computed():
    # 1e9 nnz, m = n = 1e6: A = A^T = 8.000008e9 bytes. Load both at 200 MiB/s,
    # then 10 iterations of FP + BP at 1 GB/s.
    s = MatrixSize(rows=1_000_000, cols=1_000_000, nnz=1_000_000_000)
    a = 8_000_008_008
    seconds = 2 * a / (200 * MB) + 10 * 2 * a / 1e9
    expected = math.ceil(10 + 3.0 * seconds / 60)
    assert estimate_runtime_min("mlem", s, iterations=10, backend="cpu") == expected
    assert expected == 10 + math.ceil(3 * (76.29 + 160.0) / 60 - 1e-9)  # 22 minutes


@pytest.mark.parametrize("stage", cluster.STAGES)
def test_bigger_matrix_asks_for_more(stage):
    small = MatrixSize(rows=10_000, cols=5_000, nnz=1_000_000)
    big = MatrixSize(rows=1_000_000, cols=500_000, nnz=2_000_000_000)
    assert estimate_mem_mb(stage, small) <= estimate_mem_mb(stage, big)
    assert estimate_runtime_min(stage, small) <= estimate_runtime_min(stage, big)
    if stage != "summary":  # the summary reads only small vectors
        assert estimate_mem_mb(stage, small) < estimate_mem_mb(stage, big)
        assert estimate_runtime_min(stage, small) < estimate_runtime_min(stage, big)
    # Every request is at least the base, a multiple of 256 MB, at least 10 minutes.
    assert estimate_mem_mb(stage, small) >= cluster.BASE_MB
    assert estimate_mem_mb(stage, big) % cluster.MEM_ROUND_MB == 0
    assert estimate_runtime_min(stage, small) >= cluster.MIN_RUNTIME_MIN


def test_small_matrix_gets_the_floor():
    tiny = MatrixSize(rows=100, cols=50, nnz=1000)
    # Peak 4*8*1000 + 2*8*100 = 33,600 bytes (a chunk, the next one read ahead, a validated copy, a write
    # buffer): (1024 MB + 0.032 MB) * 1.5 is just over 1536 MB, so the request rounds up to the next 256 MB: 1792.
    assert cluster.peak_host_bytes("convert", tiny) == 33_600
    assert estimate_mem_mb("convert", tiny) == 1792
    assert estimate_runtime_min("convert", tiny) == cluster.MIN_RUNTIME_MIN + 1


def test_gpu_runs_scale_with_gpus():
    s = MatrixSize(rows=1_327_104, cols=784_000, nnz=1_603_498_863)  # MADPET-II
    one = estimate_mem_mb("mlem", s, parts=1, backend="cuda")
    four = estimate_mem_mb("mlem", s, parts=4, backend="cuda")
    cpu = estimate_mem_mb("mlem", s, backend="cpu")
    assert four < one < cpu + cluster.GPU_BASE_MB * cluster.MEM_SAFETY + cluster.MEM_ROUND_MB
    t1 = estimate_runtime_min("mlem", s, iterations=500, parts=1, backend="cuda")
    t4 = estimate_runtime_min("mlem", s, iterations=500, parts=4, backend="cuda")
    tc = estimate_runtime_min("mlem", s, iterations=500, backend="cpu")
    assert t4 < t1 < tc
    # Per-GPU device memory: 1/4 of A and A^T plus full-length vectors.
    g1 = cluster.estimate_gpu_mem_mb(s, parts=1)
    g4 = cluster.estimate_gpu_mem_mb(s, parts=4)
    a_and_at_mb = 2 * 8 * s.nnz / MB  # 24,466 MB
    assert g1 == pytest.approx(a_and_at_mb + cluster.GPU_RESERVE_MB, rel=0.01)
    assert g4 == pytest.approx(a_and_at_mb / 4 + cluster.GPU_RESERVE_MB, rel=0.02)
    assert cluster.estimate_gpu_mem_mb(s, parts=1, stored_transpose=False) < g1


def test_attempt_scales_requests():
    s = MatrixSize(rows=1000, cols=1000, nnz=10**8)
    assert estimate_mem_mb("transpose", s, attempt=2) >= 2 * estimate_mem_mb("transpose", s) - 256
    assert estimate_runtime_min("transpose", s, attempt=3) >= 3 * estimate_runtime_min("transpose", s) - 1
    with pytest.raises(ConfigError, match="attempt"):
        estimate_mem_mb("transpose", s, attempt=0)


def test_stage_resources_gpu_only_for_gpu_backends():
    s = MatrixSize(rows=1000, cols=500, nnz=10**5)
    cpu = cluster.stage_resources("mlem", s, backend="cpu", gpus=1)
    assert cpu["gpu"] == 0 and "cpus_per_gpu" not in cpu
    cuda = cluster.stage_resources("mlem", s, backend="cuda", gpus=4, parts=4)
    assert cuda["gpu"] == 4 and cuda["cpus_per_gpu"] == cluster.CPUS_PER_GPU
    assert cuda["mem_mb"] == estimate_mem_mb("mlem", s, backend="cuda", parts=4)
    auto = cluster.stage_resources("mlem", s, backend="auto", gpus=2, parts=2)
    assert auto["gpu"] == 2
    norm = cluster.stage_resources("norm", s)
    assert norm["gpu"] == 0 and set(norm) == {"mem_mb", "runtime", "gpu"}


@pytest.mark.parametrize(
    ("call", "key"),
    [
        (lambda s: estimate_mem_mb("deconvolve", s), "stage"),
        (lambda s: estimate_mem_mb("mlem", s, backend="opencl"), "backend"),
        (lambda s: estimate_mem_mb("mlem", s, parts=0), "parts"),
        (lambda s: estimate_runtime_min("mlem", s, iterations=0), "iterations"),
        (lambda s: cluster.gpus_for("cuda", -1), "gpus"),
    ],
)
def test_bad_arguments_raise_config_error(call, key):
    with pytest.raises(ConfigError) as err:
        call(MatrixSize(rows=10, cols=10, nnz=10))
    assert err.value.source == key


# ------------------------------------------------------- conda environments


def _env(name: str) -> dict:
    with open(ROOT / "envs" / name) as f:
        return yaml.safe_load(f)


def _conda_pins(env: dict) -> dict[str, str]:
    pins = {}
    for dep in env["dependencies"]:
        if isinstance(dep, str):
            match = re.fullmatch(r"([a-z0-9_.-]+)=([0-9][0-9a-z.]*)", dep)
            assert match, f"conda dependency {dep!r} is not pinned as name=exact.version"
            pins[match[1]] = match[2]
    return pins


def _pip_pins(env: dict) -> dict[str, str]:
    pins = {}
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            assert set(dep) == {"pip"}, f"unexpected mapping in dependencies: {dep}"
            for req in dep["pip"]:
                match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][0-9a-z.]*)", req)
                assert match, f"pip requirement {req!r} is not pinned as name==version"
                pins[match[1].lower()] = match[2]
    return pins


@pytest.mark.parametrize("name", ["cpu.yaml", "gpu.yaml"])
def test_env_is_pinned_to_conda_forge(name):
    env = _env(name)
    assert set(env) == {"channels", "dependencies"}
    assert env["channels"] == ["conda-forge", "nodefaults"]
    pins = _conda_pins(env)
    assert re.fullmatch(r"3\.1[12]\.\d+", pins["python"])
    # Everything mlemlib imports at its core (pyproject's dependencies).
    for package in ("numpy", "scipy", "numba", "h5py", "matplotlib-base", "pyyaml", "jsonschema", "markdown"):
        assert package in pins, f"{name} lacks {package}"
    # Each pin satisfies pyproject's lower bound.
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    conda_name = {"matplotlib": "matplotlib-base"}
    for requirement in project["dependencies"]:
        dist, minimum = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement).groups()
        dist = conda_name.get(dist.lower(), dist.lower())
        have = tuple(int(x) for x in pins[dist].split(".")[:2])
        want = tuple(int(x) for x in minimum.split(".")[:2])
        assert have >= want, f"{name}: {dist}={pins[dist]} below pyproject's >={minimum}"


def test_gpu_env_extends_cpu_env_with_cuda12():
    cpu, gpu = _conda_pins(_env("cpu.yaml")), _conda_pins(_env("gpu.yaml"))
    for package, version in cpu.items():
        assert gpu.get(package) == version, f"gpu.yaml pins {package}={gpu.get(package)}, cpu.yaml {version}"
    assert gpu["cuda-version"].startswith("12")
    assert int(gpu["cupy"].split(".")[0]) >= 13
    assert "nvidia-ml-py" in _pip_pins(_env("gpu.yaml"))
    assert "pip" in gpu


# ------------------------------------------------------------- SLURM profile


def test_slurm_profile_structure():
    profile = yaml.safe_load((ROOT / "profiles" / "slurm" / "config.yaml").read_text())
    assert profile["executor"] == "slurm"
    assert isinstance(profile["jobs"], int) and profile["jobs"] > 0
    # Account and partition are the user's (command line); the default profile
    # of the workflow would override a default-resources key here anyway.
    assert "default-resources" not in profile
    # Every key is a Snakemake or SLURM-plugin option.
    from snakemake.cli import get_argument_parser

    parser = get_argument_parser()
    options = {s for action in parser._actions for s in action.option_strings}
    from snakemake_executor_plugin_slurm import ExecutorSettings

    plugin = {"--slurm-" + f.replace("_", "-") for f in ExecutorSettings.__dataclass_fields__}
    for key in profile:
        assert f"--{key}" in options | plugin, f"profiles/slurm: unknown option {key!r}"


def test_csr4_header_parsing_is_independent_of_trailing_elements(tmp_path):
    # A header whose size field disagrees with the file: the reader refuses
    # (no estimate from a truncated or padded matrix).
    head = b"PCSR" + struct.pack("<BBHIIQI", 4, 0, 0, 3, 8, 5, 60)
    path = tmp_path / "t.csr4"
    path.write_bytes(head + bytes(60))
    with pytest.raises(MatrixFormatError, match="truncated|scanner"):
        matrix_size(path)


def test_generated_size_bounds_the_real_matrix(tmp_path):
    from mlemlib.scanner import generate

    estimate = cluster.generated_size("small")
    out = tmp_path / "small.csr4"
    generate("small", out, threads=1)
    real = matrix_size(out)
    assert (estimate.rows, estimate.cols) == (real.rows, real.cols) == (36864, 3200)
    assert estimate.nnz == 36864 * 4 * (20 + 20 + 8)
    assert real.nnz <= estimate.nnz
    # MADPET-II (the thesis): 1,603,498,863 real elements, within 10 % below the estimate.
    madpet2 = cluster.generated_size("madpet2")
    assert (madpet2.rows, madpet2.cols) == (1_327_104, 784_000)
    assert 1_603_498_863 <= madpet2.nnz <= 1.1 * 1_603_498_863
    with pytest.raises(ConfigError):
        cluster.generated_size("no-such-preset")
