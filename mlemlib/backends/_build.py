"""The one compile-and-launch path of the CUDA kernels (CuPy imported lazily; importing needs no GPU).

Every kernel of ``mlemlib/kernels/*.cu`` is reached through :func:`function`:
a :class:`Build` (the source file and its compile options, a frozen value)
plus the kernel's name give one ``cupy.RawModule`` per build and device,
compiled once and memoized. A real variant of a kernel (the launch shapes of
``csr_vector``, the vector atomics of ``scatter_vec``) is a build with
options; there is no other way to change what a kernel compiles to.

:func:`prefetch` starts compiling builds a set-up will need in background
threads (NVRTC runs without the GIL), while the matrix is read and copied:
a cold kernel cache costs about a second per ``spmv.cu`` build and some
twenty for ``compressed.cu``, one after the other otherwise. :func:`module`
waits for a build being compiled in the background instead of compiling it
again; a build compiled for one device is in CuPy's kernel cache for every
device of the same architecture.

:func:`check_vector` is the one place that checks the vectors a launch is given.
"""

from __future__ import annotations

import functools
import importlib.resources
import logging
import os
import queue
import re
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from mlemlib import setup_times
from mlemlib.errors import DeviceError

log = logging.getLogger(__name__)

#: The sources in ``mlemlib/kernels`` (``<name>.cu``).
SOURCES = ("spmv", "compressed", "synth", "prior", "map_step", "peer")

#: A line of a kernel source that includes one of the package's own headers.
_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+\.cuh)"[^\n]*$', re.M)


def cupy() -> Any:
    """Import CuPy, or raise :class:`DeviceError` saying how to get it."""
    try:
        import cupy as cp
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise DeviceError(f"the CUDA backend needs CuPy (pip install 'mlemlib[gpu]'): {exc}") from exc
    return cp


@dataclass(frozen=True)
class Build:
    """One compilation of a kernel source: the file (``spmv``, ``compressed``, ``synth``) and its options.

    ``options`` are NVRTC options (``-DMLEM_STREAM`` ...), in a fixed order, so
    that equal builds are one cache entry.
    """

    source: str
    options: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"unknown kernel source {self.source!r}, expected one of {', '.join(SOURCES)}")


#: The build of compressed.cu (the compressed formats' kernels and every one pass; it has no variants).
COMPRESSED = Build("compressed")
#: The build of peer.cu (the peer exchange of one process's GPUs, :mod:`mlemlib.backends._peer`).
PEER = Build("peer")


def kernel_source(name: str) -> str:
    """Text of ``mlemlib/kernels/<name>.cu`` (shipped as package data), each ``#include "x.cuh"`` of the
    package's own headers replaced by the header's text (NVRTC is given source text, not a directory)."""
    kernels = importlib.resources.files("mlemlib.kernels")
    text = kernels.joinpath(f"{name}.cu").read_text()
    return _LOCAL_INCLUDE.sub(lambda mo: kernels.joinpath(mo.group(1)).read_text(), text)


#: Background compilations at once (each a process-wide NVRTC call on one core).
PREFETCH_THREADS = max(1, min(8, os.cpu_count() or 1))

_pending: dict[tuple[Build, str], Future] = {}
_pending_lock = threading.Lock()
_queue: queue.SimpleQueue = queue.SimpleQueue()
_workers: list[threading.Thread] = []


def _arch(device_id: int) -> str:
    return str(cupy().cuda.Device(device_id).compute_capability)


def prefetch(builds: Iterable[Build], device_id: int) -> None:
    """Start compiling ``builds`` for GPU ``device_id`` in background threads (at most
    :data:`PREFETCH_THREADS`; daemon threads: a job that ends does not wait for a compilation it no longer
    needs). Builds already compiled or being compiled for the device's architecture are skipped; a
    compilation's error is raised where :func:`module` asks for the build."""
    arch = _arch(device_id)
    for build in dict.fromkeys(builds):
        key = (build, arch)
        with _pending_lock:
            if key in _pending:
                continue
            fut: Future = Future()
            _pending[key] = fut
            if len(_workers) < PREFETCH_THREADS:
                worker = threading.Thread(target=_work, name=f"mlem-compile-{len(_workers)}", daemon=True)
                _workers.append(worker)
                worker.start()
        _queue.put((fut, build, device_id))


def _work() -> None:
    while True:
        fut, build, device_id = _queue.get()
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(_compile(build, device_id))
        except BaseException as exc:  # noqa: BLE001 - raised again where the build is asked for
            fut.set_exception(exc)


def module(build: Build, device_id: int) -> Any:
    """``build`` compiled for one device (memoized per build and device; set-up phase ``compile``, which
    includes waiting for the build's compilation in the background, :func:`prefetch`)."""
    with _pending_lock:
        fut = _pending.get((build, _arch(device_id))) if _pending else None
    if fut is not None and not fut.done():
        with setup_times.phase("compile"):
            fut.exception()  # wait; an error is raised by _compile below, as it would be without the prefetch
    return _compile(build, device_id)


@functools.cache
def _compile(build: Build, device_id: int) -> Any:
    cp = cupy()
    with cp.cuda.Device(device_id), setup_times.phase("compile"):
        mod = cp.RawModule(code=kernel_source(build.source), options=("--std=c++17", *build.options))
        mod.compile()
    log.debug("compiled %s.cu %s for device %d", build.source, " ".join(build.options), device_id)
    return mod


@functools.cache
def _function_on(build: Build, name: str, device_id: int) -> Any:
    return module(build, device_id).get_function(name)


def function(build: Build, name: str) -> Any:
    """Kernel ``name`` of ``build``, compiled for the current device (memoized)."""
    return _function_on(build, name, cupy().cuda.Device().id)


def pinned(n: int, dtype: Any) -> Any:
    """A NumPy array of ``n`` items in page-locked host memory of its own (freed with the array, not pooled):
    an upload's staging buffer, copied from asynchronously. (Not ``cupyx.empty_pinned``: the uploads run in a
    thread per GPU, and the first touch of CuPy's lazily loaded ``cupyx`` from two threads at once fails.)"""
    import numpy as np

    cuda = cupy().cuda
    dtype = np.dtype(dtype)
    mem = cuda.PinnedMemoryPointer(cuda.PinnedMemory(max(int(n), 1) * dtype.itemsize), 0)
    return np.frombuffer(mem, dtype=dtype, count=int(n))


def check_vector(name: str, v: Any, length: int) -> None:
    """``v`` must be a C-contiguous float32 CuPy vector of ``length`` entries on the current device.

    Raises
    ------
    ValueError
        Naming the vector and what it is instead.
    """
    cp = cupy()
    if not isinstance(v, cp.ndarray) or v.dtype != cp.float32 or v.shape != (length,) or not v.flags.c_contiguous:
        what = (f"{v.dtype} {v.shape}" if isinstance(v, cp.ndarray) else type(v).__name__)
        raise ValueError(f"{name} must be a contiguous float32 CuPy vector of length {length}, got {what}")
    on = getattr(getattr(v, "device", None), "id", None)
    if v.size and on is not None and on != cp.cuda.Device().id:
        raise ValueError(f"{name} is on GPU {on}, the launch on GPU {cp.cuda.Device().id}")
