"""The CUDA SpMV kernels against float64 SciPy products (GPU only: skipped without one).

Every kernel runs on fresh random inputs into an output poisoned with NaN and
must land within the float32 summation bound of a float64 reference, row by
row: ``|y_i - ref_i| <= (len_i + 2) * eps * (|A| |x|)_i``, which holds for any
summation order (so for the atomic kernels too) and fails for any wrong or
missing term. Matrices: random with empty rows and columns, rows far longer
than a block, one row, one element, no non-zeros, a wide matrix whose chunks
overflow shared memory, the synthetic tube-of-response matrix (sinogram order)
and rows traced by the scanner (detector-pair order).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

cp = pytest.importorskip("cupy")

from mlemlib.backends import _cuda_kernels as ck
from mlemlib.backends import _cuda_plan as plan
from mlemlib.bench import tor_matrix
from mlemlib.errors import ConfigError
from mlemlib.matrix import CSRMatrix

pytestmark = pytest.mark.gpu

EPS = float(np.finfo(np.float32).eps)


def random_csr(rng, m, n, lengths, *, signed=True, sort=True) -> CSRMatrix:
    """CSR with the given row lengths, distinct random columns, values in (-1, 1) or (0, 1)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    indptr = np.concatenate(([0], np.cumsum(lengths)))
    cols = []
    for k in lengths:
        c = rng.choice(n, size=int(k), replace=False) if k else np.zeros(0, dtype=np.int64)
        cols.append(np.sort(c) if sort else c)
    indices = np.concatenate(cols) if cols else np.zeros(0, dtype=np.int64)
    lo = -1.0 if signed else 0.0
    data = rng.uniform(lo, 1.0, size=int(indptr[-1])).astype(np.float32)
    if not signed:
        data = np.maximum(data, np.float32(1e-3))
    return CSRMatrix(indptr, indices, data, (m, n))


def scanner_rows(rng) -> CSRMatrix:
    system = pytest.importorskip("mlemlib.scanner.system")
    from mlemlib.scanner import get_preset

    rows = np.sort(rng.choice(get_preset("small").n_lors, size=1500, replace=False))
    return system.trace_rows("small", rows, rays=1)


def make_matrix(kind: str, rng) -> CSRMatrix:
    if kind == "random":
        lengths = rng.integers(0, 60, size=3000)
        lengths[rng.random(3000) < 0.1] = 0
        return random_csr(rng, 3000, 2000, lengths)
    if kind == "unsorted":
        return random_csr(rng, 500, 700, rng.integers(0, 40, size=500), sort=False)
    if kind == "long_rows":  # rows far longer than a block of 256 threads (x 4 per lane)
        lengths = rng.integers(1, 4, size=40)
        lengths[[3, 17, 39]] = [5000, 12345, 2049]
        return random_csr(rng, 40, 20000, lengths)
    if kind == "single_row":
        return random_csr(rng, 1, 1000, [701])
    if kind == "one_element":
        return random_csr(rng, 1, 1, [1])
    if kind == "nnz0":
        return random_csr(rng, 30, 40, np.zeros(30, dtype=np.int64))
    if kind == "empty_cols":  # columns >= 100 of 5000 never used: empty rows of A^T
        a = random_csr(rng, 400, 100, rng.integers(0, 30, size=400))
        return CSRMatrix(a.indptr, a.indices, a.data, (400, 5000))
    if kind == "short_rows":  # 1..3 per row: 2 lanes
        return random_csr(rng, 20000, 3000, rng.integers(1, 4, size=20000))
    if kind == "wide":  # chunks spanning far more columns than shared memory holds
        return random_csr(rng, 4000, 300000, rng.integers(20, 200, size=4000), signed=False)
    if kind == "tor":
        return tor_matrix(20, 16, 3, 12, 18)
    if kind == "scanner":
        return scanner_rows(rng)
    raise ValueError(kind)


MATRICES = [
    "random",
    "unsorted",
    "long_rows",
    "single_row",
    "one_element",
    "nnz0",
    "empty_cols",
    "short_rows",
    "wide",
    "tor",
    "scanner",
]


@pytest.fixture(params=MATRICES)
def problem(request):
    # fresh inputs for every run: seed from the OS, printed on failure
    seed = int(np.random.SeedSequence().entropy % (2**32))
    local = np.random.default_rng(seed)
    a = make_matrix(request.param, local)
    a.validate("test", check_values=False)
    d = ck.DeviceCSR.from_host(a)
    s64 = sp.csr_matrix((a.data.astype(np.float64), a.indices, a.indptr), shape=a.shape)
    x = local.uniform(0.5, 1.5, a.shape[1]).astype(np.float32)
    c = local.uniform(0.5, 1.5, a.shape[0]).astype(np.float32)
    return {"kind": request.param, "seed": seed, "a": a, "d": d, "s64": s64, "x": x, "c": c}


