"""The set-up's phase record (mlemlib.setup_times): exclusive nesting, threads, device synchronisation, the
log line, the readers' bytes, and a run's timings.json (CPU; one GPU test of the CUDA backend's record)."""

from __future__ import annotations

import json
import logging
import threading

import numpy as np
import pytest
import scipy.sparse as sp

from mlemlib import setup_times
from mlemlib.formats import open_matrix, write_matrix_h5
from mlemlib.matrix import CSRMatrix
from mlemlib.mlem import reconstruct
from mlemlib.problem import ModelSpec, RunSettings
from mlemlib.setup_times import SetupTimes, format_line, phase, recording


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _recorder(syncs: list | None = None) -> tuple[SetupTimes, Clock]:
    clock = Clock()
    return SetupTimes(clock=clock, sync=(lambda: syncs.append(clock.now)) if syncs is not None else None), clock


def _matrix(m: int = 300, n: int = 120, seed: int = 3) -> CSRMatrix:
    a = sp.random(m, n, density=0.1, random_state=seed, format="csr", dtype=np.float32)
    return CSRMatrix.from_scipy(a)


def test_nested_phases_are_exclusive_and_add_up_to_the_total():
    rec, clock = _recorder()
    with rec.phase("tune"):
        clock.now += 1.0
        with rec.phase("compile"):
            clock.now += 2.0
            with rec.phase("read", nbytes=1000):
                clock.now += 0.5
        clock.now += 0.25
    clock.now += 0.75  # outside every phase
    rec.finish()
    clock.now += 10.0  # after finish: not counted
    d = rec.as_dict()
    assert d["tune"] == pytest.approx(1.25) and d["compile"] == pytest.approx(2.0) and d["read"] == pytest.approx(0.5)
    assert d["other"] == pytest.approx(0.75) and d["total"] == pytest.approx(4.5)
    assert d["read_bytes"] == 1000 and "background" not in d
    assert list(d)[:3] == ["read", "compile", "tune"]  # PHASES order, not the order they ran in
    assert sum(v for k, v in d.items() if k not in ("total", "read_bytes")) == pytest.approx(d["total"])


def test_repeated_phases_accumulate():
    rec, clock = _recorder()
    for _ in range(3):
        with rec.phase("to_gpu"):
            clock.now += 0.5
        with rec.phase("wait_read"):
            clock.now += 0.25
    d = rec.as_dict()
    assert d["to_gpu"] == pytest.approx(1.5) and d["wait_read"] == pytest.approx(0.75)


def test_other_threads_record_in_the_background():
    rec = SetupTimes()
    ready = threading.Event()

    def reader() -> None:
        with rec.phase("read", nbytes=4096):
            pass
        with rec.phase("check"):
            pass
        ready.set()

    t = threading.Thread(target=reader)
    t.start()
    t.join()
    assert ready.is_set()
    with rec.phase("to_gpu"):
        pass
    d = rec.as_dict()
    assert set(d["background"]) == {"read", "check"} and "read" not in d and "to_gpu" in d
    assert d["read_bytes"] == 4096  # bytes from every thread


def test_device_phases_synchronise_at_their_ends_only():
    syncs: list = []
    rec, clock = _recorder(syncs)
    with rec.phase("to_gpu", device=True):
        clock.now += 1.0
    assert syncs == [100.0, 101.0]
    with rec.phase("open"):  # host work: no synchronisation
        clock.now += 1.0
    assert len(syncs) == 2
    with pytest.raises(RuntimeError), rec.phase("tune", device=True, nbytes=8):
        raise RuntimeError("launch failed")
    assert len(syncs) == 3  # at the start only: an error is not hidden behind a second one
    assert rec.read_bytes == 0 and "tune" in rec.seconds


def test_without_a_recorder_phases_do_nothing():
    assert setup_times.active() is None
    with phase("to_gpu", device=True):  # would need a GPU to synchronise: must not try
        pass

    calls = []

    @setup_times.timed("check")
    def check(x):
        calls.append(x)
        return x + 1

    assert check(1) == 2 and calls == [1]
    with recording() as rec:
        assert check(2) == 3
    assert "check" in rec.seconds and check.__name__ == "check"


def test_recording_joins_the_active_recorder_and_finishes_its_own():
    with recording() as outer:
        assert setup_times.active() is outer
        with recording() as inner:
            assert inner is outer
        assert outer.ended is None  # joined: the outer set-up goes on
        own = SetupTimes()
        with recording(own) as got:
            assert got is own and setup_times.active() is own
        assert own.ended is not None and setup_times.active() is outer
    assert outer.ended is not None and setup_times.active() is None
    with pytest.raises(ValueError), recording():
        raise ValueError("set-up failed")
    assert setup_times.active() is None


def test_the_log_line():
    setup = {"read": 3.1, "check": 0.5, "wait_read": 2.0, "to_gpu": 1.2, "compile": 0.0001, "tune": 0.8,
             "warm_up": 0.06, "other": 0.3, "total": 12.3, "read_bytes": 7_700_000_000,
             "background": {"read": 6.0, "check": 2.9}}
    assert format_line(setup) == (
        "set-up 12.3 s: read 7.7 GB in 9.10 s (0.85 GB/s; 6.00 s of it in the background), "
        "checks 3.40 s (2.90 s of it in the background), waiting for reads 2.00 s, to GPU 1.20 s, "
        "tune 0.80 s, warm-up 0.06 s, other 0.30 s"
    )
    assert format_line({"other": 0.0, "total": 0.5, "read_bytes": 0}) == "set-up 0.50 s: other 0.00 s"


