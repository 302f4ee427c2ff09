"""GPU energy from NVML with a fake pynvml, and its records in the MLEM loop (no GPU needed)."""

from __future__ import annotations

import logging
import sys
import types

import numpy as np
import pytest

from mlemlib import devices
from mlemlib.problem import ModelSpec, RunSettings


class FakeNVMLError(Exception):
    pass


def _fake_nvml(counters: dict[str, list[int]], *, unsupported: set[str] = frozenset()):
    """A pynvml whose energy counter of the GPU at bus id B returns counters[B] one value per call (mJ)."""
    calls = {"init": 0, "shutdown": 0}

    def energy(handle):
        if handle in unsupported:
            raise FakeNVMLError("Not Supported")
        return counters[handle].pop(0)

    def init():
        calls["init"] += 1

    def shutdown():
        calls["shutdown"] += 1

    nvml = types.SimpleNamespace(
        NVMLError=FakeNVMLError,
        nvmlInit=init,
        nvmlShutdown=shutdown,
        nvmlDeviceGetHandleByPciBusId=lambda bus: bus,
        nvmlDeviceGetHandleByIndex=lambda i: ["0000:00:06.0", "0000:00:07.0"][i],
        nvmlDeviceGetTotalEnergyConsumption=energy,
    )
    return nvml, calls


def test_energy_of_two_gpus_hand_computed(monkeypatch):
    # First value of each list: the support check at construction. GPU 0 draws 450.5 J, GPU 1 300.25 J.
    nvml, calls = _fake_nvml({"0000:00:06.0": [999_000, 1_000_000, 1_450_500],
                              "0000:00:07.0": [1_999_000, 2_000_000, 2_300_250]})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    gpus = [{"index": 0, "pci_bus_id": "0000:00:06.0"}, {"index": 1, "pci_bus_id": "0000:00:07.0"}]
    with devices.EnergyMeter(gpus) as meter:
        assert meter.available
        e0, e1 = meter.read(), meter.read()
        assert e0 == pytest.approx(3000.0) and e1 - e0 == pytest.approx(750.75)
        assert meter.note == "NVML total energy of GPU 0, 1"
    assert calls == {"init": 1, "shutdown": 1} and not meter.available


def test_energy_by_cuda_index_without_bus_id(monkeypatch):
    # No bus id and no CuPy: the CUDA index is taken as NVML's (devices._nvml_handle).
    nvml, _ = _fake_nvml({"0000:00:07.0": [5, 7_000, 9_500]})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setitem(sys.modules, "cupy", None)
    meter = devices.EnergyMeter([1], world=4)
    assert meter.read() == pytest.approx(7.0) and meter.read() == pytest.approx(9.5)
    assert "this process's 1 of 4 GPUs" in meter.note


def test_unsupported_counter_is_not_available(monkeypatch, caplog):
    nvml, calls = _fake_nvml({"0000:00:06.0": [1, 2, 3]}, unsupported={"0000:00:06.0"})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with caplog.at_level(logging.DEBUG, logger="mlemlib.devices"):
        meter = devices.EnergyMeter([{"index": 0, "pci_bus_id": "0000:00:06.0"}])
    assert not meter.available and meter.read() is None
    assert meter.note.startswith("not available: NVML energy counter not supported")
    assert len([r for r in caplog.records if "GPU energy" in r.getMessage()]) == 1
    assert calls["shutdown"] == 1