def check_bound(y_dev, ref, absref, lengths, what):
    y = cp.asnumpy(y_dev).astype(np.float64)
    assert not np.isnan(y).any(), f"{what}: {int(np.isnan(y).sum())} outputs never written (still NaN)"
    bound = (lengths + 2) * EPS * absref + 1e-30
    err = np.abs(y - ref)
    bad = np.flatnonzero(err > bound)
    assert bad.size == 0, (
        f"{what}: {bad.size} outputs outside the float32 bound, e.g. i={bad[0]}: {y[bad[0]]!r} vs {ref[bad[0]]!r}"
    )


def poisoned(n):
    out = cp.empty(n, dtype=cp.float32)
    out.fill(cp.nan)
    return out


FP_CASES = (
    [("csr_scalar", None, None)]
    + [("csr_vector", lanes, None) for lanes in plan.LANE_CHOICES]
    + [
        ("csr_vector", None, None),
        ("merge", None, 1),
        ("merge", None, 2),
        ("merge", None, 5),
        ("merge", None, 37),
        ("cusparse", None, None),
    ]
)


@pytest.mark.parametrize(("kernel", "lanes", "secsize"), FP_CASES)
def test_forward_kernels(problem, kernel, lanes, secsize):
    a, d, s64 = problem["a"], problem["d"], problem["s64"]
    x = problem["x"]
    ref = s64 @ x.astype(np.float64)
    absref = abs(s64) @ np.abs(x.astype(np.float64))
    out = poisoned(a.shape[0])
    y = ck.spmv(d, cp.asarray(x), out, kernel=kernel, lanes=lanes, secsize=secsize or plan.DEFAULT_SECSIZE)
    assert y is out
    check_bound(
        y,
        ref,
        absref,
        np.diff(a.indptr),
        f"{kernel} lanes={lanes} secsize={secsize} ({problem['kind']}, seed {problem['seed']})",
    )


@pytest.mark.parametrize(
    ("kernel", "lanes"),
    [("csr_vector", None), ("csr_vector", 2), ("csr_scalar", None), ("merge", None), ("cusparse", None)],
)
def test_back_kernels_on_transpose(problem, kernel, lanes):
    a, d, s64 = problem["a"], problem["d"], problem["s64"]
    t = d.transpose()
    c = problem["c"]
    ref = s64.T @ c.astype(np.float64)
    absref = abs(s64).T @ np.abs(c.astype(np.float64))
    out = poisoned(a.shape[1])
    y = ck.spmv(t, cp.asarray(c), out, kernel=kernel, lanes=lanes)
    check_bound(
        y,
        ref,
        absref,
        np.bincount(a.indices, minlength=a.shape[1]),
        f"{kernel} on A^T ({problem['kind']}, seed {problem['seed']})",
    )


SCATTER_CASES = [
    ("scatter", None),
    ("scatter", 2),
    ("scatter", 32),
    ("scatter_vec", None),
    ("scatter_vec", 4),
    ("scatter_smem", None),
    ("cusparse_notrans", None),
]


@pytest.mark.parametrize(("kernel", "lanes"), SCATTER_CASES)
def test_back_kernels_without_transpose(problem, kernel, lanes):
    a, d, s64 = problem["a"], problem["d"], problem["s64"]
    c = problem["c"]
    ref = s64.T @ c.astype(np.float64)
    absref = abs(s64).T @ np.abs(c.astype(np.float64))
    out = poisoned(a.shape[1])
    y = ck.scatter(d, cp.asarray(c), out, kernel=kernel, lanes=lanes)
    check_bound(
        y,
        ref,
        absref,
        np.bincount(a.indices, minlength=a.shape[1]),
        f"{kernel} ({problem['kind']}, seed {problem['seed']})",
    )


