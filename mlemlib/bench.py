"""SpMV and MLEM-iteration benchmark of the CUDA kernels, and a synthetic PET-like matrix (CPU and CUDA).

Provides

- :func:`tor_matrix` — a synthetic tube-of-response system matrix in sinogram
  order (plane, angle, offset), on the CPU (Numba) or generated directly on
  the GPU (``device=True``, seconds for 1e9 non-zeros); both give identical
  arrays;
- :func:`copy_bandwidth` — the device-to-device copy bandwidth (bytes read +
  written per second), the yardstick of every fraction reported;
  :func:`record_copy_bandwidths` measures it cheaply on each GPU of a run
  for its ``timings.json``;
- :func:`bench_spmv` — times every kernel (CUDA events, median of two rounds
  of ``repeat`` runs after warm-up, an operation's kernels in turn, the second
  round in the reverse order) on one matrix: forward ``A x``, back projection on the
  stored transpose ``A^T c`` and without it (scatter from ``A``; ``csr_vector``
  under every launch shape, in column order and, on a copy, in the
  interleaved layout a backend gives it: ``DeviceCSR.set_layout``), each with
  its effective bandwidth (:func:`mlemlib.backends._cuda_plan.spmv_bytes`
  over the time), its fraction of the copy bandwidth and its speed relative
  to cuSPARSE in the same run, its error against a float64 product; then full
  MLEM iterations of kernel pairs against the floor (bytes of ``A`` and
  ``A^T`` over the copy bandwidth);
- :func:`format_markdown`, :func:`write_results` — the report (JSON for the
  summary, Markdown for people, CSV for the workflow).

The benchmark needs CuPy and a GPU; :func:`tor_matrix` on the CPU and the
report formatting do not.
"""

from __future__ import annotations

import csv
import datetime as _dt
import io
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit, prange

from mlemlib import registry
from mlemlib._io import atomic_path
from mlemlib.backends import _cuda_plan as plan
from mlemlib.errors import ConfigError
from mlemlib.matrix import CSRMatrix

log = logging.getLogger(__name__)

#: Kernels timed by default, per operation: every cuda kernel of the registry that reads CSR
#: (selectors left out; the compressed formats' kernels: tools/device_kernels.py --compressed).
FP_BENCH = tuple(registry.names("cuda", "forward", fmt="csr"))
BP_BENCH = tuple(registry.names("cuda", "back", fmt="csr"))
NOTRANS_BENCH = tuple(
    k.name for k in registry.KERNELS
    if k.backend == "cuda" and k.op == "back_notrans" and not k.selector and "csr" in k.formats
)
#: (fp, bp) pairs timed as whole MLEM iterations.
ITERATION_BENCH = (
    ("auto", "auto"),
    ("cusparse", "cusparse"),
    ("csr_vector", "csr_vector"),
    ("csr_vector", "scatter"),
    ("csr_vector", "scatter_smem"),
    ("csr_vector", "notrans"),
    ("merge", "scatter"),
    ("auto", "onepass"),
    ("auto", "onepass_fixed"),
    ("auto", "onepass_chunked"),
)
#: (fp, bp) pairs timed as whole MLEM iterations on the matrix re-encoded in a compressed format
#: (``formats``): ``auto`` (which may chunk it), the compressed pair, the deterministic one passes.
FORMAT_ITERATION_BENCH = (
    ("auto", "auto"),
    ("delta_vector", "delta_vector"),
    ("auto", "onepass_fixed"),
    ("auto", "onepass_chunked"),
)
#: The iteration every other one's image is compared with: the deterministic float32 CSR pair.
REFERENCE_ITERATION = ("csr", "csr_vector", "csr_vector")
#: The benchmark's operation names and the registry's.
BENCH_OPS = {"fp": "forward", "bp": "back", "bp_notrans": "back_notrans"}


def deterministic(op: str, kernel: str) -> bool:
    """Whether the registry declares kernel ``kernel`` of bench operation ``op`` deterministic."""
    return registry.get("cuda", BENCH_OPS[op], kernel).deterministic


EPS32 = float(np.finfo(np.float32).eps)


# --------------------------------------------------------------------------- synthetic matrix
def tor_geometry(nx: int, ny: int, nz: int, n_angles: int, n_offsets: int, width: float = 3.0) -> dict[str, Any]:
    """Parameters of :func:`tor_matrix` (shared by the CPU and GPU generators).

    Returns
    -------
    dict
        ``m``, ``n``, ``cs``, ``sn`` (float64 tables of the angles
        ``pi * a / n_angles``), ``w`` (half width), ``ds`` (offset spacing:
        the image diagonal over ``n_offsets``), ``cx``, ``cy`` (image centre).
    """
    for name, v in (("nx", nx), ("ny", ny), ("nz", nz), ("n_angles", n_angles), ("n_offsets", n_offsets)):
        if int(v) < 1:
            raise ConfigError(name, f"must be >= 1, got {v}")
    if not width > 0:
        raise ConfigError("width", f"tube width must be > 0, got {width}")
    planes = nz - 1 if nz > 1 else 1
    angles = np.pi * np.arange(n_angles, dtype=np.float64) / n_angles
    return {
        "nx": int(nx),
        "ny": int(ny),
        "nz": int(nz),
        "n_angles": int(n_angles),
        "n_offsets": int(n_offsets),
        "m": planes * n_angles * n_offsets,
        "n": nx * ny * nz,
        "cs": np.cos(angles),
        "sn": np.sin(angles),
        "w": float(width) / 2.0,
        "ds": math.hypot(nx, ny) / n_offsets,
        "cx": (nx - 1) / 2.0,
        "cy": (ny - 1) / 2.0,
    }