def test_no_pynvml_and_cpu_are_not_available(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    meter = devices.EnergyMeter([0])
    assert meter.read() is None and "pynvml" in meter.note
    cpu = devices.EnergyMeter([])
    assert cpu.read() is None and cpu.note == "not available: no GPU (cpu backend)"


def test_counter_failing_later_gives_none(monkeypatch):
    nvml, _ = _fake_nvml({})
    counters = iter([1, 2])

    def energy(handle):
        try:
            return next(counters)
        except StopIteration:
            raise FakeNVMLError("GPU is lost") from None

    nvml.nvmlDeviceGetTotalEnergyConsumption = energy
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    meter = devices.EnergyMeter(["0000:00:06.0"])
    assert meter.read() == pytest.approx(0.002)
    assert meter.read() is None and "GPU is lost" in meter.note


def test_backend_gpus_from_describe():
    one = {"backend": "cuda", "device": {"index": 0, "name": "H200", "pci_bus_id": "0000:00:06.0"}}
    many = {"backend": "cuda-nccl", "devices": [{"index": 0, "part": 0}, {"index": 1, "part": 1}]}
    assert devices.backend_gpus(one) == [one["device"]]
    assert [d["index"] for d in devices.backend_gpus(many)] == [0, 1]
    assert devices.backend_gpus({"backend": "cpu", "device": {"name": "host", "index": 0}}) == []
    assert devices.backend_gpus(None) == []


def test_energy_record_hand_computed():
    r = devices.energy_record(120.0, 2.0, 10, "NVML total energy of GPU 0", 1, {"power": 0.5, "thermal": 0.0})
    assert r == {"energy_J": 120.0, "energy_per_iteration_J": 12.0, "power_W": 60.0, "energy_gpus": 1,
                 "energy_note": "NVML total energy of GPU 0", "clock_capped_s": {"power": 0.5, "thermal": 0.0}}
    none = devices.energy_record(None, 2.0, 10, "not available: x")
    assert none["energy_J"] is None and none["energy_per_iteration_J"] is None and none["power_W"] is None
    assert none["clock_capped_s"] is None


def _with_caps(nvml, violation_ns: dict[str, list[tuple[int, int]]]):
    """``nvml`` with NVML's violation counters: violation_ns[bus] one (power, thermal) pair in ns per reading."""
    def status(handle, policy):
        if policy == 0:
            pair = violation_ns[handle].pop(0)
            status.pending[handle] = pair[1]
            return types.SimpleNamespace(referenceTime=0, violationTime=pair[0])
        return types.SimpleNamespace(referenceTime=0, violationTime=status.pending.pop(handle))

    status.pending = {}
    nvml.nvmlDeviceGetViolationStatus = status
    return nvml


def test_clock_capping_of_two_gpus_hand_computed(monkeypatch):
    # First pair of each list: the support check at construction. GPU 0 is held down by its power limit for
    # 1.5 s between the two readings, GPU 1 for 0.25 s and by heat for 2 s.
    nvml, _ = _fake_nvml({"0000:00:06.0": [1, 2], "0000:00:07.0": [1, 2]})
    _with_caps(nvml, {"0000:00:06.0": [(0, 0), (10_000_000_000, 0), (11_500_000_000, 0)],
                      "0000:00:07.0": [(0, 0), (1_000_000_000, 5_000_000_000), (1_250_000_000, 7_000_000_000)]})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with devices.EnergyMeter(["0000:00:06.0", "0000:00:07.0"]) as meter:
        assert meter.available and meter.caps_available
        c0, c1 = meter.capped(), meter.capped()
        assert c0 == [{"power": 10.0, "thermal": 0.0}, {"power": 1.0, "thermal": 5.0}]
        assert devices.capped_between(c0, c1) == pytest.approx({"power": 1.5, "thermal": 2.0})  # the most of any GPU
    assert meter.capped() is None and not meter.caps_available  # closed
    assert devices.capped_between(None, c1) is None and devices.capped_between(c0, c1[:1]) is None
    # a counter that went back (a driver reload between the readings) counts as no capping, not a negative time
    assert devices.capped_between(c1, c0) == {"power": 0.0, "thermal": 0.0}


def test_energy_without_clock_capping_counters(monkeypatch):
    nvml, _ = _fake_nvml({"0000:00:06.0": [1, 2000]})  # a pynvml without nvmlDeviceGetViolationStatus
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    meter = devices.EnergyMeter(["0000:00:06.0"])
    assert meter.available and not meter.caps_available
    assert meter.capped() is None and meter.read() == pytest.approx(2.0)


# --------------------------------------------------------------------------- in the MLEM loop
def _problem():
    import scipy.sparse as sp

    from mlemlib.matrix import CSRMatrix

    a = sp.random(60, 24, density=0.3, random_state=3, format="csr", dtype=np.float32)
    g = np.random.default_rng(3).poisson(a @ np.ones(24) * 30).astype(np.int32)
    return CSRMatrix.from_scipy(a), g


def test_cpu_run_records_no_energy(tmp_path):
    from mlemlib.mlem import reconstruct

    a, g = _problem()
    t = reconstruct(ModelSpec(a, g), RunSettings(3, repetitions=2, checkpoint_every=0, backend="cpu"),
                    tmp_path / "image.h5")
    for rec in t["repetitions"]:
        assert rec["energy_J"] is None and rec["energy_per_iteration_J"] is None and rec["power_W"] is None
        assert rec["energy_note"] == "not available: no GPU (cpu backend)"


def test_gpu_run_records_energy_per_repetition(tmp_path, monkeypatch):
    """A cpu run dressed as a GPU run: fake GPUs, a fake meter; energy read around each repetition's loop."""
    from mlemlib import bench, mlem
    from mlemlib.backends.cpu import CpuBackend

    events: list[str] = []
    copied: list[list] = []

    class Meter:
        def __init__(self, gpus, *, world=None):
            self.gpus, self.available, self.note = list(gpus), True, "fake meter of GPU 0"
            self.joules = 1000.0

        def read(self):
            events.append("read")
            self.joules += 30.0  # 30 J between two readings: one repetition's loop
            return self.joules

        def capped(self):  # held down by the power limit 0.125 s per loop
            self.power_s = getattr(self, "power_s", 7.0) + 0.125
            return [{"power": self.power_s, "thermal": 1.0}]

        def close(self):
            events.append("close")

    monkeypatch.setattr(mlem, "backend_gpus", lambda desc: [{"index": 0}])
    monkeypatch.setattr(mlem, "EnergyMeter", Meter)
    monkeypatch.setattr(bench, "record_copy_bandwidths", lambda gpus: copied.append(gpus))
    monkeypatch.setattr(CpuBackend, "synchronize", lambda self: events.append("sync"), raising=False)
    a, g = _problem()
    t = mlem.reconstruct(ModelSpec(a, g), RunSettings(5, repetitions=2, checkpoint_every=0, backend="cpu"),
                         tmp_path / "image.h5")
    assert copied == [[{"index": 0}]]  # once per run
    assert events == ["sync", "read", "sync", "read"] * 2 + ["close"]
    for rec in t["repetitions"]:
        assert rec["energy_J"] == pytest.approx(30.0)
        assert rec["energy_per_iteration_J"] == pytest.approx(6.0)  # 30 J / 5 iterations
        assert rec["power_W"] > 0 and rec["energy_gpus"] == 1 and rec["energy_note"] == "fake meter of GPU 0"
        assert rec["clock_capped_s"] == pytest.approx({"power": 0.125, "thermal": 0.0})
        # the readings are outside the iterations: each iteration's time is one step sample
        assert rec["steps"]["iteration"]["n"] == 5


def test_bytes_per_nnz_of_several_blocks():
    """describe()'s bytes_per_nnz (every backend; NcclBackend passes its shards' blocks together)."""
    from mlemlib.backends.base import bytes_per_nnz

    blk = types.SimpleNamespace
    shards = [blk(a=blk(nnz=100, nbytes=900), at=None), blk(a=blk(nnz=300, nbytes=1500), at=None)]
    got = {"A": bytes_per_nnz(*(s.a for s in shards)), "AT": bytes_per_nnz(*(s.at for s in shards))}
    assert got == {"A": pytest.approx(2400 / 400), "AT": None}