def test_scatter_skips_rows_with_zero_correlation(rng):
    a = make_matrix("tor", rng)
    d = ck.DeviceCSR.from_host(a)
    c = rng.uniform(0.5, 1.5, a.shape[0]).astype(np.float32)
    c[rng.random(a.shape[0]) < 0.5] = 0  # empty sinogram bins
    s64 = sp.csr_matrix((a.data.astype(np.float64), a.indices, a.indptr), shape=a.shape)
    ref = s64.T @ c.astype(np.float64)
    for kernel in ("scatter", "scatter_vec", "scatter_smem"):
        y = ck.scatter(d, cp.asarray(c), poisoned(a.shape[1]), kernel=kernel)
        check_bound(y, ref, ref, np.bincount(a.indices, minlength=a.shape[1]), kernel)


@pytest.mark.parametrize("m", [1, 2, 3, 97, 4096, 30030])
@pytest.mark.parametrize("spread", [True, False])
@pytest.mark.parametrize(("kernel", "lanes"), [("scatter", 32), ("scatter", 4), ("scatter_vec", 8)])
def test_scatter_takes_every_row_once_in_either_launch_order(m, spread, kernel, lanes):
    """Row r holds 1 at column r, with a neighbour at column (r + 1) mod m for the longer rows' trips: the
    output is c plus c rolled by one, exactly (one or two terms per column, integers), so that a row
    the launch order missed or took twice shows."""
    rows = np.arange(m)
    cols = np.stack([rows, (rows + 1) % m], axis=1) if m > 1 else rows[:, None]
    cols = np.sort(cols, axis=1)
    k = cols.shape[1]
    a = CSRMatrix(np.arange(0, m * k + 1, k), cols.ravel(), np.ones(m * k, np.float32), (m, m))
    c = np.arange(1, m + 1, dtype=np.float32)
    want = c + (np.roll(c, 1) if m > 1 else 0)
    y = ck.scatter(ck.DeviceCSR.from_host(a), cp.asarray(c), poisoned(m), kernel=kernel, lanes=lanes, spread=spread)
    assert np.array_equal(cp.asnumpy(y), want)


def test_scatter_smem_uses_both_paths(rng):
    """Chunks of the TOR matrix fit shared memory; chunks of the wide random matrix do not."""
    tor = ck.DeviceCSR.from_host(make_matrix("tor", rng))
    wide = ck.DeviceCSR.from_host(make_matrix("wide", rng))
    p_tor = ck.smem_plan(tor, chunk_nnz=4096)
    p_wide = ck.smem_plan(wide, chunk_nnz=4096)
    assert p_tor.local_fraction == 1.0
    assert p_wide.local_fraction == 0.0
    # chunk bounds: min/max column of each chunk, checked on the host
    a = tor.to_host()
    rows = cp.asnumpy(p_tor.chunk_rows)
    for b in range(len(rows) - 1):
        cols = a.indices[a.indptr[rows[b]] : a.indptr[rows[b + 1]]]
        if cols.size:
            assert (int(p_tor.cmin[b]), int(p_tor.cmax[b])) == (cols.min(), cols.max())
    for d, p in ((tor, p_tor), (wide, p_wide)):
        a = d.to_host()
        s64 = sp.csr_matrix((a.data.astype(np.float64), a.indices, a.indptr), shape=a.shape)
        c = rng.uniform(0.5, 1.5, a.shape[0]).astype(np.float32)
        ref = s64.T @ c.astype(np.float64)
        y = ck.scatter(d, cp.asarray(c), poisoned(a.shape[1]), kernel="scatter_smem", smem=p)
        check_bound(y, ref, ref, np.bincount(a.indices, minlength=a.shape[1]), "scatter_smem")


@pytest.mark.parametrize("kernel", ["csr_vector", "csr_scalar", "merge", "cusparse"])
def test_fused_epilogues(rng, kernel):
    """MODE_CORR writes g / (A x) (0 where A x == 0); MODE_UPDATE writes f * (A x) / norm (in place)."""
    a = make_matrix("tor", rng)
    d = ck.DeviceCSR.from_host(a)
    m, n = a.shape
    s64 = sp.csr_matrix((a.data.astype(np.float64), a.indices, a.indptr), shape=a.shape)
    x = rng.uniform(0.5, 1.5, n).astype(np.float32)
    g = rng.poisson(3.0, m).astype(np.float32)
    fp = s64 @ x.astype(np.float64)
    lengths = np.diff(a.indptr)
    c = ck.spmv(d, cp.asarray(x), poisoned(m), kernel=kernel, mode=ck.MODE_CORR, aux0=cp.asarray(g))
    c = cp.asnumpy(c).astype(np.float64)
    empty = fp == 0
    assert empty.any() and np.all(c[empty] == 0)
    ref = g[~empty] / fp[~empty]
    tol = (lengths[~empty] + 4) * EPS * np.abs(ref)
    assert np.all(np.abs(c[~empty] - ref) <= tol)

    # update on the transpose, in place: f <- f * (A^T y) / norm, norm == 0 -> f * (A^T y)
    t = d.transpose()
    y = rng.uniform(0.5, 1.5, m).astype(np.float32)
    f = rng.uniform(0.5, 1.5, n).astype(np.float32)
    norm = np.asarray(s64.sum(axis=0)).ravel().astype(np.float32)
    norm[:7] = 0
    f_dev = cp.asarray(f)
    out = ck.spmv(t, cp.asarray(y), f_dev, kernel=kernel, mode=ck.MODE_UPDATE, aux0=f_dev, aux1=cp.asarray(norm))
    assert out is f_dev
    bp = s64.T @ y.astype(np.float64)
    ref = f * bp / np.where(norm != 0, norm, 1.0)
    got = cp.asnumpy(out).astype(np.float64)
    tol = (np.bincount(a.indices, minlength=n) + 5) * EPS * np.abs(ref) + 1e-30
    assert np.all(np.abs(got - ref) <= tol)


