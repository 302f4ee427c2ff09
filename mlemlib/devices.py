"""GPU facts and energy from NVML (nvidia-ml-py), with CuPy as the fallback (CUDA only; no probing at import).

Provides :func:`device_facts`: name, total and free memory, memory clock, bus
width, PCI bus id and the theoretical memory bandwidth (2 transfers per clock x clock x
bus width, as NVIDIA quotes it for HBM and GDDR), for the tables and
``timings.json``. The theoretical figure is for context only: every fraction
the project reports is taken against the copy bandwidth *measured* in the same
run (:func:`copy_bandwidth`; :func:`record_copy_bandwidths` stores it beside
each GPU's facts).

:class:`EnergyMeter` reads the energy counters of the GPUs a backend uses
(:func:`backend_gpus`) around each repetition's iterations; it reports "not
available" (None) without ``pynvml``, on GPUs without the counter and on the
CPU backend.
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


# --------------------------------------------------------------------------- energy
def backend_gpus(desc: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The GPUs a backend's ``describe()`` names: ``device`` (one GPU) or ``devices`` (several), as dicts.

    Each has at least ``index`` (the CUDA device number in this process);
    ``pci_bus_id`` where the facts had it. Empty for the CPU backend (whose
    ``device`` is the host) and where no GPU is named. Under the one-GPU-per-
    process launcher (:mod:`mlemlib.dist.mpi`) a backend names only this
    process's GPU.
    """
    if not desc or not str(desc.get("backend", "")).startswith("cuda"):
        return []
    devs = desc.get("devices") if desc.get("devices") is not None else desc.get("device")
    if isinstance(devs, dict):
        devs = [devs]
    return [d for d in devs or [] if isinstance(d, dict) and isinstance(d.get("index"), int)]


#: NVML's clock-limit policies (``nvmlPerfPolicyType_t``) whose violation counters :meth:`EnergyMeter.capped`
#: reads: the time the clocks were held down by the GPU's power limit and by its temperature.
CAP_POLICIES = {"power": 0, "thermal": 1}