@njit(cache=True, nogil=True)
def _tor_row(r, nx, ny, nz, n_angles, n_offsets, w, ds, cx, cy, cs_tab, sn_tab, col, val, k0, fill):  # pragma: no cover
    per_plane = n_angles * n_offsets
    plane = r // per_plane
    angle = (r % per_plane) // n_offsets
    offset = r % n_offsets
    cs = cs_tab[angle]
    sn = sn_tab[angle]
    s = (float(offset) - float(n_offsets - 1) * 0.5) * ds
    nslices = 2 if nz > 1 else 1
    count = 0
    for dz in range(nslices):
        z = plane + dz
        for y in range(ny):
            u = (float(y) - cy) * sn - s
            if cs == 0.0:
                xlo = 0
                xhi = nx - 1
            else:
                xa = cx + (-u - w) / cs
                xb = cx + (-u + w) / cs
                if xa > xb:
                    xa, xb = xb, xa
                xa = max(xa, -1.0)
                xb = min(xb, float(nx))
                xlo = max(math.floor(xa), 0)
                xhi = min(math.ceil(xb), nx - 1)
            for x in range(xlo, xhi + 1):
                d = abs((float(x) - cx) * cs + u)
                if d < w:
                    if fill:
                        col[k0 + count] = (z * ny + y) * nx + x
                        val[k0 + count] = np.float32(1.0 - d / w)
                    count += 1
    return count


@njit(parallel=True, cache=True, nogil=True)
def _tor_count(m, nx, ny, nz, n_angles, n_offsets, w, ds, cx, cy, cs_tab, sn_tab, counts):  # pragma: no cover
    dummy_c = np.empty(0, dtype=np.int32)
    dummy_v = np.empty(0, dtype=np.float32)
    for r in prange(m):
        counts[r] = _tor_row(
            r, nx, ny, nz, n_angles, n_offsets, w, ds, cx, cy, cs_tab, sn_tab, dummy_c, dummy_v, 0, False
        )


@njit(parallel=True, cache=True, nogil=True)
def _tor_fill(m, nx, ny, nz, n_angles, n_offsets, w, ds, cx, cy, cs_tab, sn_tab, indptr, col, val):  # pragma: no cover
    for r in prange(m):
        _tor_row(r, nx, ny, nz, n_angles, n_offsets, w, ds, cx, cy, cs_tab, sn_tab, col, val, indptr[r], True)


def tor_matrix(
    nx: int, ny: int, nz: int, n_angles: int, n_offsets: int, width: float = 3.0, *, device: bool = False
) -> Any:
    """A synthetic PET-like system matrix: tubes of response in sinogram order.

    Row ``(plane * n_angles + angle) * n_offsets + offset`` is the strip of
    half width ``w = width / 2`` around the line at angle ``pi * angle /
    n_angles`` and signed distance ``(offset - (n_offsets - 1) / 2) * ds``
    from the image centre, through slices ``plane`` and ``plane + 1`` (planes
    = nz - 1; one slice when nz == 1). Voxel ``(x, y, z)`` is column
    ``(z * ny + y) * nx + x`` and takes ``1 - d / w``, ``d`` its centre's
    distance from the line, when ``d < w``. Columns are sorted in each row;
    rows of lines that miss the image are empty.

    Parameters
    ----------
    nx, ny, nz
        Voxel grid.
    n_angles, n_offsets
        Sinogram size per plane.
    width
        Tube width in voxels.
    device
        Generate on the current GPU (returns a ``DeviceCSR``); else on the
        CPU with Numba (returns a :class:`CSRMatrix`). Both give identical arrays.
    """
    g = tor_geometry(nx, ny, nz, n_angles, n_offsets, width)
    m, n = g["m"], g["n"]
    args = (g["nx"], g["ny"], g["nz"], g["n_angles"], g["n_offsets"], g["w"], g["ds"], g["cx"], g["cy"])
    if not device:
        counts = np.empty(m, dtype=np.int64)
        _tor_count(m, *args, g["cs"], g["sn"], counts)
        indptr = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        nnz = int(indptr[-1])
        col = np.empty(nnz, dtype=np.int32)
        val = np.empty(nnz, dtype=np.float32)
        _tor_fill(m, *args, g["cs"], g["sn"], indptr, col, val)
        return CSRMatrix(indptr, col, val, (m, n))

    from mlemlib.backends import _cuda_kernels as ck

    cp = ck.cupy()
    dev = cp.cuda.Device().id
    mod = ck.module("synth", dev, ("--fmad=false",))
    props = ck.device_properties(dev)
    blocks, threads = plan.launch_shape(m, 128, props["sm_count"], props["max_threads_per_sm"], threads=128)
    gargs = (
        np.int32(args[0]),
        np.int32(args[1]),
        np.int32(args[2]),
        np.int32(args[3]),
        np.int32(args[4]),
        np.float64(args[5]),
        np.float64(args[6]),
        np.float64(args[7]),
        np.float64(args[8]),
    )
    cs = cp.asarray(g["cs"])
    sn = cp.asarray(g["sn"])
    counts = cp.empty(m, dtype=cp.int32)
    mod.get_function("tor_count")((blocks,), (threads,), (*gargs, np.int64(m), cs, sn, counts))
    indptr = cp.zeros(m + 1, dtype=cp.int64)
    cp.cumsum(counts, dtype=cp.int64, out=indptr[1:])
    del counts
    nnz = int(indptr[-1])
    col = cp.empty(nnz, dtype=cp.int32)
    val = cp.empty(nnz, dtype=cp.float32)
    mod.get_function("tor_fill")((blocks,), (threads,), (*gargs, np.int64(m), cs, sn, indptr, col, val))
    return ck.DeviceCSR(indptr, col, val, (m, n))


# --------------------------------------------------------------------------- timing
def time_gpu(fn, *, repeat: int, warmup: int = 3) -> np.ndarray:
    """Seconds of each of ``repeat`` calls of ``fn`` (CUDA events around each), after ``warmup`` calls."""
    from mlemlib.backends import _cuda_kernels as ck

    cp = ck.cupy()
    for _ in range(warmup):
        fn()
    events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(repeat)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    events[-1][1].synchronize()
    return np.array([cp.cuda.get_elapsed_time(a, b) / 1e3 for a, b in events])