def test_csr_vector_is_bit_identical_run_after_run():
    a = tor_matrix(64, 64, 6, 48, 60, device=True)
    x = cp.asarray(np.random.default_rng().uniform(0.5, 1.5, a.shape[1]).astype(np.float32))
    first = ck.spmv(a, x, kernel="csr_vector").copy()
    t = a.transpose()
    y = cp.asarray(np.random.default_rng().uniform(0.5, 1.5, a.shape[0]).astype(np.float32))
    first_t = ck.spmv(t, y, kernel="csr_vector").copy()
    for _ in range(3):
        assert cp.array_equal(ck.spmv(a, x, poisoned(a.shape[0]), kernel="csr_vector"), first)
        assert cp.array_equal(ck.spmv(t, y, poisoned(a.shape[1]), kernel="csr_vector"), first_t)
        assert cp.array_equal(
            ck.spmv(a, x, poisoned(a.shape[0]), kernel="csr_scalar"), ck.spmv(a, x, kernel="csr_scalar")
        )


@pytest.mark.parametrize("dims", [(20, 16, 3, 12, 18), (33, 17, 1, 7, 40), (9, 9, 5, 31, 6)])
def test_tor_matrix_on_device_equals_cpu(dims):
    host = tor_matrix(*dims)
    dev = tor_matrix(*dims, device=True).to_host()
    np.testing.assert_array_equal(dev.indptr, host.indptr)
    np.testing.assert_array_equal(dev.indices, host.indices)
    np.testing.assert_array_equal(dev.data, host.data)


@pytest.mark.parametrize("kind", ["random", "nnz0", "empty_cols", "tor"])
def test_device_transpose_equals_scipy(rng, kind):
    a = make_matrix(kind, rng)
    t = ck.DeviceCSR.from_host(a).transpose().to_host()
    ref = a.to_scipy().T.tocsr()
    ref.sort_indices()
    assert t.shape == (a.shape[1], a.shape[0])
    np.testing.assert_array_equal(t.indptr, ref.indptr)
    np.testing.assert_array_equal(t.indices, ref.indices)
    np.testing.assert_array_equal(t.data, ref.data)


def test_misaligned_arrays_are_copied(rng, caplog):
    a = make_matrix("random", rng)
    big_i = cp.zeros(a.nnz + 1, dtype=cp.int32)
    big_i[1:] = cp.asarray(a.indices)
    big_v = cp.zeros(a.nnz + 1, dtype=cp.float32)
    big_v[1:] = cp.asarray(a.data)
    with caplog.at_level(logging.WARNING):
        d = ck.DeviceCSR(cp.asarray(a.indptr), big_i[1:], big_v[1:], a.shape)
    assert "not 16-byte aligned" in caplog.text
    assert d.indices.data.ptr % 16 == 0 and d.data.data.ptr % 16 == 0
    x = rng.uniform(0.5, 1.5, a.shape[1]).astype(np.float32)
    s64 = sp.csr_matrix((a.data.astype(np.float64), a.indices, a.indptr), shape=a.shape)
    y = ck.spmv(d, cp.asarray(x), poisoned(a.shape[0]))
    check_bound(y, s64 @ x.astype(np.float64), abs(s64) @ x.astype(np.float64), np.diff(a.indptr), "aligned copy")


