"""GPU facts from NVML (nvidia-ml-py), with CuPy as the fallback (CUDA only; no probing at import).

Provides :func:`device_facts`: name, total and free memory, memory clock, bus
width, PCI bus id and the theoretical memory bandwidth (2 transfers per clock x clock x
bus width, as NVIDIA quotes it for HBM and GDDR), for the tables and
``timings.json``. The theoretical figure is for context only: every fraction
the project reports is taken against the copy bandwidth *measured* in the same
run (:func:`mlemlib.bench.copy_bandwidth`).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def theoretical_bandwidth(memory_clock_mhz: float, bus_width_bits: int) -> float:
    """Bytes per second: 2 (double data rate) x clock x bus width / 8."""
    return 2.0 * memory_clock_mhz * 1e6 * bus_width_bits / 8.0


def cuda_pci_bus_id(index: int) -> str | None:
    """PCI bus id (``0000:00:06.0``) of CUDA device ``index`` as this process numbers it, or None without CuPy."""
    try:
        import cupy as cp
    except ImportError:
        return None
    return _str(cp.cuda.runtime.deviceGetPCIBusId(index))


def cuda_memory_bandwidth(index: int) -> dict[str, Any]:
    """Memory clock (MHz), bus width (bits) and theoretical bandwidth (bytes/s) of CUDA device ``index`` from the CUDA runtime.

    The fields are gone from ``cudaDeviceProp`` in CUDA 13; the runtime's
    attributes (``cudaDevAttrMemoryClockRate`` = 36, in kHz, and
    ``cudaDevAttrGlobalMemoryBusWidth`` = 37) still give them. Empty where
    this CUDA does not.
    """
    import cupy as cp

    rt = cp.cuda.runtime
    try:
        clock_khz = rt.deviceGetAttribute(getattr(rt, "cudaDevAttrMemoryClockRate", 36), index)
        bus = int(rt.deviceGetAttribute(getattr(rt, "cudaDevAttrGlobalMemoryBusWidth", 37), index))
    except Exception as exc:  # noqa: BLE001 - attribute missing on this CUDA: leave it out
        log.debug("memory clock not available from the CUDA runtime: %s", exc)
        return {}
    if clock_khz <= 0 or bus <= 0:
        return {}
    return {
        "memory_clock_mhz": clock_khz / 1000.0,
        "bus_width_bits": bus,
        "theoretical_bandwidth": theoretical_bandwidth(clock_khz / 1000.0, bus),
    }


def _nvml_handle(pynvml: Any, index: int) -> tuple[Any, str | None]:
    """NVML's handle of CUDA device ``index``, found by PCI bus id.

    CUDA numbers the devices this process sees (``CUDA_VISIBLE_DEVICES``, a
    GPU lease, a SLURM allocation), NVML numbers all of the machine's: under
    a lease CUDA device 0 may be NVML device 3. Without CuPy the index is
    taken as NVML's.
    """
    bus = cuda_pci_bus_id(index)
    if bus is None:
        return pynvml.nvmlDeviceGetHandleByIndex(index), None
    return pynvml.nvmlDeviceGetHandleByPciBusId(bus), bus


def _nvml_facts(index: int) -> dict[str, Any]:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    try:
        h, bus_id = _nvml_handle(pynvml, index)
        name = pynvml.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else str(name)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        clock = float(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM))
        bus = int(pynvml.nvmlDeviceGetMemoryBusWidth(h))
        facts = {
            "name": name,
            "memory_total": int(mem.total),
            "memory_free": int(mem.free),
            "memory_clock_mhz": clock,
            "bus_width_bits": bus,
            "theoretical_bandwidth": theoretical_bandwidth(clock, bus),
            "driver": _str(pynvml.nvmlSystemGetDriverVersion()),
            "source": "nvml",
        }
        if bus_id is not None:
            facts["pci_bus_id"] = bus_id
        try:
            uuid = pynvml.nvmlDeviceGetUUID(h)
            facts["uuid"] = _str(uuid)
        except pynvml.NVMLError:  # pragma: no cover - depends on the driver
            pass
        return facts
    finally:
        pynvml.nvmlShutdown()


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _cupy_facts(index: int) -> dict[str, Any]:
    import cupy as cp

    p = cp.cuda.runtime.getDeviceProperties(index)
    with cp.cuda.Device(index):
        free, total = cp.cuda.runtime.memGetInfo()
    facts: dict[str, Any] = {
        "name": _str(p["name"]),
        "memory_total": int(total),
        "memory_free": int(free),
        "source": "cupy",
    }
    facts.update(cuda_memory_bandwidth(index), pci_bus_id=cuda_pci_bus_id(index))
    return facts


def device_facts(index: int = 0) -> dict[str, Any]:
    """Facts of GPU ``index`` from NVML, else from CuPy.

    Returns
    -------
    dict
        ``name``, ``memory_total``, ``memory_free`` (bytes), and where known
        ``memory_clock_mhz``, ``bus_width_bits``, ``theoretical_bandwidth``
        (bytes/s), ``driver``, ``uuid``; ``source`` says where they came from.

    Raises
    ------
    mlemlib.errors.DeviceError
        When neither NVML nor CuPy can see the device.
    """
    from mlemlib.errors import DeviceError

    try:
        return _nvml_facts(index)
    except Exception as exc:  # noqa: BLE001 - ImportError, NVMLError: fall back to CuPy
        log.debug("NVML not usable (%s); asking CuPy", exc)
    try:
        return _cupy_facts(index)
    except Exception as exc:
        raise DeviceError(f"GPU {index}: neither NVML nor CuPy can read it: {exc}") from exc
