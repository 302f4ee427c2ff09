"""The one-GPU MLEM backend against a float64 reference MLEM (GPU only: skipped without one).

The reference is written here, in float64 with SciPy, straight from the
numerical contract (DESIGN.md): fp = A f; c = g / fp (0 where fp = 0);
bp = A^T c; f <- f * bp / norm (f * bp where norm = 0). After 50 iterations the
GPU image must be within 1e-5 (relative L2) of it for every kernel pair, the
deterministic pairs must give bit-identical images run after run, and the
fused two-kernel iteration must give the same bits as the four separate steps.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import scipy.sparse as sp

cp = pytest.importorskip("cupy")

from mlemlib import registry
from mlemlib.backends import _cuda_kernels as ck
from mlemlib.backends import cuda as cuda_backend
from mlemlib.backends.cuda import CudaBackend
from mlemlib.bench import tor_matrix
from mlemlib.errors import ConfigError, DeviceError, SinogramFormatError
from mlemlib.matrix import CSRMatrix

pytestmark = pytest.mark.gpu

ITERATIONS = 50


@pytest.fixture(scope="module")
def pet():
    """A PET-like problem: TOR matrix (with empty rows and columns), a phantom, Poisson counts."""
    a = tor_matrix(24, 24, 3, 20, 30)
    m, n = a.shape
    # voxels no LOR sees: empty columns (norm 0), as outside a scanner's field of view
    keep = a.indices % 24 != 23
    rows = np.repeat(np.arange(m), np.diff(a.indptr))[keep]
    s = sp.csr_matrix((a.data[keep], (rows, a.indices[keep])), shape=(m, n))
    s.sort_indices()
    a = CSRMatrix.from_scipy(s)
    rng = np.random.default_rng()
    truth = rng.uniform(0.5, 2.0, n)
    truth[a.indices.max() // 2 :] *= 3.0
    g = rng.poisson(s.astype(np.float64) @ truth * 2.0).astype(np.int32)
    at = CSRMatrix.from_scipy(s.T.tocsr())
    norm = np.asarray(s.astype(np.float64).sum(axis=0)).ravel()
    assert (norm == 0).any() and (np.diff(a.indptr) == 0).any() and (g == 0).any()
    return {"a": a, "at": at, "g": g, "norm": norm, "ref": reference_mlem(s, g, norm, ITERATIONS)}


def reference_mlem(s, g, norm, iterations):
    s64 = s.astype(np.float64)
    st = s64.T.tocsr()
    g = g.astype(np.float64)
    f = np.full(s.shape[1], g.sum() / norm.sum())
    safe = np.where(norm != 0, norm, 1.0)
    for _ in range(iterations):
        fp = s64 @ f
        c = np.zeros_like(fp)
        np.divide(g, fp, out=c, where=fp != 0)
        f = f * (st @ c) / safe
    return f


def run_gpu(pet, fp, bp, *, transpose=True, iterations=ITERATIONS, **kw):
    be = CudaBackend(pet["a"], pet["g"], pet["norm"], pet["at"] if transpose else None, fp=fp, bp=bp, **kw)
    f = be.initial_image()
    for _ in range(iterations):
        f = be.iterate(f)
    return be, be.to_host(f)


def rel_l2(x, ref):
    return float(np.linalg.norm(x.astype(np.float64) - ref) / np.linalg.norm(ref))


PAIRS = [
    ("csr_vector", "csr_vector", True),
    ("csr_scalar", "csr_scalar", True),
    ("cusparse", "cusparse", True),
    ("csr_vector", "scatter", False),
    ("csr_vector", "scatter_vec", False),
    ("csr_vector", "scatter_smem", False),
    ("csr_vector", "cusparse_notrans", False),
    ("merge", "merge", True),
    ("merge", "notrans", False),
]


@pytest.mark.parametrize(("fp", "bp", "transpose"), PAIRS)
def test_mlem_matches_float64_reference(pet, fp, bp, transpose):
    be, f = run_gpu(pet, fp, bp, transpose=transpose)
    assert f.dtype == np.float32 and np.isfinite(f).all()
    err = rel_l2(f, pet["ref"])
    assert err < 1e-5, f"{fp}+{bp}: relative L2 error {err:.2e} after {ITERATIONS} iterations"
    assert be.deterministic == (fp not in ("merge",) and fp != "cusparse" and bp in ("csr_vector", "csr_scalar"))
    # voxels no LOR sees stay at f * 0 = 0 after the first update
    assert np.all(f[pet["norm"] == 0] == 0)


@pytest.mark.parametrize(
    ("fp", "bp"), [("csr_vector", "csr_vector"), ("csr_scalar", "csr_scalar"), ("cusparse", "cusparse")]
)
def test_deterministic_pairs_are_bit_identical(pet, fp, bp):
    _, f1 = run_gpu(pet, fp, bp)
    _, f2 = run_gpu(pet, fp, bp)
    np.testing.assert_array_equal(f1, f2)


def test_fused_equals_unfused_bit_for_bit(pet):
    be_f, f_fused = run_gpu(pet, "csr_vector", "csr_vector", fuse=True)
    be_u, f_unfused = run_gpu(pet, "csr_vector", "csr_vector", fuse=False)
    assert be_f.describe()["fused"] == ["corr into fp", "update into bp"]
    assert be_u.describe()["fused"] == []
    np.testing.assert_array_equal(f_fused, f_unfused)


def test_step_api_matches_iterate(pet):
    """forward / correlate / back / update by hand give what iterate gives."""
    be = CudaBackend(pet["a"], pet["g"], pet["norm"], pet["at"], fp="csr_vector", bp="csr_vector")
    f0 = be.initial_image()
    f_hand = f0.copy()
    fp = be.forward(f_hand)
    c = be.correlate(fp)
    bp = be.back(c)
    f_hand = be.update(f_hand, bp)
    f_it = be.iterate(f0.copy())
    assert cp.array_equal(f_hand, f_it)
    expected = pet["g"].sum(dtype=np.float64) / pet["norm"].sum()
    assert float(f0[0]) == pytest.approx(expected, rel=1e-7)


def test_step_times_from_events(pet):
    be = CudaBackend(pet["a"], pet["g"], pet["norm"], None, fp="csr_vector", bp="scatter")
    f = be.iterate(be.initial_image())
    t = be.last_step_times()
    assert set(t) == {"fp", "bp", "update", "iteration"}  # corr fused into fp
    assert all(v > 0 for v in t.values())
    assert t["iteration"] == pytest.approx(t["fp"] + t["bp"] + t["update"], rel=1e-3, abs=2e-6)
    assert be.to_host(f).shape == (pet["a"].shape[1],)
    be = CudaBackend(pet["a"], pet["g"], pet["norm"], pet["at"], fp="cusparse", bp="cusparse")
    be.iterate(be.initial_image())
    assert set(be.last_step_times()) == {"fp", "corr", "bp", "update", "iteration"}


def test_bp_auto(pet, caplog):
    be = CudaBackend(pet["a"], pet["g"], pet["norm"], pet["at"])
    assert (be.fp_kernel, be.bp_kernel, be.transpose_source) == ("csr_vector", "csr_vector", "stored")
    assert be.deterministic
    with caplog.at_level(logging.INFO, logger="mlemlib.backends.cuda"):
        be = CudaBackend(pet["a"], pet["g"], pet["norm"], None, bp="auto")
    # without a stored transpose a CSR matrix is transposed on the GPU; the small TOR matrix's voxels all fit
    # one chunk (reuse far above registry.CHUNK_REUSE_MIN), but one chunk is far fewer than
    # CHUNK_WAVES_MIN per multiprocessor: the pair, as with a stored transpose
    assert (be.bp_kernel, be.transpose_source, be.deterministic) == ("csr_vector", "cusparse on device", True)
    d = be.describe()
    assert d["bp_requested"] == "auto" and d["chunk_reuse_sample"] >= registry.CHUNK_REUSE_MIN
    assert "back projection without a transpose" not in caplog.text
    img = be.to_host(be.iterate(be.initial_image()))
    stored = CudaBackend(pet["a"], pet["g"], pet["norm"], pet["at"])
    assert np.array_equal(img, stored.to_host(stored.iterate(stored.initial_image())))  # the same A^T, the same bits
    # a compressed matrix is not transposed on the GPU: without a transpose, the chunked one pass
    from mlemlib.compressed import CompressedMatrix

    with caplog.at_level(logging.INFO, logger="mlemlib.backends.cuda"):
        be = CudaBackend(CompressedMatrix.from_csr(pet["a"], "compressed"), pet["g"], pet["norm"], None, bp="auto")
    assert (be.bp_kernel, be.transpose_source, be.deterministic) == ("onepass_chunked", "none", True)
    assert "onepass_chunked" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mlemlib.backends.cuda"):
        be = CudaBackend(pet["a"], pet["g"], pet["norm"], None, bp="notrans")
    # notrans: the small TOR matrix is one row chunk whose columns fit shared memory
    assert (be.bp_kernel, be.transpose_source, be.deterministic) == ("scatter_smem", "none", False)
    assert be.describe()["smem_local_chunks"] == 1.0 and "fit shared memory: scatter_smem" in caplog.text
    # an explicit transpose kernel without a stored transpose: transposed on the GPU
    be = CudaBackend(pet["a"], pet["g"], pet["norm"], None, bp="csr_vector")
    assert be.transpose_source == "cusparse on device"
    d = be.describe()
    assert d["device"]["name"] and d["memory"]["matrix"] > 0 and d["lanes_fp"] in (2, 4, 8, 16, 32)


def test_memory_check(pet, monkeypatch, caplog):
    """When A and A^T do not both fit, bp=auto falls back to scatter and an explicit transpose kernel fails."""
    a = pet["a"]
    need_a = a.nbytes + 4 * (3 * a.shape[0] + 4 * a.shape[1])
    monkeypatch.setattr(cuda_backend, "free_memory", lambda dev: int(need_a / cuda_backend.MEMORY_HEADROOM) + 64)
    with caplog.at_level(logging.WARNING, logger="mlemlib.backends.cuda"):
        be = CudaBackend(a, pet["g"], pet["norm"], pet["at"], bp="auto")
    assert be.bp_kernel == "onepass_chunked" and be.at is None  # the no-transpose path (fewer bytes than CSR)
    assert "do not both fit" in caplog.text
    with pytest.raises(DeviceError, match="do not both fit"):
        CudaBackend(a, pet["g"], pet["norm"], pet["at"], bp="csr_vector")
    monkeypatch.setattr(cuda_backend, "free_memory", lambda dev: 1024)
    with pytest.raises(DeviceError, match="A needs"):
        CudaBackend(a, pet["g"], pet["norm"], None, bp="notrans")


def test_bad_input(pet):
    a = pet["a"]
    with pytest.raises(SinogramFormatError, match="rows"):
        CudaBackend(a, pet["g"][:-1], pet["norm"], None)
    with pytest.raises(ConfigError, match="norm"):
        CudaBackend(a, pet["g"], pet["norm"][:-1], None)
    with pytest.raises(ConfigError, match="fp"):
        CudaBackend(a, pet["g"], pet["norm"], None, fp="ell")
    with pytest.raises(ConfigError, match="secsize"):
        CudaBackend(a, pet["g"], pet["norm"], None, fp="merge", secsize=0)
    with pytest.raises(ConfigError, match="transpose"):
        CudaBackend(a, pet["g"], pet["norm"], a)
    with pytest.raises(DeviceError, match="GPU 99"):
        CudaBackend(a, pet["g"], pet["norm"], None, device=99)
    be = CudaBackend(a, pet["g"], pet["norm"], None)
    with pytest.raises(ConfigError, match="image"):
        be.from_host(np.ones(3))


def test_streams_an_opened_matrix(pet):
    """An object with iter_chunks (a file reader) is streamed block by block to the GPU."""
    a = pet["a"]

    class Reader:
        shape, nnz = a.shape, a.nnz

        def iter_chunks(self, max_nnz=1 << 26):
            for r0 in range(0, a.shape[0], 1000):
                r1 = min(r0 + 1000, a.shape[0])
                s, e = a.indptr[r0], a.indptr[r1]
                yield r0, r1, CSRMatrix(a.indptr[r0 : r1 + 1] - s, a.indices[s:e], a.data[s:e], (r1 - r0, a.shape[1]))

    d = ck.DeviceCSR.upload(Reader())
    np.testing.assert_array_equal(d.indptr.get(), a.indptr)
    np.testing.assert_array_equal(d.indices.get(), a.indices)
    np.testing.assert_array_equal(d.data.get(), a.data)
    assert isinstance(d, ck.DeviceCSR)


def test_notrans_takes_cusparse_when_chunks_do_not_fit_shared_memory():
    """Rows with columns scattered over 300,000 voxels: no chunk fits, notrans is cuSPARSE's A.T @ c."""
    rng = np.random.default_rng()
    m, n, k = 3000, 300_000, 120
    rows = np.repeat(np.arange(m), k)
    cols = rng.integers(0, n, size=m * k)
    s = sp.csr_matrix((rng.uniform(0.1, 1.0, m * k), (rows, cols)), shape=(m, n)).astype(np.float32)
    s.sum_duplicates()
    a = CSRMatrix.from_scipy(s)
    norm = np.asarray(s.astype(np.float64).sum(axis=0)).ravel()
    g = rng.poisson(s.astype(np.float64) @ rng.uniform(0.5, 2.0, n)).astype(np.int32)
    be = CudaBackend(a, g, norm, None, bp="notrans")
    assert be.bp_kernel == "scatter" and be.describe()["smem_local_chunks"] == 0.0
    f = be.initial_image()
    for _ in range(10):
        f = be.iterate(f)
    ref = reference_mlem(s, g, norm, 10)
    assert rel_l2(be.to_host(f), ref) < 1e-5