def test_bad_arguments(rng):
    d = ck.DeviceCSR.from_host(make_matrix("random", rng))
    x = cp.ones(d.shape[1], dtype=cp.float32)
    with pytest.raises(ConfigError, match="fp"):
        ck.spmv(d, x, kernel="ell")
    with pytest.raises(ConfigError, match="lanes"):
        ck.spmv(d, x, kernel="csr_vector", lanes=3)
    with pytest.raises(ConfigError, match="bp"):
        ck.scatter(d, cp.ones(d.shape[0], dtype=cp.float32), kernel="ell")
    with pytest.raises(ValueError, match="length"):
        ck.spmv(d, cp.ones(d.shape[1] + 1, dtype=cp.float32))
    with pytest.raises(ValueError, match="float32"):
        ck.spmv(d, cp.ones(d.shape[1], dtype=cp.float64))
    with pytest.raises(ValueError, match="inconsistent"):
        ck.DeviceCSR(d.indptr[:-1], d.indices, d.data, d.shape)


def test_device_properties_and_lanes(rng):
    props = ck.device_properties(cp.cuda.Device().id)
    assert props["sm_count"] > 0 and props["max_threads_per_sm"] >= 1024
    d = ck.DeviceCSR.from_host(make_matrix("short_rows", rng))
    assert d.lanes() == 2
    assert ck.DeviceCSR.from_host(make_matrix("long_rows", rng)).lanes() == 32


SHAPES = [plan.RowShape(256, False, 0), plan.RowShape(512, True, 0), plan.RowShape(1024, True, None),
          plan.RowShape(1024, False, 0), plan.RowShape(1024, True, 1), plan.RowShape(1024, False, 0, True, unroll=2),
          plan.RowShape(256, unroll=1), plan.RowShape(1024, False, 0, True, 2, unroll=1, row_bound=1024),
          plan.RowShape(256, False, 0, False, 2, row_bound=1024), plan.RowShape(768, False, 0, True, 2, unroll=2,
                                                                            row_bound=768)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.label())
@pytest.mark.parametrize("lanes", plan.BLOCK_LANES)
def test_csr_vector_launch_shapes_give_the_same_bits(problem, shape, lanes):
    """csr_block_L (any block size, rows in step or not, any grid) sums each row exactly as csr_vector_L."""
    d = problem["d"]
    x = cp.asarray(problem["x"])
    base = ck.spmv(d, x, poisoned(d.shape[0]), lanes=lanes).copy()
    got = ck.spmv(d, x, poisoned(d.shape[0]), lanes=lanes, shape=shape)
    assert cp.array_equal(got, base), f"{problem['kind']} (seed {problem['seed']}): {shape} differs"
    # the fused update epilogue too (the back projection's)
    f = cp.asarray(problem["c"])  # length m, like the image the back projection's epilogue updates
    norm = cp.ones(d.shape[0], dtype=cp.float32)
    ref = ck.spmv(d, x, poisoned(d.shape[0]), lanes=lanes, mode=ck.MODE_UPDATE, aux0=f.copy(), aux1=norm)
    fused = ck.spmv(d, x, poisoned(d.shape[0]), lanes=lanes, mode=ck.MODE_UPDATE, aux0=f.copy(), aux1=norm, shape=shape)
    assert cp.array_equal(fused, ref)


@pytest.mark.parametrize("lanes", plan.LANE_CHOICES)
def test_set_layout_stores_the_reference_order_and_keeps_the_product(problem, lanes):
    """set_layout(L) stores each row's elements where interleave_positions puts them; csr_vector on it stays
    within the float32 bound of float64, the same bits run after run and under every launch shape; set_layout(0),
    to_host and cusparse give back the arrays in column order exactly."""
    a, d, s64 = problem["a"], problem["d"], problem["s64"]
    what = f"{problem['kind']} (seed {problem['seed']}), {lanes} lanes"
    cols0, vals0 = d.indices.copy(), d.data.copy()
    # the host arrays as uploaded (SciPy may sort an unsorted matrix's indices, which s64 shares, in place)
    cols_h, vals_h = cp.asnumpy(cols0), cp.asnumpy(vals0)
    d.set_layout(lanes)
    assert d.layout == lanes
    pos = plan.interleave_positions(a.indptr, lanes)
    want_c, want_v = np.empty_like(cols_h), np.empty_like(vals_h)
    want_c[pos], want_v[pos] = cols_h, vals_h
    assert np.array_equal(cp.asnumpy(d.indices), want_c) and np.array_equal(cp.asnumpy(d.data), want_v), what
    x = problem["x"]
    y = ck.spmv(d, cp.asarray(x), poisoned(a.shape[0]), lanes=lanes).copy()
    check_bound(y, s64 @ x.astype(np.float64), abs(s64) @ np.abs(x.astype(np.float64)), np.diff(a.indptr), what)
    assert cp.array_equal(ck.spmv(d, cp.asarray(x), poisoned(a.shape[0]), lanes=lanes), y), what
    if lanes in plan.BLOCK_LANES:
        for shape in SHAPES:
            assert cp.array_equal(ck.spmv(d, cp.asarray(x), poisoned(a.shape[0]), lanes=lanes, shape=shape), y), what
    d.set_layout(32 if lanes != 32 else 16)  # from one interleaving to another, then back to column order
    d.set_layout(0)
    assert cp.array_equal(d.indices, cols0) and cp.array_equal(d.data, vals0), what
    d.set_layout(lanes)
    host = d.to_host()
    assert d.layout == 0 and np.array_equal(host.indices, cols_h) and np.array_equal(host.data, vals_h), what
    d.set_layout(lanes)
    ref = d.cusparse() @ cp.asarray(x)
    assert d.layout == 0, what
    check_bound(ref, s64 @ x.astype(np.float64), abs(s64) @ np.abs(x.astype(np.float64)), np.diff(a.indptr), what)
    with pytest.raises(ConfigError, match="lanes"):
        d.set_layout(3)


