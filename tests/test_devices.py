"""GPU facts: CUDA device numbers are mapped to NVML's by PCI bus id (no GPU needed)."""

from __future__ import annotations

import sys
import types

import pytest

from mlemlib import devices


@pytest.fixture
def leased_machine(monkeypatch):
    """A 4-GPU machine seen through a lease of its GPUs 2 and 3: CUDA device 0 is NVML device 2."""
    buses = ["0000:00:06.0", "0000:00:07.0", "0000:00:08.0", "0000:00:09.0"]
    visible = [2, 3]

    class Mem:
        total, free = 141 << 30, 140 << 30

    nvml = types.SimpleNamespace(
        NVML_CLOCK_MEM=2,
        NVMLError=RuntimeError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetHandleByPciBusId=lambda bus: buses.index(bus),
        nvmlDeviceGetName=lambda h: f"GPU{h}",
        nvmlDeviceGetMemoryInfo=lambda h: Mem,
        nvmlDeviceGetMaxClockInfo=lambda h, kind: 3200.0,
        nvmlDeviceGetMemoryBusWidth=lambda h: 6144,
        nvmlSystemGetDriverVersion=lambda: "580.1",
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}",
    )
    runtime = types.SimpleNamespace(deviceGetPCIBusId=lambda i: buses[visible[i]])
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return buses, visible


def test_device_facts_follow_the_cuda_numbering(leased_machine):
    buses, visible = leased_machine
    for cuda_index, machine_index in enumerate(visible):
        facts = devices.device_facts(cuda_index)
        assert facts["name"] == f"GPU{machine_index}"
        assert facts["uuid"] == f"GPU-{machine_index}"
        assert facts["pci_bus_id"] == buses[machine_index]
        assert facts["source"] == "nvml"
    # 2 x 3200 MHz x 6144 bit / 8 = 4.9152 TB/s
    assert devices.device_facts(0)["theoretical_bandwidth"] == pytest.approx(4.9152e12)


def test_device_facts_without_cupy_use_the_nvml_index(leased_machine, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    assert devices.device_facts(1)["name"] == "GPU1"
    assert "pci_bus_id" not in devices.device_facts(1)