class EnergyMeter:
    """Energy drawn by a set of GPUs, from NVML's counters (``nvmlDeviceGetTotalEnergyConsumption``; CUDA only).

    The counter of each GPU is the energy in millijoules since the driver was
    loaded (Volta and newer). :meth:`read` returns the sum over the GPUs in
    joules; the difference of two readings is the energy of the interval
    between them. Where it cannot be had (no ``pynvml``, a GPU without the
    counter, an NVML error, no GPU at all: the CPU backend) the meter is not
    :attr:`available`, :meth:`read` returns None, and :attr:`note` says why
    (logged once, at debug level).

    Parameters
    ----------
    gpus
        The GPUs: CUDA device numbers, PCI bus ids (``0000:00:06.0``), or
        dicts with ``index`` and optionally ``pci_bus_id`` (as in a backend's
        ``describe()``; :func:`backend_gpus`). A bus id is used as it is; a
        number is mapped to NVML's by :func:`_nvml_handle`.
    world
        GPUs the run uses in all (default: ``len(gpus)``); more than
        ``len(gpus)`` where other processes drive the rest (one GPU per
        process), whose energy this meter does not see: the note says so.
    """

    def __init__(self, gpus: list[int | str | dict[str, Any]], *, world: int | None = None) -> None:
        self.gpus = list(gpus)
        self.world = len(self.gpus) if world is None else int(world)
        self._nvml: Any = None
        self._handles: list[Any] = []
        self.available = False
        self.caps_available = False  # NVML's clock-capping counters (:meth:`capped`)
        self.note = ""
        if not self.gpus:
            self._unavailable("no GPU (cpu backend)")
            return
        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            self._unavailable("pynvml (nvidia-ml-py) not installed")
            return
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError or a driver without NVML
            self._unavailable(f"NVML not usable: {exc}")
            return
        self._nvml = pynvml
        try:
            self._handles = [self._handle(g) for g in self.gpus]
            for h in self._handles:  # a GPU without the counter raises here (NVML_ERROR_NOT_SUPPORTED)
                pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
        except Exception as exc:  # noqa: BLE001 - NVMLError, or CuPy failing to name a bus id
            self.close()
            self._unavailable(f"NVML energy counter not supported: {exc}")
            return
        self.available = True
        self.caps_available = self.capped() is not None
        names = ", ".join(str(g.get("index") if isinstance(g, dict) else g) for g in self.gpus)
        self.note = f"NVML total energy of GPU {names}"
        if self.world > len(self.gpus):
            self.note += (f" (this process's {len(self.gpus)} of {self.world} GPUs; the other processes' GPUs "
                          "are not counted)")

    def _handle(self, gpu: int | str | dict[str, Any]) -> Any:
        bus = gpu.get("pci_bus_id") if isinstance(gpu, dict) else (gpu if isinstance(gpu, str) else None)
        if bus:
            return self._nvml.nvmlDeviceGetHandleByPciBusId(bus)
        index = int(gpu["index"]) if isinstance(gpu, dict) else int(gpu)
        return _nvml_handle(self._nvml, index)[0]

    def _unavailable(self, why: str) -> None:
        self.available = False
        self.note = f"not available: {why}"
        log.debug("GPU energy %s", self.note)

    def read(self) -> float | None:
        """Joules the GPUs have drawn since their driver was loaded (summed), or None where not available."""
        if not self.available:
            return None
        try:
            return sum(float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self._handles) / 1e3
        except self._nvml.NVMLError as exc:
            self.close()
            self._unavailable(f"NVML energy counter failed: {exc}")
            return None

    def capped(self) -> list[dict[str, float]] | None:
        """Per GPU, the seconds its clocks have been held down by each of :data:`CAP_POLICIES` since its
        driver was loaded (``nvmlDeviceGetViolationStatus``, nanoseconds: what ``nvidia-smi -q -d
        PERFORMANCE`` lists as "Clocks Event Reasons Counters"), or None where they cannot be read.
        :func:`capped_between` turns two readings into the seconds of an interval."""
        if self._nvml is None or not self._handles:
            return None
        try:
            return [{k: self._nvml.nvmlDeviceGetViolationStatus(h, p).violationTime / 1e9
                     for k, p in CAP_POLICIES.items()} for h in self._handles]
        except Exception as exc:  # noqa: BLE001 - NVMLError (not supported), or a pynvml without the call
            log.debug("NVML clock-capping counters not available: %s", exc)
            self.caps_available = False
            return None

    def close(self) -> None:
        """Release NVML (idempotent)."""
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception as exc:  # noqa: BLE001 - shutting down twice or a vanished driver
                log.debug("nvmlShutdown: %s", exc)
            self._nvml = None
        self.available = False
        self.caps_available = False

    def __enter__(self) -> EnergyMeter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def capped_between(start: list[dict[str, float]] | None, end: list[dict[str, float]] | None) -> dict[str, float] | None:
    """Seconds the clocks were held down between two :meth:`EnergyMeter.capped` readings: per policy
    (``power``, ``thermal``), the most any GPU had; None where either reading is missing."""
    if not start or not end or len(start) != len(end):
        return None
    return {k: max(max(0.0, e[k] - s[k]) for s, e in zip(start, end)) for k in CAP_POLICIES}


def energy_record(joules: float | None, seconds: float, iterations: int, note: str, gpus: int = 0,
                  capped: dict[str, float] | None = None) -> dict[str, Any]:
    """The energy fields of one repetition's record in ``timings.json``.

    ``energy_J`` (the GPUs' energy over the iteration loop), ``energy_per_iteration_J``,
    ``power_W`` (energy over the loop's wall time ``seconds``), ``energy_gpus``
    (how many GPUs were counted), ``energy_note``, and ``clock_capped_s``: the
    seconds of the loop the GPUs' clocks were held down by their power limit
    and by heat (:func:`capped_between`; a throttled GPU times its kernels
    slower than its copy bandwidth predicts); None where not measured.
    """
    if joules is None:
        return {"energy_J": None, "energy_per_iteration_J": None, "power_W": None, "energy_gpus": None,
                "energy_note": note, "clock_capped_s": capped}
    return {
        "energy_J": joules,
        "energy_per_iteration_J": joules / iterations if iterations > 0 else None,
        "power_W": joules / seconds if seconds > 0 else None,
        "energy_gpus": gpus,
        "energy_note": note,
        "clock_capped_s": capped,
    }


