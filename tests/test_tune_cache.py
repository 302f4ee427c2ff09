"""The launch-shape tuning cache (mlemlib.backends._tune_cache): its key, its invalidation, its files (CPU; one
GPU test of DeviceCSR.tune taking a cached shape)."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib.backends._tune_cache import ENV, TuneCache, file_identity, source_key, tune_key
from mlemlib.formats import InMemoryMatrix, open_matrix, write_matrix_h5
from mlemlib.matrix import CSRMatrix

DEVICE = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "cuda_runtime": 12080}
CANDIDATES = ["256t", "512t w0 stream"]


def _matrix(seed: int = 3) -> CSRMatrix:
    return CSRMatrix.from_scipy(sp.random(200, 90, density=0.1, random_state=seed, format="csr", dtype=np.float32))


def _key(source, *, what="A", rows=None, lanes=8, layout=0, device=DEVICE, kernels="k1", candidates=CANDIDATES):
    part = source_key(source, what, rows)
    assert part is not None
    return tune_key(part, lanes=lanes, layout=layout, candidates=candidates, device=device, kernels=kernels)


@pytest.fixture
def matrix_file(tmp_path):
    path = tmp_path / "matrix.h5"
    write_matrix_h5(path, _matrix())
    return path


def test_identity_of_a_matrix_file(matrix_file):
    with open_matrix(matrix_file) as f:
        ident = file_identity(f)
        assert ident == file_identity(matrix_file) | {"checksum": f.checksum}  # the container's recorded checksum
    st = matrix_file.stat()
    assert ident["path"] == os.fspath(matrix_file.resolve()) and ident["size"] == st.st_size
    assert ident["mtime_ns"] == st.st_mtime_ns and ident["checksum"]


def test_no_identity_no_cache():
    a = _matrix()
    assert file_identity(a) is None and source_key(a, "A") is None
    assert file_identity(InMemoryMatrix(a, "<matrix in memory>")) is None
    assert file_identity("/no/such/matrix.h5") is None


def test_key_changes_with_the_matrix_file(matrix_file, tmp_path):
    before = _key(matrix_file)
    assert _key(matrix_file) == before  # the same file, the same key
    os.utime(matrix_file, ns=(matrix_file.stat().st_atime_ns, matrix_file.stat().st_mtime_ns + 1_000_000))
    touched = _key(matrix_file)
    assert touched != before  # a new modification time
    write_matrix_h5(matrix_file, _matrix(seed=4))  # rewritten: size, mtime and checksum change
    assert _key(matrix_file) not in (before, touched)
    other = tmp_path / "copy.h5"
    other.write_bytes(matrix_file.read_bytes())
    assert _key(other) != _key(matrix_file)  # another path


def test_key_changes_with_the_block_the_device_and_the_kernels(matrix_file):
    base = _key(matrix_file)
    variants = [
        _key(matrix_file, what="AT"),
        _key(matrix_file, rows=(0, 100)),
        _key(matrix_file, rows=(100, 200)),
        _key(matrix_file, lanes=16),
        _key(matrix_file, layout=8),
        _key(matrix_file, device={**DEVICE, "name": "NVIDIA H200"}),
        _key(matrix_file, device={**DEVICE, "cuda_runtime": 13000}),
        _key(matrix_file, kernels="k2"),
        _key(matrix_file, candidates=CANDIDATES[:1]),
    ]
    keys = [json.dumps(k, sort_keys=True) for k in [base, *variants]]
    assert len(set(keys)) == len(keys)
    cache = TuneCache("unused")
    assert len({cache.path(k) for k in [base, *variants]}) == len(keys)


def test_cache_round_trip_and_invalidation(matrix_file, tmp_path):
    cache = TuneCache(tmp_path / "cache")
    key = _key(matrix_file)
    assert cache.get(key) is None  # no directory yet: a miss
    path = cache.put(key, "512t w0 stream", {"256t": 1.5, "512t w0 stream": 1.25})
    assert path == cache.path(key) and path.is_file()
    assert cache.get(key) == {"best": "512t w0 stream", "times_ms": {"256t": 1.5, "512t w0 stream": 1.25}}
    assert cache.get(_key(matrix_file, device={**DEVICE, "name": "Tesla V100"})) is None  # another device
    os.utime(matrix_file, ns=(matrix_file.stat().st_atime_ns, matrix_file.stat().st_mtime_ns + 1_000_000))
    assert cache.get(_key(matrix_file)) is None  # the matrix changed


def test_cache_reads_never_fail(matrix_file, tmp_path):
    cache = TuneCache(tmp_path / "cache")
    key = _key(matrix_file)
    path = cache.path(key)
    path.parent.mkdir()
    path.write_text("{ not json")
    assert cache.get(key) is None
    other = _key(matrix_file, lanes=4)  # an entry of another key under this key's name
    path.write_text(json.dumps({"key": other, "best": "256t", "times_ms": {"256t": 1.0}}))
    assert cache.get(key) is None
    path.write_text(json.dumps({"key": key, "best": 3, "times_ms": {}}))
    assert cache.get(key) is None


def test_cache_writes_that_fail_are_logged(matrix_file, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = TuneCache(blocker / "cache")  # below a file: cannot be made
    with caplog.at_level(logging.WARNING):
        assert cache.put(_key(matrix_file), "256t", {"256t": 1.0}) is None
    assert "not written" in caplog.text


def test_off_unless_a_directory_is_given(tmp_path):
    assert TuneCache.from_setting(None, env={}) is None
    assert TuneCache.from_setting(None, env={ENV: ""}) is None
    assert TuneCache.from_setting(None, env={ENV: str(tmp_path)}).directory == tmp_path
    assert TuneCache.from_setting(tmp_path / "c", env={ENV: "/elsewhere"}).directory == tmp_path / "c"
    cache = TuneCache(tmp_path)
    assert TuneCache.from_setting(cache) is cache


@pytest.mark.gpu
def test_tune_takes_the_cached_shape(matrix_file, tmp_path, caplog):
    from mlemlib.backends import _cuda_kernels as ck

    cache = TuneCache(tmp_path / "cache")
    with open_matrix(matrix_file) as src:
        a = ck.DeviceCSR.upload(src)
        first = a.tune(4, cache=cache, cache_key=source_key(src, "A"))
        entries = list((tmp_path / "cache").glob("tune-*.json"))
        assert len(entries) == 1
        b = ck.DeviceCSR.upload(src)
        with caplog.at_level(logging.INFO):
            second = b.tune(4, cache=cache, cache_key=source_key(src, "A"))
    assert second == first and b.row_shape == a.row_shape and b.tuned == a.tuned
    assert "from the tuning cache" in caplog.text
    x = ck.cupy().ones(a.shape[1], dtype=ck.cupy().float32)
    assert bool((ck.spmv(a, x) == ck.spmv(b, x)).all())
