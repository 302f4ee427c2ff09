"""The direct, multi-threaded reads of a container's datasets (mlemlib.formats._direct) against h5py's own.

Every layout a container can have: chunked (the writers' 1 MiB chunks, a last
partial chunk), contiguous, chunks out of file order, and those h5py must read
(filters, chunks never written, big-endian data, a small read); ranges inside
one chunk, across chunk edges and the whole dataset; a matrix container read
both ways gives the same rows; a truncated file is one clear line.
"""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from mlemlib.errors import MatrixFormatError
from mlemlib.formats import _direct as D
from mlemlib.formats.h5 import MatrixH5


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    """Pieces and the h5py threshold small enough that these few-MB datasets go through many threads."""
    monkeypatch.setattr(D, "PIECE_BYTES", 1 << 16)
    monkeypatch.setattr(D, "MIN_BYTES", 1)


def _direct(path, name):
    f = h5py.File(path, "r")
    fd = os.open(path, os.O_RDONLY)
    return f, fd, D.DirectDataset.of(f[name], fd)


RANGES = [(0, 1), (5, 17), (1000, 70000), (65536, 131072), (123, 300_001), (0, 300_001), (300_000, 300_001)]


@pytest.mark.parametrize("layout", ["chunked", "contiguous", "chunked-u8", "chunked-f8"])
def test_direct_equals_h5py(tmp_path, layout):
    rng = np.random.default_rng(1)
    n = 300_001
    dtype = {"chunked-u8": np.uint8, "chunked-f8": np.float64}.get(layout, np.float32)
    data = (rng.random(n) * 1000).astype(dtype)
    p = tmp_path / "d.h5"
    with h5py.File(p, "w") as f:
        if layout == "contiguous":
            f.create_dataset("x", data=data)
        else:
            ds = f.create_dataset("x", shape=(0,), maxshape=(None,), dtype=dtype, chunks=(4096,))
            for a in range(0, n, 70_000):  # appended as the writers do, the last chunk partial
                b = min(n, a + 70_000)
                ds.resize((b,))
                ds[a:b] = data[a:b]
    f, fd, d = _direct(p, "x")
    try:
        assert d is not None
        for lo, hi in RANGES:
            out = np.full(hi - lo, 7, dtype=dtype)
            assert d.read(lo, hi, out)
            np.testing.assert_array_equal(out, data[lo:hi])
    finally:
        f.close()
        os.close(fd)


def test_chunks_out_of_file_order(tmp_path):
    """Chunks written back to front lie in the file in reverse: the runs follow the offsets, not the order."""
    n, c = 50_000, 1000
    data = np.arange(n, dtype=np.int32) * 3
    p = tmp_path / "r.h5"
    with h5py.File(p, "w") as f:
        ds = f.create_dataset("x", shape=(n,), dtype=np.int32, chunks=(c,))
        for a in range(n - c, -1, -c):
            ds[a : a + c] = data[a : a + c]
    f, fd, d = _direct(p, "x")
    try:
        runs = d.runs(0, n)
        assert len(runs) > 1 and runs[0][0] > runs[-1][0]  # the first elements sit last in the file
        out = np.empty(n, dtype=np.int32)
        assert d.read(0, n, out)
        np.testing.assert_array_equal(out, data)
        out = np.empty(n - 1999, dtype=np.int32)
        assert d.read(999, n - 1000, out)
        np.testing.assert_array_equal(out, data[999 : n - 1000])
    finally:
        f.close()
        os.close(fd)


@pytest.mark.parametrize("case", ["gzip", "unwritten", "big-endian", "2-d"])
def test_h5py_reads_what_direct_cannot(tmp_path, case):
    p = tmp_path / "x.h5"
    with h5py.File(p, "w") as f:
        if case == "gzip":
            f.create_dataset("x", data=np.arange(10_000, dtype=np.float32), chunks=(1000,), compression="gzip")
        elif case == "unwritten":
            ds = f.create_dataset("x", shape=(10_000,), dtype=np.float32, chunks=(1000,), fillvalue=2.0)
            ds[0:1000] = 1.0
        elif case == "big-endian":
            f.create_dataset("x", data=np.arange(10_000, dtype=">f4"))
        else:
            f.create_dataset("x", data=np.zeros((100, 100), dtype=np.float32))
    f, fd, d = _direct(p, "x")
    try:
        assert d is None
    finally:
        f.close()
        os.close(fd)


def _write_container(path, rng):
    from mlemlib.formats.h5 import MatrixH5Writer
    from mlemlib.matrix import CSRMatrix
    import scipy.sparse as sp

    a = sp.random(3000, 700, density=0.05, format="csr", random_state=np.random.RandomState(2), dtype=np.float32)
    a.data[:] = rng.random(a.nnz).astype(np.float32) + 0.1
    m = CSRMatrix(a.indptr.astype(np.int64), a.indices.astype(np.int32), a.data, a.shape)
    with MatrixH5Writer(path, shape=a.shape, nnz=a.nnz) as w:
        w.write_rows(m)
    return a


def test_container_reads_same_rows_both_ways(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    p = tmp_path / "m.h5"
    a = _write_container(p, rng)
    with MatrixH5(p) as src:
        direct = src.read_rows(100, 2900)
        assert src._direct["indices"] is not None and src._direct["data"] is not None  # the direct path ran
    monkeypatch.setattr(D, "MIN_BYTES", 1 << 40)  # everything through h5py
    with MatrixH5(p) as src:
        plain = src.read_rows(100, 2900)
        assert not src._direct
    ref = a[100:2900]
    for got in (direct, plain):
        np.testing.assert_array_equal(got.indptr - got.indptr[0], ref.indptr)
        np.testing.assert_array_equal(got.indices, ref.indices)
        np.testing.assert_array_equal(got.data, ref.data)


def test_truncated_file_is_one_line(tmp_path):
    rng = np.random.default_rng(4)
    p = tmp_path / "m.h5"
    _write_container(p, rng)
    src = MatrixH5(p)
    try:
        src.read_rows(0, 10)  # opens the direct readers' file
        size = p.stat().st_size
        with open(p, "r+b") as fh:  # the file loses its tail after it was opened
            fh.truncate(size // 3)
        with pytest.raises(MatrixFormatError, match=r"m\.h5.*file ends early"):
            src.read_rows(0, 3000)
    finally:
        src.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_reads_with_its_own_pool(tmp_path):
    """The pool's threads stay in the parent: a child forked after a direct read reads with a new pool (the old
    one would take its work and never run it)."""
    import multiprocessing as mp

    p = tmp_path / "d.h5"
    data = np.arange(200_000, dtype=np.float32)
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=data, chunks=(4096,))
    f, fd, d = _direct(p, "x")
    try:
        out = np.empty(data.size, dtype=np.float32)
        assert d.read(0, data.size, out) and D._pool is not None
        ctx = mp.get_context("fork")
        q = ctx.Queue()

        def child():
            got = np.empty(data.size, dtype=np.float32)
            q.put(bool(d.read(0, data.size, got)) and bool((got == data).all()))

        proc = ctx.Process(target=child)
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0 and q.get(timeout=5) is True
    finally:
        f.close()
        os.close(fd)