# --------------------------------------------------------------------------- copy bandwidth
def copy_bandwidth(nbytes: int = 1 << 31, *, repeat: int = 20, warmup: int = 3,
                   device: int | None = None) -> dict[str, Any]:
    """Device-to-device copy bandwidth of one GPU: (bytes read + written) / median time of a copy (CuPy).

    Each of ``repeat`` copies of a float32 buffer of ``nbytes`` bytes (far
    larger than the L2 cache) is timed with CUDA events after ``warmup``
    untimed ones. Every "share of the floor" the project reports divides by
    this figure, measured in the same run.

    Parameters
    ----------
    nbytes
        Bytes of the buffer copied.
    repeat, warmup
        Timed and untimed copies.
    device
        CUDA device index (default: the current one).

    Returns
    -------
    dict
        ``bytes`` (read + written per copy), ``median_s``, ``bandwidth``
        (bytes/s) and ``checked`` (the copy's last elements equal its source's).

    Raises
    ------
    mlemlib.errors.DeviceError
        Without CuPy.
    """
    from mlemlib.errors import DeviceError

    try:
        import cupy as cp
    except ImportError as exc:
        raise DeviceError(f"copy bandwidth needs CuPy: {exc}") from exc
    import numpy as np

    with cp.cuda.Device(cp.cuda.Device().id if device is None else int(device)):
        count = max(1, int(nbytes) // 4)
        src = cp.arange(count, dtype=cp.float32)
        dst = cp.empty_like(src)
        for _ in range(warmup):
            cp.copyto(dst, src)
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(repeat)]
        for start, stop in events:
            start.record()
            cp.copyto(dst, src)
            stop.record()
        events[-1][1].synchronize()
        times = np.array([cp.cuda.get_elapsed_time(a, b) / 1e3 for a, b in events])
        ok = bool(cp.array_equal(dst[-1024:], src[-1024:]))
        del src, dst
    med = float(np.median(times))
    return {"bytes": 2 * count * 4, "median_s": med, "bandwidth": 2 * count * 4 / med, "checked": ok}


#: Buffer and repeats of the copy bandwidth recorded with every GPU run (cheap: well under a second per GPU).
RUN_COPY_BYTES = 256 << 20
RUN_COPY_REPEAT = 5


def record_copy_bandwidths(gpus: list[dict[str, Any]], *, nbytes: int = RUN_COPY_BYTES,
                           repeat: int = RUN_COPY_REPEAT) -> None:
    """Measure :func:`copy_bandwidth` on each GPU and store it in its dict under ``copy_bandwidth``.

    ``gpus`` are the device dicts of a backend's ``describe()``
    (:func:`backend_gpus`, each with ``index``), changed in place, so the
    figure lands in ``timings.json`` beside the GPU's other facts. A failure
    (too little free memory) is recorded as ``{"error": ...}`` and logged; it
    never stops the run. The memory pool's unused blocks are freed afterwards.
    """
    import cupy as cp

    for g in gpus:
        try:
            g["copy_bandwidth"] = copy_bandwidth(nbytes, repeat=repeat, device=int(g["index"]))
            with cp.cuda.Device(int(g["index"])):
                cp.get_default_memory_pool().free_all_blocks()
        except Exception as exc:  # noqa: BLE001 - out of memory, a CUDA error: the run goes on without it
            log.warning("GPU %s: copy bandwidth not measured: %s", g.get("index"), exc)
            g["copy_bandwidth"] = {"error": str(exc)}
        else:
            log.info("GPU %s: copy bandwidth %.1f GB/s (median of %d copies of %d MiB)", g["index"],
                     g["copy_bandwidth"]["bandwidth"] / 1e9, repeat, nbytes >> 20)
