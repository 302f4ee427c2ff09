"""GPU leases: give each concurrent job its own GPUs (host side, no GPU needed to test).

Snakemake counts a ``gpu`` resource (``--resources gpu=8``) but never tells a
job *which* devices it may use, so two jobs running at once can both start on
device 0 (snakemake issue #281). A job that calls :func:`lease_gpus` takes
``P`` free devices by locking one file per device with ``fcntl.flock``, and
sets ``CUDA_VISIBLE_DEVICES`` for itself before CUDA is initialised. The
kernel drops a ``flock`` lock when the last descriptor of the open file goes
away, so a job that ends in any way, ``SIGKILL`` included, frees its devices
with no stale lock left to clean up.

Rules:

- The candidates are the entries of an existing ``CUDA_VISIBLE_DEVICES`` (a
  SLURM allocation, say), in their order and written form, or else the
  indices ``0 .. count-1`` where ``count`` is ``$MLEM_NUM_GPUS`` (an override
  for tests and odd set-ups) or what NVML reports.
- A lease is all-or-nothing: a job either gets all ``P`` devices or holds
  none while it waits, so two jobs that each hold part of what they need can
  never block each other.
- Lock files live in ``$MLEM_LOCK_DIR`` (default ``/tmp/mlem-gpu-locks``),
  one per device, named after the device's UUID where NVML can tell it
  (stable whatever numbering a job sees) or else after its entry. The
  directory must be local to the node (leases are per node).
- Asking for more devices than exist, or for none, raises
  :class:`~mlemlib.errors.ConfigError` at once; waiting longer than the
  timeout raises :class:`LeaseTimeout`, which names who holds the devices.

Works on every platform with ``fcntl`` (Linux, macOS); never initialises CUDA.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import random
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any
from dataclasses import dataclass, field
from pathlib import Path

from mlemlib.errors import ConfigError, DeviceError

log = logging.getLogger(__name__)

#: Environment variable naming the lock directory.
LOCK_DIR_ENV = "MLEM_LOCK_DIR"
#: Environment variable that overrides the device count (tests, no NVML).
NUM_GPUS_ENV = "MLEM_NUM_GPUS"
#: Default lock directory (node-local).
DEFAULT_LOCK_DIR = "/tmp/mlem-gpu-locks"


class LeaseTimeout(DeviceError):
    """No set of free devices became available within the timeout."""


@dataclass
class Device:
    """One candidate device.

    Attributes
    ----------
    entry
        The device as the job's ``CUDA_VISIBLE_DEVICES`` names it (``"3"``,
        ``"GPU-8f6c..."``, ``"MIG-..."``).
    key
        The name of its lock (the UUID where known, else ``entry``).
    """

    entry: str
    key: str


@dataclass
class GpuLease:
    """A held set of devices; release it with :meth:`release` (or use :func:`lease_gpus`).

    Attributes
    ----------
    devices
        The leased devices, in candidate order.
    lock_dir
        Where the lock files are.
    """

    devices: list[Device]
    lock_dir: Path
    _fds: list[int] = field(default_factory=list, repr=False)

    @property
    def visible_devices(self) -> str:
        """The value to give ``CUDA_VISIBLE_DEVICES`` (comma-separated entries)."""
        return ",".join(d.entry for d in self.devices)

    @property
    def fds(self) -> list[int]:
        """The open lock-file descriptors (to pass on to a child that inherits the lease)."""
        return list(self._fds)

    @property
    def held(self) -> bool:
        return bool(self._fds)

    def release(self) -> None:
        """Unlock and close every lock file (idempotent)."""
        if self._fds:
            # Logged before unlocking, as the lease is logged after locking: the
            # logged interval lies inside the held one, so logs of two jobs
            # that overlap in time show a real overlap, never a hand-over.
            log.info("releasing GPU lease %s", self.visible_devices)
        for fd in self._fds:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []

    def __enter__(self) -> GpuLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# --- which devices exist ------------------------------------------------------


def parse_visible_devices(value: str) -> list[str]:
    """Parse a ``CUDA_VISIBLE_DEVICES`` value the way the CUDA runtime does.

    Entries are separated by commas; the list ends at the first invalid entry
    (a negative index such as ``-1``, or an empty field), and an empty value
    means no device at all.

    Parameters
    ----------
    value
        The variable's value.

    Returns
    -------
    list of str
        The visible entries, stripped, in order.

    Raises
    ------
    ConfigError
        If an entry appears twice (CUDA would reject the whole list).
    """
    entries: list[str] = []
    for raw in value.split(","):
        e = raw.strip()
        if not e:
            break
        if e.lstrip("+-").isdigit():
            if int(e) < 0:
                break
            e = str(int(e))
        if e in entries:
            raise ConfigError("CUDA_VISIBLE_DEVICES", f"device {e!r} listed twice in {value!r}")
        entries.append(e)
    return entries


@contextlib.contextmanager
def _nvml() -> Iterator[Any]:
    """``pynvml``, initialised for the block and shut down after; None where NVML is missing or fails."""
    try:
        import pynvml
    except ImportError:
        yield None
        return
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        log.debug("NVML unavailable: %s", exc)
        yield None
        return
    try:
        yield pynvml
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _nvml_uuids() -> list[str] | None:
    """UUIDs of the devices NVML sees, in NVML (PCI bus) order; None without NVML."""
    with _nvml() as nv:
        if nv is None:
            return None
        try:
            return [_text(nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(i))) for i in range(nv.nvmlDeviceGetCount())]
        except Exception as exc:
            log.debug("NVML query failed: %s", exc)
            return None


def _nvml_pci_bus_ids(keys: list[str]) -> list[str] | None:
    """PCI bus ids of the devices with these NVML UUIDs, for the log; None without NVML.

    A key that is no UUID NVML knows (``$MLEM_NUM_GPUS`` devices, MIG
    instances) gives ``"?"``.
    """
    if not any(k.startswith(("GPU-", "MIG-")) for k in keys):
        return None
    with _nvml() as nv:
        if nv is None:
            return None
        out = []
        for key in keys:
            try:
                out.append(_text(nv.nvmlDeviceGetPciInfo(nv.nvmlDeviceGetHandleByUUID(key)).busId))
            except Exception as exc:  # not a UUID NVML knows
                log.debug("no PCI bus id for %s: %s", key, exc)
                out.append("?")
        return out


def _proc_gpu_count() -> int | None:
    """Number of NVIDIA GPUs the driver lists under /proc (Linux); None if absent."""
    p = Path("/proc/driver/nvidia/gpus")
    if not p.is_dir():
        return None
    return sum(1 for _ in p.iterdir())


def device_count(env: Mapping[str, str] | None = None) -> int:
    """Number of GPUs on this node, without initialising CUDA.

    ``$MLEM_NUM_GPUS`` if set (tests, machines without NVML), else NVML's
    count, else the driver's ``/proc/driver/nvidia/gpus`` entries, else 0.

    Raises
    ------
    ConfigError
        If ``$MLEM_NUM_GPUS`` is not a non-negative integer.
    """
    env = os.environ if env is None else env
    override = env.get(NUM_GPUS_ENV)
    if override is not None and override.strip() != "":
        try:
            count = int(override)
        except ValueError:
            count = -1
        if count < 0:
            raise ConfigError(NUM_GPUS_ENV, f"expected a non-negative integer, found {override!r}")
        return count
    uuids = _nvml_uuids()
    if uuids is not None:
        return len(uuids)
    return _proc_gpu_count() or 0


def candidate_devices(env: Mapping[str, str] | None = None) -> list[Device]:
    """The devices this job may lease, with their lock keys.

    An existing ``CUDA_VISIBLE_DEVICES`` is respected: only its entries are
    candidates. Lock keys are NVML UUIDs where NVML can map the entry (and
    ``$MLEM_NUM_GPUS`` is not set), so jobs that number the same device
    differently still share one lock.
    """
    env = os.environ if env is None else env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    entries = parse_visible_devices(cvd) if cvd is not None else [str(i) for i in range(device_count(env))]
    uuids = None if env.get(NUM_GPUS_ENV) else _nvml_uuids()
    devices = []
    for e in entries:
        key = e
        if e.startswith(("GPU-", "MIG-")):
            key = e
        elif uuids is not None and e.isdigit() and int(e) < len(uuids):
            key = uuids[int(e)]
        devices.append(Device(entry=e, key=key))
    return devices


# --- locking ----------------------------------------------------------------


def lock_dir(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The lock directory (created world-writable with the sticky bit, like /tmp)."""
    env = os.environ if env is None else env
    d = Path(path if path is not None else env.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)
    if not d.is_dir():
        try:
            d.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                os.chmod(d, 0o1777)  # other users on the node must be able to lock too
        except OSError as exc:
            raise ConfigError(d, f"cannot create the GPU lock directory: {exc.strerror}") from exc
    return d