def test_records_keeps_and_logs_a_backend_set_up(caplog):
    class Backend:
        name = "toy"

        @setup_times.records
        def __init__(self, seconds: float) -> None:
            with phase("warm_up"):
                self.seconds = seconds

    with caplog.at_level(logging.INFO, logger="mlemlib.setup_times"):
        be = Backend(1.0)
    assert be.seconds == 1.0 and set(be.setup_record) >= {"warm_up", "other", "total", "read_bytes"}
    assert any(r.getMessage().startswith("toy backend: set-up ") for r in caplog.records)
    assert setup_times.active() is None


def test_process_age():
    age = setup_times.process_age()
    assert 0.0 < age < 30 * 86400.0
    assert setup_times.process_age() >= age


def test_readers_count_the_bytes_they_read(tmp_path):
    a = _matrix()
    path = tmp_path / "matrix.h5"
    write_matrix_h5(path, a)
    m = a.shape[0]
    with recording() as rec, open_matrix(path) as f:
        block = f.read_rows(10, 200)
    k = block.nnz
    assert rec.read_bytes == 8 * (200 - 10 + 1) + 8 * k  # the row pointer's range, columns and values
    assert {"open", "read", "check"} <= set(rec.seconds)
    with recording() as rec, open_matrix(path) as f:
        blocks = list(f.iter_chunks(max_nnz=500))  # read ahead on a helper thread
    assert sum(b.nnz for _, _, b in blocks) == a.nnz
    assert rec.read_bytes >= 8 * a.nnz + 8 * (m + 1)
    assert "read" in rec.as_dict().get("background", {})


def test_csr4_reads_count_their_bytes(tmp_path):
    from mlemlib.formats import write_csr4
    from mlemlib.formats.csr4 import ScannerGeometry

    a = _matrix()  # n = 120 = 6 x 5 x 4 voxels
    geometry = ScannerGeometry(layers=[(2.0, 2.0, 10.0, 50.0, 0.096)], n_blocks=8, block_size=2, block_gaps=[0.25],
                               n_rings=1, ring_gaps=[], voxel_size=(2.0, 2.0, 2.0), grid=(6, 5, 4))
    path = tmp_path / "matrix.csr4"
    write_csr4(path, a, scanner_block=geometry.to_bytes())
    with recording() as rec, open_matrix(path) as f:
        block = f.read_rows(0, a.shape[0])
    assert rec.read_bytes == 8 * block.nnz and "read" in rec.seconds


def test_a_run_records_its_set_up(tmp_path, caplog):
    a = _matrix()
    path = tmp_path / "matrix.h5"
    write_matrix_h5(path, a)
    g = np.random.default_rng(1).poisson(5.0, a.shape[0]).astype(np.int32)
    with caplog.at_level(logging.INFO, logger="mlemlib.mlem"):
        t = reconstruct(ModelSpec(path, g), RunSettings(2, checkpoint_every=0, backend="cpu"),
                        tmp_path / "run" / "image.h5")
    phases = t["setup"]["phases"]
    assert {"open", "read", "check", "problem"} <= set(phases)
    assert phases["read_bytes"] >= 8 * a.nnz  # the norm's pass and the backend's load read the matrix
    assert t["setup"]["first_iteration_s"] >= phases["total"] >= t["setup"]["backend_s"]
    on_disk = json.loads((tmp_path / "run" / "timings.json").read_text())
    assert on_disk["setup"]["phases"] == phases and {"load_s", "backend_s"} <= set(on_disk["setup"])
    assert any(r.getMessage().startswith("first iteration after ") and "(set-up " in r.getMessage()
               for r in caplog.records)


@pytest.mark.gpu
def test_cuda_backend_describes_its_set_up(tmp_path, caplog):
    from mlemlib.backends.cuda import CudaBackend

    a = _matrix(2000, 300)
    path = tmp_path / "matrix.h5"
    write_matrix_h5(path, a)
    g = np.ones(a.shape[0], dtype=np.float32)
    norm = np.asarray(a.to_scipy().sum(axis=0), dtype=np.float64).reshape(-1)
    with caplog.at_level(logging.INFO), open_matrix(path) as src:
        be = CudaBackend(src, g, norm, fp="csr_vector", bp="scatter", tune=True)
    setup = be.describe()["setup"]
    assert {"init", "to_gpu", "wait_read", "tune", "warm_up"} <= set(setup)
    assert setup["read_bytes"] >= 8 * a.nnz
    phases = [v for k, v in setup.items() if k not in ("total", "read_bytes", "background")]
    # each phase and the total are rounded to the microsecond on their own
    assert setup["total"] == pytest.approx(sum(phases), abs=1e-6 * (len(phases) + 1))
    assert any(r.getMessage().startswith("cuda backend: set-up ") for r in caplog.records)