def time_gpu_interleaved(fns, *, repeat: int, warmup: int = 3) -> list[np.ndarray]:
    """:func:`time_gpu` of several functions in turn: call ``k`` of each before call ``k + 1`` of any.

    A drift of the clocks during the measurement (a few percent over a
    second on an H200, docs/benchmarks.md section 70) then spreads over every
    candidate alike, so their times compare within one run.
    """
    from mlemlib.backends import _cuda_kernels as ck

    cp = ck.cupy()
    for fn in fns:
        for _ in range(warmup):
            fn()
    events = [[(cp.cuda.Event(), cp.cuda.Event()) for _ in range(repeat)] for _ in fns]
    for k in range(repeat):
        for fn, ev in zip(fns, events):
            ev[k][0].record()
            fn()
            ev[k][1].record()
    events[-1][-1][1].synchronize()
    return [np.array([cp.cuda.get_elapsed_time(a, b) / 1e3 for a, b in ev]) for ev in events]


def copy_bandwidth(nbytes: int = 1 << 31, *, repeat: int = 20) -> dict[str, float]:
    """Device-to-device copy bandwidth of the current GPU: (bytes read + written) / median time.

    Parameters
    ----------
    nbytes
        Size of the buffer copied (far larger than the L2 cache).
    """
    from mlemlib.backends import _cuda_kernels as ck

    cp = ck.cupy()
    count = nbytes // 4
    src = cp.arange(count, dtype=cp.float32)
    dst = cp.empty_like(src)
    t = time_gpu(lambda: cp.copyto(dst, src), repeat=repeat, warmup=3)
    ok = bool(cp.array_equal(dst[-1024:], src[-1024:]))
    med = float(np.median(t))
    return {"bytes": 2 * count * 4, "median_s": med, "bandwidth": 2 * count * 4 / med, "checked": ok}


#: Buffer and repeats of the copy bandwidth recorded with every GPU run (cheap: well under a second per GPU).
RUN_COPY_BYTES = 256 << 20
RUN_COPY_REPEAT = 5


def record_copy_bandwidths(gpus: Sequence[dict[str, Any]], *, nbytes: int = RUN_COPY_BYTES,
                           repeat: int = RUN_COPY_REPEAT) -> None:
    """Measure :func:`copy_bandwidth` on each GPU and store it in its dict under ``copy_bandwidth``.

    ``gpus`` are the device dicts of a backend's ``describe()``
    (:func:`mlemlib.devices.backend_gpus`, each with ``index``), changed in
    place, so the figure lands in ``timings.json`` beside the GPU's other
    facts. A failure (too little free memory) is recorded as
    ``{"error": ...}`` and logged; it never stops the run. The pool's unused
    blocks are freed afterwards.
    """
    from mlemlib.backends import _cuda_kernels as ck

    cp = ck.cupy()
    for g in gpus:
        try:
            with cp.cuda.Device(int(g["index"])):
                g["copy_bandwidth"] = copy_bandwidth(nbytes, repeat=repeat)
                cp.get_default_memory_pool().free_all_blocks()
        except Exception as exc:  # noqa: BLE001 - out of memory, a CUDA error: the run goes on without it
            log.warning("GPU %s: copy bandwidth not measured: %s", g.get("index"), exc)
            g["copy_bandwidth"] = {"error": str(exc)}
        else:
            log.info("GPU %s: copy bandwidth %.1f GB/s (median of %d copies of %d MiB)", g["index"],
                     g["copy_bandwidth"]["bandwidth"] / 1e9, repeat, nbytes >> 20)


# --------------------------------------------------------------------------- the benchmark
def _rel_errors(y: Any, ref: Any, absref: Any, lengths: Any) -> dict[str, float]:
    """Relative L2 error and the worst error in units of the float32 summation bound."""
    from mlemlib.backends import _cuda_kernels as ck

    cp = ck.cupy()
    y64 = y.astype(cp.float64)
    diff = cp.abs(y64 - ref)
    nref = float(cp.linalg.norm(ref))
    rel = float(cp.linalg.norm(y64 - ref)) / nref if nref else float(cp.linalg.norm(y64))
    bound = (lengths.astype(cp.float64) + 2.0) * EPS32 * absref
    with np.errstate(divide="ignore", invalid="ignore"):
        units = diff / cp.where(bound > 0, bound, 1.0)
    return {
        "rel_l2": rel,
        "worst_of_bound": float(units.max()) if units.size else 0.0,
        "nan": int(cp.isnan(y).sum()),
    }


def _load(matrix: Any, what: str) -> tuple[Any, str]:
    """``matrix`` (path, opened matrix, CSRMatrix or device CSR) on the current GPU as CSR, and its own format.

    The kernels timed here read CSR: a compressed container is decoded row block by row block as it is
    streamed to the GPU (its own format's iterations are then added: :func:`bench_spmv`'s ``formats``).
    """
    from mlemlib.backends._cuda_kernels import DeviceCSR, load_device
    from mlemlib.backends.device_formats import DeviceMatrix, format_of
    from mlemlib.formats import open_source

    if isinstance(matrix, DeviceMatrix):
        if not isinstance(matrix, DeviceCSR):
            raise ConfigError(what, f"the benchmark's kernels read CSR: give the file or a device CSR matrix, "
                                    f"not a {type(matrix).__name__}")
        return matrix, "csr"
    src = open_source(matrix, what)
    return load_device(src, what), format_of(src)