def test_fused_forward_skipping_empty_rows_changes_no_bit(pet, monkeypatch):
    """With most rows empty the fused forward runs over the non-empty rows only (DeviceCSR.compact_rows);
    the image equals the unfused iteration's and the one without skipping bit for bit."""
    a = pet["a"]
    m, n = a.shape
    lengths = np.diff(a.indptr)
    spread = np.zeros(3 * m, dtype=np.int64)  # every row of A followed by two empty rows
    spread[::3] = lengths
    wide = CSRMatrix(np.concatenate(([0], np.cumsum(spread))), a.indices, a.data, (3 * m, n))
    g = np.zeros(3 * m, dtype=np.int32)
    g[::3] = pet["g"]
    g[1::3] = 5  # counts where the matrix has no row: c = g / 0 -> 0
    at = CSRMatrix.from_scipy(sp.csr_matrix((wide.data, wide.indices, wide.indptr), shape=wide.shape).T.tocsr())
    problem = {"a": wide, "at": at, "g": g, "norm": pet["norm"]}
    be, skipped = run_gpu(problem, "csr_vector", "csr_vector")
    assert be.a.compact_rows() is not None
    _, unfused = run_gpu(problem, "csr_vector", "csr_vector", fuse=False)
    np.testing.assert_array_equal(skipped, unfused)
    # the fused forward over the non-empty rows only, against every row: the same correlation
    f0 = be.initial_image()
    outs = []
    for skip in (True, False):
        out = cp.zeros(3 * m, dtype=cp.float32)
        ck.csr_vector(be.a, f0, out, mode=ck.MODE_CORR, aux0=be.g, skip_empty=skip, prepare=True)()
        outs.append(cp.asnumpy(out))
    np.testing.assert_array_equal(outs[0], outs[1])
    assert rel_l2(skipped, pet["ref"]) < 1e-5


