"""The chunk plan of a shared-memory one pass (mlemlib.chunked): its structure and its one-pass step."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib import chunked, reorder
from mlemlib.matrix import CSRMatrix


def _hand() -> CSRMatrix:
    # rows {0,1,2}, {1,2,3}, {10,11}
    return CSRMatrix.from_scipy(sp.csr_matrix(
        (np.arange(1, 9, dtype=np.float32), [0, 1, 2, 1, 2, 3, 10, 11], [0, 3, 6, 8]), shape=(3, 12)))


def _random(m=700, n=900, seed=0) -> CSRMatrix:
    rng = np.random.default_rng(seed)
    # rows that share voxels with their neighbours (a band), some empty
    rows, cols = [], []
    for i in range(m):
        if rng.random() < 0.1:
            continue
        c0 = int(i * (n - 60) / m)
        k = int(rng.integers(1, 40))
        rows += [i] * k
        cols += list(c0 + rng.choice(60, size=k, replace=False))
    a = sp.csr_matrix((rng.uniform(0.1, 1.0, len(rows)), (rows, cols)), shape=(m, n)).astype(np.float32)
    a.sort_indices()
    return CSRMatrix.from_scipy(a)


def test_plan_by_hand():
    p = chunked.build_plan(_hand(), window=4)
    assert p.chunk_rows.tolist() == [0, 2, 3]
    assert p.vptr.tolist() == [0, 4, 6]
    assert p.voxels.tolist() == [0, 1, 2, 3, 10, 11]
    assert p.local.tolist() == [0, 1, 2, 1, 2, 3, 0, 1]
    assert p.chunks == 2 and p.reuse == pytest.approx(8 / 6)
    # room for 3 voxels: every row alone
    assert chunked.build_plan(_hand(), window=3).chunk_rows.tolist() == [0, 1, 2, 3]
    # a row cap: 2 rows per chunk although 100 voxels would fit
    a = _hand()
    rows = np.arange(3, dtype=np.int64)
    assert chunked.greedy_chunks(a.indptr, a.indices, rows, 12, 100)[0].tolist() == [0, 3]
    starts, distinct = chunked.greedy_chunks(a.indptr, a.indices, rows, 12, 100, 2)
    assert starts.tolist() == [0, 2, 3] and distinct.tolist() == [4, 2]
    # a non-zero cap: rows of 3, 3 and 2 non-zeros, at most 5 per chunk (a longer row alone)
    starts, distinct = chunked.greedy_chunks(a.indptr, a.indices, rows, 12, 100, 100, 5)
    assert starts.tolist() == [0, 1, 3] and distinct.tolist() == [3, 5]
    assert chunked.greedy_chunks(a.indptr, a.indices, rows, 12, 100, 100, 2)[0].tolist() == [0, 1, 2, 3]


def test_plan_caps_the_non_zeros_of_a_chunk(monkeypatch):
    """No chunk holds more than MAX_CHUNK_NNZ non-zeros (one block's work), and the plan still rebuilds A."""
    a = _random()
    whole = chunked.build_plan(a, window=5000)
    sizes = np.diff(np.asarray(a.indptr)[whole.chunk_rows])
    assert sizes.max() > 2000  # the window alone lets chunks grow past the cap below
    monkeypatch.setattr(chunked, "MAX_CHUNK_NNZ", 2000)
    p = chunked.build_plan(a, window=5000)
    sizes = np.diff(np.asarray(a.indptr)[p.chunk_rows])
    assert sizes.max() <= 2000 and p.chunks > whole.chunks
    np.testing.assert_array_equal(p.columns(a.indptr), a.indices)


@pytest.mark.parametrize("window", [40, 64, 300, 5000])
def test_plan_rebuilds_the_columns(window):
    a = _random()
    p = chunked.build_plan(a, window=window)
    np.testing.assert_array_equal(p.columns(a.indptr), a.indices)
    assert p.local.dtype == np.uint16 and int(p.local.max()) < window
    counts = np.diff(p.vptr)
    assert counts.max() <= window and p.chunk_rows[-1] == a.shape[0]
    for c in range(p.chunks):
        v = p.voxels[p.vptr[c] : p.vptr[c + 1]]
        assert (np.diff(v) > 0).all()  # sorted, distinct
        cols = a.indices[a.indptr[p.chunk_rows[c]] : a.indptr[p.chunk_rows[c + 1]]]
        assert set(v.tolist()) == set(cols.tolist())
    # the same chunks as voxel_reuse's count over the stored order
    assert reorder.voxel_reuse(a, window=window)["reuse"] == pytest.approx(p.reuse)
    assert p.bytes_per_nnz() > 6


def _step_problem(a: CSRMatrix, seed: int):
    """(f, g, fp64, bp64): an image, a Poisson measurement, and the one-pass step's float64 fp and bp."""
    rng = np.random.default_rng(seed)
    f = rng.uniform(0.5, 1.5, a.shape[1]).astype(np.float32)
    g = rng.poisson(a.to_scipy() @ rng.uniform(0.5, 2.0, a.shape[1])).astype(np.float32)
    s64 = a.to_scipy().astype(np.float64)
    fp64 = s64 @ f.astype(np.float64)
    c64 = np.where(fp64 > 0, g / np.where(fp64 > 0, fp64, 1.0), 0.0)
    return f, g, fp64, s64.T @ c64


def test_onepass_through_the_plan_equals_float64():
    a = _random(seed=3)
    f, g, fp64, bp64 = _step_problem(a, 1)
    for window in (40, 300):
        bp, fp = chunked.onepass(chunked.build_plan(a, window=window), a.indptr, a.data, g, f)
        assert np.linalg.norm(fp - fp64) / np.linalg.norm(fp64) < 1e-6
        assert np.linalg.norm(bp - bp64) / np.linalg.norm(bp64) < 1e-6


def test_plan_refusals_and_empty():
    with pytest.raises(ValueError, match="window must lie"):
        chunked.build_plan(_hand(), window=0)
    with pytest.raises(ValueError, match="window must lie"):
        chunked.build_plan(_hand(), window=1 << 17)
    with pytest.raises(ValueError, match="a row has 3 non-zeros, more than the window of 2"):
        chunked.build_plan(_hand(), window=2)
    empty = CSRMatrix.from_scipy(sp.csr_matrix((4, 5), dtype=np.float32))
    p = chunked.build_plan(empty)
    assert p.chunks == 1 and len(p.voxels) == 0 and p.bytes_per_nnz() == 0.0
    bp, fp = chunked.onepass(p, empty.indptr, empty.data, np.ones(4), np.ones(5))
    assert not bp.any() and not fp.any()
    with pytest.raises(ValueError, match="g must have 4 entries"):
        chunked.onepass(p, empty.indptr, empty.data, np.ones(3), np.ones(5))


# --------------------------------------------------------------------------- the chunks on the device
class _HostArray(np.ndarray):
    """A NumPy array standing in for device memory (CuPy's ``get``)."""

    def get(self):
        return np.asarray(self).copy()


def _host_cupy():
    """The CuPy calls DeviceChunked.upload makes, on host arrays: its streaming logic tested without a GPU."""
    from types import SimpleNamespace

    return SimpleNamespace(
        empty=lambda n, dtype: np.empty(n, dtype=dtype).view(_HostArray),
        asarray=lambda a: np.array(a).view(_HostArray),
        concatenate=lambda xs: np.concatenate(xs).view(_HostArray),
        int64=np.int64, int32=np.int32, uint16=np.uint16, float32=np.float32, float16=np.float16,
        cuda=SimpleNamespace(Device=lambda: SimpleNamespace(attributes={"MultiProcessorCount": 4})),
    )


UPLOAD_ON = ("host", pytest.param("gpu", marks=pytest.mark.gpu))


def _check_chunks(d, a: CSRMatrix, window: int, blocks: list[tuple[int, int]]) -> None:
    """d holds a's values and row pointer, and its chunks rebuild a's columns; no chunk crosses a block's end."""
    ip = np.asarray(a.indptr, dtype=np.int64)
    pos = chunked.stored_positions(ip)  # the kernel's layout (rows padded, groups interleaved)
    np.testing.assert_array_equal(d.indptr.get(), chunked.padded_indptr(ip))
    stored = d.data.get()
    assert len(stored) == d.indptr.get()[-1] < a.nnz + 4 * a.shape[0]
    np.testing.assert_array_equal(stored[pos], a.data)
    pad = np.ones(len(stored), dtype=bool)
    pad[pos] = False
    assert not stored[pad].any() and not d.local.get()[pad].any()  # the padding adds nothing
    # every chunk is launched once, the smallest last (the stand-in's 4 multiprocessors, on a GPU its own)
    order = d.order.get()
    np.testing.assert_array_equal(np.sort(order), np.arange(d.chunks))
    sizes = np.diff(d.indptr.get()[d.chunk_rows.get()])
    tail = min(d.chunks, chunked.TAIL_WAVES * 4)
    if tail and d.chunks > tail:
        assert sizes[order[-tail:]].max() <= sizes[order[:-tail]].min()
    cr, vptr, vox, loc = d.chunk_rows.get(), d.vptr.get(), d.voxels.get(), d.local.get()[pos]
    assert cr[0] == 0 and cr[-1] == a.shape[0] and (np.diff(cr) > 0).all()
    assert (np.diff(cr) <= chunked.MAX_CHUNK_ROWS).all() and (np.diff(vptr) <= window).all()
    per_nnz = np.repeat(np.arange(len(cr) - 1), np.diff(ip[cr]))
    np.testing.assert_array_equal(vox[vptr[per_nnz] + loc.astype(np.int64)], a.indices)
    ends = {r1 for _, r1 in blocks}
    for r0, r1 in blocks:
        assert r0 in set(cr.tolist())  # every block starts a chunk
    assert ends <= set(cr.tolist())
    assert d.nnz == a.nnz and d.reuse == pytest.approx(a.nnz / len(vox))


@pytest.mark.parametrize("where", UPLOAD_ON)
@pytest.mark.parametrize("source", ["memory", "h5"])
def test_chunked_upload_streams_block_by_block(tmp_path, monkeypatch, where, source):
    from mlemlib.backends import _compressed_cuda as gpu
    from mlemlib.formats import open_matrix
    from mlemlib.formats.h5 import write_matrix_h5
    from mlemlib.matrix import chunk_bounds

    if where == "host":
        monkeypatch.setattr(gpu, "cupy", _host_cupy)
    a = _random(seed=5)
    blocks = chunk_bounds(np.asarray(a.indptr, dtype=np.int64), 1500)
    assert len(blocks) > 3
    if source == "h5":
        write_matrix_h5(tmp_path / "a.h5", a)
        with open_matrix(tmp_path / "a.h5") as src:
            d = gpu.DeviceChunked.upload(src, window=64, max_nnz=1500)
    else:
        d = gpu.DeviceChunked.upload(a, window=64, max_nnz=1500)
    _check_chunks(d, a, 64, blocks)
    assert d.window == 64 and d.lanes() == 32 and d.shape == a.shape
    stored = int(chunked.padded_indptr(a.indptr)[-1])
    assert d.nbytes == 8 * (a.shape[0] + 1) + 6 * stored + 4 * len(d.voxels) + 8 * 2 * (d.chunks + 1) + 4 * d.chunks


def test_a_small_share_is_cut_into_chunks_that_fill_the_multiprocessors(monkeypatch):
    """chunk_cap_for: MAX_CHUNK_NNZ for a large share; nnz / (CHUNK_WAVES sms) for a small one (an OSEM subset on
    several GPUs), not below MIN_CHUNK_NNZ; the upload of a share with sms given keeps to it."""
    from mlemlib.backends import _compressed_cuda as gpu

    waves = chunked.CHUNK_WAVES
    assert chunked.chunk_cap_for(10**9, 132) == chunked.MAX_CHUNK_NNZ
    assert chunked.chunk_cap_for(7_500_000, 132) == 7_500_000 // (waves * 132) < chunked.MAX_CHUNK_NNZ
    assert chunked.chunk_cap_for(1000, 132) == chunked.MIN_CHUNK_NNZ
    monkeypatch.setattr(gpu, "cupy", _host_cupy)
    monkeypatch.setattr(chunked, "MIN_CHUNK_NNZ", 10)
    a = _random(seed=5)
    whole = gpu.DeviceChunked.upload(a, window=5000, max_nnz=10**6)
    d = gpu.DeviceChunked.upload(a, window=5000, max_nnz=10**6, sms=4)
    cap = a.nnz // (waves * 4)
    assert np.diff(whole.indptr.get()[whole.chunk_rows.get()]).max() > cap  # the window alone: larger chunks
    _check_chunks(d, a, 5000, [(0, a.shape[0])])
    assert np.diff(np.asarray(a.indptr)[d.chunk_rows.get()]).max() <= cap and d.chunks >= waves * 4


def test_launch_order_by_hand():
    """Row order, the tail_waves * sms smallest chunks last, largest first among them."""
    sizes = np.array([5, 1, 7, 3, 2, 9])
    np.testing.assert_array_equal(chunked.launch_order(sizes, 2, 1), [0, 2, 3, 5, 4, 1])
    np.testing.assert_array_equal(chunked.launch_order(sizes, 1, 2), [0, 2, 3, 5, 4, 1])
    np.testing.assert_array_equal(chunked.launch_order(sizes, 2, 0), np.arange(6))
    np.testing.assert_array_equal(chunked.launch_order(sizes, 4, 9), [5, 2, 0, 3, 4, 1])  # all: largest first
    assert chunked.launch_order(np.zeros(0, np.int64), 132).size == 0
    assert chunked.launch_order(sizes, 132).dtype == np.int32


def _long(m=600, n=5000, seed=0, top=700) -> CSRMatrix:
    """Rows of 0..top non-zeros from a moving band: whole groups of 128, several per row, and rests."""
    rng = np.random.default_rng(seed)
    rows, cols = [], []
    for i in range(m):
        k = int(rng.integers(0, top + 1)) if i % 7 else int(rng.choice([0, 1, 127, 128, 129, 256, 384]))
        width = max(2 * top, 400)
        c0 = int(i * (n - width) / m)
        rows += [i] * k
        cols += list(c0 + rng.choice(width, size=k, replace=False))
    a = sp.csr_matrix((rng.uniform(0.1, 1.0, len(rows)), (rows, cols)), shape=(m, n)).astype(np.float32)
    a.sort_indices()
    return CSRMatrix.from_scipy(a)


def test_interleave_by_hand():
    """A row of 130 (padded to 132: one whole group of 128, then 4 in order) and a row of 3 (padded to 4)."""
    ip = np.array([10, 140, 143])  # a block's pointer need not start at 0
    assert chunked.padded_indptr(ip).tolist() == [0, 132, 136]
    pos = chunked.stored_positions(ip)
    # element 32 t + l of the whole group at 4 l + t: lane l's trips 0..3 side by side
    assert pos[[0, 1, 31, 32, 33, 64, 127]].tolist() == [0, 4, 124, 1, 5, 2, 127]
    assert pos[128:].tolist() == [128, 129, 132, 133, 134]
    local = np.arange(133, dtype=np.uint16)
    data = np.arange(1, 134, dtype=np.float32)
    pip, loc, dat = chunked.interleave(ip, local, data)
    assert pip.tolist() == [0, 132, 136]
    assert dat[[0, 4, 1, 5, 128, 129, 130, 131, 132, 134, 135]].tolist() == [1, 2, 33, 34, 129, 130, 0, 0, 131, 133, 0]
    # what lane l reads: 4 values at 4 l of the group, then elements l, l + 32, ... of the rest
    for lane in (0, 7, 31):
        assert dat[4 * lane : 4 * lane + 4].tolist() == [1 + lane + 32 * t for t in range(4)]


@pytest.mark.parametrize("top", [5, 140, 700])
def test_interleave_equals_its_reference_and_round_trips(top):
    a = _long(seed=top, top=top)
    ip = np.asarray(a.indptr, dtype=np.int64)
    local = (np.arange(a.nnz) % 65535 + 1).astype(np.uint16)
    pip, loc, dat = chunked.interleave(ip, local, a.data)
    pos = chunked.stored_positions(ip)
    assert len(np.unique(pos)) == a.nnz and len(dat) == pip[-1]
    np.testing.assert_array_equal(loc[pos], local)
    np.testing.assert_array_equal(dat[pos], a.data)
    assert (pip % chunked.VEC == 0).all() and (np.diff(pip) - np.diff(ip) < chunked.VEC).all()
    pad = np.ones(len(dat), dtype=bool)
    pad[pos] = False
    assert not loc[pad].any() and not dat[pad].any()
    # every lane reads its row's elements l, l + 32, l + 64, ... in that order
    for r in range(0, a.shape[0], 37):
        row = dat[pip[r] : pip[r + 1]]
        whole = len(row) // 128 * 128
        seq = np.concatenate([row[:whole].reshape(-1, 32, 4).transpose(0, 2, 1).reshape(-1), row[whole:]])
        np.testing.assert_array_equal(seq[: ip[r + 1] - ip[r]], a.data[ip[r] : ip[r + 1]])


@pytest.mark.parametrize("where", UPLOAD_ON)
@pytest.mark.parametrize("fmt", ["compressed", "compressed-f16", "compressed-u16"])
@pytest.mark.parametrize("source", ["memory", "h5"])
def test_chunked_upload_of_a_compressed_matrix_keeps_its_decoded_values(tmp_path, monkeypatch, where, fmt, source):
    """Compressed rows are decoded block by block; 16-bit values stay float16 / uint16 times the row scale, exactly."""
    from mlemlib.backends import _compressed_cuda as gpu
    from mlemlib.compressed import CompressedMatrix
    from mlemlib.formats import open_matrix
    from mlemlib.formats.compressed_h5 import write_compressed_h5

    if where == "host":
        monkeypatch.setattr(gpu, "cupy", _host_cupy)
    cm = CompressedMatrix.from_csr(_long(m=400, n=5000, seed=21, top=300), fmt)
    decoded = cm.to_csr()
    if source == "h5":
        write_compressed_h5(tmp_path / "c.h5", cm)
        with open_matrix(tmp_path / "c.h5") as src:
            d = gpu.DeviceChunked.upload(src, window=2048, max_nnz=20_000)
    else:
        d = gpu.DeviceChunked.upload(cm, window=2048, max_nnz=20_000)
    assert d.format == fmt and d.half == (fmt != "compressed") and d.nnz == cm.nnz
    pos = chunked.stored_positions(decoded.indptr)
    stored = d.data.get()[pos]
    if d.half:
        assert stored.dtype == cm.values.dtype
        # the encoder's scale, or (float16) twice it where a row's largest value rounded up to 2^15 times the scale
        assert np.isin(d.scale.get() / cm.scale, [1.0, 2.0] if fmt == "compressed-f16" else [1.0]).all()
        lengths = np.diff(decoded.indptr)
        np.testing.assert_array_equal(stored.astype(np.float32) * np.repeat(d.scale.get(), lengths), decoded.data)
        stored_bytes = 8 * (cm.shape[0] + 1) + 4 * len(d.data) + 4 * len(d.voxels) + 16 * (d.chunks + 1) + 4 * cm.shape[0]
        stored_bytes += 4 * d.chunks  # the launch order
        assert d.nbytes == stored_bytes
    else:
        np.testing.assert_array_equal(stored, decoded.data)
    vox, vptr, cr = d.voxels.get(), d.vptr.get(), d.chunk_rows.get()
    per_nnz = np.repeat(np.arange(len(cr) - 1), np.diff(decoded.indptr[cr]))
    np.testing.assert_array_equal(vox[vptr[per_nnz] + d.local.get()[pos].astype(np.int64)], decoded.indices)


@pytest.mark.parametrize("fmt", ["compressed-f16", "compressed-u16"])
def test_half_rows_refuses_values_that_are_not_16_bits_times_a_row_scale(fmt):
    from mlemlib.compressed import CompressedMatrix

    a = _long(m=50, n=5000, seed=22, top=100)
    cm = CompressedMatrix.from_csr(a, fmt)
    dec = cm.to_csr()
    given = cm.scale if fmt == "compressed-u16" else None  # the integers come back from the row scales
    scale, values = chunked.half_rows(dec, fmt, scale=given)
    assert values.dtype == cm.values.dtype
    assert np.isin(scale / cm.scale, [1.0, 2.0] if fmt == "compressed-f16" else [1.0]).all()
    np.testing.assert_array_equal(values.astype(np.float32) * np.repeat(scale, np.diff(dec.indptr)), dec.data)
    if fmt == "compressed-u16":
        np.testing.assert_array_equal(values, cm.values[cm.codes < cm.code_high])
    kind = "float16" if fmt == "compressed-f16" else "uint16"
    with pytest.raises(ValueError, match=rf"block 3: row 1\d* has values that are not {kind} times .* \(not a {fmt}"):
        chunked.half_rows(a, fmt, scale=given, what="block 3", row0=100)
    if fmt == "compressed-u16":
        with pytest.raises(ValueError, match=r"block 3: compressed-u16 rows need their 50 row scales"):
            chunked.half_rows(dec, fmt, what="block 3")


def _chunked_images(runs, g, norm, iterations: int) -> list[np.ndarray]:
    """The image after ``iterations`` of ``bp=onepass_chunked`` for each ``(backend class, matrix)``, on the host."""
    images = []
    for backend, mat in runs:
        be = backend(mat, g, norm, bp="onepass_chunked")
        x = be.initial_image()
        for _ in range(iterations):
            x = be.iterate(x)
        images.append(np.asarray(be.to_host(x)))
    return images


def test_cpu_onepass_chunked_on_a_compressed_matrix_is_the_decoded_matrix_run():
    from mlemlib.backends.cpu import CpuBackend
    from mlemlib.compressed import CompressedMatrix

    a = _long(m=600, n=5000, seed=23, top=300)
    rng = np.random.default_rng(6)
    g = rng.poisson(a.to_scipy() @ rng.uniform(0.5, 2.0, a.shape[1])).astype(np.float32)
    for fmt in ("compressed", "compressed-f16", "compressed-u16"):
        cm = CompressedMatrix.from_csr(a, fmt)
        dec = cm.to_csr()
        norm = np.asarray(dec.to_scipy().sum(axis=0)).ravel()
        images = _chunked_images([(CpuBackend, cm), (CpuBackend, dec)], g, norm, 3)
        np.testing.assert_array_equal(images[0], images[1])


def test_chunked_upload_refuses_a_row_longer_than_the_window(monkeypatch):
    from mlemlib.backends import _compressed_cuda as gpu

    monkeypatch.setattr(gpu, "cupy", _host_cupy)
    with pytest.raises(ValueError, match="a row has 3 non-zeros, more than the window of 2"):
        gpu.DeviceChunked.upload(_hand(), window=2)


def test_chunk_scale_keeps_the_split_words_from_wrapping():
    """bound * scale < 2^52: a term's high part (q >> 20) is below 2^32, and 4,096 low parts (< 2^20) sum below 2^32."""
    from mlemlib.backends import _compressed_cuda as gpu

    for bound in (1e-30, 0.3, 1.0, 7.5, 1e12):
        s = gpu.chunk_scale(bound)
        assert bound * s < 2.0**52 and bound * s >= 2.0**51 and math.frexp(s)[0] == 0.5
    # the kernel's split sum, emulated: equal to the 64-bit sum of the terms, in any order
    rng = np.random.default_rng(0)
    q = rng.integers(0, 2**52 // chunked.MAX_CHUNK_ROWS, chunked.MAX_CHUNK_ROWS, dtype=np.uint64)
    for order in (q, q[::-1], rng.permutation(q)):
        lo = np.uint32(0)
        hi = np.uint32(0)
        for v in order:
            lo = np.uint32(lo + np.uint32(int(v) & 0xFFFFF))
            hi = np.uint32(hi + np.uint32(int(v) >> 20))
        assert (int(hi) << 20) + int(lo) == int(q.sum())


@pytest.mark.gpu
def test_chunked_onepass_on_the_gpu_equals_float64_and_repeats_bit_for_bit():
    import cupy as cp

    from mlemlib.backends import _compressed_cuda as gpu

    for a, cases in ((_random(m=3000, n=2000, seed=7), ((64, 5000), (16384, 1 << 26))),
                     (_long(m=3000, n=20000, seed=8), ((1024, 200_000), (16384, 1 << 26)))):
        _gpu_step_checks(cp, gpu, a, cases)


def _gpu_step_checks(cp, gpu, a, cases):
    f, g, fp64, bp64 = _step_problem(a, 2)
    fd, gd = cp.asarray(f), cp.asarray(g)
    for window, max_nnz in cases:
        d = gpu.DeviceChunked.upload(a, window=window, max_nnz=max_nnz)
        stats: dict = {}
        bp, fp = gpu.chunked_onepass(d, gd, fd, stats=stats)
        assert np.linalg.norm(fp.get() - fp64) / np.linalg.norm(fp64) < 1e-6
        assert np.linalg.norm(bp.get() - bp64) / np.linalg.norm(bp64) < 1e-6
        assert stats["scale"] * stats["bound"] < 2.0**52 and stats.get("retries", 0) == 0
        # the CPU's emulation of the kernel's arithmetic, same scale: the same bits (not yet run on a GPU when
        # written; a mismatch of a few ulps would mean the kernel's FMA contraction differs from the emulation)
        cbp, cfp, _ = chunked.onepass_fixed(chunked.build_plan(a, window=window), a.indptr, a.data, g, f,
                                            stats["scale"])
        np.testing.assert_array_equal(fp.get(), cfp)
        np.testing.assert_array_equal(bp.get(), cbp)
        again, _ = gpu.chunked_onepass(d, gd, fd)
        np.testing.assert_array_equal(bp.get(), again.get())
        # the chunks started in any order: the same integer sums, the same bits
        d.order = d.order[::-1].copy()
        rev, rfp = gpu.chunked_onepass(d, gd, fd)
        np.testing.assert_array_equal(bp.get(), rev.get())
        np.testing.assert_array_equal(fp.get(), rfp.get())
        fwd = gpu.chunked_forward(d, fd)
        np.testing.assert_array_equal(fwd.get(), fp.get())
        # a bound far too small: the overflow is detected and the step retried with a larger one
        stats = {}
        small, _ = gpu.chunked_onepass(d, gd, fd, bound=1e-12, stats=stats)
        assert stats["retries"] >= 1
        assert np.linalg.norm(small.get() - bp64) / np.linalg.norm(bp64) < 1e-6


@pytest.mark.gpu
def test_chunked_step_flags_a_sum_that_reaches_its_limit():
    """The chunked kernel's global adds: a chunk's sum below fixed_limits' red_lim is a reduction, a larger one
    is checked against its sum limit (2^63 / P on P GPUs), and the flag is set exactly where a voxel's sum
    reaches it; each voxel's adds are counted by the chunks whose voxel lists hold it."""
    import cupy as cp

    from mlemlib.backends import _compressed_cuda as gpu

    a = _random(m=3000, n=2000, seed=9)
    f, g, _, _ = _step_problem(a, 3)
    fd, gd = cp.asarray(f), cp.asarray(g)
    d = gpu.DeviceChunked.upload(a, window=64, max_nnz=5000)
    lists = np.asarray(d.voxels.get())
    assert gpu.column_count_max(d) == int(np.bincount(lists, minlength=2000).max()) > 1
    fp = cp.empty(3000, dtype=cp.float32)

    def run(limits):
        acc = cp.zeros(2000, dtype=cp.uint64)
        flag = cp.zeros(1, dtype=cp.int32)
        gpu.chunked_step(d, gd, fd, fp=fp, acc=acc, flag=flag, bound=gpu.onepass_bound(gd, fd), limits=limits)
        return acc.get(), int(flag.get()[0])

    sums, bad = run(None)
    assert bad == 0 and sums.max() > 2**20
    for limits in (gpu.fixed_limits(gpu.column_count_max(d), 4), (0, int(sums.max()) + 1)):
        again, bad = run(limits)
        assert bad == 0
        np.testing.assert_array_equal(again, sums)
    assert run((0, int(sums.max())))[1] == 2  # every add checked: the largest sum reaches the limit
    # every add a reduction (red_lim above every chunk's sum): the same integers, nothing read back to check
    again, bad = run(((1 << 64) - 1, int(sums.max())))
    assert bad == 0
    np.testing.assert_array_equal(again, sums)


@pytest.mark.gpu
def test_chunked_onepass_on_compressed_matrices_is_the_decoded_matrix_step_bit_for_bit():
    import cupy as cp

    from mlemlib.backends import _compressed_cuda as gpu
    from mlemlib.backends.cpu import CpuBackend
    from mlemlib.backends.cuda import CudaBackend
    from mlemlib.compressed import CompressedMatrix

    a = _long(m=3000, n=20000, seed=24)
    for fmt in ("compressed", "compressed-f16", "compressed-u16"):
        cm = CompressedMatrix.from_csr(a, fmt)
        dec = cm.to_csr()
        f, g, fp64, bp64 = _step_problem(dec, 3)
        d = gpu.DeviceChunked.upload(cm, window=16384)
        assert d.half == (fmt != "compressed") and d.kernel.endswith({"compressed": "onepass", "compressed-f16": "_f16",
                                                                       "compressed-u16": "_u16"}[fmt])
        stats: dict = {}
        bp, fp = gpu.chunked_onepass(d, cp.asarray(g), cp.asarray(f), stats=stats)
        cbp, cfp, _ = chunked.onepass_fixed(chunked.build_plan(dec, window=16384), dec.indptr, dec.data, g, f,
                                            stats["scale"])
        np.testing.assert_array_equal(fp.get(), cfp)
        np.testing.assert_array_equal(bp.get(), cbp)
        assert np.linalg.norm(bp.get() - bp64) / np.linalg.norm(bp64) < 1e-6
        norm = np.asarray(dec.to_scipy().sum(axis=0)).ravel()
        images = _chunked_images([(CudaBackend, cm), (CpuBackend, cm)], g, norm, 5)
        assert np.linalg.norm(images[0] - images[1]) / np.linalg.norm(images[1]) < 1e-6


def _backend_problem():
    """A random matrix, a Poisson measurement of it and its norm: the backends' problem in these tests."""
    a = _random(m=3000, n=2000, seed=9)
    rng = np.random.default_rng(4)
    g = rng.poisson(a.to_scipy() @ rng.uniform(0.5, 2.0, a.shape[1])).astype(np.float32)
    norm = np.asarray(a.to_scipy().sum(axis=0)).ravel()
    return a, g, norm


@pytest.mark.gpu
def test_cuda_backend_runs_onepass_chunked_like_onepass_fixed():
    from mlemlib.backends.cuda import CudaBackend

    a, g, norm = _backend_problem()
    images = {}
    for bp in ("onepass_fixed", "onepass_chunked"):
        be = CudaBackend(a, g, norm, bp=bp)
        assert be.deterministic and be.onepass
        f = be.initial_image()
        for _ in range(20):
            f = be.iterate(f)
        images[bp] = be.to_host(f)
        d = be.describe()
    assert d["bp"] == "onepass_chunked" and d["chunks"]["count"] >= 1 and d["bytes_per_nnz"]["A"] < 8
    ref = images["onepass_fixed"]
    assert np.linalg.norm(images["onepass_chunked"] - ref) / np.linalg.norm(ref) < 1e-6


@pytest.mark.gpu
def test_cuda_backend_chunked_overflow_is_redone_and_its_bound_kept():
    # The iteration reads the overflow flag after its update, into the other of two buffers: f stays as it
    # was, an overflow is redone from it with a larger bound, and that bound serves the next iterations (the
    # same bits as a run at that bound from the start).
    from mlemlib.backends.cuda import CudaBackend

    a, g, norm = _backend_problem()
    be = CudaBackend(a, g, norm, bp="onepass_chunked")
    f0 = be.initial_image()
    before = be.to_host(f0)
    f1 = be.iterate(f0)
    f2 = be.iterate(f1)
    assert f1 is not f0 and f2 is not f1 and np.array_equal(be.to_host(f0), before)
    assert "retry" not in be.last_step_times() and be.fixed_stats.get("retries", 0) == 0

    tight = CudaBackend(a, g, norm, bp="onepass_chunked")
    tight._fixed_bound *= 2.0**-40  # every term overflows the fixed point at this scale
    f = tight.iterate(tight.initial_image())
    assert tight.fixed_stats["retries"] >= 1 and "retry" in tight.last_step_times()
    retries, bound = tight.fixed_stats["retries"], tight._fixed_bound
    assert bound > be._fixed_bound * 2.0**-40
    f = tight.iterate(f)
    assert tight.fixed_stats["retries"] == retries and "retry" not in tight.last_step_times()

    same = CudaBackend(a, g, norm, bp="onepass_chunked")
    same._fixed_bound = bound
    h = same.iterate(same.initial_image())
    h = same.iterate(h)
    assert np.array_equal(tight.to_host(f), same.to_host(h))


def test_auto_takes_the_chunked_one_pass_from_the_sampled_reuse(tmp_path):
    """The rule (registry) and its input (a sample block's reuse): high for banded rows, low once shuffled."""
    from mlemlib import registry
    from mlemlib.formats import open_matrix
    from mlemlib.formats.h5 import write_matrix_h5

    for transpose, pair in ((False, "notrans"), (True, "csr_vector")):
        assert registry.choose_auto(None, transpose=transpose) == pair
        many = {"chunks": 1e6, "sms": 132}
        assert registry.choose_auto(registry.CHUNK_REUSE_MIN, transpose=transpose, **many) == "onepass_chunked"
        assert registry.choose_auto(registry.CHUNK_REUSE_MIN - 0.01, transpose=transpose, **many) == pair
    a = _random(m=4000, n=3000, seed=11)
    banded = chunked.sample_reuse(a, window=1024, max_nnz=20_000)
    # the same block's reuse by hand: build_plan of the middle block of chunk_bounds
    from mlemlib.matrix import chunk_bounds

    bounds = chunk_bounds(np.asarray(a.indptr, dtype=np.int64), 20_000)
    r0, r1 = bounds[len(bounds) // 2]
    block = CSRMatrix.from_scipy(a.to_scipy()[r0:r1])
    assert banded == pytest.approx(chunked.build_plan(block, window=1024).reuse)
    shuffled = CSRMatrix.from_scipy(a.to_scipy()[np.random.default_rng(0).permutation(a.shape[0])])
    low = chunked.sample_reuse(shuffled, window=1024, max_nnz=20_000)
    assert banded >= registry.CHUNK_REUSE_MIN > low
    # a sample holding the whole matrix: its reuse and chunks are the plan's
    whole = chunked.build_plan(a, window=1024)
    assert chunked.sample_chunks(a, window=1024, max_nnz=2 * a.nnz) == pytest.approx((whole.reuse, whole.chunks))
    # the middle block's chunks, scaled to the matrix
    reuse, chunks = chunked.sample_chunks(a, window=1024, max_nnz=20_000)
    assert chunks == pytest.approx(chunked.build_plan(block, window=1024).chunks * a.nnz / block.nnz)
    # with a transpose, the chunks must also fill the GPU (3.5 chunks here: fewer than 4 per multiprocessor)
    assert 1 < chunks < registry.CHUNK_WAVES_MIN
    assert registry.choose_auto(reuse, transpose=True, chunks=chunks, sms=1) == "csr_vector"
    assert registry.choose_auto(reuse, transpose=True, chunks=100 * chunks, sms=1) == "onepass_chunked"
    assert registry.choose_auto(reuse, transpose=False, chunks=chunks, sms=1) == "onepass_chunked"
    assert registry.choose_auto(reuse, transpose=True) == "csr_vector"  # no estimate: the pair
    # N GPUs, the same rule with each GPU's share of the chunks; the thesis layout keeps its pair
    assert registry.choose_auto(reuse, transpose=True, chunks=4 * chunks, sms=1) == "onepass_chunked"
    assert registry.choose_auto(reuse, transpose=True, chunks=4 * chunks, sms=1, gpus=4, layout="local") == "csr_vector"
    assert registry.choose_auto(reuse, transpose=True, chunks=400 * chunks, sms=1, gpus=4,
                                layout="local") == "onepass_chunked"
    assert registry.choose_auto(reuse, transpose=False, chunks=chunks, sms=1, gpus=2, layout="local") == "onepass_chunked"
    assert registry.choose_auto(reuse, transpose=True, chunks=400 * chunks, sms=1, gpus=2,
                                layout="thesis") == "csr_vector"
    # an opened file gives the same sample as the matrix in memory
    write_matrix_h5(tmp_path / "a.h5", a)
    with open_matrix(tmp_path / "a.h5") as src:
        assert chunked.sample_reuse(src, window=1024, max_nnz=20_000) == pytest.approx(banded)
    empty = CSRMatrix.from_scipy(sp.csr_matrix((3, 4), dtype=np.float32))
    assert chunked.sample_reuse(empty) is None


@pytest.mark.gpu
def test_cuda_backend_auto_takes_the_chunks_where_they_pay(monkeypatch):
    from mlemlib import registry
    from mlemlib.backends.cuda import CudaBackend

    a = _random(m=40000, n=40000, seed=12)  # a band: chunks of 4,096 rows reuse each voxel ~18 times
    shuffled = CSRMatrix.from_scipy(a.to_scipy()[np.random.default_rng(1).permutation(a.shape[0])])
    at_of = {id(mat): CSRMatrix.from_scipy(mat.to_scipy().T.tocsr()) for mat in (a, shuffled)}
    for mat, chunky in ((a, True), (shuffled, False)):
        g = np.ones(mat.shape[0], dtype=np.float32)
        norm = np.asarray(mat.to_scipy().sum(axis=0)).ravel()
        # the pair (a CSR matrix without a stored transpose is transposed on its GPU), as 10 chunks leave most of
        # the GPU idle
        for at in (None, at_of[id(mat)]):
            be = CudaBackend(mat, g, norm, at, bp="auto")
            d = be.describe()
            assert d["chunk_reuse_sample"] is not None and d["chunks_estimated"] < 100
            assert be.bp_kernel == "csr_vector", (chunky, at is None)
        f = be.iterate(be.initial_image())
        assert np.isfinite(be.to_host(f)).all()
        # the chunks once they would fill it, where they reuse voxels
        with monkeypatch.context() as mp:
            mp.setattr(registry, "CHUNK_WAVES_MIN", 0)
            for at in (None, at_of[id(mat)]):
                be = CudaBackend(mat, g, norm, at, bp="auto")
                if chunky:
                    assert be.bp_kernel == "onepass_chunked" and be.deterministic and be.at is None
                    assert be.transpose_source == "none"
                else:
                    assert be.bp_kernel == "csr_vector"
            f = be.iterate(be.initial_image())
            assert np.isfinite(be.to_host(f)).all()


# --------------------------------------------------------------------------- the GPU kernel's arithmetic on the CPU
def test_fixed_point_step_is_the_same_bits_for_any_chunking_and_close_to_float64():
    from mlemlib.backends._compressed_cuda import chunk_scale

    a = _random(m=1500, n=1200, seed=13)
    f, g, fp64, bp64 = _step_problem(a, 5)
    scale = chunk_scale(2.0**20 * float(np.asarray(a.to_scipy().sum(axis=0)).max()))
    runs = []
    for window, groups in ((40, 1), (300, 3), (5000, 2), (5000, None)):
        bp, fp, overflow = chunked.onepass_fixed(chunked.build_plan(a, window=window), a.indptr, a.data, g, f, scale,
                                                 groups=groups)
        assert not overflow
        runs.append((bp, fp))
    for bp, fp in runs[1:]:  # integer sums: the chunks and the tasks do not change a bit
        np.testing.assert_array_equal(bp, runs[0][0])
        np.testing.assert_array_equal(fp, runs[0][1])
    bp, fp = runs[0]
    assert np.linalg.norm(fp - fp64) / np.linalg.norm(fp64) < 1e-6
    assert np.linalg.norm(bp - bp64) / np.linalg.norm(bp64) < 1e-6
    # a scale far too large: every term overflows and says so
    assert chunked.onepass_fixed(chunked.build_plan(a), a.indptr, a.data, g, f, 2.0**80)[2]


def test_fp_sums_each_row_as_a_warp_does():
    """One row of 70 elements: lane l adds elements l, l + 32, l + 64 (fused), then the butterfly 16, 8, 4, 2, 1."""
    rng = np.random.default_rng(3)
    vals = rng.uniform(0.1, 1.0, 70).astype(np.float32)
    f = rng.uniform(0.5, 1.5, 70).astype(np.float32)
    a = CSRMatrix(np.array([0, 70], np.int64), np.arange(70, dtype=np.int32), vals, (1, 70))
    lanes = np.zeros(32, np.float64)
    for k in range(70):  # float64 holds a float32 product exactly; one rounding of each fused add
        lanes[k % 32] = np.float32(np.float64(vals[k]) * np.float64(f[k]) + lanes[k % 32])
    for o in (16, 8, 4, 2, 1):
        lanes = np.array([np.float32(lanes[i] + lanes[i ^ o]) for i in range(32)], np.float64)
    _, fp, _ = chunked.onepass_fixed(chunked.build_plan(a), a.indptr, a.data, np.ones(1, np.float32), f, 1.0)
    assert fp[0] == np.float32(lanes[0])


def test_cpu_backend_runs_onepass_chunked_like_float64_mlem():
    from mlemlib.backends.cpu import CpuBackend

    a = _random(m=1500, n=1200, seed=17)
    rng = np.random.default_rng(6)
    g = rng.poisson(a.to_scipy() @ rng.uniform(0.5, 2.0, a.shape[1])).astype(np.float32)
    norm = np.asarray(a.to_scipy().astype(np.float64).sum(axis=0)).ravel()
    s64 = a.to_scipy().astype(np.float64)
    ref = np.full(a.shape[1], g.sum() / norm.sum())
    for _ in range(20):
        fp = s64 @ ref
        ref = ref * (s64.T @ np.where(fp > 0, g / np.where(fp > 0, fp, 1.0), 0.0)) / np.where(norm > 0, norm, 1.0)
    images = []
    for _ in range(2):
        be = CpuBackend(a, g, norm, bp="onepass_chunked")
        f = be.initial_image()
        for _ in range(20):
            f = be.iterate(f)
        images.append(be.to_host(f))
    d = be.describe()
    assert d["bp"] == "onepass_chunked" and d["deterministic"] and d["fixed_point"]["scale"] > 0
    np.testing.assert_array_equal(images[0], images[1])
    assert np.linalg.norm(images[0] - ref) / np.linalg.norm(ref) < 1e-5


def test_mlem_info_prints_the_sampled_chunk_reuse(tmp_path, capsys):
    import argparse

    from mlemlib.cli import main
    from mlemlib.cli.info import run
    from mlemlib.errors import ConfigError
    from mlemlib.formats.h5 import write_matrix_h5
    from mlemlib.formats.lmsino import write_lmsino

    a = _random(m=40000, n=40000, seed=12)
    write_matrix_h5(tmp_path / "a.h5", a)
    assert main(["info", str(tmp_path / "a.h5"), "--chunks"]) == 0
    want = chunked.sample_reuse(a)
    assert f"chunk reuse  {want:.2f} per voxel" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "a.h5"), "--chunks", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["chunk_reuse_sample"] == pytest.approx(want)
    assert got["chunks_estimated"] == pytest.approx(chunked.sample_chunks(a)[1])
    write_lmsino(tmp_path / "g.LMsino", np.ones(5, np.int32))
    with pytest.raises(ConfigError, match="--chunks"):
        run(argparse.Namespace(file=tmp_path / "g.LMsino", matrix=None, quick=False, json=False, chunks=True))


def test_row_blocks_read_every_kind_of_source_alike(tmp_path):
    """Host CSR, SciPy, an opened file and a device CSR (arrays with .get) give the same blocks; others refused."""
    from types import SimpleNamespace

    from mlemlib.formats import open_matrix
    from mlemlib.formats.h5 import write_matrix_h5
    from mlemlib.matrix import chunk_bounds

    a = _random(seed=19)
    want = chunk_bounds(np.asarray(a.indptr, dtype=np.int64), 900)
    dev = SimpleNamespace(indptr=np.asarray(a.indptr, np.int64).view(_HostArray), indices=a.indices.view(_HostArray),
                          data=a.data.view(_HostArray), shape=a.shape, nnz=a.nnz)
    write_matrix_h5(tmp_path / "a.h5", a)
    with open_matrix(tmp_path / "a.h5") as src:
        for source in (a, a.to_scipy(), src, dev):
            got = list(chunked.row_blocks(source, 900))
            assert [(r0, r1) for r0, r1, _ in got] == want
            for r0, r1, block in got:
                ref = a.to_scipy()[r0:r1]
                np.testing.assert_array_equal(np.asarray(block.indptr), ref.indptr)
                np.testing.assert_array_equal(block.indices, ref.indices)
                np.testing.assert_array_equal(block.data, ref.data)
    with pytest.raises(TypeError, match="cannot read rows of list"):
        list(chunked.row_blocks([1, 2], 10))


def test_step_vectors_check_and_allocate(monkeypatch):
    """The one-pass launchers' shared vector check: bp and fp made when None, a wrong length refused by name."""
    from types import SimpleNamespace

    from mlemlib.backends import _compressed_cuda as gpu

    from mlemlib.backends import _build

    fake = lambda: SimpleNamespace(**vars(_host_cupy()), ndarray=np.ndarray)  # noqa: E731
    monkeypatch.setattr(gpu, "cupy", fake)
    monkeypatch.setattr(_build, "cupy", fake)
    g, f = np.ones(3, np.float32), np.ones(5, np.float32)
    bp, fp = gpu._step_vectors((3, 5), g, f, None, None)
    assert bp.shape == (5,) and fp.shape == (3,) and bp.dtype == fp.dtype == np.float32
    mine = np.zeros(5, np.float32)
    assert gpu._step_vectors((3, 5), g, f, mine, None)[0] is mine
    with pytest.raises(ValueError, match="fp must be a contiguous float32 CuPy vector of length 3"):
        gpu._step_vectors((3, 5), g, f, None, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="^f must"):
        gpu._step_vectors((3, 5), g, np.ones(5, np.float64), None, None)


def test_chunked_upload_refuses_u16_row_scales_its_one_fma_decode_cannot_hold(monkeypatch):
    """chunked_onepass_u16 decodes u * s as fma(2^23 + u, s, -2^23 s): a row scale of 2^100 or more (values
    above ~8e34) would overflow 2^23 s, so the upload refuses it, naming the row."""
    from mlemlib.backends import _compressed_cuda as gpu
    from mlemlib.compressed import CompressedMatrix

    monkeypatch.setattr(gpu, "cupy", _host_cupy)
    a = _long(m=40, n=5000, seed=25, top=50)
    a.data[a.indptr[7] : a.indptr[8]] *= np.float32(1e36)
    with pytest.raises(ValueError, match=r"matrix: row 7 has values above 2\^116 .*below 2\^100"):
        gpu.DeviceChunked.upload(CompressedMatrix.from_csr(a, "compressed-u16"), window=2048)
    d = gpu.DeviceChunked.upload(CompressedMatrix.from_csr(a, "compressed"), window=2048)  # float32 values: fine
    assert d.kernel == "chunked_onepass"


def test_auto_takes_the_chunks_at_a_lower_reuse_where_the_other_choice_is_the_fixed_point_pass():
    from mlemlib import registry

    low = (registry.CHUNK_REUSE_MIN_ONEPASS + registry.CHUNK_REUSE_MIN) / 2
    assert registry.choose_auto(low, transpose=False, fmt="compressed") == "onepass_chunked"
    assert registry.choose_auto(registry.CHUNK_REUSE_MIN_ONEPASS - 0.01, transpose=False, fmt="compressed") == "onepass_fixed"
    assert registry.choose_auto(low, transpose=True, fmt="compressed", chunks=1e6, sms=132) == "delta_vector"
    assert registry.choose_auto(low, transpose=False, fmt="csr") == "notrans"  # the scatter: the csr threshold