def bench_spmv(
    matrix: Any,
    transpose: Any | None = None,
    *,
    repeat: int = 50,
    warmup: int = 5,
    fp_kernels: Sequence[str] = FP_BENCH,
    bp_kernels: Sequence[str] = BP_BENCH,
    notrans_kernels: Sequence[str] = NOTRANS_BENCH,
    iterations: Sequence[tuple[str, str]] = ITERATION_BENCH,
    formats: Sequence[str] = ("csr",),
    secsizes: Sequence[int] = (plan.DEFAULT_SECSIZE,),
    lanes: Sequence[int] | None = None,
    check: bool = True,
    copy_bytes: int = 1 << 31,
    device: int = 0,
    matrix_label: str | None = None,
    out_json: str | os.PathLike | None = None,
    out_md: str | os.PathLike | None = None,
    out_csv: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Time every SpMV kernel and MLEM iteration on one matrix; see the module docstring.

    Parameters
    ----------
    matrix
        ``A``: a path (``.h5``, ``.csr4``...), an opened matrix, a
        :class:`CSRMatrix` or a ``DeviceCSR``. A compressed container is
        decoded to CSR for the kernels (they read CSR).
    transpose
        ``A^T`` in the same forms; None: transposed on the GPU with cuSPARSE.
    repeat, warmup
        Timed and untimed runs per kernel (the median of the timed ones is reported).
    fp_kernels, bp_kernels, notrans_kernels
        Kernels of the forward projection, of the back projection on the
        stored transpose, and without it.
    iterations
        ``(fp, bp)`` pairs timed as whole MLEM iterations (empty: none).
    formats
        Matrix formats the iterations run in (a compressed ``matrix`` adds
        its own): ``csr`` (``iterations``) and
        ``compressed`` / ``compressed-f16`` / ``compressed-u16`` (``A`` and ``A^T`` re-encoded on
        the host, :data:`FORMAT_ITERATION_BENCH`). Every iteration row gives
        its format, bytes per non-zero, its own floor (the bytes of the
        matrices it reads: ``A`` once for a one pass, ``A`` and ``A^T`` for a
        pair, ``A`` twice without a transpose) and the CSR pair's floor, and
        the relative L2 distance of its image to that of the float32 CSR pair
        (``csr_vector``) after the same ``warmup + repeat`` iterations.
    secsizes
        Section sizes of ``merge`` (one row each).
    lanes
        Extra lane counts of ``csr_vector`` to time besides the automatic one.
    check
        Compare every output with a float64 product (cuSPARSE on a float64
        copy of the values: 8 more bytes per non-zero of GPU memory).
    copy_bytes
        Buffer size of the copy-bandwidth measurement.
    matrix_label
        Name of the matrix in the report (default: the path or "in-memory").
    out_json, out_md, out_csv
        Where to write the report (atomically); None: not written.

    Returns
    -------
    dict
        ``device``, ``copy``, ``matrix``, ``kernels`` (one row per kernel and
        operation), ``iterations``, ``date``, ``repeat``.
    """
    from mlemlib.backends import _cuda_kernels as ck
    from mlemlib.backends import cuda as cuda_backend
    from mlemlib.backends.cuda import CudaBackend
    from mlemlib.devices import EnergyMeter, capped_between, device_facts

    cp = ck.cupy()
    if repeat < 1 or warmup < 0:
        raise ConfigError("repeat", f"repeat must be >= 1 and warmup >= 0, got {repeat}, {warmup}")
    formats = check_formats(formats)
    label = matrix_label or (os.fspath(matrix) if isinstance(matrix, (str, os.PathLike)) else "in-memory")
    with cp.cuda.Device(device), EnergyMeter([device]) as meter:
        facts = device_facts(device)
        caps0, t_run = meter.capped(), time.perf_counter()
        copy = copy_bandwidth(copy_bytes)
        bw = copy["bandwidth"]
        log.info("copy bandwidth %.3f TB/s", bw / 1e12)
        t0 = time.perf_counter()
        a, own = _load(matrix, "matrix")
        at = _load(transpose, "transpose")[0] if transpose is not None else a.transpose()
        if own not in formats:  # a compressed container: its own format's iterations too
            formats = (*formats, own)
        m, n = a.shape
        nnz = a.nnz
        st = a.stats()
        st_t = at.stats()
        log.info("matrices on the GPU in %.1f s: %d x %d, %d nnz", time.perf_counter() - t0, m, n, nnz)
        rng = np.random.default_rng()
        x = cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
        c = cp.asarray(rng.uniform(0.5, 1.5, m).astype(np.float32))
        lengths_a = cp.diff(a.indptr)
        lengths_t = cp.diff(at.indptr)
        refs: dict[str, Any] = {}
        if check:
            a64 = a.cusparse().astype(cp.float64) if nnz else None
            x64 = x.astype(cp.float64)
            c64 = c.astype(cp.float64)
            if nnz:
                ref_fp = a64 @ x64
                refs["fp"] = (ref_fp, ref_fp)  # values and x non-negative: |A||x| = A x
                ref_bp = a64.T @ c64
                refs["bp"] = refs["bp_notrans"] = (ref_bp, ref_bp)
            else:
                refs["fp"] = (cp.zeros(m), cp.zeros(m))
                refs["bp"] = refs["bp_notrans"] = (cp.zeros(n), cp.zeros(n))
            del a64

        rows: list[dict[str, Any]] = []
        smem = ck.smem_plan(a) if "scatter_smem" in notrans_kernels else None

        # The kernels of one operation are timed in turn (call k of each before call k + 1 of any):
        # a drift of the clocks over the seconds of a benchmark then hits them all alike
        # (docs/benchmarks.md section 70). run() queues a kernel, flush() times the queue.
        pending: list[tuple] = []
        picked_shape: dict[str, str] = {}

        def run(op: str, kernel: str, fn, nbytes: int, extra: dict | None = None) -> None:
            pending.append((op, kernel, fn, nbytes, extra))

        def flush() -> None:
            if not pending:
                return
            fns = [p[2] for p in pending]
            # two rounds, the second in the reverse order: what a kernel leaves in L2 for the next one
            # then favours no candidate (benchmarks.md section 84)
            rounds = [time_gpu_interleaved(fns, repeat=repeat, warmup=warmup),
                      time_gpu_interleaved(fns[::-1], repeat=repeat, warmup=0)[::-1]]
            for (op, kernel, fn, nbytes, extra), t0, t1 in zip(pending, *rounds):
                rounds_s = [float(np.median(t0)), float(np.median(t1))]
                record(op, kernel, fn, np.concatenate([t0, t1]), nbytes, {**(extra or {}), "rounds_s": rounds_s})
            pending.clear()
            for r in rows:  # the layout and launch shape a backend picks, among those timed
                if r["kernel"] == "csr_vector" and r.get("lanes_auto") and r["op"] in picked_shape:
                    r["auto"] = (r.get("shape"), r.get("layout", 0)) == picked_shape[r["op"]]

        def record(op: str, kernel: str, fn, t: np.ndarray, nbytes: int, extra: dict | None = None) -> None:
            """One row of the table from the times ``t`` of ``fn`` (checked once more against the reference)."""
            med = float(np.median(t))
            row = {
                "op": op,
                "kernel": kernel,
                "deterministic": deterministic(op, kernel),
                "median_s": med,
                "min_s": float(t.min()),
                "max_s": float(t.max()),
                "bytes": int(nbytes),
                "bandwidth": nbytes / med,
                "of_copy": nbytes / med / bw,
                **(extra or {}),
            }
            if check:
                # poison the output and run once more for the check (cuSPARSE allocates a fresh one)
                y = fn()
                if kernel not in ("cusparse", "cusparse_notrans"):
                    y.fill(cp.nan)
                    y = fn()
                ref, absref = refs[op]
                # a row of A bounds the error of A x; a column of A (a row of A^T) that of A^T c
                row.update(_rel_errors(y, ref, absref, lengths_a if op == "fp" else lengths_t))
            rows.append(row)
            log.info(
                "%-10s %-16s %8.3f ms %7.3f TB/s %5.1f%% of copy",
                op,
                kernel,
                med * 1e3,
                nbytes / med / 1e12,
                100 * nbytes / med / bw,
            )

        fp_bytes = plan.spmv_bytes(m, n, nnz)
        bp_bytes = plan.spmv_bytes(n, m, nnz)
        nt_bytes = plan.spmv_bytes(m, n, nnz)  # reads A, c; writes the n-vector
        y_m = cp.empty(m, dtype=cp.float32)
        y_n = cp.empty(n, dtype=cp.float32)
        lanes_a, lanes_t = a.lanes(), ck.transpose_lanes(at)
        interleave = cuda_backend.INTERLEAVE

        def run_spmv(op: str, k: str, mat, vec, out, nbytes: int, lanes_auto: int) -> None:
            """Time the SpMV kernel ``k`` (each section size or lane count it takes)."""
            if k == "merge":
                for s in secsizes:
                    run(op, k, lambda s=s: ck.spmv(mat, vec, out, kernel="merge", secsize=s), nbytes, {"secsize": s})
            elif k == "csr_vector":
                for L in [lanes_auto] + [v for v in (lanes or ()) if v != lanes_auto]:
                    run(
                        op,
                        k,
                        lambda L=L: ck.spmv(mat, vec, out, kernel="csr_vector", lanes=L, shape=plan.RowShape()),
                        nbytes,
                        {"lanes": L, "lanes_auto": L == lanes_auto, "shape": plan.RowShape().label()},
                    )
                # the launch shapes a backend tunes over, and the one its tuning picks on this matrix
                picked_shape[op] = (mat.tune(lanes_auto).label(), 0)
                for sh in plan.SHAPE_CANDIDATES[1:]:
                    if lanes_auto not in plan.BLOCK_LANES:
                        break
                    run(
                        op,
                        k,
                        lambda sh=sh: ck.spmv(mat, vec, out, kernel="csr_vector", lanes=lanes_auto, shape=sh),
                        nbytes,
                        {"lanes": lanes_auto, "lanes_auto": True, "shape": sh.label()},
                    )
                # every shape again on a copy in the layout a backend gives the matrix (DeviceCSR.set_layout)
                layout = plan.row_layouts("csr_vector", "csr_vector", True, lanes_auto, lanes_auto, interleave)[0]
                if layout:
                    try:
                        il = ck.DeviceCSR(mat.indptr, mat.indices.copy(), mat.data.copy(), mat.shape,
                                          layout=mat.layout)
                    except cp.cuda.memory.OutOfMemoryError:
                        log.warning("%s: no memory for a copy in the interleaved layout; column order only", op)
                        return
                    il.set_layout(layout)
                    picked_shape[op] = (il.tune(lanes_auto).label(), layout)
                    for sh in plan.SHAPE_CANDIDATES:  # a layout is only given to block-shape lane counts
                        run(
                            op,
                            k,
                            lambda sh=sh: ck.spmv(il, vec, out, kernel="csr_vector", lanes=lanes_auto, shape=sh),
                            nbytes,
                            {"lanes": lanes_auto, "lanes_auto": True, "shape": sh.label(), "layout": layout},
                        )
            else:
                run(op, k, lambda: ck.spmv(mat, vec, out, kernel=k), nbytes)

        for k in fp_kernels:
            if k == "cusparse":
                if nnz:
                    a.cusparse()
                    run("fp", k, lambda: a.cusparse() @ x, plan.spmv_bytes(m, n, nnz, 4))
            else:
                run_spmv("fp", k, a, x, y_m, fp_bytes, lanes_a)
        flush()
        if "cusparse_notrans" not in notrans_kernels:
            a.drop_cusparse()
        for k in bp_kernels:
            if k == "cusparse":
                if nnz:
                    at.cusparse()
                    run("bp", k, lambda: at.cusparse() @ c, plan.spmv_bytes(n, m, nnz, 4))
            else:
                run_spmv("bp", k, at, c, y_n, bp_bytes, lanes_t)
        flush()
        at.drop_cusparse()
        for k in notrans_kernels:
            if k == "cusparse_notrans":
                if nnz:
                    a.cusparse()
                    run("bp_notrans", k, lambda: a.cusparse().T @ c, plan.spmv_bytes(m, n, nnz, 4))
            elif k == "scatter_smem":
                run(
                    "bp_notrans",
                    k,
                    lambda: ck.scatter(a, c, y_n, kernel="scatter_smem", smem=smem),
                    nt_bytes,
                    {"local_chunks": smem.local_fraction if smem else None},
                )
            else:
                run("bp_notrans", k, lambda k=k: ck.scatter(a, c, y_n, kernel=k), nt_bytes, {"lanes": lanes_a})
        flush()
        a.drop_cusparse()

        # cuSPARSE ratios, per operation
        base = {}
        for r in rows:
            if r["kernel"] in ("cusparse", "cusparse_notrans"):
                base[r["op"]] = r["median_s"]
        for r in rows:
            ref_t = base.get(r["op"])
            r["vs_cusparse"] = (ref_t / r["median_s"]) if ref_t else None

        # whole iterations, in each format
        its: list[dict[str, Any]] = []
        if iterations and nnz:
            f_true = cp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
            g = (a.cusparse() @ f_true).get()
            a.drop_cusparse()
            norm = (at.cusparse() @ cp.ones(m, dtype=cp.float32)).get().astype(np.float64)
            at.drop_cusparse()
            csr_floor_s = plan.iteration_floor_bytes(m, n, nnz) / bw
            images: dict[int, np.ndarray] = {}
            host: dict[str, Any] = {}  # A and A^T copied to the host once for every compressed format
            for fmt in formats:
                for fp_k, bp_k, mat, tr in _format_iterations(fmt, a, at, iterations, host):
                    row, img = _time_iteration(CudaBackend, fmt, fp_k, bp_k, mat, tr, g, norm, device,
                                               warmup, repeat, bw, csr_floor_s, meter)
                    its.append(row)
                    if img is not None:
                        images[len(its) - 1] = img
                cp.get_default_memory_pool().free_all_blocks()
            ref = next((images.get(i) for i, r in enumerate(its)
                        if (r.get("format"), r.get("fp_requested"), r.get("bp_requested")) == REFERENCE_ITERATION),
                       None)
            for i, r in enumerate(its):
                img = images.get(i)
                if ref is not None and img is not None:
                    r["rel_l2_to_csr"] = float(np.linalg.norm(img - ref) / (np.linalg.norm(ref) or 1.0))
        cp.cuda.Device().synchronize()
        capped = {"run_s": time.perf_counter() - t_run, "capped_s": capped_between(caps0, meter.capped()),
                  "note": "NVML clock-capping counters" if meter.caps_available else meter.note or "not available"}

    result = {
        "date": _dt.date.today().isoformat(),
        "device": facts,
        "copy": copy,
        "repeat": repeat,
        "warmup": warmup,
        "matrix": {
            "label": label,
            "format": own,
            "shape": [m, n],
            "nnz": nnz,
            "bytes": plan.csr_bytes(m, nnz),
            "mean_row_length": st["mean_row_length"],
            "max_row_length": st["max_row_length"],
            "empty_rows": st["empty_rows"],
            "mean_col_length": st_t["mean_row_length"],
            "max_col_length": st_t["max_row_length"],
            "empty_cols": st_t["empty_rows"],
            "lanes_fp": lanes_a,
            "lanes_bp": lanes_t,
        },
        "kernels": rows,
        "iterations": its,
        "clocks": capped,
    }
    write_results(result, out_json=out_json, out_md=out_md, out_csv=out_csv)
    return result


def check_formats(formats: Sequence[str]) -> tuple[str, ...]:
    """``formats`` as a tuple without repeats, each a matrix format (:class:`ConfigError` otherwise)."""
    from mlemlib.formats import MATRIX_FORMATS

    out = tuple(dict.fromkeys(str(f) for f in formats))
    bad = [f for f in out if f not in MATRIX_FORMATS]
    if bad or not out:
        raise ConfigError("formats", f"expected some of {', '.join(MATRIX_FORMATS)}, got {', '.join(formats) or 'none'}")
    return out


def _format_iterations(fmt: str, a: Any, at: Any, iterations: Sequence[tuple[str, str]], host: dict | None = None):
    """``(fp, bp, A source, A^T or None)`` of the iterations timed in format ``fmt`` (a generator: a compressed
    format is encoded from the device CSR ``a``, ``at`` when the first of them runs; ``host`` keeps their host
    copies, ``"a"`` and ``"at"``, for the next format)."""
    if fmt == "csr":
        for fp_k, bp_k in iterations:
            yield fp_k, bp_k, a, at if registry.uses_transpose("cuda", bp_k) else None
        return
    from mlemlib.backends._compressed_cuda import DeviceCompressed
    from mlemlib.compressed import CompressedMatrix

    t0 = time.perf_counter()
    host = {} if host is None else host
    if not host:
        host.update(a=a.to_host(), at=at.to_host())
    host_a = CompressedMatrix.from_csr(host["a"], fmt, validate=False)
    host_at = CompressedMatrix.from_csr(host["at"], fmt, validate=False)
    dev_a, dev_at = DeviceCompressed.from_host(host_a), DeviceCompressed.from_host(host_at)
    log.info("%s: A and A^T encoded (%.3f / %.3f bytes per non-zero) and on the GPU in %.1f s", fmt,
             host_a.bytes_per_nnz, host_at.bytes_per_nnz, time.perf_counter() - t0)
    for fp_k, bp_k in FORMAT_ITERATION_BENCH:
        # auto and onepass_chunked take the host matrix: the chunked layout is built from its decoded rows
        source = host_a if bp_k in ("auto", "onepass_chunked") else dev_a
        yield fp_k, bp_k, source, dev_at if registry.uses_transpose("cuda", bp_k) else None


def _time_iteration(backend: Any, fmt: str, fp_k: str, bp_k: str, mat: Any, tr: Any, g: np.ndarray,
                    norm: np.ndarray, device: int, warmup: int, repeat: int, bw: float,
                    csr_floor_s: float, meter: Any = None) -> tuple[dict[str, Any], np.ndarray | None]:
    """One iteration row of :func:`bench_spmv` (and the final image, float64 on the host; None if not run);
    ``meter`` (an :class:`~mlemlib.devices.EnergyMeter`) gives the seconds the clocks were held down meanwhile."""
    from mlemlib.backends.base import bytes_per_nnz, timed_iterations
    from mlemlib.devices import capped_between

    try:
        be = backend(mat, g, norm, tr, fp=fp_k, bp=bp_k, device=device)
    except ConfigError as exc:  # e.g. onepass_chunked on a row longer than its window
        log.warning("iteration %s + %s (%s) not timed: %s", fp_k, bp_k, fmt, exc)
        return {"format": fmt, "fp_requested": fp_k, "bp_requested": bp_k, "error": str(exc)}, None
    t = []
    f = be.initial_image()
    caps0 = meter.capped() if meter is not None else None
    for _, f, ready in timed_iterations(be, f, 1, warmup + repeat):  # as mlem.reconstruct runs them
        t += [times["iteration"] for k, times in ready if k > warmup]
    capped = capped_between(caps0, meter.capped()) if caps0 is not None else None
    med = float(np.median(t))
    # its own floor: the bytes of the matrices one iteration reads (A once in one pass, A twice without A^T)
    nbytes = int(be.a.nbytes) * (1 if be.onepass or be.at is not None else 2)
    nbytes += int(be.at.nbytes) if be.at is not None else 0
    floor_s = nbytes / bw
    row = {
        "format": fmt,
        "fp_requested": fp_k,
        "fp": be.fp_kernel,
        "bp": be.bp_kernel,
        "bp_requested": bp_k,
        "deterministic": be.deterministic,
        "fused": be.describe()["fused"],
        "bytes_per_nnz": bytes_per_nnz(be.a),
        "median_s": med,
        "min_s": float(min(t)),
        "floor_bytes": nbytes,
        "floor_s": floor_s,
        "of_floor": floor_s / med,
        "csr_floor_s": csr_floor_s,
        "of_csr_floor": csr_floor_s / med,
        "clock_capped_s": capped,
    }
    img = np.asarray(be.to_host(f), dtype=np.float64)
    row["finite"] = bool(np.isfinite(img).all())
    log.info("iteration %s + %s (%s, %s): %.3f ms, %.1f%% of its floor %.3f ms, %.1f%% of the CSR floor", fp_k,
             be.bp_kernel, bp_k, fmt, med * 1e3, 100 * floor_s / med, floor_s * 1e3, 100 * csr_floor_s / med)
    del be
    return row, img


# --------------------------------------------------------------------------- reports
OP_TITLES = {"fp": "forward A x", "bp": "back A^T c (stored transpose)", "bp_notrans": "back A^T c (no transpose)"}


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def auto_vs_fastest(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per operation: the configuration ``auto`` runs (kernel, lanes, tuned shape) beside the fastest timed one."""
    out = []
    for op in ("fp", "bp"):
        rows = [r for r in result["kernels"] if r["op"] == op]
        picked = [r for r in rows if r.get("auto")]
        if not rows or not picked:
            continue
        fastest = min(rows, key=lambda r: r["median_s"])
        fastest_det = min((r for r in rows if r["deterministic"]), key=lambda r: r["median_s"], default=fastest)
        a = picked[0]
        out.append({
            "op": op, "auto": kernel_label(a), "auto_s": a["median_s"], "fastest": kernel_label(fastest),
            "fastest_s": fastest["median_s"], "fastest_deterministic": kernel_label(fastest_det),
            "fastest_deterministic_s": fastest_det["median_s"], "slower_by": a["median_s"] / fastest["median_s"] - 1,
        })
    return out


def kernel_label(row: dict[str, Any]) -> str:
    """``csr_vector (32 lanes)``, ``merge (secsize 5)``... for tables."""
    k = row["kernel"]
    if row.get("secsize") is not None:
        return f"{k} (secsize {row['secsize']})"
    if row.get("lanes") is not None and k == "csr_vector":
        shape = row.get("shape")
        shape = f", {shape}" if shape and shape != "256t" else ""
        shape += ", interleaved" if row.get("layout") else ""
        return f"{k} ({row['lanes']} lanes{'' if row.get('lanes_auto', True) else ', forced'}{shape})"
    return k


def auto_versus_fastest(iterations: Sequence[dict[str, Any]]) -> str:
    """What ``auto`` + ``auto`` ran and its time beside the fastest iteration in the same format of the same run.

    One sentence per format with an ``auto`` + ``auto`` row (the CSR one without a format prefix); "" without one.
    """
    done = [r for r in iterations if "error" not in r]
    lines = []
    for fmt in dict.fromkeys(r.get("format", "csr") for r in done):
        same = [r for r in done if r.get("format", "csr") == fmt]
        auto = next((r for r in same if r.get("fp_requested") == "auto" and r.get("bp_requested") == "auto"), None)
        if auto is None:
            continue
        best = min(same, key=lambda r: r["median_s"])
        best_det = min((r for r in same if r["deterministic"]), key=lambda r: r["median_s"], default=None)
        where = "" if fmt == "csr" else f"{fmt}: "
        text = (f"{where}auto ran {auto['fp']} + {auto['bp']}: {auto['median_s'] * 1e3:.3f} ms; the fastest "
                f"iteration of this run{'' if fmt == 'csr' else ' in ' + fmt} is {best['fp']} + {best['bp']}: "
                f"{best['median_s'] * 1e3:.3f} ms (auto takes {auto['median_s'] / best['median_s']:.2f}x its time)")
        if best_det is not None and best_det is not best:
            text += (f"; the fastest deterministic one is {best_det['fp']} + {best_det['bp']}: "
                     f"{best_det['median_s'] * 1e3:.3f} ms")
        lines.append(text + ".")
    return "\n\n".join(lines)


def format_markdown(result: dict[str, Any]) -> str:
    """The benchmark report as Markdown (device, matrix, one table per operation, iterations)."""
    d, mtx, cp_ = result["device"], result["matrix"], result["copy"]
    lines = [
        f"## SpMV benchmark: {mtx['label']}",
        "",
        f"- date: {result['date']}; device: {d.get('name', '?')}"
        + (f" (theoretical {d['theoretical_bandwidth'] / 1e12:.2f} TB/s)" if d.get("theoretical_bandwidth") else ""),
        f"- measured copy bandwidth (read + write): {cp_['bandwidth'] / 1e12:.3f} TB/s",
        (
            f"- matrix: {mtx['shape'][0]} x {mtx['shape'][1]}, {mtx['nnz']} nnz ({mtx['bytes'] / 1e9:.2f} GB as CSR"
            + (f"; the file is {mtx['format']}, decoded for the kernels" if mtx.get("format", "csr") != "csr" else "")
            + "), "
            f"row length mean {mtx['mean_row_length']:.1f} max {mtx['max_row_length']}, "
            f"{mtx['empty_rows']} empty rows, {mtx['empty_cols']} empty columns"
        ),
        (
            f"- kernels: median of 2 x {result['repeat']} runs after {result['warmup']} warm-up runs (CUDA "
            "events), each operation's kernels in turn, in two rounds (the second in the reverse order; both "
            f"rounds' medians shown); iterations: median of {result['repeat']}; "
            "bandwidth = (8 B per nnz + row pointer + vectors) / time; 'vs cuSPARSE' = cuSPARSE time / kernel time"
        ),
        "",
    ]
    clocks = result.get("clocks")
    if clocks:
        lines[-1:-1] = [clock_line(clocks)]
    for op in ("fp", "bp", "bp_notrans"):
        rows = [r for r in result["kernels"] if r["op"] == op]
        if not rows:
            continue
        lines += [
            f"### {OP_TITLES[op]}",
            "",
            "| kernel | deterministic | median ms | rounds ms | TB/s | of copy bw | vs cuSPARSE | rel. L2 error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            rounds = " / ".join(f"{t * 1e3:.3f}" for t in r.get("rounds_s", ()))
            lines.append(
                f"| {kernel_label(r)} | {'yes' if r['deterministic'] else 'no'} | {r['median_s'] * 1e3:.3f} | "
                f"{rounds or '-'} | "
                f"{r['bandwidth'] / 1e12:.3f} | {_fmt(r['of_copy'], '.1%')} | {_fmt(r.get('vs_cusparse'), '.2f')} | "
                f"{_fmt(r.get('rel_l2'), '.1e')} |"
            )
        lines.append("")
    choice = auto_vs_fastest(result)
    if choice:
        lines += [
            "### what auto picks, beside the fastest",
            "",
            "| operation | auto runs | ms | fastest | ms | auto slower by | fastest deterministic | ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in choice:
            lines.append(
                f"| {OP_TITLES[c['op']]} | {c['auto']} | {c['auto_s'] * 1e3:.3f} | {c['fastest']} | "
                f"{c['fastest_s'] * 1e3:.3f} | {c['slower_by']:.1%} | {c['fastest_deterministic']} | "
                f"{c['fastest_deterministic_s'] * 1e3:.3f} |"
            )
        lines.append("")
    if result.get("iterations"):
        lines += [
            "### one MLEM iteration",
            "",
            "| format | bytes/nnz | fp | bp | deterministic | fused | median ms | its floor ms | of its floor | "
            "of the CSR floor | rel. L2 to the CSR image | clocks capped s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in result["iterations"]:
            fmt = r.get("format", "csr")
            if "error" in r:
                lines.append(f"| {fmt} | | {r['fp_requested']} | {r['bp_requested']} | not run: {r['error']} "
                             "| | | | | | | |")
                continue
            bp = r["bp"] if r.get("bp_requested", r["bp"]) == r["bp"] else f"{r['bp']} ({r['bp_requested']})"
            lines.append(
                f"| {fmt} | {_fmt(r.get('bytes_per_nnz'), '.2f')} | {r['fp']} | {bp} | "
                f"{'yes' if r['deterministic'] else 'no'} | {', '.join(r['fused']) or '-'} | "
                f"{r['median_s'] * 1e3:.3f} | {r['floor_s'] * 1e3:.3f} | {_fmt(r['of_floor'], '.1%')} | "
                f"{_fmt(r.get('of_csr_floor'), '.1%')} | {_fmt(r.get('rel_l2_to_csr'), '.1e')} | "
                f"{_capped_cell(r.get('clock_capped_s'))} |"
            )
        lines += [
            "",
            f"Its floor: the bytes of the matrices one iteration reads (A once for a one pass, A and A^T for a "
            f"pair, A twice without A^T) at the copy bandwidth; the CSR floor: A and A^T as CSR. Images compared "
            f"after {result['warmup'] + result['repeat']} iterations from the same start with the float32 CSR "
            f"pair's (csr_vector).",
            "",
        ]
        pick = auto_versus_fastest(result["iterations"])
        if pick:
            lines += [pick, ""]
    return "\n".join(lines)


CSV_FIELDS = (
    "op",
    "kernel",
    "lanes",
    "secsize",
    "deterministic",
    "median_s",
    "min_s",
    "bytes",
    "bandwidth",
    "of_copy",
    "vs_cusparse",
    "rel_l2",
)


def _capped_cell(capped: dict[str, float] | None) -> str:
    """Seconds of clock capping (power + thermal) for a table cell; '-' where not measured."""
    return "-" if not capped else f"{sum(capped.values()):.2f}"


def clock_line(clocks: dict[str, Any]) -> str:
    """The report's line on the GPU's clocks during the run: how long its power limit or heat held them down."""
    capped = clocks.get("capped_s")
    if not capped:
        return f"- clock capping during the run: not measured ({clocks.get('note') or 'no NVML counters'})"
    held = sum(capped.values())
    text = (f"- clock capping during the run (NVML): held down by the power limit {capped['power']:.2f} s, "
            f"by heat {capped['thermal']:.2f} s, of {clocks['run_s']:.1f} s")
    if held > 0:
        text += ("; a capped GPU lowers its SM clock, which slows the kernels whose gathers and atomics run "
                 "in L1 and L2 more than the copy that sets the floors (docs/benchmarks.md section 84)")
    return text


def format_csv(result: dict[str, Any]) -> str:
    """One CSV row per kernel and operation (the workflow's ``spmv.csv``)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in result["kernels"]:
        w.writerow({k: r.get(k) for k in CSV_FIELDS})
    return buf.getvalue()


def write_results(result: dict[str, Any], *, out_json=None, out_md=None, out_csv=None) -> None:
    """Write the report files that are asked for, each atomically."""
    for path, text in (
        (out_json, lambda: json.dumps(result, indent=2, default=_json_default) + "\n"),
        (out_md, lambda: format_markdown(result) + "\n"),
        (out_csv, lambda: format_csv(result)),
    ):
        if path is None:
            continue
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            Path(tmp).write_text(text(), encoding="utf-8")


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