def test_interleaved_layout_changes_the_rounding_only(pet, monkeypatch):
    """The csr_vector pair interleaves A and A^T for its lanes (DeviceCSR.set_layout); the image stays within
    float32 rounding of the one in column order and of float64. A DeviceCSR shared with a backend whose back
    projection scatters from A is put back in column order by it."""
    d_a, d_at = ck.DeviceCSR.from_host(pet["a"]), ck.DeviceCSR.from_host(pet["at"])
    shared = {**pet, "a": d_a, "at": d_at}
    be, f = run_gpu(shared, "csr_vector", "csr_vector", lanes=16)  # this matrix's short rows alone take 4
    assert be.describe()["layout"] == {"A": 16, "AT": 16} and d_a.layout == d_at.layout == 16
    be0, f0 = run_gpu(pet, "csr_scalar", "csr_scalar")  # one thread per row, each row in column order
    assert be0.describe()["layout"] == {"A": 0, "AT": 0}
    assert rel_l2(f, f0.astype(np.float64)) < 1e-6
    assert rel_l2(f, pet["ref"]) < 1e-5 and rel_l2(f0, pet["ref"]) < 1e-5
    d_a.set_layout(d_a.layout)  # no-op
    _, fs = run_gpu(shared, "csr_vector", "scatter", transpose=False)
    assert d_a.layout == 0
    assert rel_l2(fs, pet["ref"]) < 1e-5
