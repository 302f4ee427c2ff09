"""MLEM runs on every matrix format and with the one-pass iteration, on the CPU and (marked gpu) on GPUs.

Independent expectations: the CPU's compressed kernels and its one-pass step
sum every row and every voxel in the same order as the CSR kernels (so the
images are equal bit for bit); the GPU variants are checked against the CPU's
float32 image within a float32 tolerance, the deterministic ones bit for bit
run after run, and the fixed-point one-pass bit for bit across GPU counts.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib.backends import make_backend
from mlemlib.compressed import CompressedMatrix
from mlemlib.errors import ConfigError
from mlemlib.matrix import CSRMatrix
from mlemlib.problem import ModelSpec, RunSettings


def problem(seed: int = 0, m: int = 900, n: int = 400):
    """A PET-like positive problem: rows of 0..60 columns (some far apart: 16-bit deltas), a noiseless measurement."""
    rng = np.random.default_rng(seed)
    rows, cols, vals = [], [], []
    for i in range(m):
        k = int(rng.integers(0, min(60, n)))
        c = np.sort(rng.choice(n, size=k, replace=False))
        rows += [i] * k
        cols += c.tolist()
        vals += rng.uniform(0.05, 1.0, k).tolist()
    a = sp.csr_matrix((np.float32(vals), (rows, cols)), shape=(m, n))
    a.sort_indices()
    A = CSRMatrix.from_scipy(a)
    At = CSRMatrix.from_scipy(a.T.tocsr())
    g = (a @ rng.uniform(0.5, 1.5, n)).astype(np.float32)
    norm = np.asarray(a.sum(axis=0), dtype=np.float64).ravel()
    return A, At, g, norm


def run(backend, matrix, g, norm, transpose=None, *, bp="auto", iterations=15, **kw):
    be = make_backend(backend, matrix, g, norm, transpose, bp=bp, **kw)
    f = be.initial_image()
    for _ in range(iterations):
        f = be.iterate(f)
    img = be.to_host(f)
    d = be.describe()
    if hasattr(be, "close"):
        be.close()
    return img, d


def rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


# --------------------------------------------------------------------------- CPU (CI)
@pytest.mark.parametrize("fmt", ["compressed", "compressed-f16", "compressed-u16"])
def test_cpu_compressed_runs_the_csr_sums(fmt):
    A, At, g, norm = problem()
    C = CompressedMatrix.from_csr(A, fmt)
    ref_t, _ = run("cpu", A, g, norm, At, bp="numba")
    ref_n, _ = run("cpu", A, g, norm, None, bp="notrans")
    got_t, d = run("cpu", C, g, norm, At, bp="numba")
    got_n, _ = run("cpu", C, g, norm, None, bp="notrans")
    assert d["format"] == fmt
    if fmt == "compressed":  # lossless, and every row and voxel summed in the CSR kernels' order
        np.testing.assert_array_equal(got_t, ref_t)
        np.testing.assert_array_equal(got_n, ref_n)
    else:  # 16-bit values: the run of the decoded matrix, bit for bit; float16 at most 2^-11 relative per
        # value, the per-row fixed point at most 2^-16 of its row's largest
        dec_n, _ = run("cpu", C.to_csr(), g, norm, None, bp="notrans")
        np.testing.assert_array_equal(got_n, dec_n)
        tol = 2e-3 if fmt == "compressed-f16" else 1e-4
        assert rel(got_t, ref_t) < tol and rel(got_n, ref_n) < tol


@pytest.mark.parametrize("fmt", ["csr", "compressed"])
def test_cpu_one_pass_equals_forward_then_blocked_scatter(fmt):
    A, _, g, norm = problem(1)
    mat = A if fmt == "csr" else CompressedMatrix.from_csr(A, fmt)
    two, _ = run("cpu", A, g, norm, None, bp="notrans")
    one, d = run("cpu", mat, g, norm, None, bp="onepass")
    assert d["onepass"] and d["steps"] == ["bp", "update"]
    np.testing.assert_array_equal(one, two)


def test_cpu_one_pass_names():
    A, _, g, norm = problem(2, 50, 30)
    with pytest.raises(ConfigError, match="fp must be auto or onepass"):
        make_backend("cpu", A, g, norm, fp="scipy", bp="onepass")
    with pytest.raises(ConfigError, match="float32"):
        make_backend("cpu", A, g, norm, bp="onepass", dtype=np.float64)
    with pytest.raises(ConfigError, match="does not read the compressed format"):
        make_backend("cpu", CompressedMatrix.from_csr(A, "compressed"), g, norm, fp="scipy")


# --------------------------------------------------------------------------- one GPU
def _cuda():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no GPU")
    except Exception:  # no driver
        pytest.skip("no GPU")
    return cp


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["compressed", "compressed-f16", "compressed-u16"])
def test_gpu_compressed_with_transpose_matches_the_cpu(fmt):
    _cuda()
    A, At, g, norm = problem(3)
    C = CompressedMatrix.from_csr(A, fmt)
    cpu, _ = run("cpu", C, g, norm, At, bp="numba")
    gpu1, d = run("cuda", C, g, norm, At)
    gpu2, _ = run("cuda", C, g, norm, At)
    assert (d["fp"], d["bp"], d["format"]) == ("delta_vector", "delta_vector", fmt) and d["deterministic"]
    np.testing.assert_array_equal(gpu1, gpu2)  # no atomics: the same bits run after run
    assert rel(gpu1, cpu) < 2e-6


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["csr", "compressed"])
def test_gpu_one_pass(fmt):
    _cuda()
    A, _, g, norm = problem(4)
    mat = A if fmt == "csr" else CompressedMatrix.from_csr(A, fmt)
    cpu, _ = run("cpu", A, g, norm, None, bp="notrans")
    atom, d = run("cuda", mat, g, norm, None, bp="onepass")
    assert d["onepass"] and not d["deterministic"]
    fixed1, d1 = run("cuda", mat, g, norm, None, bp="onepass_fixed")
    fixed2, _ = run("cuda", mat, g, norm, None, bp="onepass_fixed")
    assert d1["deterministic"]
    np.testing.assert_array_equal(fixed1, fixed2)
    assert rel(atom, cpu) < 2e-6 and rel(fixed1, cpu) < 2e-6


@pytest.mark.gpu
def test_gpu_fixed_point_one_pass_is_the_same_on_every_gpu_count():
    cp = _cuda()
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs")
    A, _, g, norm = problem(5)
    one, _ = run("cuda", A, g, norm, None, bp="onepass_fixed", gpus=1, graph=True)
    two, d = run("cuda", A, g, norm, None, bp="onepass_fixed", gpus=2, layout="local")
    assert d["gpus"] == 2 and d["backend"] == "cuda-nccl"
    assert d["onepass"]  # timings.json counts A once an iteration (the 2-GPU Matrix 3 run had counted it twice)
    np.testing.assert_array_equal(one, two)
    C = CompressedMatrix.from_csr(A, "compressed")
    c1, _ = run("cuda", C, g, norm, None, bp="onepass_fixed", gpus=1, graph=True)
    c2, _ = run("cuda", C, g, norm, None, bp="onepass_fixed", gpus=2, layout="local")
    np.testing.assert_array_equal(c1, c2)


@pytest.mark.parametrize(("r0", "r1"), [(0, 900), (37, 611), (5, 5)])
def test_csr_source_is_encoded_block_by_block_for_the_gpu(monkeypatch, r0, r1):
    """The host half of DeviceCompressed.upload: a CSR source read in blocks encodes as the whole rows would."""
    from mlemlib.backends import _compressed_cuda as cc

    A, _, _, _ = problem(6)
    monkeypatch.setattr(cc, "UPLOAD_CHUNK_NNZ", 997)  # many blocks
    got = cc._encoded_rows(A, r0, r1, "compressed", "matrix")
    want = CompressedMatrix.from_csr(A, "compressed").row_range(r0, r1)
    assert got.shape == want.shape and got.nnz == want.nnz
    assert (got.to_csr().to_scipy() != want.to_csr().to_scipy()).nnz == 0


def test_timings_count_the_bytes_each_iteration_reads(tmp_path):
    """timings.json: the format's own bytes (not CSR's 8 per non-zero), and A once an iteration in one pass."""
    import json

    from mlemlib.formats.compressed_h5 import write_compressed_h5
    from mlemlib.mlem import reconstruct

    A, _, g, norm = problem(7)
    path = tmp_path / "c.h5"
    write_compressed_h5(path, A, fmt="compressed")
    from mlemlib.formats import open_source

    with open_source(path) as src:
        stored = src.nbytes
    for bp, reads in (("onepass", 1), ("notrans", 2)):
        out = tmp_path / bp / "image.h5"
        reconstruct(ModelSpec(path, g, norm=norm), RunSettings(2, backend="cpu", bp=bp), out)
        t = json.loads((out.parent / "timings.json").read_text())
        per_nnz = t["backend"]["bytes_per_nnz"]["A"]
        assert 4.0 < per_nnz < 8.0  # the compressed format, below CSR's 8
        assert t["bytes"]["A"] == round(per_nnz * A.nnz)
        assert abs(t["bytes"]["A"] - stored) < 0.01 * stored  # what the container holds
        assert t["bytes"]["iteration"] == reads * t["bytes"]["A"]