def test_block_shape_needs_block_lanes(rng):
    d = ck.DeviceCSR.from_host(random_csr(rng, 10, 10, np.full(10, 3)))
    with pytest.raises(ConfigError, match="block shape needs lanes"):
        ck.spmv(d, cp.ones(10, dtype=cp.float32), lanes=2, shape=plan.RowShape(1024, True, 0))
    with pytest.raises(ConfigError, match="needs lanes"):
        ck.spmv(d, cp.ones(10, dtype=cp.float32), lanes=4, shape=plan.RowShape(1024, row_bound=1024))


def test_row_kernel_refuses_rows_past_its_offsets(rng, monkeypatch):
    """csr_row_L keeps 32-bit offsets within a row: a matrix with a longer row is refused in one line, and tune
    does not time it there (the limit lowered to the test matrix's rows)."""
    d = ck.DeviceCSR.from_host(random_csr(rng, 64, 64, np.full(64, 9)))
    monkeypatch.setattr(plan, "ROW_KERNEL_MAX_LENGTH", 8)
    row = plan.RowShape(1024, False, 0, True, 2, unroll=1, row_bound=1024)
    with pytest.raises(ConfigError, match="at most 8 non-zeros; this matrix has one of 9"):
        ck.spmv(d, cp.ones(64, dtype=cp.float32), lanes=8, shape=row)
    d.tune(8, candidates=(plan.RowShape(), row), repeat=1)
    assert list(d.tuned) == [plan.RowShape().label()]


@pytest.mark.parametrize("shape", [None, *SHAPES], ids=lambda s: "own" if s is None else s.label())
def test_skip_empty_rows_computes_the_same_sums_and_leaves_empty_rows(rng, shape):
    """skip_empty: the non-empty rows get csr_vector's bits (plain and correlation), the empty rows are not
    written (a poisoned output keeps its NaN there), and the update epilogue refuses it."""
    lengths = rng.integers(1, 300, size=4000)
    lengths[rng.random(4000) < 0.6] = 0  # 60% empty rows, as madpet2's own order has 58%
    lengths[:5] = 0
    lengths[-7:] = 0  # empty rows before the first and after the last non-empty one
    a = random_csr(rng, 4000, 900, lengths, signed=False)
    d = ck.DeviceCSR.from_host(a)
    rows = d.compact_rows()
    nonempty = np.flatnonzero(lengths)
    assert cp.asnumpy(rows).tolist() == nonempty.tolist()
    x = cp.asarray(rng.uniform(0.5, 1.5, 900).astype(np.float32))
    g = cp.asarray(rng.poisson(3.0, 4000).astype(np.float32))
    empty = lengths == 0
    lanes = plan.BLOCK_LANES[-1] if shape is not None else None
    for mode, aux0 in ((ck.MODE_PLAIN, None), (ck.MODE_CORR, g)):
        ref = cp.asnumpy(ck.spmv(d, x, poisoned(4000), lanes=lanes, mode=mode, aux0=aux0, shape=shape))
        got = cp.asnumpy(ck.csr_vector(d, x, poisoned(4000), lanes=lanes, mode=mode, aux0=aux0, shape=shape,
                                       skip_empty=True, prepare=True)())
        assert np.array_equal(got[~empty], ref[~empty])
        assert np.all(ref[empty] == 0) and np.all(np.isnan(got[empty]))
    with pytest.raises(ValueError, match="skip_empty"):
        ck.csr_vector(d, x, poisoned(4000), mode=ck.MODE_UPDATE, aux0=g, aux1=g, skip_empty=True)