def _safe(key: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in key)


def lock_path(directory: Path, device: Device) -> Path:
    """The lock file of one device: ``<dir>/gpu-<key>.lock``."""
    return directory / f"gpu-{_safe(device.key)}.lock"


def _try_lock(path: Path) -> int | None:
    """Open and lock ``path`` without blocking; the descriptor, or None if held elsewhere."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666)  # best effort, so other users can lock it too
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def _write_owner(fd: int, device: Device) -> None:
    """Record who holds the lock (read back only to explain a timeout)."""
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": device.entry,
        "job": os.environ.get("SNAKEMAKE_JOBID") or os.environ.get("SLURM_JOB_ID") or "",
        "argv": " ".join(sys.argv)[:200],
    }
    data = (json.dumps(info) + "\n").encode()
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)


def read_owner(path: Path) -> dict | None:
    """The holder record of a lock file (may be stale if the lock is free)."""
    try:
        return json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None


def is_locked(path: Path) -> bool:
    """True when some process holds the lock on ``path`` right now."""
    if not path.exists():
        return False
    fd = _try_lock(path)
    if fd is None:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    return False


def acquire(
    count: int,
    *,
    timeout: float | None = 600.0,
    poll: float = 0.5,
    directory: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
) -> GpuLease:
    """Take ``count`` free devices, waiting up to ``timeout`` seconds.

    Parameters
    ----------
    count
        Number of devices (``P``), at least 1.
    timeout
        Seconds to wait for enough free devices; ``None`` waits for ever, 0
        tries once.
    poll
        Seconds between tries (with up to 50 % random jitter, so jobs that
        started together do not retry in lockstep).
    directory
        Lock directory; default ``$MLEM_LOCK_DIR`` or ``/tmp/mlem-gpu-locks``.
    env
        Environment to read (default ``os.environ``); not modified.

    Returns
    -------
    GpuLease
        The held lease; call :meth:`GpuLease.release` when done.

    Raises
    ------
    ConfigError
        ``count`` < 1, or more devices asked for than there are candidates.
    LeaseTimeout
        Not enough free devices within ``timeout``.
    """
    env = os.environ if env is None else env
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ConfigError("gpus", f"asked for {count!r} GPUs, expected an integer >= 1")
    devices = candidate_devices(env)
    where = (
        f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}"
        if "CUDA_VISIBLE_DEVICES" in env
        else (f"{NUM_GPUS_ENV}={env[NUM_GPUS_ENV]}" if env.get(NUM_GPUS_ENV) else "NVML")
    )
    if count > len(devices):
        raise ConfigError(
            "gpus",
            f"asked for {count} GPUs but only {len(devices)} "
            f"{'is' if len(devices) == 1 else 'are'} visible to this job ({where})",
        )
    d = lock_dir(directory, env)
    deadline = None if timeout is None else time.monotonic() + timeout
    waited = False
    while True:
        fds: list[int] = []
        got: list[Device] = []
        busy: list[Device] = []
        for dev in devices:
            fd = _try_lock(lock_path(d, dev))
            if fd is None:
                busy.append(dev)
                continue
            fds.append(fd)
            got.append(dev)
            if len(got) == count:
                break
        if len(got) == count:
            for fd, dev in zip(fds, got):
                _write_owner(fd, dev)
            lease = GpuLease(devices=got, lock_dir=d, _fds=fds)
            pci = _nvml_pci_bus_ids([dev.key for dev in got])
            log.info(
                "leased GPU(s) %s (%spid %d; lock dir %s)",
                lease.visible_devices, f"PCI {','.join(pci)}; " if pci else "", os.getpid(), d,
            )
            return lease
        for fd in fds:  # all or nothing: never sit on part of what we need
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            holders = []
            for dev in busy:
                o = read_owner(lock_path(d, dev)) or {}
                holders.append(f"{dev.entry} (pid {o.get('pid', '?')} on {o.get('host', '?')})")
            raise LeaseTimeout(
                f"no {count} free GPU(s) among {len(devices)} ({where}) after {timeout:g} s; "
                f"held: {', '.join(holders) or 'none'}; lock dir {d}"
            )
        if not waited:
            log.info("waiting for %d free GPU(s); busy: %s", count, ",".join(b.entry for b in busy))
            waited = True
        delay = poll * (1.0 + 0.5 * random.random())
        if deadline is not None:
            delay = min(delay, max(deadline - now, 0.0))
        time.sleep(delay)


@contextlib.contextmanager
def lease_gpus(
    count: int,
    *,
    timeout: float | None = 600.0,
    directory: str | os.PathLike | None = None,
    set_env: bool = True,
) -> Iterator[GpuLease]:
    """Hold ``count`` GPUs for the ``with`` block and make only them visible.

    Call it before anything initialises CUDA (before the first CuPy array):
    the CUDA runtime reads ``CUDA_VISIBLE_DEVICES`` once, when it starts. Inside
    the block the leased GPUs are CUDA devices ``0 .. count-1``. On exit the
    previous ``CUDA_VISIBLE_DEVICES`` is restored and the locks released.

    Parameters
    ----------
    count
        Number of GPUs.
    timeout
        Seconds to wait for free GPUs (``None``: for ever).
    directory
        Lock directory (default ``$MLEM_LOCK_DIR`` or ``/tmp/mlem-gpu-locks``).
    set_env
        Set ``CUDA_VISIBLE_DEVICES`` in ``os.environ`` (default True).

    Yields
    ------
    GpuLease

    Examples
    --------
    >>> with lease_gpus(2) as lease:               # doctest: +SKIP
    ...     reconstruct(model, RunSettings(50, backend="cuda", gpus=2), "image.h5")
    """
    lease = acquire(count, timeout=timeout, directory=directory)
    saved = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    try:
        if set_env:
            if "cupy" in sys.modules:
                log.debug("CuPy already imported: CUDA_VISIBLE_DEVICES works only if no CUDA call was made yet")
            os.environ.update(lease_environment(lease, saved))
        yield lease
    finally:
        if set_env:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        lease.release()


def lease_environment(lease: GpuLease, env: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The variables a process holding ``lease`` runs with.

    ``CUDA_VISIBLE_DEVICES`` lists the leased entries. Where the candidates
    were plain NVML indices (no ``CUDA_VISIBLE_DEVICES`` before) and no
    ``CUDA_DEVICE_ORDER`` is set, ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes CUDA
    number the devices as NVML does, so index ``k`` is the device locked as ``k``.
    """
    env = os.environ if env is None else env
    out = {"CUDA_VISIBLE_DEVICES": lease.visible_devices}
    if env.get("CUDA_VISIBLE_DEVICES") is None and not env.get("CUDA_DEVICE_ORDER"):
        out["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return out


def status(directory: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> list[dict]:
    """One record per candidate device: entry, key, lock file, held, holder."""
    env = os.environ if env is None else env
    d = lock_dir(directory, env)
    out = []
    for dev in candidate_devices(env):
        p = lock_path(d, dev)
        held = is_locked(p)
        out.append(
            {"device": dev.entry, "key": dev.key, "lock": str(p), "held": held, "holder": read_owner(p) if held else None}
        )
    return out
