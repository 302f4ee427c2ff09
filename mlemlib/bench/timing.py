"""Timing of the benchmarks: whole iterations as the backends report them, single calls with CUDA events,
the host's copy bandwidth, and the floor of an iteration (bytes it must read over the copy bandwidth).

Whole iterations run through :func:`mlemlib.backends.base.timed_iterations`,
as ``mlem reconstruct`` runs them: a GPU backend's ``iteration`` time is its
CUDA events', the CPU backend's the host clock's. Single projections
(:func:`time_calls`) are timed with CUDA events around each call (CuPy).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mlemlib import registry


def time_iterations(be: Any, *, warmup: int, iterations: int, repeats: int, steps: bool = False) -> dict[str, Any]:
    """Time ``repeats`` runs of ``iterations`` MLEM iterations of backend ``be`` after ``warmup`` untimed ones.

    An OSEM backend's iteration is one full pass over its subsets.

    Returns
    -------
    dict
        ``ms`` (median over the repeats of each repeat's median iteration),
        ``ms_min`` / ``ms_max`` (the fastest and slowest repeat's median),
        ``ms_repeats`` (each repeat's median), ``finite`` (the last image has
        no NaN or infinity); with ``steps`` also ``steps_ms`` (each step the
        backend reports, :meth:`last_step_times`, its median over the timed
        iterations in ms) and, where it reports an ``allreduce``,
        ``allreduce_ms`` and ``allreduce_share`` (the median of each
        iteration's all-reduce time over its iteration time).
    """
    from mlemlib.backends.base import timed_iterations

    f = be.initial_image()
    total = warmup + iterations * repeats
    times: dict[int, dict[str, float]] = {}
    for _, f, ready in timed_iterations(be, f, 1, total):
        for k, step_times in ready:
            times[k] = {name: float(v) for name, v in step_times.items()}
    medians = []
    for r in range(repeats):
        first = warmup + r * iterations + 1
        medians.append(float(np.median([times[k]["iteration"] for k in range(first, first + iterations)])) * 1e3)
    img = np.asarray(be.to_host(f))
    out: dict[str, Any] = {
        "ms": float(np.median(medians)),
        "ms_min": min(medians),
        "ms_max": max(medians),
        "ms_repeats": [round(v, 6) for v in medians],
        "finite": bool(np.isfinite(img).all()),
    }
    if steps:
        timed = [times[k] for k in range(warmup + 1, total + 1)]
        names = sorted({name for t in timed for name in t})
        out["steps_ms"] = {name: float(np.median([t.get(name, 0.0) for t in timed])) * 1e3 for name in names}
        if "allreduce" in names:
            out["allreduce_ms"] = out["steps_ms"]["allreduce"]
            shares = [t.get("allreduce", 0.0) / t["iteration"] for t in timed if t["iteration"] > 0]
            out["allreduce_share"] = float(np.median(shares)) if shares else None
    return out


def time_calls(fn: Callable[[], Any], *, repeat: int, warmup: int = 3, gpu: bool = True) -> np.ndarray:
    """Seconds of each of ``repeat`` calls of ``fn`` after ``warmup`` untimed ones: CUDA events around each
    call (``gpu``), else the host clock."""
    for _ in range(warmup):
        fn()
    if not gpu:
        out = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return np.array(out)
    import cupy as cp

    events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(repeat)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    events[-1][1].synchronize()
    return np.array([cp.cuda.get_elapsed_time(a, b) / 1e3 for a, b in events])


def host_copy_bandwidth(nbytes: int = 256 << 20, *, repeat: int = 5) -> dict[str, Any]:
    """The host's memory copy bandwidth (bytes read + written per second, NumPy ``copyto``): the CPU
    backend's yardstick, as :func:`mlemlib.devices.copy_bandwidth` is a GPU's."""
    src = np.arange(max(1, nbytes // 4), dtype=np.float32)
    dst = np.empty_like(src)
    t = time_calls(lambda: np.copyto(dst, src), repeat=repeat, warmup=1, gpu=False)
    med = float(np.median(t))
    return {"bytes": 2 * src.nbytes, "median_s": med, "bandwidth": 2 * src.nbytes / med, "checked": True}


def iteration_op(backend: str, bp: str | None) -> str:
    """The registry's operation of a resolved back projection: ``back`` (reads ``A^T``), ``back_notrans``
    (reads ``A`` again) or ``iteration`` (one pass over ``A``); ``back`` where it is not known."""
    try:
        return registry.get_bp(backend, bp).op
    except Exception:  # noqa: BLE001 - a name the registry does not know (e.g. renamed): count both matrices
        return "back"


def floor_bytes(desc: dict[str, Any], facts: dict[str, Any], backend: str, bp: str | None,
                transpose_bytes: int | None) -> int:
    """The bytes one iteration must read: ``A`` once for a one pass, ``A`` and ``A^T`` for a pair on a stored
    transpose, ``A`` twice without one. ``A``'s (and ``A^T``'s) bytes are the backend's own where its
    ``describe()`` gives bytes per non-zero, else the files' (``facts``, ``transpose_bytes``)."""
    nnz = int(facts["nnz"])
    bpn = desc.get("bytes_per_nnz") if isinstance(desc.get("bytes_per_nnz"), dict) else {}
    a = bpn.get("A") * nnz if bpn.get("A") else float(facts["bytes"])
    op = "iteration" if desc.get("onepass") else iteration_op(backend, bp)
    if op == "iteration":
        return int(a)
    if op == "back_notrans":
        return int(2 * a)
    if bpn.get("AT"):
        return int(a + bpn["AT"] * nnz)
    return int(a + (transpose_bytes if transpose_bytes is not None else a))