def test_compact_rows_only_where_many_rows_are_empty(rng):
    lengths = np.full(800, 5)
    lengths[:100] = 0  # exactly 1/8 empty: not worth a row list
    d = ck.DeviceCSR.from_host(random_csr(rng, 800, 50, lengths))
    assert d.compact_rows() is None
    x = cp.asarray(rng.uniform(0.5, 1.5, 50).astype(np.float32))
    full = ck.spmv(d, x, poisoned(800))
    got = ck.csr_vector(d, x, poisoned(800), skip_empty=True, prepare=True)()  # no list: every row written
    assert cp.array_equal(got, full)


def test_update_fixed_is_fixed_to_float_then_update_bit_for_bit(rng):
    """The fused update from the 64-bit fixed point gives the bits of fixed_to_float then update, and the
    update's three cases by hand: f * bp / norm, f * bp where norm == 0, f where norm is NaN."""
    from mlemlib.backends import _compressed_cuda as cc

    n = 50_000
    scale = 2.0**40
    bp_true = rng.uniform(0.0, 3.0, n)
    acc = cp.asarray(np.round(bp_true * scale).astype(np.uint64))
    f = cp.asarray(rng.uniform(0.1, 2.0, n).astype(np.float32))
    norm = rng.uniform(0.5, 4.0, n).astype(np.float32)
    norm[:5], norm[5:9] = 0.0, np.nan
    norm = cp.asarray(norm)
    bp = cc.fixed_to_float(acc, cp.empty(n, dtype=cp.float32), scale)
    two_step = ck.update(f, bp, norm)
    fused = ck.update_fixed(f, acc, scale, norm)
    assert cp.array_equal(fused, two_step)
    h_f, h_bp, h_norm = (cp.asnumpy(v) for v in (f, bp, norm))
    got = cp.asnumpy(fused)
    assert np.array_equal(got[:5], h_f[:5] * h_bp[:5])
    assert np.array_equal(got[5:9], h_f[5:9])
    assert np.array_equal(got[9:], h_f[9:] * h_bp[9:] / h_norm[9:])
    np.testing.assert_allclose(cp.asnumpy(bp), bp_true, rtol=1e-6)
    f_in = f.copy()
    assert ck.update_fixed(f_in, acc, scale, norm, out=f_in) is f_in and cp.array_equal(f_in, fused)


def test_builds_compiled_in_background_threads_launch_like_the_default_build(rng):
    """prefetch compiles real builds with NVRTC on several threads at once; module() hands out the modules
    those threads compiled, and their kernels compute the same bits as the default build's (the extra
    define changes nothing in the code)."""
    from mlemlib.backends import _build

    dev = cp.cuda.Device().id
    arch = str(cp.cuda.Device(dev).compute_capability)
    tag = f"{rng.integers(1 << 30)}"
    builds = [_build.Build("spmv", (f"-DMLEM_PREFETCH_TEST={tag}{i}",)) for i in range(4)]
    _build.prefetch(builds, dev)
    d = ck.DeviceCSR.from_host(random_csr(rng, 300, 200, rng.integers(0, 40, size=300)))
    x = cp.asarray(rng.uniform(0.5, 1.5, 200).astype(np.float32))
    want = ck.spmv(d, x, cp.empty(300, dtype=cp.float32), lanes=4).copy()
    for b in builds:
        mod = _build.module(b, dev)
        assert _build._pending[(b, arch)].result() is mod  # the background thread's compilation
        y = cp.empty(300, dtype=cp.float32)
        args = (d.indptr, d.indices, d.data, x, y, np.int64(300), np.int32(ck.MODE_PLAIN), y, y, np.uint64(0))
        ck._rows_launch(mod.get_function("csr_vector_4"), 300, 4, args)()
        assert cp.array_equal(y, want), b


def test_tuning_a_matrix_again_for_the_same_question_times_nothing(rng, monkeypatch):
    """A DeviceCSR tuned for some lanes, layout and candidates keeps its shape when asked again (a backend
    built again on the same matrix on the GPU); other lanes are timed."""
    d = ck.DeviceCSR.from_host(random_csr(rng, 4000, 3000, rng.integers(10, 60, size=4000)))
    first = d.tune(8)
    assert d.tuned_for is not None and d.tuned_for[0] == 8
    calls = []
    real = ck.spmv
    monkeypatch.setattr(ck, "spmv", lambda *a, **k: calls.append(k.get("shape")) or real(*a, **k))
    assert d.tune(8) == first and calls == []
    d.tune(16)
    assert calls and d.tuned_for[0] == 16


_LATE_OVERWRITE = r"""
extern "C" __global__ void late_overwrite(unsigned char* buf, long long n, long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)ns);
    for (long long i = threadIdx.x; i < n; i += blockDim.x) buf[i] = 0xff;
}"""


def late_overwrite(nbytes: int, ms: float = 50.0) -> None:
    """Queue on the current stream a kernel that waits ``ms`` and then overwrites a buffer of ``nbytes``, and free
    that buffer at once (the memory pool hands it to the next allocation of its size on this stream): work an
    upload on a stream of its own must not overtake."""
    buf = cp.empty(max(int(nbytes), 1), dtype=cp.uint8)
    kernel = cp.RawKernel(_LATE_OVERWRITE, "late_overwrite")
    kernel((1,), (256,), (buf, np.int64(buf.size), np.int64(ms * 1e6)))
    del buf


def test_an_upload_comes_after_the_current_streams_work(rng, tmp_path):
    """upload_rows copies on a stream of its own, after what the current stream queued before it: a row block
    with leading padding (whose zero fill is queued on the current stream) behind a kernel still running there,
    which then overwrites the memory the upload is given, arrives intact."""
    from mlemlib.formats import open_matrix, write_matrix_h5

    a = random_csr(rng, 900, 1000, rng.integers(1, 40, size=900), signed=False)
    write_matrix_h5(tmp_path / "a.h5", a)
    r0 = next(r for r in range(1, 900) if a.indptr[r] % ck.ALIGN)
    lo, hi = int(a.indptr[r0]), int(a.indptr[900])
    pad = lo % ck.ALIGN
    with open_matrix(tmp_path / "a.h5") as src:
        late_overwrite(4 * (hi - lo + pad))
        d = ck.upload_rows(src, r0, 900, 0, align=True)
    cp.cuda.Device().synchronize()
    assert np.array_equal(d.indices.get()[pad:], a.indices[lo:hi])
    assert np.array_equal(d.data.get()[pad:], a.data[lo:hi])
    assert not d.indices.get()[:pad].any() and not d.data.get()[:pad].any()


@pytest.mark.parametrize("suffix", [".h5", ".csr4"])
@pytest.mark.parametrize("align", [False, True])
def test_streamed_row_blocks_equal_the_file(rng, tmp_path, monkeypatch, suffix, align):
    """upload_rows streams a file's row range through the two pinned staging buffers (many small blocks here,
    a row longer than a block among them) and gives the rows' arrays as read on the host, with ``align``'s
    leading padding; the whole-matrix load takes the same path."""
    from mlemlib.formats import open_matrix, write_csr4, write_matrix_h5

    sys.path.insert(0, str(Path(__file__).parent))
    from test_formats import scanner_bytes

    lengths = rng.integers(0, 40, size=900)
    lengths[500] = 700  # longer than a block
    a = random_csr(rng, 900, 1000, lengths, signed=False)
    path = tmp_path / f"a{suffix}"
    if suffix == ".h5":
        write_matrix_h5(path, a)
    else:
        write_csr4(path, a, scanner_block=scanner_bytes(grid=(10, 10, 10)))
    monkeypatch.setattr(ck, "STAGE_NNZ", 300)
    with open_matrix(path) as src:
        for r0, r1 in ((0, 900), (7, 613), (613, 900), (50, 50)):
            d = ck.upload_rows(src, r0, r1, 0, align=align)
            lo, hi = int(a.indptr[r0]), int(a.indptr[r1])
            pad = lo % ck.ALIGN if align else 0
            assert d.shape == (r1 - r0, 1000)
            assert np.array_equal(d.indptr.get(), a.indptr[r0 : r1 + 1] - lo + pad)
            assert np.array_equal(d.indices.get()[pad:], a.indices[lo:hi])
            assert np.array_equal(d.data.get()[pad:], a.data[lo:hi])
            assert not d.indices.get()[:pad].any() and not d.data.get()[:pad].any()
        whole = ck.load_device(src)
        assert np.array_equal(whole.indices.get(), a.indices) and np.array_equal(whole.indptr.get(), a.indptr)
